"""Loading: a YAML experiment (a key given twice refused) and `key.sub=value` overrides into a
nested mapping, a Hugging Face directory's config.json into the `model:` block, and that mapping
into the frozen `Config`, every value coerced to its key's type and range-checked, every problem
collected; then the cross-checks (`strata.config.checks`), and one ConfigError listing them all.
Also the way back: `to_dict` and `dump`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from strata.config.checks import cross_problems, path_problem
from strata.config.schema import GROUPS, Config, ModelConfig
from strata.config.schema.fields import key_of
from strata.config.schema.keys import (
    is_group,
    item_of,
    optional_of,
    plain,
    record_of,
    replace,
    required,
    type_name,
    unknown,
)
from strata.errors import ConfigError
from strata.hf import config_json


def load(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    world_size: int | None = None,
    local_world_size: int | None = None,
) -> Config:
    """Read a YAML experiment, apply `key.sub=value` overrides and validate everything.

    With `world_size`, also checks that the parallel layout and batch sizes fit it; where a launcher
    says how many of its ranks run on each node (`local_world_size`), with that as the node size
    parallel.ranks_per_node null stands for. Raises ConfigError listing every problem found.
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
    _check_and_raise(cfg, problems, world_size, local_world_size)
    return cfg


def _derive_from_hf(raw: dict[str, Any], problems: list[str]) -> None:
    """With model.init_from naming a Hugging Face model directory, fill the model block from its
    config.json (the user's own keys must agree with it). Only when a user's experiment is loaded:
    a checkpoint's config.yaml already holds the derived values, and the directory may be gone."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    source = model.get("init_from")
    if not isinstance(source, str) or path_problem("model.init_from", source):
        return  # unset, or a problem the type and path checks report
    if not Path(source).is_dir():
        problems.append(
            f"model.init_from: {source!r} is not a directory; give a local Hugging Face model "
            "directory (config.json + model.safetensors) or a Strata checkpoint directory"
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
        derived = config_json.model_settings(hf_config, seq_len if isinstance(seq_len, int) else 0)
    except ConfigError as e:  # the features Strata lacks, each naming its config.json field
        problems += [f"model.init_from: {path}: {p}" for p in e.problems]
        return
    clashes = config_json.conflicts(model, derived)
    problems += [f"model.init_from: {c}" for c in clashes]
    if not clashes:
        raw["model"] = merge_groups(derived, model)


def merge_groups(base: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """`own`'s keys over `base`'s, group by group (a nested group keeps the keys of `base` that `own`
    does not set); neither is changed."""
    out = dict(base)
    for key, value in own.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge_groups(out[key], value) if nested else value
    return out


def from_yaml(data: bytes | str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build and validate a Config from a YAML document (a checkpoint's config.yaml), with
    `key.sub=value` overrides applied."""
    if not overrides:
        return from_dict(yaml.safe_load(data))
    problems: list[str] = []
    raw = yaml.safe_load(data)
    for item in overrides:
        _apply_override(raw, item, problems)
    cfg = _build(raw, problems)
    _check_and_raise(cfg, problems, None)
    return cfg


def from_dict(raw: dict[str, Any], world_size: int | None = None) -> Config:
    """Build and validate a Config from a nested dict (as YAML would give)."""
    problems: list[str] = []
    cfg = _build(raw, problems)
    _check_and_raise(cfg, problems, world_size)
    return cfg


def _check_and_raise(
    cfg: Config, problems: list[str], world_size: int | None, local_world_size: int | None = None
) -> None:
    """Add the cross-key problems to the per-key ones and raise if there are any. A key that was
    already rejected holds its default, so cross-checks that name it would mislead: drop those."""
    bad_keys = [re.escape(p.split(":", 1)[0]) for p in problems]
    names_bad_key = re.compile(rf"\b({'|'.join(bad_keys)})\b(?!\.)(?=\W|$)") if bad_keys else None
    problems.extend(
        p
        for p in cross_problems(cfg, world_size, local_world_size)
        if not (names_bad_key and names_bad_key.search(p))
    )
    if problems:
        raise ConfigError(problems)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain values (a list key as a list), under the YAML names of its keys."""
    return {key_of(f): plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def dump(cfg: Config) -> str:
    """The resolved config as YAML (loadable again with `load`)."""
    text: str = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    return text


# --- reading YAML and overrides ------------------------------------------------------------------


class _PlainYAMLError(yaml.YAMLError):  # type: ignore[misc, unused-ignore]
    """A mapping that gives one key twice (or a value no Python object can hold): a message of one line."""


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc, unused-ignore]
    """yaml.safe_load's loader, but a key given twice in one mapping is an error (PyYAML keeps the
    last silently, so a typo'd copy of a group would quietly replace the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """A YAML mapping as a dict, refusing a key given twice with both lines named."""
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
                    f"line {line}: duplicate key {key!r} (first given on line {first}); keep one "
                    "of them"
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
        problems.append(
            f"config file {str(path)!r} is a directory; pass the path to a YAML "
            "experiment (see configs/)"
        )
        return {}
    if not path.is_file():
        problems.append(
            f"config file {str(path)!r} does not exist; pass the path to a YAML "
            "experiment (see configs/)"
        )
        return {}
    try:
        raw = _safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        problems.append(
            f"{path}: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); save it as UTF-8"
        )
        return {}
    except OSError as e:
        problems.append(
            f"config file {str(path)!r} cannot be read ({e.strerror}); check its permissions"
        )
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
            f"{path}: the top level must be a mapping of groups ({', '.join(GROUPS)}), got "
            f"{type(raw).__name__}"
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
                f"override {item!r}: {'.'.join(path[: depth + 1])} is not a mapping (it is "
                f"{target!r}), so it has no keys to set"
            )
            return
    target[path[-1]] = value


