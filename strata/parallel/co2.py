"""CO2 (Sun et al., "CO2: Efficient Distributed Training with Full Communication-Computation
Overlap", ICLR 2024, arXiv 2401.16265): local updating across nodes with a one-round-late,
asynchronous outer all-reduce, so the slow inter-node link is busy while the next local steps compute.

Inside a node training is ordinary data parallelism (the trainer's inner optimizer with its
intra-node gradient all-reduce). Across nodes, the ranks holding the same shard/replica
(`outer_group`: a dedicated group, e.g. `Topology.dedicated_digit_group('node', 'global')`) train independently for
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

(α = outer_lr, β = outer_momentum, λ = staleness_penalty, c = clip; c = 0 or None: no clip.) Each
replica continues from the consensus anchor plus its own not-yet-averaged progress; when that
progress's average arrives, one round later, it enters the anchor and the local copy of it is
dropped, so nothing is counted twice and no compute is discarded. Round r's average thus reaches
the parameters at the end of round r+1 (the paper's one-step asynchronous communication); the
first round only starts the pipeline. `finish()` (end of training) applies the delta in flight
and exchanges a partial last round synchronously, so the final parameters hold every step.

How this relates to the paper (what could and could not be checked). The paper's body (Algorithm
1, §3.2) was not readable in the sources available here: only its abstract
(https://hf.samuelbohl.com/papers/2401.16265.md, https://huggingface.co/papers/2401.16265), the
authors' code (github.com/weigao266/fairscale-CO2,
fairscale/experimental/nn/data_parallel/gossip/co2.py) and OpenReview-style review texts. So the
penalty and the clip above stay this module's documented reading, not a transcription:
- Penalty. The authors' code divides the pseudo-gradient entering the outer momentum by a constant
  (`co2_gap_penalty`, default 1) and restarts every replica from the new anchor. The reviews say
  the paper's Λ_t is computed from the outer iterates x_{t,0} and "scales the updates". That
  points to Λ_t dividing the stale averaged delta in the momentum step, not to shrinking the
  replica's own progress as here; the exact Λ_t is unverified, so it is not implemented. Here λ = 0
  keeps the local progress whole and λ → ∞ restarts every replica from the stale anchor (the
  code's restart).
- Clip. The authors' code intends an element-wise clamp of the outer momentum to [−φ, φ] but calls
  `torch.clamp` without keeping its result, so it never clips. This module clips the momentum's
  global L2 norm to c and stores the clipped momentum (clipping changes the update; tested).

`overlap=False` waits for Δ̄_r at once and applies it in the same round (no gap, so no penalty):
with H = 1, α = 1, β = 0 and no clip, x_{r+1} = mean_i e_r^i, which equals synchronous data
parallelism exactly when the inner update is linear in the gradient (SGD, with or without
momentum and weight decay — every replica's momentum buffer is then the same linear function of
its gradients, so averaging parameters averages gradients). For AdamW it is only close: averaging
Adam steps taken on different gradients is not an Adam step on the average.

Process group and thread. The outer all-reduce is issued with `async_op=True` on `outer_group`;
gloo runs it on that process group's own worker thread and the simulated slow link
(`comm.set_link_delay`) is a deadline checked at `wait()`, so the main thread never blocks on it
before the next round ends. A process group runs its collectives in issue order, so
`outer_group` must be **dedicated**: created with `dist.new_group(ranks)` for CO2 alone (not
handed back by a membership dedup that also serves dp/tp/ZeRO or `norm_group`), or a main-thread
collective on it would queue behind the slow reduction and lose the overlap.

Checkpoints. The trainer saves in the global layout: `close_round(optimizer)` ends the round
(every replica then holds the anchor and the replicas' mean inner-optimizer state) and the outer
momentum goes beside each parameter's optimizer state (`momentum_views`); `restart` resumes from
that. For a same-layout, mid-round resume of this class on its own, `state_dict()` waits for the
reduction in flight (without applying it) and returns
the anchor, the round's start, the momentum, the pending (reduced, not yet averaged) delta and the
counters; `load_state_dict()` into a fresh CO2 built over the same parameters resumes exactly,
mid-round too. The live parameters and the inner optimizer are the trainer's to save and restore.

Memory: the anchor, the round's start, the momentum and the in-flight delta are each one fp32
copy of the local parameters. Counters: the outer all-reduce is counted under dim "co2".
"""

from __future__ import annotations

import torch

from strata.parallel import comm


