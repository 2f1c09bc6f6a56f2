"""Process start-up: join the torch.distributed world that torchrun (or srun) describes in the
environment, pick the device, and leave cleanly."""

from __future__ import annotations

import ctypes
import datetime
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from strata.parallel import comm


@dataclass(frozen=True)
class Runtime:
    """This process's place in the world: its rank, the world size, its rank and the ranks on its
    node, and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # ranks on this node, as the launcher says (None: not launched)
    local_world_size: int | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_size_from_env() -> int:
    """The world size torchrun (or srun) put in WORLD_SIZE; 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size_from_env() -> int | None:
    """The ranks on this node that torchrun (or srun) put in LOCAL_WORLD_SIZE; None when not launched."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None


def start(backend: str = "auto", timeout_s: int = 600) -> Runtime:
    """Initialise the default process group if the environment names a world of > 1 process."""
    world = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        chosen = ("nccl" if use_cuda else "gloo") if backend == "auto" else backend
        dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s))
    return Runtime(rank, world, local_rank, device, local_world_size_from_env())


def stop(wait_for_peers: bool = True) -> None:
    """Leave the world, after the other ranks are done with it too (`wait_for_peers`): a rank
    that tears its groups down while a peer still talks to them makes the peer's gloo abort. On
    an error path do not wait: the peers may never come."""
    if dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        comm.forget_groups()
        dist.destroy_process_group()


def pin_host(buffer: torch.Tensor) -> bool:
    """Page-lock a whole host buffer for CUDA once (cudaHostRegister), so copies between it and
    the GPU are DMA; False, leaving it pageable (it still works, only slower), without CUDA or if
    CUDA refuses. Not `tensor.pin_memory()`: that copies, rounds up to a power of two and keeps
    the block cached for the rest of the process."""
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    cudart = torch.cuda.cudart()
    nbytes = buffer.numel() * buffer.element_size()
    err = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(err) == 0:
        return True
    _clear_cuda_error()
    warnings.warn(
        f"cudaHostRegister of a {nbytes}-byte host buffer failed "
        f"({cudart.cudaGetErrorString(err)}); it "
        "stays pageable: host-device copies through it will be slower",
        stacklevel=2,
    )
    return False


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error, or it is reported again at the next unrelated kernel
    launch, which torch then raises (seen on an H100: cudaErrorHostMemoryAlreadyRegistered). torch
    binds no cudaGetLastError, so call it in the libcudart this process has loaded."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart" in line), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except (AttributeError, OSError):
        pass


def unpin_host(buffer: torch.Tensor) -> None:
    """Undo `pin_host` (call only when it returned True)."""
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


# --- this process's host memory ------------------------------------------------------------


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on `device` can still get: the GPU's free memory, or the host's
    MemAvailable (/proc/meminfo); None where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM: the peak), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{field} is not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (writing 5 to /proc/self/clear_refs); False where the
    kernel refuses or the peak does not drop, so VmHWM stays the lifetime peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        # within pages of RSS
        return proc_status_bytes("VmHWM") <= proc_status_bytes("VmRSS") + 2**20
    except (OSError, KeyError):
        return False