# --- building the dataclasses --------------------------------------------------------------------


def _build(raw: dict[str, Any], problems: list[str]) -> Config:
    data = raw.get("data")
    if isinstance(data, dict) and isinstance(data.get("sources"), list) and not data["sources"]:
        # an empty list would read as "no mixture" and train on data.path or the built-in corpus
        problems.append(
            "data.sources: an empty list names no data; list at least one prepared directory "
            "([{path: DIR, weight: 1}]), or remove the key to train on data.path"
        )
    cfg: Config = _build_group("", Config, raw, problems)
    return cfg


def _build_group(prefix: str, cls: type, values: dict[str, Any], problems: list[str]) -> Any:
    """The dataclass `cls` (the keys below the dotted `prefix`) from a mapping: groups recurse,
    values are coerced and range-checked; a rejected key keeps its default."""
    hints = typing.get_type_hints(cls)
    fields = {key_of(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            problems.append(unknown(key))
            continue
        f = fields[name]
        ok, built = _build_value(key, f, hints[f.name], value, problems)
        if ok:
            kwargs[f.name] = built
    return cls(**kwargs)


def _build_value(
    key: str, f: dataclasses.Field[Any], hint: Any, value: Any, problems: list[str]
) -> tuple[bool, Any]:
    """(True, the value of the field `f`) built from YAML's `value`: a group, a list of records or
    one value; (False, None), with the problem added, when it is wrong."""
    if is_group(hint):
        value = {} if value is None else value
        if isinstance(value, dict):
            return True, _build_group(key, hint, value, problems)
        problems.append(f"{key}: must be a mapping of keys, got {type(value).__name__} {value!r}")
        return False, None
    record = record_of(optional_of(hint) or hint)
    if record is not None:
        if value is None:
            return True, None
        items = _build_records(key, record, value, problems)
        return items is not None, items
    if isinstance(value, dict):
        problems.append(
            f"{key}: expected {type_name(hint)}, got the mapping {value!r} ({key} is one value, "
            "not a group of keys)"
        )
        return False, None
    ok, converted, why = _coerce(value, hint)
    if not ok:
        problems.append(
            f"{key}: {why}"
            if why.startswith("item ")
            else f"{key}: expected {type_name(hint)}, got {value!r} ({why})"
        )
        return False, None
    if isinstance(converted, tuple):
        err = _items_problem(converted, f.metadata)
    else:
        err = _range_problem(converted, f.metadata)
        err = err and f"{converted!r} {err}"
    if err:
        problems.append(f"{key}: {err}")
        return False, None
    return True, converted


def _build_records(key: str, cls: type, value: Any, problems: list[str]) -> tuple[Any, ...] | None:
    """A list of records (YAML: a list of mappings, also in an override's flow syntax) as a tuple
    of `cls`, each item's keys checked as a group's are and named `key[i].name` (i from 0); None,
    with the problems added, if any item is wrong."""
    fields = {key_of(f): f for f in dataclasses.fields(cls)}
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
        problems += [
            f"{where}.{k}: unknown key; valid: {', '.join(fields)}" for k in item if k not in fields
        ]
        missing = [name for name, f in fields.items() if required(f) and name not in item]
        problems += [
            f"{where}.{name}: missing; give the {fields[name].metadata['doc']}" for name in missing
        ]
        if not missing:
            items.append(_build_group(where, cls, known, problems))
    return tuple(items) if len(problems) == before else None


def _coerce(value: Any, hint: Any) -> tuple[bool, Any, str]:
    """Check `value` against a type hint; ints widen to floats, numeric strings ("3e-4") to floats, a
    list to the tuple of its coerced items (the reason for a bad item starts with "item N")."""
    inner = optional_of(hint)
    if inner is not None:
        if value is None:
            return True, None, ""
        hint = inner
    item_hint = item_of(hint)
    if item_hint is not None:
        return _coerce_list(value, item_hint)
    if hint is bool:
        return (True, value, "") if isinstance(value, bool) else (False, None, "use true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, ""
        return False, None, "use a whole number"
    if hint is float:
        return _coerce_float(value)
    if hint is str:
        return (True, value, "") if isinstance(value, str) else (False, None, "use a string")
    return False, None, f"unsupported type {hint}"


def _coerce_list(value: Any, item_hint: Any) -> tuple[bool, Any, str]:
    """`_coerce` for a list key: the tuple of the coerced items, or why the first bad one is bad."""
    if not isinstance(value, (list, tuple)):
        return False, None, "use a list, e.g. [a, b]"
    items = []
    for i, item in enumerate(value, 1):
        ok, converted, why = _coerce(item, item_hint)
        if not ok:
            return (
                False,
                None,
                f"item {i} is {item!r}, " + (f"not {why[4:]}" if why.startswith("use ") else why),
            )
        items.append(converted)
    return True, tuple(items), ""


def _coerce_float(value: Any) -> tuple[bool, Any, str]:
    """`_coerce` for a float key: a number (an int widens) or a numeric string ("3e-4")."""
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
