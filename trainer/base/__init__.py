"""Strata: train large transformers from one YAML file, with composed tensor, pipeline and data
parallelism, ZeRO partitioning, memory tiers and resharding checkpoints.

This package's own modules are the base every other layer stands on and that imports nothing of
Strata's: `errors` (user errors), `config` (the experiment schema and its checks), `model` (the
plain transformer) and `atomic` (atomic file writes). The layers above are `strata.parallel`,
then `strata.offload` and `strata.checkpoint`, then `strata.trainer` (the loop), then
`strata.launch` (the command line and launchers); docs/ARCHITECTURE.md is the map.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("strata-train")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
