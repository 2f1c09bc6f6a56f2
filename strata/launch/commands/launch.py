"""`strata launch`: check the job (config, data, earlier checkpoints, the planner's memory warning)
without importing torch, then start N workers under torchrun on this node, or write (and submit) a
Slurm job. The workers train, or with --eval evaluate a checkpoint (`strata eval` on every rank)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from strata.errors import StrataError
from strata.launch.commands.common import (
    EXIT_CODES,
    OVERRIDES,
    CommandHelp,
    file_errors,
    port,
    warn_memory,
    whole,
)

if TYPE_CHECKING:
    from strata.config import Config
    from strata.launch.torchrun import WorkerCommand


HELP = CommandHelp(
    "launch",
    summary="start N processes with torchrun, or write/submit a Slurm job",
    description="Start N processes with torchrun, or write (and submit) a Slurm job.",
    examples=(
        "strata launch configs/tiny.yaml --nproc 2",
        "strata launch configs/tiny.yaml parallel.tp=2 parallel.pp=2 --nproc 4",
        "strata launch configs/tiny.yaml --nproc 2 --max-restarts 3 snapshot.every_steps=1 "
        "snapshot.m=0",
        "strata launch configs/tiny.yaml --nnodes 2 --nproc 8 --rdzv-endpoint node0:29400 "
        "--net-ifname eth0",
        "strata launch configs/tiny.yaml --nnodes 2 --nproc 8 --node-rank 1 --master-addr node0",
        "strata launch configs/llama-1b.yaml --slurm --nodes 4 --gpus-per-node 8 --partition gpu",
        "strata launch configs/llama-1b.yaml --slurm --nodes 4 --net-ifname ib0 "
        "--sbatch-option cpus-per-task=16 --sbatch-option constraint=h100",
        "strata launch configs/tiny.yaml --nproc 4 parallel.tp=2 --eval --resume "
        "runs/tiny/checkpoints",
    ),
    extra=EXIT_CODES,
)


def add_arguments(la: argparse.ArgumentParser) -> None:
    """The config, its overrides, the evaluation's flags, then torchrun's and Slurm's."""
    la.add_argument("config", help="YAML experiment")
    la.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=OVERRIDES)
    la.add_argument("--resume", help="checkpoint directory the workers resume from")
    la.add_argument(
        "--eval",
        action="store_true",
        help="the workers evaluate the --resume checkpoint on held-out data (`strata eval` on "
        "every rank) instead of training",
    )
    la.add_argument(
        "--data", action="append", default=[], help="with --eval: a prepared directory (repeatable)"
    )
    la.add_argument("--out", help="with --eval: where the JSON goes (default: RUN_DIR/eval.json)")
    _add_torchrun_options(la)
    _add_slurm_options(la)


def _add_torchrun_options(la: argparse.ArgumentParser) -> None:
    """The options of a launch on this node under torchrun: processes, rendezvous, restarts."""
    la.add_argument("--nproc", type=whole(1), default=1, help="processes per node (local torchrun)")
    la.add_argument(
        "--nnodes", type=whole(1), default=1, help="nodes taking part in the local rendezvous"
    )
    la.add_argument(
        "--rdzv-endpoint",
        default="",
        help="host:port of the c10d rendezvous (default: a free local port)",
    )
    la.add_argument(
        "--rdzv-id", default="strata", help="rendezvous id: the same on every node of one job"
    )
    la.add_argument(
        "--rdzv-store",
        choices=["torchrun", "external"],
        default="torchrun",
        help="who hosts the rendezvous store: the first torchrun (losing that node ends the job), "
        "or `strata store` at --rdzv-endpoint (any node can be lost and replaced)",
    )
    la.add_argument(
        "--max-restarts",
        type=whole(0),
        default=0,
        help="times torchrun restarts the workers after a failure (they resume from the newest "
        "in-memory snapshot with snapshot.every_steps, else the newest checkpoint)",
    )
    la.add_argument(
        "--join-timeout",
        type=whole(1),
        default=600,
        help="seconds a rendezvous waits for every node (after a loss: for the replacement)",
    )
    la.add_argument(
        "--node-rank",
        type=whole(0),
        help="static rendezvous: this node's rank, 0..nnodes-1 (with --master-addr; no "
        "--rdzv-endpoint)",
    )
    la.add_argument(
        "--master-addr",
        default="",
        help="static rendezvous: the address of the node with --node-rank 0",
    )
    la.add_argument(
        "--master-port",
        type=port,
        help="static rendezvous: the port node 0's store listens on (default 29500)",
    )
    la.add_argument(
        "--net-ifname",
        default="",
        metavar="IF",
        help="the network interface the workers talk over (sets GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME; its address is the one other nodes reach this node at)",
    )
    la.add_argument(
        "--worker-start",
        choices=["forkserver", "fresh"],
        default="forkserver",
        help="how torchrun starts each worker, the first ones and every restart: forked from a "
        "per-node process that has imported torch and Strata once (a restart takes milliseconds, "
        "not seconds of imports), or a fresh Python each (plain torchrun); see "
        "docs/FAULT_TOLERANCE.md",
    )


