"""`strata config`: show a resolved, validated config (optionally checked against a world size, with
the planner's memory warning), or explain a key or group of the schema."""

from __future__ import annotations

import argparse

from strata.launch.commands.common import OVERRIDES, CommandHelp, warn_memory, whole

HELP = CommandHelp(
    "config",
    summary="show a resolved config or explain a key",
    usage=(
        "strata config show CFG [key=value ...] [--world-size N]",
        "strata config explain KEY",
    ),
    description="Show a resolved, validated config, or explain a key or group.",
    examples=(
        "strata config show configs/tiny.yaml optim.lr=1e-4",
        "strata config show configs/llama2-7b-3d.yaml --world-size 32",
        "strata config explain optim.lr",
        "strata config explain optim",
    ),
)


def add_arguments(c: argparse.ArgumentParser) -> None:
    """The action, its config file or key, the overrides and the world size to check against."""
    c.add_argument("action", choices=["show", "explain"])
    c.add_argument("target", help="config file (show) or key such as optim.lr (explain)")
    c.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="show: " + OVERRIDES
    )
    c.add_argument(
        "--world-size", type=whole(1), help="also check the layout against this many processes"
    )


def run(args: argparse.Namespace) -> int:
    """Print the resolved config (show) or a key's documentation (explain)."""
    from strata import config

    if args.action == "show":
        cfg = config.load(args.target, args.overrides, world_size=args.world_size)
        print(config.dump(cfg), end="")
        if args.world_size:
            warn_memory(cfg, 1, args.world_size)
    else:
        print(config.explain(args.target))
    return 0
