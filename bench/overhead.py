"""Strata's single-process step time against a plain hand-written PyTorch loop, side by side.

Both sides train the same GPT (strata.model.build_model, same seed) on the same batches with the
same AdamW (hyperparameters, fused setting and weight-decay param groups), the same warmup+cosine
learning rate, the same gradient accumulation and the same gradient clipping:

* strata: a real `strata.trainer.loop.Trainer` built from `strata.config.load(None, overrides,
  world_size=1)` and `parallel.runtime.start()`; each step is one `trainer.train_step()` call,
  which includes reading its micro-batches from the token memmap (that is Strata's cost to carry).
* plain: a hand-written loop. It reads the same samples from the same train.bin with np.memmap
  slicing (the same seeded permutation, computed inline), so data reading is on both sides and the
  ratio is the framework's overhead, not the cost of loading data. `--plain-data prebuilt` builds the
  peer's micro-batches before timing instead, which charges all of Strata's data reading to Strata.

The steps are interleaved to cancel machine noise: after warmup, each of `--rounds` rounds runs
`--steps-per-round` steps of one side and then of the other, alternating which goes first. Each
step is timed alone (wall clock; process CPU time is printed as a second opinion). The headline
ratio is median(strata step times) / median(plain step times): the interleaving makes both sides
sample the same load from other processes, and the medians drop the bursts. Its spread is that of
the per-round ratios, median(strata steps of the round) / median(plain steps of the round)
(median, interquartile range, min, max). Both sides run the same number of steps, so their loss trajectories must agree
step for step: the largest difference is printed as a check that the comparison is fair.

A run with `--aa` puts a second plain loop in Strata's place: its ratio is the noise floor of the
measurement on this machine (an A/A test), to read the real ratio against.

    python bench/overhead.py                   # defaults: well under a minute on 2 idle CPU cores
    python bench/overhead.py --check           # exit 1 if the ratio exceeds the goal (1.05)
    python bench/overhead.py --aa              # plain vs plain: the noise floor
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from strata import config as config_mod
from strata.data.prepare import prepare, stdlib_corpus_files
from strata.data.tokens import read_meta
from strata.model import build_model
from strata.parallel import runtime as runtime_mod
from strata.trainer.loop import Trainer

GOAL = 1.05


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument(
        "--warmup", type=int, default=5, help="untimed steps of each side before the rounds"
    )
    p.add_argument(
        "--check-steps",
        type=int,
        default=5,
        help="leading steps whose losses are printed side by side (all steps are compared)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for both sides")
    p.add_argument(
        "--plain-data",
        choices=("memmap", "prebuilt"),
        default="memmap",
        help="memmap: the peer slices train.bin each step like Strata; prebuilt: its "
        "micro-batches are built before timing",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="a prepared token directory (default: prepare stdlib sources into a temp dir)",
    )
    p.add_argument(
        "--aa",
        action="store_true",
        help="A/A run: a second plain loop, built where the Trainer would be, takes Strata's place; "
        "the ratio then shows the measurement's noise floor",
    )
    p.add_argument(
        "--json", type=Path, default=None, help="also write the raw per-step times and losses here"
    )
    p.add_argument("--check", action="store_true", help=f"exit 1 if the ratio exceeds {GOAL}")
    return p.parse_args(argv)


def prepare_data(tmp: Path) -> Path:
    """A few MB of byte tokens: the first 300 of the standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp / "data"
    prepare(stdlib_corpus_files()[:300], out, val_fraction=0.05, root=root)
    return out


def strata_config(args, data_dir: Path, total_steps: int, run_root: Path) -> config_mod.Config:
    overrides = {
        "data.path": str(data_dir),
        "log.dir": str(run_root),
        "log.progress": "false",
        "log.name": "overhead",
        "model.d_model": args.d_model,
        "model.n_layers": args.layers,
        "model.n_heads": args.heads,
        "model.seq_len": args.seq_len,
        "train.micro_batch_size": args.micro_batch,
        "train.global_batch_size": args.micro_batch * args.accum,
        "train.steps": total_steps,
        "train.precision": args.precision,
        "train.threads": args.threads,
        "train.eval_interval": 0,
        "checkpoint.save_final": "false",
    }
    return config_mod.load(None, [f"{k}={v}" for k, v in overrides.items()], world_size=1)


