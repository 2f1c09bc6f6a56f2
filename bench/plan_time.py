"""`strata plan`'s step-time model against measured step times on a real bandwidth-limited network:
2 nodes × 2 ranks, each node a network namespace (tests/cluster.py) whose link to the other is
shaped with tc tbf (--rate, 100 Mbit/s by default), intra-node traffic on the node's own loopback.

1. Calibration, the model's inputs: this machine's sustained per-rank compute rate with 4 ranks
   computing at once, loopback bandwidth and latency (`strata.trainer.calibrate.calibrate_local`),
   and the inter-node link measured on the cluster with gloo (bench/_plan_time_worker.py): one rank
   per node (one-way bandwidth, small-message latency) and two ranks per node sending at once (the
   node's link is shared by its ranks).
2. The same ~5M-parameter model trained by `strata train` (the real trainer under torchrun, static
   rendezvous at node 0's address) in each of LAYOUTS; the step time is the median of the timed
   steps' `step_time_s` in the run's metrics.jsonl (CO2: the mean over whole rounds).
3. Each layout's prediction, `strata.plan.timing.estimate_time(cfg, cluster, vocab).step_s`,
   against the measurement: a table with the predicted parts, the Spearman rank correlation and the
   median absolute error (goals: >= 0.9 and <= 20 %).

    python bench/plan_time.py                                  # every layout at 100mbit (~10 min on 2 cores)
    python bench/plan_time.py --baseline                       # and each with the link unshaped (~2x longer)
    python bench/plan_time.py --layouts dp4,dp4-zero3 --steps 2 --warmup 1   # a quick look
    python bench/plan_time.py --measured /tmp/plantime/measured.json        # predict again, no runs
    python bench/plan_time.py --ranks-per-node 1 --rate 200mbit   # 2 nodes × 1 rank, MoE layouts too

Run it on an idle machine (it waits for the 1-minute load average to fall below --max-load).
Needs root (network namespaces); writes the raw figures to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# One OpenMP waiting policy for the calibration (this process's workers) and every measured run: the
# strata command picks passive waiting when other work is runnable at its start, which the runs here
# would see of each other. An empty value is libgomp's own default, and the strata command keeps it.
os.environ.setdefault("OMP_WAIT_POLICY", "")

from strata import config as config_mod  # noqa: E402
from strata.data.prepare import ensure_default_corpus  # noqa: E402
from tests.cluster import Cluster, unavailable  # noqa: E402

NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
# The model and batch every layout trains: ~5.3M parameters (3.1M in blocks, 2.1M in the untied
# embedding and output), 32 sequences of 128 tokens per step: about a second of compute per step
# on 2 shared cores, and a gradient (21 MB) that takes about as long over 100 Mbit/s.
BASE: dict[str, Any] = {
    "model.n_layers": 4,
    "model.d_model": 256,
    "model.n_heads": 4,
    "model.seq_len": 128,
    "model.vocab_size": 4096,
    "train.global_batch_size": 32,
    "train.micro_batch_size": 8,
    "train.eval_interval": 0,
    "train.eval_batches": 1,
    "optim.warmup_steps": 0,
    "checkpoint.save_final": False,
    "checkpoint.interval": 0,
    "log.interval": 1,
    "log.progress": False,
    "parallel.ranks_per_node": RANKS_PER_NODE,
}
VOCAB = BASE["model.vocab_size"]  # set, so the padded vocabulary the trainer uses is this
G = "global"
# Layouts on 2 nodes × 2 ranks (topology order: tp innermost, then dp, then pp — so tp=2 stays inside
# a node and pp=2 puts one stage on each node), each exercising a different term of the model.
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4": {},
    "dp4-accum4": {"train.micro_batch_size": 2},
    "dp4-zero1": {"zero.optim.shard_over": G},
    "dp4-zero3": {
        "zero.params.shard_over": G,
        "zero.grads.shard_over": G,
        "zero.optim.shard_over": G,
        "zero.hierarchical": False,
    },
    "dp4-zero3-hier": {
        "zero.params.shard_over": "node",
        "zero.grads.shard_over": G,
        "zero.optim.shard_over": G,
    },
    "tp2-dp2": {"parallel.tp": 2},
    "pp2-dp2": {"parallel.pp": 2, "train.micro_batch_size": 4},
    "tp2-pp2": {"parallel.tp": 2, "parallel.pp": 2},
    "dp4-co2": {"co2.enabled": True, "co2.outer_every": 2},
}


CALIBRATION_LAYOUT = "dp4"  # its micro-batch (8 sequences) is what the compute rate is measured on

# With --ranks-per-node 1 (2 nodes × 1 rank: each rank has a core of its own on 2 cores), these
# layouts instead, MoE ones included (4 experts of SwiGLU 256, top 2, in every block).
MOE = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_ffn": 256}
LAYOUTS_ONE_PER_NODE: dict[str, dict[str, Any]] = {
    "dp2": {},
    "dp2-zero1": {"zero.optim.shard_over": G},
    "dp2-zero3": {
        "zero.params.shard_over": G,
        "zero.grads.shard_over": G,
        "zero.optim.shard_over": G,
        "zero.hierarchical": False,
    },
    "tp2": {"parallel.tp": 2},
    "pp2": {"parallel.pp": 2, "train.micro_batch_size": 4},
    "moe-dp2": MOE,
    "moe-ep2": {**MOE, "parallel.ep": 2},
    "moe-ep2-flat": {**MOE, "parallel.ep": 2, "parallel.ep_dispatch": "flat"},
    # each sequence over both nodes: K/V blocks round the ring, or the all-to-all into the head split
    "cp2-ring": {"parallel.cp": 2, "parallel.cp_mode": "ring"},
    "cp2-alltoall": {"parallel.cp": 2, "parallel.cp_mode": "alltoall"},
}


def configure(ranks_per_node: int) -> None:
    """The harness's shape: 2 nodes of `ranks_per_node` ranks (2: LAYOUTS; 1: LAYOUTS_ONE_PER_NODE)."""
    global RANKS_PER_NODE, WORLD, LAYOUTS, CALIBRATION_LAYOUT
    RANKS_PER_NODE, WORLD = ranks_per_node, NODES * ranks_per_node
    BASE["parallel.ranks_per_node"] = ranks_per_node
    if ranks_per_node == 1:
        LAYOUTS, CALIBRATION_LAYOUT = LAYOUTS_ONE_PER_NODE, "dp2"


