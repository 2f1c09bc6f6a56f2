"""The time model: one optimizer step of a layout on a cluster, built from parts — compute from the
FLOPs each pipeline stage runs per micro-batch at the device's sustained rates (the blocks' linear
layers at the matmul rate, float8's under fp8; attention at flash attention's; each GEMM's operands,
float8's casts and element-wise work at memory bandwidth), tensor-parallel all-reduces on the
critical path, pipeline sends where the schedule cannot hide them, the pipeline schedule's bubble,
data-parallel/ZeRO collectives hop by hop (`traffic`) with what overlapping hides of them, the
optimizer update where offload puts it, offload I/O against host-link and NVMe bandwidth, and CO2's
outer all-reduce amortised over its round.

What overlaps with what, as Strata's trainer runs it: a ZeRO-3 group's gather is prefetched behind
the forward (backward) compute of the groups before it, so only what exceeds that compute shows,
and the step's first gather never hides; per-micro-batch reduce-scatters run behind backward;
with `parallel.overlap_grad_reduce` the step's final reduction starts inside the last micro-batch's
backward (without it, it follows); the rebuild gather after the update and the update itself
are exposed; CO2's outer all-reduce hides behind the next round's steps when `co2.overlap`;
tensor-parallel collectives hide behind nothing. Another framework's published runs are predicted
as it runs them (`strata.plan.engines`): tensor-parallel collectives chunked behind the GEMMs, the
rebuild gather inside the next step's first forward, fused element-wise work, its own selective
recomputation.

On a cluster whose ranks all share one machine's cores (`Cluster.shared_cores`), compute is the
stages' mean and the bubble costs nothing: the machine, not the slowest stage, sets the pace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.config.schema import Config
from strata.config.vocabulary import offload_devices
from strata.model import flops_per_token
from strata.parallel.stages import schedule_name
from strata.parallel.topology import Layout, expert_layout
from strata.plan import traffic
from strata.plan.cluster import LINKS, Cluster
from strata.plan.engines import STRATA, Engine
from strata.plan.memory import (
    FP32,
    TIER_OF,
    activation_bytes,
    flat_groups,
    in_flight,
    layout_of,
    micro_batches,
    zero_levels,
)
from strata.plan.shapes import (
    Group,
    attention_flops,
    backward_flops,
    block_saved,
    chunk_counts,
    gemm_operands,
    head_flops,
    layer_flops,
    parts_of,
    saved_bytes,
)

ADAM_BYTES = 32  # per element of the optimizer chunk: parameter r/w, gradient r, two moments r/w
# Unfused attention (scores, mask, softmax and dropout as separate kernels, as Megatron-LM ran
# before flash attention) moves each element of the batch·heads·seq² score matrix through memory: in
# 16-bit, forward writes the scores, reads them for the masked softmax and writes its output, and
# dropout reads that and writes its result and a byte mask (13 bytes); backward reads and writes as
# much again twice over. Strata's own attention (SDPA) is fused and keeps no score matrix.
UNFUSED_SCORE_BYTES = {"forward": 13, "backward": 26}
# saved activations written in forward, read in backward, their gradients too
ELEMENTWISE_PASSES = 4
# eager PyTorch runs each element-wise op of a block (norms in float32, rotary embedding, SiLU and
# product, residual adds, casts) as its own kernel, each reading its inputs and writing its output
EAGER_PASSES = 8
# a float8 cast with a tensor-wise scale reads a bf16 tensor for its absolute maximum, then
# again to write it in float8
FP8_CAST_BYTES = 5


@dataclass
class TimeEstimate:
    """Seconds per optimizer step, its parts, and the bytes each rank sends per link level."""

    step_s: float
    parts: dict[str, float]
    link_bytes: dict[str, float]
    dp_bytes: dict[str, float]
    model_flops: float  # per step over the whole cluster, Megatron's counting (no recompute)
    ranks: int
    peak_tflops: float
    notes: list[str] = field(default_factory=list)

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per rank (recomputation not counted)."""
        return self.model_flops / self.step_s / self.ranks / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOP utilization: the model's TFLOP/s per rank over the device's peak."""
        return self.tflops_per_gpu / self.peak_tflops

    def tokens_per_s(self, tokens_per_step: int) -> float:
        """Training throughput for `tokens_per_step` tokens per optimizer step."""
        return tokens_per_step / self.step_s


@dataclass
class _Stage:
    """One pipeline rank's per-micro-batch times."""

    fwd: float
    bwd: float  # backward, with the recomputed forward
    tp: traffic.Traffic  # tensor-parallel all-reduces per micro-batch
    send: float  # one pipeline send of a micro-batch's activations (or their gradients)
    chunks: int  # model chunks this rank runs (V)
    ep: traffic.Traffic = field(default_factory=traffic.Traffic)  # MoE all-to-alls per micro-batch
    # context parallelism's, seconds exposed
    cp: traffic.Traffic = field(default_factory=traffic.Traffic)

    @property
    def micro_batch(self) -> float:
        """Seconds one micro-batch keeps this rank busy: forward, backward, and the tensor-, expert-
        and context-parallel communication they wait on."""
        return self.fwd + self.bwd + self.tp.seconds + self.ep.seconds + self.cp.seconds

    def sends(self, m: int, p: int) -> float:
        """Pipeline sends that show: in the steady state each goes out while the stage computes the
        next micro-batch (activations forward and gradients back use the two directions of the
        link), so only what exceeds that compute shows; in the warm-up and cool-down nothing
        hides them, one per stage boundary each way."""
        if p == 1:
            return 0.0
        steady = m * max(0.0, self.chunks * self.send - self.micro_batch)
        return 2 * (p - 1) * self.send + steady


