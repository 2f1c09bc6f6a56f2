"""`strata config`: show a resolved, validated config (optionally checked against a world size, with
the planner's memory warning), or explain a key or group of the schema (with no key: the groups)."""

from __future__ import annotations

import argparse

from strata.launch.commands.common import (
    OVERRIDES,
    CommandHelp,
    Subcommand,
    warn_memory,
    whole,
)

HELP = CommandHelp(
    "config",
    summary="show a resolved config or explain a key",
    usage=(
        "strata config show CFG [key=value ...] [--world-size N]",
        "strata config explain [KEY | GROUP]",
    ),
    description="Show a resolved, validated config, or explain a key or group.",
    examples=(
        "strata config show configs/tiny.yaml optim.lr=1e-4",
        "strata config show configs/llama2-7b-3d.yaml --world-size 32",
        "strata config explain optim.lr",
        "strata config explain optim",
    ),
)

SHOW = CommandHelp(
    "show",
    summary="print the resolved, validated config",
    usage=("strata config show CFG [key=value ...] [--world-size N]",),
    description="Print the resolved config: the file with the overrides applied and every default "
    "filled in,\nafter every check (with --world-size, also against that many processes, warning "
    "when a rank\nis predicted not to fit this machine).",
    examples=(
        "strata config show configs/tiny.yaml optim.lr=1e-4",
        "strata config show configs/llama2-7b-3d.yaml --world-size 32",
    ),
)

EXPLAIN = CommandHelp(
    "explain",
    summary="the doc, type and default of a key, or a group's keys (no KEY: the groups)",
    usage=("strata config explain [KEY | GROUP]",),
    description="The doc, type and default of a key, or the doc of a group and of every key in it;"
    "\nwith neither, the groups.",
    examples=(
        "strata config explain",
        "strata config explain optim",
        "strata config explain optim.lr",
    ),
)


def add_arguments(c: argparse.ArgumentParser) -> None:
    """Nothing of its own: `show` and `explain` (SUBCOMMANDS) have the arguments."""


def _add_show_arguments(c: argparse.ArgumentParser) -> None:
    """The config file, the overrides and the world size to check against."""
    c.add_argument("target", metavar="CFG", help="config file")
    c.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=OVERRIDES)
    c.add_argument(
        "--world-size", type=whole(1), help="also check the layout against this many processes"
    )


def _add_explain_arguments(c: argparse.ArgumentParser) -> None:
    """The key or group (none: the groups)."""
    c.add_argument(
        "target", nargs="?", metavar="KEY", help="a key such as optim.lr, or a group such as optim"
    )


def run(args: argparse.Namespace) -> int:
    """Print the resolved config (show) or a key's documentation (explain)."""
    from strata import config
    from strata.config.reference import overview

    if args.action == "show":
        cfg = config.load(args.target, args.overrides, world_size=args.world_size)
        print(config.dump(cfg), end="")
        if args.world_size:
            warn_memory(cfg, 1, args.world_size)
    else:
        print(config.explain(args.target) if args.target else overview())
    return 0


SUBCOMMANDS = (
    Subcommand(SHOW, _add_show_arguments, run),
    Subcommand(EXPLAIN, _add_explain_arguments, run),
)
