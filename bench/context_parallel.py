"""Context parallelism's attention, measured: Strata's ring and all-to-all (Ulysses) attention against
each other and against DeepSpeed's Ulysses `DistributedAttention` (the peer that runs on the CPU:
torch's own `context_parallel` handles only CUDA kernels), forward + backward of one causal attention
layer over a sequence split across cp = 4 ranks (bench/_context_worker.py under torchrun, gloo):

1. on this machine (4 ranks, loopback);
2. across the namespace cluster (tests/cluster.py): 2 nodes × 2 ranks, the link shaped to --rate;
3. memory: the RSS high-water mark of one forward and backward of a small model (2 layers, d_model
   256) at --mem-seq tokens, unsplit in one process and split over 4 ranks (goal: ≤ 0.3× per rank),
   under glibc's default malloc and with its mmap threshold fixed at 64 KiB. By default glibc raises
   the threshold to the size of the largest block freed so far (up to 32 MiB), after which tensors
   come from the heap and the heap keeps freed ones: the RSS then holds the allocator's hoard as well
   as the live tensors. With the threshold fixed every tensor is its own mapping, returned on free,
   and the high-water mark is that of the live tensors (torch's CUDA caching allocator is the GPU's
   equivalent question, answered by `torch.cuda.max_memory_allocated`).

    python bench/context_parallel.py                          # ~5 min on 2 cores
    python bench/context_parallel.py --skip-cluster --seq 4096

Rank 0's step is the slowest rank's median; the bytes are Strata's counters (DeepSpeed's all-to-alls
are not counted: four tensors, each (cp−1)/cp of a rank's share, each way). Writes --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster import Cluster, unavailable  # noqa: E402

WORKER = str(ROOT / "bench" / "_context_worker.py")


ALLOCATORS = {"glibc default": {}, "mmap threshold 64 KiB": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def local(nproc: int, args: list[str], out: Path, env_extra: dict | None = None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        WORKER,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.run(
        [*cmd, *args, "--out", str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode:
        raise SystemExit(f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def table(title: str, result: dict) -> list[str]:
    systems = result["systems"]
    lines = [
        f"### {title}",
        "",
        "| system | step s (fwd+bwd) | MB sent per rank (counted) |",
        "|---|---|---|",
    ]
    for name, r in systems.items():
        mb = f"{r['bytes_per_rank'] / 1e6:.1f}" if r["bytes_per_rank"] else "(not counted)"
        lines.append(f"| {name} | {r['step_s']:.3f} | {mb} |")
    ours, peer = systems.get("strata-alltoall"), systems.get("deepspeed-ulysses")
    ring = systems.get("strata-ring")
    if ours and peer:
        lines.append(
            f"\nStrata all-to-all / DeepSpeed Ulysses: {ours['step_s'] / peer['step_s']:.2f} (goal <= 1.0)"
        )
    if ours and ring:
        lines.append(f"ring / all-to-all: {ring['step_s'] / ours['step_s']:.2f}")
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--mem-seq", type=int, default=16384)
    ap.add_argument("--skip-cluster", action="store_true")
    ap.add_argument("--out", default="context_parallel.json")
    args = ap.parse_args()
    shape = ["--seq", str(args.seq), "--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    shape += ["--reps", str(args.reps)]
    results: dict = {"args": vars(args)}
    lines = [
        f"## causal attention, seq {args.seq}, {args.heads} heads of {args.head_dim}, cp = 4",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        results["local"] = local(4, shape, Path(tmp) / "local.json")
        lines += table("one machine, 4 ranks (loopback)", results["local"])
        problem = unavailable()
        if args.skip_cluster or problem:
            lines.append(f"(cluster skipped: {problem or '--skip-cluster'})\n")
        else:
            with Cluster(2, args.rate) as cluster:
                out = Path(tmp) / "cluster.json"
                cluster.torchrun(
                    2, [WORKER, *shape, "--out", str(out)], dict(os.environ), 900, ROOT
                )
                results["cluster"] = json.loads(out.read_text())
            lines += table(f"2 nodes × 2 ranks, link {args.rate}", results["cluster"])
        mem = ["--memory", "--seq", str(args.mem_seq), "--heads", str(args.heads)]
        lines += [
            f"### memory: one forward + backward, 2 layers, d_model 256, seq {args.mem_seq}",
            "",
        ]
        results["memory"] = {}
        for allocator, env in ALLOCATORS.items():
            one = local(1, mem, Path(tmp) / "mem1.json", env)["memory"]
            four = local(4, mem, Path(tmp) / "mem4.json", env)["memory_by_rank"]
            results["memory"][allocator] = {"cp1": one, "cp4": four}
            worst = max(r["peak_above_baseline_bytes"] for r in four)
            ratio = worst / one["peak_above_baseline_bytes"]
            lines.append(
                f"{allocator}: peak RSS above baseline unsplit {one['peak_above_baseline_bytes'] / 2**20:.0f} MiB; "
                f"cp = 4, the largest rank {worst / 2**20:.0f} MiB: {ratio:.2f}x (goal <= 0.3)"
            )
        lines.append("")
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"raw figures: {args.out}")


if __name__ == "__main__":
    main()
