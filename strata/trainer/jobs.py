"""What a worker runs around a `Trainer`, on every rank of a world of any layout: `train` (`strata
train`: where the run starts, the start-up banner, the training loop, summary.json and the closing
line), `evaluate_checkpoint` (`strata eval`: a checkpoint's loss, perplexity and bits per byte on
each held-out split) and `rewrite_checkpoint` (the workers of `strata ckpt reshard`: a checkpoint
loaded into this layout and saved again).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from strata import config as config_mod
from strata.config import Config
from strata.data.tokens import TokenDataset
from strata.errors import CheckpointError, ConfigError
from strata.model import count_params
from strata.parallel import comm
from strata.parallel import runtime as runtime_mod
from strata.parallel.runtime import Runtime
from strata.trainer import start
from strata.trainer.evaluate import Evaluation, evaluate, target_bytes
from strata.trainer.hooks import HangWatch
from strata.trainer.loop import RunResult, Trainer
from strata.trainer.metrics import MetricsLogger, mfu_peak
from strata.trainer.preference import Preference
from strata.trainer.signals import Preempted


def train(cfg: Config, runtime: Runtime, resume: Path | None = None) -> RunResult:
    """Train `cfg` in this process (one rank of the world `runtime` describes) and print a summary."""
    trainer = Trainer(cfg, runtime)
    began = time.time()
    if isinstance(trainer.model.objective, Preference) and not cfg.model.lora.enabled:
        # DPO's reference, full fine-tuning: the weights the run starts from, before any resume
        if cfg.model.init_from:
            start.init_weights(trainer)
        trainer.model.objective.keep_reference()
    origin = start.choose(trainer, resume)
    peak, peak_note = mfu_peak(cfg.log.peak_tflops, runtime.device, cfg.train.precision)
    log = MetricsLogger(
        cfg.run_dir(),
        cfg.train.steps,
        trainer.step,
        enabled=runtime.rank == 0,
        progress=cfg.log.progress,
        wandb_project=cfg.log.wandb_project if cfg.log.wandb else None,
        config=config_mod.to_dict(cfg),
        tensorboard=cfg.log.tensorboard,
        peak_tflops=peak,
    )
    _print_start(log, trainer, origin, peak_note, began)
    try:
        result = trainer.fit(log)
    except Preempted:
        # every rank is done with the world: leave it together, then exit PREEMPTED_EXIT
        runtime_mod.stop()
        raise
    finally:
        log.close()
    if runtime.rank == 0:
        _summarize(trainer, result)
    trainer.release_locks()
    return result


def _print_start(
    log: MetricsLogger, trainer: Trainer, origin: start.Origin, peak_note: str, began: float
) -> None:
    """The start-up banner, the data, the config's warnings, the notes of the set-up, and where the
    run started and how its memory tiers were set up (also into metrics.jsonl)."""
    cfg = trainer.cfg
    log.print(_banner(trainer, origin))
    log.print(f"data: {trainer.data_description}")
    for warning in config_mod.start_up_warnings(cfg):
        log.print(f"warning: {warning}")
    for note in trainer.start_notes:
        log.print(note)
    log.print(peak_note)
    if log.set_aside is not None:
        log.print(
            f"note: an earlier run's metrics.jsonl was kept as {log.set_aside.name}; this "
            "run's starts anew"
        )
    if origin.restore_note:
        log.print(origin.restore_note)
        log.write(
            {
                "step": trainer.step,
                "resumed": origin.restore_note,
                "restore_s": time.time() - began,
                "wall_time": time.time(),
            }
        )
    offload = trainer.model.startup_record()
    if offload is not None:
        log.write({"step": trainer.step, **offload})
    for note in trainer.model.startup_notes():
        log.print(note)


def _banner(trainer: Trainer, origin: start.Origin) -> str:
    """The run's first line: the model's size, the layout, the batch, the run directory, and where
    its state came from."""
    cfg, layout = trainer.cfg, trainer.topo.layout
    n_params = count_params(cfg.model, trainer.model.vocab_size)
    trained = ""
    if trainer.model.frozen:  # model.lora, train.freeze
        n_params, n_trained = trainer.model.parameter_counts()
        trained = f" ({n_trained / 1e6:.2f}M trained)"
    return (
        f"strata: {n_params / 1e6:.2f}M parameters{trained}, world {trainer.rt.world_size} "
        f"(tp {layout.tp}, pp {layout.pp}, dp {layout.data_parallel}"
        + (f", cp {layout.cp}" if layout.cp > 1 else "")
        + "), "
        f"{cfg.train.global_batch_size}×{cfg.model.seq_len} tokens/step, run dir {cfg.run_dir()}"
        + (f", resumed from {origin.resumed_from}" if origin.resumed_from else "")
        + (f", weights from {origin.weights_from}" if origin.weights_from else "")
    )


def _summarize(trainer: Trainer, result: RunResult) -> None:
    """summary.json in the run directory, and the closing line (rank 0)."""
    summary = {
        "final_step": result.final_step,
        "train_loss": result.losses.get(result.final_step),
        "eval_loss": result.eval_losses.get(result.final_step),
        "tokens_per_s": result.tokens_per_s,
        "comm_bytes": {f"{dim}/{op}": n for (dim, op), n in sorted(comm.bytes_moved.items())},
        "wire_bytes": dict(sorted(comm.bytes_by_link.items())),
        "held_bytes": trainer.held_bytes,
        "offload": trainer.model.offload_metrics(),
    }
    (trainer.cfg.run_dir() / "summary.json").write_text(json.dumps(summary, indent=1))
    train_loss = f"{summary['train_loss']:.4f}" if summary["train_loss"] is not None else "n/a"
    print(
        f"done: step {result.final_step}  train loss {train_loss}  eval loss "
        f"{summary['eval_loss']:.4f}  throughput {result.tokens_per_s:,.0f} tokens/s"
    )


def evaluate_checkpoint(cfg: Config, runtime: Runtime, source: Path, data_dirs: list[Path]) -> dict:
    """Every held-out split's loss, perplexity and bits per byte under the checkpoint `source`
    (collective: every rank of any layout calls it): `data_dirs`' validation splits, else each of
    the config's data sources apart. Whole splits, every sequence once. Writes nothing: the caller
    holds the lock of the run directory it writes the results into, and checkpoint.dir, which a
    live run may be writing, is left alone."""
    if cfg.train.objective != "lm":
        raise ConfigError(
            [
                f"strata eval scores the next-token loss, perplexity and bits per byte, which "
                f"train.objective={cfg.train.objective} does not train: the run's own evaluation "
                "(train.eval_interval) reports its mean pair loss; or export the model (strata "
                "ckpt export) and evaluate it on conversations with train.objective=lm"
            ]
        )
    trainer = Trainer(cfg, runtime, writes=[], saves=False)
    trainer.resume(source)
    if not data_dirs:
        data_dirs = [Path(s.path) for s in cfg.data.sources or ()] or [trainer.data_dir]
    results: dict[str, dict] = {}
    # the hang watchdog over the evaluation, as over the training loop (a collective to start)
    watch = next(hook for hook in trainer.hooks if isinstance(hook, HangWatch))
    with watch.running(print if runtime.rank == 0 else lambda line: None):
        splits = [_evaluate_split(trainer, data_dir) for data_dir in data_dirs]
    for data_dir, (dataset, found) in zip(data_dirs, splits):
        tokens = found.targets
        nats = found.loss * tokens
        spelt = target_bytes(data_dir, dataset) if runtime.rank == 0 else 0
        results[str(data_dir)] = {
            "loss": found.loss,
            "perplexity": found.perplexity,
            "bits_per_byte": nats / math.log(2) / spelt if spelt else None,
            "sequences": found.sequences,
            "tokens": tokens,
            "bytes": spelt,
        }
    return {"step": trainer.step, "checkpoint": str(source), "splits": results}


def _evaluate_split(trainer: Trainer, data_dir: Path) -> tuple[TokenDataset, Evaluation]:
    """The validation split of `data_dir` and the loss of the trainer's model over all of it."""
    cfg = trainer.cfg
    dataset = TokenDataset(data_dir, "val", cfg.model.seq_len, key="--data")
    found = evaluate(
        trainer.model,
        dataset,
        0,
        cfg.train.global_batch_size,
        cfg.train.micro_batch_size,
        trainer.topo,
    )
    return dataset, found


def rewrite_checkpoint(cfg: Config, runtime: Runtime, source: Path, out: Path) -> None:
    """Load checkpoint `source` into this layout and save it under `out`, without training (the
    workers of `strata ckpt reshard`)."""
    # `strata ckpt reshard` holds out's lock for its workers; the source run is only read
    trainer = Trainer(config_mod.replace(cfg, "checkpoint.dir", str(out)), runtime, writes=[])
    trainer.resume(source)
    saved = trainer.save()  # large weights raise DivergedError here, or at close below
    trainer.checkpoints.close()
    refused = trainer.checkpoints.take_refused()
    if refused is not None and refused[1].finite:
        limit = cfg.checkpoint.max_abs_weight
        raise CheckpointError(
            f"{source} holds a parameter of magnitude {refused[1].largest:.3g}, above "
            f"checkpoint.max_abs_weight={limit:g}; {out} not written (raise the limit if such "
            "weights are intended)"
        )
    if not saved or refused is not None:
        raise CheckpointError(
            f"{source} holds parameters or optimizer states that are not finite; {out} not written"
        )