class CO2:
    """Outer (inter-node) optimizer state for one replica. Call `after_local_step()` after every
    inner optimizer step; every `outer_every`-th call ends a round (see the module docstring).

    `params`: the tensors the inner optimizer steps in place (whole parameters or ZeRO shard
    views); `outer_group`: the dedicated group of this replica's peers (None: one replica).
    `clip`: L2 bound on the outer momentum, 0 or None for none. `overlap`: False waits for each
    round's average at once (synchronous). `norm_group`: where the other pieces of the momentum
    vector live when parameters are sharded (tp/pp/ZeRO); the clip norm is then the global one.
    None: these parameters are the whole model.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        outer_group,
        outer_every: int,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        staleness_penalty: float = 0.0,
        clip: float | None = None,
        overlap: bool = True,
        norm_group=None,
    ):
        if outer_every < 1:
            raise ValueError(f"CO2: outer_every must be >= 1, got {outer_every}")
        if clip is not None and clip < 0:
            raise ValueError(f"CO2: clip must be positive, or 0/None for no clipping, got {clip}")
        self.params = list(params)
        self.group, self.norm_group = outer_group, norm_group
        self.every, self.lr, self.beta = outer_every, outer_lr, outer_momentum
        self.penalty, self.clip, self.overlap = staleness_penalty, clip or None, overlap
        self.world = 1 if outer_group is None else torch.distributed.get_world_size(outer_group)
        self.anchor = self._flat().clone()
        self.start = self.anchor.clone()  # where this replica began the current round
        self.momentum = torch.zeros_like(self.anchor)
        self.steps = 0  # inner steps taken (finish() rounds it up to close a partial last round)
        self.rounds = 0  # rounds ended
        self.pending: tuple[comm.AsyncWork, torch.Tensor] | None = None
        self.last_clip_scale = 1.0
        # parameters over norm_group (computed once, when first needed)
        self._numel: int | None = None

    # --- flat views of the parameters ----------------------------------------------------------

    def _flat(self) -> torch.Tensor:
        # a ZeRO rank whose chunk is all padding still takes part in the collectives
        if not self.params:
            return torch.zeros(0)
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    @torch.no_grad()
    def _load(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
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
        gap = -delta if self.overlap else None  # a copy: the reduction works on delta in place
        work = comm.all_reduce_async(delta, self.group, dim="co2")
        if not self.overlap:
            work.wait()
            self._outer_step(delta.div_(self.world))
            self.start.copy_(self.anchor)
        else:
            self._apply_pending()
            self.pending = (work, delta)
            assert gap is not None  # overlap
            self.start.copy_(self.anchor).add_(self._penalized(gap))
        self.rounds += 1
        self._load(self.start)

    @torch.no_grad()
    def finish(self) -> None:
        """End of training: apply the delta in flight, then exchange the progress of a partial last
        round (if the step count is not a multiple of `outer_every`) synchronously. Afterwards
        every replica holds the same parameters (the anchor), with every inner step in them. A
        collective over `outer_group` when a partial round is left: call it on every replica."""
        self._apply_pending()
        if self.steps % self.every:
            delta = self.start - self._flat()
            comm.all_reduce_async(delta, self.group, dim="co2").wait()
            self._outer_step(delta.div_(self.world))
            self.rounds += 1
            # closed: a second finish() changes nothing
            self.steps += self.every - self.steps % self.every
        self.start.copy_(self.anchor)
        self._load(self.start)

    @torch.no_grad()
    def close_round(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """`finish()`, and make the inner optimizer's state (its per-parameter moments) the
        replicas' mean: afterwards one replica's parameters and optimizer state are every
        replica's, so a checkpoint of them resumes exactly as this run goes on."""
        self.finish()
        if optimizer is None:
            return
        for p in self.params:
            for value in optimizer.state[p].values():
                if torch.is_tensor(value) and value.ndim > 0:
                    comm.all_reduce(value, self.group, dim="co2").div_(self.world)

    def _apply_pending(self) -> None:
        if self.pending is not None:
            work, delta = self.pending
            self.pending = None
            work.wait()
            self._outer_step(delta.div_(self.world))

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
            n = torch.tensor([float(self.anchor.numel())], device=self.anchor.device)
            comm.all_reduce(n, self.norm_group, dim="co2")
            self._numel = int(n.item())
        return self._numel

    # --- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to resume exactly, mid-round included: anchor, start, momentum, the
        pending delta (the reduction in flight is waited for, not applied: the trajectory does not
        change) and the counters. Flat fp32 tensors over `params` in order; copies."""
        if self.pending is not None:
            work, delta = self.pending
            work.wait()
            self.pending = (comm.AsyncWork(None, 0.0), delta)  # done: later waits return at once
        return {
            "numel": self.anchor.numel(),
            "world": self.world,
            "steps": self.steps,
            "rounds": self.rounds,
            "anchor": self.anchor.clone(),
            "start": self.start.clone(),
            "momentum": self.momentum.clone(),
            "pending": None if self.pending is None else self.pending[1].clone(),
            "last_clip_scale": self.last_clip_scale,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output into this CO2 (built over parameters of the same sizes, in
        the same outer world). Leaves the parameters alone: the trainer restores those itself."""
        if state["numel"] != self.anchor.numel():
            raise ValueError(
                f"CO2 state holds {state['numel']} parameter elements, these parameters have "
                f"{self.anchor.numel()}"
            )
        if state["world"] != self.world:
            raise ValueError(
                f"CO2 state was saved with {state['world']} replicas, this outer "
                f"group has {self.world}"
            )
        self.anchor.copy_(state["anchor"])
        self.start.copy_(state["start"])
        self.momentum.copy_(state["momentum"])
        pending = state["pending"]
        self.pending = (
            None if pending is None else (comm.AsyncWork(None, 0.0), pending.clone().float())
        )
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])
        self.last_clip_scale = float(state["last_clip_scale"])

    def momentum_views(self) -> list[torch.Tensor]:
        """The outer momentum as one tensor per parameter (views, shaped like the parameters): how
        the trainer saves it in the global layout, beside the parameter's optimizer state."""
        return [
            m.view_as(p)
            for m, p in zip(self.momentum.split([p.numel() for p in self.params]), self.params)
        ]

    @torch.no_grad()
    def restart(self, steps: int, momentum: list[torch.Tensor] | None = None) -> None:
        """Continue after `finish()` from a checkpoint: the parameters (already restored) are the
        anchor, `steps` inner steps are done, and `momentum` (per parameter, or None: zero) is the
        outer momentum."""
        self.anchor.copy_(self._flat())
        self.start.copy_(self.anchor)
        if momentum:
            self.momentum.copy_(torch.cat([m.reshape(-1).float() for m in momentum]))
        else:
            self.momentum.zero_()
        self.pending = None
        self.rounds = -(-steps // self.every)  # finish() closed a partial round, as here
        self.steps = self.rounds * self.every
