"""The groups around the training step: `data:` (a prepared directory, a mixture or the built-in
corpus), `checkpoint:`, `snapshot:` (in-memory, erasure-coded) and `log:` (run directory, metrics,
profiling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.config.schema.fields import opt


@dataclass(frozen=True)
class DataSource:
    """One dataset of a mixture (an item of data.sources)."""

    path: str = field(metadata={"doc": "directory made by `strata data prepare`"})
    weight: float = opt(
        1.0,
        "its share of the training samples, relative to the other sources' weights",
        min=0.0,
        min_exclusive=True,
    )


@dataclass(frozen=True)
class DataConfig:
    """Token data: a prepared directory (train.bin/val.bin + meta.json), a mixture, or the built-in corpus."""

    path: str | None = opt(
        None,
        "directory made by `strata data prepare` (null: the Python stdlib corpus, prepared "
        "on first use)",
    )
    sources: tuple[DataSource, ...] | None = opt(
        None,
        "a mixture instead of data.path (null: none): a list of {path, weight} (e.g. [{path: "
        "data/web, weight: 3}, "
        "{path: data/code, weight: 1}]); each step's samples go to the source furthest behind its "
        "share "
        "(weights normalised; Megatron's blended dataset), each source in its own seeded order, "
        "evaluation "
        "blends the val splits alike. All sources need the same tokenizer",
    )
    document_mask: bool = opt(
        False,
        "attend only inside each document packed into a sequence: the end-of-document token the "
        "data's meta.json "
        "records (`strata data prepare` writes it) ends one; the loss still counts every token "
        "(of conversations, every trained one). Conversations packed without it attend to each "
        "other (a warning at start-up)",
    )
    reset_positions: bool = opt(
        False,
        "restart the rotary positions at every document packed into a sequence (with or "
        "without document_mask)",
    )
    cache_dir: str | None = opt(
        None, "where the built-in corpus is prepared (null: $STRATA_CACHE or ~/.cache/strata)"
    )
    val_fraction: float = opt(
        0.05, "share of built-in corpus files held out for evaluation", min=0.0, max=0.5
    )
    tokenizer: str | None = opt(
        None,
        "the tokenizer data.path was prepared with (`strata data prepare --tokenizer`): bytes, "
        "bpe:N, or the path of a tokenizer.json or a model directory holding one; checked against "
        "the data's meta.json at start-up (a path by its content). null: whatever the data says. "
        "The built-in corpus is bytes",
    )

    def prepared_dir(self) -> str | None:
        """The prepared directory whose meta.json says the run's tokenizer: data.path, or the first of
        data.sources (a mixture's sources share one); None for the built-in corpus."""
        return self.sources[0].path if self.sources else self.path


@dataclass(frozen=True)
class CheckpointConfig:
    """Periodic checkpoints: every rank writes its own part (DCP's format), committed last with checksums."""

    dir: str | None = opt(None, "where checkpoints go (null: <run dir>/checkpoints)")
    interval: int = opt(0, "save every N steps (0: only at the end when `save_final`)", min=0)
    save_final: bool = opt(True, "save a checkpoint after the last step")
    keep_last: int = opt(
        2,
        "committed checkpoints to keep (0: keep all); the newest one saved before the loss-spike "
        "guard last "
        "fired is kept besides, so retention never leaves only checkpoints of a run that was "
        "diverging",
        min=0,
    )
    max_abs_weight: float = opt(
        1.0e4,
        "a save whose largest parameter magnitude exceeds this is refused and the run stops: "
        "finite weights that "
        "large mean the run diverged (trained transformers stay below ~1e3); 0: no check",
        min=0.0,
    )
    async_save: bool = opt(
        False,
        "save in the background: the step pays only for copying this rank's state into a "
        "shared-memory staging buffer, a writer process persists it while training goes on",
        key="async",
    )
    verify_on_load: bool = opt(True, "check the CRC-32C of every block a resume reads")
    overwrite: bool = opt(
        False,
        "start a new run in a checkpoint.dir that holds committed checkpoints, replacing them as "
        "new ones are saved (false: such a start is refused; continue that run with --resume DIR)",
    )
    on_disk_full: str = opt(
        "stop",
        "what a save that finds no room (ENOSPC, EDQUOT, EFBIG) does: stop (every rank raises an "
        "error naming "
        "the file and the bytes missing) or retry (warn, train on, and try again at the next "
        "checkpoint); "
        "either way the partial save is removed and the committed checkpoints stay as they were",
        choices=("stop", "retry"),
    )


@dataclass(frozen=True)
class SnapshotConfig:
    """In-memory snapshots kept by one agent process per node, erasure-coded across nodes; a restarted
    job resumes from the newest step every rank can restore, else from the newest disk checkpoint."""

    every_steps: int = opt(
        0,
        "snapshot the training state into host memory every N steps (0: off); needs the "
        "snapshot agents `strata launch` starts",
        min=0,
    )
    k: int = opt(1, "data fragments each rank's snapshot is cut into (Reed-Solomon)", min=1)
    m: int = opt(
        1,
        "parity fragments: the loss of up to m whole nodes is survivable; k + m fragments go to "
        "k + m different nodes (0: local snapshots only, surviving worker crashes)",
        min=0,
    )
    agent_timeout_s: float = opt(
        60.0,
        "how long a worker waits for its agent's reply before giving up",
        min=0.0,
        min_exclusive=True,
    )


@dataclass(frozen=True)
class LogConfig:
    """Where a run writes and what it reports."""

    dir: str = opt("runs", "parent directory of run directories")
    name: str | None = opt(None, "run name (null: the config file's stem)")
    interval: int = opt(10, "write a metrics line every N steps", min=1)
    progress: bool = opt(True, "show a progress bar on rank 0")
    wandb: bool = opt(
        False, "also log to Weights & Biases (offline unless WANDB_MODE says otherwise)"
    )
    wandb_project: str = opt("strata", "wandb project name")
    peak_tflops: float | None = opt(
        None,
        "per-device peak TFLOP/s for MFU (null: looked up from the GPU's name for bf16; on a CPU "
        "or an unknown "
        "GPU, MFU is not reported)",
        min=0.0,
        min_exclusive=True,
    )
    tensorboard: bool = opt(
        False, "also write the metrics as TensorBoard scalars to <run dir>/tensorboard (rank 0)"
    )
    profile_steps: tuple[int, ...] | None = opt(
        None,
        "[first, last]: record steps first..last (inclusive, 1 <= first <= last) with "
        "torch.profiler, a "
        "Chrome/Perfetto trace per rank in <run dir>/profile/rank<r>.json and, on CUDA, a memory "
        "snapshot "
        "(null: no profiling; on CUDA an out-of-memory error leaves a memory snapshot either way)",
        min=1,
        min_items=2,
        max_items=2,
    )
