"""Strata ZeRO-3 against DeepSpeed ZeRO-3 on the same model, data, optimizer and world (CPU, gloo, fp32).

Both sides train the Strata config (configs/tiny.yaml widened to a few million parameters by
default) for `--steps` steps with the same global batch on `--nproc` ranks, each side launched
with torchrun as its own worker (bench/_zero_worker.py) and measured the same way on every rank:

* Strata: `strata.trainer.loop.Trainer` with `zero.params/grads/optim.shard_over=global`, one
  `train_step()` per step (`--strata dp` runs plain data parallelism instead);
* DeepSpeed ZeRO-3: the model built under `zero.Init` (partitioned from the start,
  `stage3_param_persistence_threshold: 0`, so every parameter is sharded), Strata's initial
  values (`strata.model.initial_value`) written through `GatheredParameters`, torch AdamW with
  Strata's weight-decay groups, `strata.trainer.lr_schedule.lr_at`, gradient clipping, and Strata's
  `BatchLoader` giving each rank the same samples as Strata's trainer does.

Printed: the median step time over steps 3..N (a step's time is that of its slowest rank) and the
ratio Strata/DeepSpeed; the peak RSS per rank above a baseline taken after the process group is
up and before the model exists (psutil, sampled after every step), and its ratio; the bytes each
side holds for parameters, gradients and optimizer state; both loss curves and their largest
relative difference. `--check` also trains the same model single-process with plain torch
(bench/overhead.py's PlainLoop) for `--check-steps` steps and fails if either side's losses
differ from it by more than `--tol` (relative).

    python bench/zero_vs_deepspeed.py                       # 2 ranks, 20 steps: 2-3 minutes on 2 cores
    python bench/zero_vs_deepspeed.py --check --out zero_vs_ds.json
    python bench/zero_vs_deepspeed.py --nproc 4 model.n_layers=8

Needs DeepSpeed, installed without letting pip touch torch (psutil comes with it):
`echo torch==2.13.0 > /tmp/torch-pin.txt && pip install -c /tmp/torch-pin.txt deepspeed` (0.19.8 here).
On first use DeepSpeed JIT-compiles its shared-memory comm op (about 25 s on 2 cores; cached in
$TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions); that is init time, not step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from strata import config as config_mod
from strata.data.prepare import ensure_default_corpus
from strata.launch.cli import TORCH_ENV_DEFAULTS
from strata.launch.torchrun import LaunchPlan, torchrun_args

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORKER = BENCH / "_zero_worker.py"
ZERO3 = [
    "zero.params.shard_over=global",
    "zero.grads.shard_over=global",
    "zero.optim.shard_over=global",
]
MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides (applied last)")
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--nproc", type=int, default=2, help="ranks (world size) for both sides")
    p.add_argument(
        "--steps", type=int, default=20, help="optimizer steps per side (timed: steps 3..N)"
    )
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument(
        "--strata",
        choices=("auto", "zero3", "dp"),
        default="auto",
        help="Strata's mode: zero3, plain data parallelism, or zero3 when the config has a zero group",
    )
    p.add_argument(
        "--sides", default="deepspeed,strata", help="which workers to run, in this order"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each side, alternating which goes first (the load of other processes then "
        "falls on both); times are pooled over rounds, RSS peaks are the largest of any round",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="compare both sides' losses with a single-process plain torch run; exit 1 if they differ",
    )
    p.add_argument("--check-steps", type=int, default=5)
    p.add_argument(
        "--tol", type=float, default=1e-4, help="largest relative loss difference --check accepts"
    )
    p.add_argument("--timeout", type=int, default=300, help="seconds per worker run")
    p.add_argument(
        "--out", type=Path, default=None, help="also write everything measured as JSON here"
    )
    p.add_argument("--verbose", action="store_true", help="stream the workers' output")
    return p.parse_args(argv)


def strata_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    return "zero3" if hasattr(config_mod, "ZeroConfig") else "dp"


def bench_overrides(args) -> list[str]:
    """Config overrides shared by both sides (the data directory is added by `main`)."""
    return [
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.steps={args.steps}",
        f"optim.warmup_steps={max(1, args.steps // 5)}",
        "train.eval_interval=0",
        "checkpoint.save_final=false",
        *args.overrides,
    ]


def run_worker(side: str, args, overrides: list[str], out: Path, tmp: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(LaunchPlan(args.nproc, rdzv_id=side)),
        str(WORKER),
        "--side",
        side,
        "--out",
        str(out),
        args.config,
        *overrides,
    ]
    env = dict(
        os.environ,
        TMPDIR=str(tmp),
        DS_ACCELERATOR="cpu",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore::FutureWarning",
    )  # gloo's all_gather_into_tensor deprecation, per call
    if (
        side == "strata"
    ):  # what the `strata` command sets for its workers (each side as its own tool runs it)
        env = {**TORCH_ENV_DEFAULTS, **env}
    log = tmp / f"{side}.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd,
            env=env,
            cwd=REPO,
            timeout=args.timeout,
            text=True,
            stdout=None if args.verbose else f,
            stderr=subprocess.STDOUT if not args.verbose else None,
        )
    if proc.returncode != 0 or not out.is_file():
        tail = "" if args.verbose else "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"{side} worker failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


def summarize(runs: list[dict]) -> dict:
    """Per-side figures from every rank's record of every round."""

    def per_rank(f):  # the largest value of f(rank record) over rounds, for each rank
        return [max(f(run["ranks"][k]) for run in runs) for k in range(len(runs[0]["ranks"]))]

    # a step lasts as long as its slowest rank
    step_s = [
        [max(r["step_s"][i] for r in run["ranks"]) for i in range(len(run["ranks"][0]["step_s"]))]
        for run in runs
    ]
    steps = len(step_s[0])
    timed_by_round = [run[2:] or run for run in step_s]
    timed = [t for run in timed_by_round for t in run]
    peak = per_rank(lambda r: max(r["rss_after_step"]) - r["rss_baseline"])
    losses = [run["ranks"][0]["losses"] for run in runs]
    return {
        "label": runs[0]["label"],
        "n_params": runs[0]["n_params"],
        "step_s": step_s,
        "median_step_s": statistics.median(timed),
        "round_median_step_s": [statistics.median(run) for run in timed_by_round],
        "timed_steps": f"3..{steps}" if steps > 2 else f"1..{steps}",
        "peak_rss_above_baseline": peak,
        "max_peak_rss_above_baseline": max(peak),
        "lifetime_peak_rss_above_baseline": per_rank(
            lambda r: r["peak_rss_lifetime"] - r["rss_baseline"]
        ),
        "rss_after_init_above_baseline": per_rank(
            lambda r: r["rss_after_init"] - r["rss_baseline"]
        ),
        "held_bytes": [r["held"] for r in runs[0]["ranks"]],
        "init_s": max(r["init_s"] for run in runs for r in run["ranks"]),
        "threads_per_rank": runs[0]["ranks"][0]["threads"],
        "losses": losses[0],
        "rounds_identical": all(run == losses[0] for run in losses),
    }


