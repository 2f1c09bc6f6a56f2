"""The training loop: one Trainer with small steps (set up, train a step, evaluate, save, resume).

It asks the data loader for this rank's micro-batches, accumulates gradients, averages them over
the data-parallel group, clips, steps AdamW under a warmup+cosine schedule, and reports.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from strata.checkpoint.layout import hyperparameters, load_optimizer, model_state_problems, optimizer_problems
from strata.checkpoint.manager import CheckpointManager
from strata.checkpoint.pieces import (Piece, canonical_names, model_pieces, optimizer_entries, optimizer_pieces, rng_piece,
                               state_pieces, whole_piece)
from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.parallel import comm
from strata.parallel.data_parallel import GradientBuckets, unique_params
from strata.parallel.runtime import Runtime
from strata.parallel.clipping import clip_grad_norm
from strata.parallel.co2 import CO2
from strata.parallel.pipeline import Pipeline, StageShapes, split_stages
from strata.parallel.tensor import apply_tensor_parallel, placement_of
from strata.parallel.topology import Topology, build_topology, layout_from_config
from strata.parallel.zero import ZeroEngine, ZeroPlan, held_bytes
from strata import config as config_mod
from strata.config import Config, ModelConfig, OptimConfig
from strata.trainer.data import BatchLoader, TokenDataset, ensure_default_corpus, eval_batches
from strata.errors import CheckpointError, ConfigError
from strata.trainer.metrics import MetricsLogger
from strata.model import (GPT, count_params, flops_per_token, initial_value, lm_loss, padded_vocab_size,
                           set_rope_buffers)

if TYPE_CHECKING:
    from strata.checkpoint.snapshot import SnapshotManager
    from strata.offload.tiers import Tiers


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
    min_lr = optim.lr * optim.min_lr_ratio
    return min_lr + (optim.lr - min_lr) * shape


def materialize(parts: list[torch.nn.Module], cfg: ModelConfig, seed: int, device: torch.device) -> None:
    """Give meta-device modules real parameters on `device`, each filled with its slice (its
    `placement`) of the whole initial value. One Parameter per meta Parameter, registered
    everywhere the old one was, with its attributes: tying survives, also across the parts."""
    names = {id(p): n for part in parts for n, p in part.named_parameters()}
    fresh: dict[int, torch.nn.Parameter] = {}
    for part in parts:
        for module in part.modules():
            for key, p in module._parameters.items():
                if p is None or not p.is_meta:
                    continue
                if id(p) not in fresh:
                    pl = placement_of(p)
                    whole = initial_value(cfg, names[id(p)], pl.global_shape, seed)
                    q = torch.nn.Parameter(torch.empty(p.shape, device=device).copy_(pl.local_slice(whole)),
                                           requires_grad=p.requires_grad)
                    q.__dict__.update(p.__dict__)  # placement
                    fresh[id(p)] = q
                module._parameters[key] = fresh[id(p)]
        set_rope_buffers(part, cfg, device)


def decays(shape: tuple[int, ...]) -> bool:
    """Whether a parameter of this shape gets weight decay, i.e. is in AdamW's group 0: matrices."""
    return len(shape) >= 2


def build_optimizer(params: list[torch.nn.Parameter], optim: OptimConfig, device: torch.device,
                    shape_of=lambda p: tuple(p.shape)) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (`shape_of`: for ZeRO's flat pieces, the shape of
    the parameter a piece belongs to); torch's fused kernel where available."""
    groups = [{"params": [p for p in params if decays(shape_of(p))], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if not decays(shape_of(p))], "weight_decay": 0.0}]
    kernel = {"fused": True} if optim.impl in ("fused", "auto") else {"foreach": True}
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **kernel)


@dataclass
class RunResult:
    """What a finished run reports (rank 0's view; losses are dp-averaged)."""
    losses: dict[int, float] = field(default_factory=dict)     # step (1-based) -> train loss
    eval_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    final_step: int = 0


