"""Strata ZeRO-3 with offload against DeepSpeed ZeRO-Infinity (ZeRO-3 with parameter and optimizer
offload), to NVMe and to host memory, on the same model, data, optimizer and world (CPU, gloo, fp32).

For each offload device (`--devices nvme,cpu`) both sides train the same >= 100M-parameter model
(d_model 1024, 8 layers, seq 256 by default) for `--steps` steps, each side as its own torchrun
world of `--nproc` ranks running bench/_zero_worker.py (the worker of bench/zero_vs_deepspeed.py,
whose launch, summary and loss helpers this bench reuses); the side that goes first alternates run
by run. Both get the same `offload.*` overrides:

* Strata: `strata.trainer.loop.Trainer` with `zero.{params,grads,optim}.shard_over=global`,
  `offload.params.device=D offload.optim.device=D offload.nvme_path=DIR offload.host_buffer_mb=64
  offload.slab_mb=4`, one `train_step()` per step; the tiers' own counters come from
  `trainer.model.tiers.metrics()` (io_read_bytes, io_write_bytes,
  host_peak_bytes, ...) where the trainer has them. A trainer without tiers fails the Strata run
  (offload not active) unless `--allow-inactive-offload`.
* DeepSpeed 0.19.8: the model built under `zero.Init(config_dict_or_path=ds)` (otherwise NVMe
  swaps bf16 parameters in an fp32 run), `offload_param` {device D, nvme_path, pin_memory,
  buffer_count, buffer_size = the largest parameter}, `offload_optimizer` {device D, nvme_path,
  pin_memory, pipeline_read/write, buffer_count 12}, an `aio` section with Strata's request size
  and thread count (`offload.slab_mb`, `offload.io_threads`), Strata's torch AdamW
  (`zero_force_ds_cpu_optimizer: false`, which DeepSpeed accepts with offload; `--ds-optimizer
  cpu_adam` for DeepSpeedCPUAdam) and weight-decay groups, lr schedule, clipping, initial values and
  batches. Its optimizer sub-group (`sub_group_size`) is 1e7 elements for NVMe: DeepSpeed's default
  1e9 makes the whole model one sub-group, whose pinned swap buffers (4 x the model) took its peak
  from about 3.1 to 4.2 GiB at 100M parameters, with steps no faster; 1e7 needs 12 optimizer
  buffers (4 and 8 run out with pipelined swapping). CPU offload keeps DeepSpeed's default (1e7
  was slower there: 7.2 against 5.3 s a step, same peak).

Measured per side (every rank): the peak RSS above a baseline taken after the imports and the
process group (VmHWM, reset through /proc/self/clear_refs right after the baseline and again after
the build, so the build's and the steps' peaks are both exact); the median step time over steps
3..N (a step lasts as long as its slowest rank); the losses (must match: allclose, `--rtol`); the
bytes of the swap files under `offload.nvme_path` after the steps; the bytes each process moved to
and from storage during the steps (/proc/self/io: O_DIRECT and libaio included, the same measure
for both sides); Strata's tier counters. Printed: a table per device and the ratios Strata/DeepSpeed
with the goals (peak RSS <= 0.5x, step time <= 1.0x).

    python bench/offload_vs_deepspeed.py                          # 1 rank, nvme and cpu, 8 steps: ~5 min
    python bench/offload_vs_deepspeed.py --nproc 2 --devices nvme --out offload_vs_ds.json
    python bench/offload_vs_deepspeed.py --sides deepspeed        # DeepSpeed's figures only

NVMe on the DeepSpeed side needs libaio (`apt-get install -y libaio-dev`) and the async_io op, a
JIT build of about 189 s on 2 cores that this script does once up front (cached in
$TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Where `AsyncIOBuilder().is_compatible()`
is False, the builder's reason is printed and only the CPU-offload comparison runs. The swap
directories go under `--swap-dir` (default: a new temp dir on the disk behind $TMPDIR, refused on
tmpfs unless --allow-tmpfs) and are removed after each run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported, here or in a worker

import torch  # noqa: E402

from strata import config as config_mod  # noqa: E402
from strata.data.prepare import ensure_default_corpus  # noqa: E402

# bench/ is sys.path[0] when a bench runs as a script
from zero_vs_deepspeed import REPO, ZERO3, bench_overrides, mib, rel_diff, run_worker, summarize  # noqa: E402

DEVICES = ("nvme", "cpu")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="extra key=value config overrides for both sides (applied last)",
    )
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--nproc", type=int, default=1, help="ranks (world size) for both sides")
    p.add_argument(
        "--devices", default="nvme,cpu", help="offload devices to compare, in this order"
    )
    p.add_argument(
        "--sides", default="deepspeed,strata", help="which workers to run (first run's order)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each side per device; which side goes first alternates run by run",
    )
    p.add_argument(
        "--steps", type=int, default=8, help="optimizer steps per run (timed: steps 3..N)"
    )
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument(
        "--lr", type=float, default=3e-4, help="optim.lr (configs/tiny.yaml's 3e-3 spikes at 100M)"
    )
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: CPUs / nproc; torchrun alone would give 1)",
    )
    p.add_argument(
        "--host-buffer-mb", type=float, default=64, help="Strata: offload.host_buffer_mb"
    )
    p.add_argument(
        "--slab-mb",
        type=float,
        default=4,
        help="Strata: offload.slab_mb (also DeepSpeed's aio block_size)",
    )
    p.add_argument(
        "--ds-optimizer",
        choices=("torch", "cpu_adam"),
        default="torch",
        help="DeepSpeed's optimizer: Strata's torch AdamW, or DeepSpeedCPUAdam (a 44 s cpu_adam build)",
    )
    p.add_argument(
        "--ds-sub-group-size",
        type=float,
        default=None,
        help="DeepSpeed zero_optimization.sub_group_size in elements, for both devices (default: 1e7 for "
        "nvme, its lowest-memory working setting here; DeepSpeed's own 1e9 for cpu, its fastest)",
    )
    p.add_argument(
        "--ds-param-buffers", type=int, default=5, help="DeepSpeed offload_param.buffer_count"
    )
    p.add_argument(
        "--ds-optim-buffers",
        type=int,
        default=12,
        help="DeepSpeed offload_optimizer.buffer_count, buffers of one sub-group each (its default 4, and "
        "8, run out with pipelined swapping of more than one sub-group)",
    )
    p.add_argument(
        "--rtol",
        type=float,
        default=1e-5,
        help="losses must be allclose(strata, deepspeed, rtol, atol=0)",
    )
    p.add_argument(
        "--swap-dir",
        type=Path,
        default=None,
        help="parent of the runs' nvme_path directories (default: a temp dir under $TMPDIR or /tmp)",
    )
    p.add_argument(
        "--allow-tmpfs", action="store_true", help="accept a --swap-dir on tmpfs (no real disk I/O)"
    )
    p.add_argument(
        "--allow-inactive-offload",
        action="store_true",
        help="run Strata even when its trainer has no offload tiers (then it is plain ZeRO-3; labelled so)",
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds per worker run")
    p.add_argument(
        "--out", type=Path, default=None, help="also write everything measured as JSON here"
    )
    p.add_argument("--verbose", action="store_true", help="stream the workers' output")
    return p.parse_args(argv)


# --- set-up -------------------------------------------------------------------------------------


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (longest mount-point prefix)."""
    path, best, kind = str(path.resolve()), "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        mount = fields[1].replace("\\040", " ")
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def prepare_ops(
    devices: list[str], ds_optimizer: str, run_deepspeed: bool
) -> tuple[list[str], dict]:
    """Loads (building once, if not cached) the DeepSpeed ops the runs need, here rather than in a
    timed worker. Drops nvme when DeepSpeed's async_io op cannot work here, printing the reason."""
    info: dict = {}
    if not run_deepspeed:
        return devices, info
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

    if "nvme" in devices:
        builder, said = AsyncIOBuilder(), io.StringIO()
        with contextlib.redirect_stdout(said):
            ok = builder.is_compatible(verbose=True)
        if not ok:
            said = re.sub(r"\x1b\[[0-9;]*m", "", said.getvalue())  # DeepSpeed's colours
            reason = (
                "\n  ".join(line.strip() for line in said.splitlines() if line.strip())
                or getattr(builder, "error_log", None)
                or "no reason given"
            )
            print(
                f"DeepSpeed's async_io op is not compatible here, so NVMe offload is skipped:\n  {reason}\n"
                "  (apt-get install -y libaio-dev, then run again; the op's first build takes ~189 s)"
            )
            info["async_io"] = {"compatible": False, "reason": reason}
            devices = [d for d in devices if d != "nvme"]
        else:
            t = time.perf_counter()
            builder.load(verbose=False)
            info["async_io"] = {"compatible": True, "load_s": round(time.perf_counter() - t, 1)}
            print(
                f"DeepSpeed async_io op ready in {info['async_io']['load_s']} s (a build, not cached, takes ~189 s)"
            )
    if ds_optimizer == "cpu_adam":
        t = time.perf_counter()
        CPUAdamBuilder().load(verbose=False)
        info["cpu_adam"] = {"load_s": round(time.perf_counter() - t, 1)}
        print(
            f"DeepSpeed cpu_adam op ready in {info['cpu_adam']['load_s']} s (a build takes ~44 s)"
        )
    return devices, info


