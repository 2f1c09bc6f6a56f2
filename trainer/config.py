"""The experiment schema: YAML (+ `key.sub=value` overrides) into frozen, validated dataclasses.

This is the one place that parses and checks configuration. Every key has a default and a doc
string (`strata config explain KEY`); `load` reports every problem at once in a ConfigError.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from parallel.topology import layout_problems
from trainer.errors import ConfigError


def opt(default: Any, doc: str, *, choices: tuple | None = None, min: float | None = None,
        max: float | None = None, min_exclusive: bool = False) -> Any:
    """A config key: its default, one-line doc and the range checks `load` applies."""
    meta = {"doc": doc, "choices": choices, "min": min, "max": max, "min_exclusive": min_exclusive}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer (Llama-style: RoPE, RMSNorm, SwiGLU)."""
    n_layers: int = opt(4, "number of transformer blocks", min=1)
    d_model: int = opt(128, "hidden size (width of the residual stream)", min=1)
    n_heads: int = opt(4, "attention heads; must divide d_model", min=1)
    n_kv_heads: Optional[int] = opt(None, "key/value heads for grouped-query attention (null: = n_heads)", min=1)
    ffn_hidden: Optional[int] = opt(None, "SwiGLU inner size (null: 8/3·d_model rounded up to a multiple of 32)", min=1)
    vocab_size: Optional[int] = opt(None, "vocabulary size (null: the data's, padded to pad_vocab_multiple)", min=1)
    pad_vocab_multiple: int = opt(64, "pad a data-derived vocabulary up to a multiple of this", min=1)
    seq_len: int = opt(128, "tokens per training sequence (context length)", min=1)
    rope_theta: float = opt(10000.0, "RoPE base frequency", min=0.0, min_exclusive=True)
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", min=0.0, min_exclusive=True)
    tie_embeddings: bool = opt(False, "share the token embedding with the output projection")
    init_std: float = opt(0.02, "std of the normal init of weights (output projections scaled by 1/sqrt(2·n_layers))",
                          min=0.0, min_exclusive=True)


