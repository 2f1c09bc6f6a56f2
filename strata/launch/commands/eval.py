"""`strata eval`: a checkpoint's loss, perplexity and bits per byte on held-out data, in this
process or as each rank of a world of any layout (`strata launch --eval`;
`strata.trainer.jobs.evaluate_checkpoint`); with --tasks, its scores on lm-evaluation-harness
tasks instead, in this process (`strata.inference.harness.run_tasks`).

--out replaces only a JSON file `strata eval` wrote: one whose object has `"written_by": "strata
eval"` (or, from before that key, exactly the keys an evaluation writes). Any other existing file,
a path inside a checkpoint directory or a prepared data directory, and the config file itself are
refused before anything is evaluated or written.

The results go into the run directory (eval.json by default, always an `eval` record in its
metrics.jsonl), so the evaluation holds that directory's lock (`strata.runlock`) as a training job
does: a run still training there refuses it, with the fix (a run directory of its own); the
checkpoint it evaluates, maybe the live run's, is only read."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from strata.errors import StrataError
from strata.launch.commands.common import OVERRIDES, CommandHelp, file_errors, whole

# the key and value that mark a JSON file as `strata eval`'s own output, which --out may replace
WRITTEN_BY = ("written_by", "strata eval")

if TYPE_CHECKING:
    from strata.config import Config


HELP = CommandHelp(
    "eval",
    summary="a checkpoint's loss, perplexity and bits per byte on held-out data, or its lm-eval "
    "task scores",
    usage=(
        "strata eval CFG --resume CKPT [--data DIR ...] [--out JSON] [key=value ...]",
        "strata eval CFG --resume CKPT --tasks T1,T2 [--include-path DIR] [--limit N] "
        "[--num-fewshot N]",
    ),
    description="""\
Evaluate a checkpoint on the validation split of each prepared directory (--data), or
of each of the config's data sources apart: every sequence once, in the config's layout (for a
parallel one, every rank runs it: strata launch CFG --nproc N --eval --resume CKPT). Prints a
table, writes JSON (--out, default RUN_DIR/eval.json) and an `eval` record into the run's
metrics.jsonl, holding the run directory's lock as training does: while a run still trains
there, evaluate its checkpoints into a run directory of their own (log.name=NAME-eval).

With --tasks, the checkpoint runs lm-evaluation-harness tasks instead (the eval extra, from
the checkout: pip install -e '.[eval]'), in this one process on the whole model (the first GPU if
there is one): lm-eval's table, its results as JSON (--out, default RUN_DIR/eval_tasks.json)
and an `eval` record of each task's metrics in metrics.jsonl. lm-eval's own command line with
the same model: python -m strata.inference.harness --model strata --model_args checkpoint=CKPT ...""",
    examples=(
        "strata eval configs/tiny.yaml --resume runs/tiny/checkpoints",
        "strata eval configs/tiny.yaml --resume runs/tiny/checkpoints --data data/books "
        "--data data/code",
        "strata launch cfg.yaml --resume CKPT parallel.tp=2 parallel.dp=2 --nproc 4 --eval   "
        "# 4 workers",
        "strata eval cfg.yaml --resume runs/x/checkpoints --tasks hellaswag,arc_easy --limit 200",
        "strata eval cfg.yaml --resume CKPT --tasks python_choice --include-path examples/tasks/",
    ),
)


def add_arguments(e: argparse.ArgumentParser) -> None:
    """The config, its overrides, the checkpoint and the held-out data, then lm-eval's options."""
    e.add_argument("config", help="the YAML experiment the checkpoint was trained with")
    e.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=OVERRIDES)
    e.add_argument(
        "--resume",
        required=True,
        help="the checkpoint (a step_* dir, or a checkpoints dir: latest)",
    )
    e.add_argument(
        "--data",
        action="append",
        default=[],
        help="a prepared directory to evaluate on (repeatable)",
    )
    e.add_argument(
        "--out",
        help="where the JSON goes (default: RUN_DIR/eval.json, with --tasks "
        "RUN_DIR/eval_tasks.json)",
    )
    tasks = e.add_argument_group("lm-evaluation-harness tasks (in place of the held-out loss)")
    _add_task_options(tasks)


