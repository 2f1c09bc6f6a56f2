"""`strata config`: show a resolved, validated config (optionally checked against a world size, with
the planner's memory warning), or explain a key or group of the schema."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from strata.launch.commands.common import FORMATTER, OVERRIDES, epilog, warn_memory, whole

if TYPE_CHECKING:
    from strata.launch.commands.common import Subparsers


def add_parser(subparsers: Subparsers) -> None:
    """Add `strata config show|explain` to the `strata` parser."""
    c = subparsers.add_parser(
        "config",
        help="show a resolved config or explain a key",
        formatter_class=FORMATTER,
        usage="strata config show CFG [key=value ...] [--world-size N]\n       strata config "
        "explain KEY",
        description="Show a resolved, validated config, or explain a key or group.",
        epilog=epilog(
            "strata config show configs/tiny.yaml optim.lr=1e-4",
            "strata config show configs/llama2-7b-3d.yaml --world-size 32",
            "strata config explain optim.lr",
            "strata config explain optim",
        ),
    )
    c.add_argument("action", choices=["show", "explain"])
    c.add_argument("target", help="config file (show) or key such as optim.lr (explain)")
    c.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="show: " + OVERRIDES
    )
    c.add_argument(
        "--world-size", type=whole(1), help="also check the layout against this many processes"
    )
    c.set_defaults(func=run)


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