@dataclass(frozen=True)
class DataConfig:
    """Token data: a prepared directory (train.bin/val.bin + meta.json) or the built-in corpus."""
    path: Optional[str] = opt(None, "directory made by `strata data prepare` (null: the Python stdlib corpus, prepared on first use)")
    cache_dir: Optional[str] = opt(None, "where the built-in corpus is prepared (null: $STRATA_CACHE or ~/.cache/strata)")
    val_fraction: float = opt(0.05, "share of built-in corpus files held out for evaluation", min=0.0, max=0.5)


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation loop: batch sizes, steps, precision, evaluation."""
    steps: int = opt(300, "optimizer steps to train for", min=1)
    global_batch_size: int = opt(16, "sequences per optimizer step, over all data-parallel ranks", min=1)
    micro_batch_size: int = opt(8, "sequences per forward/backward on one rank; accumulation = global/(micro·dp)", min=1)
    seed: int = opt(1234, "seed for init and data order (runs with equal seeds are identical)")
    precision: str = opt("fp32", "compute precision: fp32, or bf16 autocast (weights and optimizer stay fp32)",
                         choices=("fp32", "bf16"))
    eval_interval: int = opt(100, "evaluate every N steps and at the end (0: only at the end)", min=0)
    eval_batches: int = opt(8, "validation micro-batches per evaluation on each rank", min=1)
    threads: Optional[int] = opt(None, "torch intra-op CPU threads (null: torch's default; torchrun sets 1)", min=1)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""
    lr: float = opt(3e-3, "peak learning rate", min=0.0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr", min=0.0, max=1.0)
    warmup_steps: int = opt(30, "linear warmup steps from 0 to lr", min=0)
    schedule: str = opt("cosine", "decay after warmup", choices=("cosine", "linear", "constant"))
    weight_decay: float = opt(0.1, "decoupled weight decay (matrices only; not norms)", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0, min_exclusive=True)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: off)", min=0.0)
    impl: str = opt("auto", "AdamW kernel: fused, foreach, or auto (fused where available)",
                    choices=("auto", "fused", "foreach"))


# Schedules of torch.distributed.pipelining; the first two run one stage per rank.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
V_SHAPED_SCHEDULES = ("zbv_zero_bubble", "dualpipev")  # exactly two stages per rank, in a V
PIPELINE_SCHEDULES = ("auto", *SINGLE_STAGE_SCHEDULES, "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                      *V_SHAPED_SCHEDULES)


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks are combined. world size = tp · pp · dp."""
    tp: int = opt(1, "tensor-parallel degree", min=1)
    pp: int = opt(1, "pipeline-parallel degree", min=1)
    dp: Optional[int] = opt(None, "data-parallel degree (null: world size / (tp·pp))", min=1)
    virtual_stages: int = opt(1, "model chunks per pipeline rank (V): layers split into pp·V stages; V > 1 interleaves",
                              min=1)
    microbatches: Optional[int] = opt(None, "micro-batches per step on each data-parallel replica (null: "
                                      "global_batch_size/(micro_batch_size·dp), Megatron's rule; if set it must agree)",
                                      min=1)
    schedule: str = opt("auto", "pipeline schedule (auto: 1f1b, or interleaved_1f1b when virtual_stages > 1)",
                        choices=PIPELINE_SCHEDULES)
    sequence_parallel: bool = opt(False, "with tp > 1, shard norms/residuals along the sequence (Megatron SP); "
                                  "ignored when tp = 1")
    ranks_per_node: Optional[int] = opt(None, "ranks on one node (null: the launcher's LOCAL_WORLD_SIZE)", min=1)
    ranks_per_gpu: int = opt(1, "ranks sharing one physical GPU (2 for the GCDs of a Frontier MI250X)", min=1)

    def dp_size(self, world_size: int) -> int:
        """Data-parallel degree: `dp`, or what tp·pp leaves of the world."""
        return self.dp or world_size // (self.tp * self.pp)
    backend: str = opt("auto", "torch.distributed backend (auto: nccl with GPUs, gloo on CPU)",
                       choices=("auto", "gloo", "nccl"))
    bucket_mb: float = opt(25.0, "gradient all-reduce bucket size in MiB", min=0.0, min_exclusive=True)
    timeout_s: int = opt(600, "process-group timeout in seconds", min=1)


@dataclass(frozen=True)
class OffloadConfig:
    """Memory tiers (CPU / NVMe). No keys yet: offload is not implemented in this version."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Periodic checkpoints (atomic directories with a COMMITTED marker)."""
    dir: Optional[str] = opt(None, "where checkpoints go (null: <run dir>/checkpoints)")
    interval: int = opt(0, "save every N steps (0: only at the end when `save_final`)", min=0)
    save_final: bool = opt(True, "save a checkpoint after the last step")
    keep_last: int = opt(2, "committed checkpoints to keep (0: keep all)", min=0)


@dataclass(frozen=True)
class SnapshotConfig:
    """In-memory snapshots. No keys yet: snapshots are not implemented in this version."""


@dataclass(frozen=True)
class LogConfig:
    """Where a run writes and what it reports."""
    dir: str = opt("runs", "parent directory of run directories")
    name: Optional[str] = opt(None, "run name (null: the config file's stem)")
    interval: int = opt(10, "write a metrics line every N steps", min=1)
    progress: bool = opt(True, "show a progress bar on rank 0")
    wandb: bool = opt(False, "also log to Weights & Biases (offline unless WANDB_MODE says otherwise)")
    wandb_project: str = opt("strata", "wandb project name")
    peak_tflops: Optional[float] = opt(None, "per-device peak TFLOP/s for MFU (null: MFU not reported)",
                                       min=0.0, min_exclusive=True)


@dataclass(frozen=True)
class Config:
    """A whole experiment."""
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": ModelConfig.__doc__})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": DataConfig.__doc__})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": TrainConfig.__doc__})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"doc": OptimConfig.__doc__})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"doc": ParallelConfig.__doc__})
    offload: OffloadConfig = field(default_factory=OffloadConfig, metadata={"doc": OffloadConfig.__doc__})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": CheckpointConfig.__doc__})
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig, metadata={"doc": SnapshotConfig.__doc__})
    log: LogConfig = field(default_factory=LogConfig, metadata={"doc": LogConfig.__doc__})

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

