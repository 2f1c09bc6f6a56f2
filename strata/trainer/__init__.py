"""strata.trainer: the training loop and what it needs around it.

`loop` (the Trainer: set a run up, step, evaluate, log and save), `hooks` (what the loop calls around
each step: `StepHook`, and the hang watchdog's part), `start` (where a run starts: a snapshot, a
checkpoint of any layout, initial weights), `jobs` (what a worker runs: train, evaluate a checkpoint,
rewrite a checkpoint), `datasets` (the splits a run trains and evaluates on), `signals` (stopping on
a signal with a checkpoint, exit 75), `lr_schedule` (warm-up and decay), `parallelize` (one
function that lays the model out over the ranks and memory tiers and returns the one object the loop
drives), `objective` (what a step's objective other than the next-token loss provides),
`preference` (DPO on preference pairs), `evaluate` (the validation loss over a split's evaluation batches), `state`
(`TrainState`: what a checkpoint or an in-memory snapshot of a rank holds), `metrics`
(progress bar, metrics.jsonl, TensorBoard, wandb), `plots` (run curves, pipeline schedule
timelines), `divergence` (the loss-spike guard), `routing` (MoE routing statistics
and the auxiliary-loss-free bias update), `compile` (regional compilation), `float8` (float8
linear layers), `calibrate` (the planner's measurement of this machine, timing the trainer's own
step) and `profiling`
(torch.profiler traces, memory snapshots).

This layer imports the base (`strata`), `strata.parallel`, `strata.offload`, `strata.checkpoint`,
`strata.plan` and `strata.data`; `strata.inference` and `strata.launch` import it.
"""

# imported by the top-level link's name, e.g. from the repository root
if __name__ != "strata.trainer":
    raise ImportError(
        f"import strata.trainer, not {__name__}: the folder trainer/ links to strata/trainer/"
    )
