"""`strata eval`: a checkpoint's loss, perplexity and bits per byte on held-out data, in this process
or as each rank of a torchrun world of any layout (`strata.trainer.evaluate.evaluate_checkpoint`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from strata.launch.commands.common import FORMATTER, OVERRIDES, epilog, file_errors

if TYPE_CHECKING:
    from strata.launch.commands.common import Subparsers


def add_parser(subparsers: Subparsers) -> None:
    """Add `strata eval` to the `strata` parser."""
    e = subparsers.add_parser(
        "eval",
        help="a checkpoint's loss, perplexity and bits per byte on held-out data",
        formatter_class=FORMATTER,
        usage="strata eval CFG --resume CKPT [--data DIR ...] [--out JSON] [key=value ...]",
        description="Evaluate a checkpoint on the validation split of each prepared directory (--data), or\n"
        "of each of the config's data sources apart: every sequence once, in the config's layout (run it\n"
        "as torchrun's workers for a parallel one). Prints a table, writes JSON (--out, default\n"
        "RUN_DIR/eval.json) and an `eval` record into the run's metrics.jsonl. In a parallel layout, every\n"
        "rank runs it: torchrun --nproc-per-node 4 -m strata.launch.cli eval cfg.yaml --resume CKPT parallel.tp=2",
        epilog=epilog(
            "strata eval configs/tiny.yaml --resume runs/tiny/checkpoints",
            "strata eval configs/tiny.yaml --resume runs/tiny/checkpoints --data data/books --data data/code",
            "strata eval cfg.yaml --resume CKPT parallel.tp=2 parallel.dp=2   # under torchrun, 4 workers",
        ),
    )
    e.add_argument("config", help="the YAML experiment the checkpoint was trained with")
    e.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=OVERRIDES)
    e.add_argument("--resume", required=True, help="the checkpoint (a step_* dir, or a checkpoints dir: latest)")
    e.add_argument("--data", action="append", default=[], help="a prepared directory to evaluate on (repeatable)")
    e.add_argument("--out", help="where the JSON goes (default: RUN_DIR/eval.json)")
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate on every rank; rank 0 prints the table and writes the JSON and the metrics record."""
    from strata import config
    from strata.parallel import runtime
    from strata.trainer.evaluate import evaluate_checkpoint

    cfg = config.load(args.config, args.overrides, world_size=runtime.world_size_from_env())
    rt = runtime.start(cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        result = evaluate_checkpoint(cfg, rt, Path(args.resume), [Path(d) for d in args.data])
    except BaseException:
        runtime.stop(wait_for_peers=False)
        raise
    if rt.rank == 0:
        out = Path(args.out) if args.out else cfg.run_dir() / "eval.json"
        with file_errors("strata eval"):
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")
            cfg.run_dir().mkdir(parents=True, exist_ok=True)
            with open(cfg.run_dir() / "metrics.jsonl", "a") as f:  # appended: the run's own records stay
                f.write(json.dumps({"time": time.time(), "step": result["step"], "eval": result["splits"]}) + "\n")
        print(f"step {result['step']} of {result['checkpoint']}:")
        print(f"{'split':<40} {'loss':>8} {'perplexity':>11} {'bits/byte':>10} {'sequences':>10}")
        for name, r in result["splits"].items():
            bpb = f"{r['bits_per_byte']:.4f}" if r["bits_per_byte"] is not None else "n/a"
            ppl = f"{r['perplexity']:.3f}" if r["perplexity"] is not None else "overflow"
            print(f"{name:<40} {r['loss']:>8.4f} {ppl:>11} {bpb:>10} {r['sequences']:>10}")
        print(f"wrote {out}")
    runtime.stop()
    return 0