DS_SUB_GROUP = {"nvme": 1e7, "cpu": None}  # None: DeepSpeed's default (1e9)


def worker_flags(args, device: str) -> list[str]:
    """Options for bench/_zero_worker.py, placed after its config overrides."""
    flags = [
        "--ds-optimizer",
        args.ds_optimizer,
        "--ds-param-buffers",
        str(args.ds_param_buffers),
        "--ds-optim-buffers",
        str(args.ds_optim_buffers),
    ]
    sub_group = args.ds_sub_group_size or DS_SUB_GROUP[device]
    if sub_group:
        flags += ["--ds-sub-group-size", f"{sub_group:g}"]
    if args.allow_inactive_offload:
        flags.append("--allow-inactive-offload")
    return flags


def offload_overrides(args, device: str, nvme_path: Path | None) -> list[str]:
    o = [
        f"offload.params.device={device}",
        f"offload.optim.device={device}",
        f"offload.host_buffer_mb={args.host_buffer_mb:g}",
        f"offload.slab_mb={args.slab_mb:g}",
    ]
    return o + ([f"offload.nvme_path={nvme_path}"] if nvme_path else [])


# --- summary ------------------------------------------------------------------------------------


def offload_summary(runs: list[dict]) -> dict:
    """The offload figures of one side on one device, from every rank of every round."""
    ranks = range(len(runs[0]["ranks"]))
    steps = len(runs[0]["ranks"][0]["step_s"])

    def peak(r: dict, key: str) -> int:  # above the post-import baseline
        value = r[key] if r["hwm_reset"] else r["peak_rss_lifetime"]
        return value - r["rss_baseline"]

    peak_init = [max(peak(run["ranks"][k], "hwm_init") for run in runs) for k in ranks]
    peak_steps = [max(peak(run["ranks"][k], "hwm_steps") for run in runs) for k in ranks]
    peak_all = [max(a, b) for a, b in zip(peak_init, peak_steps)]
    first = runs[0]

    def per_step(key: str, field: str) -> float:  # summed over ranks, per step, first round
        return sum(r[key].get(field, 0) for r in first["ranks"]) / steps

    metrics = [r.get("offload_metrics_steps") or {} for r in first["ranks"]]
    tiers = {}
    for name in ("io_read_bytes", "io_write_bytes"):
        if any(name in m for m in metrics):
            tiers[name + "_per_step"] = sum(m.get(name, 0) for m in metrics) / steps
    host_peaks = [
        r["offload_metrics"].get("host_peak_bytes")
        for r in first["ranks"]
        if r.get("offload_metrics")
    ]
    if any(h is not None for h in host_peaks):
        tiers["host_peak_bytes"] = max(h for h in host_peaks if h is not None)
    return {
        "hwm_reset": all(r["hwm_reset"] for run in runs for r in run["ranks"]),
        "peak_init": peak_init,
        "peak_steps": peak_steps,
        "peak": peak_all,
        "max_peak": max(peak_all),
        "sum_peak": sum(peak_all),
        "swap_after_init": first.get("swap_after_init"),
        "swap": first.get("swap_after_steps"),
        "disk_read_per_step": per_step("io_steps", "read"),
        "disk_write_per_step": per_step("io_steps", "write"),
        "disk_write_init": sum(r["io_init"].get("write", 0) for r in first["ranks"]),
        "tiers": tiers,
        "tier_metrics": [r.get("offload_metrics") for r in first["ranks"]],
        "info": first.get("info", {}),
    }


