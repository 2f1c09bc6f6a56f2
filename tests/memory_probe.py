"""Measuring what a real training rank holds, by kind of state and by memory tier, for checking the
planner's memory model (`strata.plan.memory`) against it.

Inside every rank of a real gloo world, `measure` builds the trainer's parallel model for a config
(`strata.trainer.parallelize.parallelize`: tensor, pipeline and data parallelism, the ZeRO engine,
memory tiers, activation policy), trains two optimizer steps on random tokens the way
`Trainer.train_step` does, and reports the bytes it finds in the real tensors — never computed from
the plan:

- params, grads, optim: `ZeroEngine.held_bytes()` right after each optimizer step (before the
  gradients are cleared), the optimizer's moments read from the offload tier's own buffers when it
  has them (device tensors, the host pool's resident region, or the swap file's regions on NVMe),
  parameter shards swapped to NVMe by the swap file's size;
- activations: the peak over the step of the distinct storages saved for backward whose handles
  autograd still holds (`saved_tensors_hooks`; a handle's life ends when autograd frees it, seen by
  `weakref.finalize` on the packed object), without the model's parameters and buffers or the
  engine's flat buffers; with recomputation the tensors the recomputed block saves again during
  backward count too (hooked in `torch.utils.checkpoint`); with activation offload, the peaks of
  what stays in memory, of the host copies in use, and of the swap-file bytes in use, from the
  offloader's entries; the autocast weight copies (bf16) saved for backward are reported
  separately as well (`activations.weight_copies`, a part of `activations`);
- gathered: the peak of ZeRO-3 flat buffers gathered whole at once (their storage allocated);
- buckets: the peak of the transient whole-gradient buffers of partitioned gradients (ZeRO-2/3),
  alive from the first gradient of a micro-batch until their reduce-scatter has let them go
  (by the storage's own lifetime, so a reduction in flight on another thread keeps counting);
- pool: the offload host pool's staging slabs (its resident region holds the optimizer's host
  moments, reported as optim/host).

Every rank's result is one dict {"layout", "rank", "pp_stage", "tp_rank", "dp_rank", "measured":
{"kind/tier": bytes}, "info": {...}}. `LAYOUTS` are the layouts the memory tests and
`bench/plan_memory.py` run, all in one 4-rank world (`run_probe`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from strata import config
from strata.config import Config
from strata.data.tokens import Batch
from strata.parallel.flat_group import FlatGroup
from strata.parallel.topology import Layout, Topology, build_topology, layout_from_config
from strata.parallel.zero import ZeroEngine
from strata.trainer.parallelize import ParallelModel, parallelize

from worlds import join_world, run_world

WORLD = 4  # ranks of the probe's world
STEPS = 2  # optimizer steps per layout; every peak is the largest over them
VOCAB = 256

# The model and batch every layout starts from: small, but with activations well above the
# parameters (4 layers of d=128 over 2 x 128 tokens: ~2.6 MB saved per block and micro-batch).
BASE: dict[str, Any] = {
    "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128, "vocab_size": VOCAB},
    "train": {"micro_batch_size": 2, "global_batch_size": 8, "steps": STEPS, "precision": "fp32"},
    "optim": {"warmup_steps": 1},
    "parallel": {"ranks_per_node": WORLD},
    "log": {"progress": False},
}
G = {"shard_over": "global"}
# A capacity of 1.0 bounds the rows an expert's rank receives (dropless routing has no bound: the
# planner assumes balance, which a randomly initialised router only approaches)
MOE = {
    "num_experts": 8,
    "top_k": 2,
    "expert_ffn": 256,
    "aux_loss_coef": 0.01,
    "capacity_factor": 1.0,
}
LORA = {"rank": 8, "alpha": 16, "target_modules": ["all-linear"]}
NVME = "{nvme}"  # replaced by a scratch directory of the rank's run

# name -> overrides of BASE (nested like the YAML file)
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp": {},
    "zero1": {"zero": {"optim": G}},
    "zero2": {"zero": {"grads": G, "optim": G}},
    "zero3": {"zero": {"params": G, "grads": G, "optim": G, "prefetch_blocks": 1}},
    "zero3-prefetch2": {"zero": {"params": G, "grads": G, "optim": G, "prefetch_blocks": 2}},
    "3-level": {
        "parallel": {"ranks_per_node": 4, "ranks_per_gpu": 2},
        "zero": {"params": {"shard_over": "gpu"}, "grads": {"shard_over": "node"}, "optim": G},
    },
    "per-node": {
        "parallel": {"ranks_per_node": 2},
        "zero": {"params": {"shard_over": "node"}, "grads": {"shard_over": "node"}, "optim": G},
    },
    "hpz": {
        "parallel": {"ranks_per_node": 2},
        "zero": {"params": G, "grads": G, "optim": G, "secondary_params": {"shard_over": "node"}},
    },
    "tp2-sp": {"parallel": {"tp": 2, "sequence_parallel": True}},
    "pp2-1f1b": {"parallel": {"pp": 2, "schedule": "1f1b"}},
    "pp2-gpipe": {"parallel": {"pp": 2, "schedule": "gpipe"}},
    "pp2-interleaved": {"parallel": {"pp": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"}},
    "recompute": {"activations": {"recompute": "full"}},
    "act-offload-cpu": {
        "activations": {"offload": "cpu", "min_bytes": 65536},
        "offload": {"host_buffer_mb": 2, "slab_mb": 0.25},
    },
    "act-offload-nvme": {
        "activations": {"offload": "nvme", "min_bytes": 65536, "max_inflight_mb": 1},
        "offload": {"nvme_path": NVME, "host_buffer_mb": 2, "slab_mb": 0.25},
    },
    "optim-offload-cpu": {
        "zero": {"optim": G},
        "offload": {"optim": {"device": "cpu"}, "host_buffer_mb": 2, "slab_mb": 0.25},
    },
    "optim-offload-nvme": {
        "zero": {"optim": G},
        "offload": {
            "optim": {"device": "nvme"},
            "nvme_path": NVME,
            "host_buffer_mb": 2,
            "slab_mb": 0.25,
        },
    },
    "bf16": {"train": {"precision": "bf16"}},
    # MoE: 8 experts of 256, top 2, every block; experts split over ep ranks of the 4
    "moe-ep2-zero1": {"model": {"moe": MOE}, "parallel": {"ep": 2}, "zero": {"optim": G}},
    "moe-ep4-zero3": {
        "model": {"moe": MOE},
        "parallel": {"ep": 4},
        "zero": {"params": G, "grads": G, "optim": G, "prefetch_blocks": 1},
    },
    # the fullest rank's share of the routed rows approaches the capacity bound over more micro-batches
    "moe-tp2-sp-ep4": {
        "model": {"moe": MOE},
        "parallel": {"tp": 2, "sequence_parallel": True, "ep": 4},
        "train": {"global_batch_size": 16},
    },
    "moe-ep2-pp2": {"model": {"moe": MOE | {"shared_experts": 1}}, "parallel": {"ep": 2, "pp": 2}},
    # context parallelism: each sequence over cp ranks of the 4
    "cp2-ring": {"parallel": {"cp": 2, "cp_mode": "ring"}},
    "cp4-ring": {"parallel": {"cp": 4, "cp_mode": "ring"}},
    "cp2-alltoall": {"parallel": {"cp": 2, "cp_mode": "alltoall"}},
    "cp2-tp2-sp": {"parallel": {"cp": 2, "tp": 2, "sequence_parallel": True}},
    "cp2-zero3": {
        "parallel": {"cp": 2},
        "zero": {"params": G, "grads": G, "optim": G, "prefetch_blocks": 1},
    },
    # LoRA: the frozen base whole on every rank, the adapters alone in the flat groups
    "lora-zero3": {
        "model": {"lora": LORA},
        "zero": {"params": G, "grads": G, "optim": G, "prefetch_blocks": 1},
    },
    "lora-tp2-sp": {"model": {"lora": LORA}, "parallel": {"tp": 2, "sequence_parallel": True}},
}

KINDS = ("params", "grads", "optim", "gathered", "buckets", "activations", "pool", "staging")


def _substitute(raw: Any, nvme: str) -> Any:
    if isinstance(raw, dict):
        return {k: _substitute(v, nvme) for k, v in raw.items()}
    return nvme if raw == NVME else raw


def layout_config(
    name: str, nvme_dir: str | Path = "/tmp/memprobe-nvme", world: int = WORLD
) -> Config:
    """The validated config of layout `name` for a world of `world` ranks."""
    return config.from_dict(
        _substitute(config.merge_groups(BASE, LAYOUTS[name]), str(nvme_dir)), world_size=world
    )


# --- bookkeeping of live bytes ---------------------------------------------------------------------


class LiveBytes:
    """Bytes of distinct storages held by counted references, and the peak. A storage is known by
    its Python object (torch keeps one per live storage), confirmed through a weak reference: its
    address may be reused once it is freed while references to its entry live on (an offloaded
    original freed after its copy is written), and then a new storage there is a new entry."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs: dict[int, list[int]] = {}  # token -> [references, nbytes]
        self.tokens: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (the storage, token)
        self.next_token = 0
        self.now = 0
        self.peak = 0

    def add(self, storage: torch.UntypedStorage) -> int:
        """Count one more reference to `storage`; returns the token to `drop` it by."""
        with self.lock:
            known = self.tokens.get(id(storage))
            if known is not None and known[0]() is storage and known[1] in self.refs:
                token = known[1]
                self.refs[token][0] += 1
                return token
            token, self.next_token = self.next_token, self.next_token + 1
            self.tokens[id(storage)] = (weakref.ref(storage), token)
            self.refs[token] = [1, storage.nbytes()]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            return token

    def drop(self, token: int) -> None:
        with self.lock:
            entry = self.refs[token]
            entry[0] -= 1
            if entry[0] == 0:
                del self.refs[token]
                self.now -= entry[1]