def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
         world_size: int | None = None) -> Config:
    """Read a YAML experiment, apply `key.sub=value` overrides and validate everything.

    With `world_size`, also checks that the parallel layout and batch sizes fit it.
    Raises ConfigError listing every problem found.
    """
    problems: list[str] = []
    raw: dict = {}
    if path is not None:
        raw = _read_yaml(Path(path), problems)
    for item in overrides:
        _apply_override(raw, item, problems)
    cfg = _build(raw, problems)
    if cfg.log.name is None and path is not None:
        cfg = replace(cfg, "log.name", Path(path).stem)
    _check_and_raise(cfg, problems, world_size)
    return cfg


def from_dict(raw: dict, world_size: int | None = None) -> Config:
    """Build and validate a Config from a nested dict (as YAML would give)."""
    problems: list[str] = []
    cfg = _build(raw, problems)
    _check_and_raise(cfg, problems, world_size)
    return cfg


def _check_and_raise(cfg: Config, problems: list[str], world_size: int | None) -> None:
    """Add the cross-key problems to the per-key ones and raise if there are any. A key that was
    already rejected holds its default, so cross-checks that name it would mislead: drop those."""
    bad_keys = [re.escape(p.split(":", 1)[0]) for p in problems]
    names_bad_key = re.compile(rf"\b({'|'.join(bad_keys)})\b(?!\.)(?=\W|$)") if bad_keys else None
    problems.extend(p for p in _cross_checks(cfg, world_size) if not (names_bad_key and names_bad_key.search(p)))
    if problems:
        raise ConfigError(problems)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump(cfg: Config) -> str:
    """The resolved config as YAML (loadable again with `load`)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def replace(cfg: Config, key: str, value: Any) -> Config:
    """A copy of cfg with one dotted key changed (no validation)."""
    group, name = key.split(".", 1)
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **{name: value})})


def explain(key: str) -> str:
    """The doc, type and default of `group` or `group.key`."""
    group, _, name = key.partition(".")
    if group not in GROUPS:
        raise ConfigError([_unknown(key, all_keys() if name else list(GROUPS))])
    cls = GROUPS[group]
    if not name:
        lines = [f"{group}: {cls.__doc__}"]
        for f in dataclasses.fields(cls):
            lines.append(f"  {group}.{f.name} = {f.default!r}  # {f.metadata['doc']}")
        return "\n".join(lines)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise ConfigError([_unknown(key, [f"{group}.{n}" for n in fields])])
    f = fields[name]
    hint = typing.get_type_hints(cls)[name]
    text = f"{key}: {f.metadata['doc']}\n  type: {_type_name(hint)}\n  default: {f.default!r}"
    if f.metadata.get("choices"):
        text += f"\n  choices: {', '.join(map(str, f.metadata['choices']))}"
    return text


def all_keys() -> list[str]:
    return [f"{g}.{f.name}" for g, cls in GROUPS.items() for f in dataclasses.fields(cls)]


# --- internals ------------------------------------------------------------------------------

def _read_yaml(path: Path, problems: list[str]) -> dict:
    if not path.is_file():
        problems.append(f"config file {str(path)!r} does not exist; pass the path to a YAML experiment (see configs/)")
        return {}
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        problems.append(f"{path}: not valid YAML: {e}")
        return {}
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(f"{path}: the top level must be a mapping of groups ({', '.join(GROUPS)}), got {type(raw).__name__}")
        return {}
    return raw


def _apply_override(raw: dict, item: str, problems: list[str]) -> None:
    key, eq, text = item.partition("=")
    if not eq or "." not in key:
        problems.append(f"override {item!r}: write it as group.key=value, e.g. train.steps=100")
        return
    group, name = key.strip().split(".", 1)
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        problems.append(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]}); quote it")
        return
    target = raw.setdefault(group, {})
    if not isinstance(target, dict):
        problems.append(f"override {item!r}: {group} is not a mapping in the config file")
        return
    target[name] = value


def _build(raw: dict, problems: list[str]) -> Config:
    groups = {}
    for group, value in raw.items():
        if group not in GROUPS:
            problems.append(_unknown(str(group), list(GROUPS)))
            continue
        if value is None:
            value = {}
        if not isinstance(value, dict):
            problems.append(f"{group}: must be a mapping of keys, got {type(value).__name__} {value!r}")
            continue
        groups[group] = _build_group(group, GROUPS[group], value, problems)
    return Config(**groups)


def _build_group(group: str, cls: type, values: dict, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{group}.{name}"
        if name not in fields:
            problems.append(_unknown(key, [f"{group}.{n}" for n in fields] + [f"{g}.{n}" for g in GROUPS
                                                                             for n in _field_names(GROUPS[g])]))
            continue
        ok, converted, why = _coerce(value, hints[name])
        if not ok:
            problems.append(f"{key}: expected {_type_name(hints[name])}, got {value!r} ({why})")
            continue
        err = _range_problem(converted, fields[name].metadata)
        if err:
            problems.append(f"{key}: {converted!r} {err}")
            continue
        kwargs[name] = converted
    return cls(**kwargs)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _coerce(value: Any, hint: Any) -> tuple[bool, Any, str]:
    """Check `value` against a type hint; ints widen to floats, numeric strings ("3e-4") to floats."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        if value is None:
            return True, None, ""
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        return (True, value, "") if isinstance(value, bool) else (False, None, "use true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, ""
        return False, None, "use a whole number"
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value), ""
        if isinstance(value, str):
            try:
                return True, float(value), ""
            except ValueError:
                pass
        return False, None, "use a number"
    if hint is str:
        return (True, value, "") if isinstance(value, str) else (False, None, "use a string")
    return False, None, f"unsupported type {hint}"