def _add_slurm_options(la: argparse.ArgumentParser) -> None:
    """The options of a Slurm job: its script, nodes and queue."""
    la.add_argument(
        "--slurm",
        action="store_true",
        help="write an sbatch script (and submit it if sbatch exists)",
    )
    la.add_argument("--nodes", type=whole(1), default=1, help="Slurm nodes")
    la.add_argument(
        "--gpus-per-node", type=whole(1), default=8, help="Slurm GPUs (= processes) per node"
    )
    la.add_argument("--partition", default="", help="Slurm partition")
    la.add_argument("--account", default="", help="Slurm account")
    la.add_argument("--time", default="01:00:00", help="Slurm time limit")
    la.add_argument(
        "--sbatch-option",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="one more #SBATCH --KEY=VALUE line (--KEY for a flag) in the job script, "
        "repeatable: e.g. cpus-per-task=16, exclusive, constraint=h100; refused for the options "
        "Strata writes itself (nodes, gpus-per-node, output, ...)",
    )
    la.add_argument(
        "--script", help="where to write the sbatch script (default: <run dir>/job.sbatch)"
    )
    la.add_argument("--no-submit", action="store_true", help="only write the script")


def run(args: argparse.Namespace) -> int:
    """Launch the job: torchrun's exit code (or 128 + a signal), or sbatch's."""
    if (args.data or args.out) and not args.eval:
        raise StrataError(
            "--data and --out belong to an evaluation: add --eval (and --resume CKPT)"
        )
    if args.eval and not args.resume:
        raise StrataError("--eval evaluates a checkpoint: give it with --resume CKPT")
    return _run_slurm(args) if args.slurm else _run_torchrun(args)


def _worker(args: argparse.Namespace, config_path: str) -> WorkerCommand:
    """What each worker runs: `strata train`, or `strata eval` with its flags."""
    from strata.launch.torchrun import WorkerCommand

    extra: list[str] = []
    if args.eval:
        extra = [f for d in args.data for f in ("--data", str(Path(d).resolve()))]
        extra += ["--out", str(Path(args.out).resolve())] if args.out else []
    command = "eval" if args.eval else "train"
    return WorkerCommand(config_path, tuple(args.overrides), args.resume, tuple(extra), command)


def _run_slurm(args: argparse.Namespace) -> int:
    """Write the sbatch script, and submit it unless --no-submit."""
    from strata.launch import slurm

    options = slurm.sbatch_options(args.sbatch_option)
    cfg = _checked_config(args, args.nodes, args.gpus_per_node)
    warn_memory(cfg, args.nodes, args.gpus_per_node)
    job = slurm.SlurmJob(
        name=cfg.run_name(),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        account=args.account,
        time=args.time,
        max_restarts=args.max_restarts,
        snapshots=cfg.snapshot.every_steps > 0 and not args.eval,
        net_ifname=args.net_ifname,
        sbatch_options=options,
    )
    script = slurm.sbatch_script(
        job, _worker(args, str(Path(args.config).resolve())), workdir=str(Path.cwd())
    )
    path = Path(args.script or cfg.run_dir() / "job.sbatch")
    with file_errors("strata launch --slurm"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script)
    print(f"strata launch: wrote {path}")
    return 0 if args.no_submit else slurm.submit(path)


