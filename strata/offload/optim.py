"""The optimizer tier: AdamW's moments for this rank's ZeRO optimizer partition kept on the device,
in host memory or in a swap file, and the step taken in sub-groups of one slab — read next, update
current, write previous — each updated on the CPU or the GPU as `offload.placement` decided.

The update is torch's fused AdamW kernel (`torch._fused_adamw_`, what `torch.optim.AdamW(fused=True)`
runs), called on sub-ranges: it is elementwise, so any split gives the unsplit step's bits. The
`torch.optim.AdamW` object stays the holder of hyper-parameters and of `state` as the checkpoint
code reads it: views into the tier's buffers, or (nvme) filled only inside `materialized()`.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from strata.offload.files import SwapFile
from strata.offload.io_engine import IOEngine, aligned
from strata.offload.pool import HostPool, Slab
from strata.offload.swap import FileRegion, Mover

if TYPE_CHECKING:
    from strata.offload.params import ParamTier
    from strata.parallel.flat_group import FlatGroup

MOMENTS = ("exp_avg", "exp_avg_sq")
Moments = tuple[torch.Tensor, ...]  # one tensor per name in MOMENTS
# Bytes per element each update path moves, for the placement model (placement.Measured.traffic).
# The device keeps fp32 parameters, so the CPU path brings parameter and gradient down and the
# parameter up; the GPU path takes both moments up and back.
TRAFFIC = (8, 4, 8, 8)
# offload.optim.device -> where the moments live
KIND_OF = {"none": "device", "cpu": "host", "nvme": "nvme"}


@dataclass
class _Span:
    """A piece's elements [piece_lo, piece_lo + size) at `offset` in a sub-group."""

    piece: nn.Parameter
    piece_lo: int
    offset: int
    size: int


@dataclass
class SubGroup:
    """Elements [start, start + size) of one flat group's optimizer chunk."""

    group: FlatGroup
    start: int
    size: int
    spans: list[_Span]
    regions: tuple[FileRegion, ...] = ()  # nvme: where exp_avg and exp_avg_sq live
    on_gpu: bool = False

    def params(self) -> torch.Tensor:
        """The view of the flat group's parameter shard this sub-group updates."""
        g = self.group
        lo = g.optim_start - g.param_start + self.start
        return g.shard[lo : lo + self.size]

    def grads(self) -> torch.Tensor:
        """The view of the flat group's reduced gradient shard this sub-group updates with."""
        reduced = self.group.reduced
        assert reduced is not None, (
            "a sub-group's gradients exist after the engine's reduce-scatter"
        )
        return reduced[self.start : self.start + self.size]


def split(groups: list[FlatGroup], elems: int) -> list[SubGroup]:
    """Each group's optimizer chunk cut into sub-groups of at most `elems` elements, with the
    optimizer pieces (one per parameter the chunk touches) that each covers."""
    out = []
    for g in groups:
        pieces = [(slot.range[0] + a - g.optim_start, piece) for slot, piece, a, _ in g.segments]
        for start in range(0, g.optim_size, elems):
            size = min(elems, g.optim_size - start)
            spans = []
            for at, piece in pieces:
                lo, hi = max(start, at), min(start + size, at + piece.numel())
                if lo < hi:
                    spans.append(_Span(piece, lo - at, lo - start, hi - lo))
            out.append(SubGroup(g, start, size, spans))
    return out


