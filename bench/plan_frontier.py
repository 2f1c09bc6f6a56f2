"""`strata plan` on Frontier-like nodes (4 MI250X = 8 GCDs, two ranks per GPU): for a 175B model
on 1024 GCDs and a 1T model on 3072 GCDs, every ZeRO placement — where parameters, gradients and
optimizer states are partitioned (GCD pair, node, everything) — with its predicted per-rank memory,
step time and bytes per rank per step on each link level, and the placement the plan picks (the
fastest that fits). Pure arithmetic, a few seconds:

    python bench/plan_frontier.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata import config  # noqa: E402
from strata.plan.cluster import LINKS, preset  # noqa: E402
from strata.plan.memory import estimate_memory  # noqa: E402
from strata.plan.search import ZERO_SCHEMES, with_layout  # noqa: E402
from strata.plan.timing import estimate_time  # noqa: E402

VOCAB = 51200
MODELS = {  # GPT-3 175B and the 1T model of Narayanan et al., with the Frontier runs' tp·pp (Dash et al.)
    "175B": (
        ["model.n_layers=96", "model.d_model=12288", "model.n_heads=96", "model.ffn_hidden=32768"],
        128,
        (4, 16),
    ),
    "1T": (
        [
            "model.n_layers=128",
            "model.d_model=25600",
            "model.n_heads=160",
            "model.ffn_hidden=68272",
        ],
        384,
        (4, 128),
    ),
}
COMMON = [
    "model.seq_len=2048",
    f"model.vocab_size={VOCAB}",
    "train.precision=bf16",
    "train.micro_batch_size=1",
    "activations.recompute=full",
    "train.global_batch_size=3072",
]


def rows(name: str) -> list[str]:
    keys, nodes, paper = MODELS[name]
    cluster = preset("frontier", nodes)
    out = []
    for label, (tp, pp) in {
        "tp1 pp1 (ZeRO only)": (1, 1),
        f"tp{paper[0]} pp{paper[1]}": paper,
    }.items():
        best = None
        for scheme, levels in ZERO_SCHEMES.items():
            changes = {"parallel.tp": tp, "parallel.pp": pp, "parallel.sequence_parallel": tp > 1}
            changes.update(
                {
                    f"zero.{k}.shard_over": v
                    for k, v in zip(("params", "grads", "optim", "secondary_params"), levels)
                }
            )
            cfg = with_layout(config.load(None, [*keys, *COMMON]), cluster, changes)
            problems = config.cross_problems(cfg, cluster.world_size)
            if problems:
                continue
            mem, est = estimate_memory(cfg, cluster, VOCAB), estimate_time(cfg, cluster, VOCAB)
            fits = mem.fits()
            if fits and (best is None or est.step_s < best[1]):
                best = (scheme, est.step_s)
            level_bytes = " | ".join(f"{est.dp_bytes[k] / 2**30:.2f}" for k in LINKS)
            where = "/".join(levels[:3]) + (f" +{levels[3]}" if levels[3] != "none" else "")
            device = f"{mem.peak('device') / 2**30:.1f}" + ("" if fits else " (no fit)")
            figures = f"{device} | {est.step_s:.1f} | {est.mfu:.1%} | {level_bytes}"
            out.append(f"| {name} | {label} | {scheme} | {where} | {figures} |")
        if best:
            out.append(
                f"| {name} | {label} | **plan picks {best[0]}** | | | {best[1]:.1f} | | | | |"
            )
    return out


def main() -> None:
    print(
        "| model | layout | ZeRO | params/grads/optim level | device GiB | step s | MFU | "
        "ZeRO GiB/rank/step intra-gpu | intra-node | inter-node |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in MODELS:
        print("\n".join(rows(name)))


if __name__ == "__main__":
    main()