def _run_torchrun(args: argparse.Namespace) -> int:
    """Check everything the workers would refuse, then run torchrun on this node."""
    from strata import config
    from strata.launch import torchrun

    # fail before starting workers
    cfg = _checked_config(args, args.nnodes, args.nproc)
    problem = config.snapshot_nodes_problem(cfg.snapshot, args.nnodes)
    if problem:
        raise StrataError(problem)
    _check_data(cfg, [Path(d) for d in args.data])
    if args.eval:  # the run directory its results go into, held by a live run: refused now
        from strata.launch.commands.eval import check_run_free

        check_run_free(cfg)
    # A node that joins a running job of several nodes (a replacement) finds that job's own lock
    # held: there, only the workers' own lock refuses a second job.
    _check_checkpoints(cfg, args.resume, locks=not args.eval and args.nnodes == 1)
    warn_memory(cfg, args.nnodes, args.nproc)
    plan = torchrun.LaunchPlan(
        nproc_per_node=args.nproc,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        external_store=args.rdzv_store == "external",
        join_timeout_s=args.join_timeout,
        snapshots=cfg.snapshot.every_steps > 0 and not args.eval,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        net_ifname=args.net_ifname,
        worker_start=args.worker_start,
    )
    return torchrun.run_local(plan, _worker(args, args.config))


def _check_data(cfg: Config, eval_dirs: list[Path]) -> None:
    """The data directory's problems (or those of the directories an evaluation reads), before any
    worker starts (each worker would hit them alone)."""
    from strata.data.mixture import open_mixture
    from strata.data.tokens import TokenDataset, check_data_config, check_data_dir

    for d in eval_dirs:  # an evaluation reads only the validation split
        check_data_config(d, cfg)
        TokenDataset(d, "val", cfg.model.seq_len)
    if eval_dirs:
        return
    if cfg.data.path:
        check_data_dir(Path(cfg.data.path), cfg.model.seq_len, cfg)
    elif cfg.data.sources:
        open_mixture(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)


def _check_checkpoints(cfg: Config, resume: str | None, locks: bool = True) -> None:
    """What the workers' start would refuse about checkpoints, before they start: the run directory
    or checkpoint.dir locked by a job still writing it (with `locks`), a --resume without
    a committed checkpoint, or a new run (no --resume, no snapshots to recover) in a checkpoint.dir
    holding an earlier run's committed checkpoints without checkpoint.overwrite."""
    from strata.checkpoint import store
    from strata.runlock import check_free

    # a job writing this run already: refused now, rather than by every worker once started
    if locks:
        check_free([(cfg.run_dir(), "run directory"), (cfg.checkpoint_dir(), "checkpoint.dir")])
    if resume and not store.is_dcp_only(Path(resume)):
        # a damaged commit marker: one error, before any worker
        store.marker(store.resolve(Path(resume)))
        return
    root = cfg.checkpoint_dir()
    found = [p.name for p in store.committed(root)]
    if found and not cfg.checkpoint.overwrite and not cfg.snapshot.every_steps:
        raise store.earlier_run_error(root, found)


def _checked_config(args: argparse.Namespace, nodes: int, per_node: int) -> Config:
    """The config loaded and checked for `nodes` nodes of `per_node` ranks, and trainable: every
    problem refused here, before a worker or a job starts."""
    from strata import config

    cfg = config.load(
        args.config, args.overrides, world_size=nodes * per_node, local_world_size=per_node
    )
    config.check_trainable(cfg)
    return cfg
