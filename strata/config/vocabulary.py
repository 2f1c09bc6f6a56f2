"""The vocabulary the config shares with the layers above it: hierarchy levels, pipeline schedule
names, precisions, offload devices and streams, and the arithmetic on them that the schema's checks
and the code that acts on a config must agree on (the layout a world size allows, the padded
vocabulary, which streams use the host pool, where snapshot fragments fit).

This module is the bottom of `strata.config`: it imports nothing of the schema. What its functions
read of a config is stated as protocols (`ParallelShape`, ...), which the schema's dataclasses satisfy.
"""

from __future__ import annotations

import math
from typing import Protocol

from strata.errors import ConfigError

# --- the hierarchy vocabulary (parallel.topology maps ranks onto these levels) ---------------
LEVELS = ("none", "gcd", "gpu", "node", "global")  # hierarchy levels, finest to coarsest
CHAIN = ("none", "gpu", "node", "global")  # the levels partitioning tells apart ("gcd" is "none")


def chain_level(level: str) -> str:
    """`level` as a step of CHAIN: one rank drives one GCD, so partitioning "within a GCD" is none."""
    if level not in LEVELS:
        raise ValueError(f"unknown hierarchy level {level!r}; expected one of {LEVELS}")
    return "none" if level == "gcd" else level


def coarseness(level: str) -> int:
    """Order of hierarchy levels: none = gcd < gpu < node < global (topology's CHAIN)."""
    return CHAIN.index(chain_level(level))


# --- compute precision and the pipeline schedules ----------------------------------------------
PRECISIONS = ("fp32", "bf16", "fp8")

# Schedules of torch.distributed.pipelining; the first two run one stage per rank.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
V_SHAPED_SCHEDULES = ("zbv_zero_bubble", "dualpipev")  # exactly two stages per rank, in a V
PIPELINE_SCHEDULES = (
    "auto",
    *SINGLE_STAGE_SCHEDULES,
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    *V_SHAPED_SCHEDULES,
)
# These compute weight gradients in a later pass than the input gradients (past the ZeRO engine's
# hooks).
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", *V_SHAPED_SCHEDULES)


