"""Search the layouts of one model and global batch on one cluster: every tensor-parallel degree
inside a node, pipeline degree and virtual stages, expert parallelism for MoE models (every degree
that divides the experts and a stage's tp·dp ranks), context parallelism for long sequences, micro-batch
size, ZeRO placement (ZeRO-1/2/3,
hierarchical ZeRO-3 within a node or a GPU, hpZ, the 3-level scheme), optimizer/parameter offload
and recomputation; keep those the config's own checks accept and the memory model fits, rank
them by the time model, and say for each rejected family (tp, pp, V, ep, cp) why it failed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.config.schema import Config, replace
from strata.errors import StrataError
from strata.plan.cluster import Cluster
from strata.plan.memory import MemoryEstimate, estimate_memory
from strata.plan.timing import TimeEstimate, estimate_time


@dataclass(frozen=True)
class Candidate:
    """One layout: the config keys it sets, by name."""

    tp: int
    pp: int
    virtual_stages: int
    micro_batch_size: int
    zero: str  # a ZERO_SCHEMES name
    offload: str  # an OFFLOADS name
    recompute: str
    # expert parallelism (MoE models): over the stage's tp·dp ranks, folded across tp when ep > dp
    ep: int = 1
    cp: int = 1  # context parallelism: each sequence over cp ranks carved out of dp

    @property
    def family(self) -> tuple[int, int, int, int, int]:
        """The layout without its memory settings (tp, pp, V, ep, cp): the search says why each
        family fails as one."""
        return (self.tp, self.pp, self.virtual_stages, self.ep, self.cp)

    def overrides(self) -> dict[str, object]:
        """The config keys that put this layout into a config (dp left to follow from the world
        size, the schedule to auto)."""
        out: dict[str, object] = {
            "parallel.tp": self.tp,
            "parallel.pp": self.pp,
            "parallel.dp": None,
            "parallel.virtual_stages": self.virtual_stages,
            "parallel.schedule": "auto",
            "parallel.microbatches": None,
            "parallel.sequence_parallel": self.tp > 1,
            "parallel.ep": self.ep,
            "parallel.cp": self.cp,
            "train.micro_batch_size": self.micro_batch_size,
            "activations.recompute": self.recompute,
        }
        levels = dict(
            zip(("params", "grads", "optim", "secondary_params"), ZERO_SCHEMES[self.zero])
        )
        out.update({f"zero.{k}.shard_over": v for k, v in levels.items()})
        params, optim = OFFLOADS[self.offload]
        out.update({"offload.params.device": params, "offload.optim.device": optim})
        return out

    def describe(self) -> str:
        """The layout in one line of the search's table."""
        experts = f" ep={self.ep}" if self.ep > 1 else ""
        context = f" cp={self.cp}" if self.cp > 1 else ""
        return (
            f"tp={self.tp} pp={self.pp} V={self.virtual_stages}{experts}{context} "
            f"mbs={self.micro_batch_size} zero={self.zero} offload={self.offload} "
            f"recompute={self.recompute}"
        )


# (params, grads, optim, secondary_params) levels
ZERO_SCHEMES: dict[str, tuple[str, str, str, str]] = {
    "none": ("none", "none", "none", "none"),
    "zero1": ("none", "none", "global", "none"),
    "zero2": ("none", "global", "global", "none"),
    "zero3": ("global", "global", "global", "none"),
    "zero3-node": ("node", "global", "global", "none"),  # parameters within a node only
    "hpz": ("global", "global", "global", "node"),
    "3-level": ("gpu", "node", "global", "none"),  # a GPU's GCDs, the node, everything
}
OFFLOADS: dict[str, tuple[str, str]] = {
    "none": ("none", "none"),
    "optim-cpu": ("none", "cpu"),
    "optim-nvme": ("none", "nvme"),
    "all-nvme": ("nvme", "nvme"),
}


@dataclass
class Planned:
    """A layout that fits: the candidate, the config it makes, and its memory and time estimates."""

    candidate: Candidate
    cfg: Config
    memory: MemoryEstimate
    time: TimeEstimate


@dataclass
class SearchResult:
    """What a search found: the fitting layouts (fastest first), why each rejected family
    (tp, pp, V) does not fit, and how many layouts were considered."""

    fitting: list[Planned]
    # family -> why none fits
    rejected: dict[tuple[int, int, int, int, int], str] = field(default_factory=dict)
    considered: int = 0


def with_layout(cfg: Config, cluster: Cluster, changes: dict[str, object]) -> Config:
    """`cfg` with `changes` applied, placed on `cluster` (its ranks per node and per GPU)."""
    changes = {
        "parallel.ranks_per_node": cluster.ranks_per_node,
        "parallel.ranks_per_gpu": cluster.ranks_per_gpu,
        **changes,
    }
    for key, value in changes.items():
        cfg = replace(cfg, key, value)
    return cfg


