"""The sizes the planner works from, derived from the config alone: each rank's parameters unit by
unit after tensor and pipeline parallelism, the flat groups the ZeRO engine packs them into (with
its padding and bucketing), each level's chunk of them, and what one transformer layer saves for
backward per token. `tests/plan/test_planner.py` checks these against the modules Strata really builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from strata.config.schema import Config, ModelConfig
from strata.config.vocabulary import lora_target_kinds
from strata.parallel.stages import plan_stages, schedule_name, stage_indices
from strata.parallel.topology import CHAIN, Grid


@dataclass(frozen=True)
class Group:
    """One flat group on one rank: `elements` before padding, `padded` after; `layers` transformer
    blocks packed in it (0 for the embedding, head and tied groups)."""

    name: str
    elements: int
    padded: int
    layers: int
    part: int  # which of the rank's model chunks (virtual stages) it belongs to
    domain: str = ""  # the ranks ZeRO reduces and partitions it over: "" dp, "experts", "routing"
    frozen: bool = False  # model.lora's frozen weights under ZeRO-3: partitioned, never stepped


@dataclass(frozen=True)
class Part:
    """One model chunk a pipeline rank runs: its layer count and whether it holds the embedding
    (first stage) or the final norm and output layer (last stage)."""

    n_layers: int
    first: bool
    last: bool
    first_layer: int = 0  # the model's index of its first block


def block_elements(m: ModelConfig, tp: int, ffn: bool = True) -> int:
    """Parameters of one dense transformer block on one tensor-parallel rank (norms replicated);
    without `ffn`, all but its feed-forward."""
    d, q, kv, f = (
        m.d_model,
        m.n_heads * m.head_size,
        m.kv_heads * m.head_size,
        m.ffn_size if ffn else 0,
    )
    n = (2 * d * q + 2 * d * kv + 3 * d * f) // tp + 2 * d
    if m.qkv_bias:
        n += (q + 2 * kv) // tp
    if m.qk_norm:
        n += 2 * m.head_size
    return n


def parts_of(cfg: Config, pp_rank: int) -> list[Part]:
    """The chunks pipeline rank `pp_rank` runs, in execution order (all of the model without pp)."""
    par = cfg.parallel
    if par.pp == 1:
        return [Part(cfg.model.n_layers, True, True)]
    indices = stage_indices(
        pp_rank, par.pp, par.virtual_stages, schedule_name(par.schedule, par.virtual_stages)
    )
    return [
        Part(p.n_layers, p.is_first, p.is_last, p.first_layer)
        for p in plan_stages(cfg.model.n_layers, par.pp * par.virtual_stages, indices)
    ]


def block_domains(cfg: Config, index: int) -> dict[str, int]:
    """Block `index`'s parameters on one rank by ZeRO domain, in the order the engine meets them
    (`parallel.experts.domain_of`). An MoE block: its attention and norms data parallel; its
    `num_experts/ep` experts in "experts" whenever experts or tensors are split (ep or tp > 1);
    its router and shared experts, which tensor parallelism does not split, in "routing" under tp."""
    m, par = cfg.model, cfg.parallel
    if not m.moe.is_moe_layer(index):
        return {"": block_elements(m, par.tp)}
    moe, d, tp = m.moe, m.d_model, par.tp
    attention = block_elements(m, tp, ffn=False)
    shared = moe.shared_ffn_size(m)
    routing = moe.num_experts * d + 3 * d * shared + (d if shared and moe.shared_expert_gate else 0)
    experts = moe.num_experts // par.ep * 3 * d * moe.expert_ffn_size(m)
    if par.ep == 1 and tp == 1:
        return {"": attention + routing + experts}
    if tp == 1:
        return {"": attention + routing, "experts": experts}
    return {"": attention, "routing": routing, "experts": experts}


def lora_domains(cfg: Config, index: int) -> dict[str, int]:
    """Block `index`'s LoRA adapters on one rank by ZeRO domain (`strata.lora`; sharded as
    `parallel.tensor.AdapterLinear` shards them): of a column-parallel layer A whole and B split,
    of a row-parallel one A split and B whole; an MoE layer's shared experts' whole, in "routing"
    under tp."""
    m, tp, r = cfg.model, cfg.parallel.tp, cfg.model.lora.rank
    kinds = set(lora_target_kinds(m.lora.target_modules))
    d, q, kv = m.d_model, m.n_heads * m.head_size, m.kv_heads * m.head_size
    moe = m.moe.is_moe_layer(index)
    f = m.moe.shared_ffn_size(m) if moe else m.ffn_size
    # PEFT's name: (in, out, column-parallel)
    shapes = {
        "q_proj": (d, q, True),
        "k_proj": (d, kv, True),
        "v_proj": (d, kv, True),
        "o_proj": (q, d, False),
        "gate_proj": (d, f, True),
        "up_proj": (d, f, True),
        "down_proj": (f, d, False),
    }

    def elements(kind: str, split: bool) -> int:
        i, o, column = shapes[kind]
        if not split:
            return r * (i + o)
        return r * i + r * o // tp if column else r * i // tp + r * o

    attention = sum(
        elements(k, True) for k in ("q_proj", "k_proj", "v_proj", "o_proj") if k in kinds
    )
    ffn = sum(elements(k, not moe) for k in ("gate_proj", "up_proj", "down_proj") if k in kinds)
    ffn = ffn if f else 0
    if moe and tp > 1:
        return {"": attention, "routing": ffn}
    return {"": attention + ffn}


def frozen_units(cfg: Config, vocab: int, pp_rank: int) -> list[tuple[str, int, int, str]]:
    """(unit, elements, model chunk, domain) of what pipeline rank `pp_rank` holds and never
    trains: with model.lora every weight of its share of the model, unit by unit and domain by
    domain (train.freeze's items are not modelled)."""
    m, tp = cfg.model, cfg.parallel.tp
    if not m.lora.enabled:
        return []
    embed, tied = vocab // tp * m.d_model, m.tie_embeddings
    out = []
    for pi, part in enumerate(parts_of(cfg, pp_rank)):
        if part.first:
            out.append(("tok_embeddings", embed, pi, ""))
        for i in range(part.n_layers):
            index = part.first_layer + i
            out += [(f"layers.{index}", n, pi, d) for d, n in block_domains(cfg, index).items()]
        if part.last:  # a tied embedding's copy on the last stage is frozen with the head
            out.append(("head", m.d_model + (embed if not tied or not part.first else 0), pi, ""))
    return out


def frozen_elements(cfg: Config, vocab: int, pp_rank: int) -> int:
    """Parameters pipeline rank `pp_rank` holds and never trains (`frozen_units`)."""
    return sum(n for _, n, _, _ in frozen_units(cfg, vocab, pp_rank))


def groups_of(
    cfg: Config,
    vocab: int,
    pp_rank: int,
    pad_to: dict[str, int],
    bucket_bytes: int,
    frozen_groups: bool = False,
) -> list[Group]:
    """The flat groups of pipeline rank `pp_rank`, as `ZeroEngine` plans them: one per unit
    (embedding, each block, final norm + output) and parameter domain, a tied embedding in a group
    of its own, consecutive blocks of one chunk and one domain merged while the group holds less
    than `bucket_bytes`, each padded to a multiple of `pad_to[domain]` (the chunks its state is cut
    into: the data-parallel degree of its domain). With model.lora the groups hold the adapters
    alone (`lora_domains`), and the frozen rest (`frozen_elements`) is in none, or with
    `frozen_groups` (ZeRO-3) in groups of its own, one per unit and domain, never merged."""
    m, tp = cfg.model, cfg.parallel.tp
    tied, lora = m.tie_embeddings, m.lora.enabled
    embed = vocab // tp * m.d_model
    out: list[list] = []  # name, elements, layers, part, domain
    for pi, part in enumerate(parts_of(cfg, pp_rank)):
        if part.first and not lora:
            out.append(["tied" if tied else "tok_embeddings", embed, 0, pi, ""])
        for i in range(part.n_layers):
            index = part.first_layer + i
            domains = (lora_domains if lora else block_domains)(cfg, index)
            for domain, elements in domains.items():
                if not elements:
                    continue
                last = out[-1] if out else None
                if (
                    last
                    and last[2] > 0
                    and last[3] == pi
                    and last[4] == domain
                    and last[1] * 4 < bucket_bytes
                ):
                    last[1] += elements
                    last[2] += 1
                else:
                    out.append([f"layers.{part.first_layer + i}", elements, 1, pi, domain])
        if part.last and not lora:
            out.append(["head", m.d_model + (0 if tied else embed), 0, pi, ""])
            # the last stage's copy of a tied embedding: a group of its own
            if tied and not part.first:
                out.append(["tied", embed, 0, pi, ""])
    groups = [
        Group(n, e, math.ceil(e / pad_to[dom]) * pad_to[dom], layers, pi, dom)
        for n, e, layers, pi, dom in out
    ]
    if not (frozen_groups and lora):
        return groups
    return groups + [
        Group(n, e, math.ceil(e / pad_to[dom]) * pad_to[dom], 0, pi, dom, frozen=True)
        for n, e, pi, dom in frozen_units(cfg, vocab, pp_rank)
        if e
    ]


@lru_cache(maxsize=256)
def chunk_counts(layout: Grid, rank: int = 0) -> dict[str, int]:
    """How many chunks state partitioned at each level is cut into across a data-dimension group
    (dp; edp for the experts' layout) (the ZeRO engine's `Routes.count`): 1 at none, its degree at
    global."""
    return {level: layout.nested_chunk(rank, level)[1] for level in CHAIN}


def layer_flops(m: ModelConfig, tp: int, index: int = 0) -> float:
    """Matmul FLOPs layer `index`'s forward executes per token on one tensor-parallel rank
    (causal attention computes half of its score matrix; backward is twice this). An MoE layer runs
    its router, top_k experts and the shared experts on each token; a tensor-parallel rank routes
    1/tp of the tokens (sequence parallelism), so its share is 1/tp of those too."""
    d, q, kv, f = m.d_model, m.n_heads * m.head_size, m.kv_heads * m.head_size, m.ffn_size
    if m.moe.is_moe_layer(index):
        moe = m.moe
        ffn = (
            moe.num_experts * d / 3
            + moe.top_k * d * moe.expert_ffn_size(m)
            + d * moe.shared_ffn_size(m)
        )
        return 2 * (2 * d * q + 2 * d * kv + 3 * ffn) / tp + attention_flops(m, tp)
    return 2 * (2 * d * q + 2 * d * kv + 3 * d * f) / tp + attention_flops(m, tp)


def attention_flops(m: ModelConfig, tp: int) -> float:
    """Forward FLOPs per token of one layer's causal attention (scores and their product with v,
    half the score matrix computed) on one tensor-parallel rank: part of `layer_flops`."""
    return 0.5 * 4 * m.seq_len * m.n_heads * m.head_size / tp


def gemm_operands(m: ModelConfig, tp: int, ep: int, index: int = 0) -> tuple[float, float, float]:
    """What one layer's forward GEMMs read and write on one tensor-parallel rank: elements per
    token (each GEMM's input and output rows; an input that several GEMMs read one after another,
    q/k/v's or w1/w3's, once), elements per micro-batch (its weights), and of the first the
    GEMMs' inputs alone. An MoE layer's routed and shared experts count each token's top_k rows
    (1/tp of the tokens per rank) and read the weights of the num_experts/ep experts the rank
    holds."""
    d, q, kv, f = m.d_model, m.n_heads * m.head_size, m.kv_heads * m.head_size, m.ffn_size
    rows = 2 * d + (2 * q + 2 * kv) / tp
    inputs = d + q / tp
    weights = (2 * d * q + 2 * d * kv) / tp
    if m.moe.is_moe_layer(index):
        moe = m.moe
        ef, sf = moe.expert_ffn_size(m), moe.shared_ffn_size(m)
        shared = (2 * d + 3 * sf if sf else 0, d + sf if sf else 0)
        rows += (moe.num_experts + d + moe.top_k * (2 * d + 3 * ef) + shared[0]) / tp
        inputs += (d + moe.top_k * (d + ef) + shared[1]) / tp
        weights += moe.num_experts * d + 3 * d * (ef * moe.num_experts / ep + sf)
        return rows, weights, inputs
    return rows + 2 * d + 3 * f / tp, weights + 3 * d * f / tp, inputs + d + f / tp


def head_flops(m: ModelConfig, vocab: int, tp: int) -> float:
    """Forward matmul FLOPs per token of the output layer on one tensor-parallel rank."""
    return 2 * m.d_model * vocab / tp


def backward_flops(m: ModelConfig, group: Group, vocab: int, tp: int) -> float:
    """Relative backward matmul work per token of a flat group's units: its blocks' and, for the
    head's group, the output layer's; an embedding's backward (a scatter-add) counts as nothing.
    (An MoE block's groups of other domains each count the block's work: a bound, not a split.)"""
    first = int(group.name.split(".")[1]) if group.name.startswith("layers.") else 0
    return group.layers * layer_flops(m, tp, first) + (
        head_flops(m, vocab, tp) if group.name == "head" else 0.0
    )


# --- activations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    """A tensor one layer saves for backward: elements per token (per sequence position held by
    this rank) and bytes per element."""

    name: str
    per_token: float
    itemsize: int


def block_saved(cfg: Config, index: int = 0) -> list[Saved]:
    """What one transformer block saves for backward, per token of the micro-batch, on one rank:
    for each norm its input, 1/rms and the normalised input before the weight (x·rstd, which
    `F.rms_norm`'s backward keeps); each linear's input (shared by the q/k/v and by the gate/up
    projections in fp32; under bf16 autocast each linear casts its own copy); the rotated q/k and
    v, the attention output and its log-sum-exp (fused SDPA keeps no score matrix); the copy `wo`
    takes of the re-laid-out attention output; SwiGLU's gate, its SiLU, the up projection and their
    product. `block_constant_bytes` adds what does not scale with tokens."""
    m, tp = cfg.model, cfg.parallel.tp
    d, q, kv, f = m.d_model, m.n_heads * m.head_size, m.kv_heads * m.head_size, m.ffn_size
    bf16 = cfg.train.bf16_compute
    act = 2 if bf16 else 4
    sp = cfg.parallel.sequence_parallel and tp > 1
    # sequence parallelism shards the residual stream over the tp ranks
    stream = d / tp if sp else d
    rstd = 1 / tp if sp else 1
    saved = [
        Saved("residual into attn_norm", stream, 4),
        Saved("attn_norm x·rstd", stream, 4),
        Saved("attn_norm rstd", rstd, 4),
        Saved("q/k/v input", d * (3 if bf16 else 1), act),
        Saved("q, k, v (rotated)", (q + 2 * kv) / tp, act),
        Saved("attention output", q / tp, act),
        Saved("attention log-sum-exp", m.n_heads / tp, 4),
        Saved("wo input", q / tp, act),
        Saved("residual into mlp_norm", stream, 4),
        Saved("mlp_norm x·rstd", stream, 4),
        Saved("mlp_norm rstd", rstd, 4),
    ]
    if m.moe.is_moe_layer(index):
        saved += moe_saved(cfg)
    else:
        saved += [
            Saved("w1/w3 input", d * (2 if bf16 else 1), act),
            Saved("w1 output (SiLU input)", f / tp, act),
            Saved("SiLU output", f / tp, act),
            Saved("w3 output", f / tp, act),
            Saved("w2 input", f / tp, act),
        ]
    if m.qk_norm:
        saved += [
            Saved("q/k before their norms", (q + kv) / tp, act),
            Saved("q/k norm x·rstd", (q + kv) / tp, 4),
            Saved("q/k norm rstd", (m.n_heads + m.kv_heads) / tp, 4),
        ]
    if m.lora.enabled:
        saved = [x for x in saved if not x.name.endswith("x·rstd")] + lora_saved(cfg, index)
    return saved


def lora_saved(cfg: Config, index: int) -> list[Saved]:
    """With model.lora, what the adapters save besides their layer's input: each adapter's rank-r
    activation (B's input; of a row-parallel layer under sequence parallelism, this rank's
    positions). A frozen norm keeps no x·rstd (`block_saved` drops them): it is for its weight's
    gradient. The inputs of layers without an adapter are still counted (an overestimate)."""
    m, tp, r = cfg.model, cfg.parallel.tp, cfg.model.lora.rank
    act = 2 if cfg.train.bf16_compute else 4
    sp = cfg.parallel.sequence_parallel and tp > 1
    row = {"o_proj", "down_proj"}
    kinds = lora_target_kinds(m.lora.target_modules)
    if m.moe.is_moe_layer(index) and not m.moe.shared_ffn_size(m):
        kinds = [k for k in kinds if k in ("q_proj", "k_proj", "v_proj", "o_proj")]
    return [Saved(f"{k} adapter A·x", r / tp if k in row and sp else r, act) for k in kinds]


def moe_saved(cfg: Config) -> list[Saved]:
    """What an MoE feed-forward saves per token of the micro-batch (strata.moe; each tensor-parallel
    rank routes its own part of the sequence): the norm's output (the router's fp32 input), the
    router's scores (and the logits or a second softmax when the z or auxiliary loss needs them),
    the top-k indices and gate weights, the sort and gather indices of the dispatch, each token's
    k rows as the experts' input, output and weighted output and SwiGLU's four intermediates per row
    (dropless: balanced routing, so expert parallelism receives as many rows as it sends; with a
    capacity, its bound), and the shared experts' SwiGLU."""
    m, tp = cfg.model, cfg.parallel.tp
    moe, d, k, e = m.moe, m.d_model, m.moe.top_k, m.moe.num_experts
    bf16 = cfg.train.bf16_compute
    act = 2 if bf16 else 4
    share = 1 / tp if cfg.parallel.sequence_parallel and tp > 1 else 1
    # The experts' rows a rank holds per token routed: k when routing is balanced; with a capacity,
    # up to capacity_factor·k (each expert keeps that many of every source's tokens at most).
    rows = share * (moe.capacity_factor or 1.0)
    fe, fs = moe.expert_ffn_size(m), moe.shared_ffn_size(m)
    losses = (moe.aux_loss_coef > 0) + (moe.z_loss_coef > 0)
    saved = [
        Saved("router input", d * share, 4),
        Saved("router scores, logits", e * (1 + losses) * share, 4),
        Saved("top-k indices", k * share, 8),
        Saved("gate weights, their sum and the weights per row", (2 * k + 1) * share, 4),
        Saved("dispatch indices", 3 * k * share, 8),
        Saved("expert input rows", k * d * rows, act),
        Saved("expert SwiGLU", 4 * k * fe * rows, act),
        Saved("expert output rows, and weighted", 2 * k * d * rows, act),
    ]
    if cfg.parallel.ep > 1:
        saved.append(Saved("exchange indices", 2 * k * rows, 8))
    if fs:
        saved += [
            Saved("shared input copies", (2 * d if bf16 else 0) * share, act),
            Saved("shared SwiGLU", 4 * fs * share, act),
        ]
    return saved


