"""The groups that say where training state lives: `zero:` (partitioning over a hierarchy level),
`co2:` (asynchronous updates across nodes), `offload:` (host memory and NVMe tiers) and
`activations:` (kept, offloaded or recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.config.schema.fields import nested, opt
from strata.config.vocabulary import LEVELS, OFFLOAD_DEVICES, coarseness


@dataclass(frozen=True)
class ShardSpec:
    """Where one kind of training state is partitioned."""

    shard_over: str = opt(
        "none",
        "hierarchy level whose data-parallel ranks split it (none: not split; gcd = none)",
        choices=LEVELS,
    )


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO: parameters, gradients and optimizer state partitioned over the data-parallel ranks of a level."""

    params: ShardSpec = nested(
        ShardSpec,
        "where parameters are partitioned; anything but none = ZeRO-3 (gathered "
        "per block just before use, freed after)",
    )
    grads: ShardSpec = nested(
        ShardSpec,
        "where gradients are partitioned (reduce-scattered per micro-batch as backward produces "
        "them): ZeRO-2",
    )
    optim: ShardSpec = nested(
        ShardSpec, "where optimizer states (and the fp32 update) are partitioned: ZeRO-1"
    )
    secondary_params: ShardSpec = nested(
        ShardSpec,
        "hpZ (ZeRO++): a second copy of the parameters partitioned at "
        "this finer level, gathered for backward and later micro-batches instead "
        "of the primary one; none = off",
    )
    prefetch_blocks: int = opt(
        1, "flat groups gathered ahead of the one running (forward and backward)", min=0
    )
    bucket_mb: float = opt(
        0.0,
        "merge consecutive transformer blocks into one flat group (one gather, one "
        "reduce-scatter) until it holds at least this many MB of parameters; 0 = one group "
        "per block",
        min=0.0,
    )
    hierarchical: bool = opt(
        True,
        "reduce-scatter inside the fastest level first, then across (and all-gather "
        "the other way); false = one collective over the whole shard group",
    )

    @property
    def enabled(self) -> bool:
        """Whether any state is partitioned at all (gcd partitions nothing: one rank per GCD)."""
        return any(
            coarseness(s.shard_over) > coarseness("none")
            for s in (self.params, self.grads, self.optim)
        )


@dataclass(frozen=True)
class CO2Config:
    """CO2: nodes train as independent replicas, averaged by an outer all-reduce every round."""

    enabled: bool = opt(
        False, "use CO2 across nodes (inside a node: ordinary data parallelism); needs >= 2 nodes"
    )
    outer_every: int = opt(2, "H: local optimizer steps per round", min=1)
    outer_lr: float = opt(0.8, "outer learning rate applied to the averaged round delta", min=0.0)
    outer_momentum: float = opt(0.0, "outer momentum", min=0.0, max=1.0, max_exclusive=True)
    staleness_penalty: float = opt(
        0.0,
        "staleness gap penalty on a replica's not-yet-averaged progress (0: keep it whole)",
        min=0.0,
    )
    clip: float = opt(
        0.0, "clip the outer momentum's L2 norm to this (0 = no outer-momentum clipping)", min=0.0
    )
    overlap: bool = opt(
        True,
        "apply each round's average one round late, overlapping its all-reduce with the next "
        "round; false: wait for the outer all-reduce at once and apply it in the same round "
        "(synchronous)",
    )


@dataclass(frozen=True)
class ParamOffloadConfig:
    """Where ZeRO-3 parameter shards live between uses (ZeRO-Infinity)."""

    device: str = opt(
        "none",
        "none: on the training device; cpu: host memory; nvme: swap files under "
        "offload.nvme_path (read ahead of use, written back after the step)",
        choices=OFFLOAD_DEVICES,
    )
    read_ahead: int = opt(
        1, "flat groups whose shards are read ahead of the gather prefetch", min=0
    )
    keep_groups: int = opt(
        2,
        "shards kept in memory after their last use, most recent first, so the turns "
        "(forward to backward, backward to the update) read nothing (0: drop every shard once "
        "gathered)",
        min=0,
    )
    resident_mb: float | None = opt(
        0.0,
        "device memory for shards that stay in memory for good once read (never re-read nor "
        "written "
        "back; DeepSpeed's max_reuse_distance taken to its end); null: what the device had free at "
        "the first step's peak, less 10% of its memory, shared by the ranks on it (0: none)",
        min=0.0,
    )


@dataclass(frozen=True)
class OptimOffloadConfig:
    """Where optimizer states (AdamW's moments) live, and where each sub-group's update runs."""

    device: str = opt(
        "none",
        "none: on the training device; cpu: host memory; nvme: swap files, stepped in "
        "sub-groups of one slab (read next, update current, write previous)",
        choices=OFFLOAD_DEVICES,
    )
    update_on: str = opt(
        "auto",
        "where offloaded sub-groups are updated: cpu, gpu, or auto (Deep Optimizer States: "
        "per sub-group, by a performance model calibrated at start-up; all-CPU without CUDA)",
        choices=("auto", "cpu", "gpu"),
    )


@dataclass(frozen=True)
class OffloadConfig:
    """Memory tiers: ZeRO state in host memory or NVMe swap files, through one budgeted host buffer pool."""

    nvme_path: str | None = opt(
        None,
        "directory for swap files on a local SSD (needed when a device is nvme); checked and "
        "preallocated at start-up",
    )
    host_buffer_mb: float = opt(
        64.0,
        "staging budget per rank: every transfer streams through slabs of this "
        "pool (pinned when CUDA exists); a transfer beyond it waits, then fails clearly",
        min=0.0,
        min_exclusive=True,
    )
    slab_mb: float = opt(
        4.0,
        "slab size (a multiple of 4 KiB); also the optimizer sub-group size",
        min=0.0,
        min_exclusive=True,
    )
    io_threads: int = opt(4, "I/O threads per rank for swap files", min=1)
    direct_io: bool = opt(
        True,
        "O_DIRECT swap I/O, bypassing the page cache (falls back to buffered I/O on file "
        "systems that refuse it)",
    )
    params: ParamOffloadConfig = nested(ParamOffloadConfig)
    optim: OptimOffloadConfig = nested(OptimOffloadConfig)

    @property
    def enabled(self) -> bool:
        """Whether any ZeRO state is offloaded (to host memory or NVMe)."""
        return self.params.device != "none" or self.optim.device != "none"


@dataclass(frozen=True)
class ActivationsConfig:
    """The activation policy: what backward's saved tensors cost (kept, offloaded, or recomputed)."""

    offload: str = opt(
        "none",
        "where saved activations go during forward until backward needs them: none (kept), "
        "cpu (host memory) or nvme (swap file under offload.nvme_path); written asynchronously, "
        "stored once when several ops save one tensor, prefetched a layer ahead in backward",
        choices=OFFLOAD_DEVICES,
    )
    min_bytes: int = opt(
        1 << 20,
        "never offload a saved tensor whose storage is smaller than this (parameters never are)",
        min=0,
    )
    max_inflight_mb: float | None = opt(
        None,
        "bound on the saved tensors kept in memory while their offload "
        "writes are in flight: forward waits for the disk beyond it, which "
        "guarantees the saving (null: never wait; a fast GPU then serves most "
        "from memory and saves little)",
        min=0.0,
    )
    recompute: str = opt(
        "none",
        "full: recompute each transformer block's forward in backward instead of saving "
        "its activations (torch.utils.checkpoint); selective: keep the matmul and attention "
        "outputs "
        "and recompute only the cheap, memory-heavy ops between them (norms, RoPE, SiLU, products)",
        choices=("none", "selective", "full"),
    )