class OptimTier:
    """See the module docstring. `kind`: "device" (moments beside the parameters: only the
    parameters are offloaded), "host" (the pool's resident region) or "nvme" (`swap_file`,
    streamed through slabs of the pool's "optim" stream by `io`)."""

    def __init__(
        self,
        groups: list[FlatGroup],
        optimizer: torch.optim.Optimizer,
        kind: str,
        pool: HostPool,
        io: IOEngine | None = None,
        swap_file: SwapFile | None = None,
        params: ParamTier | None = None,
        read_ahead: int = 2,
        mover: Mover | None = None,
    ):
        self.groups, self.optimizer, self.kind = groups, optimizer, kind
        self.pool, self.io, self.param_tier, self.mover = pool, io, params, mover
        self.read_ahead = read_ahead
        self.device = groups[0].shard.device
        elems = pool.slab_bytes // 4
        self.subgroups = split(groups, elems)
        self._moments: dict[str, Moments] = {}
        for g in groups:
            if g.shard.dtype != torch.float32:
                raise ValueError(
                    f"optimizer offload steps fp32 master parameters; group {g.name} "
                    f"is {g.shard.dtype}"
                )
            if kind == "device":
                self._moments[g.name] = (
                    torch.zeros(g.optim_size, device=self.device),
                    torch.zeros(g.optim_size, device=self.device),
                )
            elif kind == "host":  # the arena is fresh anonymous memory: zeros
                self._moments[g.name] = tuple(
                    pool.resident(g.optim_size * 4, torch.float32) for _ in MOMENTS
                )
        if kind == "nvme":
            if swap_file is None:
                raise ValueError("optimizer moments on nvme need a swap file")
            for sg in self.subgroups:
                sg.regions = tuple(
                    FileRegion(swap_file, swap_file.region(sg.size * 4), sg.size * 4)
                    for _ in MOMENTS
                )
        self._elems = elems
        # per side stream: the moments of a device update
        self._scratch: list[dict[str, torch.Tensor]] = []
        self._sides: list = []
        # The CPU path on a GPU: parameters and gradients come down into these two pinned buffers
        # (the pool's resident region, planned by `needs_resident_bytes`); never borrowed slabs,
        # which the moments' read-ahead may all hold. Reused in stream order: the next sub-group's
        # copies down queue behind the previous one's copy up.
        self._host_scratch = (
            [pool.resident(elems * 4, torch.float32) for _ in range(2)]
            if self.device.type == "cuda" and kind != "device"
            else None
        )
        self._state_init()

    @staticmethod
    def needs_resident_bytes(
        groups: list[FlatGroup], kind: str, device: torch.device, slab_bytes: int
    ) -> int:
        """Host bytes this tier takes from the pool's resident region: the moments ("host" kind)
        and, on a GPU, the CPU path's two buffers."""
        moments = sum(2 * aligned(g.optim_size * 4) for g in groups) if kind == "host" else 0
        scratch = 2 * aligned(slab_bytes) if device.type == "cuda" and kind != "device" else 0
        return moments + scratch

    def place(self, on_gpu: list[bool]) -> None:
        """Set where each sub-group's update runs (`on_gpu`, in update order)."""
        for sg, gpu in zip(self.subgroups, on_gpu):
            sg.on_gpu = gpu

    # --- optimizer.state as the checkpoint code sees it ----------------------------------------
    def _pieces(self) -> list[tuple[FlatGroup, int, nn.Parameter]]:
        """(group, offset in its optimizer chunk, piece) for every optimizer piece."""
        return [
            (g, slot.range[0] + a - g.optim_start, piece)
            for g in self.groups
            for slot, piece, a, _ in g.segments
        ]

    def _state_init(self) -> None:
        fused = self.optimizer.param_groups[0].get("fused")
        for g, at, piece in self._pieces():
            step = torch.zeros((), dtype=torch.float32, device=piece.device if fused else "cpu")
            self.optimizer.state[piece] = {"step": step, **self._moment_views(g, at, piece)}

    def _moment_views(self, g: FlatGroup, at: int, piece: nn.Parameter) -> dict[str, torch.Tensor]:
        if g.name not in self._moments:
            return {}
        return {k: m[at : at + piece.numel()] for k, m in zip(MOMENTS, self._moments[g.name])}

    @contextlib.contextmanager
    def materialized(self) -> Iterator[None]:
        """`optimizer.state` complete inside the block (swapped moments read into temporary tensors)."""
        if self.kind != "nvme":
            yield
            return
        flat = {g.name: tuple(torch.empty(g.optim_size) for _ in MOMENTS) for g in self.groups}
        assert self.mover is not None, "an nvme tier has a mover"
        self._swap(self.mover.read, flat)
        for g, at, piece in self._pieces():
            self.optimizer.state[piece].update(
                {k: m[at : at + piece.numel()] for k, m in zip(MOMENTS, flat[g.name])}
            )
        try:
            yield
        finally:
            for _, _, piece in self._pieces():
                for k in MOMENTS:
                    self.optimizer.state[piece].pop(k, None)

    def adopt(self) -> None:
        """Take over the moments `optimizer.load_state_dict` left in `optimizer.state` (a resume)."""
        flat = {
            g.name: tuple(torch.zeros(g.optim_size, device=self.device) for _ in MOMENTS)
            for g in self.groups
        }
        for g, at, piece in self._pieces():
            state = self.optimizer.state[piece]
            for k, m in zip(MOMENTS, flat[g.name]):
                if k in state:
                    m[at : at + piece.numel()].copy_(state[k])
            state["step"] = state.get("step", torch.zeros((), dtype=torch.float32))
        if self.kind == "nvme":
            assert self.mover is not None, "an nvme tier has a mover"
            self._swap(self.mover.write, flat)
        else:
            for g in self.groups:
                for dst, src in zip(self._moments[g.name], flat[g.name]):
                    dst.copy_(src)
        for g, at, piece in self._pieces():
            self.optimizer.state[piece] = {
                "step": self.optimizer.state[piece]["step"],
                **self._moment_views(g, at, piece),
            }

    def device_bytes(self) -> int:
        """Bytes of moments held on the training device (the "device" kind only; the others live
        in host memory or on NVMe, counted by the pool and the swap files)."""
        return (
            sum(g.optim_size * 4 * len(MOMENTS) for g in self.groups)
            if self.kind == "device"
            else 0
        )

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> None:
        """One AdamW step of every piece (their `.grad` set by the engine), sub-group by sub-group.
        On a GPU, device-placed sub-groups are queued on a side stream and run while the CPU
        updates its own; the step ends when both are done."""
        for _, _, piece in self._pieces():
            self.optimizer.state[piece]["step"] += 1
        hyper = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        self._steps = {
            "here": {id(p): self.optimizer.state[p]["step"] for _, _, p in self._pieces()}
        }
        # the CPU path's kernel needs the counts on the CPU: copied once
        if self.device.type != "cpu":
            self._steps["cpu"] = {k: t.cpu() for k, t in self._steps["here"].items()}
        sides = self._side_streams()
        on_device = 0
        loads = _Pipeline(self, self.subgroups)
        last_group = None
        try:
            for i, sg in enumerate(self.subgroups):
                if sg.group is not last_group:
                    self._switch_group(last_group, sg.group, i)
                    last_group = sg.group
                moments = loads.take(i)
                if sg.on_gpu and self.kind != "device":
                    done = self._update_on_device(sg, moments, hyper, on_device % 2, sides)
                    on_device += 1
                    if self.kind == "nvme" and done is not None:
                        # the slabs go to disk next: their copies must have landed
                        done.synchronize()
                else:
                    self._update_here(sg, moments, hyper)
                loads.put_back(i, sg)
            for side in sides:
                side.synchronize()
                torch.cuda.current_stream(self.device).wait_stream(side)
        finally:
            loads.close()
        self._switch_group(last_group, None, len(self.subgroups))

    def _side_streams(self) -> list:
        """The two streams device-placed updates alternate on (CUDA only), after the gradients are
        ready: one sub-group's moments come back while the next one's go up (one stream would
        serialise the two directions of the link)."""
        if self.device.type != "cuda" or not any(sg.on_gpu for sg in self.subgroups):
            return []
        if not self._sides:
            self._sides = [torch.cuda.Stream(self.device) for _ in range(2)]
        for side in self._sides:
            side.wait_stream(torch.cuda.current_stream(self.device))
        return self._sides

    def _switch_group(self, done: FlatGroup | None, nxt: FlatGroup | None, at: int) -> None:
        """Parameters offloaded too: hold the next group's shard, write back the finished one."""
        if self.param_tier is None:
            return
        if done is not None:
            self.param_tier.write_back(done)
        if nxt is not None:
            self.param_tier.hold(nxt)
            later = list(
                dict.fromkeys(sg.group for sg in self.subgroups[at:] if sg.group is not nxt)
            )
            self.param_tier.read_ahead(later[:1])
        else:
            self.param_tier.finish_writes(self.groups)
            self.param_tier.step_done()

    def _update_on_device(self, sg: SubGroup, moments, hyper: dict, lane: int, sides: list):
        """Deep Optimizer States' GPU path: the moments go up, the fused kernel runs beside the
        parameters and gradients, the moments come back, on side stream `lane`. Returns the CUDA
        event that marks the copies back (None off CUDA, where it is synchronous: the same copies
        and the same kernel)."""
        side = sides[lane] if sides else None
        while len(self._scratch) <= lane:
            self._scratch.append({k: torch.empty(self._elems, device=self.device) for k in MOMENTS})
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            scratch = self._scratch[lane]
            work = tuple(
                scratch[k][: sg.size].copy_(m, non_blocking=True) for k, m in zip(MOMENTS, moments)
            )
            _fused_step(sg, sg.params(), sg.grads(), work, hyper, self._steps["here"])
            for m, w in zip(moments, work):
                m.copy_(w, non_blocking=side is not None)
            return side.record_event() if side is not None else None

    def _update_here(self, sg: SubGroup, moments, hyper: dict) -> None:
        """The update where the moments are: on the device ("device" kind), or on the CPU — which,
        on a GPU machine, brings the parameters and gradients down and the parameters back."""
        params, grads = sg.params(), sg.grads()
        if self.device.type == "cpu" or self.kind == "device":
            _fused_step(sg, params, grads, moments, hyper, self._steps["here"])
            return
        assert self._host_scratch is not None, "made for the CPU path on a GPU"
        host_p, host_g = (t[: sg.size] for t in self._host_scratch)
        host_p.copy_(params, non_blocking=True)
        host_g.copy_(grads, non_blocking=True)
        # also the previous sub-group's copy up
        torch.cuda.current_stream(self.device).synchronize()
        _fused_step(sg, host_p, host_g, moments, hyper, self._steps["cpu"])
        params.copy_(host_p, non_blocking=True)

    def _swap(self, transfer, flat: dict[str, Moments]) -> None:
        """Every sub-group's moments between the swap file and `flat` (whole-group tensors), by
        `transfer` (the mover's read or write), all in flight at once."""
        for t in [
            transfer(m[sg.start : sg.start + sg.size], region)
            for sg in self.subgroups
            for region, m in zip(sg.regions, flat[sg.group.name])
        ]:
            t.wait()


