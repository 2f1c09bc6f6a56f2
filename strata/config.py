"""The experiment schema: YAML (+ `key.sub=value` overrides) into frozen, validated dataclasses.

This is the one place that parses and checks configuration. Every key has a default and a doc
string (`strata config explain KEY`); `load` reports every problem at once in a ConfigError.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from strata import hf
from strata.errors import ConfigError

# --- the hierarchy vocabulary (parallel.topology maps ranks onto these levels) ---------------
LEVELS = ("none", "gcd", "gpu", "node", "global")  # hierarchy levels, finest to coarsest
CHAIN = ("none", "gpu", "node", "global")  # the levels partitioning tells apart ("gcd" is "none")


def chain_level(level: str) -> str:
    """`level` as a step of CHAIN: one rank drives one GCD, so partitioning "within a GCD" is none."""
    if level not in LEVELS:
        raise ValueError(f"unknown hierarchy level {level!r}; expected one of {LEVELS}")
    return "none" if level == "gcd" else level


def ranks_per_node(par: ParallelConfig, world_size: int, local_world_size: int | None) -> tuple[int, str]:
    """How many ranks one node runs, and where that number came from (for messages): a set
    parallel.ranks_per_node wins over the launcher's LOCAL_WORLD_SIZE, so one machine can stand in
    for several nodes; with neither, the world is one node."""
    if par.ranks_per_node is not None:
        return par.ranks_per_node, f"parallel.ranks_per_node={par.ranks_per_node}"
    if local_world_size is not None:
        return local_world_size, f"parallel.ranks_per_node (null: the launcher's LOCAL_WORLD_SIZE={local_world_size})"
    return world_size, f"parallel.ranks_per_node (null, no launcher: the world size {world_size})"


def layout_problems(par: ParallelConfig, world_size: int, local_world_size: int | None = None) -> list[str]:
    """Why `par` cannot lay out a world of `world_size` ranks: the degrees must multiply to it, nodes
    must hold whole GPUs and equal rank counts, and tp groups may not straddle nodes partway
    (`parallel.topology.layout_from_config` builds the layout once these pass)."""
    tp, pp, g = par.tp, par.pp, par.ranks_per_gpu
    per_node, source = ranks_per_node(par, world_size, local_world_size)
    problems = []
    if world_size % (tp * pp):
        problems.append(
            f"world size {world_size} is not divisible by parallel.tp·pp = {tp}·{pp} = {tp * pp}; "
            f"choose tp and pp whose product divides the number of ranks"
        )
    else:
        dp = par.dp_size(world_size)
        if tp * pp * dp != world_size:
            problems.append(
                f"parallel: tp·pp·dp = {tp}·{pp}·{dp} = {tp * pp * dp} but the world size is "
                f"{world_size}; set parallel.dp={world_size // (tp * pp)} or leave it null"
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
            f"parallel.tp={tp} would straddle node boundaries unevenly: with {source}, tp must divide "
            f"it ({', '.join(map(str, fits))}) or be a multiple of it, so each tensor-parallel group "
            f"stays inside one node (as Megatron does) or spans whole nodes"
        )
    return problems


def opt(
    default: Any,
    doc: str,
    *,
    choices: tuple[Any, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    max_exclusive: bool = False,
    min_items: int | None = None,
    max_items: int | None = None,
    key: str | None = None,
) -> Any:
    """A config key: its default, one-line doc and the range checks `load` applies (to each item of
    a list key, whose length `min_items`/`max_items` bound); `key` is its name in YAML when that
    cannot be the field's (`checkpoint.async`: a Python keyword).

    A list key is typed `tuple[X, ...]` (frozen configs hold no mutable values): YAML gives it as
    a list (`[3, 5]`, also in an override) and `to_dict`/`dump` write it back as one."""
    meta = {
        "doc": doc,
        "choices": choices,
        "min": min,
        "max": max,
        "min_exclusive": min_exclusive,
        "max_exclusive": max_exclusive,
        "min_items": min_items,
        "max_items": max_items,
        "key": key,
    }
    return field(default=default, metadata=meta)


def _key_of(f: dataclasses.Field[Any]) -> str:
    """A field's name in YAML."""
    return f.metadata.get("key") or f.name


def nested(cls: type, doc: str | None = None) -> Any:
    """A group of keys inside a group (`zero.params.shard_over`): the dataclass `cls` with its
    defaults, and a one-line doc (null: the class's docstring)."""
    return field(default_factory=cls, metadata={"doc": doc or cls.__doc__})


ROPE_SCALINGS = ("none", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer (Llama-style: RoPE, RMSNorm, SwiGLU)."""

    n_layers: int = opt(4, "number of transformer blocks", min=1)
    d_model: int = opt(128, "hidden size (width of the residual stream)", min=1)
    n_heads: int = opt(4, "attention heads; must divide d_model unless head_dim is set", min=1)
    n_kv_heads: int | None = opt(None, "key/value heads for grouped-query attention (null: = n_heads)", min=1)
    head_dim: int | None = opt(
        None, "size of each attention head (null: d_model/n_heads); n_heads·head_dim may differ from d_model", min=2
    )
    qkv_bias: bool = opt(False, "bias on the query/key/value projections (Qwen2); the output projection has none")
    qk_norm: bool = opt(False, "RMSNorm over each head's query and key before RoPE, one weight of head_dim (Qwen3)")
    ffn_hidden: int | None = opt(None, "SwiGLU inner size (null: 8/3·d_model rounded up to a multiple of 32)", min=1)
    vocab_size: int | None = opt(None, "vocabulary size (null: the data's, padded to pad_vocab_multiple)", min=1)
    pad_vocab_multiple: int = opt(64, "pad a data-derived vocabulary up to a multiple of this", min=1)
    seq_len: int = opt(128, "tokens per training sequence (context length)", min=1)
    rope_theta: float = opt(10000.0, "RoPE base frequency", min=0.0, min_exclusive=True)
    rope_scaling: str = opt(
        "none",
        "RoPE frequency scaling: none, or llama3 (Llama 3.1's, set by the rope_* keys below)",
        choices=ROPE_SCALINGS,
    )
    rope_factor: float = opt(8.0, "llama3 RoPE scaling: divisor of the low frequencies", min=1.0)
    rope_low_freq_factor: float = opt(
        1.0,
        "llama3 RoPE scaling: wavelengths above original_max/this are divided by rope_factor",
        min=0.0,
        min_exclusive=True,
    )
    rope_high_freq_factor: float = opt(
        4.0,
        "llama3 RoPE scaling: wavelengths below original_max/this are kept (between: interpolated)",
        min=0.0,
        min_exclusive=True,
    )
    rope_original_max_position_embeddings: int = opt(
        8192, "llama3 RoPE scaling: the context length the model was pretrained with", min=1
    )
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", min=0.0, min_exclusive=True)
    tie_embeddings: bool = opt(False, "share the token embedding with the output projection")
    init_from: str | None = opt(
        None,
        "start a new run from these weights (the optimizer, data position and step start fresh): a local "
        "Hugging Face model directory (config.json + model.safetensors or shards; the other model keys are "
        "derived from its config.json, and one set to a different value is an error), or a Strata checkpoint",
    )
    init_std: float = opt(
        0.02,
        "std of the normal init of weights (output projections scaled by 1/sqrt(2·n_layers))",
        min=0.0,
        min_exclusive=True,
    )

    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim, or d_model/n_heads."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_size(self) -> int:
        """SwiGLU inner width: ffn_hidden, or Llama's 2/3·4·d_model rounded up to a multiple of 32."""
        return self.ffn_hidden or 32 * math.ceil(int(8 * self.d_model / 3) / 32)


def padded_vocab_size(cfg: ModelConfig, data_vocab_size: int) -> int:
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


@dataclass(frozen=True)
class DataSource:
    """One dataset of a mixture (an item of data.sources)."""

    path: str = field(metadata={"doc": "directory made by `strata data prepare`"})
    weight: float = opt(
        1.0, "its share of the training samples, relative to the other sources' weights", min=0.0, min_exclusive=True
    )


@dataclass(frozen=True)
class DataConfig:
    """Token data: a prepared directory (train.bin/val.bin + meta.json), a mixture, or the built-in corpus."""

    path: str | None = opt(
        None, "directory made by `strata data prepare` (null: the Python stdlib corpus, prepared on first use)"
    )
    sources: tuple[DataSource, ...] | None = opt(
        None,
        "a mixture instead of data.path (null: none): a list of {path, weight} (e.g. [{path: data/web, weight: 3}, "
        "{path: data/code, weight: 1}]); each step's samples go to the source furthest behind its share "
        "(weights normalised; Megatron's blended dataset), each source in its own seeded order, evaluation "
        "blends the val splits alike. All sources need the same tokenizer",
    )
    cache_dir: str | None = opt(None, "where the built-in corpus is prepared (null: $STRATA_CACHE or ~/.cache/strata)")
    val_fraction: float = opt(0.05, "share of built-in corpus files held out for evaluation", min=0.0, max=0.5)
    tokenizer: str | None = opt(
        None,
        "the tokenizer data.path was prepared with (`strata data prepare --tokenizer`): bytes, bpe:N, or the path "
        "of a tokenizer.json or a model directory holding one; checked against the data's meta.json at start-up "
        "(a path by its content). null: whatever the data says. The built-in corpus is bytes",
    )


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
        f"tokenizer {spec!r}: bpe:N needs a whole vocabulary size N in {BPE_MIN_VOCAB}..{BPE_MAX_VOCAB} "
        "(256 bytes plus the end-of-document token at least), e.g. bpe:8192"
    )


