"""`strata ckpt`: inspect or verify a checkpoint, reshard it to another layout, export it
(safetensors, a Hugging Face directory), or import a DeepSpeed or Hugging Face one."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from strata.errors import StrataError
from strata.launch.commands.common import EXIT_CODES, CommandHelp, Subcommand, file_errors

HELP = CommandHelp(
    "ckpt",
    summary="inspect, verify, reshard, export or import a checkpoint",
    usage=(
        "strata ckpt inspect DIR",
        "strata ckpt verify DIR",
        "strata ckpt reshard DIR OUT --to tp=..,pp=..,dp=..[,vs=..] [key=value ...]",
        "strata ckpt export DIR OUT [--format safetensors|hf|peft] [--overwrite] [--force]",
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


INSPECT = CommandHelp(
    "inspect",
    summary="a checkpoint's step, layout, files and tensors",
    usage=("strata ckpt inspect DIR",),
    description="A checkpoint's step, saved layout, files with sizes and CRC-32Cs, and tensors "
    "with their\nglobal shapes and saved boxes.",
    examples=(
        "strata ckpt inspect runs/tiny/checkpoints",
        "strata ckpt inspect runs/tiny/checkpoints/step_00000500",
    ),
    extra=EXIT_CODES,
)

VERIFY = CommandHelp(
    "verify",
    summary="check every block checksum and DCP's .metadata (exit 1 on damage)",
    usage=("strata ckpt verify DIR",),
    description="Check every block checksum of a checkpoint and DCP's .metadata; exit 1 naming "
    "every missing,\ntruncated or corrupted file.",
    examples=("strata ckpt verify runs/tiny/checkpoints/step_00000500   # exit 1 if damaged",),
    extra=EXIT_CODES,
)

RESHARD = CommandHelp(
    "reshard",
    summary="rewrite a checkpoint for another layout offline",
    usage=("strata ckpt reshard DIR OUT --to tp=..,pp=..,dp=..[,vs=..] [key=value ...]",),
    description="Rewrite a checkpoint for another layout offline: starts that world with torchrun "
    "on this\nmachine, one file per target rank. --resume reshards at load anyway; a resharded "
    "checkpoint\nmakes later loads one sequential read per rank.",
    examples=(
        "strata ckpt reshard runs/tiny/checkpoints resharded --to tp=2,pp=1,dp=1",
        "strata ckpt reshard runs/tiny/checkpoints r --to tp=1,pp=2,dp=1,vs=2",
    ),
)

EXPORT = CommandHelp(
    "export",
    summary="the model as one safetensors file, or as a Hugging Face directory",
    usage=("strata ckpt export DIR OUT [--format safetensors|hf|peft] [--overwrite] [--force]",),
    description="Write the whole model's weights (global names, a plain strata.model.GPT "
    "state_dict) in one\nsafetensors file with the checkpoint's config beside it, or (--format hf) "
    "a Hugging Face model\ndirectory that transformers' from_pretrained loads (LoRA "
    "adapters merged), or (--format peft)\na LoRA run's adapters as a PEFT adapter directory.",
    examples=(
        "strata ckpt export runs/tiny/checkpoints tiny.safetensors",
        "strata ckpt export runs/qwen-ft/checkpoints qwen-ft-hf --format hf   # carries "
        "Qwen's own config",
    ),
)

IMPORT_DEEPSPEED = CommandHelp(
    "import-deepspeed",
    summary="a DeepSpeed ZeRO-1/2/3 checkpoint as a Strata checkpoint",
    usage=("strata ckpt import-deepspeed DS_DIR OUT [key=value ...] --config CFG",),
    description="A DeepSpeed ZeRO-1/2/3 checkpoint (read with weights_only=True, no deepspeed "
    "needed) as a\nStrata checkpoint under OUT: weights and Adam moments by name, step, samples "
    "consumed.",
    examples=("strata ckpt import-deepspeed ds_ckpt/ imported/ --config configs/tiny.yaml",),
)

IMPORT_HF = CommandHelp(
    "import-hf",
    summary="a Hugging Face model directory's weights as the Strata checkpoint of step 0",
    usage=("strata ckpt import-hf HF_DIR OUT [key=value ...] [--config CFG]",),
    description="A Hugging Face model directory's weights as the Strata checkpoint of step 0 (no "
    "optimizer\nstate); the model block comes from HF_DIR's config.json.",
    examples=("strata ckpt import-hf models/tiny imported/",),
)

DIR_HELP = "a step_* directory, or a checkpoints directory (latest committed)"


def add_arguments(ck: argparse.ArgumentParser) -> None:
    """Nothing of its own: each action (SUBCOMMANDS) has its arguments."""


def _add_read_arguments(ck: argparse.ArgumentParser) -> None:
    """inspect, verify: the checkpoint (anything more is refused by `run`, naming it)."""
    ck.add_argument("path", metavar="DIR", help=DIR_HELP)
    ck.add_argument("out", nargs="?", help=argparse.SUPPRESS)
    ck.add_argument("overrides", nargs="*", default=[], help=argparse.SUPPRESS)


def _add_reshard_arguments(ck: argparse.ArgumentParser) -> None:
    """The checkpoint, OUT, the overrides, the target layout, --overwrite."""
    ck.add_argument("path", metavar="DIR", help=DIR_HELP)
    ck.add_argument("out", nargs="?", metavar="OUT", help="a checkpoints directory")
    ck.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="key=value",
        help="overrides of the saved config (e.g. zero settings)",
    )
    ck.add_argument(
        "--to", help="the target layout, tp=..,pp=..,dp=.. (and vs=.. for virtual stages)"
    )
    _add_overwrite(ck)


def _add_export_arguments(ck: argparse.ArgumentParser) -> None:
    """The checkpoint, OUT, the format, and what the export may replace or lose."""
    ck.add_argument("path", metavar="DIR", help=DIR_HELP)
    ck.add_argument(
        "out",
        nargs="?",
        metavar="OUT",
        help="a .safetensors file (its config goes to NAME.config.yaml beside it), or a directory "
        "for model.safetensors and config.yaml (--format hf: the Hugging Face directory)",
    )
    ck.add_argument("overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    _add_export_options(ck)


def _add_import_arguments(source: str) -> Callable[[argparse.ArgumentParser], None]:
    """import-deepspeed, import-hf: the source directory, OUT, the overrides, --config."""

    def add(ck: argparse.ArgumentParser) -> None:
        ck.add_argument("path", metavar=source, help=f"the {source} to import")
        ck.add_argument("out", nargs="?", metavar="OUT", help="a checkpoints directory")
        ck.add_argument(
            "overrides", nargs="*", default=[], metavar="key=value", help="overrides of --config"
        )
        ck.add_argument(
            "--config",
            help="the Strata experiment the imported state continues in"
            + (
                " (optional; the model block comes from HF_DIR's config.json)"
                if source == "HF_DIR"
                else ""
            ),
        )
        _add_overwrite(ck)

    return add


def _add_overwrite(ck: argparse.ArgumentParser) -> None:
    """--overwrite of the actions that write a checkpoint."""
    ck.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an OUT that already holds committed checkpoints (only the step written "
        "is replaced; nothing is removed)",
    )


def _add_export_options(ck: argparse.ArgumentParser) -> None:
    """`strata ckpt export`'s format and what it may replace or lose."""
    ck.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "hf", "peft"],
        help="export format: one safetensors file of Strata's names; hf: a Hugging Face model "
        "directory (config.json, sharded safetensors, the tokenizer and its config, "
        "generation_config.json, carried from the model the run started from) for transformers' "
        "from_pretrained, LoRA adapters merged into their weights; or peft: a LoRA run's adapters "
        "alone (adapter_config.json, adapter_model.safetensors) for peft's "
        "PeftModel.from_pretrained on the base model",
    )
    ck.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the weights and config files OUT names if they exist",
    )
    ck.add_argument(
        "--force",
        action="store_true",
        help="--format hf: export even where fields would be lost (the model the run "
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


SUBCOMMANDS = (
    Subcommand(INSPECT, _add_read_arguments, run),
    Subcommand(VERIFY, _add_read_arguments, run),
    Subcommand(RESHARD, _add_reshard_arguments, run),
    Subcommand(EXPORT, _add_export_arguments, run),
    Subcommand(IMPORT_DEEPSPEED, _add_import_arguments("DS_DIR"), run),
    Subcommand(IMPORT_HF, _add_import_arguments("HF_DIR"), run),
)
