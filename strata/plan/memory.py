"""The memory model: per-rank bytes by kind of state and by tier (device, host, NVMe), from the
resolved config and a cluster description alone. Pure functions; every placement they assume is
the one the trainer makes (strata/parallel/zero.py, offload/, checkpoint/), and tests/plan/test_memory.py
checks them against the bytes real runs hold.

Kinds: params, grads, optim (each at its ZeRO level and tier), gathered (ZeRO-3 groups gathered
at once: the running one and `prefetch_blocks` ahead), buckets (gradient buffers waiting for their
reduce-scatter), activations (saved for backward, times the micro-batches the pipeline schedule
keeps in flight), pool (the offload host pool), staging (the asynchronous checkpoint's image),
snapshot (the in-memory snapshot's image and the fragments the node's agent keeps for others).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from strata.config.schema import Config
from strata.config.vocabulary import V_SHAPED_SCHEDULES, chain_level, offload_devices
from strata.parallel.stages import schedule_name
from strata.parallel.topology import Layout, expert_layout, layout_from_config
from strata.plan.cluster import Cluster
from strata.plan.shapes import (
    Group,
    Saved,
    block_constant_bytes,
    block_kept_selective,
    block_saved,
    chunk_counts,
    frozen_elements,
    groups_of,
    head_constant_bytes,
    head_saved,
    parts_of,
    saved_bytes,
)

TIERS = ("device", "host", "nvme")
KINDS = (
    "params",
    "grads",
    "optim",
    "gathered",
    "buckets",
    "activations",
    "pool",
    "staging",
    "snapshot",
)
FP32 = 4
ADAM_MOMENTS = 2
TIER_OF = {"none": "device", "cpu": "host", "nvme": "nvme"}  # an offload device setting's tier
ALIGN = 4096  # offloaded activations are stored 4 KiB-aligned (O_DIRECT)


@dataclass
class RankMemory:
    """Bytes one rank holds at its peak, by (kind, tier)."""

    pp_rank: int
    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, kind: str, tier: str, nbytes: float) -> None:
        """Count `nbytes` more of `kind` (parameters, gradients, ...) in `tier`; zero adds no
        entry."""
        if nbytes:
            self.bytes[(kind, tier)] = self.bytes.get((kind, tier), 0) + int(nbytes)

    def total(self, tier: str) -> int:
        """Bytes held in `tier`, every kind together."""
        return sum(v for (_, t), v in self.bytes.items() if t == tier)

    def kind(self, kind: str, tier: str | None = None) -> int:
        """Bytes of `kind` held in `tier`, or in every tier when `tier` is None."""
        return sum(
            v for (k, t), v in self.bytes.items() if k == kind and (tier is None or t == tier)
        )


@dataclass
class MemoryEstimate:
    """Per pipeline stage (the ranks of one stage hold alike), and the cluster's budgets."""

    stages: list[RankMemory]
    cluster: Cluster
    layout: Layout

    def stage(self, pp_rank: int) -> RankMemory:
        """The figures of pipeline rank `pp_rank`'s ranks."""
        return self.stages[pp_rank]

    def worst(self, tier: str) -> RankMemory:
        """The stage that holds the most in `tier`."""
        return max(self.stages, key=lambda r: r.total(tier))

    def peak(self, tier: str) -> int:
        """The most any rank holds in `tier`, in bytes."""
        return self.worst(tier).total(tier)

    @property
    def device_budget(self) -> int:
        """A rank's device memory in bytes."""
        return int(self.cluster.device.mem_gib * 2**30)

    @property
    def host_budget_per_rank(self) -> int:
        """A rank's share of its node's host memory in bytes."""
        return int(self.cluster.host_mem_gib * 2**30 / self.cluster.ranks_per_node)

    def fits(self) -> bool:
        """Whether every rank's device and host peaks fit within its budgets."""
        return (
            self.peak("device") <= self.device_budget
            and self.peak("host") <= self.host_budget_per_rank
        )

    def problems(self) -> list[str]:
        """Why the layout does not fit, one line per tier over its budget."""
        out = []
        for tier, budget in (("device", self.device_budget), ("host", self.host_budget_per_rank)):
            worst = self.worst(tier)
            if worst.total(tier) > budget:
                top = sorted(
                    ((v, k) for (k, t), v in worst.bytes.items() if t == tier), reverse=True
                )[:3]
                parts = ", ".join(f"{k} {gib(v)}" for v, k in top)
                out.append(
                    f"{tier} memory: pipeline stage {worst.pp_rank} needs {gib(worst.total(tier))} "
                    f"per rank (largest: {parts}) but has {gib(budget)}"
                )
        return out