# layouts --search may try (a few ms each): past it, one error naming the count
MAX_CANDIDATES = 50_000


def _divisors(n: int) -> list[int]:
    """n's divisors in increasing order (trial division up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def candidates(cfg: Config, cluster: Cluster, nvme: bool) -> list[Candidate]:
    """Every combination the search tries (invalid ones are weeded out by the config's checks)."""
    world, node = cluster.world_size, cluster.ranks_per_node
    out = []
    for tp in _divisors(node):
        # a pipeline stage holds at least one layer
        for pp in (p for p in _divisors(world // tp) if p <= cfg.model.n_layers):
            for cp in context_degrees(cfg, world // (tp * pp)):
                out += _family(cfg, nvme, tp, pp, cp, world // (tp * pp * cp))
    return out


def context_degrees(cfg: Config, ranks: int) -> list[int]:
    """The context-parallel degrees worth trying with `ranks` data-parallel ranks: 1, and every
    divisor that splits the sequence evenly while leaving each rank at least 1024 tokens (below
    that a sequence is short enough for one rank)."""
    seq = cfg.model.seq_len
    return [c for c in _divisors(ranks) if c == 1 or (seq % (2 * c) == 0 and seq // c >= 1024)]


def _family(cfg: Config, nvme: bool, tp: int, pp: int, cp: int, dp: int) -> list[Candidate]:
    """Every candidate of one (tp, pp, cp) with `dp` data-parallel replicas."""
    vs = [1] if pp == 1 else [1, 2, 4]
    per_replica = cfg.train.global_batch_size // dp if cfg.train.global_batch_size % dp == 0 else 0
    mbs = (
        [b for b in _divisors(per_replica) if b <= 16]
        if per_replica
        else [cfg.train.micro_batch_size]
    )
    zeros = ["none"] if dp * cp == 1 else list(ZERO_SCHEMES)
    offloads = [o for o in OFFLOADS if nvme or "nvme" not in o]
    experts = cfg.model.moe.num_experts
    eps = [e for e in _divisors(tp * dp * cp) if experts % e == 0] if experts else [1]
    out = []
    for v, b, z, o, r, e in itertools.product(
        vs, mbs, zeros, offloads, ("none", "selective", "full"), eps
    ):
        if o == "all-nvme" and ZERO_SCHEMES[z][0] == "none":
            continue  # parameter offload needs ZeRO-3
        out.append(Candidate(tp, pp, v, b, z, o, r, e, cp))
    return out


def search(
    cfg: Config, cluster: Cluster, vocab: int, problems_of: Callable[[Config, int], list[str]]
) -> SearchResult:
    """Layouts that fit, fastest first, and why each (tp, pp, V, ep, cp) family has none. `problems_of(cfg,
    world_size)` is the config's own validation (`strata.config.checks.cross_problems`), which weeds
    out layouts a run would refuse."""
    nvme = cfg.offload.nvme_path is not None
    result = SearchResult([])
    why: dict[tuple[int, int, int, int, int], list[str]] = {}
    best_memory: dict[tuple[int, int, int, int, int], tuple[int, str]] = {}
    tries = candidates(cfg, cluster, nvme)
    if len(tries) > MAX_CANDIDATES:
        raise StrataError(
            f"strata plan --search would try {len(tries):,} layouts (more than "
            f"{MAX_CANDIDATES:,}, minutes of work): "
            "plan fewer nodes or GPUs per node, or check the config's layout without --search"
        )
    for cand in tries:
        result.considered += 1
        trial = with_layout(cfg, cluster, cand.overrides())
        problems = problems_of(trial, cluster.world_size)
        if problems:
            why.setdefault(cand.family, []).append(problems[0])
            continue
        memory = estimate_memory(trial, cluster, vocab)
        if not memory.fits():
            need = memory.peak("device")
            if cand.family not in best_memory or need < best_memory[cand.family][0]:
                best_memory[cand.family] = (need, memory.problems()[0])
            continue
        result.fitting.append(Planned(cand, trial, memory, estimate_time(trial, cluster, vocab)))
    fits = {p.candidate.family for p in result.fitting}
    for family in sorted(set(why) | set(best_memory)):
        if family in fits:
            continue
        if family in best_memory:
            result.rejected[family] = (
                f"memory: even its leanest variant does not fit ({best_memory[family][1]})"
            )
        else:
            result.rejected[family] = f"invalid: {why[family][0]}"
    result.fitting.sort(key=lambda p: p.time.step_s)
    return result
