"""`strata store`: host the c10d rendezvous store of a multi-node job outside every torchrun, so that
any node can be lost and replaced (`strata launch ... --rdzv-store external`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from strata.launch.commands.common import FORMATTER, epilog, port

if TYPE_CHECKING:
    from strata.launch.commands.common import Subparsers


def add_parser(subparsers: Subparsers) -> None:
    """Add `strata store` to the `strata` parser."""
    st = subparsers.add_parser(
        "store",
        help="host the c10d rendezvous store of a multi-node job outside every torchrun",
        formatter_class=FORMATTER,
        description="Host the c10d rendezvous store of a multi-node job outside every torchrun, "
        "so any node can be lost\nand replaced; start each node with "
        "`strata launch ... --rdzv-store external --rdzv-endpoint HOST:PORT`.",
        epilog=epilog(
            "strata store --port 29400",
            "strata launch configs/tiny.yaml --nnodes 2 --nproc 8 --rdzv-store external "
            "--rdzv-endpoint store-host:29400   # on each node",
        ),
    )
    st.add_argument("--host", default="0.0.0.0", help="address to listen on")
    st.add_argument("--port", type=port, required=True, help="port to listen on")
    st.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve the store until stopped."""
    from strata.launch.torchrun import serve_store

    serve_store(args.host, args.port)
    return 0
