"""strata.trainer: the training loop and what it needs around it.

`loop` (the Trainer: set a run up, step, evaluate, log, save and resume), `parallelize` (one
function that lays the model out over the ranks and memory tiers and returns the one object the
loop drives), `state` (`TrainState`: what a checkpoint or an in-memory snapshot of a rank holds),
`data` (token files and the deterministic, resumable data-parallel loader), `metrics` (progress
bar, metrics.jsonl, wandb) and `plots` (run curves, pipeline schedule timelines).

The base modules every layer stands on (errors, config, model, atomic writes) sit in this
folder's `base/` but are the root package `strata` (`strata.config`, `strata.model`, ...), not
part of `strata.trainer`. This layer imports the base, `strata.parallel`, `strata.offload` and
`strata.checkpoint`; only `strata.launch` imports it.
"""