def gib(nbytes: float) -> str:
    """Bytes as a GiB figure for reports (two decimals)."""
    return f"{nbytes / 2**30:.2f} GiB"


def layout_of(cfg: Config, cluster: Cluster) -> Layout:
    """The topology's Layout of `cfg` on `cluster`, whose shape wins over the config's ranks per
    node and per GPU (ConfigError, as at launch, when the layout does not fit the cluster)."""
    par = dataclasses.replace(
        cfg.parallel, ranks_per_node=cluster.ranks_per_node, ranks_per_gpu=cluster.ranks_per_gpu
    )
    return layout_from_config(par, cluster.world_size)


def zero_levels(cfg: Config) -> dict[str, str]:
    """The level each kind of state is partitioned at (chain levels), as the engine plans it."""
    z = cfg.zero
    if not z.enabled:
        return {"params": "none", "grads": "none", "optim": "none", "secondary": "none"}
    return {
        "params": chain_level(z.params.shard_over),
        "grads": chain_level(z.grads.shard_over),
        "optim": chain_level(z.optim.shard_over),
        "secondary": chain_level(z.secondary_params.shard_over),
    }


def bucket_bytes(cfg: Config) -> int:
    """How many bytes a flat group fills before the next block starts another: the ZeRO engine's
    `zero.bucket_mb`, or `parallel.bucket_mb` for plain data parallelism."""
    return int((cfg.zero.bucket_mb if cfg.zero.enabled else cfg.parallel.bucket_mb) * 2**20)


def domain_counts(cfg: Config, layout: Layout) -> dict[str, dict[str, int]]:
    """Per parameter domain ("" data parallel; for MoE models "experts" and "routing", each over its
    own `expert_layout`), how many chunks state partitioned at each level is cut into."""
    out = {"": chunk_counts(layout)}
    if cfg.model.moe.enabled:
        out["experts"] = chunk_counts(expert_layout(layout, cfg.parallel.ep))
        out["routing"] = chunk_counts(expert_layout(layout, 1))
    return out


def flat_groups(cfg: Config, layout: Layout, vocab: int, pp_rank: int) -> list[Group]:
    """The flat groups of pipeline rank `pp_rank` under this layout, padded as the engine pads them."""
    pad_to = {domain: c["global"] for domain, c in domain_counts(cfg, layout).items()}
    sharded = zero_levels(cfg)["params"] != "none"
    return groups_of(cfg, vocab, pp_rank, pad_to, bucket_bytes(cfg), frozen_groups=sharded)


def micro_batches(cfg: Config, layout: Layout) -> int:
    """Micro-batches per step on each data-parallel rank (at least 1)."""
    return max(
        1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * layout.data_parallel)
    )


def in_flight(cfg: Config, layout: Layout, pp_rank: int) -> float:
    """Micro-batches whose activations pipeline rank `pp_rank` holds at once, in units of its whole
    share of the model (a virtual stage holds 1/V of it): all of them for GPipe, p − rank for
    1F1B, and for the interleaved schedule Megatron's (and torch's) warm-up of
    (V − 1)·p + 2·(p − 1 − rank) chunk-micro-batches, plus the one in flight."""
    p, v, m = cfg.parallel.pp, cfg.parallel.virtual_stages, micro_batches(cfg, layout)
    if p == 1:
        return 1.0
    name = schedule_name(cfg.parallel.schedule, v)
    if name in ("gpipe", "looped_bfs"):
        return float(m)
    if name in V_SHAPED_SCHEDULES:
        v = 2
    if v == 1:
        return float(min(m, p - pp_rank))
    chunks = min(m * v, (v - 1) * p + 2 * (p - 1 - pp_rank) + 1)
    return chunks / v


