"""The `strata` command: train, launch (torchrun / Slurm), store (a standalone rendezvous store),
config show/explain, plan (memory and step time of a layout; search), data prepare, ckpt (inspect,
verify, reshard, export, import), eval (a checkpoint on held-out data or lm-eval tasks), generate
(continue prompts), plot (run curves or a pipeline schedule timeline).

This module is the dispatcher: it builds the top-level parser and, from each command module of
`strata.launch.commands`, that command's parser (its help texts, then its arguments), and runs the
command. A command's options and key=value
overrides come in any order. Exit codes: 0 done; 2 a user error (StrataError, or argparse's usage
error), printed as one message without a traceback; 75 stopped by a signal after saving a checkpoint
(`train`, and `launch` when every worker did); anything else a failure (1 when `ckpt verify` or
`ckpt inspect` finds damage, or `plan` finds the layout does not fit; `launch` passes on torchrun's
code, or 128 + the signal that stopped it)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from strata import __version__
from strata.errors import StrataError
from strata.launch.commands import COMMANDS
from strata.launch.commands.common import (
    EXIT_CODES,
    FORMATTER,
    command_parser,
    epilog,
    subcommand_parsers,
)


def _parsers() -> tuple[
    argparse.ArgumentParser,
    dict[str, argparse.ArgumentParser],
    dict[str, dict[str, argparse.ArgumentParser]],
]:
    """The `strata` parser, its commands' parsers by name, and their sub-commands' parsers by
    command and word (`strata config show`)."""
    p = argparse.ArgumentParser(
        prog="strata",
        formatter_class=FORMATTER,
        description="Train transformer models from one YAML experiment.\n\n"
        "Options and key=value overrides mix freely: options anywhere after the command,\n"
        "overrides after its other positional arguments (such as the config file).\n"
        "`strata COMMAND --help` shows a command's options and examples.",
        epilog=epilog(
            "strata train configs/tiny.yaml train.steps=100",
            "strata launch configs/tiny.yaml --nproc 2",
            "strata config show configs/llama2-7b-3d.yaml --world-size 32",
            "strata ckpt verify runs/tiny/checkpoints",
            extra=EXIT_CODES,
        ),
    )
    p.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    words = {}
    for command in COMMANDS:
        parser = command_parser(sub, command.HELP, command.run)
        command.add_arguments(parser)
        subcommands = getattr(command, "SUBCOMMANDS", ())
        if subcommands:
            words[command.HELP.name] = subcommand_parsers(parser, command.HELP.name, subcommands)
    return p, dict(sub.choices), words


def parser() -> argparse.ArgumentParser:
    """The `strata` parser (its commands' parsers inside)."""
    return _parsers()[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """A command's positionals, options and key=value overrides, in any order after the command
    (argparse's intermixed parsing, which cannot go through subparsers: the command's own parser
    runs it). Usage errors exit 2, --help and --version 0."""
    top, commands, words = _parsers()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in commands:
        return top.parse_args(argv)  # --help, --version, or an error naming the commands
    command, rest = argv[0], argv[1:]
    # A sub-command's word is the command's first positional; options and their values may come
    # before it (`strata config --world-size 8 show CFG`). The command's own parser answers
    # --help before it and input with no word.
    at = _word_at(rest, words.get(command, {}))
    if at is None or any(a in ("-h", "--help") for a in rest[:at]):
        parser = commands[command]
        listed = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
        args = parser.parse_args(rest) if listed else parser.parse_intermixed_args(rest)
    else:
        args = words[command][rest[at]].parse_intermixed_args(rest[:at] + rest[at + 1 :])
        args.action = rest[at]
    args.command = command
    return args


def _word_at(rest: list[str], words: dict[str, argparse.ArgumentParser]) -> int | None:
    """Where in `rest` (a command's arguments) its sub-command's word is: the first of `words`
    with only options, or what may be their values, before it; None if there is none."""
    for i, arg in enumerate(rest):
        if arg in words:
            return i
        follows_option = i > 0 and rest[i - 1].startswith("-") and "=" not in rest[i - 1]
        if not arg.startswith("-") and not follows_option:
            return None
    return None


# Environment for torch that must be set before torch is imported, in this process and so in every
# worker it starts (torchrun, the fork server and the workers inherit it); a value the user set
# wins. THP_MEM_ALLOC_ENABLE puts torch's host allocations of 2 MiB and more on transparent huge
# pages: ZeRO-3 allocates each gathered group's flat buffer at every use, and with 4 KiB pages
# faulting it in cost as much as the gather's copy (an NVMe-offload step on CPU: 7.9 s against 6.7
# s). Where the kernel has THP off it changes nothing.
TORCH_ENV_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def cpus_busy(samples: list[str] | None = None, cores: int | None = None) -> bool:
    """Whether other work keeps this machine's cores busy now: the tasks runnable besides this one
    reach the cores this process may use, in the median of 5 readings of /proc/loadavg 10 ms apart
    (`samples`: those texts, read when not given). Runnable tasks, not the load average, which lags
    a minute behind what just ended."""
    if cores is None:
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
    try:
        if samples is None:
            samples = []
            for _ in range(5):
                with open("/proc/loadavg") as f:
                    samples.append(f.read())
                time.sleep(0.01)
        runnable = sorted(int(text.split()[3].split("/")[0]) - 1 for text in samples)
        return runnable[len(runnable) // 2] >= cores
    except (OSError, ValueError, IndexError):
        return False


def omp_defaults() -> dict[str, str]:
    """OMP_WAIT_POLICY=PASSIVE when the cores are busy at start: OpenMP's threads then sleep at a
    barrier instead of spinning. A spinning thread holds the core its partner needs, and every
    parallel region waits out a scheduler slice: the demo trained at 145 tokens/s beside a load of 4
    on 2 cores, against 2,343 passive. On an idle machine spinning is the faster (10,355 against
    5,901 tokens/s), so libgomp's default stays (bench/busy_machine.py measures all four). The
    checkpoint writer, the snapshot agent and data-preparation workers inherit it."""
    return {"OMP_WAIT_POLICY": "PASSIVE"} if cpus_busy() else {}


def main(argv: list[str] | None = None) -> int:
    """Run `strata ARGV`: the command's exit code; a StrataError printed as one line, exit 2."""
    for key, value in {**TORCH_ENV_DEFAULTS, **omp_defaults()}.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    try:
        return args.func(args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
