"""The `parallel:` group: how ranks are combined (tensor, pipeline and data parallel degrees, the
pipeline schedule, the node layout) and the process groups' backend, buckets and timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.config.schema.fields import opt
from strata.config.vocabulary import PIPELINE_SCHEDULES


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks are combined. world size = tp · cp · dp · pp."""

    tp: int = opt(1, "tensor-parallel degree", min=1)
    pp: int = opt(1, "pipeline-parallel degree", min=1)
    dp: int | None = opt(None, "data-parallel degree (null: world size / (tp·cp·pp))", min=1)
    cp: int = opt(
        1,
        "context-parallel degree: each sequence split over this many consecutive ranks after tp "
        "(causal load-balanced: rank i holds chunks i and 2·cp−1−i of 2·cp), attention computed "
        "across the split; the ranks hold the same weights, so gradients and ZeRO partitions span "
        "dp·cp ranks",
        min=1,
    )
    cp_mode: str = opt(
        "auto",
        "how attention crosses the split: ring (K/V blocks passed rank to rank, overlapped with "
        "the block "
        "computation) or alltoall (DeepSpeed-Ulysses: sequence split to head split and back; cp "
        "must divide the "
        "heads per tensor-parallel rank); auto: alltoall where cp divides those heads, else ring",
        choices=("auto", "ring", "alltoall"),
    )
    ep: int = opt(
        1,
        "expert-parallel degree (MoE models): each MoE layer's experts split over this many "
        "consecutive ranks of a pipeline stage's tp·dp ranks (tp first, Megatron's MoE parallel "
        "folding; with tp=1, carved out of dp); tokens reach their experts by all-to-all, expert "
        "gradients are averaged over the other (tp·dp)/ep ranks",
        min=1,
    )
    ep_dispatch: str = opt(
        "auto",
        "how tokens reach experts on other ranks: flat (one all-to-all over the expert-parallel "
        "group, Megatron-core's and torchtitan's) or hierarchical (each token sent once to every "
        "node holding its experts, then to the experts' ranks inside the node, so it crosses the "
        "inter-node link at most once per destination node); auto: hierarchical where the "
        "expert-parallel group spans several nodes",
        choices=("auto", "flat", "hierarchical"),
    )
    virtual_stages: int = opt(
        1,
        "model chunks per pipeline rank (V): layers split into pp·V stages; V > 1 interleaves",
        min=1,
    )
    microbatches: int | None = opt(
        None,
        "micro-batches per step on each data-parallel replica (null: "
        "global_batch_size/(micro_batch_size·dp), Megatron's rule; if set it must agree)",
        min=1,
    )
    schedule: str = opt(
        "auto",
        "pipeline schedule (auto: 1f1b, or interleaved_1f1b when virtual_stages > 1)",
        choices=PIPELINE_SCHEDULES,
    )
    sequence_parallel: bool = opt(
        False,
        "with tp > 1, shard norms/residuals along the sequence (Megatron SP); ignored when tp = 1",
    )
    ranks_per_node: int | None = opt(
        None, "ranks on one node (null: the launcher's LOCAL_WORLD_SIZE)", min=1
    )
    ranks_per_gpu: int = opt(
        1, "ranks sharing one physical GPU (2 for the GCDs of a Frontier MI250X)", min=1
    )

    def dp_size(self, world_size: int) -> int:
        """Data-parallel degree (replicas reading different data): `dp`, or what tp·cp·pp leaves of the world."""
        return self.dp or world_size // (self.tp * self.cp * self.pp)

    backend: str = opt(
        "auto",
        "torch.distributed backend (auto: nccl with GPUs, gloo on CPU)",
        choices=("auto", "gloo", "nccl"),
    )
    bucket_mb: float = opt(
        25.0,
        "data parallel without zero: consecutive transformer blocks share one flat "
        "gradient buffer (one all-reduce) until it holds this many MiB",
        min=0.0,
        min_exclusive=True,
    )
    overlap_grad_reduce: bool = opt(
        True,
        "start each gradient bucket's data-parallel reduction (all-reduce, or ZeRO's "
        "reduce-scatters) as soon as backward has produced it, on process groups of its own, and "
        "wait only before clipping; false = reduce after backward (same numbers either way)",
    )
    timeout_s: int = opt(600, "process-group timeout in seconds", min=1)
    hang_timeout_s: float | None = opt(
        None,
        "when no rank makes progress for this many seconds (one is stopped, or stuck outside or "
        "inside a collective) the job stops with one error naming the stuck rank, its host and its "
        "last collective, long before timeout_s; armed after the first step (or evaluation "
        "micro-batch); null = a fifth of timeout_s; 0 = off",
        min=0.0,
    )

    def hang_after_s(self) -> float:
        """Seconds without progress that count as a hang (0: not watched)."""
        return self.timeout_s / 5 if self.hang_timeout_s is None else self.hang_timeout_s
