"""The schema as a tree of dotted keys (`train.steps`, `zero.params.shard_over`): walking it, reading
and replacing one key of a built config, a key's type in words, a config as plain values, and the
message for a key that is not in it (naming the closest one that is).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterator
from typing import Any

from strata.config.schema.experiment import GROUPS, Config
from strata.config.schema.fields import key_of


def is_group(hint: Any) -> bool:
    """Whether a field's type hint is a group of keys (a dataclass) rather than one value."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """(dotted key, field, type hint) of every field below the dataclass `cls`, depth first in
    declaration order; a group comes just before its keys."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{key_of(f)}" if prefix else key_of(f)
        yield key, f, hints[f.name]
        if is_group(hints[f.name]):
            yield from walk(hints[f.name], key)


@functools.cache
def entries() -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    """Every group and key of Config by dotted name."""
    return {key: (f, hint) for key, f, hint in walk(Config)}


def optional_of(hint: Any) -> Any:
    """X for a hint `X | None` (or `Optional[X]`), else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


def item_of(hint: Any) -> Any:
    """X for a list hint `tuple[X, ...]`, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def record_of(hint: Any) -> Any:
    """R for a list of records `tuple[R, ...]` (R a dataclass: `data.sources`), else None."""
    item = item_of(hint)
    return item if is_group(item) else None


def required(f: dataclasses.Field[Any]) -> bool:
    """Whether a field has no default (a record's `path`): YAML must give it."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def type_name(hint: Any) -> str:
    """A key's type in words: `int`, `float or null`, `list of int or null`."""
    inner = optional_of(hint)
    if inner is not None:
        return f"{type_name(inner)} or null"
    item = item_of(hint)
    if item is not None:
        return f"list of {type_name(item)}"
    if is_group(hint):
        return "mappings {" + ", ".join(key_of(f) for f in dataclasses.fields(hint)) + "}"
    return getattr(hint, "__name__", str(hint))


def plain(value: Any) -> Any:
    """A config value as YAML would give it: a group as a dict under its keys' YAML names, a list
    key's tuple as a list."""
    if dataclasses.is_dataclass(value):
        return {key_of(f): plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return [plain(v) for v in value] if isinstance(value, tuple) else value


def get(cfg: Any, key: str) -> Any:
    """The value of a dotted key (`log.name`) in a config."""
    for name in key.split("."):
        cfg = getattr(cfg, next(f.name for f in dataclasses.fields(cfg) if key_of(f) == name))
    return cfg


def replace(cfg: Any, key: str, value: Any) -> Any:
    """A copy of cfg with one dotted key (`optim.lr`, `zero.params.shard_over`) changed (no validation)."""
    name, _, rest = key.partition(".")
    name = next((f.name for f in dataclasses.fields(cfg) if key_of(f) == name), name)
    return dataclasses.replace(
        cfg, **{name: replace(getattr(cfg, name), rest, value) if rest else value}
    )


# Other frameworks' names for keys Strata spells differently (transformers' TrainingArguments and
# config.json, Megatron, nanoGPT): spelling alone would suggest a wrong key (learning_rate is
# nearer min_lr_ratio than lr).
ALIASES = {
    "learning_rate": "lr",
    "max_lr": "lr",
    "min_lr": "min_lr_ratio",
    "warmup": "warmup_steps",
    "warmup_iters": "warmup_steps",
    "lr_warmup_iters": "warmup_steps",
    "lr_scheduler_type": "schedule",
    "lr_decay_style": "schedule",
    "wd": "weight_decay",
    "max_grad_norm": "grad_clip",
    "clip_grad": "grad_clip",
    "adam_beta1": "beta1",
    "adam_beta2": "beta2",
    "adam_epsilon": "eps",
    "adam_eps": "eps",
    "max_steps": "steps",
    "train_iters": "steps",
    "max_iters": "steps",
    "batch_size": "global_batch_size",
    "global_batch": "global_batch_size",
    "micro_batch": "micro_batch_size",
    "num_layers": "n_layers",
    "num_hidden_layers": "n_layers",
    "n_layer": "n_layers",
    "hidden_size": "d_model",
    "n_embd": "d_model",
    "num_attention_heads": "n_heads",
    "n_head": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_hidden",
    "ffn_hidden_size": "ffn_hidden",
    "max_position_embeddings": "seq_len",
    "seq_length": "seq_len",
    "block_size": "seq_len",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
}


def unknown(key: str) -> str:
    """`key` is not in the schema: name the key another framework's name for it means (`ALIASES`),
    else the closest dotted key that is (in any group), else the valid keys beside it."""
    known = list(entries())
    parent, _, last = key.rpartition(".")
    alias = ALIASES.get(last)
    if alias:
        candidates = [k for k in known if k == f"{parent}.{alias}".lstrip(".")]
        candidates += [k for k in known if k.rpartition(".")[2] == alias]
        if candidates:
            return f"{key}: unknown key; did you mean {candidates[0]!r}?"
    beside = [k for k in known if not key.startswith(k + ".")]  # its own groups are no suggestion
    match = difflib.get_close_matches(key, beside, n=1, cutoff=0.6)
    if match:
        return f"{key}: unknown key; did you mean {match[0]!r}?"
    siblings = [k for k in known if k.rpartition(".")[0] == parent] or list(GROUPS)
    return f"{key}: unknown key; valid: {', '.join(sorted(siblings)[:12])}"
