"""Before a job starts: this machine as a cluster, and the warning `strata launch` and `strata config
show --world-size` print when the predicted per-rank memory exceeds what a rank will have."""

from __future__ import annotations

from pathlib import Path

from strata.config.schema import Config
from strata.plan.cluster import Cluster, Device, ram_gib
from strata.plan.memory import estimate_memory, gib

GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd")  # the NVIDIA and ROCm drivers' device files


def this_machine(nodes: int, ranks_per_node: int, ranks_per_gpu: int = 1) -> Cluster:
    """`nodes` machines like this one: its GPU (memory from CUDA), or on a CPU-only machine each
    rank's share of the physical memory (where device and host are one memory)."""
    device = _gpu()
    if device is not None:
        return Cluster(
            nodes, ranks_per_node // ranks_per_gpu, device, ranks_per_gpu, host_mem_gib=ram_gib()
        )
    share = ram_gib() / ranks_per_node
    return Cluster(
        nodes,
        ranks_per_node // ranks_per_gpu,
        Device("cpu", share, 1.0, 1.0, 1.0, host_memory=True),
        ranks_per_gpu,
        host_mem_gib=0.0,
    )


def _gpu() -> Device | None:
    """This machine's first GPU as CUDA describes it, or None."""
    if not any(Path(node).exists() for node in GPU_DRIVER_NODES):
        # CUDA (HIP) cannot be available, and `strata launch` is spared importing torch (seconds)
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return Device(props.name, props.total_memory / 2**30, 1.0, 1.0, 1.0)


def memory_warning(cfg: Config, nodes: int, ranks_per_node: int, vocab: int) -> str | None:
    """One line when the layout is predicted not to fit this machine's ranks (the model's padded
    vocabulary `vocab`), else None."""
    cluster = this_machine(nodes, ranks_per_node, cfg.parallel.ranks_per_gpu)
    memory = estimate_memory(cfg, cluster, vocab)
    worst = memory.worst("device")
    need = worst.total("device")
    if cluster.device.host_memory:  # one memory: what goes to the "host" tier counts too
        worst = max(memory.stages, key=lambda r: r.total("device") + r.total("host"))
        need = worst.total("device") + worst.total("host")
    budget = memory.device_budget
    if need <= budget:
        return None
    what = "GPU memory" if not cluster.device.host_memory else "its share of this machine's memory"
    return (
        f"predicted memory per rank is {gib(need)} (pipeline stage {worst.pp_rank}) but a rank has "
        f"{gib(budget)} of {what}; the job will likely run out of memory. `strata plan CONFIG "
        "--search` lists layouts that fit"
    )
