"""Time and peak memory from a Hugging Face model directory to a trainable model: Strata's
`model.init_from` against transformers' `AutoModelForCausalLM.from_pretrained`, same run (CPU).

A random Llama of ~500M parameters (hidden 1536, 16 layers, 12 heads, 4 kv heads, ffn 4096, vocab
32000, untied) is saved once with `save_pretrained` under `--work` (bf16 by default: how models are
published; reruns reuse it). Each variant then runs in a fresh process of its own, the model files
already in the page cache (an untimed read first), and reports its time from process start (the
interpreter's own start-up included) to fp32 trainable parameters, and its peak RSS (VmHWM):

* strata: load the config (`model.init_from=DIR`, the model block derived from config.json), build
  `strata.trainer.loop.Trainer` (the parallel model, its flat parameter groups and its AdamW) and
  call `init_weights()`, which reads the safetensors boxes into it: what `strata train` does before
  its first step, without the step itself;
* strata tp2: the same in a world of 2 ranks (torchrun, `parallel.tp=2`): per-rank peak RSS and
  the slowest rank's time, and the launcher's wall time (torchrun's start-up included);
* transformers: `AutoModelForCausalLM.from_pretrained(DIR, torch_dtype=torch.float32)`, then
  `model.train()` and a `torch.optim.AdamW` over its parameters.

Both sides build an optimizer and neither has optimizer state yet (torch's AdamW allocates it at
the first step; Strata's gradient buffers also come at the first backward). Printed: each figure
and the ratios strata/transformers of time and of peak RSS (goals: time ≤ 0.5, RSS ≤ 0.6).

    python bench/hf_load.py --rounds 3               # ~75 s on 2 cores, after a one-time ~20 s build
    python bench/hf_load.py --rounds 1 --no-tp2      # a quicker look
"""

from __future__ import annotations

import time

T0 = time.time()  # the worker's process start, as near as Python lets us see it

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GiB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/strata-bench-hf-load"),
        help="model and runs (cached)",
    )
    p.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16", help="the saved weights' dtype"
    )
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument(
        "--rounds", type=int, default=2, help="runs of each variant, interleaved (medians reported)"
    )
    p.add_argument("--no-tp2", action="store_true", help="skip the 2-rank tp2 variant")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    p.add_argument(
        "--worker", choices=("strata", "hf", "build"), default=None, help=argparse.SUPPRESS
    )
    p.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- measuring inside a worker -------------------------------------------------------------------


