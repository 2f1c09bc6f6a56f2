"""Regional compilation (`train.compile`) against eager: tokens/s, compile time and, on a GPU, MFU
against the bf16 matmul peak measured in the same run.

Each variant is a real `Trainer` (`strata.trainer.loop`) in a fresh process (so no compiled code
is shared between them), on the same data, seed and batches; `--variants` picks which of
eager / compiled, with full or selective recomputation (`--recompute`). A step is one
`train_step()` (forward and backward of every micro-batch, clipping, AdamW), timed alone, the device
synchronised around it. The first `--warmup` steps are left out (the compiled variant compiles
in its first step: that step's excess over the median is its compile time); the figure is the
median of the rest. Both variants train the same steps, so their losses must agree (the largest
relative difference is printed: compiled kernels sum in another order, nothing more).

On a GPU the bench first measures the bf16 matmul peak (8192³ products, the mean of the fastest
half of 20) and passes it as `log.peak_tflops`, so MFU is model FLOPs per second (Megatron's
counting, `strata.model.flops_per_token`, no recomputation) over the peak this card reaches.

    python bench/compile.py                                  # CPU: 2 variants, a few minutes on 2 cores
    python bench/compile.py --preset tiny --steps 40 --warmup 5   # the CPU demo's model
    python bench/compile.py --preset 1b --device cuda        # one GPU: TinyLlama-shaped 1.1B, bf16
    python bench/compile.py --variants eager,compiled,compiled-selective   # with selective recompute
    python bench/compile.py --preset 1b --variants compiled,compiled-fp8,compiled-fp8-rowwise   # FP8 training
    python bench/compile.py --preset 1b --set model.n_layers=4 --set model.seq_len=1024   # a smaller shape

bench/gpu.py runs the GPU rows of this bench (and the rest of the GPU figures) as one command.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GOAL_CPU = 1.2  # compiled tokens/s over eager on CPU
GOAL_MFU = 0.45  # of the measured bf16 matmul peak, ~1B model on one GPU

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for 2 CPU cores, wide enough that the element-wise work between the matmuls
    # (norms, RoPE, SwiGLU, residual adds) is a real share of the step, as in any transformer.
    "cpu": {
        "model.n_layers": 4,
        "model.d_model": 256,
        "model.n_heads": 4,
        "model.seq_len": 256,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 8,
        "train.precision": "fp32",
    },
    # configs/tiny.yaml's model and batch (the CPU demo): small enough that eager's per-op overhead
    # is a real share of the step, as in any small model
    "tiny": {
        "model.n_layers": 4,
        "model.d_model": 128,
        "model.n_heads": 4,
        "model.seq_len": 128,
        "train.global_batch_size": 16,
        "train.micro_batch_size": 8,
        "train.precision": "fp32",
    },
    # configs/llama-1b.yaml's model (TinyLlama's shape) on one GPU, bf16 autocast.
    "1b": {
        "model.n_layers": 22,
        "model.d_model": 2048,
        "model.n_heads": 32,
        "model.n_kv_heads": 4,
        "model.ffn_hidden": 5632,
        "model.seq_len": 2048,
        "model.vocab_size": 32000,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 8,
        "train.precision": "bf16",
    },
}
VARIANTS = {
    "eager": {},
    "compiled": {"train.compile": True},
    "eager-selective": {"activations.recompute": "selective"},
    "compiled-selective": {"train.compile": True, "activations.recompute": "selective"},
    "eager-full": {"activations.recompute": "full"},
    "compiled-full": {"train.compile": True, "activations.recompute": "full"},
    # FP8 training (torchao float8 linears, bf16 autocast elsewhere; needs train.compile on a GPU). A
    # variant's values come after the preset's in `overrides`, so its train.precision wins.
    "compiled-fp8": {
        "train.compile": True,
        "train.precision": "fp8",
        "train.fp8_recipe": "tensorwise",
    },
    "compiled-fp8-rowwise": {
        "train.compile": True,
        "train.precision": "fp8",
        "train.fp8_recipe": "rowwise",
    },
}


def overrides(
    preset: str,
    variant: str,
    steps: int,
    data: Path,
    peak: float | None,
    device: str,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The config overrides of one variant: the preset's values, then the variant's (which win), then
    the run's own; `extra` (key=value, from `--set`) last of all."""
    values = {
        **PRESETS[preset],
        **VARIANTS[variant],
        "train.steps": steps,
        "train.eval_interval": 0,
        "optim.warmup_steps": 0,
        "optim.lr": 3e-4,
        "checkpoint.save_final": False,
        "checkpoint.interval": 0,
        "log.progress": False,
        "data.path": str(data),
        "parallel.backend": "gloo" if device == "cpu" else "auto",
    }
    if peak:
        values["log.peak_tflops"] = peak
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key=value")
        values[key] = value
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def worker(args: argparse.Namespace) -> None:
    """One variant: build the trainer, time each step, print one JSON line."""
    import torch

    from strata import config as config_mod
    from strata.model import flops_per_token
    from strata.parallel import runtime as runtime_mod
    from strata.trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        ov = overrides(
            args.preset, args.variant, args.steps, Path(args.data), args.peak, args.device, args.set
        )
        ov.append(f"log.dir={tmp}")
        cfg = config_mod.load(None, ov, world_size=1)
        rt = runtime_mod.start(cfg.parallel.backend, cfg.parallel.timeout_s)
        start = time.perf_counter()
        trainer = Trainer(cfg, rt)
        build_s = time.perf_counter() - start
        cuda = rt.device.type == "cuda"
        times, losses = [], []
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, _ = trainer.train_step()
            losses.append(float(loss))  # a host sync
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        timed = times[args.warmup :]
        step_s = statistics.median(timed)
        tokens = cfg.train.global_batch_size * cfg.model.seq_len
        flops = flops_per_token(cfg.model, trainer.model.vocab_size) * tokens / step_s
        peak_mem = torch.cuda.max_memory_allocated() if cuda else 0
        print(
            "RESULT "
            + json.dumps(
                {
                    "variant": args.variant,
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "step_s": step_s,
                    "first_step_s": times[0],
                    "step_times_s": times,
                    "tokens_per_s": tokens / step_s,
                    "model_tflops": flops / 1e12,
                    "losses": losses,
                    "build_s": build_s,
                    "peak_mem_gib": peak_mem / 2**30,
                }
            ),
            flush=True,
        )
        trainer.checkpoints.close()
        trainer.model.close()


