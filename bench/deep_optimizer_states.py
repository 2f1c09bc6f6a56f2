"""Deep Optimizer States on a GPU: the optimizer step with AdamW's moments offloaded to host memory
(`offload.optim.device: cpu`, ZeRO-3 on one rank), updated all on the CPU (ZeRO-Offload's way)
against the placement the performance model chooses per sub-group (`update_on: auto`) and all on
the GPU — the same trainer, model, data and steps, in one process, variants interleaved.

Each optimizer step is timed alone (CUDA synchronised before and after); the whole training step
too. Prints the calibration and the plan the model made, the median step times, the ratio
auto/all-CPU (the paper reports 2.5x), and the largest parameter difference between the variants
(CPU and GPU fused AdamW may differ in the last bits; they are not bit-identical on a GPU).

    python bench/deep_optimizer_states.py                      # needs CUDA; d_model 2048, 8 layers
    python bench/deep_optimizer_states.py --d-model 1024 --steps 6

Without CUDA it says so and stops: on a CPU the model plans all-CPU (tests/offload/test_placement.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from strata import config as config_mod
from strata.parallel import runtime as runtime_mod
from strata.trainer.loop import Trainer

VARIANTS = ("cpu", "auto", "gpu")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument(
        "--steps", type=int, default=8, help="steps per variant; the first 2 are warm-up"
    )
    p.add_argument("--slab-mb", type=float, default=64.0, help="slab = optimizer sub-group size")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    return p.parse_args(argv)


def build(args, update_on: str, run_root: Path) -> Trainer:
    overrides = {
        "model.n_layers": args.layers,
        "model.d_model": args.d_model,
        "model.n_heads": max(1, args.d_model // 128),
        "model.seq_len": args.seq_len,
        "train.micro_batch_size": args.micro_batch,
        "train.global_batch_size": args.micro_batch,
        "train.steps": args.steps,
        "train.eval_interval": 0,
        "optim.warmup_steps": 1,
        "log.dir": str(run_root),
        "log.name": update_on,
        "log.progress": "false",
        "checkpoint.save_final": "false",
        "zero.params.shard_over": "global",
        "zero.grads.shard_over": "global",
        "zero.optim.shard_over": "global",
        "offload.optim.device": "cpu",
        "offload.optim.update_on": update_on,
        "offload.slab_mb": args.slab_mb,
        "offload.host_buffer_mb": 8 * args.slab_mb,
    }
    cfg = config_mod.load(None, [f"{k}={v}" for k, v in overrides.items()], world_size=1)
    return Trainer(cfg, runtime_mod.start())


def timed_optimizer(trainer: Trainer, times: list[float]) -> None:
    """Time every optimizer step of `trainer` (the tier's sub-group step), synchronised."""
    tier = trainer.model.engine.optim_tier
    inner = tier.step

    def step():
        torch.cuda.synchronize()
        start = time.perf_counter()
        inner()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    tier.step = step


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "no CUDA device: Deep Optimizer States plans every sub-group on the CPU here (its decision logic "
            "is tested in tests/offload/test_placement.py); run this on a GPU machine"
        )
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in VARIANTS:
            trainer = build(args, name, Path(tmp))
            opt_times, step_times = [], []
            timed_optimizer(trainer, opt_times)
            losses = []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                start = time.perf_counter()
                loss, _ = trainer.train_step()
                losses.append(loss.item())
                step_times.append(time.perf_counter() - start)
            params = torch.cat([g.shard.float().cpu() for g in trainer.model.engine.groups])
            record = trainer.model.tiers.startup_record()
            results[name] = {
                "optimizer_step_s": statistics.median(opt_times[2:]),
                "train_step_s": statistics.median(step_times[2:]),
                "losses": losses,
                "placement": record.get("offload_placement"),
                "calibration": record.get("offload_calibration"),
                "params": params,
            }
            n_params = params.numel()
            trainer.model.tiers.close()
            del trainer
            torch.cuda.empty_cache()
    print(
        f"device: {torch.cuda.get_device_name()}, {n_params / 1e6:.0f}M parameters (ZeRO-3, 1 rank), "
        f"sub-groups of {args.slab_mb:g} MiB, moments in pinned host memory"
    )
    print("calibration:", json.dumps(results["auto"]["calibration"]))
    print("plan (auto):", results["auto"]["placement"]["reason"])
    print(f"{'update_on':10} {'optimizer step':>15} {'train step':>11} {'final loss':>11}")
    for name in VARIANTS:
        r = results[name]
        print(
            f"{name:10} {r['optimizer_step_s'] * 1e3:12.1f} ms {r['train_step_s'] * 1e3:8.1f} ms "
            f"{r['losses'][-1]:11.5f}"
        )
    ratio = results["cpu"]["optimizer_step_s"] / results["auto"]["optimizer_step_s"]
    print(f"optimizer step, all-CPU / auto: {ratio:.2f}x (Deep Optimizer States reports 2.5x)")
    for name in ("auto", "gpu"):
        diff = (results[name]["params"] - results["cpu"]["params"]).abs().max().item()
        print(f"max |param({name}) - param(cpu)| after {args.steps} steps: {diff:.3g}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {k: {kk: vv for kk, vv in v.items() if kk != "params"} for k, v in results.items()},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
