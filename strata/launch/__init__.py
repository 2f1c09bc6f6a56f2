"""strata.launch: the top layer, what a user starts.

`cli` (the `strata` command: the top-level parser and the dispatch) and `commands` (one module per
`strata` command: its parser and what it does), `torchrun` (local multi-process launch with c10d
rendezvous, the node's snapshot agent beside it, and a standalone rendezvous store), `supervisor`
(the launcher's hold on torchrun and its workers: signals, stops, what each worker noted),
`elastic` and `forkserver` (torchrun whose workers are forks of a per-node process that imported
torch and Strata once), `slurm` (sbatch scripts), `reshard` (`strata ckpt reshard`: starts the
target world) and `snapshot_agent` (one process per node keeping the in-memory snapshots).

It may import every other layer; nothing imports it.
"""

# imported by the top-level link's name, e.g. from the repository root
if __name__ != "strata.launch":
    raise ImportError(
        f"import strata.launch, not {__name__}: the folder launch/ links to strata/launch/"
    )
