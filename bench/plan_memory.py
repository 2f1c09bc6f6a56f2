"""The planner's memory model against measured bytes, layout by layout.

    python bench/plan_memory.py [LAYOUT ...] [--json OUT]

Runs the layouts of tests/memory_probe.py (all of them by default) in one 4-rank gloo world on this
machine: each trains two steps with the real trainer, and every rank reports the bytes it holds
by kind and tier, measured from its tensors. Prints a markdown table, one row per layout, rank
position (pipeline stage) and kind/tier: the figure `strata.plan.memory.estimate_memory`
predicts, the measured one (the largest over the ranks of that stage), and the error, then the
largest |error| over the rows. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from memory_probe import LAYOUTS, UNCOMPARED, compare, run_probe  # noqa: E402


def table(measured: dict[str, list[dict]], nvme_dir: str | Path) -> tuple[list[str], float]:
    """Markdown lines and the largest |error| (a share) over the compared rows that have a measurement."""
    lines = [
        "| layout | stage | kind | predicted | measured | error % |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    worst = 0.0
    for name, ranks in measured.items():
        rows: dict[tuple[int, str], dict] = {}
        for row in compare(name, ranks, nvme_dir):
            key = (row["pp_stage"], row["key"])
            if key not in rows or row["measured"] > rows[key]["measured"]:
                rows[key] = row
        for (stage, kind), row in sorted(rows.items()):
            err = row["error"]
            compared = kind.split("/")[0] not in UNCOMPARED
            worst = max(worst, abs(err)) if compared else worst
            shown = ("n/a" if math.isinf(err) else f"{100 * err:+.1f}") + (
                "" if compared else " (not compared)"
            )
            flag = "" if row["ok"] else " ✗"
            lines.append(
                f"| {name} | {stage} | {kind} | {row['predicted']:,} | {row['measured']:,} | {shown}{flag} |"
            )
    return lines, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="*", help=f"any of: {', '.join(LAYOUTS)}")
    parser.add_argument("--json", help="also save the measurements here")
    args = parser.parse_args()
    names = args.layouts or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        measured = run_probe(names, Path(tmp) / "ranks", Path(tmp) / "nvme")
        lines, worst = table(measured, Path(tmp) / "nvme")
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=1))
    print("\n".join(lines))
    shown = "n/a (a kind measured as 0)" if math.isinf(worst) else f"{100 * worst:.1f}%"
    print(f"\nmax |error| of the compared kinds: {shown}")


if __name__ == "__main__":
    main()
