"""A job's start and end: the wall time of `strata launch` for a tiny training job, from the command
to the workers' banner (the model built, the world joined) and to its exit, with the workers
forked from the node's fork server (`--worker-start forkserver`, the default) against plain
torchrun starting each as a fresh Python (`--worker-start fresh`), in the same run, alternating
which goes first.

The job trains the tiny model for a few steps, so nearly all of its time is what a user waits for
before and after training: the launcher's checks, torchrun's start, the workers' imports, the
rendezvous, and the shutdown.

    python bench/launch_start.py                       # 2 processes, 3 jobs per start method
    python bench/launch_start.py --nproc 4 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from strata.data.prepare import ensure_default_corpus

ROOT = Path(__file__).resolve().parents[1]
STARTS = ("forkserver", "fresh")
TINY = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=4",
    "model.seq_len=32",
    "train.steps=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "log.progress=false",
    "log.interval=1",
]


def one_job(start: str, nproc: int, root: Path, data: Path) -> dict:
    """Seconds from `strata launch` to the workers' banner ("... world N (tp ...") and to its exit."""
    root.mkdir(parents=True, exist_ok=True)
    experiment = root / "experiment.yaml"
    experiment.write_text("{}\n")
    argv = [sys.executable, "-m", "strata.launch.cli", "launch", str(experiment), *TINY]
    argv += [f"data.path={data}", f"log.dir={root}", "log.name=t", "checkpoint.overwrite=true"]
    argv += ["--nproc", str(nproc), "--worker-start", start]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ready = None
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if ready is None and " world " in line and "(tp " in line:
            ready = time.perf_counter() - t0
    code = proc.wait()
    total = time.perf_counter() - t0
    if code != 0 or ready is None:
        raise SystemExit(f"--worker-start {start}: exit {code}\n{''.join(lines[-40:])}")
    return {"ready_s": ready, "total_s": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes of the job")
    p.add_argument("--repeats", type=int, default=3, help="jobs per start method")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    data = ensure_default_corpus(None, 0.05)
    runs: dict[str, list[dict]] = {s: [] for s in STARTS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for start in STARTS if i % 2 == 0 else reversed(STARTS):
                r = one_job(start, args.nproc, Path(tmp) / f"{start}-{i}", data)
                runs[start].append(r)
                print(f"{start}: ready {r['ready_s']:.2f} s, exit {r['total_s']:.2f} s", flush=True)
    med = {
        s: {k: statistics.median(r[k] for r in runs[s]) for k in ("ready_s", "total_s")}
        for s in STARTS
    }
    print(f"\n{args.nproc} processes, median of {args.repeats} jobs each:")
    print("| workers | ready s | exit s |\n|---|---|---|")
    for s in STARTS:
        print(f"| {s} | {med[s]['ready_s']:.2f} | {med[s]['total_s']:.2f} |")
    ratio = med["forkserver"]["total_s"] / med["fresh"]["total_s"]
    ready = med["forkserver"]["ready_s"] / med["fresh"]["ready_s"]
    print(f"\nforked / fresh (plain torchrun): exit {ratio:.2f}, ready {ready:.2f}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"nproc": args.nproc, "runs": runs, "median": med}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
