"""Strata against the peers users would pick, on a real bandwidth-limited network: 2 nodes × 2
ranks, each node a network namespace (tests/cluster.py) whose link to the other is shaped with
tc tbf (1 Gbit/s and 200 Mbit/s by default), intra-node traffic on the node's own loopback.
Every system trains the same ~12M-parameter model on the same batches in the same run:

    Strata dp            vs torch DDP                  step-time ratio, goal <= 0.95
    Strata ZeRO-3 (flat) vs FSDP2 fully_shard          goal <= 1.0
    Strata hierarchical ZeRO-3, hpZ, 3-level
                         vs FSDP2 and HSDP (2-D mesh)  goal >= 1.5x faster at 200 Mbit/s
    Strata CO2           vs DDP                        >= 1.5x faster, final loss within 3 %
                                                       (its own longer run, --co2-steps)

It also prints, per Strata system, the inter-node bytes Strata's counters report against the TCP
payload the link carried (the interfaces' byte counters less 66 header bytes per packet: Ethernet
14, IPv4 20, TCP with timestamps 32), and each system's exposed communication: its step time
minus the step time of the same model trained with no communication (every rank alone, all at
once, so compute shares the cores as it does in the others).

    python bench/network.py                    # both rates, every system, then CO2 (~25 min on 2 cores)
    python bench/network.py --rates 200mbit --systems strata-dp,ddp --steps 3
Needs root (network namespaces); writes the raw figures to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster import Cluster, unavailable  # noqa: E402

HEADER_BYTES = 66  # per packet: Ethernet 14 + IPv4 20 + TCP 20 + timestamps option 12
ALL = "local,strata-dp,ddp,strata-zero3,fsdp2,strata-zero3-hier,strata-hpz,strata-3level,hsdp"
PAIRS = [  # (Strata system, peer, goal as the most the time ratio may be)
    ("strata-dp", "ddp", 0.95),
    ("strata-zero3", "fsdp2", 1.0),
    ("strata-zero3-hier", "fsdp2", None),
    ("strata-hpz", "fsdp2", None),
    ("strata-3level", "fsdp2", 1 / 1.5),
    ("strata-3level", "hsdp", 1 / 1.5),
    ("strata-co2", "ddp", 1 / 1.5),
]


def run_cluster(cluster: Cluster, worker_args: list[str], out: Path, timeout_s: float) -> dict:
    """The worker under torchrun on every node (static rendezvous at node 0's address)."""
    worker = [str(ROOT / "bench" / "_network_worker.py"), *worker_args, "--out", str(out)]
    cluster.torchrun(2, worker, dict(os.environ), timeout_s, ROOT)
    return json.loads(out.read_text())


def payload(links: list[dict]) -> int:
    """TCP payload bytes the nodes' links sent (every node's tx; what one sends the other receives)."""
    return sum(link["tx_bytes"] - HEADER_BYTES * link["tx_packets"] for link in links)


def report(rate: str, data: dict) -> list[str]:
    res = data["results"]
    lines = [
        f"## {rate}",
        "",
        "| system | step s | exposed comm s | eval loss | counted / link bytes |",
        "|---|---|---|---|---|",
    ]
    base = res.get("local", {}).get("step_s")
    for name, r in res.items():
        exposed = f"{r['step_s'] - base:.2f}" if base is not None and name != "local" else "—"
        link = payload(r["links"]) if r["links"] else 0
        ratio = (
            f"{r['counted_inter_node_bytes'] / link:.3f}"
            if name.startswith("strata") and link
            else "—"
        )
        lines.append(f"| {name} | {r['step_s']:.2f} | {exposed} | {r['eval_loss']:.3f} | {ratio} |")
    lines += ["", "| Strata | peer | time ratio | goal |", "|---|---|---|---|"]
    for ours, peer, goal in PAIRS:
        if ours in res and peer in res:
            ratio = res[ours]["step_s"] / res[peer]["step_s"]
            met = "" if goal is None else (" met" if ratio <= goal else " NOT met")
            lines.append(
                f"| {ours} | {peer} | {ratio:.2f} | {'—' if goal is None else f'<= {goal:.2f}'}{met} |"
            )
    if "strata-co2" in res and "ddp" in res:
        gap = res["strata-co2"]["eval_loss"] / res["ddp"]["eval_loss"] - 1
        lines.append(
            f"\nCO2 eval loss vs DDP: {gap:+.1%} (goal within 3 %; ln V = {data['ln_vocab']:.2f})"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rates", default="1gbit,200mbit", help="comma-separated tc rates of the inter-node link"
    )
    ap.add_argument("--systems", default=ALL)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per system")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--co2-steps", type=int, default=60, help="CO2 against DDP: steps each trains (0: skip)"
    )
    ap.add_argument("--co2-rate", default="200mbit", help="the link rate of the CO2 comparison")
    ap.add_argument("--out", default="network.json")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("worker", nargs="*", help="more worker flags after --, e.g. -- --layers 4")
    args = ap.parse_args()
    problem = unavailable()
    if problem:
        raise SystemExit(f"bench/network.py needs network namespaces: {problem}")
    everything = {}
    with Cluster(2) as cluster, tempfile.TemporaryDirectory() as tmp:
        for rate in filter(None, args.rates.split(",")):
            cluster.shape(rate)
            flags = [
                "--systems",
                args.systems,
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                *args.worker,
            ]
            data = run_cluster(cluster, flags, Path(tmp) / f"{rate}.json", args.timeout)
            everything[rate] = data
            print("\n".join(report(rate, data)), flush=True)
        if args.co2_steps:  # long enough for the losses to say something
            cluster.shape(args.co2_rate)
            flags = [
                "--systems",
                "ddp,strata-co2",
                "--steps",
                str(args.co2_steps),
                "--warmup",
                "0",
                *args.worker,
            ]
            data = run_cluster(cluster, flags, Path(tmp) / "co2.json", args.timeout)
            everything["co2"] = data
            print(
                "\n".join(
                    report(f"CO2 against DDP, {args.co2_rate}, {args.co2_steps} steps", data)
                ),
                flush=True,
            )
    Path(args.out).write_text(json.dumps(everything, indent=1))
    print(f"\nraw figures: {args.out}")


if __name__ == "__main__":
    main()
