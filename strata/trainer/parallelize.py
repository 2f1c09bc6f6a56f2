"""One function, `parallelize`, turns the plain model into this rank's trainable share of it, applying
every parallelism and memory feature in one fixed order:

    (LoRA adapters on the plain model →) tensor parallel → expert parallel → context parallel →
    pipeline split → materialise → float8 linears → freezing → ZeRO engine → memory tiers →
    activation policy → compilation → CO2

It returns a `ParallelModel`, the one object the training loop drives: `forward_backward` over the
step's micro-batches, `reduce_and_clip`, `step`. Plain data parallelism is the ZeRO engine with
nothing partitioned (`shard_over: none` everywhere): gradients are all-reduced from the engine's flat
groups, so every layout trains through the same step path.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from strata.checkpoint.pieces import canonical_names
from strata.config import Config, ModelConfig, OptimConfig, padded_vocab_size
from strata.data.tokens import Batch
from strata.errors import ConfigError, DataError
from strata.lora import apply_lora, freeze, is_adapter, trainable_names
from strata.model import (
    GPT,
    IGNORE_INDEX,
    Documents,
    documents_of,
    initial_value,
    lm_loss,
    moe_layers,
    set_rope_buffers,
)
from strata.parallel import comm
from strata.parallel.co2 import CO2
from strata.parallel.runtime import available_bytes
from strata.parallel.tensor import apply_tensor_parallel, placement_of
from strata.parallel.topology import ExpertTopology, Topology
from strata.parallel.zero import ZeroEngine, ZeroPlan
from strata.trainer.objective import Objective

if TYPE_CHECKING:
    from strata.offload.tiers import Tiers
    from strata.parallel.pipeline import Pipeline, Stage, StageShapes


def decays(shape: tuple[int, ...]) -> bool:
    """Whether a parameter of this shape gets weight decay, i.e. is in AdamW's group 0: matrices."""
    return len(shape) >= 2


def build_optimizer(
    params: list[nn.Parameter],
    optim: OptimConfig,
    device: torch.device,
    shape_of: Callable[[nn.Parameter], tuple[int, ...]] = lambda p: tuple(p.shape),
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (`shape_of`: for ZeRO's flat pieces, the shape of
    the parameter a piece belongs to); torch's fused kernel where available."""
    groups = [
        {"params": [p for p in params if decays(shape_of(p))], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if not decays(shape_of(p))], "weight_decay": 0.0},
    ]
    kernel = {"fused": True} if optim.impl in ("fused", "auto") else {"foreach": True}
    return torch.optim.AdamW(
        groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **kernel
    )


def materialize(
    parts: list[nn.Module],
    cfg: ModelConfig,
    seed: int,
    device: torch.device,
    positions: torch.Tensor | None = None,
) -> None:
    """Give meta-device modules real parameters on `device`, each filled with its slice (its
    `placement`) of the whole initial value. One Parameter per meta Parameter, registered
    everywhere the old one was, with its attributes: tying survives, also across the parts. The
    rotary tables are those of the token `positions` this rank holds (context parallelism), or all.

    With model.init_from the parameters are left unfilled: every run that has it loads all of
    them before its first step (`Trainer.init_weights`, or a resume, which overwrites them too;
    both check that every parameter is covered), so the random initialisation would be thrown away.
    It is the costly part: every rank draws each whole tensor, not just its slice. LoRA adapters,
    which a base model's weights do not hold, are filled either way."""
    names = {id(p): n for part in parts for n, p in part.named_parameters()}
    fresh: dict[int, nn.Parameter] = {}
    for part in parts:
        for module in part.modules():
            for key, p in module._parameters.items():
                if p is None or not p.is_meta:
                    continue
                if id(p) not in fresh:
                    # adapters start from their own values on a loaded base
                    random_init = not cfg.init_from or is_adapter(names[id(p)])
                    value = torch.empty(p.shape, device=device)
                    if random_init:
                        pl = placement_of(p)
                        value.copy_(
                            pl.local_slice(initial_value(cfg, names[id(p)], pl.global_shape, seed))
                        )
                    q = nn.Parameter(value, requires_grad=p.requires_grad)
                    q.__dict__.update(p.__dict__)  # placement
                    if not random_init:
                        # the ZeRO engine need not copy it into its flat buffer
                        q.__dict__["unfilled"] = True
                    fresh[id(p)] = q
                module._parameters[key] = fresh[id(p)]
            for key, b in module._buffers.items():  # the MoE routers' expert biases start at zero
                if b is not None and b.is_meta:
                    module._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device)
        set_rope_buffers(part, cfg, device, positions)


