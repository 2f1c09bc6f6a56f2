"""`strata plan`: print one layout's predicted memory and step time on a described cluster, or
search every layout of the model and rank those that fit (docs/PLAN.md)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace

from strata.errors import ConfigError, StrataError

EXAMPLES = (
    "strata plan configs/llama2-7b-3d.yaml --nodes 4 --gpus-per-node 8 --gpu h100",
    "strata plan configs/llama2-7b-3d.yaml --nodes 4 --gpus-per-node 8 --gpu h100 --search",
    "strata plan cfg.yaml --system frontier --nodes 64 --search",
    "strata plan configs/tiny.yaml --nodes 1 --gpus-per-node 2 --calibrate",
)


def add_parser(sub, fmt, epilog: Callable[..., str], whole: Callable[[int], Callable[[str], int]]) -> None:
    pl = sub.add_parser(
        "plan",
        help="predict memory and step time of a layout, or search the layouts that fit",
        formatter_class=fmt,
        usage="strata plan CFG [key=value ...] --nodes N --gpus-per-node G (--gpu NAME | --gpu-mem-gb M "
        "--tflops T | --system NAME | --calibrate) [--search]",
        description="Predict each rank's memory (parameters, gradients, optimizer states, activations, buffers; "
        "device, host and NVMe) and the step time of the config's layout on a cluster, from the config and "
        "the cluster alone; with --search, rank every layout that fits. Exits 1 when the config's own layout "
        "does not fit (without --search).",
        epilog=epilog(*EXAMPLES, extra="Bandwidths are Gbit/s one way; --inter-node-gbps is a node's whole network."),
    )
    pl.add_argument("config", help="YAML experiment")
    pl.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides")
    pl.add_argument("--nodes", type=whole(1), default=1, help="nodes (default 1)")
    pl.add_argument("--gpus-per-node", type=whole(1), help="GPUs per node (default: the system's, else 8)")
    pl.add_argument("--ranks-per-gpu", type=whole(1), help="ranks per GPU: 2 for the GCDs of an MI250X")
    pl.add_argument("--system", help="a known system: dgx-a100, dgx-h100, frontier (its GPUs and links)")
    pl.add_argument("--gpu", help="a known device: a100-40gb, a100-80gb, h100, h200, mi250x-gcd, mi300x")
    pl.add_argument("--gpu-mem-gb", type=float, help="device memory per rank in GiB (an unknown device)")
    pl.add_argument("--tflops", type=float, help="sustained dense TFLOP/s per rank (an unknown device)")
    pl.add_argument("--intra-gpu-gbps", type=float, help="between the two GCDs of one GPU")
    pl.add_argument("--intra-node-gbps", type=float, help="each GPU's link inside the node")
    pl.add_argument("--inter-node-gbps", type=float, help="each node's network, all NICs together")
    pl.add_argument("--host-mem-gb", type=float, help="host memory per node in GiB")
    pl.add_argument("--nvme-gbps", type=float, help="NVMe bandwidth per node")
    pl.add_argument("--calibrate", action="store_true", help="measure this machine (CPU: compute, AdamW, loopback)")
    pl.add_argument("--search", action="store_true", help="rank every layout that fits, fastest first")
    pl.add_argument("--top", type=whole(1), default=10, help="layouts --search prints (default 10)")
    pl.add_argument("--json", action="store_true", help="print the figures as JSON")
    pl.set_defaults(func=cmd_plan)


def _cluster(args: argparse.Namespace, cfg, vocab: int):
    from strata.trainer.plan.cluster import PRESETS, Cluster, Device, device_named, preset

    links = {
        "intra_gpu_gbps": args.intra_gpu_gbps,
        "intra_node_gbps": args.intra_node_gbps,
        "inter_node_gbps": args.inter_node_gbps,
        "host_mem_gib": args.host_mem_gb,
        "nvme_gbps": args.nvme_gbps,
    }
    shape = {"gpus_per_node": args.gpus_per_node, "ranks_per_gpu": args.ranks_per_gpu}
    given = {k: v for k, v in {**links, **shape}.items() if v is not None}
    sources = [bool(args.system), bool(args.gpu), args.tflops is not None, args.calibrate]
    if sum(sources) == 0:
        raise StrataError(
            "strata plan needs the device: --gpu NAME (known: a100-40gb, a100-80gb, h100, h200, mi250x-gcd, "
            "mi300x), --system NAME (dgx-a100, dgx-h100, frontier), --gpu-mem-gb M --tflops T, or --calibrate"
        )
    if args.gpu and args.tflops is not None:
        raise StrataError("give either --gpu NAME or --tflops T (with --gpu-mem-gb), not both")
    if args.tflops is not None and args.gpu_mem_gb is None:
        raise StrataError("--tflops describes an unknown device: give its memory too with --gpu-mem-gb M")
    for flag, value in (
        ("--tflops", args.tflops),
        ("--gpu-mem-gb", args.gpu_mem_gb),
        *((f"--{k}", v) for k, v in given.items()),
    ):
        if isinstance(value, float) and not value > 0:
            raise StrataError(f"{flag.replace('_', '-')} must be > 0, got {value:g}")
    if args.system:
        cluster = preset(args.system, args.nodes, **given)
    else:
        base = {k: v for k, v in PRESETS["dgx-h100"].items() if k not in ("device", "gpus_per_node")}
        cluster = Cluster(nodes=args.nodes, gpus_per_node=8, device=Device("unset", 1, 1, 1, 1), **base)
        cluster = replace(cluster, **given)
    if args.gpu:
        cluster = replace(cluster, device=device_named(args.gpu))
    elif args.tflops is not None:
        cluster = replace(cluster, device=Device("custom", args.gpu_mem_gb, args.tflops, 1.0, 2000.0))
    if args.gpu_mem_gb is not None:
        cluster = replace(cluster, device=replace(cluster.device, mem_gib=args.gpu_mem_gb))
    if args.calibrate:
        from strata.trainer.plan.calibrate import calibrate_local

        if args.nodes > 1 and args.inter_node_gbps is None:
            raise StrataError(
                "--calibrate measures one machine: give the network with --inter-node-gbps for --nodes > 1"
            )
        cal = calibrate_local(cfg, vocab, ranks=cluster.ranks_per_node)
        latency = {**cluster.latency_s, "intra-node": cal.latency_s, "intra-gpu": cal.latency_s}
        cluster = replace(
            cluster,
            device=cal.device,
            intra_node_gbps=args.intra_node_gbps or cal.intra_node_gbps,
            intra_gpu_gbps=args.intra_gpu_gbps or cal.intra_node_gbps,
            latency_s=latency,
            cpu_adam_gparams_s=cal.adam_gparams_s,
            host_mem_gib=args.host_mem_gb or cal.device.mem_gib * cluster.ranks_per_node,
        )
    return cluster


def cmd_plan(args: argparse.Namespace) -> int:
    from strata import config
    from strata.trainer.plan import report
    from strata.trainer.plan.memory import estimate_memory
    from strata.trainer.plan.preflight import plan_vocab
    from strata.trainer.plan.search import search, with_layout
    from strata.trainer.plan.timing import estimate_time

    cfg = config.load(args.config, args.overrides)
    vocab = plan_vocab(cfg)
    cluster = _cluster(args, cfg, vocab)
    print(f"strata plan: {cluster.describe()}; vocabulary {vocab}")
    if args.search:
        result = search(cfg, cluster, vocab)
        if args.json:
            print(
                json.dumps(
                    [
                        {**p.candidate.__dict__, "step_s": p.time.step_s, "device_bytes": p.memory.peak("device")}
                        for p in result.fitting[: args.top]
                    ],
                    indent=1,
                )
            )
        else:
            print("\n".join(report.search_table(result, cluster, args.top)))
        return 0 if result.fitting else 1
    cfg = with_layout(cfg, cluster, {})
    problems = config.cross_problems(cfg, cluster.world_size)
    if problems:
        raise ConfigError(problems)
    memory = estimate_memory(cfg, cluster, vocab)
    est = estimate_time(cfg, cluster, vocab)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    if args.json:
        print(
            json.dumps(
                {
                    "memory": {
                        f"{k}/{t}": v
                        for s in memory.stages
                        for (k, t), v in s.bytes.items()
                        if s is memory.worst("device")
                    },
                    "step_s": est.step_s,
                    "parts": est.parts,
                    "link_bytes": est.link_bytes,
                    "mfu": est.mfu,
                },
                indent=1,
            )
        )
    else:
        print("layout: " + report.layout_line(cfg, cluster))
        print("\n".join(report.memory_table(memory) + report.time_table(est, tokens)))
    if not memory.fits():
        print("does not fit: " + "; ".join(memory.problems()) + "\n  `--search` lists layouts that fit")
        return 1
    return 0