def _add_task_options(t: argparse._ArgumentGroup) -> None:
    """The options of `strata eval --tasks`: which lm-eval tasks, and how many examples of each."""
    t.add_argument(
        "--tasks",
        action="append",
        default=[],
        metavar="T1,T2",
        help="lm-eval task names (comma-separated, repeatable)",
    )
    t.add_argument(
        "--include-path",
        metavar="DIR",
        help="a directory of task YAML files: local tasks for --tasks",
    )
    t.add_argument("--limit", type=whole(1), metavar="N", help="at most N examples of each task")
    t.add_argument(
        "--num-fewshot",
        type=whole(0),
        metavar="N",
        help="examples in each prompt (default: each task's own)",
    )


def run(args: argparse.Namespace) -> int:
    """Evaluate on every rank, holding the run directory it writes into (`_run_held`); rank 0
    prints the table and writes the JSON and the metrics record."""
    if args.tasks or args.include_path or args.limit is not None or args.num_fewshot is not None:
        return run_tasks(args)
    from strata import config
    from strata.parallel import runtime
    from strata.trainer.jobs import evaluate_checkpoint

    cfg = config.load(
        args.config,
        args.overrides,
        world_size=runtime.world_size_from_env(),
        local_world_size=runtime.local_world_size_from_env(),
    )
    out = Path(args.out) if args.out else cfg.run_dir() / "eval.json"
    check_out(out, Path(args.config))
    check_run_free(cfg)  # a live run refused before any process group starts
    rt = runtime.start(cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        with _run_held(cfg, rt.rank):
            result = evaluate_checkpoint(cfg, rt, Path(args.resume), [Path(d) for d in args.data])
            if rt.rank == 0:
                _write(cfg, out, result, result["step"], result["splits"])
    except BaseException:
        runtime.stop(wait_for_peers=False)
        raise
    if rt.rank == 0:
        print(f"step {result['step']} of {result['checkpoint']}:")
        print(f"{'split':<40} {'loss':>8} {'perplexity':>11} {'bits/byte':>10} {'sequences':>10}")
        for name, r in result["splits"].items():
            bpb = f"{r['bits_per_byte']:.4f}" if r["bits_per_byte"] is not None else "n/a"
            ppl = f"{r['perplexity']:.3f}" if r["perplexity"] is not None else "overflow"
            print(f"{name:<40} {r['loss']:>8.4f} {ppl:>11} {bpb:>10} {r['sequences']:>10}")
        print(f"wrote {out}")
    runtime.stop()
    return 0


# --- the run directory it writes into -------------------------------------------------------------


def live_run(cfg: Config) -> StrataError:
    """The refusal of an evaluation whose run directory a live run (or another evaluation) holds,
    naming the holder and how to evaluate now."""
    from strata.runlock import describe_holder, holder

    run_dir = cfg.run_dir()
    return StrataError(
        f"strata eval: the run directory {run_dir} is in use by "
        f"{describe_holder(holder(run_dir))}; nothing was evaluated or written. An evaluation "
        "writes eval.json and an `eval` record into the run's metrics.jsonl, which a live run "
        "writes too: wait for it to end, or evaluate into a run directory of its own now with "
        f"log.name={cfg.run_name()}-eval (--out still sets where the JSON goes)"
    )


def check_run_free(cfg: Config) -> None:
    """Refuse (`live_run`) when the run directory the evaluation writes into is held now; creates
    and writes nothing (the launcher's and each command's early look; `_run_held` takes it)."""
    from strata.runlock import RunLocked, check_free

    try:
        check_free([(cfg.run_dir(), "run directory")])
    except RunLocked:
        raise live_run(cfg) from None


@contextlib.contextmanager
def _run_held(cfg: Config, rank: int) -> Iterator[None]:
    """The run directory's lock, held by rank 0 for the world (collective: every rank learns of a
    refusal, `live_run`) while the evaluation runs and writes its results; its checkpoint.dir is
    only read."""
    from strata.runlock import RunLocked
    from strata.trainer.start import lock_run

    notes: list[str] = []
    try:
        locks = lock_run([(cfg.run_dir(), "run directory")], rank, notes)
    except RunLocked:
        raise live_run(cfg) from None
    for note in notes:  # a file system that offers no locks
        print(note)
    try:
        yield
    finally:
        if locks is not None:
            locks.release()


def _write(cfg: Config, out: Path, document: dict, step: int | None, record: dict) -> None:
    """The results as JSON at `out` (atomically), and an `eval` record of `record` appended to the
    run's metrics.jsonl (the run's own records stay)."""
    from strata.atomic import write_file_atomic

    document = dict([WRITTEN_BY, *document.items()])
    with file_errors("strata eval"):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(out, (json.dumps(document, indent=1) + "\n").encode())
        cfg.run_dir().mkdir(parents=True, exist_ok=True)
        with open(cfg.run_dir() / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "step": step, "eval": record}) + "\n")


