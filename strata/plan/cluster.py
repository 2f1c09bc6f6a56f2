"""What the planner knows of the machines: a device (memory, sustained matmul rate, memory
bandwidth) and a cluster (how many nodes, GPUs and GCDs, and the bandwidth and latency of each
link level), from a small table of known hardware, from flags, or calibrated on this machine.

Bandwidths are in Gbit/s in one direction, as network links are quoted: `intra_gpu_gbps` joins
the two GCDs of one GPU, `intra_node_gbps` is each GPU's link into the node's fabric (NVLink,
Infinity Fabric), and `inter_node_gbps` is the node's whole network bandwidth (all its NICs),
which the node's ranks share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from strata.errors import ConfigError

LINKS = ("intra-gpu", "intra-node", "inter-node")  # the link levels parallel.topology names


@dataclass(frozen=True)
class Device:
    """One rank's accelerator (a GCD of a two-die GPU counts as one)."""

    name: str
    mem_gib: float  # memory a rank may fill
    peak_tflops: float  # dense bf16 peak (fp32 for a CPU): MFU's denominator
    matmul_efficiency: float  # share of peak that large matmuls sustain (1.0 when measured)
    mem_bw_gbs: float  # memory bandwidth in GB/s, which element-wise work is bound by
    # fp32 rate (0: the bf16 one), the model's rate under train.precision=fp32
    fp32_tflops: float = 0.0
    # calibrated: peak_tflops is a whole forward/backward's rate, element-wise work included
    measured: bool = False
    # a CPU rank: its "device" is host memory, so moving state to the host moves nothing
    host_memory: bool = False
    # dense float8 peak (0: no float8 matmuls, float8 runs at the bf16 rate)
    fp8_tflops: float = 0.0
    # share of peak flash attention (SDPA's fused kernel) sustains, forward and backward
    # together, counting the causal half of the score matrix (0: the matmul efficiency)
    attention_efficiency: float = 0.0
    tdp_w: float = 0.0  # the board power its sustained rates are quoted at (0: not known)

    @property
    def sustained_tflops(self) -> float:
        """The dense bf16 TFLOP/s large matmuls reach: the peak times the matmul efficiency."""
        return self.peak_tflops * self.matmul_efficiency

    def rate_tflops(self, precision: str) -> float:
        """Sustained matmul TFLOP/s at the config's precision: under fp8 the float8 rate, which only
        the transformer blocks' linear layers run at (see `strata.plan.timing`)."""
        if precision == "fp32" and self.fp32_tflops:
            return self.fp32_tflops * self.matmul_efficiency
        if precision == "fp8" and self.fp8_tflops:
            return self.fp8_tflops * self.matmul_efficiency
        return self.sustained_tflops

    def attention_tflops(self, precision: str) -> float:
        """Sustained TFLOP/s of fused (flash) attention, which runs in bf16 under fp8 too."""
        if precision == "fp32" or not self.attention_efficiency:
            return self.rate_tflops("bf16" if precision == "fp8" else precision)
        return self.peak_tflops * self.attention_efficiency


