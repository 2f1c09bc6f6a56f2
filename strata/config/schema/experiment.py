"""The whole experiment: `Config`, one field per group of keys, with the values derived from it
(data-parallel degree, accumulation steps, run and checkpoint directories), and `GROUPS`, the
groups by name in schema order.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

from strata.config.schema.fields import nested
from strata.config.schema.memory import ActivationsConfig, CO2Config, OffloadConfig, ZeroConfig
from strata.config.schema.model import ModelConfig
from strata.config.schema.parallel import ParallelConfig
from strata.config.schema.run import CheckpointConfig, DataConfig, LogConfig, SnapshotConfig
from strata.config.schema.train import OptimConfig, TrainConfig


@dataclass(frozen=True)
class Config:
    """A whole experiment."""

    model: ModelConfig = nested(ModelConfig)
    data: DataConfig = nested(DataConfig)
    train: TrainConfig = nested(TrainConfig)
    optim: OptimConfig = nested(OptimConfig)
    parallel: ParallelConfig = nested(ParallelConfig)
    zero: ZeroConfig = nested(ZeroConfig)
    co2: CO2Config = nested(CO2Config)
    offload: OffloadConfig = nested(OffloadConfig)
    activations: ActivationsConfig = nested(ActivationsConfig)
    checkpoint: CheckpointConfig = nested(CheckpointConfig)
    snapshot: SnapshotConfig = nested(SnapshotConfig)
    log: LogConfig = nested(LogConfig)

    # --- values derived from the config (and the world size) -------------------------------
    def dp_size(self, world_size: int) -> int:
        """Data-parallel degree in a world of `world_size` ranks."""
        return self.parallel.dp_size(world_size)

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches one data-parallel replica runs per optimizer step."""
        return self.train.global_batch_size // (
            self.train.micro_batch_size * self.dp_size(world_size)
        )

    def run_name(self) -> str:
        """The run's name: log.name, or "run"."""
        return self.log.name or "run"

    def run_dir(self) -> Path:
        """Where the run writes: <log.dir>/<run name>."""
        return Path(self.log.dir) / self.run_name()

    def checkpoint_dir(self) -> Path:
        """Where checkpoints go: checkpoint.dir, or <run dir>/checkpoints."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir() / "checkpoints"


GROUPS: dict[str, type] = {
    f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)
}