def reference_losses(cfg: config_mod.Config, data_dir: Path, steps: int) -> list[float]:
    """The same training in one process with plain torch: the whole global batch, accumulated."""
    from overhead import PlainLoop  # bench/ is sys.path[0] when a bench runs as a script

    loop = PlainLoop(cfg, data_dir, torch.device("cpu"))
    return [loop.train_step() for _ in range(steps)]


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = strata_mode(args.strata)
    sides = args.sides.split(",")
    overrides = bench_overrides(args)
    cfg = config_mod.load(args.config, overrides, world_size=args.nproc)
    if not cfg.data.path:  # prepare the built-in corpus once, here, and point both sides at it
        overrides.append(
            f"data.path={ensure_default_corpus(cfg.data.cache_dir, cfg.data.val_fraction)}"
        )
        cfg = config_mod.load(args.config, overrides, world_size=args.nproc)
    strata_overrides = overrides + (ZERO3 if mode == "zero3" else [])
    config_mod.load(
        args.config, strata_overrides, world_size=args.nproc
    )  # fail here, not in a worker

    load_start = os.getloadavg()[0]
    raw: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="strata-zero-vs-ds-") as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                load = os.getloadavg()[0]
                print(
                    f"round {r + 1}/{args.rounds}: {side} ({args.nproc} ranks, {args.steps} steps; "
                    f"load {load:.2f}) ...",
                    flush=True,
                )
                raw[side].append(
                    run_worker(
                        side,
                        args,
                        strata_overrides if side == "strata" else overrides,
                        tmp / f"{side}-{r}.json",
                        tmp,
                    )
                )
                raw[side][-1]["load_avg_before"] = load
    results = {side: {**summarize(runs), "raw": runs} for side, runs in raw.items()}
    reference = None
    if args.check:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        reference = reference_losses(cfg, Path(cfg.data.path), min(args.check_steps, args.steps))

    # --- report ------------------------------------------------------------------------------
    first = results[sides[0]]
    print(
        f"\nmodel {first['n_params'] / 1e6:.2f}M params (d_model {cfg.model.d_model}, {cfg.model.n_layers} layers, "
        f"seq {cfg.model.seq_len}), global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size}"
        f" x {cfg.grad_accum_steps(args.nproc)} accum x {args.nproc} ranks, fp32, gloo, torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs, {first['threads_per_rank']} torch thread(s) per rank, "
        f"load {load_start:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    for side, r in results.items():
        print(f"  {side:9s} = {r['label']}")
    print(
        f"\n{'':10s} {'step ms':>9s} {'peak RSS MiB':>13s} {'per rank':>16s} "
        f"{'held MiB (params/grads/optim, rank 0)':>40s} {'init s':>7s}"
    )
    for side, r in results.items():
        h = r["held_bytes"][0]
        held = "/".join(mib(h.get(k, 0)) for k in ("params", "grads", "optim")) if h else "n/a"
        print(
            f"{side:10s} {r['median_step_s'] * 1e3:9.1f} {mib(r['max_peak_rss_above_baseline']):>13s} "
            f"{' '.join(mib(x) for x in r['peak_rss_above_baseline']):>16s} {held:>40s} {r['init_s']:7.2f}"
        )
    ratios = {}
    if "strata" in results and "deepspeed" in results:
        s, d = results["strata"], results["deepspeed"]
        ratios = {
            "step_time": s["median_step_s"] / d["median_step_s"],
            "peak_rss": s["max_peak_rss_above_baseline"] / d["max_peak_rss_above_baseline"],
            "max_rel_loss_diff": rel_diff(s["losses"], d["losses"]),
        }
        ratios["step_time_best_rounds"] = min(s["round_median_step_s"]) / min(
            d["round_median_step_s"]
        )
        print(
            f"\nstrata/deepspeed: step time {ratios['step_time']:.3f} (median of steps {s['timed_steps']}), "
            f"peak RSS above baseline {ratios['peak_rss']:.3f} (largest rank of each)"
        )
        if args.rounds > 1:
            print(
                "  per-round medians (ms): "
                + "; ".join(
                    f"{side} " + " ".join(f"{t * 1e3:.0f}" for t in r["round_median_step_s"])
                    for side, r in results.items()
                )
                + f"; ratio of each side's quietest round {ratios['step_time_best_rounds']:.3f}"
            )

    print("\nloss per step" + (" (reference: single-process plain torch)" if reference else ""))
    print(
        f"{'step':>4s} "
        + " ".join(f"{side:>10s}" for side in results)
        + (f" {'reference':>10s}" if reference else "")
    )
    for i in range(args.steps):
        row = " ".join(f"{r['losses'][i]:10.6f}" for r in results.values())
        ref = f" {reference[i]:10.6f}" if reference and i < len(reference) else ""
        print(f"{i + 1:4d} {row}{ref}")
    for side, r in results.items():
        if not r["rounds_identical"]:
            print(f"note: {side}'s losses differ between rounds (the first round's are shown)")
    if ratios:
        print(
            f"max relative loss difference strata vs deepspeed over {args.steps} steps: "
            f"{ratios['max_rel_loss_diff']:.2e}"
        )
    failed = False
    check = {}
    if reference:
        for side, r in results.items():
            check[side] = rel_diff(r["losses"][: len(reference)], reference)
            ok = check[side] <= args.tol
            failed |= not ok
            print(
                f"check {side}: max relative difference from the reference over {len(reference)} steps "
                f"{check[side]:.2e} ({'ok' if ok else 'FAIL'}, tol {args.tol:g})"
            )

    if args.out:
        from _zero_worker import deepspeed_config

        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "strata_mode": mode,
                    "cpus": os.cpu_count(),
                    "load_avg_start": load_start,
                    "config": config_mod.to_dict(cfg),
                    "strata_overrides": strata_overrides,
                    "deepspeed_config": deepspeed_config(cfg, args.nproc),
                    "sides": results,
                    "ratios": ratios,
                    "reference_losses": reference,
                    "check_rel_diff": check,
                },
                indent=1,
            )
        )
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
