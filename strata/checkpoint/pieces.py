"""What this rank holds of the global training state, as boxes of globally named tensors: each
`Piece` is a live, contiguous view of a parameter, a ZeRO shard or an optimizer state, with the box
(offsets, sizes) it covers in the tensor the unsharded model would have. Saving copies pieces out,
loading copies into them, so neither needs a gather and any layout can read any other's boxes.

Keys follow torch.distributed.checkpoint's flattened state dict: `model.{fqn}`,
`optim.state.{fqn}.{exp_avg|exp_avg_sq|step|…}`; a tied weight is keyed by its first name in the
plain model (its other names are aliases), `rng.cpu.rank{r}` is each rank's RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from strata.parallel.flat import Box, range_to_boxes
from strata.parallel.tensor import Placement, placement_of

if TYPE_CHECKING:
    from strata.parallel.zero import ZeroEngine


@dataclass
class Piece:
    """One box of a globally named tensor that this rank holds: the key, the whole tensor's
    global shape, where the box sits in it, and the box's data."""

    key: str
    global_shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor  # contiguous, shape box.sizes

    @property
    def dtype(self) -> torch.dtype:
        """The tensor's element type."""
        return self.tensor.dtype


def canonical_names(model: nn.Module) -> dict[str, str]:
    """{every parameter name of the plain model: the first name of that parameter} (a tied
    embedding's output name maps to the embedding's)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def whole_piece(key: str, tensor: torch.Tensor) -> Piece:
    """A tensor that is its whole global tensor (one process's state, an RNG state, a read target)."""
    return Piece(key, tuple(tensor.shape), Box((0,) * tensor.ndim, tuple(tensor.shape)), tensor)


def _range_pieces(
    key: str, placement: Placement, local_shape: tuple[int, ...], start: int, flat: torch.Tensor
) -> list[Piece]:
    """Pieces of the flat range [start, start + flat.numel()) of a tp-local tensor (`flat` holds it)."""
    outer = placement.box(local_shape)
    out, pos = [], 0
    for box in range_to_boxes(local_shape, start, start + flat.numel()):
        out.append(
            Piece(
                key,
                placement.global_shape,
                box.shifted(outer.offsets),
                flat[pos : pos + box.numel].view(box.sizes),
            )
        )
        pos += box.numel
    return out


def state_pieces(
    fqn: str, entry: dict, placement: Placement, local_shape: tuple[int, ...], start: int
) -> list[Piece]:
    """Pieces of one parameter's optimizer state (its tensors cover the same flat range as the
    parameter piece; 0-d values such as `step` are whole)."""
    out = []
    for kind, value in entry.items():
        if not torch.is_tensor(value):
            raise TypeError(
                f"optimizer state {fqn}.{kind} is a {type(value).__name__}; "
                "checkpoints hold tensors"
            )
        key = f"optim.state.{fqn}.{kind}"
        if value.ndim == 0:
            out.append(Piece(key, (), Box((), ()), value.view(())))
        else:
            out += _range_pieces(key, placement, local_shape, start, value.view(-1))
    return out


def model_pieces(engine: ZeroEngine, canonical: dict[str, str]) -> list[Piece]:
    """This rank's parameters: the slices of its flat parameter shards (never gathered; whole
    tp-local tensors when parameters are not partitioned), and its frozen parameters (whole
    tp-local tensors)."""
    out = []
    for name, p in engine.frozen:
        placement = placement_of(p)
        box = placement.box(tuple(p.shape))
        out.append(Piece(f"model.{canonical[name]}", placement.global_shape, box, p.data))
    for g in engine.groups:
        lo, hi = g.param_start, g.param_start + g.shard.numel()
        for slot in g.slots:
            a, b = max(lo, slot.range[0]), min(hi, slot.range[1])
            if a < b:
                out += _range_pieces(
                    f"model.{canonical[slot.aliases[0]]}",
                    placement_of(slot.param),
                    slot.segment.shape,
                    a - slot.range[0],
                    g.shard[a - lo : b - lo],
                )
    return out


def optimizer_entries(
    engine: ZeroEngine, canonical: dict[str, str]
) -> list[tuple[nn.Parameter, str, Placement, tuple[int, ...], int]]:
    """(optimizer parameter, canonical name, placement, tp-local shape, start of its flat range)
    for every parameter segment this rank's optimizer steps."""
    return [
        (piece, canonical[slot.aliases[0]], placement_of(slot.param), slot.segment.shape, a)
        for g in engine.groups
        for slot, piece, a, _ in g.segments
    ]


def optimizer_pieces(optimizer: torch.optim.Optimizer, entries) -> list[Piece]:
    """The optimizer state this rank holds (parameters not yet stepped have none)."""
    out = []
    for param, fqn, placement, shape, start in entries:
        if optimizer.state.get(param):
            out += state_pieces(fqn, optimizer.state[param], placement, shape, start)
    return out


def rng_piece(rank: int) -> Piece:
    """This rank's CPU random-number generator state, as a whole piece of its own key."""
    return whole_piece(f"rng.cpu.rank{rank}", torch.get_rng_state())


class CachedPieces:
    """`model_pieces` + `optimizer_pieces` made once and handed out again while every tensor they
    view is the one they were made from: rebuilding ~160 pieces costs ~2 ms of Python per save or
    snapshot, checking their ~120 source tensors ~0.05 ms.

    A source counts as the same while it is the same tensor object, at the same address, with the
    same shape and dtype, and the optimizer holds the same kinds of state for the same parameters.
    So the pieces are made again after a resume (new optimizer state), after the first step
    (the state appears), each save under CO2 (its momentum is a fresh tensor) and after a `.data`
    or `set_` rebinding; in-place updates (every step) keep them, as they view the live memory."""

    def __init__(self) -> None:
        self._owners: tuple = ()  # (engine, optimizer, canonical) the pieces were made for
        self._groups: list = []
        self._entries: list = []
        self._kinds: list[tuple[str, ...]] = []
        # the source tensors themselves: kept alive, so `is` stays meaningful
        self._tensors: list = []
        self._marks: list[tuple] = []
        self._pieces: list[Piece] = []

    def get(
        self, engine: ZeroEngine, optimizer: torch.optim.Optimizer, canonical: dict[str, str]
    ) -> list[Piece]:
        """This rank's model and optimizer pieces (a new list; the Piece objects are shared while
        unchanged, which `checkpoint.stage` uses to skip re-checking their layout)."""
        owners = (engine, optimizer, canonical)
        groups = engine.groups
        if (
            len(owners) != len(self._owners)
            or any(a is not b for a, b in zip(owners, self._owners))
            or len(groups) != len(self._groups)
            or any(a is not b for a, b in zip(groups, self._groups))
        ):
            self._owners, self._groups = owners, list(groups)
            self._entries = optimizer_entries(engine, canonical)
            self._tensors, self._pieces = [], []
        kinds, tensors = self._sources(optimizer)
        marks = [(t.data_ptr(), t.shape, t.dtype) for t in tensors]
        if (
            kinds != self._kinds
            or len(tensors) != len(self._tensors)
            or any(a is not b for a, b in zip(tensors, self._tensors))
            or marks != self._marks
        ):
            self._pieces = model_pieces(engine, canonical) + optimizer_pieces(
                optimizer, self._entries
            )
            self._kinds, self._tensors, self._marks = kinds, tensors, marks
        return list(self._pieces)

    def _sources(self, optimizer: torch.optim.Optimizer) -> tuple[list[tuple[str, ...]], list]:
        """(the state kinds of every optimizer entry, every tensor a piece views): the flat
        parameter shards, then each entry's state values (a non-tensor value is kept too, so that
        rebuilding raises optimizer_pieces' error about it)."""
        kinds: list[tuple[str, ...]] = []
        tensors: list = [g.shard for g in self._groups]
        tensors += [p for _, p in self._owners[0].frozen]
        state = optimizer.state
        for param, *_ in self._entries:
            entry = state.get(param)
            if entry:
                kinds.append(tuple(entry))
                tensors.extend(entry.values())
            else:
                kinds.append(())
        return kinds, [t if torch.is_tensor(t) else _NOT_A_TENSOR for t in tensors]


_NOT_A_TENSOR = torch.empty(0)  # stands for a non-tensor state value: never equal to a real source


@dataclass
class StateContents:
    """What one rank contributes to a checkpoint or snapshot: its pieces (RNG state included), the
    objects only rank 0 stores (trainer state, optimizer hyper-parameters), the tied weights' other
    names (alias → saved key) and the layout that saved it."""

    pieces: list[Piece]
    objects: dict
    aliases: dict[str, str]
    layout: dict


class SavableState(Protocol):
    """The training state a `CheckpointManager` saves and a `SnapshotManager` snapshots."""

    def contents(self, step: int) -> StateContents:
        """What to save for `step`: this rank's pieces, its objects, the aliases of tied tensors and
        the layout."""


@dataclass
class FixedState:
    """Contents that do not change between saves (offline tools, tests)."""

    fixed: StateContents

    def contents(self, step: int) -> StateContents:
        """The fixed contents, whatever the step."""
        return self.fixed