class _Holder:
    """What autograd keeps for one saved tensor while this probe watches: the saved tensor (or
    the offloader's packed object), and the storage it counts under."""

    __slots__ = ("inner", "__weakref__")

    def __init__(self, inner: Any):
        self.inner = inner


_VIEW_NODES = (
    "TBackward0",
    "ViewBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
)


def _is_weight_copy(t: torch.Tensor) -> bool:
    """Whether `t` is (a view of) autocast's low-precision copy of a parameter."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_NODES:
        fn = fn.next_functions[0][0] if fn.next_functions else None
    if fn is None or not type(fn).__name__.startswith("ToCopyBackward"):
        return False
    nxt = fn.next_functions[0][0] if fn.next_functions else None
    return isinstance(getattr(nxt, "variable", None), torch.nn.Parameter)


class SavedTensors:
    """Saved-for-backward bookkeeping (see the module docstring). `state_ptrs()` gives the data_ptrs
    of storages that are training state, not activations (parameters, buffers, flat groups).
    `offloader`: the run's ActivationOffloader, whose hooks are the innermost ones (they replace
    any outer pair), so this probe wraps them instead of installing its own."""

    def __init__(self, state_ptrs: Callable[[], set[int]], offloader: Any = None):
        self.state_ptrs = state_ptrs
        self.saved = LiveBytes()  # every saved storage autograd holds a handle of
        self.copies = LiveBytes()  # of which autocast weight copies
        self.offloader = offloader
        self.offload_peak = {"device": 0, "host": 0, "nvme": 0, "host_reserved": 0}
        self._holders: weakref.WeakSet[_Holder] = weakref.WeakSet()
        if offloader is not None:
            inner_pack, inner_unpack = offloader._pack, offloader._unpack
            offloader._pack = lambda t: self._pack(t, inner_pack)
            offloader._unpack = lambda h: self._unpack(h, inner_unpack)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Hooks for the block (unless the offloader's hooks are the ones in force), and the
        recomputation of checkpointed blocks counted too."""
        real = torch_checkpoint._recomputation_hook
        torch_checkpoint._recomputation_hook = functools.partial(_CountedRecomputation, self)  # type: ignore[misc]
        try:
            if self.offloader is None:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    yield
            else:
                yield
        finally:
            torch_checkpoint._recomputation_hook = real  # type: ignore[misc]
        self.sample_offload()

    def counted_storage(
        self, t: torch.Tensor, state: set[int] | None = None
    ) -> torch.UntypedStorage | None:
        """`t`'s storage if it counts as an activation (`state`: the state_ptrs, if at hand), else None."""
        if t.device.type == "meta" or t.layout is not torch.strided:
            return None
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in (
            self.state_ptrs() if state is None else state
        ):
            return None
        return storage

    def count(self, t: torch.Tensor, lifetime: object) -> None:
        """Count `t`'s storage until `lifetime` is collected."""
        storage = self.counted_storage(t)
        if storage is None:
            return
        weakref.finalize(lifetime, self.saved.drop, self.saved.add(storage))
        if _is_weight_copy(t):
            weakref.finalize(lifetime, self.copies.drop, self.copies.add(storage))

    def _pack(self, t: torch.Tensor, inner: Callable | None = None) -> Any:
        if inner is not None:
            holder = _Holder(inner(t))
        else:
            # detached: an op's own output kept with its grad_fn from its node would be a cycle (a
            # leaf has none: kept as it is, as autograd keeps it)
            holder = _Holder(t if t.grad_fn is None else t.detach())
        self.count(t, holder)
        self._holders.add(holder)
        self.sample_offload()
        return holder

    def _unpack(self, holder: Any, inner: Callable | None = None) -> torch.Tensor:
        if isinstance(holder, torch.Tensor):
            return holder
        out = inner(holder.inner) if inner is not None else holder.inner
        self.sample_offload()
        return out

    def sample_offload(self) -> None:
        """With an offloader: what of the live saved tensors is in memory now, what is in host
        copies, and what in the swap file; the peaks of each."""
        off = self.offloader
        if off is None:
            return
        # the entries autograd still holds handles of (the offloader's own index of them is keyed
        # by the storage's id, which a later storage may take over)
        entries: dict[int, Any] = {}
        leaves: dict[int, int] = {}
        state = self.state_ptrs()
        for h in list(self._holders):
            if isinstance(h.inner, torch.Tensor):  # a leaf, returned as it is: autograd keeps it
                storage = self.counted_storage(h.inner, state)
                if storage is not None:
                    leaves[storage.data_ptr()] = storage.nbytes()
            else:
                entries[id(h.inner.entry)] = h.inner.entry
        device = sum(leaves.values())
        host: dict[int, int] = {}
        nvme = 0
        with off._lock:
            for e in entries.values():
                if e.released:
                    continue
                if e.kept or e.src is not None or e.loaded is not None:
                    device += e.nbytes
                if e.host is not None:
                    host[e.host.data_ptr()] = e.host.numel()
                if e.region is not None:
                    nvme += e.region.nbytes
            reserved = off._host.reserved_bytes
        now = {
            "device": device,
            "host": sum(host.values()),
            "nvme": nvme,
            "host_reserved": reserved,
        }
        for k, v in now.items():
            self.offload_peak[k] = max(self.offload_peak[k], v)


