"""The activation policy (SSDTrain-style): `ActivationOffloader` moves the tensors autograd saves
for backward to host memory or an SSD swap file during forward and brings them back a layer ahead
in backward, through `saved_tensors_hooks` (no model code changes); `apply_recompute` makes
every transformer block recompute its forward, or all of it but the matmuls, in backward instead
(torch.utils.checkpoint, selective activation checkpointing).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import mmap
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from strata.model import named_blocks
from strata.offload.files import SwapFile
from strata.offload.io_engine import aligned
from strata.offload.swap import FileRegion, Mover, Transfer
from strata.parallel.runtime import pin_host, unpin_host

# none: nothing moves, saved bytes are only counted (the bench's "keep")
MODES = ("none", "cpu", "nvme")
# the swap file grows in steps of at least this, so a first step grows it a few times only
GROW_MIN = 64 << 20
# writes handed to the mover at once: enough to keep it busy, few for a read to queue behind
WRITE_WINDOW = 2

Key = tuple[int, int, int]  # (part, micro-batch, layer)


def blocks_of(part: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT or a pipeline stage, in forward order."""
    return [block for _, block in named_blocks(part)]


@dataclass(eq=False)
class _Entry:
    """One saved storage, stored once however many saved tensors view it."""

    key: Key
    nbytes: int
    device: torch.device
    kept: bool  # held by reference: small, or mode "none"
    storage: weakref.ref  # the live storage it stands for (dedup)
    handles: int = 0
    # the original, until its copy is written (or not needed)
    src: torch.UntypedStorage | None = None
    write: Transfer | None = None  # submitted, not yet reaped
    host: torch.Tensor | None = None  # mode cpu: the host buffer holding the copy
    region: FileRegion | None = None  # mode nvme
    read: Transfer | None = None
    # what unpack rebuilds from: src forwarded, or read back
    loaded: torch.UntypedStorage | None = None
    released: bool = False
    held: tuple[int, int] = (0, 0)  # (device, host) bytes counted for it now

    def in_flight(self) -> Transfer:
        """The write of an entry in the offloader's `_pending` (set before it goes there, cleared as it leaves)."""
        assert self.write is not None
        return self.write


class _Saved:
    """What autograd stores for one saved tensor: its entry and how to rebuild the view. Dropped by
    autograd when the saved variable goes (after the last backward that needs it, which for a
    zero-bubble schedule is not the first unpack) — that, not unpacking, releases the entry."""

    __slots__ = (
        "owner",
        "entry",
        "dtype",
        "offset",
        "size",
        "stride",
        "tensor",
        "origin",
        "version",
    )

    def __init__(self, owner: ActivationOffloader, entry: _Entry, t: torch.Tensor):
        self.owner, self.entry = owner, entry
        self.dtype, self.offset, self.size, self.stride = (
            t.dtype,
            t.storage_offset(),
            t.size(),
            t.stride(),
        )
        # detached: holding an op's own output (with its grad_fn) from its node would be a cycle
        self.tensor = t.detach() if entry.kept else None
        self.origin, self.version = weakref.ref(t), t._version

    def __del__(self) -> None:
        try:
            self.owner._handle_dropped(self.entry)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to release
            pass


