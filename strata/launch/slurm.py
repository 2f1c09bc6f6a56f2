"""Slurm launch: write an sbatch script that runs one torchrun per node under srun (and, with
snapshots on, that node's snapshot agent beside it), with c10d rendezvous on the job's first node,
and submit it when sbatch exists."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from strata.errors import StrataError
from strata.launch.supervisor import FORWARDED_SIGNALS
from strata.launch.torchrun import WorkerCommand

# Slurm warns the batch shell this many seconds before the time limit (`--signal=B:USR1@SECONDS`):
# time for the step in progress, a checkpoint of it and the exit. A config key
# `slurm.stop_warning_s` would replace this constant.
STOP_WARNING_S = 120
# How long torchrun waits for its workers after passing a signal on, before it kills them: the
# warning less a margin for torchrun's own exit and the requeue.
STOP_GRACE_S = STOP_WARNING_S - 20


@dataclass(frozen=True)
class SlurmJob:
    """The sbatch request. Empty strings leave a setting to the cluster's defaults."""

    name: str
    nodes: int
    gpus_per_node: int
    partition: str = ""
    account: str = ""
    time: str = "01:00:00"
    cpus_per_task: int = 0
    rdzv_port: int = 29500
    max_restarts: int = 0
    snapshots: bool = False  # start each node's snapshot agent beside its torchrun
    # SIGUSR1 this long before the time limit: save, exit, requeue
    stop_warning_s: int = STOP_WARNING_S
    net_ifname: str = ""  # the interface the nodes talk over (and the head node is reached at)
    # the user's own #SBATCH options, as `--sbatch-option` gives them ("KEY=VALUE" or "KEY")
    sbatch_options: tuple[str, ...] = ()


# #SBATCH options Strata writes itself, with what sets each instead; given again with
# --sbatch-option they would contradict the script (one task per node, the output file a
# requeued job appends to, the time-limit warning).
OWN_OPTIONS = {
    "job-name": "run.name",
    "nodes": "--nodes",
    "ntasks": "--nodes (one task per node)",
    "ntasks-per-node": "--nodes (one task per node)",
    "gpus-per-node": "--gpus-per-node",
    "gpus": "--gpus-per-node",
    "gpus-per-task": "--gpus-per-node",
    "time": "--time",
    "output": "nothing: the job writes NAME-JOBID.out, appended to by a requeued job",
    "open-mode": "nothing: a requeued job appends to its output",
    "signal": "nothing: Strata's time-limit warning saves a checkpoint and requeues",
    "requeue": "nothing: Strata requeues after the time-limit warning",
    "no-requeue": "nothing: Strata requeues after the time-limit warning",
    "partition": "--partition",
    "account": "--account",
}


