"""Topology-aware expert dispatch against the flat all-to-all on a real bandwidth-limited network:
2 nodes × 2 ranks (network namespaces, tests/cluster.py), the link between them shaped with tc tbf
(200 Mbit/s by default). The same MoE model (8 experts, top 4, ep = 4: 4 experts on each node)
trains on the same batches with

    strata-moe-flat(-m1)           one all-to-all over the expert-parallel group (Megatron-core's,
                                   torchtitan's): a token goes once to every rank holding one of its
                                   experts, so up to top_k times across the link
    strata-moe-hierarchical(-m1)   one copy per destination node, fanned out inside the node

"-m1" is node-limited routing (model.moe.route_groups=2 = the nodes, route_group_limit=1): a token's
experts all on one node, so the hierarchical dispatch sends it across at most once each way. The
goals at M = 1: inter-node bytes ≤ 0.6× and step time ≤ 0.8× the flat dispatch's. Bytes are
Strata's counters summed over the ranks, checked against the TCP payload the nodes' interfaces
counted (bench/network.py's rule). The losses of the two dispatches of one routing must be equal
(they compute the same sums in another order).

Then the loss cost of node-limited routing: the same model trained --loss-steps steps with and
without the group limit (hierarchical dispatch, link unshaped), eval loss and the curves' gap.

    python bench/moe_dispatch.py                      # ~6 min on 2 cores
    python bench/moe_dispatch.py --loss-steps 0 --steps 3
Needs root (network namespaces); writes the raw figures to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.network import payload, run_cluster  # noqa: E402
from tests.cluster import Cluster, unavailable  # noqa: E402

SYSTEMS = [
    "strata-moe-flat-m1",
    "strata-moe-hierarchical-m1",
    "strata-moe-flat",
    "strata-moe-hierarchical",
]
MODEL = [
    "--layers",
    "2",
    "--d-model",
    "128",
    "--heads",
    "4",
    "--seq",
    "128",
    "--micro",
    "8",
    "--accum",
    "1",
]
GOALS = {"bytes": 0.6, "step": 0.8}  # hierarchical / flat at M = 1


def report(data: dict, rate: str) -> tuple[list[str], dict]:
    res = data["results"]
    steps = data["args"]["steps"]
    lines = [
        f"## {rate}: 2 nodes × 2 ranks, ep = 4, 8 experts, top 4",
        "",
        "| system | step s | inter-node MB/step (counted) | link payload MB/step | counted / link |",
        "|---|---|---|---|---|",
    ]
    for name, r in res.items():
        link = payload(r["links"])
        counted = r["counted_inter_node_bytes"]
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {counted / steps / 1e6:.2f} | {link / steps / 1e6:.2f} | "
            f"{counted / link:.3f} |"
        )
    ratios = {}
    lines += [
        "",
        "| routing | bytes hierarchical / flat | step hierarchical / flat | loss gap |",
        "|---|---|---|---|",
    ]
    for suffix, label in (("-m1", "node-limited, M = 1"), ("", "any node")):
        flat, hier = res[f"strata-moe-flat{suffix}"], res[f"strata-moe-hierarchical{suffix}"]
        b = hier["counted_inter_node_bytes"] / flat["counted_inter_node_bytes"]
        t = hier["step_s"] / flat["step_s"]
        gap = max(abs(a - c) for a, c in zip(hier["losses"], flat["losses"]))
        ratios[suffix or "free"] = {"bytes": b, "step": t, "loss_gap": gap}
        lines.append(f"| {label} | {b:.3f} | {t:.3f} | {gap:.1e} |")
    m1 = ratios["-m1"]
    met = {k: m1[k] <= goal for k, goal in GOALS.items()}
    lines.append(
        f"\nat M = 1: bytes {m1['bytes']:.2f}x (goal <= {GOALS['bytes']}, {'met' if met['bytes'] else 'NOT met'}), "
        f"step {m1['step']:.2f}x (goal <= {GOALS['step']}, {'met' if met['step'] else 'NOT met'})"
    )
    return lines, ratios


def loss_cost(data: dict, steps: int) -> list[str]:
    res = data["results"]
    limited, free = res["strata-moe-hierarchical-m1"], res["strata-moe-hierarchical"]
    tail = max(1, steps // 10)
    lines = [
        f"## the loss cost of node-limited routing: {steps} steps each",
        "",
        "| routing | first loss | mean of the last 10 % | eval loss |",
        "|---|---|---|---|",
    ]
    for label, r in (("any node", free), ("node-limited, M = 1", limited)):
        lines.append(
            f"| {label} | {r['losses'][0]:.3f} | {statistics.fmean(r['losses'][-tail:]):.3f} | {r['eval_loss']:.3f} |"
        )
    gap = limited["eval_loss"] / free["eval_loss"] - 1
    lines.append(f"\neval loss, node-limited against any node: {gap:+.2%}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="200mbit", help="tc rate of the inter-node link")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per system")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--loss-steps", type=int, default=100, help="steps of the loss comparison (0: skip)"
    )
    ap.add_argument("--out", default="moe_dispatch.json")
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args()
    problem = unavailable()
    if problem:
        raise SystemExit(f"bench/moe_dispatch.py needs network namespaces: {problem}")
    everything: dict = {}
    with Cluster(2) as cluster, tempfile.TemporaryDirectory() as tmp:
        cluster.shape(args.rate)
        flags = [
            "--systems",
            ",".join(SYSTEMS),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            *MODEL,
        ]
        data = run_cluster(cluster, flags, Path(tmp) / "dispatch.json", args.timeout)
        lines, everything["ratios"] = report(data, args.rate)
        everything["dispatch"] = data
        print("\n".join(lines), flush=True)
        if args.loss_steps:
            cluster.shape(None)
            systems = "strata-moe-hierarchical,strata-moe-hierarchical-m1"
            flags = ["--systems", systems, "--steps", str(args.loss_steps), "--warmup", "0", *MODEL]
            data = run_cluster(cluster, flags, Path(tmp) / "loss.json", args.timeout)
            everything["loss"] = data
            print("\n" + "\n".join(loss_cost(data, args.loss_steps)), flush=True)
    Path(args.out).write_text(json.dumps(everything, indent=1))
    print(f"\nraw figures: {args.out}")


if __name__ == "__main__":
    main()
