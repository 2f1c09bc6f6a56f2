"""The load-balancing curve of DeepSeek-V3's auxiliary-loss-free bias: the CPU MoE demo
(configs/moe-tiny.yaml: 8 experts, top 2, sigmoid router) trained with and without the bias update
(`model.moe.bias_update_rate`, 0.001 in the config), every other setting equal. Prints, at every
logged step, the MoE layers' mean of max/mean tokens per expert (1.0 is perfectly even; 4.0 is
every token's two experts always the same two of 8) and the loss, and the final eval losses.

    python bench/moe_balance.py                 # 300 steps each, ~4 min on 2 cores
    python bench/moe_balance.py --steps 100 --rate 0.01
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(run_root: Path, name: str, steps: int, rate: float) -> list[dict]:
    overrides = [
        f"train.steps={steps}",
        f"model.moe.bias_update_rate={rate}",
        f"log.dir={run_root}",
        f"log.name={name}",
        f"checkpoint.dir={run_root / name / 'checkpoints'}",
        "checkpoint.interval=0",
        "checkpoint.save_final=false",
        f"train.eval_interval={steps}",
        "log.progress=false",
    ]
    cmd = [
        sys.executable,
        "-m",
        "strata.launch.cli",
        "train",
        str(ROOT / "configs" / "moe-tiny.yaml"),
        *overrides,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    lines = (run_root / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--rate", type=float, default=0.001, help="the bias update rate of the balanced run"
    )
    ap.add_argument("--every", type=int, default=30, help="print every this many steps")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            name: train(Path(tmp), name, args.steps, rate)
            for name, rate in (("bias", args.rate), ("none", 0.0))
        }
    steps = {name: {r["step"]: r for r in records if "moe" in r} for name, records in runs.items()}
    lines = [
        f"| step | max/mean load, bias {args.rate} | max/mean load, no bias | loss, bias | loss, no bias |",
        "|---|---|---|---|---|",
    ]
    for step in sorted(steps["bias"]):
        if step % args.every and step != args.steps:
            continue
        a, b = steps["bias"][step], steps["none"].get(step)
        if b is None:
            continue
        lines.append(
            f"| {step} | {a['moe']['mean_load_max_over_mean']:.2f} | {b['moe']['mean_load_max_over_mean']:.2f} | "
            f"{a['loss']:.3f} | {b['loss']:.3f} |"
        )
    evals = {
        name: next((r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None)
        for name, records in runs.items()
    }
    print("\n".join(lines))
    print(
        f"\neval loss after {args.steps} steps: {evals['bias']:.3f} with the bias, {evals['none']:.3f} without"
    )


if __name__ == "__main__":
    main()