def overrides(layout: str, extra: dict[str, Any] | None = None) -> list[str]:
    values = BASE | LAYOUTS[layout] | (extra or {})
    return [
        f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
        for k, v in values.items()
    ]


def layout_config(layout: str) -> config_mod.Config:
    return config_mod.load(None, overrides(layout), world_size=WORLD)


def wait_for_idle(max_load: float, patience_s: float) -> float:
    """The 1-minute load average once it is below `max_load` (or after `patience_s`, with a warning)."""
    deadline = time.monotonic() + patience_s
    while True:
        load = float(Path("/proc/loadavg").read_text().split()[0])
        if load < max_load:
            return load
        if time.monotonic() > deadline:
            print(
                f"warning: load average {load:.2f} still >= {max_load} after {patience_s:.0f} s; measuring anyway"
            )
            return load
        print(f"load average {load:.2f} >= {max_load}: waiting", flush=True)
        time.sleep(20)


def measure_link(cluster: Cluster, env: dict[str, str], mb: float, repeats: int, tmp: Path) -> dict:
    """The inter-node link as gloo sees it: one rank per node, then two ranks per node at once."""
    worker = str(ROOT / "bench" / "_plan_time_worker.py")
    res = {}
    for nproc in sorted({1, RANKS_PER_NODE}):
        out = tmp / f"link{nproc}.json"
        cluster.torchrun(
            nproc,
            [worker, "--mb", str(mb), "--repeats", str(repeats), "--out", str(out)],
            env,
            300,
            ROOT,
        )
        res[f"{nproc}_per_node"] = json.loads(out.read_text())
    return res


