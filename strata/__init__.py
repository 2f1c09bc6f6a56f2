"""Strata: train large transformers from one YAML file, with composed tensor, pipeline and data
parallelism, ZeRO partitioning, memory tiers and resharding checkpoints.

This folder is the package `strata`; its own modules are the base every other layer stands on and
that imports nothing of Strata's: `errors` (user errors), `config` (the experiment schema and its
checks), `hf` (Hugging Face config.json and tensor names), `model` (the plain transformer), `lora`
(low-rank adapters on it and which parameters train), `moe`
(its Mixture-of-Experts feed-forward), `rope` (rotary positions and their scalings), `kv_cache`
(the keys and values decoding keeps), `atomic` (atomic file writes), `net` (a free port) and
`runlock` (one writer per run directory). The layers above are `strata.parallel`, then
`strata.offload`, `strata.checkpoint` and `strata.plan` (the planner), then `strata.trainer` (the
loop), then `strata.inference` (a trained model sampled in one process), then `strata.launch` (the
command line and launchers).
The subpackages `parallel`, `offload`, `checkpoint`, `trainer` and `launch` are symbolic links to
the repository's top-level folders of those names; docs/ARCHITECTURE.md is the map.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("strata-train")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
