"""The `strata` command: train, launch (torchrun / Slurm), store (a standalone rendezvous store), config
show/explain, plan (memory and step time of a layout; search), data prepare, ckpt (inspect, verify,
reshard, export, import), plot (run curves or a pipeline schedule timeline).

A command's options and key=value overrides come in any order. Exit codes: 0 done; 2 a user error
(StrataError, or argparse's usage error), printed as one message without a traceback; 75 stopped
by a signal after saving a checkpoint (`train`, and `launch` when every worker did); anything else
a failure (1 when `ckpt verify` or `ckpt inspect` finds damage, or `plan` finds the layout does
not fit; `launch` passes on torchrun's code, or 128 + the signal that stopped it)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from strata import __version__
from strata.errors import StrataError
from strata.launch import plan_cli

if TYPE_CHECKING:
    from strata.config import Config


def _whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= minimum (argparse names the flag and exits 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    value = _whole(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def cmd_train(args: argparse.Namespace) -> int:
    from strata import config
    from strata.launch.torchrun import note_worker_status
    from strata.parallel import runtime
    from strata.trainer.loop import Preempted, rewrite_checkpoint, run

    cfg = config.load(args.config, args.overrides, world_size=runtime.world_size_from_env())
    config.check_trainable(cfg)
    rt = runtime.start(cfg.parallel.backend, cfg.parallel.timeout_s)
    note_worker_status("running")  # under `strata launch`: this attempt's worker started
    try:
        if args.save_to:
            if not args.resume:
                raise StrataError("strata train --save-to OUT needs --resume DIR (the checkpoint to rewrite)")
            rewrite_checkpoint(cfg, rt, Path(args.resume), Path(args.save_to))
        else:
            run(cfg, rt, Path(args.resume) if args.resume else None)
    except BaseException as e:
        runtime.stop(wait_for_peers=False)  # they may never arrive: fail fast, torchrun stops the rest
        if isinstance(e, Preempted):  # saved and stopped: tell `strata launch`, which torchrun does not
            note_worker_status(str(e.code))
        raise
    runtime.stop()
    return 0


def _check_data(cfg: Config) -> None:
    """The data directory's problems, before any worker starts (each worker would hit them alone)."""
    from strata.trainer.data import check_data_dir, open_mixture

    if cfg.data.path:
        check_data_dir(Path(cfg.data.path), cfg.model.seq_len, cfg)
    elif cfg.data.sources:
        open_mixture(cfg.data, cfg.model.seq_len, cfg.model.vocab_size)


def _check_checkpoints(cfg: Config, resume: str | None) -> None:
    """What the workers' start would refuse about checkpoints, before they start: a --resume without
    a committed checkpoint, or a new run (no --resume, no snapshots to recover) in a checkpoint.dir
    holding an earlier run's committed checkpoints without checkpoint.overwrite."""
    from strata.checkpoint import store

    if resume and not store.is_dcp_only(Path(resume)):
        store.marker(store.resolve(Path(resume)))  # a damaged commit marker: one error, before any worker
        return
    root = cfg.checkpoint_dir()
    found = [p.name for p in store.committed(root)]
    if found and not cfg.checkpoint.overwrite and not cfg.snapshot.every_steps:
        raise store.earlier_run_error(root, found)