def _range_problem(value: Any, meta: dict) -> str | None:
    if value is None:
        return None
    if meta.get("choices") and value not in meta["choices"]:
        return f"is not one of: {', '.join(map(str, meta['choices']))}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            return "must be finite"
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
            return f"must be {'>' if meta.get('min_exclusive') else '>='} {lo}"
        if hi is not None and value > hi:
            return f"must be <= {hi}"
    return None


def _unknown(key: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean {match[0]!r}?" if match else f"; valid: {', '.join(sorted(set(candidates))[:12])}"
    return f"{key}: unknown key{hint}"


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return f"{inner.__name__} or null"
    return getattr(hint, "__name__", str(hint))


def _cross_checks(cfg: Config, world_size: int | None) -> list[str]:
    """Constraints between keys (and against the world size, when known)."""
    p: list[str] = []
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    if m.d_model % m.n_heads:
        p.append(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model}")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        p.append(f"model.n_kv_heads={kv} must divide model.n_heads={m.n_heads}")
    elif (m.d_model // m.n_heads) % 2:
        p.append(f"head size d_model/n_heads={m.d_model // m.n_heads} must be even for RoPE")
    if m.n_heads % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.n_heads={m.n_heads}")
    elif kv % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.n_kv_heads={kv}")
    stages = par.pp * par.virtual_stages
    if m.n_layers % stages:
        p.append(f"parallel.pp·virtual_stages = {par.pp}·{par.virtual_stages} = {stages} pipeline stages must divide "
                 f"model.n_layers={m.n_layers} (stages are balanced by layers)")
    p += _schedule_checks(par)
    if par.sequence_parallel and par.tp > 1 and m.seq_len % par.tp:
        p.append(f"parallel.sequence_parallel splits the sequence over tp={par.tp} ranks: model.seq_len={m.seq_len} "
                 "must be a multiple of tp")
    if m.ffn_hidden and m.ffn_hidden % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.ffn_hidden={m.ffn_hidden}")
    # The vocabulary never depends on the layout (unlike Megatron, which pads to a multiple of
    # 128·tp), so a checkpoint loads into any tp degree: the padding multiple must suit every tp.
    if m.vocab_size and m.vocab_size % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.vocab_size={m.vocab_size}")
    if not m.vocab_size and m.pad_vocab_multiple % par.tp:
        p.append(f"parallel.tp={par.tp} must divide model.pad_vocab_multiple={m.pad_vocab_multiple} (the vocabulary "
                 "is padded to a multiple of it and split over tp ranks); use a multiple of tp such as 128")
    if tr.global_batch_size % tr.micro_batch_size:
        p.append(f"train.micro_batch_size={tr.micro_batch_size} must divide "
                 f"train.global_batch_size={tr.global_batch_size}")
    if cfg.optim.warmup_steps > tr.steps:
        p.append(f"optim.warmup_steps={cfg.optim.warmup_steps} exceeds train.steps={tr.steps}; lower it "
                 "or train longer")
    if world_size is not None:
        layout_issues = layout_problems(par, world_size)
        p += layout_issues
        if not layout_issues:
            dp = cfg.dp_size(world_size)
            if tr.global_batch_size % (tr.micro_batch_size * dp):
                p.append(f"train.global_batch_size={tr.global_batch_size} must be a multiple of "
                         f"train.micro_batch_size·dp = {tr.micro_batch_size}·{dp}")
            else:
                p += _microbatch_checks(cfg, cfg.grad_accum_steps(world_size), dp)
    return p


def _schedule_checks(par: ParallelConfig) -> list[str]:
    p: list[str] = []
    v, name = par.virtual_stages, par.schedule
    if v > 1 and par.pp == 1:
        p.append(f"parallel.virtual_stages={v} needs pipeline parallelism: set parallel.pp > 1 or virtual_stages=1")
    if name in SINGLE_STAGE_SCHEDULES and v > 1:
        p.append(f"parallel.schedule={name} runs one stage per rank but virtual_stages={v}; use interleaved_1f1b, "
                 "looped_bfs or interleaved_zero_bubble, or set virtual_stages=1")
    if name in V_SHAPED_SCHEDULES and v != 2:
        p.append(f"parallel.schedule={name} needs exactly two stages per rank: set parallel.virtual_stages=2")
    return p


def _microbatch_checks(cfg: Config, derived: int, dp: int) -> list[str]:
    """`derived` = global_batch_size / (micro_batch_size·dp): the micro-batches one replica runs."""
    par, tr = cfg.parallel, cfg.train
    p: list[str] = []
    if par.microbatches is not None and par.microbatches != derived:
        mbs = tr.global_batch_size / (par.microbatches * dp)
        fix = f"set train.micro_batch_size={int(mbs)}" if mbs == int(mbs) and mbs >= 1 else "change global_batch_size"
        p.append(f"parallel.microbatches={par.microbatches} disagrees with global_batch_size/(micro_batch_size·dp) = "
                 f"{derived}; {fix} or leave parallel.microbatches null")
        return p
    if par.pp > 1 and par.schedule == "dualpipev" and derived < 2 * par.pp:
        p.append(f"parallel.schedule=dualpipev needs at least as many micro-batches as stages (2·pp = {2 * par.pp}) "
                 f"but gets {derived}; lower train.micro_batch_size or raise train.global_batch_size")
    elif par.pp > 1 and derived < par.pp:
        p.append(f"pipeline needs at least pp={par.pp} micro-batches per step but gets {derived} (global_batch_size/"
                 f"(micro_batch_size·dp)); lower train.micro_batch_size or raise train.global_batch_size")
    elif par.pp > 1 and par.virtual_stages > 1 and derived % max(1, derived // par.pp):
        p.append(f"interleaved schedules run micro-batches in rounds of about pp={par.pp}: {derived} micro-batches "
                 f"must be a multiple of {derived // par.pp}; use a multiple of pp")
    return p


def reference_markdown() -> str:
    """The config reference page (docs/CONFIG.md), generated from the schema so it cannot drift."""
    out = ["# Config reference", "",
           "Generated from `trainer/config.py` by `python -m trainer.config > docs/CONFIG.md`; "
           "`strata config explain KEY` prints the same for one key.", ""]
    for group, cls in GROUPS.items():
        out += [f"## `{group}`", "", cls.__doc__ or "", ""]
        fields = dataclasses.fields(cls)
        if not fields:
            out += ["(no keys yet)", ""]
            continue
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        hints = typing.get_type_hints(cls)
        for f in fields:
            doc = f.metadata["doc"] + (f" ({', '.join(f.metadata['choices'])})" if f.metadata.get("choices") else "")
            default = yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix("...").strip()
            out.append(f"| `{group}.{f.name}` | {_type_name(hints[f.name])} | `{default}` | {doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