class _CountedRecomputation(torch_checkpoint._recomputation_hook):  # type: ignore[misc, name-defined]
    """torch.utils.checkpoint's hooks for a block's recomputation in backward, which also count
    each tensor the recomputation saves until its handle (dropped when backward takes it) goes."""

    def __init__(
        self, probe: SavedTensors, target_frame_ref: weakref.ReferenceType, gid: Any
    ) -> None:
        super().__init__(target_frame_ref, gid)
        real_pack = self.pack_hook

        def pack(x: torch.Tensor) -> Any:
            try:
                return real_pack(x)
            finally:  # also when it stops the recomputation early, after storing the last one
                frame = target_frame_ref()
                if frame is not None:
                    index = frame.recomp_counter[gid] - 1
                    holder = (
                        frame.weak_holders[index]()
                        if 0 <= index < len(frame.weak_holders)
                        else None
                    )
                    handle = holder.handles.get(gid) if holder is not None else None
                    if handle is not None:
                        probe.count(x, handle)

        self.pack_hook = pack


# --- the engine's transient buffers ---------------------------------------------------------------


class EngineProbe:
    """Wraps each flat group's gather and gradient intake to follow the gathered ZeRO-3 buffers and
    the transient whole-gradient buffers of partitioned gradients."""

    def __init__(self, engine: ZeroEngine):
        self.engine = engine
        self.gathered_peak = 0
        self.buckets = LiveBytes()
        for g in engine.groups:
            g.gather = functools.partial(self._gather, g, g.gather)  # type: ignore[method-assign]
            g.wait = functools.partial(self._wait, g, g.wait)  # type: ignore[method-assign]
            g._take_grad = functools.partial(self._take_grad, g, g._take_grad)  # type: ignore[method-assign]

    def gathered_now(self) -> int:
        if not self.engine.plan.shards_params:
            return 0
        return sum(g.full.untyped_storage().nbytes() for g in self.engine.groups)

    def _sample(self) -> None:
        self.gathered_peak = max(self.gathered_peak, self.gathered_now())

    def _gather(self, g: FlatGroup, real: Callable, async_op: bool = False) -> None:
        real(async_op)
        self._sample()

    def _wait(self, g: FlatGroup, real: Callable) -> None:
        real()
        self._sample()

    def _take_grad(self, g: FlatGroup, real: Callable, slot: Any) -> None:
        fresh = g.grad_full is None
        real(slot)
        if fresh and g.plan.grads != "none" and g.grad_full is not None:
            storage = g.grad_full.untyped_storage()
            weakref.finalize(storage, self.buckets.drop, self.buckets.add(storage))