class PlainLoop:
    """The peer: what one would write by hand around the same module, optimizer and data."""

    def __init__(
        self, cfg: config_mod.Config, data_dir: Path, device: torch.device, prebuilt_steps: int = 0
    ):
        m, o, t = cfg.model, cfg.optim, cfg.train
        self.device, self.seq_len, self.seed = device, m.seq_len, t.seed
        self.micro, self.accum = t.micro_batch_size, t.global_batch_size // t.micro_batch_size
        self.total_steps, self.step, self.consumed = t.steps, 0, 0
        self.lr, self.min_lr, self.warmup = o.lr, o.lr * o.min_lr_ratio, o.warmup_steps
        assert o.schedule == "cosine", "the peer computes the cosine schedule inline"
        self.clip = o.grad_clip if o.grad_clip > 0 else float("inf")
        self.bf16 = t.precision == "bf16"

        meta = read_meta(data_dir)
        self.tokens = np.memmap(data_dir / "train.bin", dtype=np.dtype(meta.dtype), mode="r")
        self.n_samples = (len(self.tokens) - 1) // self.seq_len
        self.perm_epoch, self.perm = -1, None

        self.model = build_model(m, meta.vocab_size, t.seed).to(device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        kernel = {"fused": True} if o.impl in ("fused", "auto") else {"foreach": True}
        self.optimizer = torch.optim.AdamW(
            groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kernel
        )
        self.params = params
        self.prebuilt = [self.read_step() for _ in range(prebuilt_steps)]

    def read_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next optimizer step's micro-batches, sliced from the memmap."""
        rows = []
        for pos in range(self.consumed, self.consumed + self.micro * self.accum):
            epoch, offset = divmod(pos, self.n_samples)
            if epoch != self.perm_epoch:
                self.perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_samples)
                self.perm_epoch = epoch
            start = int(self.perm[offset]) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1])
        self.consumed += self.micro * self.accum
        block = torch.from_numpy(np.stack(rows).astype(np.int64))
        return [(mb[:, :-1], mb[:, 1:]) for mb in block.split(self.micro)]

    def train_step(self) -> float:
        if self.step < self.warmup:
            lr = self.lr * (self.step + 1) / self.warmup
        else:
            progress = min(1.0, (self.step - self.warmup) / max(1, self.total_steps - self.warmup))
            lr = self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        micro_batches = self.prebuilt[self.step] if self.prebuilt else self.read_step()
        loss_sum = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            x, y = x.to(self.device), y.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / self.accum
            loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum.item()