# Peaks and memory bandwidths are the vendors' data-sheet figures. Matmul efficiencies are the
# share of peak large bf16 GEMMs sustain in a training step (cuBLAS on A100 about 0.8 for the shapes
# of a transformer layer; rocBLAS/hipBLASLt on an MI250X GCD about 0.6); the time model adds each
# GEMM's operand traffic at memory bandwidth, which keeps small GEMMs further below. fp32_tflops is
# TF32 on NVIDIA parts, which torch uses for fp32 matmuls when allowed. H100 and H200 are fitted
# instead, to published whole training steps on H100 (Megatron-LM's DGX-H100 table and
# torchtitan's Llama 3.1 runs, bench/plan_published.py: 0.55 centres their predicted/published
# ratios on 1): Hopper's GEMMs alone reach about 0.75 of its peak, but not at a full step's power
# draw with communication kernels sharing the SMs. Their attention efficiency is
# FlashAttention-2's (what SDPA runs on Hopper): about 350 TFLOP/s forward at head size 128 as the
# FlashAttention-3 paper measures it, less backward; their float8 peak is dense, at 700 W (SXM).
H100_MATMUL = 0.55
HOPPER_ATTENTION = 0.30
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("a100-40gb", 40.0, 312.0, 0.80, 1555.0, 156.0),
        Device("a100-80gb", 80.0, 312.0, 0.80, 2039.0, 156.0),
        Device(
            "h100", 80.0, 989.0, H100_MATMUL, 3350.0, 495.0,
            fp8_tflops=1979.0, attention_efficiency=HOPPER_ATTENTION, tdp_w=700.0,
        ),
        Device(
            "h200", 141.0, 989.0, H100_MATMUL, 4800.0, 495.0,
            fp8_tflops=1979.0, attention_efficiency=HOPPER_ATTENTION, tdp_w=700.0,
        ),
        Device("mi250x-gcd", 64.0, 191.5, 0.60, 1638.0, 95.7),
        Device("mi300x", 192.0, 1307.0, 0.60, 5300.0, 653.0, fp8_tflops=2615.0),
    )
}  # fmt: skip


def power_capped(device: Device, watts: float) -> Device:
    """`device` held to `watts` below its board power: dynamic power grows with clock × voltage²
    and voltage with clock, so the clock, and with it every compute-bound rate (matmuls,
    attention; not memory bandwidth), falls as the cube root of the power. The peak, MFU's
    denominator, stays the data sheet's."""
    if not device.tdp_w or watts >= device.tdp_w:
        return device
    scale = (watts / device.tdp_w) ** (1 / 3)
    return replace(
        device,
        name=f"{device.name}-{watts:g}w",
        matmul_efficiency=device.matmul_efficiency * scale,
        attention_efficiency=device.attention_efficiency * scale,
        tdp_w=watts,
    )


# torchtitan's published H100 runs: Meta's Grand Teton hosts hold each H100 to 500 W
DEVICES["h100-500w"] = power_capped(DEVICES["h100"], 500.0)