def task_names(args: argparse.Namespace) -> list[str]:
    """--tasks' names, in order: each flag's comma-separated list; the flags that go with it
    checked."""
    names = [name.strip() for flag in args.tasks for name in flag.split(",") if name.strip()]
    if not names:
        raise StrataError(
            "--include-path, --limit and --num-fewshot go with lm-eval tasks: give --tasks T1,T2"
        )
    if args.data:
        raise StrataError(
            "--data is the held-out evaluation's and --tasks runs lm-eval's tasks in its place: "
            "run them as two commands"
        )
    from strata.parallel import runtime

    if runtime.world_size_from_env() > 1:
        raise StrataError(
            "--tasks runs in one process on the whole model: start `strata eval` "
            "itself, not torchrun"
        )
    return names


def run_tasks(args: argparse.Namespace) -> int:
    """lm-eval's tasks on the checkpoint, in this process: the table, the JSON and the metrics
    record."""
    from strata import config
    from strata.inference import harness

    names = task_names(args)
    harness.require_lm_eval()
    cfg = config.load(args.config, args.overrides)
    out = Path(args.out) if args.out else cfg.run_dir() / "eval_tasks.json"
    check_out(out, Path(args.config))
    with _run_held(cfg, 0):
        result = harness.run_tasks(
            Path(args.resume),
            names,
            config_path=Path(args.config),
            overrides=args.overrides,
            include_path=Path(args.include_path) if args.include_path else None,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
        )
        step = checkpoint_step(Path(args.resume))
        document = {"step": step, "checkpoint": args.resume, **result}
        _write(cfg, out, document, step, result["results"])
    print(f"step {step} of {args.resume}:" if step is not None else f"{args.resume}:")
    print(harness.results_table(result))
    print(f"wrote {out}")
    return 0


def checkpoint_step(path: Path) -> int | None:
    """The step of the Strata checkpoint at `path` (a step_* directory, or the newest under a
    checkpoints directory); None for a Hugging Face directory or a checkpoint DCP wrote alone."""
    from strata.checkpoint import store

    if (path / "config.json").is_file() or store.is_dcp_only(path):
        return None
    return int(store.marker(store.resolve(path))["step"])


def _own_output(path: Path) -> bool:
    """Whether the existing file `path` is JSON `strata eval` wrote (see the module docstring)."""
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    if not isinstance(document, dict):
        return False
    if document.get(WRITTEN_BY[0]) == WRITTEN_BY[1]:
        return True
    keys = set(document)
    # before the marker: the held-out evaluation's three keys, or lm-eval's results with ours
    return (
        keys == {"step", "checkpoint", "splits"}
        or {"step", "checkpoint", "results", "configs"} <= keys
    )


def check_out(out: Path, config_path: Path) -> None:
    """Refuse an --out that would replace or add to what `strata eval` did not write: the config
    file, a path inside a checkpoint directory or a prepared data directory, or any existing file
    that is not an earlier `strata eval` output. Writes nothing."""
    from strata.checkpoint.export import checkpoint_destination

    def refuse(what: str) -> StrataError:
        return StrataError(
            f"strata eval: --out {out} {what}; nothing was evaluated or written. Give --out a new "
            "file outside checkpoints and data directories (or one an earlier strata eval wrote)"
        )

    if out.is_dir():
        raise refuse("is a directory")
    if out.exists() and config_path.exists() and out.samefile(config_path):
        raise refuse("is the config file being evaluated")
    inside = checkpoint_destination(out.parent)
    if inside is not None:
        raise refuse(f"is inside the checkpoint directory {inside}, which it would alter")
    for d in [out.parent.absolute(), *out.parent.absolute().parents]:
        if (d / "meta.json").is_file() and ((d / "train.bin").exists() or (d / "val.bin").exists()):
            raise refuse(f"is inside the prepared data directory {d}")
    if (out.exists() or out.is_symlink()) and not _own_output(out):
        raise refuse("is an existing file that strata eval did not write")
