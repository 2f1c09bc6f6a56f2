"""Bytes each rank puts on each link level per training step under flat ZeRO-3, hierarchical
ZeRO-3, hpZ and the 3-level scheme, on 8 ranks simulating 2 nodes × 2 GPUs × 2 GCDs
(parallel.ranks_per_node=4, ranks_per_gpu=2).

Each scheme is a real `strata launch` run of the trainer (gloo, CPU) with the `zero:` settings
below; the figures are the trainer's own per-step counters (`wire_bytes_per_step` in
metrics.jsonl: ring-algorithm bytes per rank, attributed to the slowest link a collective's group
spans), averaged over the steps, for 1 and 2 micro-batches per step. N is one fp32 copy of the
model's parameters; the last column is inter-node bytes relative to flat ZeRO-3 in the same run.

    python bench/hierarchical_bytes.py            # about 4 minutes on 2 cores
    python bench/hierarchical_bytes.py --out bytes.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from strata import config as config_mod
from strata.data.prepare import ensure_default_corpus
from strata.data.tokens import read_meta
from strata.model import count_params

REPO = Path(__file__).resolve().parents[1]

G = "global"
SCHEMES = {
    "flat ZeRO-3": {"params": G, "grads": G, "optim": G, "hierarchical": False},
    "ZeRO-3 (hierarchical)": {"params": G, "grads": G, "optim": G},
    "hpZ (flat, secondary node)": {
        "params": G,
        "grads": G,
        "optim": G,
        "secondary_params": "node",
        "hierarchical": False,
    },
    "hpZ (hierarchical)": {"params": G, "grads": G, "optim": G, "secondary_params": "node"},
    "3-level (gpu/node/global)": {"params": "gpu", "grads": "node", "optim": G},
}
LINKS = ("intra-gpu", "intra-node", "inter-node")
MODEL = {"model.n_layers": 4, "model.d_model": 64, "model.n_heads": 4, "model.seq_len": 64}


def overrides(scheme: dict, micro: int, run_root: Path, name: str) -> list[str]:
    zero = {
        f"zero.{k}.shard_over"
        if k in ("params", "grads", "optim", "secondary_params")
        else f"zero.{k}": v
        for k, v in scheme.items()
    }
    settings = {
        **MODEL,
        **zero,
        "train.steps": 3,
        "optim.warmup_steps": 1,
        "train.micro_batch_size": 1,
        "train.global_batch_size": 8 * micro,
        "train.eval_interval": 0,
        "train.eval_batches": 1,
        "checkpoint.save_final": False,
        "log.interval": 1,
        "log.progress": False,
        "log.dir": str(run_root),
        "log.name": name,
        "parallel.ranks_per_node": 4,
        "parallel.ranks_per_gpu": 2,
        "parallel.timeout_s": 120,
    }
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]


def run(scheme: dict, micro: int, run_root: Path, name: str) -> dict[str, float]:
    experiment = run_root / "experiment.yaml"
    experiment.write_text("{}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata.launch.cli",
            "launch",
            str(experiment),
            *overrides(scheme, micro, run_root, name),
            "--nproc",
            "8",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [
        json.loads(line) for line in (run_root / name / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r["wire_bytes_per_step"] for r in records if "wire_bytes_per_step" in r]
    return {link: sum(s.get(link, 0) for s in steps) / len(steps) for link in LINKS}


def model_bytes() -> int:
    cfg = config_mod.load(None, [f"{k}={v}" for k, v in MODEL.items()])
    vocab = read_meta(ensure_default_corpus(cfg.data.cache_dir, cfg.data.val_fraction)).vocab_size
    return 4 * count_params(cfg.model, config_mod.padded_vocab_size(cfg.model, vocab))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = p.parse_args(argv)
    n = model_bytes()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for micro in (1, 2):
            for i, (label, scheme) in enumerate(SCHEMES.items()):
                results[(label, micro)] = run(scheme, micro, Path(tmp), f"s{i}-m{micro}")
    print(
        f"bytes per rank per step, in N = {n / 2**20:.2f} MiB (one fp32 copy of the parameters); "
        f"8 ranks = 2 nodes × 2 GPUs × 2 GCDs"
    )
    print(
        f"{'scheme':30s} {'M':>2s} "
        + " ".join(f"{link:>11s}" for link in LINKS)
        + "  inter-node vs flat"
    )
    for (label, micro), got in results.items():
        flat = results[("flat ZeRO-3", micro)]["inter-node"]
        print(
            f"{label:30s} {micro:2d} "
            + " ".join(f"{got[link] / n:10.3f}N" for link in LINKS)
            + f"  {got['inter-node'] / flat:8.3f}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "model_bytes": n,
                    "runs": [
                        {"scheme": label, "micro_batches": micro, **got}
                        for (label, micro), got in results.items()
                    ],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