# --- one layout on one rank ---------------------------------------------------------------------


def _state_ptrs(model: ParallelModel) -> set[int]:
    ptrs = set()
    for part in model.parts:
        for t in [*part.parameters(), *part.buffers()]:
            ptrs.add(t.untyped_storage().data_ptr())
    for g in model.engine.groups:
        for t in (g.full, g.shard, g.secondary, g.grad_shard):
            if t is not None:
                ptrs.add(t.untyped_storage().data_ptr())
    ptrs.discard(0)
    return ptrs


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors themselves, a storage's region counted once (views of one arena count
    their own elements, not the arena)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def micro_batches(cfg: Config, rank: int, step: int, world: int) -> list[Batch]:
    """Random tokens for this rank's micro-batches of `step`."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tr, m = cfg.train, cfg.model
    shape = (tr.micro_batch_size, m.seq_len + 1)
    out = []
    for _ in range(cfg.grad_accum_steps(world)):
        tokens = torch.randint(0, VOCAB, shape, generator=gen)
        out.append(Batch(tokens[:, :-1], tokens[:, 1:]))
    return out


def _tier_bytes(model: ParallelModel) -> dict[str, int]:
    """Optimizer moments, offloaded parameter shards and the host pool, by tier, from the tiers'
    own buffers and files."""
    out: dict[str, int] = {}
    tiers = model.tiers
    engine = model.engine
    optim_tier = engine.optim_tier
    if optim_tier is None:
        out["optim/device"] = engine.held_bytes()["optim"]
    else:
        kind = optim_tier.kind  # type: ignore[attr-defined]
        moments = [m for ms in optim_tier._moments.values() for m in ms]  # type: ignore[attr-defined]
        if kind == "device":
            out["optim/device"] = _distinct_bytes(moments)
        elif kind == "host":
            out["optim/host"] = _distinct_bytes(moments)
        scratch = [t for lane in optim_tier._scratch for t in lane.values()]  # type: ignore[attr-defined]
        if scratch:
            out["optim.scratch/device"] = _distinct_bytes(scratch)
    if tiers is not None:
        pool = tiers.pool
        out["pool/host"] = pool.n_slabs * pool.slab_bytes
        out["pool.resident/host"] = pool.resident_bytes
        if tiers.swap is not None:
            for kind, f in tiers.swap.files.items():
                if kind in ("params", "optim"):
                    out[f"{kind}/nvme"] = f.size
                else:
                    out[f"{kind}.file_allocated/nvme"] = f.allocated
    return out


def measure(cfg: Config, topo: Topology, world: int) -> dict[str, Any]:
    """Build the parallel model of `cfg` on this rank, train STEPS steps, and return what it held
    (see the module docstring). Every rank of the world calls it with the same config."""
    device = torch.device("cpu")
    model = parallelize(cfg, topo, device, VOCAB)
    engine = model.engine
    offloader = model.tiers.activations if model.tiers is not None else None
    saved = SavedTensors(lambda: _state_ptrs(model), offloader)
    probe = EngineProbe(engine)
    held: dict[str, int] = {}
    tiers: dict[str, int] = {}
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    start = time.perf_counter()
    try:
        for step in range(STEPS):
            with saved.watching():
                model.forward_backward(micro_batches(cfg, topo.rank, step, world))
            model.reduce_and_clip(clip)
            engine.step()
            now = engine.held_bytes()
            held = {k: max(held.get(k, 0), v) for k, v in now.items()}
            for k, v in _tier_bytes(model).items():
                tiers[k] = max(tiers.get(k, 0), v)
            engine.zero_grad()
        leftover = saved.saved.now
    finally:
        model.close()
    measured: dict[str, int] = {
        "params/device": held["params"],
        "grads/device": held["grads"],
        **tiers,
    }
    if offloader is None:
        measured["activations/device"] = saved.saved.peak
    else:
        peaks = dict(saved.offload_peak)
        measured["activations.host_reserved/host"] = peaks.pop(
            "host_reserved"
        )  # in use or kept for reuse
        measured.update({f"activations/{t}": v for t, v in peaks.items() if v})
        measured["activations.saved/device"] = saved.saved.peak  # what keeping them all would hold
    if saved.copies.peak:
        measured["activations.weight_copies/device"] = saved.copies.peak
    if probe.gathered_peak:
        measured["gathered/device"] = probe.gathered_peak
    if probe.buckets.peak:
        measured["buckets/device"] = probe.buckets.peak
    coords = topo.coords
    return {
        "rank": topo.rank,
        "pp_stage": coords["pp"],
        "tp_rank": coords["tp"],
        "dp_rank": coords["dp"],
        "measured": {k: int(v) for k, v in sorted(measured.items())},
        "info": {
            "seconds": round(time.perf_counter() - start, 2),
            "saved_left_after_step": leftover,
        },
    }


# --- the world ------------------------------------------------------------------------------------


def probe_worker(
    rank: int, size: int, port: int, out_dir: str, names: list[str], nvme_root: str
) -> None:
    """One rank of the probe's world: every layout of `names` in turn; saves rank<r>.pt."""
    join_world(rank, size, port, timeout_s=120)
    results: dict[str, Any] = {}
    topologies: dict[Layout, Topology] = {}
    try:
        for name in names:
            cfg = layout_config(name, Path(nvme_root) / name, size)
            layout = layout_from_config(cfg.parallel, size, size)
            if layout not in topologies:
                topologies[layout] = build_topology(layout, rank)
            results[name] = {"layout": name, **measure(cfg, topologies[layout], size)}
            dist.barrier()
        torch.save(results, Path(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_probe(
    names: list[str], out_dir: str | Path, nvme_root: str | Path, timeout_s: float = 600
) -> dict:
    """Run the layouts `names` in one world of WORLD processes; {layout: [rank results]}."""
    out_dir, nvme_root = Path(out_dir), Path(nvme_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        (nvme_root / name).mkdir(parents=True, exist_ok=True)
    ranks = run_world(
        probe_worker, WORLD, out_dir, list(names), str(nvme_root), timeout_s=timeout_s
    )
    return {name: [r[name] for r in ranks] for name in names}


# --- against the memory model ---------------------------------------------------------------------

REL_TOL = 0.10  # a kind may differ from the model's figure by this share of the measured bytes
ABS_SLACK = 4096  # or, where both sides are under this many bytes, by up to this many


def predicted(cfg: Config, world: int = WORLD) -> Any:
    """The memory model's estimate for `cfg` on this machine's stand-in cluster of `world` ranks."""
    from strata.plan.cluster import cpu_cluster
    from strata.plan.memory import estimate_memory

    per_node = cfg.parallel.ranks_per_node or world
    cluster = cpu_cluster(world // per_node, per_node, ranks_per_gpu=cfg.parallel.ranks_per_gpu)
    return estimate_memory(cfg, cluster, VOCAB)


def within(predicted_bytes: int, measured_bytes: int) -> bool:
    diff = abs(predicted_bytes - measured_bytes)
    if max(predicted_bytes, measured_bytes) < ABS_SLACK:
        return diff <= ABS_SLACK
    return diff <= REL_TOL * measured_bytes


# Kinds reported but not held to the model: gradient buckets live until their reduce-scatter has
# run, which on these CPUs depends on how far the reduction lanes lag behind backward (measured:
# from 3 groups' gradients to the whole gradient), where the model assumes a network that keeps pace.
UNCOMPARED = {"buckets"}


def compare(
    name: str, ranks: list[dict], nvme_dir: str | Path = "/tmp/memprobe-nvme"
) -> list[dict]:
    """One row per rank and (kind, tier) that either side has, for the kinds the model covers:
    {"layout", "rank", "pp_stage", "key", "predicted", "measured", "error", "ok"}; error is
    (predicted − measured) / measured (inf when nothing was measured)."""
    cfg = layout_config(name, nvme_dir)
    estimate = predicted(cfg)
    fullest: dict[tuple[int, str], int] = {}  # (stage, key) -> the most any of its ranks holds
    for r in ranks:
        for key, v in r["measured"].items():
            fullest[(r["pp_stage"], key)] = max(fullest.get((r["pp_stage"], key), 0), v)
    rows = []
    for r in ranks:
        want = {
            f"{k}/{t}": v for (k, t), v in estimate.stage(r["pp_stage"]).bytes.items() if k in KINDS
        }
        got = {k: v for k, v in r["measured"].items() if k.split("/")[0] in KINDS}
        if cfg.model.moe.enabled:
            # A rank's activations hold the rows its experts received, which routing decides; the
            # model plans the fullest rank's (at the capacity's bound), so that is what is compared.
            got = {
                k: fullest[(r["pp_stage"], k)] if k.startswith("activations/") else v
                for k, v in got.items()
            }
        for key in sorted(set(want) | set(got)):
            p, m = int(want.get(key, 0)), int(got.get(key, 0))
            error = (p - m) / m if m else (0.0 if p == 0 else math.inf)
            rows.append(
                dict(
                    layout=name,
                    rank=r["rank"],
                    pp_stage=r["pp_stage"],
                    key=key,
                    predicted=p,
                    measured=m,
                    error=error,
                    ok=key.split("/")[0] in UNCOMPARED or within(p, m),
                )
            )
    return rows


def main() -> None:
    """Run every layout and save the measurements to /tmp/memprobe/measured.json."""
    import sys

    names = sys.argv[1:] or list(LAYOUTS)
    result = run_probe(names, "/tmp/memprobe/ranks", "/tmp/memprobe/nvme")
    Path("/tmp/memprobe/measured.json").write_text(json.dumps(result, indent=1))
    for name, ranks in result.items():
        for r in ranks:
            print(name, r["rank"], r["pp_stage"], r["tp_rank"], r["measured"], r["info"])


if __name__ == "__main__":
    main()
