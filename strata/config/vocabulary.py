"""The vocabulary the config shares with the layers above it: hierarchy levels, pipeline schedule
names, precisions, offload devices and streams, and the arithmetic on them that the schema's checks
and the code that acts on a config must agree on (the layout a world size allows, how a group of
ranks falls on the nodes, what the model's sizes allow tensor and expert parallelism to split, the
padded vocabulary, which streams use the host pool, where snapshot fragments fit). A rule the
parallel layers must hold too is stated here once, with its message, and both call it.

This module is the bottom of `strata.config`: it imports nothing of the schema. What its functions
read of a config is stated as protocols (`ParallelShape`, ...), which the schema's dataclasses satisfy.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from collections.abc import Iterable, Sequence
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


class ExpertShape(ParallelShape, Protocol):
    """What the expert-parallel layout functions read of a `strata.config.schema.ParallelConfig`."""

    @property
    def ep(self) -> int:
        """parallel.ep: the ranks each MoE layer's experts are split over."""

    @property
    def ep_dispatch(self) -> str:
        """parallel.ep_dispatch: flat, hierarchical or auto."""


class VocabShape(Protocol):
    """What `padded_vocab_size` reads of a `strata.config.schema.ModelConfig`."""

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary (model.vocab_size; None: the data's)."""

    @property
    def pad_vocab_multiple(self) -> int:
        """What the embedding's rows are padded to a multiple of (model.pad_vocab_multiple)."""


class MoEShape(Protocol):
    """What the split rules read of a `strata.config.schema.MoEConfig`."""

    @property
    def num_experts(self) -> int: ...
    @property
    def first_dense_layers(self) -> int: ...


class ModelShape(VocabShape, Protocol):
    """What the tensor-parallel split rules read of a `strata.config.schema.ModelConfig`."""

    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def ffn_hidden(self) -> int | None: ...
    @property
    def ffn_size(self) -> int: ...
    @property
    def moe(self) -> MoEShape: ...


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
            f"divide it ({', '.join(map(str, fits))}) or be a multiple of it, so each "
            "tensor-parallel group stays inside one node (as Megatron does) or spans whole nodes"
        )
    return problems


