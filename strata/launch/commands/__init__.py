"""strata.launch.commands: one module per `strata` command, each with `HELP` (its help texts: the
summary, description, usage lines and examples, a `common.CommandHelp`), `add_arguments(parser)`
(its positionals and options) and `run(args)` (what it does; the exit code).

`train` (train in this process or as a torchrun worker), `launch` (torchrun or Slurm), `store` (a
standalone rendezvous store), `config` (show, explain), `plan` (memory and step time of a layout;
search), `data` (prepare token files), `ckpt` (inspect, verify, reshard, export, import), `eval` (a
checkpoint's loss on held-out data), `generate` (continue prompts with a trained model) and `plot`
(run curves, pipeline schedules); `common` holds what several of them share. `COMMANDS` lists them
in the order `strata --help` does; `strata.launch.cli` builds the top-level parser and each
command's parser from them, and dispatches. (The fork server preloads this package: everything the
CLI imports but itself.)

A command module imports only the standard library and light Strata modules at its top: torch,
the config and the trainer are imported inside `run`, so that `strata launch` checks a job without
importing torch before torchrun starts.
"""

from strata.launch.commands import (
    ckpt,
    config,
    data,
    eval,
    generate,
    launch,
    plan,
    plot,
    store,
    train,
)

# The commands in the order `strata --help` lists them.
COMMANDS = (train, launch, store, config, plan, data, ckpt, eval, generate, plot)