def block_kept_selective(cfg: Config) -> list[Saved]:
    """What one block keeps under selective recomputation, per token: its input (saved by the
    checkpoint) and the outputs of its matmuls and of attention (kept by the policy); everything
    between them is recomputed in backward."""
    m, tp = cfg.model, cfg.parallel.tp
    d, q, kv, f = m.d_model, m.n_heads * m.head_size, m.kv_heads * m.head_size, m.ffn_size
    act = 2 if cfg.train.bf16_compute else 4
    sp = cfg.parallel.sequence_parallel and tp > 1
    return [
        Saved("block input", d / tp if sp else d, 4),
        Saved("wq, wk, wv outputs", (q + 2 * kv) / tp, act),
        Saved("attention output", q / tp, act),
        Saved("attention log-sum-exp", m.n_heads / tp, 4),
        Saved("wo output", d, act),
        Saved("w1, w3 outputs", 2 * f / tp, act),
        Saved("w2 output", d, act),
    ]


def block_constant_bytes(cfg: Config, index: int = 0) -> int:
    """Saved bytes of block `index` that do not scale with the micro-batch: under bf16 autocast, the
    16-bit copies of every linear's weight (and the cos/sin tables each RoPE call casts)."""
    if not cfg.train.bf16_compute:
        return 0
    m, tp = cfg.model, cfg.parallel.tp
    d, q, kv, f = m.d_model, m.n_heads * m.head_size, m.kv_heads * m.head_size, m.ffn_size
    # the experts' (one stacked copy each) and the shared experts' weights
    if m.moe.is_moe_layer(index):
        moe = m.moe
        weights = (2 * d * q + 2 * d * kv) // tp * 2
        weights += (
            (moe.num_experts // cfg.parallel.ep * moe.expert_ffn_size(m) + moe.shared_ffn_size(m))
            * 3
            * d
            * 2
        )
    else:
        weights = (2 * d * q + 2 * d * kv + 3 * d * f) // tp * 2
    rope = 8 * m.seq_len * (m.head_size // 2) * 2
    return weights + rope


def head_saved(cfg: Config, vocab: int) -> list[Saved]:
    """What the final norm, output layer and loss save per token (last stage only), and the
    targets the loss keeps (int64)."""
    tp, d = cfg.parallel.tp, cfg.model.d_model
    act = 2 if cfg.train.bf16_compute else 4
    saved = [
        Saved("residual into norm", d, 4),
        Saved("norm x·rstd", d, 4),
        Saved("norm rstd", 1, 4),
        Saved("output input", d, act),
        Saved("log-softmax of the logits", vocab / tp, 4),
        Saved("targets", 1, 8),
    ]
    # model.lora: the norm's and the output layer's weights are frozen, so what only their
    # gradients need is not kept
    frozen = ("norm x·rstd", "output input") if cfg.model.lora.enabled else ()
    return [x for x in saved if x.name not in frozen]


def head_constant_bytes(cfg: Config, vocab: int) -> int:
    """Under bf16 autocast, the output layer's 16-bit weight copy."""
    if not cfg.train.bf16_compute:
        return 0
    return vocab // cfg.parallel.tp * cfg.model.d_model * 2


def saved_bytes(saved: list[Saved], tokens: int) -> int:
    """Bytes the tensors `saved` take for `tokens` tokens."""
    return int(sum(s.per_token * s.itemsize for s in saved) * tokens)