def cmd_launch(args: argparse.Namespace) -> int:
    from strata import config
    from strata.launch import slurm, torchrun

    if args.slurm:
        cfg = config.load(args.config, args.overrides, world_size=args.nodes * args.gpus_per_node)
        config.check_trainable(cfg)
        _warn_memory(cfg, args.nodes, args.gpus_per_node)
        job = slurm.SlurmJob(
            name=cfg.run_name(),
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            partition=args.partition,
            account=args.account,
            time=args.time,
            max_restarts=args.max_restarts,
            snapshots=cfg.snapshot.every_steps > 0,
        )
        script = slurm.sbatch_script(
            job, str(Path(args.config).resolve()), args.overrides, args.resume, workdir=str(Path.cwd())
        )
        path = Path(args.script or cfg.run_dir() / "job.sbatch")
        with _file_errors("strata launch --slurm"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(script)
        print(f"strata launch: wrote {path}")
        return 0 if args.no_submit else slurm.submit(path)
    cfg = config.load(args.config, args.overrides, world_size=args.nproc * args.nnodes)  # fail before starting workers
    config.check_trainable(cfg)
    problem = config.snapshot_nodes_problem(cfg.snapshot, args.nnodes)
    if problem:
        raise StrataError(problem)
    _check_data(cfg)
    _check_checkpoints(cfg, args.resume)
    _warn_memory(cfg, args.nnodes, args.nproc)
    plan = torchrun.LaunchPlan(
        nproc_per_node=args.nproc,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        external_store=args.rdzv_store == "external",
        join_timeout_s=args.join_timeout,
        snapshots=cfg.snapshot.every_steps > 0,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        net_ifname=args.net_ifname,
        worker_start=args.worker_start,
    )
    return torchrun.run_local(plan, args.config, args.overrides, args.resume)


def _warn_memory(cfg: Config, nodes: int, ranks_per_node: int) -> None:
    """Say before starting when the planner predicts a rank will not fit this machine."""
    from strata.plan.preflight import memory_warning
    from strata.trainer.data import planned_vocab

    warning = memory_warning(cfg, nodes, ranks_per_node, planned_vocab(cfg))
    if warning:
        print(f"strata: warning: {warning}", file=sys.stderr)


def cmd_store(args: argparse.Namespace) -> int:
    from strata.launch.torchrun import serve_store

    serve_store(args.host, args.port)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from strata import config

    if args.action == "show":
        cfg = config.load(args.target, args.overrides, world_size=args.world_size)
        print(config.dump(cfg), end="")
        if args.world_size:
            _warn_memory(cfg, 1, args.world_size)
    else:
        print(config.explain(args.target))
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    import sysconfig

    from strata.trainer import prepare

    root: Path | None
    if args.stdlib:
        files, root = prepare.stdlib_corpus_files(), Path(sysconfig.get_paths()["stdlib"])
        prepare.check_output_outside_inputs(Path(args.out), [root])
    else:
        if not args.inputs:
            raise StrataError("strata data prepare: give input files/directories, or --stdlib for the built-in corpus")
        files, root = prepare.expand_inputs(args.inputs, args.glob, out_dir=Path(args.out))
    with _file_errors("strata data prepare"):
        meta = prepare.prepare(
            files,
            Path(args.out),
            args.val_fraction,
            root=root,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            workers=args.workers,
            eot_token=args.eot_token,
            progress=True,
        )
    tok = meta["tokenizer"]
    print(
        f"wrote {args.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
        f"from {meta['documents']:,} documents in {meta['files']:,} files ({meta['dtype']}, "
        f"vocab {meta['vocab_size']}, tokenizer {tok['source']}, end of document {tok['eot_token']} = {meta['eot']})"
    )
    return 0


def cmd_ckpt(args: argparse.Namespace) -> int:
    from strata.checkpoint import export, inspect

    if args.action in ("inspect", "verify") and (args.out or args.overrides):
        raise StrataError(
            f"strata ckpt {args.action} DIR takes one directory; "
            f"unexpected: {' '.join(filter(None, [args.out, *args.overrides]))}"
        )
    if args.out and "=" in args.out and not Path(args.out).exists():
        raise StrataError(f"strata ckpt {args.action}: OUT comes before the overrides; {args.out!r} looks like one")
    if args.action == "import-hf":
        from strata import config
        from strata.checkpoint import hf_weights

        if not args.out:
            raise StrataError("strata ckpt import-hf HF_DIR OUT [--config CFG]: give OUT (a checkpoints directory)")
        cfg = config.load(args.config, [*args.overrides, f"model.init_from={args.path}"])
        path = hf_weights.import_hf(Path(args.path), Path(args.out), config.dump(cfg), cfg.model)
        print(
            f"wrote {path} (step 0, weights only); train from it with --resume {path} (the optimizer starts fresh) "
            f"or model.init_from={path}"
        )
        return 0
    if args.action == "import-deepspeed":
        from strata import config
        from strata.checkpoint import deepspeed_import

        if not args.out or not args.config:
            raise StrataError(
                "strata ckpt import-deepspeed DS_DIR OUT --config CFG: give OUT (a checkpoints "
                "directory) and the Strata config to continue with"
            )
        cfg = config.load(args.config, args.overrides)
        aliases = {"output.weight": "tok_embeddings.weight"} if cfg.model.tie_embeddings else None
        path = deepspeed_import.import_checkpoint(Path(args.path), Path(args.out), config.dump(cfg), aliases)
        print(f"wrote {path}; continue with: strata train {args.config} ... --resume {path}")
        return 0
    if args.action == "reshard":
        from strata.launch import reshard

        if not args.out or not args.to:
            raise StrataError(
                "strata ckpt reshard DIR OUT --to tp=..,pp=..,dp=..: give OUT (a checkpoints directory) "
                "and the target layout"
            )
        return reshard.reshard(Path(args.path), Path(args.out), args.to, args.overrides)
    if args.action == "export":
        if not args.out:
            raise StrataError("strata ckpt export DIR OUT: give OUT, a .safetensors file or a directory")
        weights, config_file = export.export(Path(args.path), Path(args.out), args.format, args.overwrite)
        print(f"wrote {weights} and {config_file}")
        return 0
    if args.action == "verify":
        ok, report = inspect.verify_report(Path(args.path))
        print(report)
        return 0 if ok else 1
    ok, report = inspect.inspect_report(Path(args.path))
    print(report)
    return 0 if ok else 1


@contextlib.contextmanager
def _file_errors(command: str) -> Iterator[None]:
    """An OSError on a path the user named (a missing directory, a name too long, no permission) as a
    StrataError naming the path."""
    try:
        yield
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        raise StrataError(
            f"{command}: cannot write or read{where}: {e.strerror or e}; check that the path exists and is writable"
        ) from e


def cmd_plot(args: argparse.Namespace) -> int:
    from strata.trainer.plots import plot_run, plot_schedule

    out = Path(args.out) if args.out else None
    if args.record is None:  # strata plot RUN_DIR
        with _file_errors("strata plot"):
            print(f"wrote {plot_run(Path(args.run_dir), out)}")
    elif args.run_dir == "schedule":  # strata plot schedule RECORD.json
        with _file_errors("strata plot schedule"):
            print(f"wrote {plot_schedule(Path(args.record), out)}")
    else:
        raise StrataError(
            f"strata plot: unexpected second argument {args.record!r}; use `strata plot RUN_DIR` "
            "or `strata plot schedule RECORD.json`"
        )
    return 0


EXIT_CODES = """\
exit codes:
  0      done
  2      user error: a bad config, override or argument (one message, no traceback)
  75     stopped by a signal (SIGTERM, SIGINT, SIGUSR1) after saving a checkpoint: resume with
         --resume (`strata train`; `strata launch` when every worker saved and stopped)
  128+N  `strata launch` stopped by signal N without every worker saving (e.g. a second signal
         killed them; 130 SIGINT, 143 SIGTERM)
  other  failure: 1 e.g. when `strata ckpt verify` or `inspect` finds damage, or `strata plan`
         finds the layout does not fit; `strata launch`
         exits with torchrun's code, e.g. a crashed worker's"""

OVERRIDES = "key=value overrides of the config (e.g. train.steps=100), before or after the options"


def _epilog(*examples: str, extra: str = "") -> str:
    """The text under a command's options: examples, then what else it needs to say."""
    text = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return text + (f"\n\n{extra}" if extra else "")


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `strata` parser and its commands' parsers, by name."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="strata",
        formatter_class=fmt,
        description="Train transformer models from one YAML experiment.\n\n"
        "Options and key=value overrides mix freely: options anywhere after the command,\n"
        "overrides after its other positional arguments (such as the config file).\n"
        "`strata COMMAND --help` shows a command's options and examples.",
        epilog=_epilog(
            "strata train configs/tiny.yaml train.steps=100",
            "strata launch configs/tiny.yaml --nproc 2",
            "strata config show configs/llama2-7b-3d.yaml --world-size 32",
            "strata ckpt verify runs/tiny/checkpoints",
            extra=EXIT_CODES,
        ),
    )
    p.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser(
        "train",
        help="train in this process (or as one torchrun worker)",
        formatter_class=fmt,
        description="Train in this process (or as one torchrun worker).",
        epilog=_epilog(
            "strata train configs/tiny.yaml",
            "strata train configs/tiny.yaml train.steps=100 log.name=short",
            "strata train configs/tiny.yaml --resume runs/tiny/checkpoints train.steps=1000",
            extra=EXIT_CODES,
        ),
    )
    t.add_argument("config", help="YAML experiment, e.g. configs/tiny.yaml")
    t.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=OVERRIDES)
    t.add_argument("--resume", help="checkpoint directory (a step_* dir, or a checkpoints dir: latest committed)")
    t.add_argument(
        "--save-to",
        metavar="OUT",
        help="do not train: load --resume into this layout and save it under OUT (what `strata ckpt reshard` runs)",
    )
    t.set_defaults(func=cmd_train)

    la = sub.add_parser(
        "launch",
        help="start N processes with torchrun, or write/submit a Slurm job",
        formatter_class=fmt,
        description="Start N processes with torchrun, or write (and submit) a Slurm job.",
        epilog=_epilog(
            "strata launch configs/tiny.yaml --nproc 2",
            "strata launch configs/tiny.yaml parallel.tp=2 parallel.pp=2 --nproc 4",
            "strata launch configs/tiny.yaml --nproc 2 --max-restarts 3 snapshot.every_steps=1 snapshot.m=0",
            "strata launch configs/tiny.yaml --nnodes 2 --nproc 8 --rdzv-endpoint node0:29400 --net-ifname eth0",
            "strata launch configs/tiny.yaml --nnodes 2 --nproc 8 --node-rank 1 --master-addr node0",
            "strata launch configs/llama-1b.yaml --slurm --nodes 4 --gpus-per-node 8 --partition gpu",
            extra=EXIT_CODES,
        ),
    )
    la.add_argument("config", help="YAML experiment")
    la.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=OVERRIDES)
    la.add_argument("--resume", help="checkpoint directory the workers resume from")
    la.add_argument("--nproc", type=_whole(1), default=1, help="processes per node (local torchrun)")
    la.add_argument("--nnodes", type=_whole(1), default=1, help="nodes taking part in the local rendezvous")
    la.add_argument("--rdzv-endpoint", default="", help="host:port of the c10d rendezvous (default: a free local port)")
    la.add_argument("--rdzv-id", default="strata", help="rendezvous id: the same on every node of one job")
    la.add_argument(
        "--rdzv-store",
        choices=["torchrun", "external"],
        default="torchrun",
        help="who hosts the rendezvous store: the first torchrun (losing that node ends the job), or "
        "`strata store` at --rdzv-endpoint (any node can be lost and replaced)",
    )
    la.add_argument(
        "--max-restarts",
        type=_whole(0),
        default=0,
        help="times torchrun restarts the workers after a failure (they resume from the newest "
        "in-memory snapshot with snapshot.every_steps, else the newest checkpoint)",
    )
    la.add_argument(
        "--join-timeout",
        type=_whole(1),
        default=600,
        help="seconds a rendezvous waits for every node (after a loss: for the replacement)",
    )
    la.add_argument(
        "--node-rank",
        type=_whole(0),
        help="static rendezvous: this node's rank, 0..nnodes-1 (with --master-addr; no --rdzv-endpoint)",
    )
    la.add_argument("--master-addr", default="", help="static rendezvous: the address of the node with --node-rank 0")
    la.add_argument(
        "--master-port", type=_port, help="static rendezvous: the port node 0's store listens on (default 29500)"
    )
    la.add_argument(
        "--net-ifname",
        default="",
        metavar="IF",
        help="the network interface the workers talk over (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; "
        "its address is the one other nodes reach this node at)",
    )
    la.add_argument(
        "--worker-start",
        choices=["forkserver", "fresh"],
        default="forkserver",
        help="how torchrun starts each worker, the first ones and every restart: forked from a per-node process "
        "that has imported torch and Strata once (a restart takes milliseconds, not seconds of imports), or a "
        "fresh Python each (plain torchrun); see docs/FAULT_TOLERANCE.md",
    )
    la.add_argument("--slurm", action="store_true", help="write an sbatch script (and submit it if sbatch exists)")
    la.add_argument("--nodes", type=_whole(1), default=1, help="Slurm nodes")
    la.add_argument("--gpus-per-node", type=_whole(1), default=8, help="Slurm GPUs (= processes) per node")
    la.add_argument("--partition", default="", help="Slurm partition")
    la.add_argument("--account", default="", help="Slurm account")
    la.add_argument("--time", default="01:00:00", help="Slurm time limit")
    la.add_argument("--script", help="where to write the sbatch script (default: <run dir>/job.sbatch)")
    la.add_argument("--no-submit", action="store_true", help="only write the script")
    la.set_defaults(func=cmd_launch)

    st = sub.add_parser(
        "store",
        help="host the c10d rendezvous store of a multi-node job outside every torchrun",
        formatter_class=fmt,
        description="Host the c10d rendezvous store of a multi-node job outside every torchrun, "
        "so any node can be lost\nand replaced; start each node with "
        "`strata launch ... --rdzv-store external --rdzv-endpoint HOST:PORT`.",
        epilog=_epilog(
            "strata store --port 29400",
            "strata launch configs/tiny.yaml --nnodes 2 --nproc 8 --rdzv-store external "
            "--rdzv-endpoint store-host:29400   # on each node",
        ),
    )
    st.add_argument("--host", default="0.0.0.0", help="address to listen on")
    st.add_argument("--port", type=_port, required=True, help="port to listen on")
    st.set_defaults(func=cmd_store)

    c = sub.add_parser(
        "config",
        help="show a resolved config or explain a key",
        formatter_class=fmt,
        usage="strata config show CFG [key=value ...] [--world-size N]\n       strata config explain KEY",
        description="Show a resolved, validated config, or explain a key or group.",
        epilog=_epilog(
            "strata config show configs/tiny.yaml optim.lr=1e-4",
            "strata config show configs/llama2-7b-3d.yaml --world-size 32",
            "strata config explain optim.lr",
            "strata config explain optim",
        ),
    )
    c.add_argument("action", choices=["show", "explain"])
    c.add_argument("target", help="config file (show) or key such as optim.lr (explain)")
    c.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="show: " + OVERRIDES)
    c.add_argument("--world-size", type=_whole(1), help="also check the layout against this many processes")
    c.set_defaults(func=cmd_config)

    plan_cli.add_parser(sub, fmt, _epilog, _whole)

    d = sub.add_parser(
        "data",
        help="prepare token files",
        formatter_class=fmt,
        description="Tokenize text files, JSON Lines (.jsonl, one object per line) and Parquet (.parquet) into "
        "train.bin, val.bin and meta.json (plus tokenizer.json for a tokenizer other than bytes), in parallel worker "
        "processes; each document is followed by the tokenizer's end-of-document token. A text file is one "
        "document and goes wholly to train or val by a hash of its path; a JSON Lines or Parquet document goes by "
        "a hash of (path, line or row number).",
        epilog=_epilog(
            "strata data prepare ~/books --glob '*.txt' --out data/books",
            "strata data prepare corpus.jsonl --text-field content --tokenizer bpe:32000 --out data/c",
            "strata data prepare shards/ --glob '*.parquet' --tokenizer ~/models/Llama-3.2-1B --out data/l",
            "strata data prepare --stdlib --out data/stdlib",
            "strata train configs/tiny.yaml data.path=data/books",
        ),
    )
    d.add_argument("action", choices=["prepare"])
    d.add_argument("inputs", nargs="*", help="text, .jsonl/.ndjson or .parquet files, or directories")
    d.add_argument(
        "--out",
        required=True,
        help="output directory (train.bin, val.bin, meta.json, tokenizer.json): new, empty, or an earlier output "
        "(which is replaced); never inside an input directory",
    )
    d.add_argument("--glob", default="*", help="file pattern inside input directories (e.g. '*.txt')")
    d.add_argument("--val-fraction", type=_fraction, default=0.05, help="share of documents held out for evaluation")
    d.add_argument("--stdlib", action="store_true", help="use the Python standard library sources as the corpus")
    d.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (UTF-8 bytes, 257 ids), the path of a tokenizer.json or of a Hugging Face model directory "
        "holding one, or bpe:N (train a byte-level BPE of N ids on the inputs, saved as OUT/tokenizer.json)",
    )
    d.add_argument(
        "--text-field", default="text", help="the JSON field (.jsonl) or column (.parquet) holding each document"
    )
    d.add_argument(
        "--eot-token",
        help="the tokenizer.json's end-of-document token (default: the model directory's eos_token, else the "
        "first of <|endoftext|>, <|end_of_text|>, </s>, <eos> it has)",
    )
    d.add_argument("--workers", type=_whole(1), help="tokenizing processes (default: one per CPU)")
    d.set_defaults(func=cmd_data)

    ck = sub.add_parser(
        "ckpt",
        help="inspect, verify, reshard, export or import a checkpoint",
        formatter_class=fmt,
        usage="strata ckpt inspect DIR\n       strata ckpt verify DIR\n"
        "       strata ckpt reshard DIR OUT --to tp=..,pp=..,dp=..[,vs=..] [key=value ...]\n"
        "       strata ckpt export DIR OUT [--format safetensors|hf] [--overwrite]\n"
        "       strata ckpt import-deepspeed DS_DIR OUT [key=value ...] --config CFG\n"
        "       strata ckpt import-hf HF_DIR OUT [key=value ...] [--config CFG]",
        description="Inspect, verify, reshard, export or import a checkpoint.",
        epilog=_epilog(
            "strata ckpt inspect runs/tiny/checkpoints",
            "strata ckpt verify runs/tiny/checkpoints/step_00000500   # exit 1 if damaged",
            "strata ckpt reshard runs/tiny/checkpoints resharded --to tp=2,pp=1,dp=1",
            "strata ckpt export runs/tiny/checkpoints tiny.safetensors",
            "strata ckpt import-deepspeed ds_ckpt/ imported/ --config configs/tiny.yaml",
            extra=EXIT_CODES,
        ),
    )
    ck.add_argument("action", choices=["inspect", "verify", "reshard", "export", "import-deepspeed", "import-hf"])
    ck.add_argument("path", metavar="DIR", help="a step_* directory, or a checkpoints directory (latest committed)")
    ck.add_argument(
        "out",
        nargs="?",
        metavar="OUT",
        help="reshard: a checkpoints directory; export: a .safetensors file (its config goes to "
        "NAME.config.yaml beside it), or a directory for model.safetensors and config.yaml",
    )
    ck.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="key=value",
        help="reshard: overrides of the saved config (e.g. zero settings); import-deepspeed, import-hf: "
        "overrides of --config",
    )
    ck.add_argument("--to", help="reshard: the target layout, tp=..,pp=..,dp=.. (and vs=.. for virtual stages)")
    ck.add_argument(
        "--format",
        default="safetensors",
        choices=["safetensors", "hf"],
        help="export format: one safetensors file of Strata's names, or hf: a Hugging Face model directory "
        "(config.json, sharded safetensors, the tokenizer) for transformers' from_pretrained",
    )
    ck.add_argument(
        "--overwrite", action="store_true", help="export: replace the weights and config files OUT names if they exist"
    )
    ck.add_argument(
        "--config",
        help="import-deepspeed, import-hf: the Strata experiment the imported state continues in "
        "(import-hf: optional; the model block comes from HF_DIR's config.json)",
    )
    ck.set_defaults(func=cmd_ckpt)

    pl = sub.add_parser(
        "plot",
        help="PNG of a run's loss and throughput curves, or of a pipeline schedule record",
        formatter_class=fmt,
        usage="strata plot RUN_DIR [--out PNG]\n       strata plot schedule RECORD.json [--out PNG]",
        description="PNG of a run's loss and throughput curves, or of a pipeline schedule record.",
        epilog=_epilog(
            "strata plot runs/tiny                      # runs/tiny/curves.png",
            "strata plot schedule records/step.json     # records/step.png",
        ),
    )
    pl.add_argument(
        "run_dir", metavar="RUN_DIR | schedule", help="run directory (writes curves.png there), or the word `schedule`"
    )
    pl.add_argument(
        "record",
        nargs="?",
        metavar="RECORD.json",
        help="with `schedule`: a step record from bench/pipeline_schedule.py --record-dir "
        "(writes RECORD.png next to it)",
    )
    pl.add_argument("--out", help="PNG path (default: next to the input)")
    pl.set_defaults(func=cmd_plot)
    return p, dict(sub.choices)


def parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """A command's positionals, options and key=value overrides, in any order after the command
    (argparse's intermixed parsing, which cannot go through subparsers: the command's own parser
    runs it). Usage errors exit 2, --help and --version 0."""
    top, commands = _parsers()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in commands:
        return top.parse_args(argv)  # --help, --version, or an error naming the commands
    args = commands[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


# Environment for torch that must be set before torch is imported, in this process and so in every
# worker it starts (torchrun, the fork server and the workers inherit it); a value the user set wins.
# THP_MEM_ALLOC_ENABLE puts torch's host allocations of 2 MiB and more on transparent huge pages:
# ZeRO-3 allocates each gathered group's flat buffer at every use, and with 4 KiB pages faulting it
# in cost as much as the gather's copy (an NVMe-offload step on CPU: 7.9 s against 6.7 s). Where
# the kernel has THP off it changes nothing.
TORCH_ENV_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def main(argv: list[str] | None = None) -> int:
    for key, value in TORCH_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    args = parse_args(argv)
    try:
        return args.func(args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