def sbatch_options(options: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`--sbatch-option` values checked: each KEY=VALUE or KEY (a flag) with KEY a long sbatch
    option name (a leading `--` is dropped), none of them one Strata writes itself. A StrataError
    lists every problem."""
    checked, problems = [], []
    for option in options:
        key, eq, value = option.strip().removeprefix("--").partition("=")
        if len(key) < 2 or not key.replace("-", "").isalnum() or (eq and not value):
            problems.append(
                f"--sbatch-option {option!r}: give KEY=VALUE or KEY with KEY a long sbatch "
                "option name, e.g. cpus-per-task=16 or exclusive"
            )
        elif key in OWN_OPTIONS:
            problems.append(
                f"--sbatch-option {option!r}: Strata writes #SBATCH --{key} itself; set it "
                f"with {OWN_OPTIONS[key]}"
            )
        else:
            checked.append(f"{key}={value}" if eq else key)
    if problems:
        raise StrataError("\n".join(problems))
    return tuple(checked)


def job_python(interpreter: str) -> tuple[str, str]:
    """How the job names the interpreter that ran `strata launch`, and the line that makes that
    name work. A batch job starts a fresh shell on the node, where `python` on PATH is whatever the
    login profile or a version manager's shim picks, not the user's venv: so the interpreter's own
    folder goes first on PATH (srun passes the environment on to every node). When that folder's
    `python` is some other program (Debian's /usr/bin/python3 has no /usr/bin/python), the job
    calls the interpreter by its absolute path instead. The path is not resolved: a venv's python
    is a symlink whose location is what selects the venv."""
    folder = os.path.dirname(interpreter)
    named = os.path.join(folder, "python")
    try:
        same = os.path.samefile(named, interpreter)
    except OSError:
        same = False
    if same:
        return "python", f'export PATH={shlex.quote(folder)}:"$PATH"'
    return shlex.quote(interpreter), ""


def sbatch_script(
    job: SlurmJob, worker: WorkerCommand, workdir: str, interpreter: str = sys.executable
) -> str:
    """The sbatch script for `job`: its #SBATCH directives, the environment every node's torchrun
    needs (the venv's Python, the rendezvous on the first node, signal and NCCL settings), then the
    job step (one torchrun per node under srun, each beside its snapshot agent when `job.snapshots`)
    under the traps that pass a stop on and requeue after the time-limit warning; each worker runs
    `worker`."""
    worker_line = shlex.join(worker.args())
    python, path_line = job_python(interpreter)
    torchrun = (
        f"{python} -m torch.distributed.run --nnodes={job.nodes} "
        f"--nproc-per-node={job.gpus_per_node} "
        '--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$SLURM_JOB_ID" '
        '--rdzv-conf=is_host="$is_host" '
        f"--max-restarts={job.max_restarts} {worker_line}"
    )
    lines = [
        "#!/bin/bash",
        *[f"#SBATCH {d}" for d in _directives(job)],
        "",
        *_environment(job, workdir, path_line, python),
    ]
    if job.snapshots:
        secret, step = _snapshot_step(python, torchrun)
        lines.append(secret)
    else:
        step = f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(IS_HOST + f'exec {torchrun}')}"
    return "\n".join(lines + _stop_and_requeue(step))


# Each node's torchrun is told whether it hosts the rendezvous store (the allocation's first node
# does): torchrun would guess it by matching the endpoint against its host's name and addresses,
# and a routable address of a host whose name resolves to loopback matches none of them.
IS_HOST = 'is_host=0; if [ "$SLURM_NODEID" = 0 ]; then is_host=1; fi; '


def _directives(job: SlurmJob) -> list[str]:
    """The #SBATCH options: one task per node with its GPUs, the time limit and its warning,
    requeueing, an appended output file, the partition, account and CPUs when set, then the
    user's own (`job.sbatch_options`, already checked by `sbatch_options`)."""
    directives = [
        f"--job-name={job.name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={job.gpus_per_node}",
        f"--time={job.time}",
        f"--output={job.name}-%j.out",
        "--open-mode=append",  # a requeued job adds to its output file instead of replacing it
        "--exclusive",
        # The warning goes to the batch shell (B:), which passes it on to srun and, once the
        # workers have saved and stopped, requeues the job: signalled without B:, the job steps
        # would stop and the job would simply end.
        f"--signal=B:USR1@{job.stop_warning_s}",
        "--requeue",
    ]
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.account:
        directives.append(f"--account={job.account}")
    if job.cpus_per_task:
        directives.append(f"--cpus-per-task={job.cpus_per_task}")
    own = [o.partition("=")[0] for o in job.sbatch_options]
    if "exclusive" in own:  # the user's own --exclusive[=user|mcs|topo] replaces Strata's
        directives.remove("--exclusive")
    return directives + [f"--{o}" for o in job.sbatch_options]


def _environment(job: SlurmJob, workdir: str, path_line: str, python: str) -> list[str]:
    """The script's set-up before the job step: the working directory, the venv's Python on PATH
    (`path_line`, from `job_python`), the rendezvous endpoint on the allocation's first node, and
    the variables torchrun and NCCL read (signals passed on, the shutdown grace, the flight recorder)."""
    path_lines = [
        "# The Python that ran `strata launch` (its venv), here and through srun on every node.",
        path_line,
    ]
    return [
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        *(path_lines if path_line else []),
        "# Rendezvous on the first node of the allocation (c10d store hosted by that node's "
        "torchrun).",
        # an array, not `| head -n 1`: under pipefail head's early exit SIGPIPEs scontrol
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "head_node=${nodes[0]}",
        *_head_address(job, python),
        f'export RDZV_ENDPOINT="$head_addr:{job.rdzv_port}"',
        "# torch <= 2.13 restarts only with a fresh store per attempt (pytorch/pytorch#135712)",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "# torchrun passes these signals on to every worker (SIGUSR1 too: the time-limit "
        "warning), and",
        "# gives the workers this long to save a checkpoint and exit before it kills them.",
        f"export PET_SIGNALS_TO_HANDLE={','.join(sig.name for sig in FORWARDED_SIGNALS)}",
        f"export PET_SHUTDOWN_TIMEOUT={max(job.stop_warning_s - (STOP_WARNING_S - STOP_GRACE_S), 10)}",
        "# NCCL's flight recorder: on a collective timeout each rank dumps its last 2000 "
        "collectives.",
        "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000",
        "export TORCH_NCCL_DUMP_ON_TIMEOUT=1",
        'echo "strata: $SLURM_JOB_NUM_NODES nodes, rendezvous at $RDZV_ENDPOINT (restart '
        '${SLURM_RESTART_COUNT:-0})"',
        "",
    ]


def _head_address(job: SlurmJob, python: str) -> list[str]:
    """Lines that set $head_addr to an address of $head_node the other nodes reach. With
    `job.net_ifname`: that interface's IPv4 address on the head node, and gloo and NCCL told to use
    the interface on every node. Otherwise the head node's name resolved (getent), then the head
    node's own addresses (`hostname --all-ip-addresses`), each skipping loopback: Debian maps a
    host's own name to 127.0.1.1, which no other node reaches; loopback only when nothing else
    exists (every node on one machine)."""
    on_head = 'srun --nodes=1 --ntasks=1 -w "$head_node"'
    if job.net_ifname:
        ifname = shlex.quote(job.net_ifname)
        lookup = (
            "import sys; from strata.net import interface_address; "
            "print(interface_address(sys.argv[1]) or '')"
        )
        return [
            f"# The address of --net-ifname {job.net_ifname} on the head node; gloo and NCCL use "
            "that interface.",
            f"head_addr=$({on_head} {python} -c {shlex.quote(lookup)} {ifname})",
            'if [ -z "$head_addr" ]; then',
            f'  echo "strata: node $head_node has no IPv4 address on --net-ifname {job.net_ifname}'
            '" >&2',
            "  exit 1",
            "fi",
            f"export GLOO_SOCKET_IFNAME={ifname} NCCL_SOCKET_IFNAME={ifname}",
        ]
    # awk keeps the first IPv4 address outside 127.0.0.0/8 and reads its input to the end (an early
    # exit would SIGPIPE the command before it under pipefail)
    routable = (
        "awk '{for (i = 1; i <= NF; i++) if (!a && $i ~ /^[0-9.]+$/ && $i !~ /^127[.]/) a = $i} "
        "END {print a}'"
    )
    return [
        "# The head node's address the other nodes reach: its name's (getent), else its own,",
        "# skipping loopback (a hostname can map to 127.0.1.1); loopback only if nothing else.",
        f'head_addr=$(getent ahostsv4 "$head_node" | {routable}) || head_addr=""',
        'if [ -z "$head_addr" ]; then',
        f'  head_addr=$({on_head} hostname --all-ip-addresses | {routable}) || head_addr=""',
        "fi",
        'if [ -z "$head_addr" ]; then',
        f"  head_addr=$({on_head} hostname --ip-address | awk '{{print $1}}')",
        "fi",
    ]


def _snapshot_step(python: str, torchrun: str) -> tuple[str, str]:
    """With snapshots on: the line that makes the agents' secret, and the job step in which each
    node starts its snapshot agent, then becomes its torchrun."""
    # One secret for every node's snapshot agent, made here so it is never written to a file;
    # srun passes the environment on. Each node starts its agent, then becomes its torchrun
    # (exec keeps the pid the agent watches).
    node = (
        # the agent ignores the warning (torchrun handles it again: PET_SIGNALS_TO_HANDLE)
        "trap '' USR1; "
        'dir=$(mktemp -d); sock="$dir/agent.sock"; '
        f"{python} -m strata.launch.snapshot_agent"
        ' --socket "$sock" --advertise "$(hostname)" --parent $$ & '
        'while [ ! -S "$sock" ]; do sleep 0.1; done; export STRATA_SNAPSHOT_SOCKET="$sock"; '
        f"{IS_HOST}exec {torchrun}"
    )
    secret = f"export STRATA_SNAPSHOT_SECRET=$({python} -c 'import secrets; print(secrets.token_hex(32))')"
    return secret, f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(node)}"


def _stop_and_requeue(step: str) -> list[str]:
    """The job step in the background, under traps: SIGUSR1 (the time-limit warning) or SIGTERM to
    the batch shell goes on to srun, which signals every node's torchrun (and Slurm every process of
    the step), and torchrun every worker; they finish their step, commit a checkpoint and exit.
    After the warning the job requeues itself, and the requeued job (SLURM_RESTART_COUNT > 0)
    resumes from checkpoint.dir's newest checkpoint; after SIGTERM (scancel, or preemption, which
    requeues by Slurm's own PreemptMode) it does not, or a cancelled job would never end. `wait`
    returns early when a trapped signal arrives, so it is called until srun is gone."""
    return [
        "# A stop signal goes on to the job step; after the time-limit warning the job requeues "
        "itself.",
        'stop_signal=""',
        'forward() { stop_signal=$1 trapped=1; kill -s "$1" "$step_pid" 2>/dev/null || true; }',
        "trap 'forward USR1' USR1",
        "trap 'forward TERM' TERM",
        f"{step} &",
        'step_pid=$! status=""',
        'while [ -z "$status" ]; do  # a trap interrupts `wait`: then wait again for the status',
        '  trapped=""',
        '  wait "$step_pid" && status=0 || status=$?',
        '  if [ -n "$trapped" ]; then status=""; fi',
        "done",
        'if [ "$stop_signal" = USR1 ]; then',
        '  echo "strata: SIGUSR1 (time limit near): the workers saved a checkpoint; requeueing '
        'job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID" || echo "strata: requeue failed; resubmit to resume" '
        ">&2",
        "  exit 0",
        "fi",
        'exit "$status"',
        "",
    ]


def submit(script_path: Path) -> int:
    """sbatch the script if Slurm is installed; otherwise say where it is. Returns an exit code."""
    if shutil.which("sbatch") is None:
        print(
            f"strata launch: sbatch not found; wrote {script_path} (submit it with: sbatch "
            f"{script_path})"
        )
        return 0
    out = subprocess.run(["sbatch", str(script_path)], capture_output=True, text=True)
    print(out.stdout.strip() or out.stderr.strip())
    return out.returncode