class _Pipeline:
    """The sub-groups' moments in order: resident views, or (nvme) slabs read `read_ahead`
    sub-groups ahead and written back behind, each slab returned when its write is done."""

    def __init__(self, tier: OptimTier, subgroups: list[SubGroup]):
        self.tier, self.subgroups = tier, subgroups
        self.reads: dict[int, tuple[list[Slab], list]] = {}
        self.taken: dict[int, list[Slab]] = {}
        self.writes: deque[tuple[list[Slab], list]] = deque()
        self.next_read = 0

    def take(self, i: int) -> Moments:
        """Sub-group `i`'s moments to update: views of the resident ones, or (nvme) the slabs read
        for it, reads `read_ahead` further issued."""
        tier, sg = self.tier, self.subgroups[i]
        if tier.kind != "nvme":
            return tuple(m[sg.start : sg.start + sg.size] for m in tier._moments[sg.group.name])
        while self.next_read <= i:
            self._issue(self.next_read, blocking=True)
        while self.next_read <= min(i + tier.read_ahead, len(self.subgroups) - 1) and self._issue(
            self.next_read
        ):
            pass
        slabs, handles = self.reads.pop(i)
        for h in handles:
            h.wait()
        self.taken[i] = slabs
        return tuple(s.tensor[: sg.size * 4].view(torch.float32) for s in slabs)

    def put_back(self, i: int, sg: SubGroup) -> None:
        """After sub-group `i`'s update: (nvme) start writing its moments back, and return the slabs
        of the writes that have finished."""
        if self.tier.kind != "nvme":
            return
        slabs = self.taken.pop(i)
        io = self.tier.io
        assert io is not None, "an nvme tier has an I/O engine"
        handles = [
            io.write(r.file.path, s.tensor[: aligned(r.nbytes)], r.offset)
            for s, r in zip(slabs, sg.regions)
        ]
        self.writes.append((slabs, handles))
        while self.writes and all(h.done() for h in self.writes[0][1]):
            self._finish_write()

    def close(self) -> None:
        """Wait for every write, and return every slab (also those of reads an error left behind)."""
        leftover = [(slabs, handles) for slabs, handles in self.reads.values()]
        leftover += [(slabs, []) for slabs in self.taken.values()]
        self.reads.clear()
        self.taken.clear()
        self.writes.extend(leftover)
        while self.writes:
            self._finish_write()

    def _issue(self, i: int, blocking: bool = False) -> bool:
        """Start reading sub-group i's moments into two slabs; without `blocking`, only if slabs
        are free now. Our own finished writes give their slabs back before anyone waits."""
        pool, sg = self.tier.pool, self.subgroups[i]
        slabs: list[Slab] = []
        while len(slabs) < len(MOMENTS):
            slab = pool.try_borrow("optim")
            if slab is None and self.writes:
                self._finish_write()
                continue
            if slab is None and not blocking:
                for s in slabs:
                    pool.give_back(s)
                return False
            slabs.append(slab or pool.borrow("optim"))
        io = self.tier.io
        assert io is not None, "an nvme tier has an I/O engine"
        handles = [
            io.read(r.file.path, s.tensor[: aligned(r.nbytes)], r.offset)
            for s, r in zip(slabs, sg.regions)
        ]
        self.reads[i] = (slabs, handles)
        self.next_read = i + 1
        return True

    def _finish_write(self) -> None:
        slabs, handles = self.writes.popleft()
        try:
            for h in handles:
                h.wait()
        finally:
            for s in slabs:
                self.tier.pool.give_back(s)


def _fused_step(
    sg: SubGroup,
    params: torch.Tensor,
    grads: torch.Tensor,
    moments,
    hyper: dict,
    steps: dict[int, torch.Tensor],
) -> None:
    """torch's fused AdamW on each span, one kernel call per parameter group (weight decay differs);
    `steps`: each piece's step count, already advanced, on the kernel's device."""
    by_group: dict[int, list[_Span]] = {}
    for span in sg.spans:
        by_group.setdefault(id(hyper[id(span.piece)]), []).append(span)
    for spans in by_group.values():
        h = hyper[id(spans[0].piece)]
        cut = lambda t: [t[s.offset : s.offset + s.size] for s in spans]  # noqa: E731
        torch._fused_adamw_(
            cut(params),
            cut(grads),
            cut(moments[0]),
            cut(moments[1]),
            [],
            [steps[id(s.piece)] for s in spans],
            amsgrad=False,
            lr=h["lr"],
            beta1=h["betas"][0],
            beta2=h["betas"][1],
            weight_decay=h["weight_decay"],
            eps=h["eps"],
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )
