"""`strata ckpt`: inspect or verify a checkpoint, reshard it to another layout, export it
(safetensors, a Hugging Face directory), or import a DeepSpeed or Hugging Face one."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from strata.errors import StrataError
from strata.launch.commands.common import EXIT_CODES, CommandHelp, file_errors

HELP = CommandHelp(
    "ckpt",
    summary="inspect, verify, reshard, export or import a checkpoint",
    usage=(
        "strata ckpt inspect DIR",
        "strata ckpt verify DIR",
        "strata ckpt reshard DIR OUT --to tp=..,pp=..,dp=..[,vs=..] [key=value ...]",
        "strata ckpt export DIR OUT [--format safetensors|hf] [--overwrite] [--force]",
        "strata ckpt import-deepspeed DS_DIR OUT [key=value ...] --config CFG",
        "strata ckpt import-hf HF_DIR OUT [key=value ...] [--config CFG]",
    ),
    description="Inspect, verify, reshard, export or import a checkpoint.",
    examples=(
        "strata ckpt inspect runs/tiny/checkpoints",
        "strata ckpt verify runs/tiny/checkpoints/step_00000500   # exit 1 if damaged",
        "strata ckpt reshard runs/tiny/checkpoints resharded --to tp=2,pp=1,dp=1",
        "strata ckpt export runs/tiny/checkpoints tiny.safetensors",
        "strata ckpt export runs/qwen-ft/checkpoints qwen-ft-hf --format hf   # carries "
        "Qwen's own config",
        "strata ckpt import-deepspeed ds_ckpt/ imported/ --config configs/tiny.yaml",
    ),
    extra=EXIT_CODES,
)


def add_arguments(ck: argparse.ArgumentParser) -> None:
    """The action, the checkpoint, OUT, the overrides, then each action's options."""
    ck.add_argument("action", choices=list(ACTIONS))
    ck.add_argument(
        "path",
        metavar="DIR",
        help="a step_* directory, or a checkpoints directory (latest committed)",
    )
    ck.add_argument(
        "out",
        nargs="?",
        metavar="OUT",
        help="reshard: a checkpoints directory; export: a .safetensors file (its config goes to "
        "NAME.config.yaml beside it), or a directory for model.safetensors and config.yaml",
    )
    ck.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="key=value",
        help="reshard: overrides of the saved config (e.g. zero settings); import-deepspeed, "
        "import-hf: overrides of --config",
    )
    ck.add_argument(
        "--to", help="reshard: the target layout, tp=..,pp=..,dp=.. (and vs=.. for virtual stages)"
    )
    _add_export_options(ck)
    ck.add_argument(
        "--config",
        help="import-deepspeed, import-hf: the Strata experiment the imported state continues in "
        "(import-hf: optional; the model block comes from HF_DIR's config.json)",
    )


def _add_export_options(ck: argparse.ArgumentParser) -> None:
    """`strata ckpt export`'s format and what it may replace or lose (--overwrite serves the
    commands that write a checkpoint too)."""
    ck.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "hf"],
        help="export format: one safetensors file of Strata's names, or hf: a Hugging Face model "
        "directory (config.json, sharded safetensors, the tokenizer and its config, "
        "generation_config.json, carried from the model the run started from) for transformers' "
        "from_pretrained",
    )
    ck.add_argument(
        "--overwrite",
        action="store_true",
        help="export: replace the weights and config files OUT names if they exist; reshard, "
        "import-deepspeed, import-hf: write into an OUT that already holds committed checkpoints "
        "(only the step written is replaced; nothing is removed)",
    )
    ck.add_argument(
        "--force",
        action="store_true",
        help="export --format hf: export even where fields would be lost (the model the run "
        "started from, model.init_from, is gone, or the run's tokenizer cannot be read); the "
        "notes say what was set instead",
    )


def run(args: argparse.Namespace) -> int:
    """Run the action: 0 done, 1 when inspect or verify finds damage."""
    if args.action in ("inspect", "verify") and (args.out or args.overrides):
        raise StrataError(
            f"strata ckpt {args.action} DIR takes one directory; "
            f"unexpected: {' '.join(filter(None, [args.out, *args.overrides]))}"
        )
    if args.out and "=" in args.out and not Path(args.out).exists():
        raise StrataError(
            f"strata ckpt {args.action}: OUT comes before the overrides; "
            f"{args.out!r} looks like one"
        )
    return ACTIONS[args.action](args)


def _inspect(args: argparse.Namespace) -> int:
    from strata.checkpoint import inspect

    ok, report = inspect.inspect_report(Path(args.path))
    print(report)
    return 0 if ok else 1


def _verify(args: argparse.Namespace) -> int:
    from strata.checkpoint import inspect
    from strata.config.loading import from_yaml

    ok, report = inspect.verify_report(Path(args.path), from_yaml)
    print(report)
    return 0 if ok else 1


def _reshard(args: argparse.Namespace) -> int:
    from strata.launch import reshard

    if not args.out or not args.to:
        raise StrataError(
            "strata ckpt reshard DIR OUT --to tp=..,pp=..,dp=..: give OUT (a checkpoints "
            "directory) and the target layout"
        )
    return reshard.reshard(Path(args.path), Path(args.out), args.to, args.overrides, args.overwrite)


def _export(args: argparse.Namespace) -> int:
    from strata.checkpoint import export
    from strata.config.loading import from_yaml

    if not args.out:
        raise StrataError(
            "strata ckpt export DIR OUT: give OUT, a .safetensors file or a directory"
        )
    with file_errors("strata ckpt export"):
        weights, config_file = export.export(
            Path(args.path), Path(args.out), args.format, args.overwrite, from_yaml, args.force
        )
    print(f"wrote {weights} and {config_file}")
    return 0


def _import_deepspeed(args: argparse.Namespace) -> int:
    from strata import config
    from strata.checkpoint import deepspeed_import

    if not args.out or not args.config:
        raise StrataError(
            "strata ckpt import-deepspeed DS_DIR OUT --config CFG: give OUT (a checkpoints "
            "directory) and the Strata config to continue with"
        )
    cfg = config.load(args.config, args.overrides)
    aliases = {"output.weight": "tok_embeddings.weight"} if cfg.model.tie_embeddings else None
    path = deepspeed_import.import_checkpoint(
        Path(args.path), Path(args.out), config.dump(cfg), aliases, args.overwrite
    )
    print(f"wrote {path}; continue with: strata train {args.config} ... --resume {path}")
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from strata import config
    from strata.checkpoint import hf_weights

    if not args.out:
        raise StrataError(
            "strata ckpt import-hf HF_DIR OUT [--config CFG]: give OUT (a checkpoints directory)"
        )
    cfg = config.load(args.config, [*args.overrides, f"model.init_from={args.path}"])
    with file_errors("strata ckpt import-hf"):
        path = hf_weights.import_hf(
            Path(args.path), Path(args.out), config.dump(cfg), cfg.model, args.overwrite
        )
    print(
        f"wrote {path} (step 0, weights only); train from it with --resume {path} (the optimizer "
        f"starts fresh) or model.init_from={path}"
    )
    return 0


ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": _inspect,
    "verify": _verify,
    "reshard": _reshard,
    "export": _export,
    "import-deepspeed": _import_deepspeed,
    "import-hf": _import_hf,
}
