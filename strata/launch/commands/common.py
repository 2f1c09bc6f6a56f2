"""What several `strata` commands share: the help texts each command declares (`CommandHelp`) and
the parser made from them (`command_parser`), a command's sub-commands (`Subcommand`,
`subcommand_parsers`: `strata config show`, `strata ckpt inspect`, ...), argparse value types, the
help texts' pieces (examples, exit codes, overrides), turning an OSError on a user's path into a
StrataError, and the planner's memory warning before a job starts."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.errors import StrataError

if TYPE_CHECKING:
    from typing import TypeAlias

    from strata.config import Config

    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

# Every command's help keeps the line breaks of its description and examples.
FORMATTER = argparse.RawDescriptionHelpFormatter

EXIT_CODES = """\
exit codes:
  0      done
  2      user error: a bad config, override or argument (one message, no traceback)
  75     stopped by a signal (SIGTERM, SIGINT, SIGUSR1) after saving a checkpoint: resume with
         --resume (`strata train`; `strata launch` when every worker saved and stopped)
  128+N  `strata launch` stopped by signal N without every worker saving (e.g. a second signal
         killed them; 130 SIGINT, 143 SIGTERM)
  other  failure: 1 e.g. when `strata ckpt verify` or `inspect` finds damage, or `strata plan`
         finds the layout does not fit; `strata launch`
         exits with torchrun's code, e.g. a crashed worker's"""

OVERRIDES = "key=value overrides of the config (e.g. train.steps=100), before or after the options"


def epilog(*examples: str, extra: str = "") -> str:
    """The text under a command's options: examples, then what else it needs to say."""
    text = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return text + (f"\n\n{extra}" if extra else "")


@dataclass(frozen=True)
class CommandHelp:
    """What `strata NAME --help` says besides the options: each command module's `HELP`."""

    name: str
    summary: str  # its line in `strata --help`
    description: str  # above the options
    examples: tuple[str, ...]  # below the options
    usage: tuple[str, ...] = ()  # a line per form of the command; empty: argparse writes it
    extra: str = ""  # below the examples


def command_parser(
    subparsers: Subparsers, command: CommandHelp, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """The parser of `strata NAME` (`command.name`) under `subparsers`: the command's help texts,
    and `run` as what it does; the command adds its own arguments to it."""
    parser = subparsers.add_parser(
        command.name,
        help=command.summary,
        formatter_class=FORMATTER,
        # continuation lines align under "usage: "
        usage="\n       ".join(command.usage) or None,
        description=command.description,
        epilog=epilog(*command.examples, extra=command.extra),
    )
    parser.set_defaults(func=run)
    return parser


@dataclass(frozen=True)
class Subcommand:
    """One form of a command with its own parser (`strata config show`): its help texts (`help.name`
    is the word after the command), its arguments, and what it does."""

    help: CommandHelp
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def subcommand_parsers(
    parser: argparse.ArgumentParser, command: str, subcommands: tuple[Subcommand, ...]
) -> dict[str, argparse.ArgumentParser]:
    """The parsers of `strata COMMAND WORD ...`, by WORD. A command with no positionals of its own
    lists them in its help (argparse's sub-commands); one that has them (`strata plot RUN_DIR`)
    keeps its help, and the dispatcher picks the sub-command by the word."""
    if any(not a.option_strings for a in parser._actions):
        holder = argparse.ArgumentParser(prog=f"strata {command}")
        subparsers = holder.add_subparsers(prog=f"strata {command}")
    else:
        subparsers = parser.add_subparsers(
            dest="action", required=True, metavar="action", prog=f"strata {command}"
        )
    for sub in subcommands:
        sub.add_arguments(command_parser(subparsers, sub.help, sub.run))
    return dict(subparsers.choices)


def whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= minimum (argparse names the flag and exits 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def port(text: str) -> int:
    """An argparse type: a TCP port, 0..65535."""
    value = whole(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {value}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


@contextlib.contextmanager
def file_errors(command: str) -> Iterator[None]:
    """An OSError on a path the user named (a missing directory, a name too long, no permission) as
    a StrataError naming the path."""
    try:
        yield
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        raise StrataError(
            f"{command}: cannot write or read{where}: {e.strerror or e}; check that the path "
            "exists and is writable"
        ) from e


def warn_memory(cfg: Config, nodes: int, ranks_per_node: int) -> None:
    """Say before starting when the planner predicts a rank will not fit this machine."""
    from strata.data.tokens import planned_vocab
    from strata.plan.preflight import memory_warning

    warning = memory_warning(cfg, nodes, ranks_per_node, planned_vocab(cfg))
    if warning:
        print(f"strata: warning: {warning}", file=sys.stderr)
