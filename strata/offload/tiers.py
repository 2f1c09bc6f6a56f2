"""The memory tiers a config asks for, built over a ZeRO engine in one place: the host pool, the swap
directory and I/O engine, the parameter and optimizer tiers, the Deep Optimizer States placement,
and the activation offloader — with every start-up check (paths, disk space, host memory) done
before the first step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from strata.config.vocabulary import (
    OFFLOAD_STREAM_KEYS,
    SLABS_PER_STREAM,
    offload_devices,
    pool_streams,
)
from strata.errors import ConfigError
from strata.offload.activations import ActivationOffloader
from strata.offload.files import SwapDir, SwapFile
from strata.offload.io_engine import IOEngine, aligned
from strata.offload.optim import KIND_OF, TRAFFIC, OptimTier
from strata.offload.params import ParamTier
from strata.offload.placement import Measured, Placement, calibrate, plan
from strata.offload.pool import HostPool
from strata.offload.swap import FileRegion, Mover, Where
from strata.parallel.runtime import proc_status_bytes

if TYPE_CHECKING:
    from strata.config.schema import Config, ParamOffloadConfig
    from strata.parallel.zero import ZeroEngine


class Tiers:
    """See the module docstring. `engine` may be None when only activations are offloaded."""

    def __init__(self, cfg: Config, engine: ZeroEngine | None, rank: int, device: torch.device):
        off, act = cfg.offload, cfg.activations
        self.engine = engine
        devices = offload_devices(cfg)
        self.notes: list[str] = []
        if device.type == "cpu" and devices["params"] == "cpu":
            # the shards already live in host memory: moving them to other host memory costs two
            # copies per use and saves nothing (the tier's copy path runs on GPU machines)
            devices["params"] = "none"
            self.notes.append(
                "offload.params.device=cpu: the parameters already live in host memory (no GPU), "
                "nothing to move"
            )
        streams = pool_streams(devices)
        groups = engine.groups if engine is not None else []
        resident = 0
        if devices["params"] == "cpu":
            resident += sum(aligned(g.shard.numel() * g.shard.element_size()) for g in groups)
        slab = int(off.slab_mb * 2**20)
        if devices["optim"] != "none":
            resident += OptimTier.needs_resident_bytes(
                groups, KIND_OF[devices["optim"]], device, slab
            )
        _check_host_memory(resident)
        self.pool = HostPool(
            int(off.host_buffer_mb * 2**20), slab, resident, {s: SLABS_PER_STREAM for s in streams}
        )
        self.swap: SwapDir | None = None
        if "nvme" in devices.values():
            assert off.nvme_path is not None, (
                "the config's checks require offload.nvme_path for nvme"
            )
            self.swap = SwapDir(off.nvme_path, rank)
        self.io = IOEngine(off.io_threads, slab, off.direct_io) if self.swap else None
        self.movers = {s: Mover(self.pool, self.io, s) for s in streams}
        self.placement: Placement | None = None
        self.measured: Measured | None = None
        self.param_tier: ParamTier | None = None
        self.optim_tier: OptimTier | None = None
        if engine is not None and (devices["params"] != "none" or devices["optim"] != "none"):
            self._build_zero_tiers(engine, devices, off.params, off.optim.update_on, device)
        if self.swap:
            self.swap.preallocate({kind: OFFLOAD_STREAM_KEYS[kind] for kind in self.swap.files})
        if self.param_tier is not None:
            self.param_tier.start()
        self.activations = None
        if act.offload != "none":
            nvme = act.offload == "nvme"
            inflight = None if act.max_inflight_mb is None else int(act.max_inflight_mb * 2**20)
            self.activations = ActivationOffloader(
                act.offload,
                act.min_bytes,
                self.movers.get("activations"),
                self._swap_file("activations") if nvme else None,
                inflight,
            )

    def _build_zero_tiers(
        self,
        engine: ZeroEngine,
        devices: dict[str, str],
        params: ParamOffloadConfig,
        update_on: str,
        device: torch.device,
    ) -> None:
        groups = engine.groups
        if devices["params"] != "none":
            where: dict[str, Where] = {}
            for g in groups:
                nbytes = g.shard.numel() * g.shard.element_size()
                if devices["params"] == "nvme":
                    f = self._swap_file("params")
                    where[g.name] = FileRegion(f, f.region(nbytes), nbytes)
                else:
                    where[g.name] = self.pool.resident(nbytes, g.shard.dtype)
            resident = None if params.resident_mb is None else int(params.resident_mb * 2**20)
            sharing = (
                engine.topo.layout.node_size
                if device.type == "cpu"
                else engine.topo.layout.ranks_per_gpu
            )
            self.param_tier = ParamTier(
                groups,
                self.movers["params"],
                where,
                params.read_ahead,
                params.keep_groups,
                resident,
                lambda: free_device_bytes(device, sharing),
            )
        kind = KIND_OF[devices["optim"]]
        optim_tier = self.optim_tier = OptimTier(
            groups,
            engine.optimizer,
            kind,
            self.pool,
            self.io,
            self._swap_file("optim") if kind == "nvme" else None,
            self.param_tier,
            mover=self.movers.get("optim"),
        )
        if kind != "device":
            # a sample as large as the state (up to 16M elements): a cache-sized one overstates CPU
            # Adam
            total = sum(sg.size for sg in optim_tier.subgroups)
            self.measured = replace(
                calibrate(device, sample_elems=min(1 << 24, max(1 << 20, total))), traffic=TRAFFIC
            )
            self.placement = plan(
                [sg.size for sg in optim_tier.subgroups], self.measured, update_on
            )
            optim_tier.place(list(self.placement.on_gpu))
        engine.use_tiers(self.param_tier, self.optim_tier)

    def _swap_file(self, kind: str) -> SwapFile:
        assert self.swap is not None, "nvme offload has a swap directory"
        return self.swap.file(kind)

    # --- checkpoints ------------------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, changed: bool = False) -> Iterator[None]:
        """Every offloaded shard and moment in memory inside the block, for a checkpoint save
        (or, with `changed`, a load: shards written back, moments taken over, on the way out)."""
        groups = self.engine.groups if self.engine is not None else []
        with contextlib.ExitStack() as stack:
            if self.param_tier is not None:
                stack.enter_context(self.param_tier.held(groups, changed))
            if self.optim_tier is not None and not changed:
                stack.enter_context(self.optim_tier.materialized())
            yield
        if changed and self.optim_tier is not None:
            self.optim_tier.adopt()

    # --- reporting --------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Counters for metrics.jsonl: swap bytes moved, time compute waited on them, pool peaks."""
        out: dict[str, Any] = {
            "pool_peak_bytes": self.pool.peak_staging_bytes,
            "pool_resident_bytes": self.pool.resident_bytes,
            "pool_waits": self.pool.waits,
            "host_peak_bytes": proc_status_bytes("VmHWM"),
            "io_stall_s": sum(m.stalled_s for m in self.movers.values()),
        }
        if self.param_tier is not None:
            out["params_resident_bytes"] = self.param_tier.resident_bytes
        if self.io is not None:
            assert self.swap is not None, "an I/O engine comes with a swap directory"
            out.update(
                io_read_bytes=self.io.bytes_read,
                io_write_bytes=self.io.bytes_written,
                swap_file_bytes={k: max(f.size, f.allocated) for k, f in self.swap.files.items()},
            )
        if self.activations is not None:
            stats = self.activations.stats
            out["activations"] = {
                k: stats[k]
                for k in (
                    "packed",
                    "deduplicated",
                    "bytes_offloaded",
                    "reads",
                    "forwarded",
                    "peak_live_saved_bytes",
                )
            }
        return out

    def startup_record(self) -> dict:
        """What was decided at start-up, logged once: the placement and the measurements behind it."""
        record: dict[str, Any] = {
            "offload_pool_bytes": self.pool.n_slabs * self.pool.slab_bytes,
            "offload_resident_bytes": self.pool.resident_bytes,
        }
        if self.placement is not None:
            assert self.measured is not None, "a placement is planned from measurements"
            record["offload_placement"] = self.placement.as_record()
            record["offload_calibration"] = self.measured.as_record()
        return record

    def close(self) -> None:
        """Release everything the tiers hold: activation buffers, the movers, the I/O engine, the
        swap files and the host pool."""
        if self.activations is not None:
            self.activations.close()
        for m in self.movers.values():
            m.close()
        if self.io is not None:
            self.io.close()
        if self.swap is not None:
            self.swap.close()
        self.pool.close()


RESIDENT_MARGIN = 0.1  # of the device's memory, left free by an automatic resident budget


def free_device_bytes(device: torch.device, sharing: int = 1) -> int:
    """What this rank may still fill on `device`, judged just after a step: free memory, less what
    the step took beyond its current use at its peak (it takes that again next step), less a margin
    of 10% of the device's memory, split among the `sharing` ranks on the device."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        transient = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    else:
        info = _meminfo()
        free, total = info.get("MemAvailable", 0), info.get("MemTotal", 0)
        transient = proc_status_bytes("VmHWM") - proc_status_bytes("VmRSS")
    return max(0, int((free - RESIDENT_MARGIN * total) / max(1, sharing) - transient))


def _meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}


def _check_host_memory(nbytes: int) -> None:
    """State kept in host memory is sized exactly at start-up: refuse it now if it cannot fit."""
    if nbytes == 0:
        return
    available = _meminfo().get("MemAvailable", 0)
    if nbytes > 0.9 * available:
        raise ConfigError(
            [
                f"offload to cpu needs {nbytes / 2**30:.2f} GiB of host memory on this rank, but "
                f"only {available / 2**30:.2f} GiB is available; offload to nvme instead "
                "(offload.nvme_path), or use more ranks"
            ]
        )