def bubble_factor(cfg: Config) -> float:
    """Idle micro-batch slots a pipeline schedule adds to the m it runs: p − 1 for GPipe and 1F1B,
    (p − 1)/V interleaved (Megatron), about a third of 1F1B's for the zero-bubble schedules,
    which fill it with split weight-gradient passes."""
    p, v = cfg.parallel.pp, cfg.parallel.virtual_stages
    if p == 1:
        return 0.0
    name = schedule_name(cfg.parallel.schedule, v)
    if name in ("gpipe", "1f1b", "looped_bfs"):
        return p - 1.0
    if name == "interleaved_1f1b":
        return (p - 1.0) / v
    if name == "interleaved_zero_bubble":
        return (p - 1.0) / (3 * v)
    return (p - 1.0) / 6  # zbv_zero_bubble, dualpipev: V-shaped, two chunks per rank


def _compute(
    cfg: Config, cluster: Cluster, indices: list[int], has_head: bool, vocab: int, engine: Engine
) -> tuple[float, float, float]:
    """Seconds of one micro-batch's forward and backward (with any recomputed forward) on a rank
    running the layers `indices` (and the output layer when `has_head`), and the seconds of them
    the blocks' GEMMs take (what chunked tensor-parallel communication can hide behind). Under
    fp8 only the blocks' linear layers run at the float8 rate; attention and the output layer
    stay in bf16."""
    m, par, dev, precision = cfg.model, cfg.parallel, cluster.device, cfg.train.precision
    tp, recompute = par.tp, cfg.activations.recompute
    tokens = cfg.train.micro_batch_size * m.seq_len // par.cp  # a context-parallel rank's share
    attend = len(indices) * attention_flops(m, tp)
    linear = sum(layer_flops(m, tp, i) for i in indices) - attend
    mm_rate = dev.rate_tflops(precision) * 1e12
    rate = dev.rate_tflops("bf16" if precision == "fp8" else precision) * 1e12
    # an unfused attention's batched matmuls run at the matmul rate, a fused kernel at its own
    fused_rate = dev.attention_tflops(precision) * 1e12
    attend_s = tokens * attend / (rate if engine.attention == "unfused" else fused_rate)
    again = 1.0 if recompute == "full" else 0.0  # full recomputation runs the blocks' forward again
    redone = again * linear
    if recompute == "selective":  # what the engine's selective checkpointing recomputes
        redone = sum(engine.recomputed_flops(m, tp, i) for i in indices)
    fwd = tokens * linear / mm_rate + attend_s
    fwd += tokens * head_flops(m, vocab, tp) / rate if has_head else 0.0
    bwd = 2 * fwd + tokens * redone / mm_rate + again * attend_s
    gemm = tokens * (3 * linear + redone) / mm_rate
    if not dev.measured:  # memory traffic at its bandwidth (a measured rate includes it)
        memory = _memory_seconds(cfg, cluster, indices, has_head, vocab, engine)
        fwd += memory["forward"]
        bwd += memory["backward"]
        gemm += memory["gemm"]
    return fwd, bwd, gemm


