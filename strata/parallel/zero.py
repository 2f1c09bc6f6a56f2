"""The ZeRO engine: parameters, gradients and optimizer states partitioned over the data-parallel
ranks, each at its own hierarchy level (`parallel.topology` levels none/gpu/node/global), so that
ZeRO-1/2/3, ZeRO++'s hpZ secondary partition and the 3-level scheme for Frontier-like machines
are settings of this one code path:

    ZeRO-1   optim: global                      ZeRO-3   params, grads, optim: global
    ZeRO-2   grads, optim: global               hpZ      ZeRO-3 + secondary_params: node
    3-level  params: gpu, grads: node, optim: global  (a GCD pair, a node, everything)

Parameters are packed per transformer block (plus one group for the embedding, one for the
final norm and output layer, and one for a tied embedding) into flat groups. A rank owns chunk
`Layout.nested_chunk(rank, level)` of each flat group at each level; that numbering nests, so
the optimizer chunk lies inside the gradient and parameter chunks a rank holds and the step needs
no communication. Moving state between levels is a chain of collectives over *digit groups*
(`Layout.digit_groups`): reduce-scatter inside the fastest unit first, then across (the
all-gathers go the other way), or, with `hierarchical=False`, one collective over the whole span.

When parameters are sharded (ZeRO-3) a group's flat buffer is gathered just before the first
block that uses it runs — forward, and again backward — and its storage is freed right after;
the next `prefetch_blocks` groups are gathered asynchronously ahead of use. Each parameter's
gradient goes into its group's flat gradient buffer, reduced to the `grads` level per micro-batch
(ZeRO-2) or accumulated (ZeRO-1). After the last micro-batch, `finish_grads` reduces on to the
`optim` level, the optimizer (torch AdamW over per-parameter segments of the chunk) steps the
local chunk in place, and `step` all-gathers the updated chunk back to the `params` level. One
group's buffers and what happens to them are `parallel.flat_group.FlatGroup`; this module plans
the groups, installs the hooks that gather, prefetch and free them, and runs the step.

Parameters that do not train (`requires_grad` False: LoRA's base, `train.freeze`) get no gradient
buffer, hook, reduction or optimizer segment. Under ZeRO-3 they are partitioned in flat groups of
their own (`FlatGroup.frozen`), gathered and freed with their unit like the others (a unit's frozen
groups are freed when the unit before it starts its backward); otherwise they stay out of the flat
groups (`frozen`), whole on every rank.

Every collective goes through `parallel.comm`, so bytes per link level are counted.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from strata.model import named_blocks
from strata.parallel import comm
from strata.parallel.clipping import global_grad_norm, scale_to_norm
from strata.parallel.experts import domain_of
from strata.parallel.flat_group import FlatGroup, ShardTier, storage_bytes
from strata.parallel.overlap import Reducer
from strata.parallel.routes import Routes
from strata.parallel.tensor import placement_of
from strata.parallel.topology import CHAIN, ExpertTopology, Topology, chain_level

if TYPE_CHECKING:
    from strata.config.schema import ZeroConfig


@dataclass(frozen=True)
class ZeroPlan:
    """Where each kind of state is partitioned (CHAIN levels), and how the engine runs."""

    params: str = "none"
    grads: str = "none"
    optim: str = "none"
    secondary: str = "none"  # hpZ: a second parameter partition at this finer level; none = off
    prefetch_blocks: int = 1
    bucket_bytes: int = 0  # merge consecutive blocks into one group until it holds this many bytes
    hierarchical: bool = True

    @classmethod
    def from_config(cls, zero: ZeroConfig) -> ZeroPlan:
        """The plan a strata.config.ZeroConfig describes."""
        return cls(
            chain_level(zero.params.shard_over),
            chain_level(zero.grads.shard_over),
            chain_level(zero.optim.shard_over),
            chain_level(zero.secondary_params.shard_over),
            zero.prefetch_blocks,
            int(zero.bucket_mb * 2**20),
            zero.hierarchical,
        )

    def __post_init__(self):
        order = CHAIN.index
        if order(self.params) > order(self.optim) or order(self.grads) > order(self.optim):
            raise ValueError(
                f"ZeroPlan: params ({self.params}) and grads ({self.grads}) must be partitioned no "
                f"coarser than optim ({self.optim})"
            )
        if self.secondary != "none" and order(self.secondary) >= order(self.params):
            raise ValueError(
                f"ZeroPlan: secondary ({self.secondary}) must be finer than params ({self.params})"
            )

    @property
    def shards_params(self) -> bool:
        return self.params != "none"


class StepTier(Protocol):
    """What the engine calls on the tier that takes the optimizer step (offload.optim.OptimTier)."""

    def step(self) -> None:
        """The optimizer step, in place of `optimizer.step()`."""

    def device_bytes(self) -> int:
        """Bytes of optimizer state on the device now."""


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's tensor state (moments; scalar step counters left out), each storage once."""
    return storage_bytes(
        [
            t
            for s in optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.ndim > 0
        ]
    )