def unit_pieces(ranks: Iterable[int], unit: int) -> list[list[int]]:
    """`ranks` in their order, cut where they pass from one unit of `unit` consecutive ranks into
    the next (the launchers fill node n with ranks [n·R, (n+1)·R), and a node's GPUs likewise):
    a group's pieces on each node, or on each GPU."""
    return [list(p) for _, p in itertools.groupby(ranks, key=lambda r: r // unit)]


def uneven_sizes(pieces: Sequence[Sequence[int]]) -> list[int]:
    """The sizes of `pieces`, ascending, where they differ; [] where all are equally large, as
    partitioning or exchanging inside each unit needs."""
    sizes = sorted({len(p) for p in pieces})
    return sizes if len(sizes) > 1 else []


def span_problem(ranks: Sequence[int], per_node: int) -> str | None:
    """Why `ranks` do not span several nodes of `per_node` ranks in pieces of one size (what an
    exchange in two hops, across the nodes and then inside each, needs), or None."""
    pieces = unit_pieces(ranks, per_node)
    if sizes := uneven_sizes(pieces):
        return f"are cut by the nodes into pieces of {sizes} ranks"
    return "lie on one node" if len(pieces) == 1 else None


def expert_pool_problem(ep: int, tp: int, replicas: int) -> str | None:
    """Why expert-parallel groups of `ep` consecutive ranks do not fold into a pipeline stage's
    tp · `replicas` (dp·cp) ranks (Megatron-core's MoE parallel folding), or None."""
    pool = tp * replicas
    if pool % ep == 0:
        return None
    return (
        f"parallel.ep={ep} must divide a pipeline stage's tp·dp·cp = {tp}·{replicas} = {pool} ranks"
    )


def ep_dispatch_problem(ep: int, dispatch: str, per_node: int, source: str) -> str | None:
    """Why parallel.ep_dispatch=`dispatch` cannot exchange tokens inside the expert-parallel groups
    of `ep` ranks on nodes of `per_node` ranks (`source` says where that number came from), or None.
    The hierarchical dispatch sends across the nodes a group spans and then inside each node, so
    every group must span several nodes in pieces of one size. The groups are the world's runs of
    `ep` consecutive ranks (`parallel.topology.ExpertLayout`'s "ep" groups) and the nodes its runs
    of `per_node`, so the first group decides for all: they do where ep is a multiple of per_node."""
    if ep == 1 or dispatch != "hierarchical":
        return None
    why = span_problem(range(ep), per_node)
    if not why:
        return None
    return (
        f"parallel.ep_dispatch=hierarchical needs each expert-parallel group of {ep} ranks to span "
        f"several nodes in pieces of one size, but with {source}, ranks 0..{ep - 1} {why}; use "
        f"ep_dispatch=flat or auto, or a parallel.ep that is a multiple of {per_node} (at least "
        f"{2 * per_node})"
    )


def expert_layout_problems(
    par: ExpertShape, world_size: int | None, local_world_size: int | None = None
) -> list[str]:
    """Why the experts' layout of `par` (`parallel.topology.expert_layout`) cannot be made in a
    world of `world_size` ranks whose dense layout passes `layout_problems`: the expert-parallel
    groups must fold into each stage's ranks, and the dispatch must fit how they lie on the nodes.
    Without a world size, only what a set parallel.ranks_per_node decides alone: the dispatch."""
    if world_size is not None:
        pool = expert_pool_problem(par.ep, par.tp, par.dp_size(world_size) * par.cp)
        if pool:
            return [pool]
        per_node, source = ranks_per_node(par, world_size, local_world_size)
    elif par.ranks_per_node is not None:
        per_node, source = par.ranks_per_node, f"parallel.ranks_per_node={par.ranks_per_node}"
    else:
        return []
    dispatch = ep_dispatch_problem(par.ep, par.ep_dispatch, per_node, source)
    return [dispatch] if dispatch else []


# --- what the model's sizes allow the parallel layers to split -----------------------------------
def heads_split_problem(m: ModelShape, tp: int) -> str | None:
    """Why tensor parallelism cannot give each of `tp` ranks whole attention heads, or None."""
    if m.n_heads % tp:
        return f"parallel.tp={tp} must divide model.n_heads={m.n_heads}"
    if m.kv_heads % tp:
        return f"parallel.tp={tp} must divide model.n_kv_heads={m.kv_heads}"
    return None


def sequence_split_problem(seq_len: int, tp: int, sequence_parallel: bool) -> str | None:
    """Why sequence parallelism cannot split `seq_len` positions over `tp` ranks, or None."""
    if not sequence_parallel or tp == 1 or seq_len % tp == 0:
        return None
    return (
        f"parallel.sequence_parallel splits the sequence over tp={tp} ranks: "
        f"model.seq_len={seq_len} must be a multiple of tp"
    )


def ffn_split_problem(m: ModelShape, tp: int) -> str | None:
    """Why tensor parallelism cannot split the SwiGLU width over `tp` ranks, or None. A width left
    to its default matters only where some layer is dense (MoE experts are not split over tp)."""
    if m.ffn_hidden:
        return (
            None
            if m.ffn_hidden % tp == 0
            else (f"parallel.tp={tp} must divide model.ffn_hidden={m.ffn_hidden}")
        )
    dense = m.moe.num_experts == 0 or m.moe.first_dense_layers > 0
    if not dense or m.ffn_size % tp == 0:
        return None
    return (
        f"parallel.tp={tp} must divide the dense layers' SwiGLU width {m.ffn_size} (model.ffn_hidden "
        "null: 2/3·4·d_model rounded up to a multiple of 32); set model.ffn_hidden to a multiple "
        "of tp"
    )


def vocab_split_problem(m: VocabShape, tp: int) -> str | None:
    """Why the vocabulary cannot be split over `tp` ranks, or None. It never depends on the layout
    (unlike Megatron, which pads to a multiple of 128·tp), so that a checkpoint loads into any tp
    degree: the padding multiple must suit every tp."""
    if m.vocab_size:
        return (
            None
            if m.vocab_size % tp == 0
            else (f"parallel.tp={tp} must divide model.vocab_size={m.vocab_size}")
        )
    if m.pad_vocab_multiple % tp == 0:
        return None
    return (
        f"parallel.tp={tp} must divide model.pad_vocab_multiple={m.pad_vocab_multiple} (the "
        "vocabulary is padded to a multiple of it and split over tp ranks); use a multiple of tp "
        "such as 128"
    )


def moe_tensor_parallel_problem(tp: int, sequence_parallel: bool) -> str | None:
    """Why MoE layers cannot run under tensor parallelism of `tp` ranks, or None."""
    if tp == 1 or sequence_parallel:
        return None
    return (
        f"MoE layers with parallel.tp={tp} need parallel.sequence_parallel=true (each "
        "tensor-parallel rank routes its own part of the sequence, as Megatron-core requires)"
    )


def tensor_split_problems(m: ModelShape, tp: int, sequence_parallel: bool) -> list[str]:
    """Every rule above that tensor parallelism over `tp` ranks needs of the model `m`: what
    `parallel.tensor.apply_tensor_parallel` refuses (the config's checks report each in its place)."""
    problems = [
        heads_split_problem(m, tp),
        sequence_split_problem(m.seq_len, tp, sequence_parallel),
        ffn_split_problem(m, tp),
        vocab_split_problem(m, tp),
        moe_tensor_parallel_problem(tp, sequence_parallel) if m.moe.num_experts else None,
    ]
    return [p for p in problems if p]


def experts_split_problem(num_experts: int, ep: int) -> str | None:
    """Why `num_experts` experts cannot be split evenly over `ep` ranks, or None."""
    if num_experts % ep == 0:
        return None
    return f"parallel.ep={ep} must divide model.moe.num_experts={num_experts}"


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


# --- LoRA targets and frozen parameters (model.lora, train.freeze) ------------------------------
# PEFT's names of a Llama block's linear layers -> Strata's module inside block N (`layers.N.`). A
# name also covers an MoE layer's shared experts' projection of that kind.
LORA_TARGETS = {
    "q_proj": "attn.wq",
    "k_proj": "attn.wk",
    "v_proj": "attn.wv",
    "o_proj": "attn.wo",
    "gate_proj": "mlp.w1",
    "up_proj": "mlp.w3",
    "down_proj": "mlp.w2",
}
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output layer


def lora_target_kinds(target_modules: Iterable[str]) -> list[str]:
    """PEFT's module names a `model.lora.target_modules` list stands for, in LORA_TARGETS' order
    (`all-linear`: all of them)."""
    names = set(target_modules)
    return [n for n in LORA_TARGETS if n in names or ALL_LINEAR in names]


FREEZE_ALIASES = {
    "embeddings": ("tok_embeddings.weight",),
    "output": ("output.weight",),
    "norms": ("*norm.weight",),
}
_LAYER_RANGE = re.compile(r"layers\.(\d+)-(\d+)((?:\..+)?)")


def freeze_pattern_problem(pattern: str) -> str | None:
    """Why a `train.freeze` item can name no parameter (empty, a reversed layer range), or None."""
    if not pattern.strip():
        return "train.freeze: an empty item names nothing; remove it"
    rng = _LAYER_RANGE.fullmatch(pattern)
    if rng and int(rng[1]) > int(rng[2]):
        return (
            f"train.freeze: {pattern!r} is a reversed layer range; give layers.FIRST-LAST with "
            f"FIRST <= LAST, e.g. layers.{rng[2]}-{rng[1]}{rng[3]}"
        )
    return None


def _expand(pattern: str) -> tuple[str, ...]:
    """A `train.freeze` item as globs over parameter names: aliases and layer ranges expanded."""
    if pattern in FREEZE_ALIASES:
        return FREEZE_ALIASES[pattern]
    rng = _LAYER_RANGE.fullmatch(pattern)
    if rng:
        return tuple(f"layers.{i}{rng[3]}" for i in range(int(rng[1]), int(rng[2]) + 1))
    return (pattern,)


def frozen_by(pattern: str, name: str) -> bool:
    """Whether `train.freeze` item `pattern` names the parameter `name` (Strata's state_dict name,
    `layers.3.attn.wq.weight`): an alias (embeddings, output, norms), the name itself or a module
    above it (`layers.3`, `layers.3.attn`), a layer range (`layers.0-7`, `layers.0-7.mlp`) or a
    glob of either (`layers.*.attn_norm.weight`, `layers.*.attn`)."""
    return any(
        fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(name, glob + ".*")
        for glob in _expand(pattern)
    )