def losses_match(a: list[float], b: list[float], rtol: float) -> bool:
    return torch.allclose(
        torch.tensor(a, dtype=torch.float64),
        torch.tensor(b, dtype=torch.float64),
        rtol=rtol,
        atol=0,
    )


def failure_reason(text: str) -> str:
    """The line of a failed worker's output that says why: rank 0's last line, else the last error."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for pick in (
        lambda x: x.startswith("[rank") and "Error" in x,
        lambda x: x.startswith("strata:"),
        lambda x: "Error" in x or "error" in x,
        lambda x: True,
    ):
        found = [line for line in lines if pick(line)]
        if found:
            return found[-1]
    return "?"


def fmt_bytes(n) -> str:
    return "-" if n is None else mib(n)


# --- the runs -----------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    command = shlex.join(
        [sys.executable, "bench/offload_vs_deepspeed.py", *(sys.argv[1:] if argv is None else argv)]
    )
    sides = args.sides.split(",")
    devices = args.devices.split(",")
    unknown = [d for d in devices if d not in DEVICES] + [
        s for s in sides if s not in ("deepspeed", "strata")
    ]
    if unknown:
        raise SystemExit(
            f"unknown device(s)/side(s) {unknown}: devices are {DEVICES}, sides deepspeed and strata"
        )
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    shared = argparse.Namespace(
        **{
            **vars(args),
            "overrides": [
                f"model.seq_len={args.seq_len}",
                f"optim.lr={args.lr:g}",
                f"train.threads={threads}",
                *args.overrides,
            ],
        }
    )
    overrides = bench_overrides(shared) + ZERO3  # DeepSpeed is ZeRO-3 whatever the zero.* keys say
    cfg = config_mod.load(args.config, overrides, world_size=args.nproc)
    if not cfg.data.path:  # prepare the built-in corpus once, here, and point both sides at it
        overrides.append(
            f"data.path={ensure_default_corpus(cfg.data.cache_dir, cfg.data.val_fraction)}"
        )
    for device in devices:  # fail here, not in a worker
        config_mod.load(
            args.config,
            overrides + offload_overrides(args, device, Path("/nonexistent")),
            world_size=args.nproc,
        )
    cfg = config_mod.load(args.config, overrides, world_size=args.nproc)

    print(f"command: {command}", flush=True)
    devices, ops = prepare_ops(devices, args.ds_optimizer, "deepspeed" in sides)
    if not devices:
        raise SystemExit("nothing to compare: no offload device left")

    swap_parent = args.swap_dir or Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
    swap_parent.mkdir(parents=True, exist_ok=True)
    kind = fs_type(swap_parent)
    if kind in ("tmpfs", "ramfs") and "nvme" in devices and not args.allow_tmpfs:
        raise SystemExit(
            f"--swap-dir {swap_parent} is on {kind}: swap files there are memory, not disk; "
            "point --swap-dir at a directory on an SSD (or pass --allow-tmpfs)"
        )

    load_start = os.getloadavg()[0]
    raw: dict[str, dict[str, list[dict]]] = {d: {s: [] for s in sides} for d in devices}
    errors: dict[str, dict[str, str]] = {d: {} for d in devices}
    wall = time.perf_counter()
    order = 0
    with (
        tempfile.TemporaryDirectory(prefix="strata-offload-vs-ds-") as tmp,
        tempfile.TemporaryDirectory(prefix="strata-offload-swap-", dir=swap_parent) as swap_root,
    ):
        tmp, swap_root = Path(tmp), Path(swap_root)
        print(f"swap files under {swap_root} ({kind})", flush=True)
        for device in devices:
            for r in range(args.rounds):
                for side in sides if order % 2 == 0 else sides[::-1]:
                    if side in errors[device]:
                        continue
                    nvme_path = swap_root / f"{device}-{side}-{r}" if device == "nvme" else None
                    load = os.getloadavg()[0]
                    print(
                        f"{device} round {r + 1}/{args.rounds}: {side} ({args.nproc} rank(s), {args.steps} steps; "
                        f"load {load:.2f}) ...",
                        flush=True,
                    )
                    t = time.perf_counter()
                    try:
                        run = run_worker(
                            side,
                            args,
                            overrides
                            + offload_overrides(args, device, nvme_path)
                            + worker_flags(args, device),
                            tmp / f"{device}-{side}-{r}.json",
                            tmp,
                        )
                    except (SystemExit, subprocess.TimeoutExpired) as e:
                        errors[device][side] = str(e.code if isinstance(e, SystemExit) else e)
                        print(
                            f"  {side} FAILED: {failure_reason(errors[device][side])}", flush=True
                        )
                        continue
                    finally:
                        if nvme_path is not None:
                            shutil.rmtree(nvme_path, ignore_errors=True)
                    run["load_avg_before"], run["wall_s"] = load, time.perf_counter() - t
                    raw[device][side].append(run)
                    print(f"  done in {run['wall_s']:.0f} s", flush=True)
                order += 1
    wall = time.perf_counter() - wall

    # --- report ------------------------------------------------------------------------------
    results: dict[str, dict[str, dict]] = {}
    for device in devices:
        results[device] = {
            side: {**summarize(runs), **offload_summary(runs), "raw": runs}
            for side, runs in raw[device].items()
            if runs
        }
    any_run = next((r for d in results.values() for r in d.values()), None)
    print(f"\n{command}")
    n_params = f"{any_run['n_params'] / 1e6:.1f}M params" if any_run else "model"
    print(
        f"{n_params} (d_model {cfg.model.d_model}, {cfg.model.n_layers} layers, seq {cfg.model.seq_len}), "
        f"global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x "
        f"{cfg.grad_accum_steps(args.nproc)} accum x {args.nproc} rank(s), {args.steps} steps, fp32, gloo, "
        f"{threads} thread(s) per rank, torch {torch.__version__}; {os.cpu_count()} CPUs, "
        f"load {load_start:.2f} -> {os.getloadavg()[0]:.2f}; {wall:.0f} s of runs"
    )
    ratios: dict[str, dict] = {}
    failed = False
    for device in devices:
        res = results[device]
        print(f"\n== offload {device} ==")
        for side, r in res.items():
            print(f"  {side:9s} = {r['label']}")
        for side, err in errors[device].items():
            print(f"  {side:9s} FAILED: {failure_reason(err)}")
        if not res:
            continue
        print(
            f"{'':10s} {'step ms':>8s} {'peak RSS MiB':>12s} {'build':>7s} {'steps':>7s} {'swap MiB':>9s} "
            f"{'files':>5s} {'disk R/W MiB per step':>22s} {'tiers R/W MiB per step':>23s} {'init s':>7s}"
        )
        for side, r in res.items():
            swap = r["swap"] or {}
            t = r["tiers"]
            tiers = (
                f"{fmt_bytes(t.get('io_read_bytes_per_step'))}/{fmt_bytes(t.get('io_write_bytes_per_step'))}"
                if "io_read_bytes_per_step" in t or "io_write_bytes_per_step" in t
                else "-"
            )
            print(
                f"{side:10s} {r['median_step_s'] * 1e3:8.0f} {mib(r['max_peak']):>12s} "
                f"{mib(max(r['peak_init'])):>7s} {mib(max(r['peak_steps'])):>7s} "
                f"{fmt_bytes(swap.get('bytes')):>9s} {swap.get('files', '-'):>5} "
                f"{mib(r['disk_read_per_step']) + '/' + mib(r['disk_write_per_step']):>22s} {tiers:>23s} "
                f"{r['init_s']:7.1f}"
            )
            if not r["hwm_reset"]:
                print(f"  ({side}: VmHWM could not be reset; its peaks are the lifetime ru_maxrss)")
            if r["tiers"].get("host_peak_bytes") is not None:
                print(
                    f"  ({side}: the tiers' own host_peak_bytes {mib(r['tiers']['host_peak_bytes'])} MiB: VmHWM "
                    "since the bench's last reset, not above the baseline)"
                )
        if args.nproc > 1:
            print(
                "  peak RSS above baseline per rank (MiB): "
                + "; ".join(
                    f"{side} "
                    + " ".join(mib(x) for x in r["peak"])
                    + f" (sum {mib(r['sum_peak'])})"
                    for side, r in res.items()
                )
            )
        if args.rounds > 1:
            print(
                "  per-round median step ms: "
                + "; ".join(
                    f"{side} " + " ".join(f"{t * 1e3:.0f}" for t in r["round_median_step_s"])
                    for side, r in res.items()
                )
            )
        if "deepspeed" in res:
            print(
                f"  deepspeed optimizer: {res['deepspeed']['info'].get('optimizer')} "
                f"(inside {res['deepspeed']['info'].get('engine_optimizer')})"
            )
        if "strata" in res and "deepspeed" in res:
            s, d = res["strata"], res["deepspeed"]
            match = losses_match(s["losses"], d["losses"], args.rtol)
            ratios[device] = {
                "step_time": s["median_step_s"] / d["median_step_s"],
                "peak_rss": s["max_peak"] / d["max_peak"],
                "max_rel_loss_diff": rel_diff(s["losses"], d["losses"]),
                "losses_allclose": match,
                "strata_offload_active": s["info"].get("offload_active", False),
            }
            q = ratios[device]
            failed |= not match
            print(
                f"strata/deepspeed ({device}): step time {q['step_time']:.3f} (goal <= 1.0), "
                f"peak RSS {q['peak_rss']:.3f} (goal <= 0.5); losses "
                f"{'allclose' if match else 'DIFFER'} (max rel diff {q['max_rel_loss_diff']:.1e}, rtol {args.rtol:g})"
                + ("" if q["strata_offload_active"] else "  [strata offload NOT active]")
            )
        print(
            "loss per step: "
            + "; ".join(
                f"{side} " + " ".join(f"{x:.6f}" for x in r["losses"]) for side, r in res.items()
            )
        )
        for side, r in res.items():
            if not r["rounds_identical"]:
                print(f"note: {side}'s losses differ between rounds (the first round's are used)")
    print(f"\n{command}")

    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": command,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "cpus": os.cpu_count(),
                    "load_avg_start": load_start,
                    "ops": ops,
                    "config": config_mod.to_dict(cfg),
                    "overrides": overrides,
                    "deepspeed_config": {
                        d: res["deepspeed"]["info"].get("deepspeed_config")  # as the worker ran it
                        for d, res in results.items()
                        if "deepspeed" in res
                    },
                    "sides": results,
                    "errors": errors,
                    "ratios": ratios,
                },
                indent=1,
            )
        )
        print(f"wrote {args.out}")
    return 1 if failed or any(errors[d] for d in devices) else 0


if __name__ == "__main__":
    sys.exit(main())
