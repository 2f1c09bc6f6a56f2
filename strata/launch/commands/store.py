"""`strata store`: host the c10d rendezvous store of a multi-node job outside every torchrun, so
that any node can be lost and replaced (`strata launch ... --rdzv-store external`)."""

from __future__ import annotations

import argparse

from strata.launch.commands.common import CommandHelp, port

HELP = CommandHelp(
    "store",
    summary="host the c10d rendezvous store of a multi-node job outside every torchrun",
    description="Host the c10d rendezvous store of a multi-node job outside every torchrun, "
    "so any node can be lost\nand replaced; start each node with "
    "`strata launch ... --rdzv-store external --rdzv-endpoint HOST:PORT`.",
    examples=(
        "strata store --port 29400",
        "strata launch configs/tiny.yaml --nnodes 2 --nproc 8 --rdzv-store external "
        "--rdzv-endpoint store-host:29400   # on each node",
    ),
)


def add_arguments(st: argparse.ArgumentParser) -> None:
    """The address and port the store listens on."""
    st.add_argument("--host", default="0.0.0.0", help="address to listen on")
    st.add_argument("--port", type=port, required=True, help="port to listen on")


def run(args: argparse.Namespace) -> int:
    """Serve the store until stopped."""
    from strata.launch.torchrun import serve_store

    serve_store(args.host, args.port)
    return 0