class _HostBuffers:
    """Host copies for mode cpu: page-aligned buffers kept for reuse by size (a model saves the same
    sizes every micro-batch and step), page-locked once each when they back CUDA tensors. Not
    `pin_memory()`, which rounds up to a power of two and caches for the rest of the process; a
    size not used for a whole step is given back at `trim`."""

    def __init__(self) -> None:
        self._free: dict[int, list[tuple[torch.Tensor, bool]]] = {}
        self._pinned: dict[int, bool] = {}  # data_ptr -> pinned, for every buffer alive
        self._used: set[int] = set()
        self.reserved_bytes = 0

    def take(self, nbytes: int, for_cuda: bool) -> torch.Tensor:
        """A page-aligned host buffer of at least `nbytes`: a kept one of that size, else a new one
        (page-locked when it backs CUDA tensors)."""
        size = aligned(nbytes)
        self._used.add(size)
        free = self._free.get(size)
        if free:
            buf, _ = free.pop()
        else:
            buf = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
            self._pinned[buf.data_ptr()] = for_cuda and pin_host(buf)
            self.reserved_bytes += size
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        """Keep `buf` for the next `take` of its size."""
        self._free.setdefault(buf.numel(), []).append((buf, self._pinned[buf.data_ptr()]))

    def trim(self) -> None:
        """Free the kept buffers of every size not taken since the last trim (the step's sizes
        stay)."""
        for size in [s for s in self._free if s not in self._used]:
            for buf, pinned in self._free.pop(size):
                self._drop(buf, pinned)
        self._used.clear()

    def close(self) -> None:
        """Free every kept buffer."""
        self._used.clear()
        self.trim()

    def _drop(self, buf: torch.Tensor, pinned: bool) -> None:
        if pinned:
            unpin_host(buf)
        del self._pinned[buf.data_ptr()]
        self.reserved_bytes -= buf.numel()