def units_of(part: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """A GPT or pipeline Stage's units in forward order: the modules whose parameters are
    gathered together (embedding, each block, final norm + output layer)."""
    units: list[tuple[str, list[nn.Module]]] = []
    if hasattr(part, "tok_embeddings"):
        embedding = part.tok_embeddings
        assert isinstance(embedding, nn.Module)
        units.append(("tok_embeddings", [embedding]))
    units += [(f"layers.{key}", [block]) for key, block in named_blocks(part)]
    if hasattr(part, "output"):
        norm, output = part.norm, part.output
        assert isinstance(norm, nn.Module) and isinstance(output, nn.Module)
        units.append(("head", [norm, output]))
    return units


FROZEN = "~frozen"  # the key of a flat group of frozen parameters ends with this


def _domain(group_key: str) -> str:
    """The parameter domain of a flat group's key ("layers.3@experts": experts; "layers.3": "")."""
    return group_key.partition("@")[2].removesuffix(FROZEN)


def _grad(piece: nn.Parameter) -> torch.Tensor:
    """An optimizer segment's gradient, which `FlatGroup.finish_grads` sets for every segment."""
    assert piece.grad is not None  # clip_grad_norm runs after finish_grads
    return piece.grad


class ZeroEngine:
    """Partitioned training state for this rank's model parts (see the module docstring).

    `make_optimizer(params, shape_of)` builds the inner optimizer (Strata's AdamW, decaying
    matrices only) from per-parameter segment Parameters (1-D pieces: `shape_of(piece)` is
    the shape of the parameter a piece belongs to); `tied_copies` are parameters that are another
    rank's parameter too (a pipeline's two embedding copies): their reduced gradients are summed
    over `tied_group`, and the gradient norm counts them on the rank where `count_tied` is True
    (the first stage's) only. `sync_level` is how far gradients
    are averaged: the whole dp group ("global"), or only inside each node ("node") when CO2
    synchronises the nodes itself. Parameters of another domain (`parallel.experts.domain_of`: MoE
    experts, and under tensor parallelism the routers) go into groups of their own, reduced and
    partitioned over the edp dimension of `domains[domain]` (an `ExpertTopology`, of
    `parallel.topology.expert_layout`) at the same levels as the rest."""

    def __init__(
        self,
        parts: list[nn.Module],
        topo: Topology,
        plan: ZeroPlan,
        make_optimizer: Callable[[list[nn.Parameter], Callable], torch.optim.Optimizer],
        tied_copies: Sequence[torch.Tensor] | None = None,
        tied_group=None,
        count_tied: bool = True,
        sync_level: str = "global",
        overlap: bool = False,
        domains: dict[str, ExpertTopology] | None = None,
    ):
        self.plan, self.topo, self.tied_group, self.count_tied = plan, topo, tied_group, count_tied
        self.routes, self.sync_level = Routes(topo, plan.hierarchical), sync_level
        # parameter domain (parallel.experts.domain_of) -> its topology
        self.domains = dict(domains or {})
        self.domain_routes = {
            name: Routes(t, plan.hierarchical) for name, t in self.domains.items()
        }
        self.groups: list[FlatGroup] = []
        # parameters that do not train (requires_grad False: LoRA's base, train.freeze), by their
        # first name: no flat group, gradient or optimizer state, whole (after tp/pp) on every rank
        self.frozen: list[tuple[str, nn.Parameter]] = []
        self.device = next(
            (p.device for part in parts for p in part.parameters()), torch.device("cpu")
        )
        self._plan_groups(parts, {id(p) for p in tied_copies or []})
        self.reducer = self._overlap() if overlap else None
        self.params = [piece for g in self.groups for _, piece, _, _ in g.segments]
        shapes = {
            id(piece): tuple(slot.param.shape)
            for g in self.groups
            for slot, piece, _, _ in g.segments
        }
        self.optimizer = make_optimizer(self.params, lambda piece: shapes[id(piece)])
        self.param_tier: ShardTier | None = None  # memory tiers (offload/), attached by `use_tiers`
        self.optim_tier: StepTier | None = None
        self._install_hooks(parts)

    def use_tiers(self, param_tier: ShardTier | None, optim_tier: StepTier | None) -> None:
        """Offload (offload.tiers): parameter shards read ahead of their gathers, and the optimizer
        step taken by `optim_tier` sub-group by sub-group instead of `optimizer.step()`."""
        self.param_tier, self.optim_tier = param_tier, optim_tier

    # --- set-up ----------------------------------------------------------------------------
    def _plan_groups(self, parts: list[nn.Module], tied_ids: set[int]) -> None:
        """One flat group per unit, a tied weight in a group of its own, consecutive blocks merged
        up to `bucket_bytes`; `self.unit_groups[(part, unit)]` = the groups a unit uses."""
        names: dict[int, list[str]] = {}
        for part in parts:
            for n, p in part.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(n)
        owner: dict[int, str] = {}
        members: dict[str, list[tuple[str, nn.Parameter]]] = {}
        used: dict[tuple[int, int], list[int]] = {}
        part_of: dict[str, int] = {}
        for pi, part in enumerate(parts):
            for ui, (unit, modules) in enumerate(units_of(part)):
                ids = []
                for m in modules:
                    for p in m.parameters():
                        if id(p) not in owner:
                            self._place(p, unit, tied_ids, names, owner)
                            if owner[id(p)]:
                                members.setdefault(owner[id(p)], []).append((names[id(p)][0], p))
                                part_of.setdefault(owner[id(p)], pi)
                        ids.append(id(p))
                used[(pi, ui)] = ids
        merged: list[tuple[str, list]] = []
        # blocks merge only with their neighbours in the same stage
        for key, named in members.items():
            last = merged[-1] if merged else None
            if (
                last
                and key.startswith("layers.")
                and last[0].startswith("layers.")
                and part_of[key] == part_of[last[0]]
                and _domain(key) == _domain(last[0])
                and key.endswith(FROZEN) == last[0].endswith(FROZEN)
                and sum(p.numel() * p.element_size() for _, p in last[1]) < self.plan.bucket_bytes
            ):
                merged[-1] = (last[0], last[1] + named)
            else:
                merged.append((key, list(named)))
        self.groups = [
            FlatGroup(
                key,
                named,
                self.plan,
                self.domain_routes.get(_domain(key), self.routes),
                names,
                tied_copy=any(id(p) in tied_ids for _, p in named),
                sync_level=self.sync_level,
                frozen=key.endswith(FROZEN),
            )
            for key, named in merged
        ]
        group_of = {id(slot.param): g for g in self.groups for slot in g.slots}
        self.unit_groups = {
            k: list(dict.fromkeys(group_of[i] for i in ids if i in group_of))
            for k, ids in used.items()
        }

    def _place(
        self,
        p: nn.Parameter,
        unit: str,
        tied_ids: set[int],
        names: dict[int, list[str]],
        owner: dict[int, str],
    ) -> None:
        """The flat group parameter `p` goes into (`owner[id(p)]`): its unit's, of its domain, or
        the tied weight's. A frozen parameter (no gradient) goes into a group of frozen ones under
        ZeRO-3, which partitions it as any other but reduces and steps nothing; without ZeRO-3
        into none (`self.frozen`: whole on every rank, no copy into a flat buffer)."""
        domain = domain_of(p) if domain_of(p) in self.domains else ""
        key = f"{unit}@{domain}" if domain else unit
        if not p.requires_grad:
            owner[id(p)] = key + FROZEN if self.plan.shards_params else ""
            if not self.plan.shards_params:
                self.frozen.append((names[id(p)][0], p))
            return
        tied = id(p) in tied_ids or len(set(names[id(p)])) > 1
        owner[id(p)] = "tied" if tied else key

    def _install_hooks(self, parts: list[nn.Module]) -> None:
        trained = [g for g in self.groups if not g.frozen]
        for slot_param, (group, slot) in ((s.param, (g, s)) for g in trained for s in g.slots):
            slot_param.register_post_accumulate_grad_hook(lambda p, g=group, s=slot: g.add_grad(s))
        if not self.plan.shards_params:
            return  # parameters stay whole: only gradients need hooks
        for pi, part in enumerate(parts):
            units = units_of(part)
            order = [self.unit_groups[(pi, ui)] for ui in range(len(units))]
            for g in order[0] if order else []:
                g.opens_forward = True
            for ui, (_, modules) in enumerate(units):
                modules[0].register_forward_pre_hook(
                    lambda m, args, o=order, u=ui: self._pre_forward(o, u), prepend=True
                )
                modules[-1].register_forward_hook(
                    lambda m, args, out, o=order, u=ui: self._post_forward(o, u, out)
                )

    def _overlap(self) -> Reducer | None:
        """Reductions behind backward: process groups of their own for every hop a reduction takes
        (made now, in the same order on every rank), and a Reducer each group hands its buckets
        to. None when there is nothing to reduce (a single data-parallel rank)."""
        plan = self.plan
        widest = max(plan.optim, self.sync_level, key=CHAIN.index)
        if not self.groups or not any(
            r.steps("none", widest) for r in [self.routes, *self.domain_routes.values()]
        ):
            return None
        reducer = Reducer()
        dedicated = {
            name: Routes(t, plan.hierarchical, dedicated=True)
            for name, t in [("", self.topo), *self.domains.items()]
        }
        uses: dict[int, set[int]] = {}
        for (pi, _), groups in self.unit_groups.items():
            for g in groups:
                uses.setdefault(id(g), set()).add(pi)
        for g in self.groups:
            g.reducer, g.reduce_routes = reducer, dedicated[_domain(g.name)]
            # a weight in two pipeline stages: two backwards per micro-batch
            g.uses = len(uses.get(id(g), {0}))
        # Every chain a group can start, built once now: each makes its groups, in the same order on
        # every rank.
        for name in dedicated:
            first = next((g for g in self.groups if _domain(g.name) == name and not g.frozen), None)
            if first is None:
                continue
            if plan.grads != "none":
                first.hops("none", to=plan.grads)
            first.hops("none", add_into_shard=plan.grads != "none")
        return reducer

    def expect_backwards(self, micro_batches: int) -> None:
        """The step about to run has this many micro-batches (each part runs backward once per
        micro-batch): a group's reduction starts after its last backward of the step."""
        for g in self.groups:
            # a step starts with nothing gathered (one that failed part-way may have left some)
            g.free()
            g.expected, g.backwards = micro_batches * g.uses, 0

    # --- hooks (ZeRO-3) --------------------------------------------------------------------
    def _prefetch(self, order: list[list[FlatGroup]], units: range) -> None:
        for u in units:
            for g in order[u]:
                g.gather(async_op=True)

    def _pre_forward(self, order: list[list[FlatGroup]], u: int) -> None:
        for g in order[u]:
            g.wait()
        ahead = self.plan.prefetch_blocks
        self._prefetch(order, range(u + 1, min(len(order), u + 1 + ahead)))
        if self.param_tier is not None:  # shards read one step further ahead than the gathers
            self._read_ahead(
                order[u + 1 + ahead : u + 1 + ahead + self.param_tier.read_ahead_groups]
            )

    def _post_forward(self, order: list[list[FlatGroup]], u: int, out):
        backward = torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad
        later = {id(g) for groups in order[u + 1 :] for g in groups}
        for g in order[u]:
            # The last unit's backward runs first: when one is still to come this step
            # (`expect_backwards`), its groups stay gathered until their gradients are in (the
            # peak is no higher: they are the running unit when backward starts).
            if id(g) not in later and not (
                backward and u == len(order) - 1 and g.backward_to_come()
            ):
                g.free()
        if backward:
            out.register_hook(lambda grad, o=order, v=u: self._pre_backward(o, v))
        return out

    def _pre_backward(self, order: list[list[FlatGroup]], u: int) -> None:
        for g in order[u]:
            g.wait()
        # The unit after this one has run its backward: its frozen groups, which no gradient hook
        # frees, are done with for this micro-batch.
        using = {id(g) for g in order[u]}
        for g in order[u + 1] if u + 1 < len(order) else []:
            if g.frozen and id(g) not in using:
                g.backwards += 1
                g.free()
        ahead = self.plan.prefetch_blocks
        self._prefetch(order, range(u - 1, max(-1, u - 1 - ahead), -1))
        if self.param_tier is not None:
            start = u - 1 - ahead
            self._read_ahead(
                order[max(0, start - self.param_tier.read_ahead_groups + 1) : max(0, start + 1)][
                    ::-1
                ]
            )

    def _read_ahead(self, units: list[list[FlatGroup]]) -> None:
        assert self.param_tier is not None  # called only with a parameter tier
        self.param_tier.read_ahead(
            [g for groups in units for g in groups if not (g.gathered or g.secondary_valid)]
        )

    # --- the step --------------------------------------------------------------------------
    def finish_grads(self, scale: float) -> None:
        """After the last micro-batch: every segment's .grad is the data-parallel sum times `scale`."""
        for g in self.groups:
            if g.frozen:  # nothing to reduce; nothing gathered outlives the step
                g.free()
                g.backwards = 0
                continue
            reduced = g.finish_grads(scale)
            if g.tied_copy and self.tied_group is not None:
                comm.all_reduce(reduced, self.tied_group, dim="pp")

    def clip_grad_norm(self, max_norm: float, tp_group=None, pp_group=None) -> torch.Tensor:
        """Clip the segments' gradients by the norm of the whole model's gradient."""
        partition, _ = self.topo.digit_group("none", self.plan.optim)
        others = [g for g in self.groups if _domain(g.name)]
        if tp_group is None and pp_group is None and partition is None and not others:
            # This rank's segments are the whole gradient, in the model's parameter order: torch's
            # own clip_grad_norm_ gives, bit for bit, what a plain training loop computes.
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        counted = [
            (slot, piece)
            for g in self.groups
            if (self.count_tied or not g.tied_copy) and not _domain(g.name)
            for slot, piece, _, _ in g.segments
        ]
        sharded = [
            _grad(piece)
            for slot, piece in counted
            if placement_of(slot.param).shard_dim is not None
        ]
        replicated = [
            _grad(piece) for slot, piece in counted if placement_of(slot.param).shard_dim is None
        ]
        device = self.groups[0].full.device if self.groups else self.device
        total = global_grad_norm(
            sharded,
            replicated,
            tp_group,
            pp_group,
            partition,
            device,
            extra_sq=self._domains_sq(others, device),
        )
        if math.isfinite(max_norm):
            scale_to_norm(
                [piece.grad for piece in self.params if piece.grad is not None], max_norm, total
            )
        return total

    def _domains_sq(self, groups: list[FlatGroup], device: torch.device) -> torch.Tensor | None:
        """The squared norm of this pipeline stage's gradients in other domains: each domain's
        pieces summed over its partition, then over its expert-parallel group (whose ranks hold
        other experts)."""
        if not self.domains:
            return None
        total = torch.zeros((), dtype=torch.float32, device=device)
        for name, topo in self.domains.items():  # every rank, every domain, in the same order
            sq = torch.zeros((), dtype=torch.float32, device=device)
            for g in groups:
                if _domain(g.name) == name:
                    for _, piece, _, _ in g.segments:
                        sq += _grad(piece).float().pow(2).sum()
            comm.all_reduce(sq, topo.digit_group("none", self.plan.optim)[0], dim=name)
            total += comm.all_reduce(sq, topo.group("ep"), dim=name)
        return total

    def step(self, after_update: Callable[[], None] | None = None) -> None:
        """Step the optimizer on the local chunks (then `after_update`, which may change them:
        CO2's outer update), then rebuild the parameter partition."""
        if self.optim_tier is not None:
            self.optim_tier.step()
        else:
            self.optimizer.step()
        if after_update is not None:
            after_update()
        self.rebuild()

    def rebuild(self) -> None:
        """All-gather every group's optimizer chunk back into its parameter partition (after the
        step, or after anything else changed the chunks in place)."""
        for g in self.groups:
            g.rebuild()

    def zero_grad(self) -> None:
        for g in self.groups:
            g.zero_grad()

    # --- inspection and checkpoints --------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameter, gradient and optimizer-state storage this rank holds right now
        (measured from the tensors, not computed from the plan)."""
        out = {"params": storage_bytes([p for _, p in self.frozen]), "grads": 0}
        for g in self.groups:
            for k, v in g.held_bytes().items():
                out[k] += v
        out["optim"] = (
            self.optim_tier.device_bytes()
            if self.optim_tier is not None
            else optimizer_state_bytes(self.optimizer)
        )
        return out

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every group's parameters whole inside the block (for inspection)."""
        for g in self.groups:
            g.gather()
        try:
            yield
        finally:
            for g in self.groups:
                g.free()

    def close(self) -> None:
        """Wait out reductions in flight and end the reduction lanes."""
        for g in self.groups:
            g.drain()
            g.reducer = None  # any later step reduces serially
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None

    def invalidate_secondary(self) -> None:
        """The parameter shards were written from outside (a checkpoint load): hpZ copies are stale."""
        for g in self.groups:
            g.secondary_valid = False