def _memory_seconds(
    cfg: Config, cluster: Cluster, indices: list[int], has_head: bool, vocab: int, engine: Engine
) -> dict[str, float]:
    """The memory-bound seconds of a micro-batch on a rank (see `_compute`), forward and backward,
    and the share of them in the blocks' GEMMs. Each GEMM reads its operands and writes its result
    once, backward's two per forward one twice: what keeps a small GEMM further below peak than a
    large one. Float8 casts each block GEMM's inputs (read in bf16, written in float8) in every
    pass. Element-wise work moves what backward saves `ELEMENTWISE_PASSES` times fused (compiled,
    or another framework's fused kernels), `EAGER_PASSES` times eagerly; the unfused attention of
    other frameworks moves its score matrix."""
    m, par, dev, recompute = cfg.model, cfg.parallel, cluster.device, cfg.activations.recompute
    tp = par.tp
    tokens = cfg.train.micro_batch_size * m.seq_len // par.cp
    bw = dev.mem_bw_gbs * 1e9
    act = 2 if cfg.train.bf16_compute else 4
    again = 1.0 if recompute == "full" else 0.0
    rows, weights, inputs = 0.0, 0.0, 0.0
    for i in indices:
        r, w, x = gemm_operands(m, tp, par.ep, i)
        rows, weights, inputs = rows + r, weights + w, inputs + x
    operands = act * (tokens * rows + weights) / bw
    if cfg.train.precision == "fp8" and dev.fp8_tflops:
        operands += FP8_CAST_BYTES * (tokens * inputs + weights) / bw
    head = 0.0
    if has_head:
        head = act * (tokens * (m.d_model + vocab / tp) + m.d_model * vocab / tp) / bw
    saved = sum(saved_bytes(block_saved(cfg, i), tokens) for i in indices)
    passes = ELEMENTWISE_PASSES if engine.fused(cfg.train.compile) else EAGER_PASSES
    moved = passes * saved / bw
    out = {
        "forward": operands + head + moved / 3,
        # backward's share, and a recomputed forward's element-wise work again (selective
        # recomputes only that; full's matmuls are counted with them)
        "backward": 2 * (operands + head)
        + again * operands
        + 2 * moved / 3
        + (moved / 3 if recompute != "none" else 0.0),
        "gemm": (3 + again) * operands,
    }
    if engine.attention == "unfused":
        scores = cfg.train.micro_batch_size * m.n_heads / tp * m.seq_len**2 * len(indices) / bw
        out["forward"] += scores * UNFUSED_SCORE_BYTES["forward"]
        out["backward"] += scores * (
            UNFUSED_SCORE_BYTES["backward"] + again * UNFUSED_SCORE_BYTES["forward"]
        )
    return out