def refuse_unallocatable(parts: list[nn.Module], device: torch.device) -> None:
    """Refuse, before allocating anything, a model whose parameters on this rank alone (fp32, after
    tensor and pipeline parallelism) exceed the memory `device` has free: building it would fail in
    the allocator (or the kernel's OOM killer) with no word of what to change."""
    seen: set[int] = set()
    need = 0
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                need += p.numel() * 4
    free = available_bytes(device)
    if free is None or need <= free:
        return
    where = f"{device.type} memory" if device.type == "cuda" else "memory available on this machine"
    raise ConfigError(
        [
            f"the model's parameters on this rank need {need / 2**30:,.1f} GiB (fp32) before "
            f"gradients, optimizer state and activations, but the {where} is {free / 2**30:,.1f} "
            "GiB: make the model smaller (model.d_model, model.n_layers), split it over more ranks "
            "(parallel.tp, parallel.pp), or see `strata plan CONFIG --search` for layouts that fit"
        ]
    )


class StepLoss:
    """The loss the step calls on each micro-batch's logits and targets (the pipeline schedule on
    its last stage, or the plain loop): `loss` (`lm_loss`, or the vocab-parallel one under tp) as
    its mean, or with `weight` set its sum over the trained targets (the others IGNORE_INDEX)
    times `weight`.

    A step over masked targets sets `weight` to dp·M'/N (N the trained targets of the whole global
    batch, counted before any backward; M' the micro-batches where a pipeline leaves their 1/M to
    the ZeRO engine, else 1): the engine's fixed 1/(dp·M') then makes the accumulated gradient
    that of (sum over every trained target)/N, and the loss the loop averages over the dp ranks
    that sum over N, whatever the split of the targets over micro-batches, ranks or sequence
    shards. (Under CO2 the engine averages over a node's dp ranks: each node's gradient is its own
    targets' sum over N/nodes, whose mean over the nodes is the global one.) The MoE auxiliary
    losses keep their per-micro-batch weights."""

    def __init__(self, loss: Callable[..., torch.Tensor]):
        self.loss = loss
        self.weight: float | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.loss(logits, targets)
        return self.loss(logits, targets, reduction="sum") * self.weight


