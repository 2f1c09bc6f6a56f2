"""`strata plan`: print one layout's predicted memory and step time on a described cluster, or
search every layout of the model and rank those that fit (docs/PLAN.md)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

from strata.errors import ConfigError, StrataError
from strata.launch.commands.common import CommandHelp, whole
from strata.plan.cluster import DEVICES, PRESETS

EXAMPLES = (
    "strata plan configs/llama2-7b-3d.yaml --nodes 4 --gpus-per-node 8 --gpu h100",
    "strata plan configs/llama2-7b-3d.yaml --nodes 4 --gpus-per-node 8 --gpu h100 --search",
    "strata plan cfg.yaml --system frontier --nodes 64 --search",
    "strata plan configs/tiny.yaml --nodes 1 --gpus-per-node 2 --calibrate",
)


HELP = CommandHelp(
    "plan",
    summary="predict memory and step time of a layout, or search the layouts that fit",
    usage=(
        "strata plan CFG [key=value ...] --nodes N --gpus-per-node G (--gpu NAME | "
        "--gpu-mem-gb M --tflops T | --system NAME | --calibrate) [--search]",
    ),
    description="Predict each rank's memory (parameters, gradients, optimizer states, "
    "activations, buffers; device, host and NVMe) and the step time of the config's layout "
    "on a cluster, from the config and the cluster alone; with --search, rank every layout "
    "that fits. Exits 1 when the config's own layout does not fit (without --search).",
    examples=EXAMPLES,
    extra="Bandwidths are Gbit/s one way; --inter-node-gbps is a node's whole network. "
    "Without --system the links are a DGX A100's unless given.",
)


def add_arguments(pl: argparse.ArgumentParser) -> None:
    """The config, its overrides, the cluster's description and what to print."""
    pl.add_argument("config", help="YAML experiment")
    pl.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="config overrides"
    )
    pl.add_argument("--nodes", type=whole(1), default=1, help="nodes (default 1)")
    pl.add_argument(
        "--gpus-per-node", type=whole(1), help="GPUs per node (default: the system's, else 8)"
    )
    pl.add_argument(
        "--ranks-per-gpu", type=whole(1), help="ranks per GPU: 2 for the GCDs of an MI250X"
    )
    pl.add_argument("--system", help=f"a known system: {', '.join(PRESETS)} (its GPUs and links)")
    pl.add_argument("--gpu", help=f"a known device: {', '.join(DEVICES)}")
    pl.add_argument(
        "--gpu-mem-gb", type=float, help="device memory per rank in GiB (an unknown device)"
    )
    pl.add_argument(
        "--tflops", type=float, help="sustained dense TFLOP/s per rank (an unknown device)"
    )
    pl.add_argument("--intra-gpu-gbps", type=float, help="between the two GCDs of one GPU")
    pl.add_argument("--intra-node-gbps", type=float, help="each GPU's link inside the node")
    pl.add_argument("--inter-node-gbps", type=float, help="each node's network, all NICs together")
    pl.add_argument("--host-mem-gb", type=float, help="host memory per node in GiB")
    pl.add_argument("--nvme-gbps", type=float, help="NVMe bandwidth per node")
    pl.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (CPU: compute, AdamW, loopback)",
    )
    pl.add_argument(
        "--search", action="store_true", help="rank every layout that fits, fastest first"
    )
    pl.add_argument("--top", type=whole(1), default=10, help="layouts --search prints (default 10)")
    pl.add_argument("--json", action="store_true", help="print the figures as JSON")