class Trainer:
    def __init__(self, cfg: Config, runtime: Runtime):
        self.cfg, self.rt = cfg, runtime
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        par = cfg.parallel
        layout = layout_from_config(par, runtime.world_size, runtime.local_world_size)
        self.topo: Topology = build_topology(layout, runtime.rank)
        self.dp_group, self.tp_group, self.pp_group = (self.topo.group(d) for d in ("dp", "tp", "pp"))
        data_dir = Path(cfg.data.path) if cfg.data.path else self._default_corpus()
        self.train_set = TokenDataset(data_dir, "train", cfg.model.seq_len)
        self.val_set = TokenDataset(data_dir, "val", cfg.model.seq_len)
        # Under CO2 gradients are averaged inside the node only; CO2 joins the nodes every H steps.
        self.sync_level = "node" if cfg.co2.enabled else "global"
        self.sync_group, sync_members = self.topo.digit_group("none", self.sync_level)
        self.sync_size = len(sync_members)
        self.parts, self.pipeline = self._build_model()
        self.engine = self._partition() if cfg.zero.enabled else None
        self.tiers = self._memory_tiers() if cfg.offload.enabled or cfg.activations.offload != "none" else None
        self._activation_policy()
        if self.engine:
            self.params, self.optimizer = self.engine.params, self.engine.optimizer
        else:
            self.params = unique_params(*self.parts)
            self.buckets = GradientBuckets(self.params, int(par.bucket_mb * 2**20))
            self.optimizer = build_optimizer(self.params, cfg.optim, runtime.device)
        self.co2 = self._outer_updates() if cfg.co2.enabled else None
        self.held_bytes: dict[str, int] = {}
        self.loader = BatchLoader(self.train_set, cfg.train.seed, cfg.train.global_batch_size,
                                  cfg.train.micro_batch_size, self.topo.dp_rank, layout.dp)
        self._config_yaml = config_mod.dump(cfg)  # saved with every checkpoint
        control = comm.new_gloo_group() if runtime.distributed else None  # saves' and snapshots' collectives
        self.checkpoints = CheckpointManager(cfg.checkpoint_dir(), runtime.rank, runtime.world_size,
                                             cfg.checkpoint.keep_last, cfg.checkpoint.async_save, control)
        self.snapshots = self._snapshot_manager(control) if cfg.snapshot.every_steps else None
        self.step = 0
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        self.flops_per_token = flops_per_token(cfg.model, self.vocab_size)

    def _build_model(self) -> tuple[list[torch.nn.Module], Pipeline | None]:
        """The plain model, built on the meta device (no memory), transformed — tensor parallel,
        then split into this rank's pipeline stages — and only then materialised: each rank
        allocates and initialises just its own slices, with the values one process would give
        them (`initial_value` depends on the parameter's name, not on the layout)."""
        cfg, par = self.cfg, self.cfg.parallel
        with torch.device("meta"):
            model = GPT(cfg.model, padded_vocab_size(cfg.model, self.train_set.vocab_size))
        self.vocab_size = model.vocab_size
        # every persistent state-dict entry of the whole model, before any sharding (resume checks)
        self.global_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self.canonical = canonical_names(model)
        self.loss_fn = lm_loss
        if par.tp > 1:
            self.loss_fn = apply_tensor_parallel(model, self.tp_group, self.topo.coords["tp"], par.tp,
                                                 sequence_parallel=par.sequence_parallel)
        if par.pp == 1:
            materialize([model], cfg.model, cfg.train.seed, self.rt.device)
            return [model], None
        parts = split_stages(model, self.topo.coords["pp"], par.pp, par.virtual_stages, par.schedule)
        materialize(parts, cfg.model, cfg.train.seed, self.rt.device)
        tied_group = self.topo.group("pp_ends") if cfg.model.tie_embeddings else None
        shapes = self._stage_shapes() if cfg.zero.enabled else None
        pipeline = Pipeline(parts, self.loss_fn, self.pp_group, par.pp, par.virtual_stages, par.schedule,
                            cfg.grad_accum_steps(self.rt.world_size), self.rt.device, tied_group, shapes)
        return parts, pipeline

    def _stage_shapes(self) -> StageShapes:
        """What crosses a stage boundary, declared up front: otherwise torch's pipelining infers
        it by running a real forward and backward, which ZeRO's hooks would take for a step."""
        cfg, par = self.cfg, self.cfg.parallel
        mbs, seq, tp = cfg.train.micro_batch_size, cfg.model.seq_len, par.tp
        local_seq = seq // tp if par.sequence_parallel and tp > 1 else seq
        return StageShapes(tokens=(mbs, seq), hidden=(mbs, local_seq, cfg.model.d_model),
                           logits=(mbs, seq, self.vocab_size // tp),
                           logits_dtype=torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32)

    def _partition(self) -> ZeroEngine:
        """The ZeRO engine over this rank's model parts (after tp and pp, as DESIGN.md orders them)."""
        tied = [self.pipeline.tied_weight] if self.pipeline and self.pipeline.tied_weight is not None else []
        return ZeroEngine(self.parts, self.topo, ZeroPlan.from_config(self.cfg.zero),
                          lambda params, shape_of: build_optimizer(params, self.cfg.optim, self.rt.device, shape_of),
                          tied, self.topo.group("pp_ends") if tied else None,
                          count_tied=not self.pipeline or self.pipeline.has_first, sync_level=self.sync_level)

    def _memory_tiers(self) -> "Tiers":
        """ZeRO state in host memory or NVMe (offload.*), over the engine's flat groups."""
        from strata.offload.tiers import Tiers  # offload's modules load only when a run uses them
        return Tiers(self.cfg, self.engine, self.rt.rank, self.rt.device)

    def _snapshot_manager(self, group) -> "SnapshotManager":
        from strata.checkpoint.snapshot import SnapshotManager  # loads the agent protocol only when snapshots are on
        return SnapshotManager(self.cfg.snapshot, self.rt.rank, self.rt.world_size, group)

    def _activation_policy(self) -> None:
        """activations.*: blocks that recompute their forward in backward, and saved tensors
        offloaded by hooks keyed by block (those of recomputed blocks are only their inputs)."""
        if self.cfg.activations.recompute == "full":
            from strata.offload.activations import apply_recompute
            apply_recompute(self.parts)
        if self.tiers and self.tiers.activations:
            self.tiers.activations.attach(self.parts)

    def _saving_activations(self):
        offloader = self.tiers.activations if self.tiers else None
        return offloader.saving() if offloader else contextlib.nullcontext()

    def offloaded_state_in_memory(self, changed: bool = False):
        """Offloaded shards and moments brought into memory for a checkpoint (a no-op without offload)."""
        return self.tiers.resident(changed) if self.tiers else contextlib.nullcontext()

    def _outer_updates(self) -> CO2:
        """CO2 across nodes over what this rank's optimizer steps (its ZeRO chunk, or the whole
        replica), exchanged with the ranks holding the same in the other nodes on a group of its own."""
        co2, layout = self.cfg.co2, self.topo.layout
        if layout.nodes < 2:
            raise ConfigError([f"co2.enabled needs at least 2 nodes, but the {layout.world_size} ranks are one node of "
                               f"{layout.node_size}; run on more nodes, set parallel.ranks_per_node to simulate "
                               "them, or set co2.enabled=false"])
        norm_group = self.topo.digit_group("none", self.cfg.zero.optim.shard_over)[0] if self.engine else None
        return CO2(self.params, self.topo.dedicated_digit_group("node", "global"), co2.outer_every, co2.outer_lr,
                   co2.outer_momentum, co2.staleness_penalty, co2.clip, co2.overlap, norm_group)

    def _default_corpus(self) -> Path:
        """Rank 0 prepares the built-in corpus once; the others wait, then read it."""
        if self.rt.rank == 0:
            ensure_default_corpus(self.cfg.data.cache_dir, self.cfg.data.val_fraction)
        comm.barrier()
        return ensure_default_corpus(self.cfg.data.cache_dir, self.cfg.data.val_fraction)

    # --- one step -------------------------------------------------------------------------
    def autocast(self):
        if self.cfg.train.precision == "bf16":
            return torch.autocast(self.rt.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over this rank's micro-batches, sync, clip, step. Returns the
        dp-averaged loss and the gradient norm before clipping, as 0-d tensors on the device (no
        host sync here, so a GPU can run ahead; callers read them with .item() when they log)."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.step, self.cfg.optim, self.cfg.train.steps)
        with self.autocast():
            loss = self.forward_backward(self.loader.next_step())
        if self.engine:  # the pipeline leaves the 1/M of its micro-batch mean to the engine
            self.engine.finish_grads(1 / (self.sync_size * (self.pipeline.microbatches if self.pipeline else 1)))
        elif self.sync_group is not None:
            self.buckets.all_reduce_mean(self.sync_group, self.sync_size)
        if self.dp_group is not None:
            comm.all_reduce(loss, self.dp_group, dim="dp")
            loss /= self.topo.dp_size
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        if self.engine:
            grad_norm = self.engine.clip_grad_norm(clip, self.tp_group, self.pp_group)
            self.engine.step(after_update=self.co2.after_local_step if self.co2 else None)
            self.held_bytes = self.engine.held_bytes()
            self.engine.zero_grad()
        else:
            counted_elsewhere = [self.pipeline.tied_weight] if self.pipeline and not self.pipeline.has_first else []
            grad_norm = clip_grad_norm(self.params, clip, self.tp_group, self.pp_group, counted_elsewhere)
            self.optimizer.step()
            if self.co2:
                self.co2.after_local_step()
            self.held_bytes = held_bytes(self.params, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.checkpoints.poll()  # a background save's failure surfaces here, on every rank
        return loss, grad_norm

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Gradients of the mean loss over this replica's micro-batches; returns that loss."""
        inputs = [i.to(self.rt.device) for i, _ in micro_batches]
        targets = [t.to(self.rt.device) for _, t in micro_batches]
        with self._saving_activations():
            if self.pipeline:
                loss_sum = self.pipeline.forward_backward(torch.cat(inputs), torch.cat(targets))
            else:
                model, loss_sum = self.parts[0], torch.zeros((), device=self.rt.device)
                for x, y in zip(inputs, targets):
                    loss = self.loss_fn(model(x), y) / len(micro_batches)
                    loss.backward()
                    loss_sum += loss.detach()
        if self.tiers and self.tiers.activations:
            self.tiers.activations.end_step()
        return loss_sum

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the fixed evaluation batches of all dp ranks."""
        for part in self.parts:
            part.eval()
        total = torch.zeros((), device=self.rt.device)
        n = self.cfg.train.eval_batches
        for inputs, targets in eval_batches(self.val_set, n, self.cfg.train.micro_batch_size,
                                            self.topo.dp_rank, self.topo.dp_size):
            inputs, targets = inputs.to(self.rt.device), targets.to(self.rt.device)
            with self.autocast():
                if self.pipeline:
                    total += self.pipeline.evaluate(inputs, targets)
                else:
                    total += self.loss_fn(self.parts[0](inputs), targets)
        for part in self.parts:
            part.train()
        if self.dp_group is not None:
            comm.all_reduce(total, self.dp_group, dim="dp")
        return total.item() / (n * self.topo.dp_size)

    # --- checkpoints ----------------------------------------------------------------------
    def save(self) -> None:
        """Saved in the global layout without gathering: every rank writes its own boxes of the global
        tensors (a box several ranks hold is split among them), in the background with
        `checkpoint.async`. Under CO2 a save closes the round first (`_close_co2_round`), and the
        outer momentum is saved per parameter beside its optimizer state."""
        if self.co2:
            self._close_co2_round()
            for p, m in zip(self.params, self.co2.momentum_views()):
                self.optimizer.state[p]["co2_momentum"] = m.clone()  # staged (copied) before save returns
        try:
            with self.offloaded_state_in_memory():
                self._write_checkpoint()
        finally:
            for p in self.params:
                self.optimizer.state[p].pop("co2_momentum", None)

    def _close_co2_round(self) -> None:
        """End CO2's round early (a save, the end of training): every node takes the anchor and
        the nodes' mean optimizer state, so one saved copy is every node's; under ZeRO, spread the
        changed chunks to the parameter partition."""
        self.co2.close_round(self.optimizer)
        if self.engine:
            self.engine.rebuild()

    def checkpoint_pieces(self) -> list[Piece]:
        """This rank's parameters and optimizer state as boxes of the global tensors (live views)."""
        return (model_pieces(self.parts, self.engine, self.canonical)
                + optimizer_pieces(self.optimizer, optimizer_entries(self.parts, self.engine, self.canonical)))

    def _state_to_save(self) -> tuple[list[Piece], dict, dict[str, str]]:
        """What a checkpoint or a snapshot holds: this rank's pieces and RNG, rank 0's trainer state
        and optimizer hyper-parameters, and the tied weights' other names."""
        pieces = self.checkpoint_pieces() + [rng_piece(self.rt.rank)]
        objects = {"trainer": {"step": self.step, "data": self.loader.state_dict()},
                   "optim.param_groups": self._param_groups()} if self.rt.rank == 0 else {}
        aliases = {f"model.{name}": f"model.{first}" for name, first in self.canonical.items() if name != first}
        return pieces, objects, aliases

    def _write_checkpoint(self) -> None:
        self.checkpoints.save(self.step, *self._state_to_save(), self._config_yaml, self._layout_summary())

    def snapshot(self) -> bool:
        """An in-memory snapshot of this step through the node's agent (collective); False if skipped."""
        return self.snapshots.save(self.step, *self._state_to_save(), self._layout_summary())

    def _param_groups(self) -> list[dict]:
        """The optimizer's hyper-parameters with each group's parameters named as in the plain model,
        as torch.distributed.checkpoint.state_dict names them (build_optimizer's grouping: matrices
        decay), so a plain torch AdamW can load the state with DCP alone."""
        names = list(dict.fromkeys(self.canonical.values()))
        matrix = [n for n in names if decays(self.global_shapes[n])]
        other = [n for n in names if not decays(self.global_shapes[n])]
        return [{**h, "params": group} for h, group in zip(hyperparameters(self.optimizer), (matrix, other))]

    def _layout_summary(self) -> dict:
        layout, zero = self.topo.layout, self.cfg.zero
        return {"world": self.rt.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                "virtual_stages": self.cfg.parallel.virtual_stages,
                "zero": {"params": zero.params.shard_over, "grads": zero.grads.shard_over,
                         "optim": zero.optim.shard_over} if zero.enabled else None}

    def resume(self, path: Path) -> Path:
        """Load a checkpoint saved from any layout into this one. Every check and every read (into
        fresh tensors) happens first, and all ranks agree on the verdict, before any state changes.
        Offloaded shards and moments are in memory meanwhile, and go back to their tiers after."""
        with self.offloaded_state_in_memory(changed=True):
            return self._resume(path)

    def _resume(self, path: Path) -> Path:
        return self._resume_from(Checkpoint(path))

    def restore_on_start(self, resume: Path | None) -> str:
        """With snapshots on, where this run starts from (collective): the newest in-memory snapshot
        every rank can restore; else `resume`, or the newest committed checkpoint under
        checkpoint.dir (a job whose every node was lost is simply launched again); else step 0.
        Returns the sentence saying which, and why ("" for a first start)."""
        found = self.snapshots.recover()
        if found.checkpoint is not None:
            self._resume_from(found.checkpoint)
            return f"snapshot: resumed from {found.message}"
        disk = resume or (self.cfg.checkpoint_dir() if store.committed(self.cfg.checkpoint_dir()) else None)
        lead = f"snapshot: no in-memory snapshot every rank can restore ({found.message})"
        if disk is None:
            return "" if not found.restarted else \
                f"{lead}; no committed checkpoint under {self.cfg.checkpoint_dir()} either: starting from step 0"
        return f"{lead}; resumed from disk checkpoint {self.resume(disk)}"

    def _resume_from(self, ckpt: Checkpoint) -> Path:
        misfit: list[str] = []
        try:
            problems = ckpt.problems or model_state_problems(self.global_shapes, ckpt.shapes("model."))
            misfit = [] if ckpt.problems else problems
            live = model_pieces(self.parts, self.engine, self.canonical)
            fresh = [Piece(p.key, p.global_shape, p.box, torch.empty_like(p.tensor)) for p in live]
            optim_state, optim_targets = self._fresh_optimizer_state(ckpt)
            rng = self._rng_target(ckpt)
            objects = {}
            if not problems:
                problems = ckpt.read(fresh + optim_targets + rng, self.cfg.checkpoint.verify_on_load)
                objects = {k: ckpt.object(k) for k in ("trainer", "optim.param_groups")}
                misfit = self.loader.state_problems(objects["trainer"]["data"]) + \
                    optimizer_problems(self.optimizer, objects["optim.param_groups"])
                problems += misfit
        except CheckpointError as e:
            problems = [str(e)]
        finally:
            ckpt.close()
        self.checkpoints.agree(problems, f"{ckpt.path} does not fit this run, nothing was loaded; resume with the "
                               "config it was saved with (see its config.yaml)" if misfit else
                               f"{ckpt.path} is damaged, nothing was loaded; resume from another checkpoint "
                               "(`strata ckpt verify DIR` checks one)")
        with torch.no_grad():
            for dst, src in zip(live, fresh):
                dst.tensor.copy_(src.tensor)
        load_optimizer(self.optimizer, optim_state, objects["optim.param_groups"])
        if self.engine:
            self.engine.invalidate_secondary()
        state = objects["trainer"]
        self.loader.load_state_dict(state["data"])
        for piece in rng:
            torch.set_rng_state(piece.tensor)
        self.step = int(state["step"])
        momentum = [self.optimizer.state[p].pop("co2_momentum", None) for p in self.params]
        if self.co2:
            self.co2.restart(self.step, None if any(m is None for m in momentum) else momentum)
        return ckpt.path

    def _rng_target(self, ckpt: Checkpoint) -> list[Piece]:
        """This rank's saved RNG state, or rank 0's when the saving world was smaller, or none (an
        imported checkpoint: the RNG stays as initialisation left it)."""
        keys = [k for k in (f"rng.cpu.rank{self.rt.rank}", "rng.cpu.rank0") if ckpt.has(k)]
        return [whole_piece(keys[0], torch.get_rng_state())] if keys else []

    def _fresh_optimizer_state(self, ckpt: Checkpoint) -> tuple[dict[int, dict], list[Piece]]:
        """New optimizer-state tensors for every kind the checkpoint holds (torch index → entry),
        and the pieces that read into them."""
        saved: dict[str, dict[str, tuple]] = {}
        for key, shape in ckpt.shapes("optim.state.").items():
            fqn, kind = key.rsplit(".", 1)
            saved.setdefault(fqn, {})[kind] = shape
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        state, targets = {}, []
        for param, fqn, placement, shape, start in optimizer_entries(self.parts, self.engine, self.canonical):
            if fqn in saved:
                entry = {kind: torch.empty((), dtype=torch.float32) if not s else torch.empty_like(param.data)
                         for kind, s in saved[fqn].items()}
                state[index[id(param)]] = entry
                targets += state_pieces(fqn, entry, placement, shape, start)
        return state, targets

    # --- the run --------------------------------------------------------------------------
    def fit(self, log: MetricsLogger) -> RunResult:
        cfg, result = self.cfg, RunResult()
        losses: dict[int, torch.Tensor] = {}
        interval_start, interval_steps = time.perf_counter(), 0
        link_bytes_before = Counter(comm.bytes_by_link)
        train_start, start_step = time.perf_counter(), self.step
        while self.step < cfg.train.steps:
            loss, grad_norm = self.train_step()
            losses[self.step] = loss
            interval_steps += 1
            record = {}
            if self.step % cfg.log.interval == 0 or self.step == cfg.train.steps:
                elapsed = time.perf_counter() - interval_start
                record = self._throughput(interval_steps, elapsed)
                moved = Counter(comm.bytes_by_link) - link_bytes_before
                record["wire_bytes_per_step"] = {link: n / interval_steps for link, n in sorted(moved.items())}
                link_bytes_before = Counter(comm.bytes_by_link)
                record.update(loss=loss.item(), grad_norm=grad_norm.item(), lr=self.optimizer.param_groups[0]["lr"])
                if self.tiers:
                    record["offload"] = self.tiers.metrics()
                if self.snapshots:
                    record["snapshot"] = self.snapshots.stats()
                interval_start, interval_steps = time.perf_counter(), 0
            log.step(self.step, record)
            if cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0 and self.step < cfg.train.steps:
                result.eval_losses[self.step] = self._eval_and_log(log)
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                self.save()
            if self.snapshots and self.step % cfg.snapshot.every_steps == 0 and self.step < cfg.train.steps:
                self.snapshot()
        if self.co2:  # the last round's exchange: every node ends on the same parameters
            self._close_co2_round()
        result.eval_losses[self.step] = self._eval_and_log(log)
        if cfg.checkpoint.save_final and not (cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0):
            self.save()
        self.checkpoints.close()  # the last save is committed before the run reports done
        if self.snapshots:
            self.snapshots.close()
        if self.tiers:
            self.tiers.close()
        elapsed = time.perf_counter() - train_start
        result.final_step = self.step
        result.losses = {step: loss.item() for step, loss in losses.items()}
        result.tokens_per_s = (self.step - start_step) * self.tokens_per_step / max(elapsed, 1e-9)
        return result

    def _eval_and_log(self, log: MetricsLogger) -> float:
        loss = self.evaluate()
        log.write({"step": self.step, "eval_loss": loss})
        return loss

    def _throughput(self, steps: int, seconds: float) -> dict:
        tokens_per_s = steps * self.tokens_per_step / max(seconds, 1e-9)
        tflops = tokens_per_s * self.flops_per_token / 1e12 / self.rt.world_size
        record = {"tokens_per_s": tokens_per_s, "tflops_per_rank": tflops, "step_time_s": seconds / steps}
        if self.cfg.log.peak_tflops:
            record["mfu"] = tflops / self.cfg.log.peak_tflops
        return record


def rewrite_checkpoint(cfg: Config, runtime: Runtime, source: Path, out: Path) -> None:
    """Load checkpoint `source` into this layout and save it under `out`, without training (the
    workers of `strata ckpt reshard`)."""
    trainer = Trainer(config_mod.replace(cfg, "checkpoint.dir", str(out)), runtime)
    trainer.resume(source)
    trainer.save()
    trainer.checkpoints.close()


def run(cfg: Config, runtime: Runtime, resume: Path | None = None) -> RunResult:
    """Train `cfg` in this process (one rank of the world `runtime` describes) and print a summary."""
    trainer = Trainer(cfg, runtime)
    main = runtime.rank == 0
    start = time.time()
    if trainer.snapshots:
        resumed_from, restore_note = None, trainer.restore_on_start(resume)
    else:
        resumed_from, restore_note = trainer.resume(resume) if resume else None, ""
    log = MetricsLogger(cfg.run_dir(), cfg.train.steps, trainer.step, enabled=main, progress=cfg.log.progress,
                        wandb_project=cfg.log.wandb_project if cfg.log.wandb else None,
                        config=config_mod.to_dict(cfg))
    n_params = count_params(cfg.model, trainer.vocab_size)
    layout = trainer.topo.layout
    log.print(f"strata: {n_params / 1e6:.2f}M parameters, world {runtime.world_size} "
              f"(tp {layout.tp}, pp {layout.pp}, dp {layout.dp}), "
              f"{cfg.train.global_batch_size}×{cfg.model.seq_len} tokens/step, run dir {cfg.run_dir()}"
              + (f", resumed from {resumed_from}" if resumed_from else ""))
    if restore_note:
        log.print(restore_note)
        log.write({"step": trainer.step, "resumed": restore_note, "restore_s": time.time() - start,
                   "wall_time": time.time()})
    if trainer.tiers:
        log.write({"step": trainer.step, **trainer.tiers.startup_record()})
        for note in trainer.tiers.notes:
            log.print(f"offload: {note}")
        if trainer.tiers.placement is not None:
            log.print(f"offload: {trainer.tiers.placement.reason}")
    try:
        result = trainer.fit(log)
    finally:
        log.close()
    if main:
        summary = {"final_step": result.final_step, "train_loss": result.losses.get(result.final_step),
                   "eval_loss": result.eval_losses.get(result.final_step), "tokens_per_s": result.tokens_per_s,
                   "comm_bytes": {f"{dim}/{op}": n for (dim, op), n in sorted(comm.bytes_moved.items())},
                   "wire_bytes": dict(sorted(comm.bytes_by_link.items())), "held_bytes": trainer.held_bytes,
                   "offload": trainer.tiers.metrics() if trainer.tiers else None}
        (cfg.run_dir() / "summary.json").write_text(json.dumps(summary, indent=1))
        train_loss = f"{summary['train_loss']:.4f}" if summary["train_loss"] is not None else "n/a"
        print(f"done: step {result.final_step}  train loss {train_loss}  eval loss {summary['eval_loss']:.4f}  "
              f"throughput {result.tokens_per_s:,.0f} tokens/s")
    return result