def _data_checks(d: DataConfig) -> list[str]:
    """data.path or data.sources, not both; the sources' paths; data.tokenizer's form (what it
    names, and the sources' vocabularies, are checked against the data at start-up)."""
    p: list[str] = []
    if d.path is not None and d.sources:
        p.append(
            f"data.path={d.path!r} and data.sources (of {len(d.sources)}) are both set: give one, data.path "
            "for one prepared directory or data.sources for a mixture of several"
        )
    first: dict[str, int] = {}
    for i, source in enumerate(d.sources or ()):
        key = f"data.sources[{i}].path"
        if not source.path.strip():
            p.append(f"{key}: empty; give the directory made by `strata data prepare`")
        elif source.path in first:
            p.append(
                f"{key}={source.path!r} is also data.sources[{first[source.path]}]: give each directory once "
                "(with the sum of the weights)"
            )
        else:
            first[source.path] = i
            problem = _path_problem(key, source.path)
            if problem:
                p.append(problem)
    t = d.tokenizer
    if t is None or t == "bytes":
        return p
    if not t.strip():
        return [*p, "data.tokenizer: empty; give bytes, bpe:N, a tokenizer.json path, or null (the data's)"]
    if (problem := bpe_problem(t)) is not None:
        return [*p, f"data.{problem}"]
    if d.path is None and not d.sources:
        p.append(
            f"data.tokenizer={t!r} needs data.path or data.sources (the built-in corpus is byte-level): prepare "
            f"the data with `strata data prepare ... --tokenizer {t}` and set data.path to it"
        )
    return p