def _cluster(args: argparse.Namespace, cfg, vocab: int):
    """The cluster the flags describe: a known system, or nodes of the given device with the
    default (DGX A100-like) links, each flag overriding; measured here with --calibrate."""
    from strata.plan.cluster import Cluster, Device, device_named, preset

    given = {
        "intra_gpu_gbps": args.intra_gpu_gbps,
        "intra_node_gbps": args.intra_node_gbps,
        "inter_node_gbps": args.inter_node_gbps,
        "host_mem_gib": args.host_mem_gb,
        "nvme_gbps": args.nvme_gbps,
        "gpus_per_node": args.gpus_per_node,
        "ranks_per_gpu": args.ranks_per_gpu,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not (args.system or args.gpu or args.tflops is not None or args.calibrate):
        raise StrataError(
            f"strata plan needs the device: --gpu NAME (known: {', '.join(DEVICES)}), --system "
            "NAME "
            f"({', '.join(PRESETS)}), --gpu-mem-gb M --tflops T, or --calibrate"
        )
    if args.gpu and args.tflops is not None:
        raise StrataError("give either --gpu NAME or --tflops T (with --gpu-mem-gb), not both")
    if args.tflops is not None and args.gpu_mem_gb is None:
        raise StrataError(
            "--tflops describes an unknown device: give its memory too with --gpu-mem-gb M"
        )
    numbers = {"tflops": args.tflops, "gpu_mem_gb": args.gpu_mem_gb, **given}
    for key, value in numbers.items():
        if isinstance(value, float) and not (value > 0 and math.isfinite(value)):
            raise StrataError(f"--{key.replace('_', '-')} must be > 0 and finite, got {value:g}")
    if args.calibrate and args.nodes > 1 and args.inter_node_gbps is None:
        raise StrataError(
            "--calibrate measures one machine: give the network with "
            "--inter-node-gbps for --nodes > 1"
        )
    if args.gpu:
        device = device_named(args.gpu)
    elif args.tflops is not None:
        device = Device("custom", args.gpu_mem_gb, args.tflops, 1.0, 2000.0)
    else:
        device = None  # the system's, or the one --calibrate measures
    if args.system:
        cluster = preset(args.system, args.nodes, **given)
        cluster = replace(cluster, device=device) if device else cluster
    else:
        cluster = Cluster(
            nodes=args.nodes, gpus_per_node=8, device=device or Device("to measure", 1, 1, 1, 1)
        )
        cluster = replace(cluster, **given)
    if args.gpu_mem_gb is not None:
        cluster = replace(cluster, device=replace(cluster.device, mem_gib=args.gpu_mem_gb))
    if args.calibrate:
        cluster = _calibrated(args, cfg, vocab, cluster)
    return cluster


def _calibrated(args: argparse.Namespace, cfg, vocab: int, cluster):
    """`cluster` with this machine's measured device, intra-node link and AdamW rate (flags win)."""
    from strata.trainer.calibrate import calibrate_local

    cal = calibrate_local(cfg, vocab, ranks=cluster.ranks_per_node)
    return replace(
        cluster,
        device=cal.device,
        intra_node_gbps=args.intra_node_gbps or cal.intra_node_gbps,
        intra_gpu_gbps=args.intra_gpu_gbps or cal.intra_node_gbps,
        latency_s={**cluster.latency_s, "intra-node": cal.latency_s, "intra-gpu": cal.latency_s},
        cpu_adam_gparams_s=cal.adam_gparams_s,
        host_mem_gib=args.host_mem_gb or cal.device.mem_gib * cluster.ranks_per_node,
    )


def run(args: argparse.Namespace) -> int:
    """Print the prediction (or the search's table); 1 when the layout (or every layout) does not
    fit."""
    from strata import config
    from strata.config.checks import cross_problems
    from strata.data.tokens import planned_vocab
    from strata.plan import report
    from strata.plan.memory import estimate_memory
    from strata.plan.search import search, with_layout
    from strata.plan.timing import estimate_time

    cfg = config.load(args.config, args.overrides)
    vocab = planned_vocab(cfg)
    cluster = _cluster(args, cfg, vocab)
    if not args.json:
        print(f"strata plan: {cluster.describe()}; vocabulary {vocab}")
    if args.search:
        result = search(cfg, cluster, vocab, cross_problems)
        if args.json:
            best = result.fitting[: args.top]
            rows = [
                {
                    **vars(p.candidate),
                    "step_s": p.time.step_s,
                    "device_bytes": p.memory.peak("device"),
                }
                for p in best
            ]
            print(json.dumps(rows, indent=1))
        else:
            print("\n".join(report.search_table(result, cluster, args.top, cfg)))
        return 0 if result.fitting else 1
    cfg = with_layout(cfg, cluster, {})
    problems = config.cross_problems(cfg, cluster.world_size)
    if problems:
        raise ConfigError(problems)
    memory = estimate_memory(cfg, cluster, vocab)
    est = estimate_time(cfg, cluster, vocab)
    if args.json:
        worst = memory.worst("device")
        figures = {
            "fits": memory.fits(),
            "memory": {f"{k}/{t}": v for (k, t), v in worst.bytes.items()},
            "step_s": est.step_s,
            "parts": est.parts,
            "link_bytes": est.link_bytes,
            "mfu": est.mfu,
        }
        print(json.dumps(figures, indent=1))
    else:
        tokens = cfg.train.global_batch_size * cfg.model.seq_len
        print("layout: " + report.layout_line(cfg, cluster))
        print("\n".join(report.memory_table(memory) + report.time_table(est, tokens)))
        if not memory.fits():
            print(
                "does not fit: " + "; ".join(memory.problems()) + "\n  `--search` lists layouts "
                "that fit"
            )
    return 0 if memory.fits() else 1