def _stage_time(
    cfg: Config, cluster: Cluster, layout: Layout, vocab: int, pp_rank: int, engine: Engine
) -> _Stage:
    m, par = cfg.model, cfg.parallel
    tp = par.tp
    tokens = cfg.train.micro_batch_size * m.seq_len // par.cp  # a context-parallel rank's share
    parts = parts_of(cfg, pp_rank)
    indices = [p.first_layer + i for p in parts for i in range(p.n_layers)]
    layers = len(indices)
    has_head = any(p.last for p in parts)
    fwd, bwd, gemm = _compute(cfg, cluster, indices, has_head, vocab, engine)
    recompute = cfg.activations.recompute
    act = 2 if cfg.train.bf16_compute else 4
    hidden = tokens * m.d_model * act
    # per layer two all-reduces forward and two backward (sequence parallel: all-gather plus
    # reduce-scatter, the same bytes), the recomputed forward's again (selective recomputation
    # repeats them too: a collective is never kept); the embedding's and the output layer's input
    # gradient once each
    reductions = layers * (4 + (2 if recompute != "none" else 0))
    reductions += sum(1 for p in parts if p.first) + (1 if has_head else 0)
    tp_traffic = traffic.dim_all_reduce(cluster, layout, "tp", hidden).scaled(reductions)
    if engine.tp_comm_overlap and tp > 1:
        # each collective in tp chunks, all but the first behind the GEMM it feeds or drains
        whole = tp_traffic.seconds
        tp_traffic.seconds = whole / tp + max(0.0, whole * (tp - 1) / tp - gemm)
    send = 0.0
    if par.pp > 1:
        local_seq = m.seq_len // par.cp // (tp if par.sequence_parallel and tp > 1 else 1)
        send = traffic.pipeline_send(
            cluster, layout, cfg.train.micro_batch_size * local_seq * m.d_model * 4
        ).seconds
    ep = _expert_traffic(cfg, cluster, layout, indices)
    attention_rate = cluster.device.attention_tflops(cfg.train.precision) * 1e12
    attend_s = tokens * attention_flops(m, tp) / attention_rate  # a layer's attention forward
    cp = _context_traffic(cfg, cluster, layout, layers, tokens, attend_s)
    return _Stage(fwd, bwd, tp_traffic, send, len(parts), ep, cp)