def memory() -> dict[str, float]:
    """This process's peak and current RSS and the current RSS's file-backed part (mmapped model
    files count towards RSS), in GiB; its CPU time (all threads, user + system) and page faults."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    fields: dict[str, float] = {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "minor_faults": usage.ru_minflt,
    }
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssFile", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024 / GiB
    return fields


def report(figures: dict) -> None:
    print("RESULT " + json.dumps(figures), flush=True)


def strata_worker(args: argparse.Namespace) -> None:
    """Config → Trainer (parallel model, flat groups, optimizer) → init_weights, timed by phase."""
    import torch

    from strata import config
    from strata.parallel import runtime
    from strata.trainer.loop import Trainer

    t_import = time.time()
    rt = runtime.start("gloo", 600)
    overrides = [
        f"model.init_from={args.model}",
        "model.seq_len=128",
        f"parallel.tp={args.tp}",
        "train.micro_batch_size=1",
        f"train.global_batch_size={rt.world_size // args.tp}",
        "train.steps=1",
        "log.progress=false",
        f"log.dir={args.work / 'runs'}",
        f"checkpoint.dir={args.work / 'ckpt'}",
        "checkpoint.save_final=false",
    ]
    cfg = config.load(None, overrides, rt.world_size)
    trainer = Trainer(cfg, rt)
    t_built = time.time()
    trainer.init_weights()
    t_loaded = time.time()
    params = trainer.model.params
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    local = sum(p.numel() for p in params)
    report(
        {
            "rank": rt.rank,
            "import_s": t_import - T0,
            "build_s": t_built - t_import,
            "load_s": t_loaded - t_built,
            "total_s": t_loaded - T0,
            "local_params": local,
            "threads": torch.get_num_threads(),
            **memory(),
        }
    )
    runtime.stop()


def hf_worker(args: argparse.Namespace) -> None:
    """from_pretrained to fp32, train mode, an AdamW over the parameters, timed by phase."""
    import torch
    import transformers

    t_import = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.optim.AdamW(params, lr=1e-4, fused=True)
    t_loaded = time.time()
    assert all(p.dtype == torch.float32 for p in params)
    report(
        {
            "rank": 0,
            "import_s": t_import - T0,
            "build_s": 0.0,
            "load_s": t_loaded - t_import,
            "total_s": t_loaded - T0,
            "local_params": sum(p.numel() for p in params),
            "threads": torch.get_num_threads(),
            **memory(),
        }
    )


def build_worker(args: argparse.Namespace) -> None:
    """The random Llama, saved with save_pretrained in `args.dtype`."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    )
    model = transformers.LlamaForCausalLM(cfg).to(
        torch.bfloat16 if args.dtype == "bf16" else torch.float32
    )
    tmp = args.model.with_name(args.model.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(args.model)


# --- the driver -----------------------------------------------------------------------------------


def model_dir(args: argparse.Namespace) -> Path:
    tag = f"llama-h{args.hidden}-l{args.layers}-a{args.heads}-kv{args.kv_heads}-f{args.ffn}-v{args.vocab}-{args.dtype}"
    return args.work / tag


def worker_cmd(args: argparse.Namespace, kind: str, model: Path) -> list[str]:
    return [__file__, "--worker", kind, "--model", str(model), "--work", str(args.work)]


def results(out: str) -> list[dict]:
    """Every rank's `RESULT {json}` in the output (two ranks' lines can interleave on one line)."""
    decoder, found, pos = json.JSONDecoder(), [], 0
    while (pos := out.find("RESULT {", pos)) >= 0:
        figures, end = decoder.raw_decode(out, pos + len("RESULT "))
        found.append(figures)
        pos = end
    return found


def run_variant(args: argparse.Namespace, name: str, model: Path) -> dict:
    """One fresh process (or torchrun world) of variant `name`; its figures and the wall time."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if name == "strata tp2":
        from strata.launch.torchrun import LaunchPlan, torchrun_args

        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(LaunchPlan(2))]
        cmd += [*worker_cmd(args, "strata", model), "--tp", "2"]
        env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores
    else:
        cmd = [sys.executable, *worker_cmd(args, "strata" if name == "strata" else "hf", model)]
    load = os.getloadavg()[0]
    t = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.time() - t
    ranks = results(proc.stdout)
    if proc.returncode or not ranks:
        sys.exit(
            f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    ranks.sort(key=lambda r: r["rank"])
    return {
        "wall_s": wall,
        "total_s": max(r["total_s"] for r in ranks),
        "after_import_s": max(r["total_s"] - r["import_s"] for r in ranks),
        "peak_gib": max(r["VmHWM"] for r in ranks),
        "cpu_s": sum(r["cpu_s"] for r in ranks),
        "load_avg_1m": load,
        "ranks": ranks,
    }


def warm_page_cache(model: Path) -> None:
    """Read the model's files once, so every variant finds them in the page cache."""
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def launch(args: argparse.Namespace) -> int:
    from strata.config import DataConfig
    from strata.data.prepare import ensure_default_corpus

    args.work.mkdir(parents=True, exist_ok=True)
    model = model_dir(args)
    if not (model / "config.json").is_file():
        print(f"building {model.name} (once) ...", flush=True)
        t = time.time()
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--worker",
                "build",
                "--model",
                str(model),
                *build_flags(args),
            ],
            check=True,
        )
        print(f"  built in {time.time() - t:.1f} s", flush=True)
    ensure_default_corpus(
        DataConfig().cache_dir, DataConfig().val_fraction
    )  # once, before any variant
    warm_page_cache(model)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors")) / GiB
    print(f"model: {model} ({size:.2f} GiB of safetensors, {args.dtype}); {os.cpu_count()} cores")

    names = ["strata", "transformers"] + ([] if args.no_tp2 else ["strata tp2"])
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for i in range(args.rounds):
        order = names if i % 2 == 0 else [names[1], names[0], *names[2:]]
        for name in order:
            r = run_variant(args, name, model)
            runs[name].append(r)
            per_rank = ", ".join(
                f"rank {x['rank']}: {x['total_s']:.2f} s (import {x['import_s']:.2f}, build {x['build_s']:.2f}, "
                f"load {x['load_s']:.2f}), cpu {x['cpu_s']:.2f} s, {x['minor_faults'] / 1e6:.2f}M faults, "
                f"peak {x['VmHWM']:.2f} GiB (file-backed now {x['RssFile']:.2f})"
                for x in r["ranks"]
            )
            print(
                f"round {i + 1} {name:13s} wall {r['wall_s']:6.2f} s, load avg {r['load_avg_1m']:.2f} | {per_rank}"
            )

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    hf_t, hf_m, hf_c = (
        med("transformers", "total_s"),
        med("transformers", "peak_gib"),
        med("transformers", "cpu_s"),
    )
    summary: dict = {
        "model": str(model),
        "dtype": args.dtype,
        "params": runs["transformers"][0]["ranks"][0]["local_params"],
        "rounds": args.rounds,
        "load_avg": os.getloadavg(),
    }
    print(
        f"\nmedians over {args.rounds} round(s); time from process start to a trainable fp32 model"
    )
    print(
        f"{'':14s} {'time s':>7s} {'peak RSS GiB':>12s} {'CPU s':>6s} "
        f"{'time ratio':>10s} {'RSS ratio':>9s} {'CPU ratio':>9s}"
    )
    for name in names:
        t, m, c = med(name, "total_s"), med(name, "peak_gib"), med(name, "cpu_s")
        summary[name] = {
            "time_s": t,
            "peak_gib": m,
            "cpu_s": c,
            "wall_s": med(name, "wall_s"),
            "runs": runs[name],
        }
        if name == "transformers":
            print(f"{name:14s} {t:7.2f} {m:12.2f} {c:6.2f}")
        else:
            summary[name].update(time_ratio=t / hf_t, rss_ratio=m / hf_m, cpu_ratio=c / hf_c)
            print(
                f"{name:14s} {t:7.2f} {m:12.2f} {c:6.2f} {t / hf_t:10.3f} {m / hf_m:9.3f} {c / hf_c:9.3f}"
            )
    if "strata tp2" in runs:
        print(
            f"(strata tp2: time is the slowest rank's, RSS the larger rank's, CPU both ranks'; launcher wall time "
            f"{med('strata tp2', 'wall_s'):.2f} s against transformers' process wall time "
            f"{med('transformers', 'wall_s'):.2f} s)"
        )
    hf_a = med("transformers", "after_import_s")
    print(
        "\nafter imports (torch and each side's own library imported: building the model, reading the "
        "weights, the optimizer)"
    )
    for name in names:
        a = med(name, "after_import_s")
        summary[name]["after_import_s"] = a
        ratio = "" if name == "transformers" else f"  ratio {a / hf_a:.3f}"
        if name != "transformers":
            summary[name]["after_import_ratio"] = a / hf_a
        print(f"{name:14s} {a:7.2f} s{ratio}")
    print(f"goals: time ratio ≤ 0.5, RSS ratio ≤ 0.6; load average now {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


def build_flags(args: argparse.Namespace) -> list[str]:
    return [
        f"--dtype={args.dtype}",
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
        f"--heads={args.heads}",
        f"--kv-heads={args.kv_heads}",
        f"--ffn={args.ffn}",
        f"--vocab={args.vocab}",
    ]


def main() -> int:
    args = parse_args()
    if args.worker == "strata":
        strata_worker(args)
    elif args.worker == "hf":
        hf_worker(args)
    elif args.worker == "build":
        build_worker(args)
    else:
        return launch(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