@dataclass
class ParallelModel:
    """This rank's share of the model after `parallelize`, and the one step path that trains it."""

    # this rank's model parts: the whole (tp-sharded) model, or its pipeline stages
    parts: list[nn.Module]
    pipeline: Pipeline | None
    engine: ZeroEngine  # flat parameter groups, gradient reduction and the optimizer step
    tiers: Tiers | None  # offloaded ZeRO state and activations
    co2: CO2 | None  # asynchronous outer updates across nodes
    loss_fn: StepLoss
    topo: Topology
    device: torch.device
    precision: str
    sync_size: int  # data-parallel ranks a gradient is averaged over (a node's under CO2)
    vocab_size: int  # the padded vocabulary
    global_shapes: dict[str, tuple[int, ...]]  # every state-dict entry of the unsharded model
    canonical: dict[str, str]  # every parameter name of the plain model -> its first name (tying)
    # (end-of-document token, attend inside documents, restart positions per document), or None
    documents: tuple[int, bool, bool] | None = None
    # the parameters that do not train (model.lora, train.freeze), by canonical name
    frozen: frozenset[str] = frozenset()
    objective: Objective | None = None  # train.objective other than lm, which runs the step

    def local(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (micro-batch, seq_len) batch, on the device."""
        batch = batch.to(self.device)
        if self.topo.layout.cp == 1:
            return batch
        from strata.parallel.context import shard

        return shard(batch, self.topo.layout.cp, self.topo.cp_rank, dim=1)

    def documents_of(self, tokens: torch.Tensor) -> Documents | None:
        """The packed documents of a batch's tokens (batch, seq_len) when `documents` is set: their
        boundaries over the whole sequence, the positions of this rank's tokens."""
        if self.documents is None:
            return None
        eot, mask, reset = self.documents
        docs = documents_of(tokens.to(self.device), eot, mask, reset)
        return Documents(docs.ids, None if docs.positions is None else self.local(docs.positions))

    def run(self, part: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """`part` (the whole model) on a micro-batch's tokens (micro-batch, seq_len): this rank's share,
        with the packed documents' boundaries and positions when `documents` is set."""
        docs = self.documents_of(tokens)
        return part(self.local(tokens)) if docs is None else part(self.local(tokens), docs)

    @property
    def params(self) -> list[nn.Parameter]:
        """What the optimizer steps: the engine's per-parameter segments of this rank's chunks."""
        return self.engine.params

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model state that is not parameters (the MoE routers' expert biases), by state-dict name."""
        out: dict[str, torch.Tensor] = {}
        for part in self.parts:
            saved = part.state_dict(keep_vars=True)
            out.update({n: b for n, b in part.named_buffers() if n in saved})
        return out

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.precision in ("bf16", "fp8"):  # fp8: bf16 around the float8 matmuls
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # --- the step --------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Gradients of this replica's micro-batches (the step's train.global_batch_size /
        (micro_batch_size·dp), which the MoE layers' auxiliary losses are weighted for) into the
        engine's flat buffers; returns their loss, which averaged over the dp ranks is the step's:
        the mean of the micro-batches' mean losses, or with loss masks the sum over the global
        batch's trained targets divided by their count (`StepLoss`). A 0-d tensor on the device."""
        if self.objective is not None:
            return self.objective.forward_backward(micro_batches)
        inputs = [b.inputs for b in micro_batches]  # cut to this rank's tokens where they are run
        targets = [self.local(self._trained(b)) for b in micro_batches]
        self.loss_fn.weight = self._loss_weight(micro_batches)
        offloader = self.tiers.activations if self.tiers else None
        self.engine.expect_backwards(
            self.pipeline.microbatches if self.pipeline else len(micro_batches)
        )
        with self.autocast(), offloader.saving() if offloader else contextlib.nullcontext():
            if self.pipeline:
                loss_sum = self.pipeline.forward_backward(
                    torch.cat([self.local(i) for i in inputs]),
                    torch.cat(targets),
                    self.documents_of(torch.cat(inputs)),
                )
            else:
                model, loss_sum = self.parts[0], torch.zeros((), device=self.device)
                for x, y in zip(inputs, targets):
                    loss = self.loss_fn(self.run(model, x), y)
                    if self.loss_fn.weight is None:
                        loss = loss / len(micro_batches)
                    loss.backward()
                    loss_sum += loss.detach()
        if offloader:
            offloader.end_step()
        return loss_sum

    @staticmethod
    def _trained(batch: Batch) -> torch.Tensor:
        """The batch's targets, IGNORE_INDEX where its mask leaves one untrained: the one tensor
        the pipeline schedule cuts into micro-batches and context parallelism into shards."""
        if batch.mask is None:
            return batch.targets
        return batch.targets.masked_fill(~batch.mask, IGNORE_INDEX)

    def _loss_weight(self, micro_batches: list[Batch]) -> float | None:
        """`StepLoss.weight` for the step (None without loss masks): the trained targets this rank
        holds (its cp shard's) summed over the dp group, which holds the replicas' cp ranks."""
        if micro_batches[0].mask is None:
            return None
        held = torch.zeros((), dtype=torch.int64, device=self.device)
        for batch in micro_batches:
            assert batch.mask is not None  # one dataset's batches all carry one, or none
            held += self.local(batch.mask).sum()
        count = int(comm.all_reduce(held, self.topo.group("dp"), dim="dp").item())
        if count == 0:
            raise DataError(
                "a global batch has no trained target (its loss mask is 0 everywhere), so its loss "
                "divides by zero; `strata data prepare` drops conversations without a trained "
                "token, so this data's SPLIT.mask.bin was written otherwise: prepare it again"
            )
        return self.topo.dp_size * (self.pipeline.microbatches if self.pipeline else 1) / count

    def reduce_and_clip(self, max_norm: float) -> torch.Tensor:
        """Average the gradients over the data-parallel ranks (the pipeline leaves the 1/M of its
        micro-batch mean to the engine too) and clip them to `max_norm` (inf: measure only).
        Returns the gradient norm before clipping."""
        self.engine.finish_grads(
            1 / (self.sync_size * (self.pipeline.microbatches if self.pipeline else 1))
        )
        return self.engine.clip_grad_norm(max_norm, self.topo.group("tp"), self.topo.group("pp"))

    def step(self) -> None:
        """The optimizer step (CO2's outer update after it, when on), then clear the gradients."""
        self.engine.step(after_update=self.co2.after_local_step if self.co2 else None)
        self.engine.zero_grad()

    def skip_step(self) -> None:
        """In place of `step` when the gradients are not finite: drop them, update nothing. CO2
        still counts it as an inner step, so every node reaches a round's exchange at the same step."""
        self.engine.zero_grad()
        if self.co2:
            self.co2.after_local_step()
            self.engine.rebuild()  # a round that ended moved the chunks

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch forward only, on every pipeline rank: (its loss times its weight, the
        weight), float64 0-d tensors on the device; summed over micro-batches and ranks, the first
        over the second is the mean. The weight is the rows without a loss mask (the mean loss of
        this rank's tokens times the rows), else the trained targets this rank holds (the loss is
        summed over them)."""
        if self.objective is not None:
            return self.objective.eval_loss(batch)
        targets = self.local(self._trained(batch))
        masked = batch.mask is not None
        self.loss_fn.weight = 1.0 if masked else None
        with self.autocast():
            if self.pipeline:
                loss = self.pipeline.evaluate(
                    self.local(batch.inputs), targets, self.documents_of(batch.inputs)
                )
            else:
                loss = self.loss_fn(self.run(self.parts[0], batch.inputs), targets)
        if masked:
            return loss.double(), (targets != IGNORE_INDEX).sum().double()
        rows = torch.tensor(float(len(batch)), dtype=torch.float64, device=self.device)
        return loss.double() * len(batch), rows

    def train(self, mode: bool = True) -> None:
        """Put every model part of this rank in training (or, with `mode` False, eval) mode."""
        for part in self.parts:
            part.train(mode)

    # --- around saves and loads ------------------------------------------------------------
    def state_in_memory(self, changed: bool = False) -> contextlib.AbstractContextManager[None]:
        """Offloaded shards and moments in memory inside the block (`changed`: written back after);
        a no-op without offload."""
        return self.tiers.resident(changed) if self.tiers else contextlib.nullcontext()

    def close_co2_round(self) -> None:
        """End CO2's round early (a save, the end of training): every node takes the anchor and
        the nodes' mean optimizer state, so one saved copy is every node's; spread the changed
        chunks to the parameter partition."""
        if self.co2:
            self.co2.close_round(self.optimizer)
            self.engine.rebuild()

    def close(self) -> None:
        """Let the memory tiers and the ZeRO engine go (their files, threads and buffers)."""
        if self.tiers:
            self.tiers.close()
        self.engine.close()

    # --- what a run reports ----------------------------------------------------------------
    def parameter_counts(self) -> tuple[int, int]:
        """(parameters of the whole model, adapters included; those of them that train)."""
        shapes = self.global_shapes
        names = set(self.canonical.values())
        total = sum(math.prod(shapes[n]) for n in names)
        return total, total - sum(math.prod(shapes[n]) for n in names & self.frozen)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameter, gradient and optimizer-state storage this rank holds now."""
        return self.engine.held_bytes()

    def offload_metrics(self) -> dict | None:
        """The memory tiers' counters for metrics.jsonl (bytes moved, stalls, pool peaks), or None
        without tiers."""
        return self.tiers.metrics() if self.tiers else None

    def startup_record(self) -> dict | None:
        """What the memory tiers decided at start-up, logged once (None without tiers)."""
        return self.tiers.startup_record() if self.tiers else None

    def startup_notes(self) -> list[str]:
        """The console's lines about the memory tiers' set-up and update placement ("offload: ...")."""
        if not self.tiers:
            return []
        notes = [f"offload: {note}" for note in self.tiers.notes]
        if self.tiers.placement is not None:
            notes.append(f"offload: {self.tiers.placement.reason}")
        return notes


def parallelize(
    cfg: Config, topo: Topology, device: torch.device, data_vocab_size: int
) -> ParallelModel:
    """The plain model, built on the meta device (no memory), transformed for this rank of `topo`
    in the order of the module docstring. Each rank allocates and initialises only its own slices,
    with the values one process would give them (`initial_value` depends on the parameter's name,
    not on the layout)."""
    # What draws from torch's own generator in training (LoRA's dropout) draws what train.seed and
    # the rank say, so equal seeds give equal runs; a resume puts the saved state back.
    digest = hashlib.sha256(f"{cfg.train.seed}/rank{topo.rank}".encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    with torch.device("meta"):
        model = GPT(cfg.model, padded_vocab_size(cfg.model, data_vocab_size))
        apply_lora(model, cfg.model.lora)
    global_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    canonical = canonical_names(model)
    trainable = trainable_names(model, cfg) if cfg.model.lora.enabled or cfg.train.freeze else None
    if trainable is not None and cfg.parallel.pp > 1:
        _refuse_frozen_first_stage(cfg, trainable)

    loss_fn = StepLoss(_tensor_parallel(cfg, topo, model))
    domains = _expert_parallel(cfg, topo, model)
    positions = _context_parallel(cfg, topo, model)
    stages = _pipeline_stages(cfg, topo, model)
    parts: list[nn.Module] = list(stages) if stages else [model]
    _materialize_parts(cfg, parts, device, positions)
    if trainable is not None:  # before the engine, which flattens only what trains
        freeze(parts, trainable)
    pipeline = _pipeline(cfg, topo, stages, loss_fn, device, model.vocab_size) if stages else None

    # Under CO2 gradients are averaged inside the node only; CO2 joins the nodes every H steps.
    sync_level = "node" if cfg.co2.enabled else "global"
    engine = _zero_engine(cfg, topo, parts, pipeline, device, sync_level, domains)
    tiers = _memory_tiers(cfg, engine, topo.rank, device)
    _activation_policy(cfg, parts, tiers)
    if cfg.train.compile:
        from strata.trainer.compile import apply_compile

        apply_compile(parts)
    co2 = _outer_updates(cfg, topo, engine) if cfg.co2.enabled else None
    return ParallelModel(
        parts,
        pipeline,
        engine,
        tiers,
        co2,
        loss_fn,
        topo,
        device,
        cfg.train.precision,
        len(topo.digit_group("none", sync_level)[1]),
        model.vocab_size,
        global_shapes,
        canonical,
        frozen=frozenset(f for n, f in canonical.items() if trainable and n not in trainable),
    )


def _refuse_frozen_first_stage(cfg: Config, trainable: set[str]) -> None:
    """A first pipeline stage with nothing to train sends activations that need no gradient, and
    torch's pipelining cannot run its backward: refuse it by name (every rank alike)."""
    par = cfg.parallel
    per_stage = cfg.model.n_layers // (par.pp * par.virtual_stages)
    first = [f"layers.{i}." for i in range(per_stage)]
    if not any(n.startswith(("tok_embeddings.", *first)) for n in trainable):
        raise ConfigError(
            [
                f"train.freeze: {list(cfg.train.freeze)} freezes all of the first pipeline stage "
                f"(the embedding and layers 0-{per_stage - 1}), which pipeline parallelism cannot "
                "run backward through; train a parameter there, or set parallel.pp=1"
            ]
        )


def _tensor_parallel(cfg: Config, topo: Topology, model: GPT) -> Callable:
    """parallel.tp: Megatron's column and row parallel layers in place of the model's; returns the
    loss over the logits each rank holds (the vocab-parallel loss under tp)."""
    par = cfg.parallel
    if par.tp == 1:
        return lm_loss
    return apply_tensor_parallel(
        model,
        topo.group("tp"),
        topo.coords["tp"],
        par.tp,
        sequence_parallel=par.sequence_parallel,
    )


def _pipeline_stages(cfg: Config, topo: Topology, model: GPT) -> list[Stage]:
    """parallel.pp: the stages of the model this pipeline rank holds (none without pp)."""
    par = cfg.parallel
    if par.pp == 1:
        return []
    # torch's pipelining (and the torch._dynamo it pulls in, ~1 s) loads only for runs that use it
    from strata.parallel.pipeline import split_stages

    return split_stages(model, topo.coords["pp"], par.pp, par.virtual_stages, par.schedule)


def _materialize_parts(
    cfg: Config, parts: list[nn.Module], device: torch.device, positions: torch.Tensor | None
) -> None:
    """This rank's parameters allocated and filled (after the checks that refuse a run before any
    memory is allocated), then float8 linear layers (`train.precision: fp8`)."""
    if cfg.train.precision == "fp8":
        from strata.trainer.float8 import check_float8

        check_float8(cfg.train, device)  # before any memory is allocated
    refuse_unallocatable(parts, device)
    materialize(parts, cfg.model, cfg.train.seed, device, positions)
    if cfg.train.precision == "fp8":
        from strata.trainer.float8 import apply_float8

        apply_float8(parts, cfg.train, compile_matmul=cfg.train.compile)


def _pipeline(
    cfg: Config,
    topo: Topology,
    stages: list[Stage],
    loss_fn: StepLoss,
    device: torch.device,
    vocab_size: int,
) -> Pipeline:
    """The schedule that runs this rank's stages (the tied embedding's copies kept equal over the
    first and last stages' group)."""
    from strata.parallel.pipeline import Pipeline

    par = cfg.parallel
    tied_group = topo.group("pp_ends") if cfg.model.tie_embeddings else None
    return Pipeline(
        stages,
        loss_fn,
        topo.group("pp"),
        par.pp,
        par.virtual_stages,
        par.schedule,
        cfg.grad_accum_steps(topo.layout.world_size),
        device,
        tied_group,
        stage_shapes(cfg, vocab_size),
    )


def stage_shapes(cfg: Config, vocab_size: int) -> StageShapes:
    """What crosses a stage boundary, declared up front: otherwise torch's pipelining infers it by
    running a real forward and backward, which the engine's hooks would take for a step."""
    from strata.parallel.pipeline import StageShapes

    par, mbs = cfg.parallel, cfg.train.micro_batch_size
    seq = cfg.model.seq_len // par.cp  # a context-parallel rank's tokens
    local_seq = seq // par.tp if par.sequence_parallel and par.tp > 1 else seq
    return StageShapes(
        tokens=(mbs, seq),
        hidden=(mbs, local_seq, cfg.model.d_model),
        logits=(mbs, seq, vocab_size // par.tp),
        logits_dtype=torch.bfloat16 if cfg.train.bf16_compute else torch.float32,
    )


def _zero_engine(
    cfg: Config,
    topo: Topology,
    parts: list[nn.Module],
    pipeline: Pipeline | None,
    device: torch.device,
    sync_level: str,
    domains: dict[str, ExpertTopology] | None = None,
) -> ZeroEngine:
    """The engine over this rank's parts (after tp and pp). Without `zero:` nothing is partitioned
    and consecutive blocks share a flat group up to parallel.bucket_mb (data parallel's buckets)."""
    plan = (
        ZeroPlan.from_config(cfg.zero)
        if cfg.zero.enabled
        else ZeroPlan(bucket_bytes=int(cfg.parallel.bucket_mb * 2**20))
    )
    tied_weight = pipeline.tied_weight if pipeline else None
    tied = [tied_weight] if isinstance(tied_weight, nn.Parameter) else []
    return ZeroEngine(
        parts,
        topo,
        plan,
        lambda params, shape_of: build_optimizer(params, cfg.optim, device, shape_of),
        tied,
        topo.group("pp_ends") if tied else None,
        count_tied=not pipeline or pipeline.has_first,
        sync_level=sync_level,
        overlap=cfg.parallel.overlap_grad_reduce,
        domains=domains,
    )


def _expert_parallel(cfg: Config, topo: Topology, model: GPT) -> dict[str, ExpertTopology]:
    """The MoE layers: their auxiliary losses weighted once for the run, and parallel.ep: the
    experts' own layout (`expert_layout`: expert-parallel × expert-data-parallel groups over each
    stage's tp·dp ranks), this rank's slice of every MoE layer's experts and the all-to-all
    dispatch; under tensor parallelism also the routers' layout (every tp·dp rank of the stage).
    Returns the parameter domains the ZeRO engine reduces over their own ranks (none where
    everything is laid out as the dense model: ep = tp = 1)."""
    par = cfg.parallel
    # An auxiliary loss weighs as much as its micro-batch's loss: 1/M of it, where M is the step's
    # micro-batches (fixed for the run); a pipeline leaves the 1/M to the engine. It acts in
    # backward only, so evaluation's forward passes (any number of micro-batches) are unaffected.
    scale = 1.0 if par.pp > 1 else 1 / cfg.grad_accum_steps(topo.layout.world_size)
    for _, layer in moe_layers(model):
        layer.aux_grad_scale = scale
    if not cfg.model.moe.enabled or (par.ep == 1 and par.tp == 1):
        return {}
    from strata.parallel.experts import EXPERTS, ROUTING, apply_expert_parallel
    from strata.parallel.topology import build_topology, expert_layout

    domains = {EXPERTS: build_topology(expert_layout(topo.layout, par.ep), topo.rank, reuse=topo)}
    if par.tp > 1:
        # every tp·dp rank of the stage: the experts' layout when ep = 1
        routing = expert_layout(topo.layout, 1)
        domains[ROUTING] = (
            domains[EXPERTS]
            if par.ep == 1
            else build_topology(routing, topo.rank, reuse=domains[EXPERTS])
        )
    experts = domains[EXPERTS]
    apply_expert_parallel(model, experts, par.ep, par.tp, par.ep_dispatch)
    return domains


def _context_parallel(cfg: Config, topo: Topology, model: GPT) -> torch.Tensor | None:
    """parallel.cp: attention across the context-parallel group (ring or all-to-all) and MoE routing
    counted over whole sequences; returns the token positions this rank holds (None without cp)."""
    par = cfg.parallel
    if par.cp == 1:
        return None
    from strata.parallel.context import apply_context_parallel, positions

    apply_context_parallel(model, topo.group("cp"), par.cp_mode)
    # the whole rotary tables: each token's position comes with its batch
    if cfg.data.reset_positions:
        return None
    return positions(cfg.model.seq_len, par.cp, topo.cp_rank)


def _memory_tiers(cfg: Config, engine: ZeroEngine, rank: int, device: torch.device) -> Tiers | None:
    """ZeRO state in host memory or NVMe and activation offload (offload.*, activations.offload)."""
    if not (cfg.offload.enabled or cfg.activations.offload != "none"):
        return None
    from strata.offload.tiers import Tiers  # offload's modules load only when a run uses them

    return Tiers(cfg, engine, rank, device)


def _activation_policy(cfg: Config, parts: list[nn.Module], tiers: Tiers | None) -> None:
    """activations.*: blocks that recompute their forward (or all but its matmuls) in backward, and
    saved tensors offloaded by hooks keyed by block (of fully recomputed blocks only their inputs;
    of selectively recomputed ones their inputs, while the kept matmul outputs stay on the device)."""
    if cfg.activations.recompute != "none":
        from strata.offload.activations import apply_recompute

        apply_recompute(parts, cfg.activations.recompute)
    if tiers and tiers.activations:
        tiers.activations.attach(parts)


def _outer_updates(cfg: Config, topo: Topology, engine: ZeroEngine) -> CO2:
    """CO2 across nodes over what this rank's optimizer steps (its chunk of the flat groups),
    exchanged with the ranks holding the same in the other nodes on a group of its own."""
    co2, layout = cfg.co2, topo.layout
    if layout.nodes < 2:
        raise ConfigError(
            [
                f"co2.enabled needs at least 2 nodes, but the {layout.world_size} ranks are one "
                f"node of {layout.node_size}; run on more nodes, set parallel.ranks_per_node to "
                "simulate them, or set co2.enabled=false"
            ]
        )
    norm_group = topo.digit_group("none", cfg.zero.optim.shard_over)[0]
    params: list[torch.Tensor] = list(engine.params)
    return CO2(
        params,
        topo.dedicated_digit_group("node", "global"),
        co2.outer_every,
        co2.outer_lr,
        co2.outer_momentum,
        co2.staleness_penalty,
        co2.clip,
        co2.overlap,
        norm_group,
    )