def activation_bytes(cfg: Config, layout: Layout, vocab: int, pp_rank: int) -> dict[str, int]:
    """Peak bytes saved for backward on a rank of `pp_rank`: {"device": ..., "host"/"nvme": ...}.

    Kept: the blocks' saved tensors times the micro-batches in flight, plus the head's (last stage)
    and the token ids (first stage), for the seq_len/cp tokens of a sequence a context-parallel rank
    holds (the ring's K/V block in flight and the all-to-all's head-split copies are transient).
    Recomputed (`activations.recompute=full`): each block keeps
    its input (`selective`: and its matmul and attention outputs); the peak comes while one block's
    forward is recomputed (its whole set but what it already counts) or, if larger, while the
    head's tensors live (with offload only block inputs would move: all counted on the device, a
    bound). Offloaded: each saved tensor of at least `activations.min_bytes` goes to host memory
    or NVMe (4 KiB-aligned); those below stay. Host offload copies as the tensor is saved and
    backward reads the copy, so nothing big stays on the device; NVMe offload reads back a layer
    ahead, so in backward a layer's and the previous layer's tensors (the head's filed with the
    last block) are on the device at once."""
    act, m = cfg.activations, cfg.model
    tp, sp = cfg.parallel.tp, cfg.parallel.sequence_parallel and cfg.parallel.tp > 1
    parts = parts_of(cfg, pp_rank)
    # a context-parallel rank's share
    tokens = cfg.train.micro_batch_size * m.seq_len // cfg.parallel.cp
    indices = [p.first_layer + i for p in parts for i in range(p.n_layers)]
    layers = len(indices)
    flight = in_flight(cfg, layout, pp_rank)
    blocks = [block_saved(cfg, i) for i in indices]
    head_list = head_saved(cfg, vocab) if any(p.last for p in parts) else []
    constant = [block_constant_bytes(cfg, i) for i in indices]
    per_layer = [saved_bytes(b, tokens) + c for b, c in zip(blocks, constant)]
    head = saved_bytes(head_list, tokens) + (head_constant_bytes(cfg, vocab) if head_list else 0)
    ids = tokens * 8 if any(p.first for p in parts) else 0
    if act.recompute != "none":
        if act.recompute == "full":
            kept_layer = tokens * (m.d_model // tp if sp else m.d_model) * FP32
        else:
            kept_layer = saved_bytes(block_kept_selective(cfg), tokens)
        kept = (layers * kept_layer + ids) * flight
        return {"device": int(kept + max(head, max(per_layer) - kept_layer))}
    if act.offload == "none":
        return {"device": int((sum(per_layer) + head + ids) * flight)}

    def split(saved: list[Saved]) -> tuple[int, int]:
        """(bytes that stay, 4 KiB-aligned bytes that move) of one micro-batch's `saved`."""
        sizes = [int(x.per_token * x.itemsize * tokens) for x in saved]
        stay = sum(n for n in sizes if n < act.min_bytes)
        move = sum(-(-n // ALIGN) * ALIGN for n in sizes if n >= act.min_bytes)
        return stay, move

    splits = [split(b) for b in blocks]
    head_stay, head_move = split(head_list)
    stay = (sum(st for st, _ in splits) + sum(constant) + head_stay + ids) * flight
    moved = (sum(mv for _, mv in splits) + head_move) * flight
    if act.offload == "cpu":
        return {"device": int(stay), "host": int(moved)}
    return {"device": int(stay + 2 * max(mv for _, mv in splits) + head_move), "nvme": int(moved)}


def estimate_memory(cfg: Config, cluster: Cluster, vocab: int) -> MemoryEstimate:
    """Per-rank bytes by kind and tier for every pipeline stage of `cfg` on `cluster`."""
    layout = layout_of(cfg, cluster)
    return MemoryEstimate(
        [_rank_memory(cfg, cluster, layout, vocab, s) for s in range(cfg.parallel.pp)],
        cluster,
        layout,
    )


def _rank_memory(
    cfg: Config, cluster: Cluster, layout: Layout, vocab: int, pp_rank: int
) -> RankMemory:
    out = RankMemory(pp_rank)
    levels, counts = zero_levels(cfg), domain_counts(cfg, layout)
    every = flat_groups(cfg, layout, vocab, pp_rank)
    groups = [g for g in every if not g.frozen]  # those with gradients and optimizer state
    padded = sum(g.padded for g in groups)
    devices = offload_devices(cfg)
    sharded = levels["params"] != "none"

    def share(kind: str) -> float:
        """Elements of this rank's chunk of the groups (frozen ones: parameters only) at `kind`'s
        level."""
        held = every if kind in ("params", "secondary") else groups
        return sum(g.padded / counts[g.domain][levels[kind]] for g in held)

    # parameters: the shard at the params level (+ the hpZ copy), or the whole flat buffer
    shard = share("params") * FP32
    params_tier = (
        "device"
        if cluster.device.host_memory and devices["params"] == "cpu"
        else TIER_OF[devices["params"]]
    )
    out.add("params", params_tier, shard)
    # model.lora's frozen weights without ZeRO-3: whole on every rank, outside the flat groups
    frozen = 0 if sharded else frozen_elements(cfg, vocab, pp_rank) * FP32
    out.add("params", "device", frozen)
    resident_mb = cfg.offload.params.resident_mb
    # resident shards, those kept after use and read ahead
    if params_tier == "nvme" and resident_mb is not None:
        _add_resident_shards(out, cfg, every, resident_mb * 2**20, counts[""][levels["params"]])
    if levels["secondary"] != "none" and sharded:
        out.add("params", "device", share("secondary") * FP32)
    if sharded:
        out.add("gathered", "device", _gathered_peak(every, cfg.zero.prefetch_blocks + 1) * FP32)

    # gradients: the whole buffer unless partitioned, plus the optimizer chunk when that is finer
    if levels["grads"] == "none":
        out.add("grads", "device", padded * FP32)
    else:
        out.add("grads", "device", share("grads") * FP32)
        # Each group's gradient lives until its reduce-scatter has run: the one being filled and the
        # one being reduced while the network keeps pace with backward. Where it does not (gloo on
        # a loaded CPU), reductions queue and hold more, up to every group's at once.
        out.add("buckets", "device", 2 * max((g.padded for g in groups), default=0) * FP32)
    finer = [
        g for g in groups if counts[g.domain][levels["optim"]] != counts[g.domain][levels["grads"]]
    ]
    out.add(
        "grads", "device", sum(g.padded / counts[g.domain][levels["optim"]] for g in finer) * FP32
    )

    # optimizer: AdamW's two fp32 moments of the optimizer chunk, wherever offload puts them
    moments = ADAM_MOMENTS * share("optim") * FP32
    out.add("optim", TIER_OF[devices["optim"]], moments)

    for tier, nbytes in activation_bytes(cfg, layout, vocab, pp_rank).items():
        out.add("activations", tier, nbytes)

    if cfg.offload.enabled or cfg.activations.offload != "none":
        out.add("pool", "host", cfg.offload.host_buffer_mb * 2**20)
        # the CPU update's two pinned buffers
        if not cluster.device.host_memory and devices["optim"] != "none":
            out.add("pool", "host", 2 * cfg.offload.slab_mb * 2**20)

    image = _image_bytes(every, counts, frozen)
    if cfg.checkpoint.async_save:
        out.add("staging", "host", image)
    snap = cfg.snapshot
    if snap.every_steps:
        # the rank's own image, and its share of the fragments the node's agent keeps: every
        # rank's image is cut into k pieces plus m parity pieces stored on k + m nodes
        out.add("snapshot", "host", image * (1 + (snap.k + snap.m) / snap.k))
    # sized at run time from what the device has free, less 10%
    if params_tier == "nvme" and resident_mb is None:
        free = 0.9 * cluster.device.mem_gib * 2**30 - out.total("device")
        _add_resident_shards(out, cfg, every, free, counts[""][levels["params"]])
    return out


def _image_bytes(groups: list[Group], counts: dict[str, dict[str, int]], frozen: int) -> float:
    """Bytes of a rank's share of a checkpoint image: each group's parameters (and the moments of
    those that train) over its domain's data-parallel ranks, and of `frozen` bytes held whole
    (a replicated box is written by each holder in part)."""
    moments = [0 if g.frozen else ADAM_MOMENTS for g in groups]
    image = sum(
        g.padded * FP32 * (1 + m) / counts[g.domain]["global"] for g, m in zip(groups, moments)
    )
    return image + frozen / counts[""]["global"]


def _gathered_peak(groups: list[Group], window: int) -> int:
    """Elements ZeRO-3 holds gathered at once: the running unit's groups and those of the units
    prefetched ahead (`window` units in all; an MoE block's groups of each domain are one unit)."""
    units: dict[str, int] = {}
    for g in groups:
        units[g.name] = units.get(g.name, 0) + g.padded
    sizes = list(units.values())
    return max((sum(sizes[i : i + window]) for i in range(len(sizes))), default=0)


def _add_resident_shards(
    out: RankMemory, cfg: Config, groups: list[Group], budget: float, ranks: int
) -> None:
    """NVMe parameter shards on the device: those `budget` bytes keep resident (strata/offload/params.py
    takes them in the update's order while they fit), then the `keep_groups` kept after use and
    the `read_ahead` read in front of the gathers, the largest of the others at once."""
    resident, others = [], []
    for g in groups:
        if g.padded / ranks * FP32 <= budget:
            resident.append(g.padded)
            budget -= g.padded / ranks * FP32
        else:
            others.append(g.padded)
    kept = cfg.offload.params.keep_groups + cfg.offload.params.read_ahead
    largest = sorted(others, reverse=True)[:kept]
    out.add("params", "device", (sum(resident) + sum(largest)) / ranks * FP32)
