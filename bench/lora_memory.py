"""LoRA's memory per rank against full fine-tuning of the same model and layout, measured in real
gloo worlds and beside what `strata plan`'s memory model (`strata.plan.memory.estimate_memory`)
predicts for each.

    python bench/lora_memory.py                 # 4 layouts, a world each, ~1 min on 2 cores
    python bench/lora_memory.py --tiny          # a smoke run: a tiny model, seconds

The model is a Llama shape (d_model 384, 6 layers, 6 heads with 2 key/value heads, SwiGLU 1024,
untied, vocab 256: the probe's random tokens), sequences of 256 tokens, micro-batch 2 per rank,
fp32.
LoRA is `model.lora` rank 16, alpha 32, on all-linear (every attention and feed-forward projection,
as PEFT's "all-linear"). Layouts:

- 1 process: plain training (nothing partitioned);
- ZeRO-3 dp2: parameters, gradients and optimizer state partitioned over 2 ranks (`zero.params`,
  `zero.grads`, `zero.optim` shard_over global, prefetch 1 block).

Each layout runs in a fresh world (tests/worlds.py) whose ranks train 2 steps with the real
trainer's parallel model and report what they hold, measured from their tensors by
tests/memory_probe.py's `measure` (the probe of bench/plan_memory.py): parameters, gradients and
optimizer state (the ZeRO engine's held storage after each step), activations saved for backward
(the peak over the step), gathered ZeRO-3 groups (the peak). Also each rank's peak RSS (VmHWM)
above its RSS before the model was built (after imports and the process group): the whole
process's working set, transients included. Figures are the largest over a world's ranks.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

KINDS = ("params", "grads", "optim", "activations", "gathered")
LORA = {"rank": 16, "alpha": 32, "target_modules": ["all-linear"]}
ZERO3 = {
    "params": {"shard_over": "global"},
    "grads": {"shard_over": "global"},
    "optim": {"shard_over": "global"},
    "prefetch_blocks": 1,
}


def base(tiny: bool) -> dict[str, Any]:
    model = (
        {"n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 64, "ffn_hidden": 128}
        if tiny
        else {"n_layers": 6, "d_model": 384, "n_heads": 6, "seq_len": 256, "ffn_hidden": 1024}
    )
    return {
        "model": {**model, "n_kv_heads": 2, "vocab_size": 256},
        "train": {"micro_batch_size": 2, "steps": 2, "precision": "fp32"},
        "optim": {"warmup_steps": 1},
        "log": {"progress": False},
    }


def layouts(tiny: bool) -> dict[str, tuple[int, dict[str, Any]]]:
    """name -> (world size, the config as a nested dict)."""
    out = {}
    for world in (1, 2):
        for lora in (False, True):
            raw = copy.deepcopy(base(tiny))
            raw["train"]["global_batch_size"] = 2 * world
            raw["parallel"] = {"ranks_per_node": world}
            if world > 1:
                raw["zero"] = ZERO3
            if lora:
                raw["model"]["lora"] = LORA
            kind = "LoRA r16" if lora else "full FT"
            name = f"{kind}, {'1 process' if world == 1 else 'ZeRO-3 dp2'}"
            out[name] = (world, raw)
    return out


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def worker(rank: int, size: int, port: int, out_dir: str, raw: dict) -> None:
    """One rank: build the layout's parallel model, train 2 steps, save what it held."""
    import torch
    import torch.distributed as dist

    from strata import config
    from strata.parallel.topology import build_topology, layout_from_config

    from memory_probe import measure
    from worlds import join_world

    join_world(rank, size, port, timeout_s=120)
    try:
        before = _vm("VmRSS")
        cfg = config.from_dict(raw, world_size=size)
        topo = build_topology(layout_from_config(cfg.parallel, size, size), rank)
        result = measure(cfg, topo, size)
        result["rss_peak_above_start"] = _vm("VmHWM") - before
        torch.save(result, Path(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def predicted(raw: dict, world: int) -> dict[str, int]:
    from strata import config

    from memory_probe import predicted as estimate

    cfg = config.from_dict(raw, world_size=world)
    est = estimate(cfg, world).stage(0)
    return {k: int(sum(v for (kind, _), v in est.bytes.items() if kind == k)) for k in KINDS}


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a smoke run: a tiny model")
    args = p.parse_args(argv)

    from worlds import run_world

    rows = {}
    with tempfile.TemporaryDirectory(prefix="strata-lora-memory-") as tmp:
        for i, (name, (world, raw)) in enumerate(layouts(args.tiny).items()):
            out = Path(tmp) / str(i)
            out.mkdir()
            ranks = run_world(worker, world, out, raw, timeout_s=600)
            measured = {
                k: max(sum(v for key, v in r["measured"].items() if key.split("/")[0] == k)
                       for r in ranks)
                for k in KINDS
            }  # fmt: skip
            rss = max(r["rss_peak_above_start"] for r in ranks)
            rows[name] = (measured, predicted(raw, world), rss)
    m = base(args.tiny)["model"]
    print(
        f"bench/lora_memory: d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads "
        f"({m['n_kv_heads']} kv), SwiGLU {m['ffn_hidden']}, vocab 256, seq {m['seq_len']}, "
        "micro-batch 2 per rank, fp32; LoRA rank 16 alpha 32 on all-linear"
    )
    print("MiB per rank (the largest rank), measured / predicted by strata plan:")
    print(
        "| layout | params | grads | optim | params+grads+optim | vs full FT | activations "
        "| gathered | peak RSS above start |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    full_state: dict[str, int] = {}
    for name, (meas, pred, rss) in rows.items():
        state = sum(meas[k] for k in ("params", "grads", "optim"))
        pstate = sum(pred[k] for k in ("params", "grads", "optim"))
        layout = name.split(", ")[1]
        full_state.setdefault(layout, state)
        cells = [f"{mib(meas[k])} / {mib(pred[k])}" for k in ("params", "grads", "optim")]
        print(
            f"| {name} | {' | '.join(cells)} | **{mib(state)}** / {mib(pstate)} "
            f"| {state / full_state[layout]:.3f}x | {mib(meas['activations'])} / "
            f"{mib(pred['activations'])} | {mib(meas['gathered'])} / {mib(pred['gathered'])} "
            f"| {mib(rss)} |"
        )
    worst = max(
        abs(pred[k] - meas[k]) / meas[k]
        for meas, pred, _ in rows.values()
        for k in KINDS
        if meas[k]
    )
    print(f"largest |predicted - measured| / measured over the kinds: {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
