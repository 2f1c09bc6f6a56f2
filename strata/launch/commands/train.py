"""`strata train`: train in this process, or as one torchrun worker (what `strata launch` starts);
with --save-to, rewrite a checkpoint into this layout instead (what `strata ckpt reshard` runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.errors import StrataError
from strata.launch.commands.common import EXIT_CODES, OVERRIDES, CommandHelp

HELP = CommandHelp(
    "train",
    summary="train in this process (or as one torchrun worker)",
    description="Train in this process (or as one torchrun worker).",
    examples=(
        "strata train configs/tiny.yaml",
        "strata train configs/tiny.yaml train.steps=100 log.name=short",
        "strata train configs/tiny.yaml --resume runs/tiny/checkpoints train.steps=1000",
    ),
    extra=EXIT_CODES,
)


def add_arguments(t: argparse.ArgumentParser) -> None:
    """The config, its overrides, and the checkpoint to resume from or rewrite."""
    t.add_argument("config", help="YAML experiment, e.g. configs/tiny.yaml")
    t.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=OVERRIDES)
    t.add_argument(
        "--resume",
        help="checkpoint directory (a step_* dir, or a checkpoints dir: latest committed)",
    )
    t.add_argument(
        "--save-to",
        metavar="OUT",
        help="do not train: load --resume into this layout and save it under OUT (what `strata "
        "ckpt reshard` runs)",
    )


def run(args: argparse.Namespace) -> int:
    """Train (or rewrite --resume under --save-to); 0 when done, Preempted's code raised on a
    signal."""
    from strata import config
    from strata.launch.supervisor import note_worker_status
    from strata.parallel import runtime
    from strata.trainer.jobs import rewrite_checkpoint, train
    from strata.trainer.signals import Preempted

    cfg = config.load(
        args.config,
        args.overrides,
        world_size=runtime.world_size_from_env(),
        local_world_size=runtime.local_world_size_from_env(),
    )
    config.check_trainable(cfg)
    rt = runtime.start(cfg.parallel.backend, cfg.parallel.timeout_s)
    note_worker_status("running")  # under `strata launch`: this attempt's worker started
    try:
        if args.save_to:
            if not args.resume:
                raise StrataError(
                    "strata train --save-to OUT needs --resume DIR (the checkpoint to rewrite)"
                )
            rewrite_checkpoint(cfg, rt, Path(args.resume), Path(args.save_to))
        else:
            train(cfg, rt, Path(args.resume) if args.resume else None)
    except BaseException as e:
        # they may never arrive: fail fast, torchrun stops the rest
        runtime.stop(wait_for_peers=False)
        # saved and stopped: tell `strata launch`, which torchrun does not
        if isinstance(e, Preempted):
            note_worker_status(str(e.code))
        raise
    runtime.stop()
    return 0
