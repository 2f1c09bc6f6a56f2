"""CO2 (Sun et al., "CO2: Efficient Distributed Training with Full Communication-Computation
Overlap", ICLR 2024): local updating across nodes with a one-round-late, asynchronous outer
all-reduce, so the slow inter-node link is busy while the next local steps compute.

Inside a node training is ordinary data parallelism (the trainer's inner optimizer with its
intra-node gradient all-reduce). Across nodes, the ranks holding the same shard/replica
(`outer_group`, e.g. a group of `Layout.replica_groups('node')`) train independently for
H = `outer_every` inner steps per *round*, then exchange the round's pseudo-gradient. With x_r the
anchor (consensus parameters, identical on every replica), s_r^i replica i's start of round r and
e_r^i its parameters after the round's H local steps:

    Δ_r^i = s_r^i − e_r^i                                this round's local progress
    start   Δ̄_r = mean_i Δ_r^i   (async all-reduce over outer_group; overlaps round r+1)
    wait    Δ̄_{r−1}             (started a round ago: H steps of compute to hide behind)
    m     ← β·m + Δ̄_{r−1}                                outer momentum
    m     ← m · min(1, c / ‖m‖₂)                          outer momentum clipping (a real clip)
    x_{r+1} = x_r − α·m                                   outer step on the anchor
    G     = −Δ_r^i                                        staleness gap: this replica's progress
                                                          that the anchor does not hold yet
    s_{r+1}^i = x_{r+1} + G ⊘ (1 + λ·|G| / rms(G))        staleness gap penalty (element-wise)

(α = outer_lr, β = outer_momentum, λ = staleness_penalty, c = clip.) Each replica continues from
the consensus anchor plus its own not-yet-averaged progress; when that progress's average
arrives, one round later, it enters the anchor and the local copy of it is dropped, so nothing
is counted twice and no compute is discarded. Round r's average thus reaches the parameters at
the end of round r+1 (the paper's one-step asynchronous communication); the first round only
starts the pipeline. The exact form of the paper's staleness gap penalty could not be checked
against its text here: the form above is this module's reading of "penalise the gap between the
stale consensus and the local parameters" (λ = 0 keeps the local progress whole; λ → ∞ restarts
every replica from the stale anchor). The clip scales the stored momentum itself (one published
implementation clamps a copy that is then discarded, which changes nothing).

`synchronous=True` waits for Δ̄_r at once and applies it in the same round (no gap, so no
penalty): with H = 1, α = 1, β = 0 and no clip, x_{r+1} = mean_i e_r^i, which equals
synchronous data parallelism exactly when the inner update is linear in the gradient (SGD, with
or without momentum and weight decay — every replica's momentum buffer is then the same linear
function of its gradients, so averaging parameters averages gradients). For AdamW it is only
close: averaging Adam steps taken on different gradients is not an Adam step on the average.

Memory: the anchor, the round's start, the momentum and the in-flight delta are each one fp32
copy of the local parameters. Counters: the outer all-reduce is counted under dim "co2".
"""
from __future__ import annotations

import torch
from torch import nn

from parallel import comm


class CO2:
    """Outer (inter-node) optimizer state for one replica. Call `after_local_step()` after every
    inner optimizer step; every `outer_every`-th call ends a round (see the module docstring).

    `norm_group`: where the other pieces of the momentum vector live when parameters are sharded
    (tp/pp/ZeRO); the clip norm is then the global one. None: these parameters are the whole model.
    """

    def __init__(self, params: list[nn.Parameter], outer_group, outer_every: int, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, staleness_penalty: float = 0.0, clip: float | None = None,
                 synchronous: bool = False, norm_group=None):
        if outer_every < 1:
            raise ValueError(f"CO2: outer_every must be >= 1, got {outer_every}")
        if clip is not None and clip <= 0:
            raise ValueError(f"CO2: clip must be positive or None, got {clip}")
        self.params = list(params)
        self.group, self.norm_group = outer_group, norm_group
        self.every, self.lr, self.beta = outer_every, outer_lr, outer_momentum
        self.penalty, self.clip, self.synchronous = staleness_penalty, clip, synchronous
        self.world = 1 if outer_group is None else torch.distributed.get_world_size(outer_group)
        self.anchor = self._flat().clone()
        self.start = self.anchor.clone()  # where this replica began the current round
        self.momentum = torch.zeros_like(self.anchor)
        self.steps = 0     # inner steps taken
        self.rounds = 0    # rounds ended
        self.pending: tuple[comm.AsyncWork, torch.Tensor] | None = None
        self.last_clip_scale = 1.0
        self._numel: int | None = None  # parameters over norm_group (computed once, when first needed)

    # --- flat views of the parameters ----------------------------------------------------------

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    @torch.no_grad()
    def _load(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n

    # --- the algorithm ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """Whether an outer all-reduce has been started and not yet applied."""
        return self.pending is not None

    def after_local_step(self) -> None:
        """Count one inner step; at the end of a round exchange and apply (see module doc)."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.end_round()

    @torch.no_grad()
    def end_round(self) -> None:
        delta = self.start - self._flat()
        gap = None if self.synchronous else -delta  # a copy: the reduction works on delta in place
        work = comm.all_reduce_async(delta, self.group, dim="co2")
        if self.synchronous:
            work.wait()
            self._outer_step(delta.div_(self.world))
            self.start.copy_(self.anchor)
        else:
            ready = self.pending
            if ready is not None:
                ready[0].wait()
                self._outer_step(ready[1].div_(self.world))
            self.pending = (work, delta)
            self.start.copy_(self.anchor).add_(self._penalized(gap))
        self.rounds += 1
        self._load(self.start)

    def finish(self) -> None:
        """Wait for and apply the delta still in flight (end of training, before a checkpoint):
        afterwards every replica holds the anchor."""
        if self.pending is not None:
            work, delta = self.pending
            self.pending = None
            work.wait()
            with torch.no_grad():
                self._outer_step(delta.div_(self.world))
                self.start.copy_(self.anchor)
                self._load(self.start)

    def _outer_step(self, avg_delta: torch.Tensor) -> None:
        self.momentum.mul_(self.beta).add_(avg_delta)
        if self.clip is not None:
            norm = self._global_norm(self.momentum)
            self.last_clip_scale = min(1.0, self.clip / (norm + 1e-12))
            if self.last_clip_scale < 1.0:
                self.momentum.mul_(self.last_clip_scale)
        self.anchor.sub_(self.momentum, alpha=self.lr)

    def _penalized(self, gap: torch.Tensor) -> torch.Tensor:
        """G ⊘ (1 + λ·|G|/rms(G)): the staleness gap, shrunk where it is large (G itself for λ = 0)."""
        if self.penalty == 0:
            return gap
        rms = self._global_norm(gap) / max(1, self._global_numel()) ** 0.5
        return gap if rms == 0 else gap / (1 + self.penalty * gap.abs() / rms)

    def _global_norm(self, t: torch.Tensor) -> float:
        sq = t.pow(2).sum()
        comm.all_reduce(sq, self.norm_group, dim="co2")
        return float(sq.sqrt())

    def _global_numel(self) -> int:
        if self._numel is None:
            n = torch.tensor([float(self.anchor.numel())])
            comm.all_reduce(n, self.norm_group, dim="co2")
            self._numel = int(n.item())
        return self._numel