PRECISIONS = ("fp32", "bf16", "fp8")


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation loop: batch sizes, steps, precision, evaluation."""

    steps: int = opt(300, "optimizer steps to train for", min=1)
    global_batch_size: int = opt(16, "sequences per optimizer step, over all data-parallel ranks", min=1)
    micro_batch_size: int = opt(
        8, "sequences per forward/backward on one rank; accumulation = global/(micro·dp)", min=1
    )
    seed: int = opt(1234, "seed for init and data order (runs with equal seeds are identical)")
    precision: str = opt(
        "fp32",
        "compute precision: fp32; bf16 autocast; or fp8: the transformer blocks' linear layers in float8 "
        "(torchao's float8 training, scaled per train.fp8_recipe) and bf16 autocast elsewhere. Weights and "
        "optimizer state stay fp32 in every mode, so a checkpoint resumes under any precision",
        choices=PRECISIONS,
    )
    fp8_recipe: str = opt(
        "tensorwise",
        "with precision=fp8, how float8 scales are chosen: tensorwise (one scale per tensor, the fastest) or "
        "rowwise (one per row, more accurate; torchao's recipes)",
        choices=("tensorwise", "rowwise"),
    )
    fp8_emulate: bool = opt(
        False,
        "with precision=fp8, run float8's casts and scaling with the matmuls in higher precision (torchao's "
        "emulation): fp8 numerics on any device, CPUs included, for tests; slow, never for training",
    )
    eval_interval: int = opt(100, "evaluate every N steps and at the end (0: only at the end)", min=0)
    eval_batches: int = opt(8, "validation micro-batches per evaluation on each rank", min=1)
    threads: int | None = opt(None, "torch intra-op CPU threads (null: torch's default; torchrun sets 1)", min=1)
    nonfinite: str = opt(
        "skip",
        "a step whose loss or gradient norm is NaN/inf: skip (no update, gradients dropped; it still counts as a "
        "step of the lr schedule and of the data) or stop (end the run with an error); no checkpoint of "
        "non-finite state is ever saved",
        choices=("skip", "stop"),
    )
    max_nonfinite_steps: int = opt(
        5, "with nonfinite=skip: end the run with an error once this many steps in a row were not finite", min=1
    )
    compile: bool = opt(
        False,
        "compile each transformer block with torch.compile (regional compilation: every block shares one "
        "compiled graph, so compile time is one block's; hooks, collectives and the loss stay eager); the "
        "first step pays the compile time",
    )

    @property
    def bf16_compute(self) -> bool:
        """Whether activations are bf16 (autocast): under bf16, and around fp8's float8 matmuls."""
        return self.precision in ("bf16", "fp8")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = opt(3e-3, "peak learning rate", min=0.0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr", min=0.0, max=1.0)
    warmup_steps: int = opt(
        30, "linear warmup steps from 0 to lr (more than train.steps: warm up over all steps, with a warning)", min=0
    )
    schedule: str = opt("cosine", "decay after warmup", choices=("cosine", "linear", "constant"))
    weight_decay: float = opt(0.1, "decoupled weight decay (matrices only; not norms)", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0, min_exclusive=True)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: off)", min=0.0)
    impl: str = opt(
        "auto", "AdamW kernel: fused, foreach, or auto (fused where available)", choices=("auto", "fused", "foreach")
    )


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
# These compute weight gradients in a later pass than the input gradients (past the ZeRO engine's hooks).
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", *V_SHAPED_SCHEDULES)


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks are combined. world size = tp · pp · dp."""

    tp: int = opt(1, "tensor-parallel degree", min=1)
    pp: int = opt(1, "pipeline-parallel degree", min=1)
    dp: int | None = opt(None, "data-parallel degree (null: world size / (tp·pp))", min=1)
    virtual_stages: int = opt(
        1, "model chunks per pipeline rank (V): layers split into pp·V stages; V > 1 interleaves", min=1
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
        False, "with tp > 1, shard norms/residuals along the sequence (Megatron SP); ignored when tp = 1"
    )
    ranks_per_node: int | None = opt(None, "ranks on one node (null: the launcher's LOCAL_WORLD_SIZE)", min=1)
    ranks_per_gpu: int = opt(1, "ranks sharing one physical GPU (2 for the GCDs of a Frontier MI250X)", min=1)

    def dp_size(self, world_size: int) -> int:
        """Data-parallel degree: `dp`, or what tp·pp leaves of the world."""
        return self.dp or world_size // (self.tp * self.pp)

    backend: str = opt(
        "auto", "torch.distributed backend (auto: nccl with GPUs, gloo on CPU)", choices=("auto", "gloo", "nccl")
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
        "start each gradient bucket's data-parallel reduction (all-reduce, or ZeRO's reduce-scatters) as soon as "
        "backward has produced it, on process groups of its own, and wait only before clipping; false = reduce "
        "after backward (same numbers either way)",
    )
    timeout_s: int = opt(600, "process-group timeout in seconds", min=1)
    hang_timeout_s: float | None = opt(
        None,
        "when no rank makes progress for this many seconds (one is stopped, or stuck outside or inside a "
        "collective) the job stops with one error naming the stuck rank, its host and its last collective, "
        "long before timeout_s; armed after the first step; null = a fifth of timeout_s; 0 = off",
        min=0.0,
    )

    def hang_after_s(self) -> float:
        """Seconds without progress that count as a hang (0: not watched)."""
        return self.timeout_s / 5 if self.hang_timeout_s is None else self.hang_timeout_s


@dataclass(frozen=True)
class ShardSpec:
    """Where one kind of training state is partitioned."""

    shard_over: str = opt(
        "none", "hierarchy level whose data-parallel ranks split it (none: not split; gcd = none)", choices=LEVELS
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
        "where gradients are partitioned (reduce-scattered per micro-batch as backward produces them): ZeRO-2",
    )
    optim: ShardSpec = nested(ShardSpec, "where optimizer states (and the fp32 update) are partitioned: ZeRO-1")
    secondary_params: ShardSpec = nested(
        ShardSpec,
        "hpZ (ZeRO++): a second copy of the parameters partitioned at "
        "this finer level, gathered for backward and later micro-batches instead "
        "of the primary one; none = off",
    )
    prefetch_blocks: int = opt(1, "flat groups gathered ahead of the one running (forward and backward)", min=0)
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
        return any(_coarseness(s.shard_over) > _coarseness("none") for s in (self.params, self.grads, self.optim))


@dataclass(frozen=True)
class CO2Config:
    """CO2: nodes train as independent replicas, averaged by an outer all-reduce every round."""

    enabled: bool = opt(False, "use CO2 across nodes (inside a node: ordinary data parallelism); needs >= 2 nodes")
    outer_every: int = opt(2, "H: local optimizer steps per round", min=1)
    outer_lr: float = opt(0.8, "outer learning rate applied to the averaged round delta", min=0.0)
    outer_momentum: float = opt(0.0, "outer momentum", min=0.0, max=1.0, max_exclusive=True)
    staleness_penalty: float = opt(
        0.0, "staleness gap penalty on a replica's not-yet-averaged progress (0: keep it whole)", min=0.0
    )
    clip: float = opt(0.0, "clip the outer momentum's L2 norm to this (0 = no outer-momentum clipping)", min=0.0)
    overlap: bool = opt(
        True,
        "apply each round's average one round late, overlapping its all-reduce with the next "
        "round; false: wait for the outer all-reduce at once and apply it in the same round "
        "(synchronous)",
    )


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class ParamOffloadConfig:
    """Where ZeRO-3 parameter shards live between uses (ZeRO-Infinity)."""

    device: str = opt(
        "none",
        "none: on the training device; cpu: host memory; nvme: swap files under "
        "offload.nvme_path (read ahead of use, written back after the step)",
        choices=OFFLOAD_DEVICES,
    )
    read_ahead: int = opt(1, "flat groups whose shards are read ahead of the gather prefetch", min=0)
    keep_groups: int = opt(
        2,
        "shards kept in memory after their last use, most recent first, so the turns "
        "(forward to backward, backward to the update) read nothing (0: drop every shard once "
        "gathered)",
        min=0,
    )
    resident_mb: float | None = opt(
        0.0,
        "device memory for shards that stay in memory for good once read (never re-read nor written "
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
        "directory for swap files on a local SSD (needed when a device is nvme); checked and preallocated at start-up",
    )
    host_buffer_mb: float = opt(
        64.0,
        "staging budget per rank: every transfer streams through slabs of this "
        "pool (pinned when CUDA exists); a transfer beyond it waits, then fails clearly",
        min=0.0,
        min_exclusive=True,
    )
    slab_mb: float = opt(
        4.0, "slab size (a multiple of 4 KiB); also the optimizer sub-group size", min=0.0, min_exclusive=True
    )
    io_threads: int = opt(4, "I/O threads per rank for swap files", min=1)
    direct_io: bool = opt(
        True, "O_DIRECT swap I/O, bypassing the page cache (falls back to buffered I/O on file systems that refuse it)"
    )
    params: ParamOffloadConfig = nested(ParamOffloadConfig)
    optim: OptimOffloadConfig = nested(OptimOffloadConfig)

    @property
    def enabled(self) -> bool:
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
        1 << 20, "never offload a saved tensor whose storage is smaller than this (parameters never are)", min=0
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
        "its activations (torch.utils.checkpoint); selective: keep the matmul and attention outputs "
        "and recompute only the cheap, memory-heavy ops between them (norms, RoPE, SiLU, products)",
        choices=("none", "selective", "full"),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Periodic checkpoints: every rank writes its own part (DCP's format), committed last with checksums."""

    dir: str | None = opt(None, "where checkpoints go (null: <run dir>/checkpoints)")
    interval: int = opt(0, "save every N steps (0: only at the end when `save_final`)", min=0)
    save_final: bool = opt(True, "save a checkpoint after the last step")
    keep_last: int = opt(2, "committed checkpoints to keep (0: keep all)", min=0)
    async_save: bool = opt(
        False,
        "save in the background: the step pays only for copying this rank's state into a "
        "shared-memory staging buffer, a writer process persists it while training goes on",
        key="async",
    )
    verify_on_load: bool = opt(True, "check the CRC-32C of every block a resume reads")
    overwrite: bool = opt(
        False,
        "start a new run in a checkpoint.dir that holds committed checkpoints, replacing them as new ones are "
        "saved (false: such a start is refused; continue that run with --resume DIR)",
    )
    on_disk_full: str = opt(
        "stop",
        "what a save that finds no room (ENOSPC, EDQUOT, EFBIG) does: stop (every rank raises an error naming "
        "the file and the bytes missing) or retry (warn, train on, and try again at the next checkpoint); "
        "either way the partial save is removed and the committed checkpoints stay as they were",
        choices=("stop", "retry"),
    )


@dataclass(frozen=True)
class SnapshotConfig:
    """In-memory snapshots kept by one agent process per node, erasure-coded across nodes; a restarted
    job resumes from the newest step every rank can restore, else from the newest disk checkpoint."""

    every_steps: int = opt(
        0,
        "snapshot the training state into host memory every N steps (0: off); needs the "
        "snapshot agents `strata launch` starts",
        min=0,
    )
    k: int = opt(1, "data fragments each rank's snapshot is cut into (Reed-Solomon)", min=1)
    m: int = opt(
        1,
        "parity fragments: the loss of up to m whole nodes is survivable; k + m fragments go to "
        "k + m different nodes (0: local snapshots only, surviving worker crashes)",
        min=0,
    )
    agent_timeout_s: float = opt(
        60.0, "how long a worker waits for its agent's reply before giving up", min=0.0, min_exclusive=True
    )


