"""One flat group of the ZeRO engine (`parallel.zero`): the parameters of one or more blocks packed
into one padded flat buffer, with this rank's chunks of it at every level of the `ZeroPlan`, and
everything that happens to one group during a step.

Parameters: when they are sharded (ZeRO-3) the group's flat buffer is gathered just before the
first unit that uses it runs — forward, and again backward — and its storage is freed right after
(`gather`, `wait`, `free`; the engine's hooks call them and start the next groups' gathers ahead of
use). Modules keep their own `nn.Parameter` objects, whose data are views of the flat buffer
(freeing resizes the storage to 0, so the views stay valid across free/gather, as in FSDP2). With
hpZ a gather also keeps this rank's piece of the finer secondary partition; with a memory tier
(`ShardTier`) the shard is read in before the gather and released after it.

Gradients: each parameter's gradient is moved into the group's flat gradient buffer by a
post-accumulate hook (`add_grad`); when the group's last gradient of a micro-batch has arrived the
buffer is reduce-scattered to the `grads` level and freed (ZeRO-2), or kept accumulating (ZeRO-1),
serially or behind the rest of backward through a `Reducer`. `finish_grads` reduces on to the
`optim` level and points each optimizer segment's gradient at its piece; after the optimizer
stepped the chunk in place, `rebuild` all-gathers it back to the `params` level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from strata.parallel.flat import Segment
from strata.parallel.overlap import Reducer, Reduction
from strata.parallel.routes import Hop, PendingGather, Routes


class Partitioning(Protocol):
    """The levels a group's state is partitioned over (`parallel.zero.ZeroPlan`, described here so
    that the engine's plan and its groups import one way)."""

    @property
    def params(self) -> str: ...
    @property
    def grads(self) -> str: ...
    @property
    def optim(self) -> str: ...
    @property
    def secondary(self) -> str: ...
    @property
    def shards_params(self) -> bool: ...


class ShardTier(Protocol):
    """What the engine calls on the memory tier its parameter shards live in between uses
    (offload.params.ParamTier; described here, as parallel/ sits below offload/ in the layers)."""

    read_ahead_groups: int  # how many groups to read ahead of the gathers' prefetch

    def ensure(self, group: FlatGroup) -> None:
        """The group's shard is in memory when this returns."""

    def release(self, group: FlatGroup) -> None:
        """The gather has copied the shard: the tier may drop it."""

    def read_ahead(self, groups: list[FlatGroup]) -> None:
        """Start reading these groups' shards."""


@dataclass
class _Slot:
    """One parameter in a flat group."""

    segment: Segment
    param: nn.Parameter
    aliases: tuple[str, ...]  # every name of the parameter on this rank (a tied weight has two)

    @property
    def range(self) -> tuple[int, int]:
        return self.segment.offset, self.segment.offset + self.segment.numel


def _slots(
    named_params: list[tuple[str, nn.Parameter]], aliases: dict[int, list[str]]
) -> tuple[list[_Slot], int]:
    """The parameters laid out one after another (their slots), and the elements they fill; a
    ValueError where one differs from the first in dtype or device."""
    first = named_params[0][1]
    slots, offset = [], 0
    for pname, p in named_params:
        if p.dtype != first.dtype or p.device != first.device:
            raise ValueError(
                f"{pname}: {p.dtype} on {p.device}, but {named_params[0][0]} is {first.dtype} "
                f"on {first.device}; a flat group holds one dtype on one device"
            )
        slots.append(
            _Slot(Segment(pname, tuple(p.shape), offset), p, tuple(dict.fromkeys(aliases[id(p)])))
        )
        offset += p.numel()
    return slots, offset