def measure_layout(
    cluster: Cluster,
    layout: str,
    warmup: int,
    steps: int,
    env: dict[str, str],
    tmp: Path,
    timeout_s: float,
) -> dict:
    """Train `layout` for warmup + steps steps with `strata train` on every node; its step times."""
    extra = {"train.steps": warmup + steps, "log.dir": str(tmp / "runs"), "log.name": layout}
    experiment = tmp / "empty.yaml"  # every key from the overrides
    experiment.write_text("# bench/plan_time.py: see its overrides\n")
    start = time.perf_counter()
    argv = ["-m", "strata.launch.cli", "train", str(experiment), *overrides(layout, extra)]
    cluster.torchrun(RANKS_PER_NODE, argv, env, timeout_s, ROOT)
    wall = time.perf_counter() - start
    records = [
        json.loads(line)
        for line in (tmp / "runs" / layout / "metrics.jsonl").read_text().splitlines()
    ]
    per_step = {r["step"]: r for r in records if "step_time_s" in r}
    timed = [per_step[s]["step_time_s"] for s in sorted(per_step) if s > warmup]
    cfg = layout_config(layout)
    rounds = cfg.co2.outer_every if cfg.co2.enabled else 1
    whole = timed[: len(timed) // rounds * rounds] or timed
    step_s = statistics.fmean(whole) if rounds > 1 else statistics.median(timed)
    wire = [per_step[s].get("wire_bytes_per_step", {}) for s in sorted(per_step) if s > warmup]
    return {
        "step_s": step_s,
        "step_times_s": timed,
        "warmup_times_s": [per_step[s]["step_time_s"] for s in sorted(per_step) if s <= warmup],
        "rank0_wire_bytes_per_step": {
            k: statistics.fmean(w.get(k, 0.0) for w in wire) for k in wire[0]
        }
        if wire
        else {},
        "overrides": overrides(layout),
        "run_wall_s": wall,
    }


def measure(args: argparse.Namespace) -> dict:
    problem = unavailable()
    if problem:
        raise SystemExit(f"bench/plan_time.py needs network namespaces: {problem}")
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    for name in layouts:
        layout_config(name)  # a bad layout fails here, not inside torchrun
    data = ensure_default_corpus(None, 0.05)  # prepared once here, not by every rank at once
    result: dict = {"rate": args.rate, "ranks_per_node": RANKS_PER_NODE, "layouts": {}, "loads": {}}
    with Cluster(NODES, args.rate) as cluster, tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        env = dict(os.environ, TMPDIR=str(tmp), WANDB_MODE="disabled")
        env.setdefault("STRATA_CACHE", str(data.parent))
        result["loads"]["before_link"] = wait_for_idle(args.max_load, args.patience)
        result["link"] = measure_link(cluster, env, args.link_mb, args.link_repeats, tmp)
        print(json.dumps(result["link"], indent=1), flush=True)
        try:
            result["loads"]["before_calibration"] = wait_for_idle(args.max_load, args.patience)
            calibrate_compute(result, args.calibrations)
            print(json.dumps(result["calibration"], indent=1), flush=True)
        except ImportError as e:  # the planner is not there yet: measure only
            print(f"no local calibration: {e}")
        if args.baseline:  # the same with the link unshaped (the veth pair's own speed)
            cluster.shape(None)
            result["baseline"] = {
                "link": measure_link(cluster, env, args.link_mb, args.link_repeats, tmp),
                "layouts": {},
            }
            cluster.shape(args.rate)
        for name in layouts:
            result["loads"][name] = wait_for_idle(args.max_load, args.patience)
            r = measure_layout(cluster, name, args.warmup, args.steps, env, tmp, args.timeout)
            r["load_after"] = float(
                Path("/proc/loadavg").read_text().split()[0]
            )  # this run's own 4 ranks included
            result["layouts"][name] = r
            times = ", ".join(f"{t:.2f}" for t in r["step_times_s"])
            print(
                f"{name}: {r['step_s']:.2f} s/step (steps {times}; load {result['loads'][name]:.2f})",
                flush=True,
            )
            if args.baseline:
                cluster.shape(None)
                b = measure_layout(cluster, name, args.warmup, args.steps, env, tmp, args.timeout)
                cluster.shape(args.rate)
                result["baseline"]["layouts"][name] = b
                print(f"{name} unshaped: {b['step_s']:.2f} s/step", flush=True)
    return result


def calibrate_compute(result: dict, tries: int = 1) -> None:
    """The lead's local calibration (4 ranks computing at once, loopback gloo), into `result`: the
    fastest of `tries` (another process on the machine only ever slows a try down)."""
    from strata.trainer.calibrate import calibrate_local

    cals = [
        calibrate_local(layout_config(CALIBRATION_LAYOUT), VOCAB, ranks=WORLD) for _ in range(tries)
    ]
    cal = max(cals, key=lambda c: c.device.peak_tflops)
    result["calibration"] = {
        "layout": CALIBRATION_LAYOUT,
        "peak_tflops": cal.device.peak_tflops,
        "matmul_efficiency": cal.device.matmul_efficiency,
        "mem_bw_gbs": cal.device.mem_bw_gbs,
        "mem_gib": cal.device.mem_gib,
        "intra_node_gbps": cal.intra_node_gbps,
        "intra_node_latency_s": cal.latency_s,
        "adam_gparams_s": cal.adam_gparams_s,
        "tries_tflops": [c.device.peak_tflops for c in cals],
    }


def plan_cluster(result: dict, link: dict) -> Any:
    """The model's cluster: the local calibration and the inter-node link measured on the harness
    (two ranks per node sending at once: the node's whole link)."""
    from strata.plan.cluster import Cluster as PlanCluster
    from strata.plan.cluster import Device

    c = result["calibration"]
    device = Device(
        "cpu (calibrated)",
        c["mem_gib"],
        c["peak_tflops"],
        c["matmul_efficiency"],
        c["mem_bw_gbs"],
        measured=True,
    )
    intra_lat = c["intra_node_latency_s"]
    return PlanCluster(
        nodes=NODES,
        gpus_per_node=RANKS_PER_NODE,
        device=device,
        intra_node_gbps=c["intra_node_gbps"],
        inter_node_gbps=link["2_per_node"]["concurrent_one_way_gbps"]
        if RANKS_PER_NODE == 2
        else link["1_per_node"]["one_way_gbps"],
        latency_s={
            "intra-gpu": intra_lat,
            "intra-node": intra_lat,
            "inter-node": link["1_per_node"]["latency_s"],
        },
        cpu_adam_gparams_s=c["adam_gparams_s"],
        shared_cores=WORLD
        > (os.cpu_count() or 1),  # both namespaced nodes are this machine's cores
    )


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank): Pearson's r of the ranks."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def predict(result: dict) -> list[str]:
    """Each measured layout's predicted step time; the table and the two figures of merit."""
    from strata.plan.timing import estimate_time

    if "calibration" not in result:
        calibrate_compute(result)
    cluster = plan_cluster(result, result["link"])
    c, link = result["calibration"], result["link"]
    lines = [
        f"## {result['rate']}, {NODES} nodes × {RANKS_PER_NODE} ranks: predicted against measured step time",
        "",
        f"calibration: {c['peak_tflops'] * 1e3:.1f} GFLOP/s per rank ({WORLD} ranks at once; tries "
        f"{', '.join(f'{t * 1e3:.1f}' for t in c.get('tries_tflops', []))}), AdamW "
        f"{c['adam_gparams_s'] * 1e3:.0f} M params/s per rank, loopback {c['intra_node_gbps']:.2f} Gbit/s and "
        f"{c['intra_node_latency_s'] * 1e6:.0f} us; inter-node {cluster.inter_node_gbps * 1e3:.1f} Mbit/s per node "
        f"({RANKS_PER_NODE} rank(s) sending at once; 1 rank alone: {link['1_per_node']['one_way_gbps'] * 1e3:.1f}), "
        f"{cluster.latency_s['inter-node'] * 1e6:.0f} us",
        "",
        "| layout | predicted s | measured s | error % | predicted parts (s) |",
        "|---|---|---|---|---|",
    ]
    preds, meas, errors = [], [], []
    for name, r in result["layouts"].items():
        est = estimate_time(layout_config(name), cluster, VOCAB)
        parts = {k: float(v) for k, v in est.parts.items()}
        r["predicted_s"], r["predicted_parts_s"] = float(est.step_s), parts
        r["predicted_link_bytes"] = {k: float(v) for k, v in est.link_bytes.items()}
        err = (est.step_s - r["step_s"]) / r["step_s"] * 100
        r["error_pct"] = err
        preds.append(est.step_s)
        meas.append(r["step_s"])
        errors.append(abs(err))
        shown = ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if v)
        lines.append(f"| {name} | {est.step_s:.2f} | {r['step_s']:.2f} | {err:+.0f} | {shown} |")
    rho = spearman(preds, meas) if len(preds) > 1 else float("nan")
    mae = statistics.median(errors) if errors else float("nan")
    result["spearman"], result["median_abs_error_pct"] = rho, mae
    result["cluster"] = repr(cluster)
    lines += [
        "",
        f"Spearman rank correlation {rho:.2f} (goal >= 0.9{' met' if rho >= 0.9 else ', NOT met'}); "
        f"median |error| {mae:.0f} % (goal <= 20 %{' met' if mae <= 20 else ', NOT met'})",
    ]
    lines += bytes_table(result, cluster)
    if "baseline" in result:
        lines += baseline_table(result, cluster)
    return lines


