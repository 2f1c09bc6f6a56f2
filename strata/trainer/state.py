"""The training state as one object: what a checkpoint or an in-memory snapshot of this rank holds
(its pieces of the model and optimizer state, its RNG state, rank 0's trainer state and optimizer
hyper-parameters, the tied weights' aliases, the saving layout), and putting a saved state back
into this layout. `CheckpointManager` and `SnapshotManager` both take it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from strata.checkpoint.layout import (
    hyperparameters,
    load_optimizer,
    model_state_problems,
    optimizer_problems,
)
from strata.checkpoint.pieces import (
    CachedPieces,
    Piece,
    StateContents,
    model_pieces,
    optimizer_entries,
    rng_piece,
    state_pieces,
    whole_piece,
)
from strata.checkpoint.reader import Checkpoint
from strata.config import Config
from strata.data.loader import BatchLoader, MixtureLoader
from strata.errors import CheckpointError
from strata.lora import is_adapter
from strata.trainer.parallelize import ParallelModel, decays

if TYPE_CHECKING:
    from strata.checkpoint.dcp_source import DcpCheckpoint


class Stateful(Protocol):
    """A part of the trainer whose state a checkpoint keeps beside the step (the spike guard)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this part (plain values)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Put back what `state_dict` gave."""
        ...


class TrainState:
    """This rank's training state: the parallel model (parameters and optimizer state, wherever the
    engine and tiers keep them), the data position, the RNG and the step."""

    def __init__(
        self, cfg: Config, model: ParallelModel, loader: BatchLoader | MixtureLoader, rank: int
    ):
        self.model, self.loader, self.rank = model, loader, rank
        self.step = 0
        # rank 0's trainer state keeps these (`trainer.parts` in a checkpoint), each by its name
        self.parts: dict[str, Stateful] = {}
        self.notes: list[str] = []  # what a load could not put back, for the run to print
        self._pieces = CachedPieces()  # made again only when a tensor they view is replaced
        layout, zero = model.topo.layout, cfg.zero
        self.layout = {
            "world": layout.world_size,
            "tp": layout.tp,
            "pp": layout.pp,
            "dp": layout.dp,
            "virtual_stages": cfg.parallel.virtual_stages,
            "zero": {
                "params": zero.params.shard_over,
                "grads": zero.grads.shard_over,
                "optim": zero.optim.shard_over,
            }
            if zero.enabled
            else None,
        }

    # --- saving ----------------------------------------------------------------------------
    def contents(self, step: int) -> StateContents:
        """What a checkpoint or snapshot of `step` holds from this rank (live views: the managers
        copy them before training goes on)."""
        m = self.model
        pieces = (
            self._pieces.get(m.engine, m.optimizer, m.canonical)
            + self._buffer_pieces()
            + [rng_piece(self.rank)]
        )
        objects = (
            {
                "trainer": {
                    "step": step,
                    "data": self.loader.state_dict(),
                    "parts": {name: part.state_dict() for name, part in self.parts.items()},
                },
                "optim.param_groups": self._param_groups(),
            }
            if self.rank == 0
            else {}
        )
        aliases = {
            f"model.{name}": f"model.{first}"
            for name, first in m.canonical.items()
            if name != first
        }
        return StateContents(pieces, objects, aliases, self.layout)

    @contextlib.contextmanager
    def ready_to_save(self) -> Iterator[None]:
        """Inside the block the whole state is in memory and self-consistent: offloaded shards and
        moments are read back, and under CO2 the round is closed (every node on the same state) and
        the outer momentum sits beside each parameter's optimizer state, so it is saved with it."""
        m = self.model
        if m.co2:
            m.close_co2_round()
            for p, mom in zip(m.params, m.co2.momentum_views()):
                # staged (copied) before a save returns
                m.optimizer.state[p]["co2_momentum"] = mom.clone()
        try:
            with m.state_in_memory():
                yield
        finally:
            for p in m.params:
                m.optimizer.state[p].pop("co2_momentum", None)

    def _buffer_pieces(self) -> list[Piece]:
        """The model's persistent buffers (whole on every rank that holds their layer)."""
        return [
            whole_piece(f"model.{name}", b) for name, b in self.model.persistent_buffers().items()
        ]

    def _param_groups(self) -> list[dict]:
        """The optimizer's hyper-parameters with each group's parameters named as in the plain model,
        as torch.distributed.checkpoint.state_dict names them (build_optimizer's grouping: matrices
        decay; frozen parameters in neither), so a plain torch AdamW can load the state with DCP
        alone."""
        frozen = self.model.frozen
        names = [n for n in dict.fromkeys(self.model.canonical.values()) if n not in frozen]
        shapes = self.model.global_shapes
        matrix = [n for n in names if decays(shapes[n])]
        other = [n for n in names if not decays(shapes[n])]
        return [
            {**h, "params": group}
            for h, group in zip(hyperparameters(self.model.optimizer), (matrix, other))
        ]

    # --- loading ---------------------------------------------------------------------------
    def load(
        self,
        ckpt: Checkpoint | DcpCheckpoint,
        verify: bool,
        agree: Callable[[list[str], str], None],
    ) -> Path:
        """Load a checkpoint saved from any layout into this one. Every check and every read (into
        fresh tensors) happens first, and all ranks `agree` on the verdict (raising together), before
        any state changes. Offloaded state is in memory meanwhile, and goes back to its tier after."""
        with self.model.state_in_memory(changed=True):
            return self._load(ckpt, verify, agree)

    def _load(
        self,
        ckpt: Checkpoint | DcpCheckpoint,
        verify: bool,
        agree: Callable[[list[str], str], None],
    ) -> Path:
        m = self.model
        misfit: list[str] = []
        try:
            problems = ckpt.problems or model_state_problems(m.global_shapes, ckpt.shapes("model."))
            misfit = [] if ckpt.problems else problems
            live = model_pieces(m.engine, m.canonical) + self._buffer_pieces()
            fresh = [Piece(p.key, p.global_shape, p.box, torch.empty_like(p.tensor)) for p in live]
            optim_state, optim_targets = self._fresh_optimizer_state(ckpt)
            rng = self._rng_target(ckpt)
            objects = {}
            if not problems:
                problems = ckpt.read(fresh + optim_targets + rng, verify)
                # an imported model's checkpoint has no optimizer: it starts fresh
                keys = (
                    ("trainer", "optim.param_groups")
                    if ckpt.has_object("optim.param_groups")
                    else ("trainer",)
                )
                objects = {k: ckpt.object(k) for k in keys}
                misfit = self.loader.state_problems(objects["trainer"]["data"])
                if "optim.param_groups" in objects:
                    misfit += optimizer_problems(m.optimizer, objects["optim.param_groups"])
                problems += misfit
        except CheckpointError as e:
            problems = [str(e)]
        finally:
            ckpt.close()
        agree(
            problems,
            f"{ckpt.path} does not fit this run, nothing was loaded; resume with the "
            "config it was saved with (see its config.yaml)"
            if misfit
            else f"{ckpt.path} is damaged, nothing was loaded; resume from another checkpoint "
            "(`strata ckpt verify DIR` checks one)",
        )
        with torch.no_grad():
            for dst, src in zip(live, fresh):
                dst.tensor.copy_(src.tensor)
        # a checkpoint without hyper-parameters (imported, or DCP's alone) keeps this run's
        load_optimizer(
            m.optimizer,
            optim_state,
            objects.get("optim.param_groups", hyperparameters(m.optimizer)),
        )
        m.engine.invalidate_secondary()
        state = objects["trainer"]
        self.loader.load_state_dict(state["data"])
        for piece in rng:
            torch.set_rng_state(piece.tensor)
        self.step = int(state["step"])
        self._load_parts(state.get("parts", {}), ckpt.path)
        momentum = [m.optimizer.state[p].pop("co2_momentum", None) for p in m.params]
        if m.co2:
            m.co2.restart(self.step, None if any(x is None for x in momentum) else momentum)
        return ckpt.path

    def _load_parts(self, saved: dict, path: Path) -> None:
        """Put back each part's saved state; a part a checkpoint lacks (saved before it was kept)
        starts afresh, with a note."""
        for name, part in self.parts.items():
            if name in saved:
                part.load_state_dict(saved[name])
            else:
                self.notes.append(
                    f"{path} holds no {name} state (an older checkpoint): it starts afresh"
                )

    def load_weights(
        self, ckpt: Checkpoint | DcpCheckpoint, agree: Callable[[list[str], str], None]
    ) -> None:
        """Only the model's weights from `ckpt` (a Hugging Face model, another checkpoint), into
        this layout at the start of a new run, each rank reading just its own boxes straight into its
        parameters (no second copy of the model: there is no earlier state to keep intact, and a
        failed load ends the run); the optimizer, the data position and the step stay fresh. Every
        rank agrees on the verdict before training can start."""
        with self.model.state_in_memory(changed=True):
            m = self.model
            # tied: one name
            first = {k: v for k, v in m.global_shapes.items() if m.canonical.get(k, k) == k}
            try:
                saved = {
                    k: v for k, v in ckpt.shapes("model.").items() if m.canonical.get(k, k) == k
                }
                # buffers a source lacks (an MoE router's expert bias in a Hugging Face model) start
                # at zero, adapters (a base model's) at their initial values
                fresh = {
                    k
                    for k in [*m.persistent_buffers(), *filter(is_adapter, first)]
                    if k not in saved
                }
                problems = model_state_problems(
                    {k: v for k, v in first.items() if k not in fresh}, saved
                )
                if not problems:
                    wanted = model_pieces(m.engine, m.canonical) + self._buffer_pieces()
                    with torch.no_grad():
                        problems = ckpt.read(
                            [p for p in wanted if p.key.removeprefix("model.") not in fresh]
                        )
            except CheckpointError as e:
                problems = [str(e)]
            finally:
                ckpt.close()
            agree(problems, f"the weights in {ckpt.path} do not fit this model; the run stops")
            m.engine.invalidate_secondary()

    def load_adapters(self, ckpt: Checkpoint, agree: Callable[[list[str], str], None]) -> None:
        """The LoRA adapters of `ckpt` (a PEFT adapter directory, model.lora.init_from) into this
        rank's adapter parameters, after the base weights: it must hold every adapter of the model,
        of its shape, and nothing else. Every rank agrees on the verdict."""
        with self.model.state_in_memory(changed=True):
            m = self.model
            try:
                want = {k: v for k, v in m.global_shapes.items() if is_adapter(k)}
                problems = model_state_problems(want, ckpt.shapes("model."))
                if not problems:
                    pieces = model_pieces(m.engine, m.canonical)
                    with torch.no_grad():
                        problems = ckpt.read([p for p in pieces if is_adapter(p.key)])
            except CheckpointError as e:
                problems = [str(e)]
            finally:
                ckpt.close()
            agree(
                problems,
                f"the adapters in {ckpt.path} do not fit this model's (model.lora: rank, "
                "target_modules); the run stops",
            )
            m.engine.invalidate_secondary()

    def _rng_target(self, ckpt: Checkpoint | DcpCheckpoint) -> list[Piece]:
        """This rank's saved RNG state, or rank 0's when the saving world was smaller, or none (an
        imported checkpoint: the RNG stays as initialisation left it)."""
        keys = [k for k in (f"rng.cpu.rank{self.rank}", "rng.cpu.rank0") if ckpt.has(k)]
        return [whole_piece(keys[0], torch.get_rng_state())] if keys else []

    def _fresh_optimizer_state(
        self, ckpt: Checkpoint | DcpCheckpoint
    ) -> tuple[dict[int, dict], list[Piece]]:
        """New optimizer-state tensors for every kind the checkpoint holds (torch index → entry),
        and the pieces that read into them."""
        m = self.model
        saved: dict[str, dict[str, tuple]] = {}
        for key, shape in ckpt.shapes("optim.state.").items():
            fqn, kind = key.rsplit(".", 1)
            saved.setdefault(fqn, {})[kind] = shape
        index = {
            id(p): i for i, p in enumerate(p for g in m.optimizer.param_groups for p in g["params"])
        }
        state, targets = {}, []
        for param, fqn, placement, shape, start in optimizer_entries(m.engine, m.canonical):
            if fqn in saved:
                entry = {
                    kind: torch.empty((), dtype=torch.float32)
                    if not s
                    else torch.empty_like(param.data)
                    for kind, s in saved[fqn].items()
                }
                state[index[id(param)]] = entry
                targets += state_pieces(fqn, entry, placement, shape, start)
        return state, targets