class FlatGroup:
    """The parameters of one or more blocks packed into one padded flat buffer, with this rank's
    chunks of it at every level of the plan."""

    def __init__(
        self,
        name: str,
        named_params: list[tuple[str, nn.Parameter]],
        plan: Partitioning,
        routes: Routes,
        aliases: dict[int, list[str]],
        tied_copy: bool = False,
        sync_level: str = "global",
        frozen: bool = False,
    ):
        self.name, self.plan, self.routes, self.tied_copy = name, plan, routes, tied_copy
        # parameters that do not train (ZeRO-3): partitioned, gathered and freed, nothing else
        self.frozen = frozen
        # how far gradients are summed: every dp rank, or the node's (CO2)
        self.sync_level = sync_level
        self.slots, numel = _slots(named_params, aliases)
        unit = routes.count("global")
        self.padded = math.ceil(numel / unit) * unit
        self.full = self._adopt(numel)
        self.param_start, size = routes.span(plan.params, self.padded)
        self.shard = (
            self.full[self.param_start : self.param_start + size].clone()
            if plan.shards_params
            else self.full
        )
        self.secondary: torch.Tensor | None = None
        self.secondary_valid = False
        self.gathered = True
        self._pending_gather: PendingGather | None = None
        self._holds_tier_shard = False  # a gather in flight reads the tier's shard (see `gather`)
        self.grad_full: torch.Tensor | None = None
        # Slots whose piece of grad_full holds nothing yet, not even zeros: their first gradient is
        # copied in (not added to zeros: one pass over the bytes instead of three), and `_grads`
        # zeroes what is left before anything reads the buffer.
        self._unwritten: set[int] = set()
        self.grad_shard: torch.Tensor | None = None
        if plan.grads != "none" and not frozen:
            self.grad_shard = self.full.new_zeros(routes.span(plan.grads, self.padded)[1])
        self.waiting = len(self.slots)  # gradients still to arrive in this micro-batch's backward
        # Overlapped reduction (`expect_backwards`): backward passes this group sees per step, those
        # seen so far, the per-micro-batch reduce-scatter not yet added in, and the step's whole
        # chain.
        self.reducer: Reducer | None = None
        self.reduce_routes: Routes | None = None
        self.expected, self.backwards, self.uses = 0, 0, 1
        self.opens_forward = False  # the first unit of a part's forward uses it (set by the engine)
        self.partial: Reduction | None = None
        self.reduction: Reduction | None = None
        self.optim_start, self.optim_size = routes.span(plan.optim, self.padded)
        if frozen:
            self.optim_size = 0  # no optimizer segments, no optimizer state
        self.segments = self._optimizer_segments()
        self.reduced: torch.Tensor | None = None
        # offload.params.ParamTier when the shard lives in host memory or on NVMe
        self.tier: ShardTier | None = None
        if plan.shards_params:
            self.free()

    # --- parameters ------------------------------------------------------------------------
    def _adopt(self, numel: int) -> torch.Tensor:
        """The padded flat buffer of the slots' `numel` elements, each slot's parameter made a view
        of its piece (holding the parameter's values)."""
        first = self.slots[0].param
        # Parameters with nothing in them yet (`unfilled`: they are loaded before the first step,
        # model.init_from) are not copied in, and the buffer is not cleared but for its padding:
        # for a big model that is seconds of start-up and a second copy of it being touched.
        unfilled = all(getattr(slot.param, "unfilled", False) for slot in self.slots)
        if unfilled:
            full = torch.empty(self.padded, dtype=first.dtype, device=first.device)
            full[numel:].zero_()
        else:
            full = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for slot in self.slots:
                a, b = slot.range
                view = full[a:b].view(slot.segment.shape)
                if not unfilled:
                    view.copy_(slot.param)
                slot.param.data = view
                slot.param.__dict__.pop("unfilled", None)
        return full

    def _optimizer_segments(self) -> list[tuple[_Slot, nn.Parameter, int, int]]:
        """(slot, parameter aliasing the slot's piece of the optimizer chunk, start, end within
        the slot's flat range) for every slot the chunk touches."""
        out = []
        lo, hi = self.optim_start, self.optim_start + self.optim_size
        for slot in self.slots:
            a, b = max(lo, slot.range[0]), min(hi, slot.range[1])
            if a < b:
                piece = nn.Parameter(self.shard[a - self.param_start : b - self.param_start])
                out.append((slot, piece, a - slot.range[0], b - slot.range[0]))
        return out

    def gather(self, async_op: bool = False) -> None:
        """Make the whole flat buffer valid (started only, with `async_op`; see `wait`)."""
        if self.gathered or self._pending_gather is not None:
            return
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        use_secondary = self.secondary_valid
        source = self.secondary if use_secondary else self.shard
        assert source is not None  # the hpZ copy is valid only once `wait` made it
        level = self.plan.secondary if use_secondary else self.plan.params
        if self.tier is not None and not use_secondary:
            self.tier.ensure(self)  # released in `wait`, once the gather is done reading the shard
            self._holds_tier_shard = True
        self._pending_gather = self.routes.gather(
            source, "none", level, self.full, self.padded, async_op
        )
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self._pending_gather is None:
            self.gather()
            return
        self._pending_gather.wait()
        self._pending_gather, self.gathered = None, True
        if self._holds_tier_shard:
            assert self.tier is not None  # set only with a tier
            self._holds_tier_shard = False
            self.tier.release(self)
        if self.plan.secondary != "none" and not self.secondary_valid:
            # hpZ: keep this rank's piece of the finer partition, for the backward and later
            # micro-batches' gathers (copied from the gathered buffer, as DeepSpeed does)
            start, size = self.routes.span(self.plan.secondary, self.padded)
            if self.secondary is None:
                self.secondary = self.full.new_empty(size)
            self.secondary.copy_(self.full[start : start + size])
            self.secondary_valid = True

    def backward_to_come(self) -> bool:
        """Whether this step has a backward pass of this group still to run (as `expect_backwards`
        announced), so that the engine may keep it gathered until then. Never with a memory tier:
        offloading means holding as little as possible, and the tier keeps shards of its own
        (`offload.params.keep_groups`)."""
        return self.tier is None and self.backwards < self.expected

    def free(self) -> None:
        if not self.plan.shards_params or not (self.gathered or self._pending_gather):
            return
        if self._pending_gather is not None:
            self.wait()
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    # --- gradients -------------------------------------------------------------------------
    def add_grad(self, slot: _Slot) -> None:
        """Move `slot`'s freshly accumulated .grad into the flat gradient buffer; reduce when the
        group's last one of this backward has arrived."""
        self._take_grad(slot)
        self.waiting -= 1
        if self.waiting == 0:
            self.end_backward()

    def _take_grad(self, slot: _Slot) -> None:
        if self.grad_full is None:
            self.grad_full = self.full.new_empty(self.padded)
            self._clear_grads()
        a, b = slot.range
        grad = slot.param.grad
        assert grad is not None  # called for a parameter whose gradient has arrived
        if id(slot) in self._unwritten:
            self._unwritten.discard(id(slot))
            self.grad_full[a:b].copy_(grad.reshape(-1))
        else:
            self.grad_full[a:b].add_(grad.reshape(-1))
        slot.param.grad = None

    def _clear_grads(self) -> None:
        """grad_full counts as zeros from here: its padding is zeroed, every slot marked unwritten."""
        assert self.grad_full is not None  # a buffer to clear
        self.grad_full[self.slots[-1].range[1] :].zero_()
        self._unwritten = {id(slot) for slot in self.slots}

    def _grads(self) -> torch.Tensor:
        """grad_full, with the slots no gradient has reached zeroed: ready to be read."""
        assert self.grad_full is not None  # a buffer to read
        if self._unwritten:
            for slot in self.slots:
                if id(slot) in self._unwritten:
                    a, b = slot.range
                    self.grad_full[a:b].zero_()
            self._unwritten = set()
        return self.grad_full

    def end_backward(self, overlap: bool = True) -> None:
        """This micro-batch's gradients are all in: free the parameters again and, from ZeRO-2 on,
        reduce-scatter the gradients to the `grads` level and drop the full buffer. With a reducer
        (`overlap`), that reduce-scatter runs behind the rest of backward, and after the step's
        last backward the whole reduction to the optimizer's chunk starts too."""
        self.waiting = len(self.slots)
        self.backwards += 1
        if not (self.opens_forward and self.backward_to_come()):
            # else the next micro-batch's forward starts with it: kept, not gathered again
            self.free()
        overlap = overlap and self.reducer is not None
        last = overlap and self.backwards == self.expected
        if self.plan.grads != "none" and self.grad_full is not None:
            assert self.grad_shard is not None  # gradients partitioned: allocated in __init__
            self._settle()  # the previous micro-batch's sum goes in first: the serial path's order
            if not overlap:
                self.grad_shard.add_(
                    self.routes.reduce_scatter(self._grads(), "none", self.plan.grads, self.padded)
                )
            elif last:
                self.reduction = self._start(self._grads(), "none", add_into_shard=True)
            else:
                self.partial = self._start(self._grads(), "none", to=self.plan.grads)
            self.grad_full = None
        elif last:
            self.reduction = self._start(
                self._grads() if self.grad_full is not None else None, "none"
            )

    def _start(
        self, buf: torch.Tensor | None, fine: str, add_into_shard: bool = False, to: str = ""
    ) -> Reduction:
        """Start reducing `buf` (this rank's `fine` chunk) to the `grads` level (`to`), or on to the
        optimizer's chunk summed within the sync level; `add_into_shard`: the gradients accumulated
        at the `grads` level are added in on the way, as the serial path does (same arithmetic)."""
        assert self.reducer is not None  # only with overlap on
        if buf is None:
            buf = self.full.new_zeros(self.padded)
        return self.reducer.start(buf, self.hops(fine, add_into_shard, to))

    def hops(self, fine: str, add_into_shard: bool = False, to: str = "") -> list[Hop]:
        """The chain `_start` runs (building it makes the dedicated groups it needs)."""
        assert self.reduce_routes is not None  # only with overlap on
        routes, plan = self.reduce_routes, self.plan
        hops = routes.reduce_scatter_hops(
            fine, plan.grads if add_into_shard or to else plan.optim, self.padded
        )
        if add_into_shard:
            shard = self.grad_shard
            assert shard is not None  # gradients partitioned
            hops.append(Hop(None, lambda reduced: (shard.add_(reduced), None)))
        if not to:
            hops += (
                routes.reduce_scatter_hops(plan.grads, plan.optim, self.padded)
                if add_into_shard
                else []
            )
            hops += routes.all_reduce_hops(plan.optim, self.sync_level, self.padded)
        return hops

    def _settle(self) -> None:
        """Add the previous micro-batch's reduce-scatter, when one is in flight, into the shard."""
        if self.partial is not None:
            assert self.grad_shard is not None  # only gradients partitioned have a partial
            self.grad_shard.add_(self.partial.wait())
            self.partial = None

    def finish_grads(self, scale: float) -> torch.Tensor:
        """This rank's `optim` chunk of the gradients summed over the dp ranks within `sync_level`
        (all of them, or the node's under CO2), times `scale`."""
        # nothing gathered outlives the step: the optimizer is about to change the shard
        self.free()
        # Gradients set on the parameters directly, past the hooks (the weight pass of torch
        # pipelining's split-backward schedules does that): whole-step sums, taken in here.
        stray = [slot for slot in self.slots if slot.param.grad is not None]
        if stray and self.plan.grads != "none":
            raise RuntimeError(
                f"{stray[0].segment.name}: a gradient arrived past the hooks, but gradients are "
                f"partitioned per micro-batch (zero.grads.shard_over={self.plan.grads})"
            )
        if stray and self.reduction is not None:
            raise RuntimeError(
                f"{stray[0].segment.name}: a gradient arrived past the hooks after its group's "
                "reduction had started; set parallel.overlap_grad_reduce=false for this schedule"
            )
        for slot in stray:
            self._take_grad(slot)
        if self.waiting != len(self.slots):
            # some parameters got no gradient this step: they count as zero
            self.end_backward(overlap=False)
        plan = self.plan
        self._settle()
        if plan.grads == "none":
            source = (
                self._grads() if self.grad_full is not None else self.full.new_zeros(self.padded)
            )
        else:
            assert self.grad_shard is not None  # gradients partitioned: allocated in __init__
            source = self.grad_shard
        if self.reduction is not None:
            reduced = self.reduction.wait()
            self.reduction = None
        else:
            reduced = self.routes.reduce_scatter(source, plan.grads, plan.optim, self.padded)
            reduced = self.routes.all_reduce(
                reduced, plan.optim, self.sync_level, self.padded
            )  # the chunk's other copies
        # nothing scattered: the chunk is a view of the buffer
        if reduced is source and plan.grads == "none":
            reduced = source[self.optim_start : self.optim_start + self.optim_size]
        self.backwards = 0
        self.reduced = reduced.mul_(scale)
        for slot, piece, a, b in self.segments:
            start = slot.range[0] + a - self.optim_start
            piece.grad = self.reduced[start : start + (b - a)]
        return self.reduced

    def drain(self) -> None:
        """Wait out reductions still in flight (a step that ends without using its gradients)."""
        for pending in (self.partial, self.reduction):
            if pending is not None:
                pending.wait()
        self.partial = self.reduction = None
        self.backwards = 0

    def zero_grad(self) -> None:
        self.drain()
        if self.grad_full is not None and self.plan.grads == "none":
            self._clear_grads()
        if self.grad_shard is not None:
            self.grad_shard.zero_()
        self.reduced = None
        for _, piece, _, _ in self.segments:
            piece.grad = None

    # --- after the optimizer step ----------------------------------------------------------
    def rebuild(self) -> None:
        """All-gather the stepped optimizer chunks back into the `params` partition; the hpZ
        copy is stale from here until the next forward gathers."""
        if self.plan.optim != self.plan.params and not self.frozen:
            lo = self.optim_start - self.param_start
            self.routes.gather(
                self.shard[lo : lo + self.optim_size],
                self.plan.params,
                self.plan.optim,
                self.shard,
                self.padded,
            ).wait()
        self.secondary_valid = False

    def held_bytes(self) -> dict[str, int]:
        """Bytes of storage this group holds now, measured from its tensors."""
        return {
            "params": storage_bytes([self.full, self.shard, self.secondary]),
            "grads": storage_bytes([self.grad_full, self.grad_shard, self.reduced]),
        }


def storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t is not None
    }
    return sum(seen.values())
