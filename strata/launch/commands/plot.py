"""`strata plot`: a PNG of a run's loss and throughput curves (`strata plot RUN_DIR`), or of a
pipeline schedule's step record (`strata plot schedule RECORD.json`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.errors import StrataError
from strata.launch.commands.common import CommandHelp, Subcommand, file_errors

HELP = CommandHelp(
    "plot",
    summary="PNG of a run's loss and throughput curves, or of a pipeline schedule record",
    usage=("strata plot RUN_DIR [--out PNG]", "strata plot schedule RECORD.json [--out PNG]"),
    description="PNG of a run's loss and throughput curves, or of a pipeline schedule record.",
    examples=(
        "strata plot runs/tiny                      # runs/tiny/curves.png",
        "strata plot schedule records/step.json     # records/step.png",
    ),
)


SCHEDULE = CommandHelp(
    "schedule",
    summary="PNG of a pipeline schedule's step record",
    usage=("strata plot schedule RECORD.json [--out PNG]",),
    description="PNG of the per-rank timeline of a pipeline step recorded by\n"
    "bench/pipeline_schedule.py --record-dir.",
    examples=("strata plot schedule records/step.json     # records/step.png",),
)


def add_arguments(pl: argparse.ArgumentParser) -> None:
    """The run directory (or `schedule` and a step record) and the PNG's path."""
    pl.add_argument(
        "run_dir",
        metavar="RUN_DIR | schedule",
        help="run directory (writes curves.png there), or the word `schedule`",
    )
    pl.add_argument(
        "record",
        nargs="?",
        metavar="RECORD.json",
        help="with `schedule`: a step record from bench/pipeline_schedule.py --record-dir "
        "(writes RECORD.png next to it)",
    )
    pl.add_argument("--out", help="PNG path (default: next to the input)")


def _add_schedule_arguments(pl: argparse.ArgumentParser) -> None:
    """The step record and the PNG's path."""
    pl.add_argument(
        "record",
        metavar="RECORD.json",
        help="a step record from bench/pipeline_schedule.py --record-dir (writes RECORD.png next "
        "to it)",
    )
    pl.add_argument("--out", help="PNG path (default: next to the input)")


def run(args: argparse.Namespace) -> int:
    """Write the PNG and print its path."""
    from strata.trainer.plots import plot_run, plot_schedule

    out = Path(args.out) if args.out else None
    if getattr(args, "action", None) == "schedule":  # strata plot schedule RECORD.json
        with file_errors("strata plot schedule"):
            print(f"wrote {plot_schedule(Path(args.record), out)}")
    elif args.record is None:  # strata plot RUN_DIR
        with file_errors("strata plot"):
            print(f"wrote {plot_run(Path(args.run_dir), out)}")
    else:
        raise StrataError(
            f"strata plot: unexpected second argument {args.record!r}; use `strata plot RUN_DIR` "
            "or `strata plot schedule RECORD.json`"
        )
    return 0


SUBCOMMANDS = (Subcommand(SCHEDULE, _add_schedule_arguments, run),)