def matmul_peak_tflops() -> float:
    """bf16 8192³ matmul rate on this GPU: the mean of the fastest half of 20 timed products."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    fast = sorted(times)[: len(times) // 2]
    return 2 * n**3 / statistics.fmean(fast) / 1e12


def run_variant(args: argparse.Namespace, variant: str, data: Path, peak: float | None) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--preset", args.preset]
    cmd += [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--data",
        str(data),
        "--device",
        args.device,
    ]
    if peak:
        cmd += ["--peak", str(peak)]
    for item in args.set:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(
            f"variant {variant} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="cpu (default on CPU), tiny or 1b"
    )
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available"
    )
    ap.add_argument("--variants", default="eager,compiled")
    ap.add_argument(
        "--steps", type=int, default=None, help="steps per variant (default 12 CPU, 14 GPU)"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="steps left out (default 2 CPU, 4 GPU)"
    )
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override on top of the preset and variant, e.g. --set model.n_layers=4 (repeatable)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    from strata.data.prepare import ensure_default_corpus

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    args.preset = args.preset or ("1b" if gpu else "cpu")
    args.steps = args.steps or (14 if gpu else 12)
    args.warmup = args.warmup if args.warmup is not None else (4 if gpu else 2)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    data = ensure_default_corpus(None, 0.05)
    peak = matmul_peak_tflops() if gpu else None
    results = {v: run_variant(args, v, data, peak) for v in variants}

    base = results[variants[0]]
    print(
        f"\n{args.preset} on {base['device']}, {args.steps} steps, median of steps {args.warmup + 1}..{args.steps}"
    )
    if peak:
        print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s")
    print(
        "| variant | step s | tokens/s | vs first | first step s (compile) | model TFLOP/s | MFU | peak GiB "
        "| max loss rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for v, r in results.items():
        compile_s = r["first_step_s"] - r["step_s"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
        mfu = f"{r['model_tflops'] / peak:.1%}" if peak else "—"
        print(
            f"| {v} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x "
            f"| {r['first_step_s']:.1f} ({compile_s:+.1f}) | {r['model_tflops']:.1f} | {mfu} "
            f"| {r['peak_mem_gib']:.1f} | {diff:.1e} |"
        )
    if "compiled" in results and "eager" in results:
        ratio = results["compiled"]["tokens_per_s"] / results["eager"]["tokens_per_s"]
        if gpu:
            mfu = results["compiled"]["model_tflops"] / peak
            print(f"compiled MFU {mfu:.1%} (goal >= {GOAL_MFU:.0%}); compiled/eager {ratio:.2f}x")
        else:
            print(f"compiled/eager tokens/s {ratio:.2f}x (goal >= {GOAL_CPU}x)")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"preset": args.preset, "peak_tflops": peak, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