@dataclass(frozen=True)
class Cluster:
    """Nodes × GPUs per node × ranks per GPU of one device, and the links between them."""

    nodes: int
    gpus_per_node: int
    device: Device
    ranks_per_gpu: int = 1
    intra_gpu_gbps: float = 1600.0
    intra_node_gbps: float = 2400.0
    inter_node_gbps: float = 1600.0
    latency_s: dict[str, float] = field(
        default_factory=lambda: {"intra-gpu": 5e-6, "intra-node": 10e-6, "inter-node": 20e-6}
    )
    host_mem_gib: float = 1024.0  # per node
    host_link_gbps: float = 200.0  # device <-> host, per GPU (PCIe 4 x16: about 25 GB/s)
    nvme_gbps: float = 50.0  # per node, read or write (a few NVMe drives)
    # AdamW updates per second on the host, per rank, in 1e9 parameters
    cpu_adam_gparams_s: float = 1.0
    # Every rank runs on one machine's cores (a namespaced test cluster, calibrated with all ranks
    # computing at once): a rank that waits frees its share for the others, so compute is the job's
    # work spread evenly over the ranks, and a pipeline's bubble idles no core.
    shared_cores: bool = False

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node: GPUs per node times ranks (GCDs) per GPU."""
        return self.gpus_per_node * self.ranks_per_gpu

    @property
    def world_size(self) -> int:
        """Ranks in the whole cluster."""
        return self.nodes * self.ranks_per_node

    def bandwidth_bytes_s(self, link: str) -> float:
        """Bytes per second one way over `link` (for inter-node: the whole node's share)."""
        gbps = {
            "intra-gpu": self.intra_gpu_gbps,
            "intra-node": self.intra_node_gbps,
            "inter-node": self.inter_node_gbps,
        }
        return gbps[link] * 1e9 / 8

    def describe(self) -> str:
        """One line for the planner's output: nodes, GPUs (and GCDs) of which device, and the links'
        bandwidths."""
        gpus = f"{self.gpus_per_node} GPUs" + (
            f" × {self.ranks_per_gpu} GCDs" if self.ranks_per_gpu > 1 else ""
        )
        return (
            f"{self.nodes} node(s) × {gpus} of {self.device.name} ({self.device.mem_gib:g} GiB, "
            f"{self.device.peak_tflops:g} TFLOP/s peak); links: intra-node "
            f"{self.intra_node_gbps:g} Gbit/s per GPU, "
            f"inter-node {self.inter_node_gbps:g} Gbit/s per node"
            + (f", intra-gpu {self.intra_gpu_gbps:g} Gbit/s" if self.ranks_per_gpu > 1 else "")
        )


# A system's figures, in this order: GPUs per node and ranks per GPU, the device, then Gbit/s one
# way between a GPU's two GCDs, from each GPU into the node, of the node's network, between a GPU
# and the host, and of the node's NVMe; and the node's host memory in GiB. (A one-die GPU keeps
# Cluster's intra-GPU default, which nothing uses.)
SYSTEM_FIELDS = (
    "gpus_per_node",
    "ranks_per_gpu",
    "device",
    "intra_gpu_gbps",
    "intra_node_gbps",
    "inter_node_gbps",
    "host_link_gbps",
    "nvme_gbps",
    "host_mem_gib",
)

# Systems whose published runs the planner is checked against (docs/PLAN.md gives the sources):
# DGX A100 (NVLink 3: 300 GB/s per GPU each way, 8 × 200 Gbit/s HDR InfiniBand per node, PCIe 4),
# DGX H100 (NVLink 4: 450 GB/s, 8 × 400 Gbit/s NDR, PCIe 5), Grand Teton (the same links and
# 400 Gbit/s RDMA per GPU, its H100s at 500 W) and an HPE Cray EX node of Frontier
# (4 MI250X = 8 GCDs; 200 GB/s between a GPU's two GCDs, 50 GB/s between GPUs, 4 × 200 Gbit/s
# Slingshot, 36 GB/s CPU-GCD links, 512 GiB DDR4, two NVMe drives).
PRESETS: dict[str, dict] = {
    name: dict(zip(SYSTEM_FIELDS, figures))
    for name, *figures in (
        ("dgx-a100", 8, 1, "a100-80gb", 1600.0, 2400.0, 1600.0, 200.0, 200.0, 2048.0),
        ("dgx-h100", 8, 1, "h100", 1600.0, 3600.0, 3200.0, 400.0, 200.0, 2048.0),
        ("grand-teton", 8, 1, "h100-500w", 1600.0, 3600.0, 3200.0, 400.0, 200.0, 2048.0),
        ("frontier", 4, 2, "mi250x-gcd", 1600.0, 400.0, 800.0, 288.0, 64.0, 512.0),
    )
}


def ram_gib() -> float:
    """This machine's physical memory, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def device_named(name: str) -> Device:
    """The known device called `name`; ConfigError listing the known ones otherwise."""
    key = name.lower()
    if key not in DEVICES:
        raise ConfigError(
            [
                f"--gpu {name!r} is not a known device; known: {', '.join(DEVICES)} (or give "
                "--gpu-mem-gb and --tflops)"
            ]
        )
    return DEVICES[key]


def preset(name: str, nodes: int, **changes) -> Cluster:
    """`nodes` nodes of a known system (PRESETS), with `changes` applied."""
    if name not in PRESETS:
        raise ConfigError([f"unknown system {name!r}; known: {', '.join(PRESETS)}"])
    values = dict(PRESETS[name])
    values["device"] = device_named(values["device"])
    return replace(Cluster(nodes=nodes, **values), **changes)


def cpu_cluster(
    nodes: int, ranks_per_node: int, ranks_per_gpu: int = 1, tflops: float = 0.01
) -> Cluster:
    """This kind of machine, CPU ranks standing in for GPUs (memory figures only need the shape)."""
    cpu = Device("cpu", 1e9, tflops, 1.0, 10.0, measured=True, host_memory=True)
    return Cluster(
        nodes=nodes,
        gpus_per_node=ranks_per_node // ranks_per_gpu,
        device=cpu,
        ranks_per_gpu=ranks_per_gpu,
    )