# --- what the functions below read of a config ---------------------------------------------------
class ParallelShape(Protocol):
    """What the layout functions read of a `strata.config.schema.ParallelConfig`."""

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (parallel.tp)."""

    @property
    def pp(self) -> int:
        """The pipeline-parallel degree (parallel.pp)."""

    @property
    def cp(self) -> int:
        """The context-parallel degree (parallel.cp)."""

    @property
    def ranks_per_node(self) -> int | None:
        """Ranks on one node (parallel.ranks_per_node; None: the launcher's LOCAL_WORLD_SIZE)."""

    @property
    def ranks_per_gpu(self) -> int:
        """Ranks sharing one GPU (parallel.ranks_per_gpu: 2 for an MI250X's GCDs)."""

    def dp_size(self, world_size: int) -> int:
        """The data-parallel degree in a world of `world_size` ranks (parallel.dp, else what
        tp·cp·pp leave)."""


class VocabShape(Protocol):
    """What `padded_vocab_size` reads of a `strata.config.schema.ModelConfig`."""

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary (model.vocab_size; None: the data's)."""

    @property
    def pad_vocab_multiple(self) -> int:
        """What the embedding's rows are padded to a multiple of (model.pad_vocab_multiple)."""


class SnapshotShape(Protocol):
    """What `snapshot_nodes_problem` reads of a `strata.config.schema.SnapshotConfig`."""

    @property
    def every_steps(self) -> int:
        """Steps between in-memory snapshots (snapshot.every_steps; 0: off)."""

    @property
    def k(self) -> int:
        """Data fragments each rank's snapshot is cut into (snapshot.k)."""

    @property
    def m(self) -> int:
        """Parity fragments (snapshot.m): how many whole nodes may be lost; 0 keeps snapshots
        local."""


class DeviceShape(Protocol):
    """Where one kind of ZeRO state is offloaded (`offload.params`, `offload.optim`)."""

    @property
    def device(self) -> str:
        """Where the state lives: none (the training device), cpu (host memory) or nvme."""


class OffloadShape(Protocol):
    """What `offload_devices` reads of a `strata.config.schema.OffloadConfig`."""

    @property
    def params(self) -> DeviceShape:
        """Where the parameters are offloaded (offload.params)."""

    @property
    def optim(self) -> DeviceShape:
        """Where the optimizer states are offloaded (offload.optim)."""


class ActivationsShape(Protocol):
    """What `offload_devices` reads of a `strata.config.schema.ActivationsConfig`."""

    @property
    def offload(self) -> str:
        """Where saved activations are offloaded (activations.offload: none, cpu or nvme)."""


class TiersShape(Protocol):
    """What `offload_devices` reads of a whole `strata.config.schema.Config`."""

    @property
    def offload(self) -> OffloadShape:
        """The parameters' and optimizer states' offload settings (offload:)."""

    @property
    def activations(self) -> ActivationsShape:
        """The activations' settings (activations:)."""


# --- the parallel layout -------------------------------------------------------------------------
def ranks_per_node(
    par: ParallelShape, world_size: int, local_world_size: int | None
) -> tuple[int, str]:
    """How many ranks one node runs, and where that number came from (for messages): a set
    parallel.ranks_per_node wins over the launcher's LOCAL_WORLD_SIZE, so one machine can stand in
    for several nodes; with neither, the world is one node."""
    if par.ranks_per_node is not None:
        return par.ranks_per_node, f"parallel.ranks_per_node={par.ranks_per_node}"
    if local_world_size is not None:
        return (
            local_world_size,
            f"parallel.ranks_per_node (null: the launcher's LOCAL_WORLD_SIZE={local_world_size})",
        )
    return world_size, f"parallel.ranks_per_node (null, no launcher: the world size {world_size})"


def layout_problems(
    par: ParallelShape, world_size: int, local_world_size: int | None = None
) -> list[str]:
    """Why `par` cannot lay out a world of `world_size` ranks: the degrees must multiply to it, nodes
    must hold whole GPUs and equal rank counts, and tp groups may not straddle nodes partway
    (`parallel.topology.layout_from_config` builds the layout once these pass)."""
    tp, pp, cp, g = par.tp, par.pp, par.cp, par.ranks_per_gpu
    per_node, source = ranks_per_node(par, world_size, local_world_size)
    problems = []
    fixed, names = tp * pp * cp, "tp·pp" if cp == 1 else "tp·pp·cp"
    shown = f"{tp}·{pp}" if cp == 1 else f"{tp}·{pp}·{cp}"
    if world_size % fixed:
        problems.append(
            f"world size {world_size} is not divisible by parallel.{names} = {shown} = {fixed}; "
            f"choose degrees whose product divides the number of ranks"
        )
    else:
        dp = par.dp_size(world_size)
        if fixed * dp != world_size:
            problems.append(
                f"parallel: {names}·dp = {shown}·{dp} = {fixed * dp} but the world size is "
                f"{world_size}; set parallel.dp={world_size // fixed} or leave it null"
            )
    if world_size % per_node:
        problems.append(
            f"world size {world_size} is not a multiple of {source}: every node must run the same "
            f"number of ranks; set parallel.ranks_per_node to a divisor of {world_size}"
        )
    if per_node % g:
        problems.append(f"parallel.ranks_per_gpu={g} must divide {source}: a node holds whole GPUs")
    if tp % per_node and per_node % tp:
        fits = [d for d in range(1, per_node + 1) if per_node % d == 0]
        problems.append(
            f"parallel.tp={tp} would straddle node boundaries unevenly: with {source}, tp must "
            "divide "
            f"it ({', '.join(map(str, fits))}) or be a multiple of it, so each tensor-parallel "
            "group "
            f"stays inside one node (as Megatron does) or spans whole nodes"
        )
    return problems


# --- the vocabulary and tokenizers ---------------------------------------------------------------
def padded_vocab_size(cfg: VocabShape, data_vocab_size: int) -> int:
    """The model's vocabulary: config's if set (must cover the data), else the data's padded up."""
    if cfg.vocab_size:
        if cfg.vocab_size < data_vocab_size:
            raise ConfigError(
                [
                    f"model.vocab_size={cfg.vocab_size} is smaller than the data's vocabulary "
                    f"({data_vocab_size}); set it >= {data_vocab_size} or leave it null"
                ]
            )
        return cfg.vocab_size
    m = cfg.pad_vocab_multiple
    return m * math.ceil(data_vocab_size / m)


BPE_MIN_VOCAB = 257  # a byte-level BPE: the 256 byte symbols plus the end-of-document token
BPE_MAX_VOCAB = 1 << 24


def bpe_problem(spec: str) -> str | None:
    """Why a `bpe:N` tokenizer spec is malformed (None: it is well formed, or not a bpe spec)."""
    if not spec.startswith("bpe:"):
        return None
    n = spec[4:]
    if n.isdigit() and BPE_MIN_VOCAB <= int(n) <= BPE_MAX_VOCAB:
        return None
    return (
        f"tokenizer {spec!r}: bpe:N needs a whole vocabulary size N in "
        f"{BPE_MIN_VOCAB}..{BPE_MAX_VOCAB} "
        "(256 bytes plus the end-of-document token at least), e.g. bpe:8192"
    )


# --- memory tiers --------------------------------------------------------------------------------
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# What moves between memory tiers (offload.tiers), and the key that says where each lives.
OFFLOAD_STREAM_KEYS = {
    "params": "offload.params.device",
    "optim": "offload.optim.device",
    "activations": "activations.offload",
}
SLABS_PER_STREAM = 2  # of the host pool, guaranteed to each stream that uses it


def offload_devices(cfg: TiersShape) -> dict[str, str]:
    """Where each offload stream lives (none, cpu or nvme), by stream name."""
    return {
        "params": cfg.offload.params.device,
        "optim": cfg.offload.optim.device,
        "activations": cfg.activations.offload,
    }


def pool_streams(devices: dict[str, str]) -> list[str]:
    """The streams that move through the host pool's slabs: every swap to NVMe, and ZeRO state kept
    in host memory (activations kept on the host have buffers of their own)."""
    return [s for s, d in devices.items() if d == "nvme" or (s != "activations" and d == "cpu")]


# --- snapshots -----------------------------------------------------------------------------------
def snapshot_nodes_problem(snap: SnapshotShape, nodes: int) -> str | None:
    """Why `nodes` nodes cannot hold the k + m fragments of every rank's snapshot (one per node), or None."""
    if not snap.every_steps or snap.k + snap.m <= nodes:
        return None
    return (
        f"snapshot.k + snapshot.m = {snap.k} + {snap.m} fragments of each rank's snapshot go to "
        "as many nodes, "
        f"but this job has {nodes}; set snapshot.m={max(nodes - snap.k, 0)} (m=0: local "
        "snapshots, which survive "
        "worker crashes but not the loss of a node)"
    )
