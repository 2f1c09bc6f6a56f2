"""strata.plan: the `strata plan` model — predict each rank's memory (by kind and tier) and the step
time of a layout on a cluster, and search the layouts that fit for the fastest.

`cluster` describes the machines (GPUs, links, host memory), `shapes` derives sizes and FLOPs from
the config, `memory` and `timing` are the two models (`traffic` the bytes each link level carries
and their time; `engines` the training program timed, Strata's trainer or another framework whose
published runs check the model), `search` enumerates layouts and ranks those that fit,
`preflight` is the launcher's memory warning for this machine, and `report` prints the tables.
The measurement of this machine that `--calibrate` feeds in times the trainer's own step, so it
lives in the trainer layer (`strata.trainer.calibrate`); the `strata plan` command is in
`strata.launch`.

A layer beside `strata.checkpoint` and `strata.offload`: it imports only the base and
`strata.parallel`.
"""