def bytes_table(result: dict, cluster: Any) -> list[str]:
    """The inter-node bytes per rank and step the model predicts against those Strata's counters
    report on rank 0 (pipeline sends go through torch's pipelining and are not counted), and the
    time the node's link needs for them back to back (every rank of the node sending at once)."""
    bw = cluster.inter_node_gbps * 1e9 / 8
    lines = [
        "",
        "| layout | inter-node MB per rank: predicted | counted (rank 0) | link busy s (predicted bytes) |",
        "|---|---|---|---|",
    ]
    for name, r in result["layouts"].items():
        pred = r["predicted_link_bytes"].get("inter-node", 0.0)
        counted = r.get("rank0_wire_bytes_per_step", {}).get("inter-node", 0.0)
        lines.append(
            f"| {name} | {pred / 1e6:.2f} | {counted / 1e6:.2f} | {pred * RANKS_PER_NODE / bw:.2f} |"
        )
    return lines


def baseline_table(result: dict, shaped: Any) -> list[str]:
    """Each layout with the link unshaped, predicted against measured, and the slow link's cost
    (shaped minus unshaped step time): what the model's inter-node terms must account for."""
    from strata.plan.timing import estimate_time

    base = result["baseline"]
    cluster = plan_cluster(result, base["link"])
    lines = [
        "",
        f"## unshaped link ({cluster.inter_node_gbps:.2f} Gbit/s per node, "
        f"{cluster.latency_s['inter-node'] * 1e6:.0f} us) and the slow link's cost",
        "",
        "| layout | unshaped predicted s | unshaped measured s | error % | slow-link cost predicted s | measured s |",
        "|---|---|---|---|---|---|",
    ]
    for name, b in base["layouts"].items():
        if name not in result["layouts"]:
            continue
        cfg = layout_config(name)
        est = estimate_time(cfg, cluster, VOCAB)
        b["predicted_s"] = float(est.step_s)
        b["predicted_parts_s"] = {k: float(v) for k, v in est.parts.items()}
        cost_pred = estimate_time(cfg, shaped, VOCAB).step_s - est.step_s
        cost_meas = result["layouts"][name]["step_s"] - b["step_s"]
        err = (est.step_s - b["step_s"]) / b["step_s"] * 100
        lines.append(
            f"| {name} | {est.step_s:.2f} | {b['step_s']:.2f} | {err:+.0f} | {cost_pred:.2f} | {cost_meas:.2f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="100mbit", help="tc rate of each node's link")
    ap.add_argument(
        "--ranks-per-node",
        type=int,
        default=2,
        choices=(1, 2),
        help="1: each rank a core of its own",
    )
    ap.add_argument(
        "--layouts", default=None, help="comma-separated (default: every layout of the shape)"
    )
    ap.add_argument("--steps", type=int, default=6, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--link-mb", type=float, default=8.0, help="message size of the link calibration"
    )
    ap.add_argument("--link-repeats", type=int, default=4)
    ap.add_argument(
        "--calibrations", type=int, default=3, help="local calibrations; the fastest is used"
    )
    ap.add_argument(
        "--max-load",
        type=float,
        default=1.5,
        help="wait for the 1-minute load average to fall below",
    )
    ap.add_argument(
        "--patience", type=float, default=600, help="seconds to wait for it before measuring anyway"
    )
    ap.add_argument("--timeout", type=float, default=900, help="per layout run")
    ap.add_argument(
        "--baseline", action="store_true", help="also run every layout with the link unshaped"
    )
    ap.add_argument(
        "--measured", help="a JSON from an earlier --out (or --measured-out): predict only, no runs"
    )
    ap.add_argument(
        "--measured-out", default="/tmp/plantime/measured.json", help="the measurements alone"
    )
    ap.add_argument("--out", default="plan_time.json")
    args = ap.parse_args()
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # the cluster's namespaces are removed on the way out
    if args.measured:
        result = json.loads(Path(args.measured).read_text())
        configure(result.get("ranks_per_node", 2))
    else:
        configure(args.ranks_per_node)
        args.layouts = args.layouts or ",".join(LAYOUTS)
        result = measure(args)
        Path(args.measured_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.measured_out).write_text(json.dumps(result, indent=1))
        print(f"measurements: {args.measured_out}")
    try:
        lines = predict(result)
    except ImportError as e:
        print(f"no prediction: {e}")
        lines = []
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nraw figures: {args.out}")


if __name__ == "__main__":
    main()
