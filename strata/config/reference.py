"""The reference a user reads: `explain` (what `strata config explain KEY` prints), `overview` (what
`strata config explain` prints: the groups), `all_keys`, and
`reference_markdown`, the page docs/CONFIG.md (`python -m strata.config > docs/CONFIG.md`),
all generated from the schema's doc strings so they cannot drift from it.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any

import yaml

from strata.config.schema import GROUPS
from strata.config.schema.fields import key_of
from strata.config.schema.keys import (
    entries,
    is_group,
    optional_of,
    plain,
    record_of,
    required,
    type_name,
    unknown,
    walk,
)
from strata.errors import ConfigError


def explain(key: str) -> str:
    """The doc, type and default of a key, or the doc of a group and of every key in it."""
    known = entries()
    if key not in known:
        raise ConfigError([unknown(key)])
    f, hint = known[key]
    if is_group(hint):
        lines = [f"{key}: {f.metadata['doc']}"]
        for sub, sub_f, sub_hint in walk(hint, key):
            indent = "  " * (sub.count(".") - key.count("."))
            lines.append(
                f"{indent}{sub}: {sub_f.metadata['doc']}"
                if is_group(sub_hint)
                else f"{indent}{sub} = {plain(sub_f.default)!r}  # {sub_f.metadata['doc']}"
            )
        return "\n".join(lines)
    text = f"{key}: {f.metadata['doc']}\n  type: {type_name(hint)}\n  default: {plain(f.default)!r}"
    for sub, sub_hint, default, doc in _record_keys(hint):
        text += f"\n  {key}[i].{sub} ({type_name(sub_hint)}, {default.strip('`')}): {doc}"
    if f.metadata.get("choices"):
        text += f"\n  choices: {', '.join(map(str, f.metadata['choices']))}"
    return text


def overview() -> str:
    """Every group with the first line of its doc, and how to see a group's or a key's."""
    known = entries()
    width = max(map(len, GROUPS))
    lines = ["groups of keys:"]
    for group in GROUPS:
        doc = " ".join(known[group][0].metadata["doc"].split())
        summary = doc.split(". ")[0].split("; ")[0].removesuffix(".")
        for i, part in enumerate(textwrap.wrap(summary, 96 - width)):
            lines.append(f"  {group if i == 0 else '':<{width}}  {part}")
    lines += [
        "",
        "strata config explain GROUP lists a group's keys (strata config explain optim),",
        "strata config explain KEY gives a key's doc, type and default (strata config explain "
        "optim.lr).",
    ]
    return "\n".join(lines)


def all_keys() -> list[str]:
    """Every settable key, dotted (`train.steps`, `zero.params.shard_over`), in schema order."""
    return [key for key, (_, hint) in entries().items() if not is_group(hint)]


def reference_markdown() -> str:
    """The config reference page (docs/CONFIG.md), generated from the schema so it cannot drift."""
    out = [
        "# Config reference",
        "",
        "Generated from `strata/config/schema/` by `python -m strata.config > docs/CONFIG.md`; "
        "`strata config explain KEY` prints the same for one key.",
        "",
    ]
    for group, cls in GROUPS.items():
        out += [f"## `{group}`", "", cls.__doc__ or "", ""]
        rows = []
        for key, f, hint in walk(cls, group):
            doc = f.metadata["doc"] + (
                f" ({', '.join(f.metadata['choices'])})" if f.metadata.get("choices") else ""
            )
            if is_group(hint):
                rows.append(f"| `{key}` | group | | {doc} |")
                continue
            value = plain(f.default)
            default = (
                yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            )
            rows.append(f"| `{key}` | {type_name(hint)} | `{default}` | {doc} |")
            rows += [
                f"| `{key}[i].{sub}` | {type_name(h)} | {d} | {doc} |"
                for sub, h, d, doc in _record_keys(hint)
            ]
        if not rows:
            out += ["(no keys yet)", ""]
            continue
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    return "\n".join(out)


def _record_keys(hint: Any) -> list[tuple[str, Any, str, str]]:
    """(name, type hint, default as markdown, doc) of each key of a list-of-records key's items."""
    record = record_of(optional_of(hint) or hint)
    if record is None:
        return []
    hints = typing.get_type_hints(record)
    return [
        (
            key_of(f),
            hints[f.name],
            "required" if required(f) else f"`{plain(f.default)!r}`",
            f.metadata["doc"],
        )
        for f in dataclasses.fields(record)
    ]
