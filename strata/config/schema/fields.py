"""The field helpers every group of the schema is written with: `opt` (a key with its default, doc
string and range checks) and `nested` (a group inside a group), and `key_of` (a field's name in
YAML, where a Python keyword cannot be the field's name).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


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


def key_of(f: dataclasses.Field[Any]) -> str:
    """A field's name in YAML."""
    return f.metadata.get("key") or f.name


def nested(cls: type, doc: str | None = None) -> Any:
    """A group of keys inside a group (`zero.params.shard_over`): the dataclass `cls` with its
    defaults, and a one-line doc (null: the class's docstring)."""
    return field(default_factory=cls, metadata={"doc": doc or cls.__doc__})