def timed(fn, device: torch.device) -> tuple[float, float, float]:
    """(wall seconds, process CPU seconds, loss) of one step; synchronises an accelerator before
    reading the clocks."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    sync()
    t1, c1 = time.perf_counter(), time.process_time()
    loss = out[0] if isinstance(out, tuple) else out
    return t1 - t0, c1 - c0, float(loss)


def main(argv=None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    k = args.steps_per_round
    n_steps = args.check_steps + args.warmup + args.rounds * k
    # The learning-rate schedule is that of a run much longer than the benchmark (as in real use).
    total_steps = max(10 * n_steps, 1000)

    with tempfile.TemporaryDirectory(prefix="strata-overhead-") as tmp:
        tmp = Path(tmp)
        data_dir = args.data or prepare_data(tmp)
        cfg = strata_config(args, data_dir, total_steps, tmp / "runs")
        rt = runtime_mod.start(cfg.parallel.backend, cfg.parallel.timeout_s)
        device = rt.device
        # The Trainer is built first, then the peer (an --aa run puts a second peer in its place).
        trainer = PlainLoop(cfg, data_dir, device) if args.aa else Trainer(cfg, rt)
        plain = PlainLoop(cfg, data_dir, device, n_steps if args.plain_data == "prebuilt" else 0)
        torch.set_num_threads(
            args.threads
        )  # both sides see the same setting (Trainer also sets it)

        n_params = sum(p.numel() for p in trainer.model.params)
        print(
            f"bench/overhead: {n_params / 1e6:.2f}M params (d_model {args.d_model}, {args.layers} layers, "
            f"seq {args.seq_len}), micro-batch {args.micro_batch} x accum {args.accum}, {args.precision}, "
            f"device {device}, threads {torch.get_num_threads()}, torch {torch.__version__}, "
            f"AdamW {'fused' if cfg.optim.impl != 'foreach' else 'foreach'}, peer data: {args.plain_data}"
        )
        if args.aa:
            print(
                "  A/A run: the 'strata' side is a second plain loop; the ratio is the noise floor"
            )
        print(
            f"  {args.check_steps} check + {args.warmup} warmup steps, then {args.rounds} rounds x {k} steps "
            f"of each side, alternating which goes first"
        )

        sides = {"plain": plain.train_step, "strata": trainer.train_step}
        losses: dict[str, list[float]] = {"plain": [], "strata": []}
        cpu_times: dict[str, list[float]] = {"plain": [], "strata": []}

        def run(side: str, steps: int) -> list[float]:
            times = []
            for _ in range(steps):
                dt, cpu, loss = timed(sides[side], device)
                times.append(dt)
                cpu_times[side].append(cpu)
                losses[side].append(loss)
            return times

        for side in ("plain", "strata"):  # check steps, then warmup (untimed)
            run(side, args.check_steps + args.warmup)
            cpu_times[side].clear()

        step_times: dict[str, list[float]] = {"plain": [], "strata": []}
        round_ratios = []
        for r in range(args.rounds):
            order = ("plain", "strata") if r % 2 == 0 else ("strata", "plain")
            this_round = {side: run(side, k) for side in order}
            for side, ts in this_round.items():
                step_times[side] += ts
            round_ratios.append(
                statistics.median(this_round["strata"]) / statistics.median(this_round["plain"])
            )

    print("\nloss check (same model, data, optimizer and schedule on both sides):")
    for i in range(min(args.check_steps, len(losses["plain"]))):
        print(f"  step {i + 1}: plain {losses['plain'][i]:.6f}  strata {losses['strata'][i]:.6f}")
    diffs = [abs(a - b) for a, b in zip(losses["plain"], losses["strata"])]
    print(
        f"  max |loss difference| over all {len(diffs)} steps: {max(diffs):.3g}"
        + ("  (bit-identical)" if max(diffs) == 0 else "")
    )
    if max(diffs) > 1e-6:
        print("  WARNING: the two loops diverge; the comparison is not like for like")

    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {name: str(value) for name, value in vars(args).items()},
                    "wall_s": step_times,
                    "cpu_s": cpu_times,
                    "round_ratios": round_ratios,
                    "losses": losses,
                }
            )
        )
    med = {side: statistics.median(ts) for side, ts in step_times.items()}
    ratio = med["strata"] / med["plain"]
    print(f"\nstep time, median of {len(step_times['plain'])} steps each:")
    for side in ("plain", "strata"):
        ts = step_times[side]
        print(
            f"  {side:6s} {med[side] * 1e3:8.2f} ms   (min {min(ts) * 1e3:.2f}, max {max(ts) * 1e3:.2f})"
        )
    print(f"  ratio of medians strata/plain: {ratio:.3f}")
    cpu_med = {side: statistics.median(ts) for side, ts in cpu_times.items()}
    print(
        f"  process CPU time per step, median: plain {cpu_med['plain'] * 1e3:.2f} ms, strata "
        f"{cpu_med['strata'] * 1e3:.2f} ms, ratio {cpu_med['strata'] / cpu_med['plain']:.3f}"
    )
    q1, q2, q3 = (
        statistics.quantiles(round_ratios, n=4, method="inclusive")
        if len(round_ratios) > 1
        else round_ratios * 3
    )
    print(
        f"  per-round ratio over {args.rounds} rounds: median {q2:.3f}, interquartile {q1:.3f}-{q3:.3f}, "
        f"min {min(round_ratios):.3f}, max {max(round_ratios):.3f}"
    )
    print(
        f"  load average (1 min) at start {load_start:.2f}, at end {os.getloadavg()[0]:.2f} on "
        f"{os.cpu_count()} CPUs: other processes inflate absolute times, the interleaved ratio less so"
    )
    print(f"\noverhead ratio strata/plain = {ratio:.3f} (goal <= {GOAL})")
    if args.check and ratio > GOAL:
        print(f"FAIL: ratio {ratio:.3f} exceeds the goal {GOAL}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
