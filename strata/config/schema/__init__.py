"""The experiment schema: one frozen dataclass per group of keys, every key with its default, doc
string and range (`fields`), the whole experiment `Config` (`experiment`), and the schema as a tree
of dotted keys (`keys`). Building a config from YAML and checking it are `strata.config.loading` and
`strata.config.checks`; the layers above the config import what they need from here and from
`strata.config.vocabulary`.

| module | what |
| --- | --- |
| `fields` | `opt` and `nested`, the helpers every key and group is declared with |
| `model` | `model:` (`ModelConfig`) |
| `train` | `train:` and `optim:` (`TrainConfig`, `OptimConfig`) |
| `parallel` | `parallel:` (`ParallelConfig`) |
| `memory` | `zero:`, `co2:`, `offload:`, `activations:` |
| `run` | `data:`, `checkpoint:`, `snapshot:`, `log:` |
| `experiment` | `Config` and `GROUPS` |
| `keys` | dotted keys: walking the tree, `replace`, type names, plain values, unknown-key messages |
"""

from strata.config.schema.experiment import GROUPS, Config
from strata.config.schema.fields import nested, opt
from strata.config.schema.keys import replace
from strata.config.schema.memory import (
    ActivationsConfig,
    CO2Config,
    OffloadConfig,
    OptimOffloadConfig,
    ParamOffloadConfig,
    ShardSpec,
    ZeroConfig,
)
from strata.config.schema.model import LoraConfig, ModelConfig, MoEConfig
from strata.config.schema.parallel import ParallelConfig
from strata.config.schema.run import (
    CheckpointConfig,
    DataConfig,
    DataSource,
    LogConfig,
    SnapshotConfig,
)
from strata.config.schema.train import DpoConfig, OptimConfig, TrainConfig

__all__ = [
    "GROUPS",
    "ActivationsConfig",
    "CO2Config",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DataSource",
    "DpoConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "MoEConfig",
    "OffloadConfig",
    "OptimConfig",
    "OptimOffloadConfig",
    "ParallelConfig",
    "ParamOffloadConfig",
    "ShardSpec",
    "SnapshotConfig",
    "TrainConfig",
    "ZeroConfig",
    "nested",
    "opt",
    "replace",
]