@dataclass(frozen=True)
class LogConfig:
    """Where a run writes and what it reports."""

    dir: str = opt("runs", "parent directory of run directories")
    name: str | None = opt(None, "run name (null: the config file's stem)")
    interval: int = opt(10, "write a metrics line every N steps", min=1)
    progress: bool = opt(True, "show a progress bar on rank 0")
    wandb: bool = opt(False, "also log to Weights & Biases (offline unless WANDB_MODE says otherwise)")
    wandb_project: str = opt("strata", "wandb project name")
    peak_tflops: float | None = opt(
        None,
        "per-device peak TFLOP/s for MFU (null: looked up from the GPU's name for bf16; on a CPU or an unknown "
        "GPU, MFU is not reported)",
        min=0.0,
        min_exclusive=True,
    )
    tensorboard: bool = opt(False, "also write the metrics as TensorBoard scalars to <run dir>/tensorboard (rank 0)")
    profile_steps: tuple[int, ...] | None = opt(
        None,
        "[first, last]: record steps first..last (inclusive, 1 <= first <= last) with torch.profiler, a "
        "Chrome/Perfetto trace per rank in <run dir>/profile/rank<r>.json and, on CUDA, a memory snapshot "
        "(null: no profiling; on CUDA an out-of-memory error leaves a memory snapshot either way)",
        min=1,
        min_items=2,
        max_items=2,
    )


@dataclass(frozen=True)
class Config:
    """A whole experiment."""

    model: ModelConfig = nested(ModelConfig)
    data: DataConfig = nested(DataConfig)
    train: TrainConfig = nested(TrainConfig)
    optim: OptimConfig = nested(OptimConfig)
    parallel: ParallelConfig = nested(ParallelConfig)
    zero: ZeroConfig = nested(ZeroConfig)
    co2: CO2Config = nested(CO2Config)
    offload: OffloadConfig = nested(OffloadConfig)
    activations: ActivationsConfig = nested(ActivationsConfig)
    checkpoint: CheckpointConfig = nested(CheckpointConfig)
    snapshot: SnapshotConfig = nested(SnapshotConfig)
    log: LogConfig = nested(LogConfig)

    # --- values derived from the config (and the world size) -------------------------------
    def dp_size(self, world_size: int) -> int:
        return self.parallel.dp_size(world_size)

    def grad_accum_steps(self, world_size: int) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.dp_size(world_size))

    def run_name(self) -> str:
        return self.log.name or "run"

    def run_dir(self) -> Path:
        return Path(self.log.dir) / self.run_name()

    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir() / "checkpoints"


GROUPS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


# --- loading --------------------------------------------------------------------------------


def load(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None
) -> Config:
    """Read a YAML experiment, apply `key.sub=value` overrides and validate everything.

    With `world_size`, also checks that the parallel layout and batch sizes fit it.
    Raises ConfigError listing every problem found.
    """
    problems: list[str] = []
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path), problems)
    for item in overrides:
        _apply_override(raw, item, problems)
    _derive_from_hf(raw, problems)
    cfg = _build(raw, problems)
    if cfg.log.name is None and path is not None:
        cfg = replace(cfg, "log.name", Path(path).stem)
    _check_and_raise(cfg, problems, world_size)
    return cfg


