"""Strata on an idle and on a busy machine: the demo config's training throughput with OpenMP's
threads left to spin (libgomp's own default) against what the `strata` command chooses (on a machine
whose cores are already busy at start, OMP_WAIT_POLICY=PASSIVE: a thread waiting at a barrier sleeps
instead of spinning; otherwise libgomp's default), each on an idle machine and with CPU-bound
processes beside it (load about twice the cores). Other variants (`--variants`): always passive,
libgomp's spin count set lower, one thread.

OpenMP's worker threads spin while they wait for their partner; when another process holds the core
that partner needs, every parallel region waits out a whole scheduler slice, and a step that takes
milliseconds takes seconds. Variants run alternately, each a fresh `strata train` of configs/tiny.yaml
for `--steps` steps; the figure is the run's own tokens/s (its summary.json), the median of
`--repeats` runs.

    python bench/busy_machine.py                      # idle and busy, both policies (~3 minutes)
    python bench/busy_machine.py --steps 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Each variant's environment (None: leave the variable to the strata command's default). libgomp
# ignores an empty OMP_WAIT_POLICY (its own default: spin, then sleep), and the strata command keeps
# a value the user set, so "" gives libgomp's default back.
VARIANTS: dict[str, dict[str, str | None]] = {
    "libgomp": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": ""},
    "strata": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": ""},
    "spin10k": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "10000"},
    "spin100k": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "100000"},
    "1thread": {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "", "OMP_NUM_THREADS": "1"},
}


def burn(stop_at: float) -> None:
    """A CPU-bound process until `stop_at`."""
    x = 0
    while time.time() < stop_at:
        x += 1


def wait_until_idle(limit_s: float = 180) -> None:
    """Wait until no other work keeps the cores busy (as the strata command judges it), so the idle
    runs are idle."""
    from strata.launch.cli import cpus_busy

    deadline = time.monotonic() + limit_s
    while cpus_busy() and time.monotonic() < deadline:
        time.sleep(5)
    if cpus_busy():
        print(
            f"warning: the machine is still busy after {limit_s:.0f} s: the idle figures are not idle"
        )


def one_run(steps: int, variant: dict[str, str | None], workdir: Path) -> float:
    """tokens/s of one `strata train` of the demo config under `variant`'s environment."""
    names = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in names}
    env.update({k: v for k, v in variant.items() if v is not None})
    name = f"r{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "strata.launch.cli", "train", str(REPO / "configs/tiny.yaml")]
    cmd += [
        f"train.steps={steps}",
        "train.eval_interval=0",
        "checkpoint.save_final=false",
        "log.progress=false",
    ]
    cmd += [f"log.dir={workdir}", f"log.name={name}", f"data.cache_dir={workdir / 'cache'}"]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True, timeout=3600)
    return json.loads((workdir / name / "summary.json").read_text())["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="steps per run on the idle machine")
    ap.add_argument("--busy-steps", type=int, default=10, help="steps per run beside the burners")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--burners", type=int, default=2 * (os.cpu_count() or 2) - 2, help="CPU-bound processes"
    )
    ap.add_argument(
        "--variants", default="libgomp,strata,passive", help=f"of {', '.join(VARIANTS)}"
    )
    args = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        chosen = {name: VARIANTS[name] for name in args.variants.split(",")}
        one_run(2, VARIANTS["strata"], workdir)  # prepares the corpus once, outside the timings
        for machine in ("idle", "busy"):
            if machine == "idle":
                wait_until_idle()
            burners: list[mp.Process] = []
            if machine == "busy":
                stop_at = time.time() + 3600
                burners = [
                    mp.Process(target=burn, args=(stop_at,), daemon=True)
                    for _ in range(args.burners)
                ]
                for b in burners:
                    b.start()
            try:
                steps = args.steps if machine == "idle" else args.busy_steps
                runs: dict[str, list[float]] = {label: [] for label in chosen}
                for _ in range(args.repeats):
                    for label, variant in chosen.items():
                        runs[label].append(one_run(steps, variant, workdir))
                results[machine] = {label: statistics.median(v) for label, v in runs.items()}
            finally:
                for b in burners:
                    b.kill()
    print(
        f"tokens/s, configs/tiny.yaml, {os.cpu_count()} cores, median of {args.repeats}; ratio to libgomp's own"
    )
    print(f"{'machine':8s}" + "".join(f"{label:>20s}" for label in chosen))
    for machine, row in results.items():
        base = row.get("libgomp")
        cells = [
            f"{row[label]:,.0f}" + (f" ({row[label] / base:.2f})" if base else "")
            for label in chosen
        ]
        print(f"{machine:8s}" + "".join(f"{cell:>20s}" for cell in cells))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
