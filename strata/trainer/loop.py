"""The training loop: one Trainer that sets a run up, then trains step by step, evaluates, logs, and
calls the checkpoint and snapshot managers to save.

Everything about *how* the model is laid out and stepped lives behind `parallelize` (tensor,
pipeline, data parallelism, ZeRO, memory tiers, activation policy, CO2): the loop asks the data
loader for this rank's micro-batches, has the parallel model run forward/backward, reduce and clip,
and step, under a warmup+cosine learning-rate schedule. What watches or steers a step (MoE routing,
the loss-spike guard, the profiler, the hang watchdog) is one of its step hooks (`hooks`); where a
run starts is `start`'s, and what a worker runs around the Trainer (`strata train`, `strata eval`,
a checkpoint's rewrite) is `jobs`'.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from strata import config as config_mod
from strata.checkpoint import store
from strata.checkpoint.manager import CheckpointManager, MagnitudeBound
from strata.config import Config
from strata.data.loader import MixtureLoader, make_loader
from strata.data.tokens import end_of_document
from strata.errors import StrataError
from strata.model import flops_per_token
from strata.parallel import comm, watchdog
from strata.parallel.runtime import Runtime
from strata.parallel.topology import Topology, build_topology, layout_from_config
from strata.trainer import start
from strata.trainer.datasets import check_objective, describe, document_mask_warning, open_data
from strata.trainer.divergence import SpikeGuard, implausible_weights, nonfinite_error
from strata.trainer.evaluate import Evaluation, evaluate
from strata.trainer.hooks import HangWatch, StepHook, all_of
from strata.trainer.lr_schedule import lr_at
from strata.trainer.metrics import Interval, MetricsLogger
from strata.trainer.parallelize import ParallelModel, parallelize
from strata.trainer.preference import Preference
from strata.trainer.profiling import StepProfiler
from strata.trainer.routing import RoutingMonitor
from strata.trainer.signals import Preempted, StopRequest
from strata.trainer.state import TrainState


@dataclass
class RunResult:
    """What a finished run reports (rank 0's view; losses are dp-averaged)."""

    losses: dict[int, float] = field(default_factory=dict)  # step (1-based) -> train loss
    eval_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    final_step: int = 0


class Trainer:
    """One rank's run: the data, the parallel model, the training state and its managers."""

    def __init__(
        self,
        cfg: Config,
        runtime: Runtime,
        writes: list[tuple[Path, str]] | None = None,
        saves: bool = True,
    ):
        """`saves` False: a job that only loads (`strata eval`) and leaves checkpoint.dir, which a
        live run may be writing, and the snapshot agents alone."""
        self.cfg, self.rt = cfg, runtime
        self.start_notes: list[str] = []  # for rank 0 to print once the log is open
        # first: nothing of the run is written before the directories it writes are held (`writes`:
        # the run directory and checkpoint.dir unless a caller that holds them says otherwise)
        if writes is None:
            writes = [(cfg.run_dir(), "run directory"), (cfg.checkpoint_dir(), "checkpoint.dir")]
        self.locks = start.lock_run(writes, runtime.rank, self.start_notes)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        layout = layout_from_config(cfg.parallel, runtime.world_size, runtime.local_world_size)
        self.topo: Topology = build_topology(layout, runtime.rank)
        data = open_data(cfg, runtime.rank)
        check_objective(cfg, data)
        warning = document_mask_warning(cfg, data)
        if warning:
            self.start_notes.append(f"warning: {warning}")
        self.train_set, self.val_set = data.train, data.val
        self.data_dir = data.path  # the (first) prepared directory
        self.data_description = describe(cfg.data)
        self.model: ParallelModel = parallelize(
            cfg, self.topo, runtime.device, self.train_set.vocab_size
        )
        if cfg.data.document_mask or cfg.data.reset_positions:
            eot = end_of_document(data.path, data.key)
            self.model.documents = (eot, cfg.data.document_mask, cfg.data.reset_positions)
        if cfg.train.objective == "dpo":  # its config checks require data.document_mask
            lora = cfg.model.lora.enabled
            self.model.objective = Preference(self.model, cfg.train.dpo, eot, lora)
        self.held_bytes: dict[str, int] = {}
        self.loader = make_loader(
            self.train_set,
            cfg.train.seed,
            cfg.train.global_batch_size,
            cfg.train.micro_batch_size,
            self.topo.data_rank,
            self.topo.data_size,
        )
        self.state = TrainState(cfg, self.model, self.loader, runtime.rank)
        # saves' and snapshots' collectives
        control = comm.new_gloo_group() if runtime.distributed else None
        self.checkpoints = self._checkpoint_manager(control, saves)
        self.snapshots = (
            start.snapshot_manager(cfg.snapshot, runtime, control, self.start_notes)
            if cfg.snapshot.every_steps and saves
            else None
        )
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        self.step_skipped = False  # the last step updated nothing: not finite, or a hook's veto
        self.skip_reason: str | None = None  # the veto
        self.skipped_steps = self.nonfinite_in_a_row = 0
        self.routing = (
            RoutingMonitor(cfg, self.model.parts, self.topo) if cfg.model.moe.enabled else None
        )
        self.hooks = self._step_hooks(control)
        self.stop_request = StopRequest()  # installed by `fit`
        # the signal every rank agreed to stop on after the last step (0: none)
        self.stop_signal = 0
        self.saved_step = -1  # the step of the last save started, so a stop does not save it twice
        self.flops_per_token = flops_per_token(cfg.model, self.model.vocab_size)

    @property
    def step(self) -> int:
        """Optimizer steps taken (the training state's)."""
        return self.state.step

    def _checkpoint_manager(self, control, saves: bool) -> CheckpointManager:
        """The manager of this run's checkpoints, agreeing over the `control` group (with `saves`
        False, one that leaves checkpoint.dir untouched)."""
        cfg, rt = self.cfg, self.rt
        return CheckpointManager(
            cfg.checkpoint_dir(),
            rt.rank,
            rt.world_size,
            cfg.checkpoint.keep_last,
            cfg.checkpoint.async_save,
            control,
            config_yaml=config_mod.dump(cfg),
            on_disk_full=cfg.checkpoint.on_disk_full,
            prepare=saves,
        )

    def _step_hooks(self, control) -> list[StepHook]:
        """What watches or steers each step, in the order the loop calls them: routing's statistics
        are summed before the watchdog hears the step is done, and the profiler writes its trace
        after the watchdog stops."""
        cfg, rt = self.cfg, self.rt
        guard = SpikeGuard.from_config(cfg.train, cfg.optim.warmup_steps, cfg.checkpoint_dir())
        if guard is not None:
            self.state.parts["spike_guard"] = guard  # a resumed run judges as the whole one
        hooks = [
            self.routing,
            guard,
            StepProfiler.from_config(cfg.log, cfg.run_dir(), rt.rank, rt.device),
            HangWatch(cfg.parallel.hang_after_s(), rt, control),
        ]
        return [hook for hook in hooks if hook is not None]

    def release_locks(self) -> None:
        """Let the run's directories go (at the end of the run; a process's exit does it too)."""
        if self.locks is not None:
            self.locks.release()
            self.locks = None

    # --- one step -------------------------------------------------------------------------
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over this rank's micro-batches, reduce, clip, step. Returns the
        dp-averaged loss and the gradient norm before clipping, as 0-d tensors on the device.

        A step whose loss or gradient norm is not finite updates nothing (`train.nonfinite`): its
        gradients are dropped, and it still counts as a step of the lr schedule and of the data (as
        Megatron counts its skipped iterations), so a resumed run and the schedule stay in step.
        Deciding that costs one host sync per step; every rank makes the same decision. The step
        hooks are called around it (`hooks`); a hook's veto skips the update as a non-finite step
        does."""
        model, step = self.model, self.step + 1
        for g in model.optimizer.param_groups:
            g["lr"] = lr_at(self.step, self.cfg.optim, self.cfg.train.steps)
        for hook in self.hooks:
            hook.start_step(step)
        loss = model.forward_backward(self.loader.next_step())
        grad_norm = model.reduce_and_clip(
            self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        )
        loss = self._dp_sum(loss) / self.topo.dp_size
        nonfinite, self.stop_signal, loss_value, norm_value = self._agree_after_step(
            loss, grad_norm
        )
        self.skip_reason = None if nonfinite else self._veto(step, loss_value, norm_value)
        self.step_skipped = nonfinite or self.skip_reason is not None
        if self.step_skipped:
            model.skip_step()
            self.skipped_steps += 1
        else:
            model.step()
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if nonfinite else 0
        self.held_bytes = model.held_bytes()
        self.state.step += 1
        for hook in self.hooks:
            hook.end_step(step, updated=not self.step_skipped)
        self.checkpoints.poll()  # a background save's failure surfaces here, on every rank
        if nonfinite:
            error = nonfinite_error(
                self.cfg.train,
                self.nonfinite_in_a_row,
                self.step,
                loss.item(),
                grad_norm.item(),
                self.cfg.checkpoint_dir(),
            )
            self._stop_with(error)
        for hook in self.hooks:
            self._stop_with(hook.stop(step))
        return loss, grad_norm

    def _veto(self, step: int, loss: float, grad_norm: float) -> str | None:
        """The first hook's reason not to update the weights of finite step `step` (the hooks after
        it are not asked), or None."""
        for hook in self.hooks:
            if (reason := hook.veto(step, loss, grad_norm)) is not None:
                return reason
        return None

    def _agree_after_step(
        self, loss: torch.Tensor, grad_norm: torch.Tensor
    ) -> tuple[bool, int, float, float]:
        """Whether any rank saw a non-finite dp-averaged loss or gradient norm, and the stop signal
        any rank caught (0 for none). One small MAX all-reduce over the whole world decides both for
        all: the loss lives on the last pipeline stage, and under CO2 each node has its own gradient
        norm, yet every rank must skip or step alike (else the ranks' parameters and collectives
        diverge); and a signal reaches the ranks at slightly different times, yet all must stop
        after the same step. The signal rides on the finiteness check, so watching for it costs
        nothing more per step."""
        bad = not (torch.isfinite(loss) & torch.isfinite(grad_norm)).item()
        # the loss and gradient norm ride along for the spike guard: the loss only the last pipeline
        # stage knows (the others hold 0; a loss is never negative), the norm every rank
        values = [0.0, 0.0] if bad else [float(loss), float(grad_norm)]
        flags = torch.tensor(
            [float(bad), float(self.stop_request.signum), *values], dtype=torch.float64
        )
        comm.all_reduce(flags, self.checkpoints.group, dim="nonfinite", op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), int(flags[1].item()), float(flags[2]), float(flags[3])

    def _stop_with(self, error: StrataError | None) -> None:
        """Raise `error`, if any (every rank alike), once a save in flight, of finite state, is
        committed."""
        if error is None:
            return
        self.checkpoints.close()
        raise error

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the data-parallel ranks (in place)."""
        return comm.all_reduce(value, self.topo.group("dp"), dim="dp")

    def evaluate(self) -> Evaluation:
        """The validation loss over the first train.eval_batches global batches of the validation
        split, the same at every world size (`trainer.evaluate`; collective)."""
        train = self.cfg.train
        return evaluate(
            self.model,
            self.val_set,
            train.eval_batches,
            train.global_batch_size,
            train.micro_batch_size,
            self.topo,
        )

    # --- saving and resuming ----------------------------------------------------------------
    def save(self) -> bool:
        """Saved in the global layout without gathering: every rank writes its own boxes of the global
        tensors (a box several ranks hold is split among them), in the background with
        `checkpoint.async`. Returns False, saving nothing, if any rank's state is not finite: a NaN
        checkpoint would verify as sound and resume into garbage. Since such a save never commits,
        `keep_last` never counts it, and never prunes the newest finite checkpoint to make room.
        Weights above checkpoint.max_abs_weight (measured as they are staged) stop the run, saving
        nothing (`implausible_weights`)."""
        cfg = self.cfg
        limit = cfg.checkpoint.max_abs_weight
        with self.state.ready_to_save():
            saved = self.checkpoints.save(
                self.step,
                self.state,
                finite_only=True,  # checked as it is staged, with the weights' magnitude
                suspect=any(hook.suspect(self.step) for hook in self.hooks),
                bound=MagnitudeBound("model.", limit) if limit else None,
            )
        if not saved:
            largest = self.checkpoints.largest
            self._stop_with(implausible_weights(largest, limit, self.step, cfg.checkpoint_dir()))
        return saved

    def snapshot(self) -> bool:
        """An in-memory snapshot of this step through the node's agent (collective); False if skipped."""
        if self.snapshots is None:
            raise RuntimeError("snapshot.every_steps is 0: this run takes no snapshots")
        with watchdog.paused("snapshot"):
            return self.snapshots.save(self.step, self.state)

    def resume(self, path: Path) -> Path:
        """Load a checkpoint saved from any layout into this one (`start.resume_from`)."""
        return start.resume_from(self, path)

    def init_weights(self) -> Path:
        """Load model.init_from's weights (`start.init_weights`; collective)."""
        return start.init_weights(self)

    # --- the run --------------------------------------------------------------------------
    def fit(self, log: MetricsLogger) -> RunResult:
        """Train to `train.steps`. A stop signal (GRACEFUL_SIGNALS) ends the run after the step in
        progress instead, with a committed checkpoint of it: raises `Preempted` on every rank."""
        self.stop_request.install()
        try:
            with all_of(hook.running(log.print) for hook in self.hooks):
                return self._fit(log)
        finally:
            self.stop_request.restore()

    def _fit(self, log: MetricsLogger) -> RunResult:
        """The training loop of `fit`: step, log every `log.interval` steps, do what follows a step
        (`_after_step`), and at the end evaluate, save and close (`_end_of_training`)."""
        cfg, result = self.cfg, RunResult()
        losses: dict[int, torch.Tensor] = {}
        interval = Interval(self.tokens_per_step, self.flops_per_token, self.rt.world_size)
        train_start, start_step = time.perf_counter(), self.step
        if cfg.train.eval_at_start and self.step == 0:
            result.eval_losses[0] = self._eval_and_log(log)
        while self.step < cfg.train.steps:
            with all_of(hook.around(self.step + 1) for hook in self.hooks):
                loss, grad_norm = self.train_step()
            losses[self.step] = loss
            interval.steps += 1
            record: dict = {}
            if self.step % cfg.log.interval == 0 or self.step == cfg.train.steps:
                record = self._interval_record(interval.measure(), loss, grad_norm)
                interval.restart()
            if self.step_skipped:
                record["skipped"] = self._note_skipped(log, loss, grad_norm)
            log.step(self.step, record)
            self._after_step(log, result)
        self._end_of_training(log, result)
        elapsed = time.perf_counter() - train_start
        result.final_step = self.step
        result.losses = {step: loss.item() for step, loss in losses.items()}
        result.tokens_per_s = (self.step - start_step) * self.tokens_per_step / max(elapsed, 1e-9)
        return result

    def _interval_record(self, record: dict, loss: torch.Tensor, grad_norm: torch.Tensor) -> dict:
        """The metrics of the steps logged at once: `record` (their throughput and bytes per step)
        with this step's loss, gradient norm and learning rate, and the skipped steps, the hooks'
        figures, memory tiers, snapshots and data mixture when there are any."""
        record.update(
            loss=loss.item(),
            grad_norm=grad_norm.item(),
            lr=self.model.optimizer.param_groups[0]["lr"],
        )
        if self.model.objective is not None:
            record.update(self.model.objective.record())
        if self.skipped_steps:
            record["skipped_steps"] = self.skipped_steps
        for hook in self.hooks:
            record.update(hook.record())
        offload = self.model.offload_metrics()
        if offload is not None:
            record["offload"] = offload
        if self.snapshots:
            record["snapshot"] = self.snapshots.stats()
        if isinstance(self.loader, MixtureLoader):
            record["data"] = {"source_samples": self.loader.source_counts()}
        return record

    def _after_step(self, log: MetricsLogger, result: RunResult) -> None:
        """What follows a logged step: the interval checkpoint, and before the last step evaluation,
        a snapshot, and stopping with a committed checkpoint when a stop signal came."""
        cfg = self.cfg
        self._report_refused(log)
        if (
            cfg.train.eval_interval
            and self.step % cfg.train.eval_interval == 0
            and self.step < cfg.train.steps
        ):
            result.eval_losses[self.step] = self._eval_and_log(log)
        if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
            self._save_or_warn(log)
        if (
            self.snapshots
            and self.step % cfg.snapshot.every_steps == 0
            and self.step < cfg.train.steps
        ):
            self.snapshot()
        if self.stop_signal and self.step < cfg.train.steps:
            self._stop_on_signal(log)

    def _end_of_training(self, log: MetricsLogger, result: RunResult) -> None:
        """After the last step: CO2's last exchange, the final evaluation, the final checkpoint
        (unless the interval save just made it), committed before the run reports done."""
        cfg = self.cfg
        self.model.close_co2_round()  # CO2's last exchange: every node ends on the same parameters
        result.eval_losses[self.step] = self._eval_and_log(log)
        if cfg.checkpoint.save_final and not (
            cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0
        ):
            self._save_or_warn(log)
        self._close("the final checkpoint's commit")
        self._report_refused(log)

    def _close(self, phase: str) -> None:
        """Commit the last save (and end the snapshots) before the run reports, under the watchdog's
        pause for `phase`; then let the model's resources go."""
        with watchdog.paused(phase):
            self.checkpoints.close()
            if self.snapshots:
                self.snapshots.close()
        self.model.close()

    def _note_skipped(self, log: MetricsLogger, loss: torch.Tensor, grad_norm: torch.Tensor) -> str:
        if self.skip_reason is not None:
            note = f"{self.skip_reason}; update skipped ({self.skipped_steps} skipped in all)"
        else:
            note = (
                f"loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g}: not finite, update "
                f"skipped ({self.nonfinite_in_a_row} in a row, {self.skipped_steps} in all)"
            )
        log.print(f"warning: step {self.step}: {note}")
        return note

    def _stop_on_signal(self, log: MetricsLogger) -> None:
        """Every rank saves this step (unless the interval save just did), waits for the commit,
        and raises `Preempted`: the job can be requeued and resumed exactly from here."""
        name = signal.Signals(self.stop_signal).name
        log.print(f"strata: {name}: stopping after step {self.step}; saving a checkpoint")
        if self.saved_step != self.step:
            self._save_or_warn(log)
        self._close("the stop checkpoint's commit")
        self._report_refused(log)
        root = self.cfg.checkpoint_dir()
        newest = store.committed(root)[-1:] if self.rt.rank == 0 else []
        where = f"checkpoint {newest[0]}" if newest else f"no committed checkpoint under {root}"
        note = f"stopped by {name} at step {self.step}: {where}; resume with --resume {root}"
        log.print(note)
        log.write({"step": self.step, "stopped": note, "wall_time": time.time()})
        raise Preempted(self.stop_signal)

    def _save_or_warn(self, log: MetricsLogger) -> None:
        self.saved_step = self.step
        refused = next((r for hook in self.hooks if (r := hook.refuse_save(self.step))), None)
        if refused is None:
            with watchdog.paused("checkpoint save"):
                saved = self.save()
            self._report_refused(log)  # the save before, which this one waited for
            if saved:
                return
        self._warn_not_saved(log, self.step, refused or "the training state is not finite")

    def _report_refused(self, log: MetricsLogger) -> None:
        """A background save whose image the writers refused (`CheckpointManager.take_refused`):
        weights above checkpoint.max_abs_weight stop the run, a state that is not finite is warned
        of as a save refused at once is."""
        refused = self.checkpoints.take_refused()
        if refused is None:
            return
        step, verdict = refused
        if verdict.finite:
            limit, where = self.cfg.checkpoint.max_abs_weight, self.cfg.checkpoint_dir()
            self._stop_with(implausible_weights(verdict.largest, limit, step, where))
        self._warn_not_saved(log, step, "the training state is not finite")

    def _warn_not_saved(self, log: MetricsLogger, step: int, why: str) -> None:
        note = (
            f"{why}: checkpoint step {step} not saved, so the newest committed checkpoint under "
            f"{self.cfg.checkpoint_dir()} stays the newest (and is kept)"
        )
        log.print(f"warning: step {self.step}: {note}")
        log.write({"step": self.step, "checkpoint_refused": note})

    def _eval_and_log(self, log: MetricsLogger) -> float:
        result = self.evaluate()
        log.write({"step": self.step, "eval_loss": result.loss})
        log.print(result.line(self.step))
        return result.loss