def _derive_from_hf(raw: dict[str, Any], problems: list[str]) -> None:
    """With model.init_from naming a Hugging Face model directory, fill the model block from its
    config.json (the user's own keys must agree with it). Only when a user's experiment is loaded:
    a checkpoint's config.yaml already holds the derived values, and the directory may be gone."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    source = model.get("init_from")
    if not isinstance(source, str) or _path_problem("model.init_from", source):
        return  # unset, or a problem the type and path checks report
    if not Path(source).is_dir():
        problems.append(
            f"model.init_from: {source!r} is not a directory; give a local Hugging Face model directory "
            "(config.json + model.safetensors) or a Strata checkpoint directory"
        )
        return
    if not (Path(source) / "config.json").is_file():
        return  # a Strata checkpoint: its own checks come when it is opened
    path = Path(source) / "config.json"
    try:
        hf_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        problems.append(f"model.init_from: {path} is not readable JSON ({e})")
        return
    if not isinstance(hf_config, dict):
        problems.append(f"model.init_from: {path} must hold a JSON object")
        return
    seq_len = model.get("seq_len", ModelConfig().seq_len)
    try:
        derived = hf.model_settings(hf_config, seq_len if isinstance(seq_len, int) else 0)
    except ConfigError as e:  # the features Strata lacks, each naming its config.json field
        problems += [f"model.init_from: {path}: {p}" for p in e.problems]
        return
    clashes = hf.conflicts(model, derived)
    problems += [f"model.init_from: {c}" for c in clashes]
    if not clashes:
        raw["model"] = {**derived, **model}


def from_dict(raw: dict[str, Any], world_size: int | None = None) -> Config:
    """Build and validate a Config from a nested dict (as YAML would give)."""
    problems: list[str] = []
    cfg = _build(raw, problems)
    _check_and_raise(cfg, problems, world_size)
    return cfg


def cross_problems(cfg: Config, world_size: int | None = None) -> list[str]:
    """What is wrong between the keys of an already built config (and against `world_size`): the
    checks `load` runs after each key's own, for configs made with `replace` (the planner's)."""
    return _cross_checks(cfg, world_size)


def _check_and_raise(cfg: Config, problems: list[str], world_size: int | None) -> None:
    """Add the cross-key problems to the per-key ones and raise if there are any. A key that was
    already rejected holds its default, so cross-checks that name it would mislead: drop those."""
    bad_keys = [re.escape(p.split(":", 1)[0]) for p in problems]
    names_bad_key = re.compile(rf"\b({'|'.join(bad_keys)})\b(?!\.)(?=\W|$)") if bad_keys else None
    problems.extend(p for p in _cross_checks(cfg, world_size) if not (names_bad_key and names_bad_key.search(p)))
    if problems:
        raise ConfigError(problems)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain values (a list key as a list), under the YAML names of its keys."""
    return {_key_of(f): _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def _plain(value: Any) -> Any:
    """A config value as YAML would give it: a group as a dict, a list key's tuple as a list."""
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def dump(cfg: Config) -> str:
    """The resolved config as YAML (loadable again with `load`)."""
    text: str = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    return text


def replace(cfg: Any, key: str, value: Any) -> Any:
    """A copy of cfg with one dotted key (`optim.lr`, `zero.params.shard_over`) changed (no validation)."""
    name, _, rest = key.partition(".")
    name = next((f.name for f in dataclasses.fields(cfg) if _key_of(f) == name), name)
    return dataclasses.replace(cfg, **{name: replace(getattr(cfg, name), rest, value) if rest else value})


def explain(key: str) -> str:
    """The doc, type and default of a key, or the doc of a group and of every key in it."""
    entries = _entries()
    if key not in entries:
        raise ConfigError([_unknown(key)])
    f, hint = entries[key]
    if _is_group(hint):
        lines = [f"{key}: {f.metadata['doc']}"]
        for sub, sub_f, sub_hint in _walk(hint, key):
            indent = "  " * (sub.count(".") - key.count("."))
            lines.append(
                f"{indent}{sub}: {sub_f.metadata['doc']}"
                if _is_group(sub_hint)
                else f"{indent}{sub} = {_plain(sub_f.default)!r}  # {sub_f.metadata['doc']}"
            )
        return "\n".join(lines)
    text = f"{key}: {f.metadata['doc']}\n  type: {_type_name(hint)}\n  default: {_plain(f.default)!r}"
    for sub, sub_hint, default, doc in _record_keys(hint):
        text += f"\n  {key}[i].{sub} ({_type_name(sub_hint)}, {default.strip('`')}): {doc}"
    if f.metadata.get("choices"):
        text += f"\n  choices: {', '.join(map(str, f.metadata['choices']))}"
    return text


def all_keys() -> list[str]:
    """Every settable key, dotted (`train.steps`, `zero.params.shard_over`), in schema order."""
    return [key for key, (_, hint) in _entries().items() if not _is_group(hint)]


# --- the schema as a tree of dotted keys --------------------------------------------------------


def _is_group(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _walk(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """(dotted key, field, type hint) of every field below the dataclass `cls`, depth first in
    declaration order; a group comes just before its keys."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{_key_of(f)}" if prefix else _key_of(f)
        yield key, f, hints[f.name]
        if _is_group(hints[f.name]):
            yield from _walk(hints[f.name], key)


@functools.cache
def _entries() -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    """Every group and key of Config by dotted name."""
    return {key: (f, hint) for key, f, hint in _walk(Config)}


# --- internals ------------------------------------------------------------------------------


class _PlainYAMLError(yaml.YAMLError):  # type: ignore[misc, unused-ignore]
    """A mapping that gives one key twice (or a value no Python object can hold): a message of one line."""


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc, unused-ignore]
    """yaml.safe_load's loader, but a key given twice in one mapping is an error (PyYAML keeps the
    last silently, so a typo'd copy of a group would quietly replace the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call, unused-ignore]
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if first is None:
                seen[key] = line
            else:
                raise _PlainYAMLError(
                    f"line {line}: duplicate key {key!r} (first given on line {first}); keep one of them"
                )
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def _safe_load(text: str) -> Any:
    """yaml.safe_load, refusing duplicate keys; a scalar YAML reads as a value Python cannot make (a
    date like 2024-13-45, an integer of thousands of digits) is a YAMLError too."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except (ValueError, OverflowError) as e:
        raise _PlainYAMLError(
            f"a value YAML reads as a date or number cannot be made: {e}; quote it as a string"
        ) from e


def _read_yaml(path: Path, problems: list[str]) -> dict[str, Any]:
    if path.is_dir():
        problems.append(f"config file {str(path)!r} is a directory; pass the path to a YAML experiment (see configs/)")
        return {}
    if not path.is_file():
        problems.append(f"config file {str(path)!r} does not exist; pass the path to a YAML experiment (see configs/)")
        return {}
    try:
        raw = _safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        problems.append(f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); save it as UTF-8")
        return {}
    except OSError as e:
        problems.append(f"config file {str(path)!r} cannot be read ({e.strerror}); check its permissions")
        return {}
    except _PlainYAMLError as e:
        problems.append(f"{path}: {e}")
        return {}
    except yaml.YAMLError as e:
        problems.append(f"{path}: not valid YAML: {e}")
        return {}
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(
            f"{path}: the top level must be a mapping of groups ({', '.join(GROUPS)}), got {type(raw).__name__}"
        )
        return {}
    return raw


def _apply_override(raw: dict[str, Any], item: str, problems: list[str]) -> None:
    """`group.key=value` (or `group.sub.key=value`) into the nested mapping `raw`."""
    key, eq, text = item.partition("=")
    path = key.strip().split(".")
    if not eq or len(path) < 2 or not all(path):
        problems.append(f"override {item!r}: write it as group.key=value, e.g. train.steps=100")
        return
    try:
        value = _safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        problems.append(f"override {item!r}: the value is not valid YAML ({why}); quote it")
        return
    target = raw
    for depth, name in enumerate(path[:-1]):
        if target.get(name) is None:
            target[name] = {}
        target = target[name]
        if not isinstance(target, dict):
            problems.append(
                f"override {item!r}: {'.'.join(path[: depth + 1])} is not a mapping (it is {target!r}), "
                "so it has no keys to set"
            )
            return
    target[path[-1]] = value


def _build(raw: dict[str, Any], problems: list[str]) -> Config:
    cfg: Config = _build_group("", Config, raw, problems)
    return cfg


def _build_group(prefix: str, cls: type, values: dict[str, Any], problems: list[str]) -> Any:
    """The dataclass `cls` (the keys below the dotted `prefix`) from a mapping: groups recurse,
    values are coerced and range-checked; a rejected key keeps its default."""
    hints = typing.get_type_hints(cls)
    fields = {_key_of(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            problems.append(_unknown(key))
            continue
        attr = fields[name].name
        hint = hints[attr]
        if _is_group(hint):
            value = {} if value is None else value
            if isinstance(value, dict):
                kwargs[attr] = _build_group(key, hint, value, problems)
            else:
                problems.append(f"{key}: must be a mapping of keys, got {type(value).__name__} {value!r}")
            continue
        record = _record_of(_optional_of(hint) or hint)
        if record is not None:
            items = None if value is None else _build_records(key, record, value, problems)
            if items is not None or value is None:
                kwargs[attr] = items
            continue
        if isinstance(value, dict):
            problems.append(
                f"{key}: expected {_type_name(hint)}, got the mapping {value!r} ({key} is one value, "
                "not a group of keys)"
            )
            continue
        ok, converted, why = _coerce(value, hint)
        if not ok:
            problems.append(
                f"{key}: {why}"
                if why.startswith("item ")
                else f"{key}: expected {_type_name(hint)}, got {value!r} ({why})"
            )
            continue
        if isinstance(converted, tuple):
            err = _items_problem(converted, fields[name].metadata)
        else:
            err = _range_problem(converted, fields[name].metadata)
            err = err and f"{converted!r} {err}"
        if err:
            problems.append(f"{key}: {err}")
            continue
        kwargs[attr] = converted
    return cls(**kwargs)


def _record_of(hint: Any) -> Any:
    """R for a list of records `tuple[R, ...]` (R a dataclass: `data.sources`), else None."""
    item = _item_of(hint)
    return item if _is_group(item) else None


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _build_records(key: str, cls: type, value: Any, problems: list[str]) -> tuple[Any, ...] | None:
    """A list of records (YAML: a list of mappings, also in an override's flow syntax) as a tuple
    of `cls`, each item's keys checked as a group's are and named `key[i].name` (i from 0); None,
    with the problems added, if any item is wrong."""
    fields = {_key_of(f): f for f in dataclasses.fields(cls)}
    example = "{" + ", ".join(f"{name}: ..." for name in fields) + "}"
    if not isinstance(value, (list, tuple)):
        problems.append(f"{key}: expected a list of mappings like [{example}], got {value!r}")
        return None
    before, items = len(problems), []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: expected a mapping like {example}, got {item!r}")
            continue
        known = {k: v for k, v in item.items() if k in fields}
        problems += [f"{where}.{k}: unknown key; valid: {', '.join(fields)}" for k in item if k not in fields]
        missing = [name for name, f in fields.items() if _required(f) and name not in item]
        problems += [f"{where}.{name}: missing; give the {fields[name].metadata['doc']}" for name in missing]
        if not missing:
            items.append(_build_group(where, cls, known, problems))
    return tuple(items) if len(problems) == before else None


def _optional_of(hint: Any) -> Any:
    """X for a hint `X | None` (or `Optional[X]`), else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


def _item_of(hint: Any) -> Any:
    """X for a list hint `tuple[X, ...]`, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _coerce(value: Any, hint: Any) -> tuple[bool, Any, str]:
    """Check `value` against a type hint; ints widen to floats, numeric strings ("3e-4") to floats, a
    list to the tuple of its coerced items (the reason for a bad item starts with "item N")."""
    inner = _optional_of(hint)
    if inner is not None:
        if value is None:
            return True, None, ""
        hint = inner
    item_hint = _item_of(hint)
    if item_hint is not None:
        if not isinstance(value, (list, tuple)):
            return False, None, "use a list, e.g. [a, b]"
        items = []
        for i, item in enumerate(value, 1):
            ok, converted, why = _coerce(item, item_hint)
            if not ok:
                return False, None, f"item {i} is {item!r}, " + (f"not {why[4:]}" if why.startswith("use ") else why)
            items.append(converted)
        return True, tuple(items), ""
    if hint is bool:
        return (True, value, "") if isinstance(value, bool) else (False, None, "use true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, ""
        return False, None, "use a whole number"
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return True, float(value), ""
            except OverflowError:
                return False, None, "too large for a floating-point number"
        if isinstance(value, str):
            try:
                return True, float(value), ""
            except ValueError:
                pass
        return False, None, "use a number"
    if hint is str:
        return (True, value, "") if isinstance(value, str) else (False, None, "use a string")
    return False, None, f"unsupported type {hint}"


def _items_problem(items: tuple[Any, ...], meta: Mapping[str, Any]) -> str | None:
    """Why the list `items` breaks its key's length bounds or an item its range, or None."""
    lo, hi = meta.get("min_items"), meta.get("max_items")
    if (lo is not None and len(items) < lo) or (hi is not None and len(items) > hi):
        if lo == hi:
            want = f"exactly {lo}"
        else:
            want = f"at least {lo}" if lo is not None and len(items) < lo else f"at most {hi}"
        return f"{list(items)} has {len(items)} item{'s' if len(items) != 1 else ''}; give {want}"
    for i, item in enumerate(items, 1):
        err = _range_problem(item, meta)
        if err:
            return f"item {i} is {item!r}, which {err}"
    return None


def _range_problem(value: Any, meta: Mapping[str, Any]) -> str | None:
    if value is None:
        return None
    if meta.get("choices") and value not in meta["choices"]:
        return f"is not one of: {', '.join(map(str, meta['choices']))}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            return "must be finite"
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            return "does not fit in a 64-bit integer; use a smaller number"
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
            return f"must be {'>' if meta.get('min_exclusive') else '>='} {lo}"
        if hi is not None and (value > hi or (meta.get("max_exclusive") and value == hi)):
            return f"must be {'<' if meta.get('max_exclusive') else '<='} {hi}"
    return None


def _unknown(key: str) -> str:
    """`key` is not in the schema: name the closest dotted key that is (in any group), else the
    valid keys beside it."""
    known = list(_entries())
    beside = [k for k in known if not key.startswith(k + ".")]  # its own groups are no suggestion
    match = difflib.get_close_matches(key, beside, n=1, cutoff=0.6)
    if match:
        return f"{key}: unknown key; did you mean {match[0]!r}?"
    parent = key.rpartition(".")[0]
    siblings = [k for k in known if k.rpartition(".")[0] == parent] or list(GROUPS)
    return f"{key}: unknown key; valid: {', '.join(sorted(siblings)[:12])}"


def _type_name(hint: Any) -> str:
    """A key's type in words: `int`, `float or null`, `list of int or null`."""
    inner = _optional_of(hint)
    if inner is not None:
        return f"{_type_name(inner)} or null"
    item = _item_of(hint)
    if item is not None:
        return f"list of {_type_name(item)}"
    if _is_group(hint):
        return "mappings {" + ", ".join(_key_of(f) for f in dataclasses.fields(hint)) + "}"
    return getattr(hint, "__name__", str(hint))


def snapshot_nodes_problem(snap: SnapshotConfig, nodes: int) -> str | None:
    """Why `nodes` nodes cannot hold the k + m fragments of every rank's snapshot (one per node), or None."""
    if not snap.every_steps or snap.k + snap.m <= nodes:
        return None
    return (
        f"snapshot.k + snapshot.m = {snap.k} + {snap.m} fragments of each rank's snapshot go to as many nodes, "
        f"but this job has {nodes}; set snapshot.m={max(nodes - snap.k, 0)} (m=0: local snapshots, which survive "
        "worker crashes but not the loss of a node)"
    )


def _snapshot_checks(cfg: Config) -> list[str]:
    """Snapshots copy the state as the checkpoint layer sees it; two features change that state."""
    if not cfg.snapshot.every_steps:
        return []
    p = []
    if cfg.co2.enabled:
        p.append(
            "snapshot.every_steps with co2.enabled: a snapshot would have to close CO2's round (as a "
            "checkpoint does), which changes the training; use checkpoint.interval, or set co2.enabled=false"
        )
    if cfg.offload.enabled:
        p.append(
            "snapshot.every_steps with offload.params.device or offload.optim.device: every snapshot would read "
            "the offloaded state back into memory; use checkpoint.interval, or set both devices to none"
        )
    return p


PATH_KEYS = (
    "model.init_from",
    "data.path",
    "data.cache_dir",
    "offload.nvme_path",
    "checkpoint.dir",
    "log.dir",
    "log.name",
)
NAME_MAX = 255  # bytes in one path component on Linux file systems


def _path_problem(key: str, value: str) -> str | None:
    """Why the path (or path component) `value` of `key` cannot name a file, or None."""
    if "\0" in value:
        return f"{key}: {value!r} contains a NUL character, which no path may hold; remove it"
    long = next((c for c in value.split("/") if len(c.encode("utf-8", "surrogateescape")) > NAME_MAX), None)
    if long is not None:
        return (
            f"{key}: the path component {long[:40]!r}... is {len(long.encode('utf-8', 'surrogateescape'))} bytes; "
            f"file systems allow {NAME_MAX}, so use a shorter name"
        )
    return None


def check_trainable(cfg: Config) -> None:
    """Refuse what a valid config may hold but training cannot run with (torch's AdamW refuses a beta
    of 1.0, which the schema's inclusive range lets through): `strata train` and `strata launch`
    call this before starting, so it fails as a ConfigError rather than in torch."""
    p = [
        f"optim.{name}: {value!r} cannot train: torch's AdamW needs 0 <= beta < 1; use e.g. 0.999"
        for name, value in (("beta1", cfg.optim.beta1), ("beta2", cfg.optim.beta2))
        if value >= 1.0
    ]
    if p:
        raise ConfigError(p)


def _value_checks(cfg: Config) -> list[str]:
    """Values the schema's ranges let through but the run would fail on later: paths no file system
    takes, a seed the data order cannot use (negative)."""
    p = [
        problem
        for key in PATH_KEYS
        if isinstance(value := _get(cfg, key), str) and (problem := _path_problem(key, value))
    ]
    if cfg.train.seed < 0:
        p.append(f"train.seed: {cfg.train.seed} must be >= 0 (it seeds the data order)")
    steps = cfg.log.profile_steps
    if steps is not None and len(steps) == 2 and steps[0] > steps[1]:
        p.append(
            f"log.profile_steps: {list(steps)} is reversed; give [first, last] with first <= last, "
            f"e.g. [{steps[1]}, {steps[0]}]"
        )
    return p


def _get(cfg: Any, key: str) -> Any:
    """The value of a dotted key (`log.name`) in a config."""
    for name in key.split("."):
        cfg = getattr(cfg, next(f.name for f in dataclasses.fields(cfg) if _key_of(f) == name))
    return cfg


def _cross_checks(cfg: Config, world_size: int | None) -> list[str]:
    """Constraints between keys (and against the world size, when known)."""
    p: list[str] = _value_checks(cfg) + _data_checks(cfg.data)
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    if m.head_dim is None and m.d_model % m.n_heads:
        p.append(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} (or set model.head_dim)")
    kv = m.kv_heads
    if m.n_heads % kv:
        p.append(f"model.n_kv_heads={kv} must divide model.n_heads={m.n_heads}")
    elif m.head_dim is not None and m.head_dim % 2:
        p.append(f"model.head_dim={m.head_dim} must be even for RoPE")
    elif m.head_dim is None and not m.d_model % m.n_heads and m.head_size % 2:
        p.append(f"head size d_model/n_heads={m.head_size} must be even for RoPE (or set an even model.head_dim)")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        p.append(
            f"model.rope_high_freq_factor={m.rope_high_freq_factor:g} must exceed "
            f"model.rope_low_freq_factor={m.rope_low_freq_factor:g} (llama3 RoPE scaling interpolates between them)"
        )
    if m.n_heads % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.n_heads={m.n_heads}")
    elif kv % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.n_kv_heads={kv}")
    stages = par.pp * par.virtual_stages
    if m.n_layers % stages:
        p.append(
            f"parallel.pp·virtual_stages = {par.pp}·{par.virtual_stages} = {stages} pipeline stages must divide "
            f"model.n_layers={m.n_layers} (stages are balanced by layers)"
        )
    if par.hang_timeout_s is not None and par.hang_timeout_s >= par.timeout_s:
        p.append(
            f"parallel.hang_timeout_s={par.hang_timeout_s:g} must be below parallel.timeout_s={par.timeout_s} (the "
            "collective timeout would end the job first, without naming the stuck rank); lower it, or 0 for off"
        )
    if tr.precision == "fp8" and not tr.compile and not tr.fp8_emulate:
        p.append(
            "train.precision=fp8 needs train.compile=true: uncompiled, float8's casts and scaling run as separate "
            "kernels and the step is slower than bf16 (torchao and torchtitan require compilation too)"
        )
    p += _schedule_checks(par)
    p += _zero_checks(cfg, world_size)
    p += _offload_checks(cfg)
    p += _snapshot_checks(cfg)
    if par.sequence_parallel and par.tp > 1 and m.seq_len % par.tp:
        p.append(
            f"parallel.sequence_parallel splits the sequence over tp={par.tp} ranks: model.seq_len={m.seq_len} "
            "must be a multiple of tp"
        )
    if m.ffn_hidden and m.ffn_hidden % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.ffn_hidden={m.ffn_hidden}")
    # The vocabulary never depends on the layout (unlike Megatron, which pads to a multiple of
    # 128·tp), so a checkpoint loads into any tp degree: the padding multiple must suit every tp.
    if m.vocab_size and m.vocab_size % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.vocab_size={m.vocab_size}")
    if not m.vocab_size and m.pad_vocab_multiple % par.tp:
        p.append(
            f"parallel.tp={par.tp} must divide model.pad_vocab_multiple={m.pad_vocab_multiple} (the vocabulary "
            "is padded to a multiple of it and split over tp ranks); use a multiple of tp such as 128"
        )
    if tr.global_batch_size % tr.micro_batch_size:
        p.append(
            f"train.micro_batch_size={tr.micro_batch_size} must divide train.global_batch_size={tr.global_batch_size}"
        )
    if world_size is not None:
        layout_issues = layout_problems(par, world_size)
        p += layout_issues
        if not layout_issues:
            dp = cfg.dp_size(world_size)
            if tr.global_batch_size % (tr.micro_batch_size * dp):
                p.append(
                    f"train.global_batch_size={tr.global_batch_size} must be a multiple of "
                    f"train.micro_batch_size·dp = {tr.micro_batch_size}·{dp}"
                )
            else:
                p += _microbatch_checks(cfg, cfg.grad_accum_steps(world_size), dp)
    return p


def start_up_warnings(cfg: Config) -> list[str]:
    """What is legal but probably not what the user meant, for rank 0 to print at start-up (a short
    trial run of a shipped config must still train, so these are not errors)."""
    w: list[str] = []
    if cfg.optim.warmup_steps > cfg.train.steps:
        w.append(
            f"optim.warmup_steps={cfg.optim.warmup_steps} exceeds train.steps={cfg.train.steps}: the warm-up is cut "
            f"short to the {cfg.train.steps} steps (the learning rate reaches optim.lr at the last step and never "
            "decays); lower optim.warmup_steps or train longer"
        )
    return w


def _schedule_checks(par: ParallelConfig) -> list[str]:
    p: list[str] = []
    v, name = par.virtual_stages, par.schedule
    if v > 1 and par.pp == 1:
        p.append(f"parallel.virtual_stages={v} needs pipeline parallelism: set parallel.pp > 1 or virtual_stages=1")
    if name in SINGLE_STAGE_SCHEDULES and v > 1:
        p.append(
            f"parallel.schedule={name} runs one stage per rank but virtual_stages={v}; use interleaved_1f1b, "
            "looped_bfs or interleaved_zero_bubble, or set virtual_stages=1"
        )
    if name in V_SHAPED_SCHEDULES and v != 2:
        p.append(f"parallel.schedule={name} needs exactly two stages per rank: set parallel.virtual_stages=2")
    return p


# What moves between memory tiers (offload.tiers), and the key that says where each lives.
OFFLOAD_STREAM_KEYS = {
    "params": "offload.params.device",
    "optim": "offload.optim.device",
    "activations": "activations.offload",
}
SLABS_PER_STREAM = 2  # of the host pool, guaranteed to each stream that uses it


def offload_devices(cfg: Config) -> dict[str, str]:
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


def _offload_checks(cfg: Config) -> list[str]:
    """Memory tiers hang off the ZeRO engine's flat groups; what the first version supports."""
    p: list[str] = []
    off, z = cfg.offload, cfg.zero
    slab = off.slab_mb * 2**20
    devices = offload_devices(cfg)
    needed = SLABS_PER_STREAM * len(pool_streams(devices))
    if slab % 4096:
        p.append(f"offload.slab_mb={off.slab_mb:g} is not a multiple of 4 KiB (O_DIRECT transfers); use e.g. 4")
    elif needed and off.host_buffer_mb * 2**20 < needed * slab:
        p.append(
            f"offload.host_buffer_mb={off.host_buffer_mb:g} holds fewer than the {needed} slabs of "
            f"offload.slab_mb={off.slab_mb:g} that {needed // SLABS_PER_STREAM} offload streams need "
            f"({SLABS_PER_STREAM} each); set it to at least {needed * off.slab_mb:g}"
        )
    nvme = [OFFLOAD_STREAM_KEYS[s] for s, d in devices.items() if d == "nvme"]
    if nvme and not off.nvme_path:
        p.append(
            f"{' and '.join(nvme)}=nvme need{'s' if len(nvme) == 1 else ''} offload.nvme_path: a directory on a "
            "local SSD for the swap files"
        )
    if off.params.device != "none":
        if _coarseness(z.params.shard_over) <= _coarseness("none"):
            p.append(
                f"offload.params.device={off.params.device} offloads ZeRO-3 parameter shards: set "
                "zero.params.shard_over (global also works on one rank)"
            )
        elif z.params.shard_over != z.optim.shard_over:
            p.append(
                f"offload.params.device={off.params.device} needs zero.optim.shard_over = zero.params.shard_over "
                f"(now {z.optim.shard_over} vs {z.params.shard_over}): each rank steps exactly the shard it swaps"
            )
    if off.optim.device != "none" and _coarseness(z.optim.shard_over) <= _coarseness("none"):
        p.append(
            f"offload.optim.device={off.optim.device} offloads the ZeRO optimizer partition: set "
            "zero.optim.shard_over (global also works on one rank)"
        )
    if off.enabled and cfg.optim.impl == "foreach":
        p.append(
            "offload steps sub-groups with torch's fused AdamW kernel (6.5x faster on CPU than foreach): set "
            "optim.impl=auto or fused"
        )
    if off.enabled and cfg.co2.enabled:
        p.append(
            "co2.enabled with offload: CO2's outer update walks every optimizer chunk at once, which offload "
            "keeps on disk or host; turn one of them off"
        )
    return p


def _coarseness(level: str) -> int:
    """Order of hierarchy levels: none = gcd < gpu < node < global (topology's CHAIN)."""
    return CHAIN.index(chain_level(level))


def _zero_checks(cfg: Config, world_size: int | None) -> list[str]:
    """ZeRO levels nest (parameters and gradients inside the optimizer shard, hpZ inside the
    parameters); CO2 needs whole nodes as replicas."""
    p: list[str] = []
    z, par = cfg.zero, cfg.parallel
    level = {name: getattr(z, name).shard_over for name in ("params", "grads", "optim", "secondary_params")}
    for name in ("params", "grads"):
        if _coarseness(level[name]) > _coarseness(level["optim"]):
            what = {"params": "parameters", "grads": "gradients"}[name]
            p.append(
                f"zero.{name}.shard_over={level[name]} is coarser than zero.optim.shard_over={level['optim']}: "
                f"a rank steps only the optimizer state inside the {what} it holds; set zero.optim.shard_over="
                f"{level[name]} or zero.{name}.shard_over={level['optim']}"
            )
    sec = level["secondary_params"]
    if sec != "none" and _coarseness(sec) >= _coarseness(level["params"]):
        finer = [lv for lv in LEVELS if _coarseness("none") < _coarseness(lv) < _coarseness(level["params"])]
        p.append(
            f"zero.secondary_params.shard_over={sec} must be finer than zero.params.shard_over={level['params']} "
            f"(hpZ is a less partitioned second copy); use {' or '.join([*finer, 'none (hpZ off)'])}"
        )
    sharded = [
        f"zero.{name}.shard_over={level[name]}"
        for name in ("params", "grads", "optim")
        if _coarseness(level[name]) > _coarseness("none")
    ]
    if sharded and par.pp > 1 and par.schedule in SPLIT_BACKWARD_SCHEDULES:
        p.append(
            f"parallel.schedule={par.schedule} with {' and '.join(sharded)}: split-backward schedules set "
            "weight gradients directly in a later pass, past the hooks through which the ZeRO engine collects "
            "gradients; use parallel.schedule=interleaved_1f1b (or 1f1b/gpipe/looped_bfs), or no zero block"
        )
    if cfg.co2.enabled:
        for name, lv in level.items():
            if _coarseness(lv) > _coarseness("node"):
                p.append(
                    f"co2.enabled needs nodes to be independent replicas but zero.{name}.shard_over={lv} "
                    "partitions across nodes; set it to node or finer, or co2.enabled=false"
                )
        for key in ("clip", "staleness_penalty"):
            if getattr(cfg.co2, key) > 0 and par.tp * par.pp > 1:
                p.append(
                    f"co2.{key}={getattr(cfg.co2, key)} with parallel.tp={par.tp}, pp={par.pp}: its norm is taken "
                    "over one model replica's data-parallel pieces only, not yet across tensor/pipeline shards "
                    f"(copies of replicated weights would drift apart); set co2.{key}=0 or use tp=pp=1"
                )
        per_node = par.ranks_per_node  # null: the launcher decides, so the node count is unknown here
        if (
            world_size is not None
            and per_node is not None
            and world_size % per_node == 0
            and world_size // per_node < 2
        ):
            p.append(
                f"co2.enabled needs at least 2 nodes but world size {world_size} / parallel.ranks_per_node="
                f"{per_node} = {world_size // per_node}; run on more nodes, lower parallel.ranks_per_node, or "
                "set co2.enabled=false"
            )
    return p


def _microbatch_checks(cfg: Config, derived: int, dp: int) -> list[str]:
    """`derived` = global_batch_size / (micro_batch_size·dp): the micro-batches one replica runs."""
    par, tr = cfg.parallel, cfg.train
    p: list[str] = []
    if par.microbatches is not None and par.microbatches != derived:
        mbs = tr.global_batch_size / (par.microbatches * dp)
        fix = f"set train.micro_batch_size={int(mbs)}" if mbs == int(mbs) and mbs >= 1 else "change global_batch_size"
        p.append(
            f"parallel.microbatches={par.microbatches} disagrees with global_batch_size/(micro_batch_size·dp) = "
            f"{derived}; {fix} or leave parallel.microbatches null"
        )
        return p
    if par.pp > 1 and par.schedule == "dualpipev" and derived < 2 * par.pp:
        p.append(
            f"parallel.schedule=dualpipev needs at least as many micro-batches as stages (2·pp = {2 * par.pp}) "
            f"but gets {derived}; lower train.micro_batch_size or raise train.global_batch_size"
        )
    elif par.pp > 1 and derived < par.pp:
        p.append(
            f"pipeline needs at least pp={par.pp} micro-batches per step but gets {derived} (global_batch_size/"
            f"(micro_batch_size·dp)); lower train.micro_batch_size or raise train.global_batch_size"
        )
    elif par.pp > 1 and par.virtual_stages > 1 and derived % max(1, derived // par.pp):
        p.append(
            f"interleaved schedules run micro-batches in rounds of about pp={par.pp}: {derived} micro-batches "
            f"must be a multiple of {derived // par.pp}; use a multiple of pp"
        )
    return p


def _record_keys(hint: Any) -> list[tuple[str, Any, str, str]]:
    """(name, type hint, default as markdown, doc) of each key of a list-of-records key's items."""
    record = _record_of(_optional_of(hint) or hint)
    if record is None:
        return []
    hints = typing.get_type_hints(record)
    return [
        (_key_of(f), hints[f.name], "required" if _required(f) else f"`{_plain(f.default)!r}`", f.metadata["doc"])
        for f in dataclasses.fields(record)
    ]


def reference_markdown() -> str:
    """The config reference page (docs/CONFIG.md), generated from the schema so it cannot drift."""
    out = [
        "# Config reference",
        "",
        "Generated from `strata/config.py` by `python -m strata.config > docs/CONFIG.md`; "
        "`strata config explain KEY` prints the same for one key.",
        "",
    ]
    for group, cls in GROUPS.items():
        out += [f"## `{group}`", "", cls.__doc__ or "", ""]
        rows = []
        for key, f, hint in _walk(cls, group):
            doc = f.metadata["doc"] + (f" ({', '.join(f.metadata['choices'])})" if f.metadata.get("choices") else "")
            if _is_group(hint):
                rows.append(f"| `{key}` | group | | {doc} |")
                continue
            plain = _plain(f.default)
            default = yaml.safe_dump(plain, default_flow_style=True).strip().removesuffix("...").strip()
            rows.append(f"| `{key}` | {_type_name(hint)} | `{default}` | {doc} |")
            rows += [f"| `{key}[i].{sub}` | {_type_name(h)} | {d} | {doc} |" for sub, h, d, doc in _record_keys(hint)]
        if not rows:
            out += ["(no keys yet)", ""]
            continue
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