def _context_traffic(
    cfg: Config, cluster: Cluster, layout: Layout, layers: int, tokens: int, attention: float
) -> traffic.Traffic:
    """Context parallelism's exchanges per micro-batch of a rank's `tokens` over `layers` layers (and
    again when the forward is recomputed), their bytes and the seconds they leave exposed. The
    all-to-all: q, k, v in and the output back, forward and backward, nothing hidden. The ring: K/V blocks passed cp − 1
    times forward and backward and their float32 gradients cp times, each passed while a block of
    the layer's `attention` (forward seconds; backward twice that) computes, so only what outlasts
    the block is exposed."""
    m, par = cfg.model, cfg.parallel
    if par.cp == 1:
        return traffic.Traffic()
    from strata.parallel.context import attention_mode

    cp, tp = par.cp, par.tp
    q, kv = m.n_heads * m.head_size / tp, m.kv_heads * m.head_size / tp
    act = 2 if cfg.train.bf16_compute else 4
    forwards = 2 if cfg.activations.recompute != "none" else 1
    mode = attention_mode(par.cp_mode, m.n_heads // tp, m.kv_heads // tp, cp)
    if mode == "alltoall":
        return traffic.context_exchange(
            cluster, layout, tokens * (2 * q + 2 * kv) * act, mode
        ).scaled(layers * (forwards + 1))
    shift = traffic.context_exchange(cluster, layout, tokens * 2 * kv * act, mode)
    grads = traffic.context_exchange(cluster, layout, tokens * 2 * kv * 4, mode)
    block = attention / cp
    out = traffic.Traffic()
    out.add(shift, layers * (cp - 1) * (forwards + 1))
    out.add(grads, layers * cp)
    out.seconds = layers * (
        forwards * (cp - 1) * max(0.0, shift.seconds - block)
        + (cp - 1) * max(0.0, shift.seconds - 2 * block)
        + cp * max(0.0, grads.seconds - 2 * block)
    )
    return out


def _expert_traffic(
    cfg: Config, cluster: Cluster, layout: Layout, indices: list[int]
) -> traffic.Traffic:
    """The all-to-alls of a micro-batch's MoE layers among `indices` under expert parallelism: each
    layer's dispatch and return forward, and both again backward (and forward again when
    recomputed). Each tensor-parallel rank routes 1/tp of the micro-batch's tokens."""
    m, par = cfg.model, cfg.parallel
    moe_layers = sum(1 for i in indices if m.moe.is_moe_layer(i))
    if not moe_layers or par.ep == 1:
        return traffic.Traffic()
    tokens = cfg.train.micro_batch_size * m.seq_len / par.cp / par.tp
    row = m.d_model * (2 if cfg.train.bf16_compute else 4)
    nodes_per_token = _nodes_per_token(cfg, layout)
    one = traffic.expert_exchange(
        cluster, layout, par.ep, tokens, row, m.moe.top_k, nodes_per_token
    )
    exchanges = 4 + (2 if cfg.activations.recompute != "none" else 0)
    return one.scaled(moe_layers * exchanges)


def _nodes_per_token(cfg: Config, layout: Layout) -> float | None:
    """For the hierarchical dispatch (parallel.ep_dispatch, "auto" where the expert-parallel group
    spans nodes), the distinct nodes a token's experts are on, on average; None for the flat one.
    With as many route groups as nodes, route_group_limit; else top_k experts drawn uniformly."""
    par, moe = cfg.parallel, cfg.model.moe
    _, nodes = expert_layout(layout, par.ep).node_span("ep")
    if par.ep_dispatch == "flat" or nodes == 1:
        return None
    if moe.route_groups == nodes:
        return float(moe.route_group_limit)
    return nodes * (1 - (1 - 1 / nodes) ** moe.top_k)


@dataclass
class _Reductions:
    """Data-parallel collectives of one stage in one step, split by where they can hide."""

    fwd_gather: traffic.Traffic = field(default_factory=traffic.Traffic)  # per micro-batch
    bwd_gather: traffic.Traffic = field(default_factory=traffic.Traffic)  # per micro-batch
    scatter: traffic.Traffic = field(default_factory=traffic.Traffic)  # per micro-batch
    final: traffic.Traffic = field(default_factory=traffic.Traffic)  # once, after the last backward
    rebuild: traffic.Traffic = field(default_factory=traffic.Traffic)  # once, after the update
    first_gather: float = 0.0
    finals: list[tuple[float, float]] = field(
        default_factory=list
    )  # (backward FLOPs, seconds) per group, in list order

    def final_exposed(self, window: float) -> float:
        """What of the final reduction outlasts a backward of `window` seconds when each group's
        reduction starts as soon as backward has produced its gradient and the link serves them one
        after another. Groups come out of backward in reverse order, each when the backward compute
        up to and including its own is done: by FLOPs, not by parameters, since an embedding holds
        many parameters but its backward is a scatter-add that costs next to nothing, so the
        groups before it are ready only at the very end."""
        total = sum(w for w, _ in self.finals) or 1.0
        done, busy_until = 0.0, 0.0
        for work, seconds in reversed(self.finals):
            done += work
            ready = window * done / total
            busy_until = max(busy_until, ready) + seconds
        return max(0.0, busy_until - window)

    def per_step(self, m: int) -> traffic.Traffic:
        """The data-parallel traffic of a step of `m` micro-batches: the per-micro-batch collectives
        m times, the final reduction and the rebuild once."""
        out = traffic.Traffic()
        for t, times in (
            (self.fwd_gather, m),
            (self.bwd_gather, m),
            (self.scatter, m),
            (self.final, 1),
            (self.rebuild, 1),
        ):
            out.add(t, times)
        return out


def _reductions(
    cfg: Config,
    cluster: Cluster,
    layout: Layout,
    groups: list[Group],
    m: int,
    vocab: int,
    param_bytes: int = FP32,
) -> _Reductions:
    """The engine's collectives per flat group (see strata/parallel/zero.py): ZeRO-3 gathers per micro-batch
    (forward from the params level; backward and later micro-batches from the hpZ copy when there
    is one), reduce-scatters to the grads level per micro-batch, the final reduce-scatter to the
    optimizer's chunk and all-reduce over its copies, and the rebuild gather after the update.
    Gradients move in float32; gathered parameters `param_bytes` each."""
    lv = zero_levels(cfg)
    hier = cfg.zero.hierarchical if cfg.zero.enabled else True
    sync = "node" if cfg.co2.enabled else "global"
    out = _Reductions()
    for i, g in enumerate(groups):
        nbytes = g.padded * FP32

        def rs(fine: str, coarse: str, size: float = nbytes) -> traffic.Traffic:
            return traffic.reduce_scatter(cluster, layout, size, fine, coarse, hier)

        def ag(fine: str, coarse: str) -> traffic.Traffic:  # the same ring, the other way
            return rs(fine, coarse, g.padded * param_bytes)

        if lv["params"] != "none":
            primary = ag("none", lv["params"])
            if lv["secondary"] != "none":
                secondary = ag("none", lv["secondary"])
                out.fwd_gather.add(primary, 1 / m)
                out.fwd_gather.add(secondary, (m - 1) / m)
                out.bwd_gather.add(secondary)
            else:
                out.fwd_gather.add(primary)
                out.bwd_gather.add(primary)
            if i == 0:
                out.first_gather = primary.seconds
        if lv["grads"] != "none":
            out.scatter.add(rs("none", lv["grads"]))
        final = rs(lv["grads"], lv["optim"])
        final.add(traffic.all_reduce(cluster, layout, nbytes, lv["optim"], sync, hier))
        out.final.add(final)
        out.finals.append((backward_flops(cfg.model, g, vocab, cfg.parallel.tp), final.seconds))
        if lv["optim"] != lv["params"]:
            out.rebuild.add(ag(lv["params"], lv["optim"]))
    return out


def estimate_time(
    cfg: Config, cluster: Cluster, vocab: int, engine: Engine = STRATA
) -> TimeEstimate:
    """Seconds per optimizer step of `cfg` on `cluster` (see the module docstring) as `engine`
    runs it: Strata's trainer, or another framework whose published runs the planner is checked
    against (strata.plan.engines)."""
    layout = layout_of(cfg, cluster)
    m = micro_batches(cfg, layout)
    stages = [_stage_time(cfg, cluster, layout, vocab, s, engine) for s in range(cfg.parallel.pp)]
    slow = max(stages, key=lambda s: s.micro_batch)
    bubble = bubble_factor(cfg) * slow.micro_batch
    compute = m * (slow.fwd + slow.bwd)
    if cluster.shared_cores:
        bubble = 0.0
        compute = m * sum(st.fwd + st.bwd for st in stages) / len(stages)
    parts = {
        "compute": compute,
        "tp": m * slow.tp.seconds,
        "ep": m * slow.ep.seconds,
        "cp": m * slow.cp.seconds,
        "pp": max(st.sends(m, cfg.parallel.pp) for st in stages),
        "bubble": bubble,
    }
    dp_exposed, optimizer, offload_io, co2 = 0.0, 0.0, 0.0, 0.0
    link_bytes = dict.fromkeys(LINKS, 0.0)
    dp_bytes = dict.fromkeys(LINKS, 0.0)
    counts = chunk_counts(layout)
    lv = zero_levels(cfg)
    devices = offload_devices(cfg)
    step_compute = parts["compute"] + parts["tp"] + parts["ep"] + parts["cp"] + parts["pp"] + bubble
    for s, st in enumerate(stages):
        groups = flat_groups(cfg, layout, vocab, s)
        red = _reductions(cfg, cluster, layout, groups, m, vocab, engine.param_bytes)
        window_f, window_b = st.fwd, st.bwd
        exposed = red.first_gather
        exposed += m * max(0.0, red.fwd_gather.seconds - window_f)
        exposed += m * max(0.0, red.bwd_gather.seconds + red.scatter.seconds - window_b)
        if cfg.parallel.overlap_grad_reduce:
            exposed += red.final_exposed(window_b)
        else:
            exposed += red.final.seconds
        if engine.param_gather_overlap:  # gathered group by group in the next first forward
            exposed += max(0.0, red.rebuild.seconds - window_f)
        else:
            exposed += red.rebuild.seconds
        total = red.per_step(m)
        if exposed >= dp_exposed:
            dp_exposed = exposed
            dp_bytes = dict(total.bytes)
        chunk = sum(g.padded for g in groups) / counts[lv["optim"]]
        optimizer = max(optimizer, _update_time(cfg, cluster, chunk, devices["optim"]))
        offload_io = max(offload_io, _offload_io(cfg, cluster, layout, vocab, s, groups, st, m))
        if cfg.co2.enabled:
            outer = traffic.co2_outer(cluster, layout, chunk * FP32)
            hidden = cfg.co2.outer_every * step_compute if cfg.co2.overlap else 0.0
            co2 = max(co2, max(0.0, outer.seconds - hidden) / cfg.co2.outer_every)
            for k, v in outer.bytes.items():
                dp_bytes[k] = dp_bytes.get(k, 0.0) + v / cfg.co2.outer_every
    parts.update({"dp": dp_exposed, "optimizer": optimizer, "offload_io": offload_io, "co2": co2})
    for k in LINKS:
        link_bytes[k] += (slow.tp.bytes[k] + slow.ep.bytes[k] + slow.cp.bytes[k]) * m + dp_bytes[k]
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    return TimeEstimate(
        step_s=sum(parts.values()),
        parts=parts,
        link_bytes=link_bytes,
        dp_bytes=dp_bytes,
        model_flops=flops_per_token(cfg.model, vocab) * tokens,
        ranks=layout.world_size,
        peak_tflops=cluster.device.peak_tflops,
    )


def _update_time(cfg: Config, cluster: Cluster, elements: float, where: str) -> float:
    """AdamW over this rank's optimizer chunk: memory-bound on the device; on the host at the
    host's rate (a GPU's gradients come down and parameters go back over its host link); from
    NVMe, the moments' reads and writes pipelined against that update."""
    dev = cluster.device
    if where == "none":
        return elements * ADAM_BYTES / (dev.mem_bw_gbs * 1e9)
    update = elements / (cluster.cpu_adam_gparams_s * 1e9)
    if not dev.host_memory:
        update += elements * 2 * FP32 / (cluster.host_link_gbps * 1e9 / 8)
    if where == "nvme":
        per_rank = cluster.nvme_gbps * 1e9 / 8 / cluster.ranks_per_node
        update = max(update, elements * 4 * FP32 / per_rank)
    return update


def _offload_io(
    cfg: Config,
    cluster: Cluster,
    layout: Layout,
    vocab: int,
    pp_rank: int,
    groups: list[Group],
    st: _Stage,
    m: int,
) -> float:
    """Exposed offload I/O: parameter shards read from NVMe for each pass (those kept in memory
    after use excepted) and written back after the update; saved activations written during
    forward and read back in backward. Reads and writes hide behind the compute they overlap."""
    devices = offload_devices(cfg)
    lv = zero_levels(cfg)
    nvme = cluster.nvme_gbps * 1e9 / 8 / cluster.ranks_per_node
    host = cluster.host_link_gbps * 1e9 / 8 / cluster.ranks_per_gpu
    exposed = 0.0
    shard = sum(g.padded for g in groups) * FP32 / chunk_counts(layout)[lv["params"]]
    if devices["params"] == "nvme":
        kept = min(1.0, cfg.offload.params.keep_groups / max(1, len(groups)))
        reads = shard * (2 * m - kept) / nvme
        exposed += max(0.0, reads - m * (st.fwd + st.bwd)) + shard / nvme
    elif devices["params"] == "cpu" and not cluster.device.host_memory:
        exposed += max(0.0, 2 * m * shard / host - m * (st.fwd + st.bwd)) + shard / host
    if cfg.activations.offload != "none":
        moved = activation_bytes(cfg, layout, vocab, pp_rank).get(
            TIER_OF[cfg.activations.offload], 0
        )
        bw = nvme if cfg.activations.offload == "nvme" else host
        if cluster.device.host_memory and cfg.activations.offload == "cpu":
            bw = cluster.device.mem_bw_gbs * 1e9
        per_mb = moved / max(1.0, in_flight(cfg, layout, pp_rank)) / bw
        exposed += m * (max(0.0, per_mb - st.fwd) + max(0.0, per_mb - st.bwd))
    return exposed