class ActivationOffloader:
    """Saved-tensor hooks that offload activations (see the module docstring).

    `mode` "cpu" copies each saved storage to host memory (for a CUDA tensor a D2H copy into a
    page-locked buffer, on `mover`'s side stream when given; on a CPU model a plain copy);
    "nvme" writes it to a bump-allocated region of `swap_file` through `mover` (the pool's slabs,
    on the mover's thread); "none" moves nothing and only counts. Leaves (parameters, buffers,
    inputs) and views of them are kept by reference — under ZeRO-3 a weight is a view of a storage
    that is freed and regathered, so a copy would be wrong — and so are storages under
    `min_bytes`. A storage saved by several ops is stored once (keyed by its live identity, never
    by a reused address).

    Writes are handed to the mover a few at a time, in the order tensors were saved; until its
    copy is written the original stays alive, so an unpack meanwhile is served from it for free,
    and a write not yet started when backward has already used (or freed) the tensor is skipped.
    In backward, the first unpack of a layer reads that layer's and the previous layer's entries
    of the same part and micro-batch. `max_inflight_bytes` bounds the originals held for unwritten
    copies (forward then waits for the disk); None never waits, and then holds at most what
    keeping the activations would, for as long as the disk lags compute.

    `attach(parts)` once, `with saving():` around a step's forward+backward, `end_step()` after it.
    The mover and swap file belong to the caller; `close()` leaves them open."""

    def __init__(
        self,
        mode: str,
        min_bytes: int,
        mover: Mover | None = None,
        swap_file: SwapFile | None = None,
        max_inflight_bytes: int | None = None,
    ):
        if mode not in MODES:
            raise ValueError(
                f"activation offload mode {mode!r}: expected one of {', '.join(MODES)}"
            )
        if mode == "nvme" and (mover is None or swap_file is None):
            raise ValueError("activations.offload=nvme needs a mover and the activation swap file")
        self.mode, self.min_bytes = mode, min_bytes
        self.mover, self.swap_file = mover, swap_file
        self.max_inflight_bytes = max_inflight_bytes
        self._host = _HostBuffers()
        self._lock = threading.Lock()
        # entries of handles autograd dropped, not yet processed
        self._dropped: deque[_Entry] = deque()
        self._hooks: list[Any] = []
        self._mb: dict[int, int] = {}
        self._current: Key = (0, 0, 0)
        self._file_peak = 0
        self._new_step()
        self._live_handles = 0
        # bytes held now: [on the tensors' device, host copies of device tensors]
        self._live = [0, 0]
        self._peak = [0, 0]
        self._count = dict(
            packed=0,
            deduplicated=0,
            skipped_leaf=0,
            skipped_small=0,
            skipped_other=0,
            counted=0,
            writes=0,
            writes_skipped=0,
            bytes_offloaded=0,
            reads=0,
            demand_reads=0,
            bytes_read=0,
            forwarded=0,
            file_grows=0,
            steps=0,
        )

    # --- the public interface -------------------------------------------------------------------
    def attach(self, parts: list[nn.Module]) -> None:
        """Key saved tensors by (part, micro-batch, block): a forward-pre hook on every block sets
        the block index, and each forward of a part's first block starts a new micro-batch."""
        for pi, part in enumerate(parts):
            for li, block in enumerate(blocks_of(part)):
                self._hooks.append(
                    block.register_forward_pre_hook(functools.partial(self._enter_block, pi, li))
                )

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Offload what autograd saves inside (backward needs no context: the hooks are captured
        when a tensor is saved)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def flush(self) -> None:
        """Write every copy still unwritten and wait for it (the originals are then dropped)."""
        with self._locked():
            self._pump(window=None)
            while self._pending:
                self._pending[0].in_flight().wait()
                self._reap(window=None)

    def end_step(self) -> None:
        """After a step's backward: checks that autograd dropped every saved tensor of the step,
        waits for the I/O still in flight, and frees the swap file's regions for the next step."""
        with self._locked():
            pass
        if self._live_handles:
            gc.collect()  # a graph kept only by a reference cycle
            with self._locked():
                pass
        if self._live_handles:
            raise RuntimeError(
                f"activation offload: {self._live_handles} tensors saved for backward in this step "
                f"are still referenced at its end ({self._live[0] + self._live[1]} bytes held); "
                "was backward run on every micro-batch, and no output kept with its graph?"
            )
        with self._locked():
            self._finish_transfers()
            self._host.trim()
            self._count["steps"] += 1
            self._new_step()

    def close(self) -> None:
        """Remove the hooks, finish the I/O in flight and free the host buffers (the mover and the
        file stay open)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        with self._locked():
            with contextlib.suppress(Exception):
                self._finish_transfers()
            self._new_step()
            self._host.close()

    @property
    def stats(self) -> dict[str, float]:
        """Counters since construction. packed: saves stored by an offload entry (deduplicated
        included); counted: saves only counted (mode none); writes/reads: storages copied out and
        back; writes_skipped: copies never needed (used or freed before their turn); forwarded:
        storages served from memory because their copy was not written yet; demand_reads: reads
        issued only when backward needed them (the rest were prefetched); peak_live_saved_bytes:
        the most bytes of saved tensors held by the hooks at once on the tensors' device (for a
        CPU model that includes host copies); peak_host_saved_bytes: host copies of device
        tensors; host_reserved_bytes: host buffers kept for reuse; file_bytes: the swap file's
        reserved size; io_stall_s: time compute waited on the mover."""
        return {
            **self._count,
            "live_saved_bytes": self._live[0],
            "peak_live_saved_bytes": self._peak[0],
            "peak_host_saved_bytes": self._peak[1],
            "host_reserved_bytes": self._host.reserved_bytes,
            "file_bytes": self.swap_file.allocated if self.swap_file is not None else 0,
            "file_step_peak_bytes": self._file_peak,
            "io_stall_s": self.mover.stalled_s if self.mover is not None else 0.0,
        }

    def reset_peaks(self) -> None:
        """Start the peak counters again from what is held now."""
        self._peak = list(self._live)

    # --- hooks --------------------------------------------------------------------------------
    def _enter_block(self, part: int, layer: int, module: nn.Module, args: Any) -> None:
        if layer == 0:
            self._mb[part] = self._mb.get(part, -1) + 1
        self._current = (part, self._mb.get(part, 0), layer)

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        if base.is_leaf:
            self._count["skipped_leaf"] += 1
            return t
        if (
            type(t) is not torch.Tensor
            or t.layout is not torch.strided
            or t.device.type not in ("cpu", "cuda")
            or t.is_conj()
            or t.is_neg()
        ):
            self._count["skipped_other"] += 1
            return t  # nothing to rebuild it from with `set_`: autograd keeps it as usual
        storage = t.untyped_storage()
        with self._locked():
            self._reap()
            entry = self._find(storage)
            if entry is None:
                entry = self._new_entry(storage)
            elif not entry.kept:
                self._count["deduplicated"] += 1
            if entry.kept:
                self._count["counted" if self.mode == "none" else "skipped_small"] += 1
            else:
                self._count["packed"] += 1
            entry.handles += 1
            self._live_handles += 1
            return _Saved(self, entry, t)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        origin = saved.origin()
        if origin is not None and origin._version != saved.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: saved at version {saved.version}, now at version "
                f"{origin._version} (activation offload keeps autograd's check)"
            )
        entry = saved.entry
        if entry.kept:
            return saved.tensor
        with self._locked():
            reads = self._count["reads"]
            self._ensure(entry)
            self._count["demand_reads"] += self._count["reads"] - reads
            if entry.key not in self._unpacked:
                self._unpacked.add(entry.key)
                part, mb, layer = entry.key
                for key in (entry.key, (part, mb, layer - 1)):
                    for e in reversed(self._groups.get(key, ())):  # backward needs them in reverse
                        self._ensure(e)
            self._reap()
            if entry.read is not None:
                entry.read.wait()
                entry.read = None
            storage = entry.loaded if entry.loaded is not None else entry.host.untyped_storage()
        return torch.empty(0, dtype=saved.dtype, device=storage.device).set_(
            storage, saved.offset, saved.size, saved.stride
        )

    # --- entries ------------------------------------------------------------------------------
    def _find(self, storage: torch.UntypedStorage) -> _Entry | None:
        entry = self._by_storage.get(id(storage))
        if entry is not None and not entry.released and entry.storage() is storage:
            return entry
        return None

    def _new_entry(self, storage: torch.UntypedStorage) -> _Entry:
        nbytes = storage.nbytes()
        kept = self.mode == "none" or nbytes < max(self.min_bytes, 1)
        entry = _Entry(self._current, nbytes, storage.device, kept, weakref.ref(storage))
        self._by_storage[id(storage)] = entry
        if not entry.kept:
            self._groups.setdefault(entry.key, []).append(entry)
            entry.src = storage
            if self.mode == "cpu" and self.mover is None:
                self._copy_out(entry)  # at once, on this thread
                entry.src = None
            else:
                self._queue.append(entry)
                self._unwritten_bytes += nbytes
        self._account(entry)
        if self.max_inflight_bytes is not None:
            while self._unwritten_bytes > self.max_inflight_bytes and (
                self._queue or self._pending
            ):
                if not self._pending:
                    self._pump(window=1)
                if self._pending:
                    self._pending[0].in_flight().wait()
                self._reap()
        else:
            self._pump()
        return entry

    def _copy_out(self, entry: _Entry) -> None:
        """Start (or, with no mover, do) the copy of `entry`'s storage to host memory or its region."""
        assert entry.src is not None  # queued copies keep their original until written or skipped
        data = torch.empty(0, dtype=torch.uint8, device=entry.device).set_(entry.src)
        if self.mode == "cpu":
            entry.host = self._host.take(entry.nbytes, entry.device.type == "cuda")
            if self.mover is None:
                entry.host[: entry.nbytes].copy_(data)
            else:
                entry.write = self.mover.write(data, entry.host[: entry.nbytes])
        else:
            assert self.mover is not None  # mode nvme: __init__ requires one
            entry.region = self._allocate(entry.nbytes)
            entry.write = self.mover.write(data, entry.region)
        self._count["writes"] += 1
        self._count["bytes_offloaded"] += entry.nbytes
        if entry.write is not None:
            self._transfers.append(entry.write)
            self._pending.append(entry)

    def _pump(self, window: int | None = WRITE_WINDOW) -> None:
        """Hand queued copies to the mover until `window` are in flight (None: all of them); skip
        those whose tensor backward already took from memory or dropped."""
        while self._queue and (window is None or len(self._pending) < window):
            entry = self._queue.popleft()
            if entry.released or entry.loaded is not None:
                self._count["writes_skipped"] += 1
                self._drop_src(entry)
            else:
                self._copy_out(entry)

    def _reap(self, window: int | None = WRITE_WINDOW) -> None:
        """Drop the originals whose copies are written (in issue order: the mover keeps it), then
        hand the mover more."""
        while self._pending and self._pending[0].in_flight().done():
            entry = self._pending.popleft()
            write, entry.write = entry.in_flight(), None
            write.wait()  # raises a failed write here, in forward or backward
            self._drop_src(entry)
        self._pump(window)

    def _drop_src(self, entry: _Entry) -> None:
        if entry.src is not None:
            entry.src = None
            self._unwritten_bytes -= entry.nbytes
            self._account(entry)

    def _ensure(self, entry: _Entry) -> None:
        """Make `entry` readable soon: forward its original if still held, else issue its read."""
        if entry.kept or entry.released or entry.loaded is not None or entry.read is not None:
            return
        if entry.src is not None:
            entry.loaded = entry.src
            self._count["forwarded"] += 1
            return
        if entry.host is not None and entry.device.type == "cpu":
            return  # a CPU model rebuilds straight from the host copy
        dst = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
        entry.loaded = dst.untyped_storage()
        if self.mover is None:  # mode cpu, copied on this thread: the copy is in host memory
            dst.copy_(_host_copy(entry))
        else:
            entry.read = self.mover.read(
                dst, entry.region if entry.region is not None else _host_copy(entry)
            )
            self._transfers.append(entry.read)
        self._count["reads"] += 1
        self._count["bytes_read"] += entry.nbytes
        self._account(entry)

    def _handle_dropped(self, entry: _Entry) -> None:
        # Runs in __del__, on whichever thread autograd frees the graph on, possibly while this
        # thread holds the lock (a garbage collection inside the hooks): never block, leave it
        # queued then.
        self._dropped.append(entry)
        if self._lock.acquire(blocking=False):
            try:
                self._process_dropped()
            finally:
                self._lock.release()

    def _process_dropped(self) -> None:
        while self._dropped:
            entry = self._dropped.popleft()
            entry.handles -= 1
            self._live_handles -= 1
            if entry.handles == 0:
                entry.released = True
                if entry.write is None:
                    self._drop_src(entry)  # not handed to the mover yet: it never will be
                if entry.host is not None and entry.write is None and entry.read is None:
                    self._host.give_back(entry.host)  # else at the step's end, when nothing uses it
                    entry.host = None
                entry.loaded = None  # a read still in flight finishes into its own buffer
                self._account(entry)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            yield
            self._process_dropped()

    def _account(self, entry: _Entry) -> None:
        on_device = (
            entry.kept and not entry.released or entry.src is not None or entry.loaded is not None
        )
        device = entry.nbytes if on_device else 0
        host = 0
        if entry.host is not None:
            if entry.device.type == "cpu":
                device += entry.nbytes
            else:
                host = entry.nbytes
        if (device, host) != entry.held:
            self._live[0] += device - entry.held[0]
            self._live[1] += host - entry.held[1]
            entry.held = (device, host)
            self._peak = [max(p, v) for p, v in zip(self._peak, self._live)]

    def _finish_transfers(self) -> None:
        for transfer in self._transfers:
            transfer.wait()
        self._reap(window=0)
        # copies never handed to the mover: backward is over, none will be needed
        while self._queue:
            self._count["writes_skipped"] += 1
            self._drop_src(self._queue.popleft())
        for group in self._groups.values():
            for entry in group:
                if entry.host is not None and entry.released:
                    self._host.give_back(entry.host)  # released while a transfer still used it
                    entry.host = None
                    self._account(entry)

    # --- swap file regions ----------------------------------------------------------------------
    def _allocate(self, nbytes: int) -> FileRegion:
        """A bump allocation in the activation file, reset at `end_step`; the file grows only in a
        step that needs more than every step before it (normally the first)."""
        offset, size = self._cursor, aligned(nbytes)
        self._cursor += size
        self._file_peak = max(self._file_peak, self._cursor)
        f = self.swap_file
        assert f is not None  # mode nvme: __init__ requires one
        if self._cursor > f.allocated:
            target = aligned(max(self._cursor, f.allocated + max(GROW_MIN, f.allocated // 8)))
            if target > f.size:
                f.region(target - f.size)
            # ENOSPC names activations.offload and offload.nvme_path
            f.preallocate("activations.offload")
            self._count["file_grows"] += 1
        return FileRegion(f, offset, size)

    def _new_step(self) -> None:
        self._groups: dict[Key, list[_Entry]] = {}
        # Keyed by the storage object (preserved while the storage lives, unlike a freed and reused
        # address), confirmed through the entry's weakref since a dead object's id can come back.
        self._by_storage: dict[int, _Entry] = {}
        self._unpacked: set[Key] = set()
        self._queue: deque[_Entry] = deque()  # copies not handed to the mover yet
        self._pending: deque[_Entry] = deque()  # copies handed to it, originals still held
        self._unwritten_bytes = 0
        self._transfers: list[Transfer] = []
        self._cursor = 0
        self._mb.clear()


def _host_copy(entry: _Entry) -> torch.Tensor:
    """The host buffer holding `entry`'s copy (mode cpu), trimmed to its size."""
    assert entry.host is not None
    return entry.host[: entry.nbytes]


# What selective recomputation keeps: the outputs of the matmuls and of attention, the ops whose
# recomputation costs FLOPs. Everything between them (norms, RoPE, SiLU, products, residual adds,
# casts) is recomputed: cheap element-wise work whose saved tensors make up most of a block's
# activation memory. torchtitan's per-op policy keeps the same set (it also drops every other mm to
# save more memory; here every matmul is kept, so backward never repeats a matmul).
_KEPT_OPS = (
    "mm.default",
    "addmm.default",
    "bmm.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
)


@functools.cache
def _kept_ops() -> frozenset:
    ops = set()
    for name in _KEPT_OPS:
        packet, overload = name.split(".")
        op = getattr(torch.ops.aten, packet, None)
        if op is not None and hasattr(op, overload):
            ops.add(getattr(op, overload))
    return frozenset(ops)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


class _Recomputed:
    """A block's forward run under non-reentrant checkpointing, installed as the instance's
    `forward`, so the module's own hooks (ZeRO's gather/free) stay outside it and fire once per
    real forward, not again when backward recomputes. `selective`: torch's selective activation
    checkpointing with the policy above instead of recomputing everything. A plain callable
    object rather than a closure, so deep-copying the model rebinds it to the copy."""

    def __init__(self, inner: Any, selective: bool = False):
        self.inner = inner
        self.selective = selective

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        if self.selective:
            return checkpoint(
                self.inner, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs
            )
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def apply_recompute(parts: list[nn.Module], mode: str = "full") -> None:
    """activations.recompute: every transformer block of `parts` recomputes its forward in backward
    instead of saving its activations — all of it (`full`: only the block's input is saved, through
    any outer saved-tensor hooks, so an offloader then offloads just that) or all but its matmul
    and attention outputs (`selective`: those are kept by the checkpoint itself, on the device).
    Applying it again replaces the mode."""
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode {mode!r}: full or selective")
    for part in parts:
        for block in blocks_of(part):
            current = block.__dict__.get("forward")
            inner = current.inner if isinstance(current, _Recomputed) else block.forward
            block.forward = _Recomputed(inner, selective=mode == "selective")
