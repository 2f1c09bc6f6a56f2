"""`strata launch --slurm` on a real Slurm cluster: the job it writes and submits trains on two nodes.

Needs a running cluster with two idle nodes and sacct (slurmdbd accounting), as .ci/slurm_cluster.sh
starts on one machine; skipped without one. CI starts that cluster and sets STRATA_REQUIRE_SLURM=1,
so there a missing cluster fails the test instead of skipping it unseen."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli, runs_unless, tiny_overrides
from worlds import REPO, strata

# sacct's end states: the job will not run again.
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
JOB_WAIT_S = 300


def _cluster_problem() -> str | None:
    """Why this machine cannot run the test, or None when a cluster answers."""
    if os.geteuid() != 0:
        return "runs as root, as the CI cluster's jobs do (.ci/slurm_cluster.sh)"
    if (
        shutil.which("sinfo") is None
        or shutil.which("sbatch") is None
        or shutil.which("sacct") is None
    ):
        return "no Slurm client (sinfo, sbatch, sacct) on PATH"
    info = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30
    )
    if info.returncode != 0:
        return f"no Slurm cluster answers (sinfo: {info.stderr.strip()}); start one with .ci/slurm_cluster.sh start"
    usable = [
        word for word in info.stdout.split() if word in ("idle", "mix", "alloc")
    ]  # node states
    if len(usable) < 2:
        return f"needs two usable Slurm nodes, sinfo says: {info.stdout.strip()!r}"
    acct = subprocess.run(
        ["sacct", "-n", "-X", "-S", "now"], capture_output=True, text=True, timeout=30
    )
    if acct.returncode != 0:
        return f"sacct does not work (accounting storage off?): {acct.stderr.strip()}"
    return None


@pytest.fixture
def slurm_cluster() -> None:
    runs_unless(_cluster_problem(), "STRATA_REQUIRE_SLURM")


def _sacct(job_id: str, fields: str) -> str:
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", fields],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip()


def _wait_for_job(job_id: str, timeout_s: float) -> str:
    """The job's final sacct state; cancels it and fails the test if it is not done in time."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        state = _sacct(job_id, "State").split(" ")[0]  # "CANCELLED by 0" -> CANCELLED
        if state in FINAL_STATES:
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id], timeout=30)
    pytest.fail(f"Slurm job {job_id} not done after {timeout_s:.0f} s (state {state!r})")


@pytest.mark.slow
def test_launched_slurm_job_trains_on_two_nodes_and_completes(
    slurm_cluster, small_data_dir, tmp_path
):
    """`strata launch --slurm --nodes 2` submits a job whose two torchruns (one per node) rendezvous
    on the first node, train 6 steps with 2 ranks, and commit checkpoints at steps 3 and 6; sacct
    records the job COMPLETED on two nodes."""
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  n_layers: 2\n  d_model: 32\n  n_heads: 4\n  seq_len: 32\n")
    overrides = tiny_overrides(small_data_dir, tmp_path / "runs", **{"checkpoint.interval": 3})
    submitted = time.monotonic()
    launch = strata(
        "launch",
        str(config),
        *overrides,
        *["--slurm", "--nodes", "2", "--gpus-per-node", "1", "--time", "00:05:00"],
        cwd=tmp_path,  # the job's working directory, where sbatch writes its output file
        timeout=120,
    )
    assert launch.returncode == 0, launch.stdout + launch.stderr
    match = re.search(r"Submitted batch job (\d+)", launch.stdout)
    assert match, launch.stdout
    job_id = match.group(1)

    state = _wait_for_job(job_id, JOB_WAIT_S)
    elapsed = time.monotonic() - submitted
    output_file = tmp_path / f"t-{job_id}.out"
    output = output_file.read_text() if output_file.exists() else "(no output file)"
    assert state == "COMPLETED", f"job {job_id}: {state}\n{output}"
    print(f"slurm job {job_id}: submitted to COMPLETED in {elapsed:.1f} s")

    # The script runs the interpreter that ran `strata launch`, not whatever `python` PATH offers.
    script = (tmp_path / "runs" / "t" / "job.sbatch").read_text()
    assert os.path.dirname(sys.executable) in script
    # One torchrun on each of the two nodes; together a world of 2 that trained to the last step.
    assert _sacct(job_id, "NNodes") == "2"
    assert "2 nodes, rendezvous at" in output and "world 2 (tp 1, pp 1, dp 2)" in output, output
    assert "done: step 6" in output, output
    run_dir = tmp_path / "runs" / "t"
    for step in (3, 6):
        step_dir = run_dir / "checkpoints" / f"step_{step:08d}"
        assert (step_dir / "COMMITTED").is_file(), step_dir
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == 6
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 6


def test_no_cluster_skips_with_a_reason(monkeypatch, tmp_path):
    """Without Slurm tools the check names what is missing (as root) instead of failing obscurely."""
    monkeypatch.setenv("PATH", str(tmp_path))
    problem = _cluster_problem()
    assert problem is not None
    assert ("Slurm client" in problem) if os.geteuid() == 0 else ("root" in problem)


def test_job_script_runs_the_launching_interpreter(tmp_path):
    """A venv's python (a symlink named `python`) puts its folder first on the job's PATH; an
    interpreter whose folder has no `python` of its own (Debian's /usr/bin/python3) is called by
    its absolute path, so the job never runs some other `python`."""
    from strata.launch.slurm import SlurmJob, sbatch_script
    from strata.launch.torchrun import WorkerCommand

    job = SlurmJob(name="t", nodes=2, gpus_per_node=1, snapshots=True)
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    (venv_bin / "python3").symlink_to("python")
    script = sbatch_script(
        job, WorkerCommand("cfg.yaml"), str(tmp_path), interpreter=str(venv_bin / "python3")
    )
    assert f'export PATH={venv_bin}:"$PATH"' in script
    assert script.index("export PATH=") < script.index("head_addr=$(srun")  # before any step starts

    lone_bin = tmp_path / "lone" / "bin"
    lone_bin.mkdir(parents=True)
    (lone_bin / "python3").symlink_to(sys.executable)
    (lone_bin / "python").write_text("#!/bin/sh\necho not this one\n")
    script = sbatch_script(
        job, WorkerCommand("cfg.yaml"), str(tmp_path), interpreter=str(lone_bin / "python3")
    )
    assert "export PATH=" not in script and "python -m" not in script.replace(
        f"{lone_bin}/python3 -m", ""
    )
    assert script.count(f"{lone_bin}/python3 -m") == 2  # the snapshot agent and torchrun
    assert f"$({lone_bin}/python3 -c" in script  # the snapshot secret


def test_an_evaluation_job_runs_strata_eval_on_every_rank(tmp_path, capsys):
    """`strata launch --slurm --eval` writes a job whose workers evaluate the checkpoint (no snapshot
    agent: nothing trains), with the evaluation's flags."""
    script = tmp_path / "eval.sbatch"
    argv = [
        "launch",
        str(REPO / "configs" / "tiny.yaml"),
        f"log.dir={tmp_path}",
        "snapshot.every_steps=1",
    ]
    argv += [
        "--slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--no-submit",
        "--script",
        str(script),
    ]
    argv += [
        "--eval",
        "--resume",
        "runs/tiny/checkpoints",
        "--data",
        "data/books",
        "--out",
        "e.json",
    ]
    code, said = run_cli(argv, capsys)
    assert code == 0, said
    text = script.read_text()
    worker = text[text.index("strata.launch.cli") :].splitlines()[0]
    assert worker.startswith(f"strata.launch.cli eval {REPO / 'configs' / 'tiny.yaml'}")
    assert "--resume runs/tiny/checkpoints" in worker
    assert (
        f"--data {Path('data/books').resolve()}" in worker
        and f"--out {Path('e.json').resolve()}" in worker
    )
    assert "snapshot_agent" not in text


# --- the job script without a cluster: stand-ins for Slurm's tools ---------------------------


def _stand_ins(bin_dir: Path, log: Path, getent: str, all_ips: str) -> dict[str, str]:
    """scontrol, srun and getent stand-ins that log how srun was called (with the interface
    variables it passed on); the environment that puts them first on PATH."""
    bin_dir.mkdir()
    tools = {
        "scontrol": "echo node-a; echo node-b\n",
        "srun": (
            # the job step (srun ... bash -c CMD): CMD as the first node expands it, exec echoed
            'if [ "${2:-}" = bash ] && [ "${3:-}" = -c ] && [ "${4#is_host=}" != "${4:-}" ]; then\n'
            '  set -- "$1" "$(SLURM_NODEID=0 bash -c "${4//exec /echo }")"\n'
            "fi\n"
            f'echo "srun $* gloo=${{GLOO_SOCKET_IFNAME:-}} nccl=${{NCCL_SOCKET_IFNAME:-}}" >> {log}\n'
            'case "$*" in\n'
            "  *interface_address*) echo 10.0.0.5 ;;\n"
            f"  *--all-ip-addresses*) echo {all_ips} ;;\n"
            "  *--ip-address*) echo 127.0.1.1 ;;\n"
            "esac\n"
        ),
        "getent": f"printf '{getent}'\n",
    }
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _run_script(script: Path, env: dict[str, str], log: Path) -> str:
    """Run the job script against the stand-ins; the torchrun line srun was given."""
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    done = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        cwd=script.parent,
        env={
            **os.environ,
            **env,
            "SLURM_JOB_NODELIST": "node-[a-b]",
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NUM_NODES": "2",
        },
    )
    assert done.returncode == 0, done.stderr
    return next(c for c in log.read_text().splitlines() if "torch.distributed.run" in c)


def _write_job(tmp_path: Path, capsys, *flags: str) -> tuple[int, str, Path]:
    script = tmp_path / "job.sbatch"
    argv = ["launch", str(REPO / "configs" / "tiny.yaml"), f"log.dir={tmp_path}"]
    argv += ["--slurm", "--nodes", "2", "--gpus-per-node", "1", "--no-submit"]
    code, said = run_cli([*argv, "--script", str(script), *flags], capsys)
    return code, said, script


@pytest.mark.parametrize(
    "getent, all_ips, endpoint",
    [
        # the name resolves to a routable address: that one, whatever the node says of itself
        ("127.0.1.1 STREAM node-a\\n10.1.2.3 STREAM\\n", "10.9.9.9", "10.1.2.3"),
        # the name resolves to loopback only (Debian's 127.0.1.1): the node's own address
        ("127.0.1.1 STREAM node-a\\n", "10.9.9.9 fe80::1", "10.9.9.9"),
        # nothing but loopback anywhere (every node on one machine): loopback it is
        ("", "", "127.0.1.1"),
    ],
)
def test_rendezvous_is_on_a_routable_address_of_the_head_node(
    tmp_path, capsys, getent, all_ips, endpoint
):
    log = tmp_path / "calls.log"
    env = _stand_ins(tmp_path / "bin", log, getent, all_ips)
    code, said, script = _write_job(tmp_path, capsys)
    assert code == 0, said
    launch = _run_script(script, env, log)
    assert f"--rdzv-endpoint={endpoint}:29500" in launch
    # the first node hosts the store, told so: torchrun's own guess fails where the host's name
    # resolves to loopback and the endpoint is its routable address
    assert "--rdzv-conf=is_host=1" in launch


def test_job_carries_net_ifname_and_the_users_sbatch_options(tmp_path, capsys):
    """--net-ifname: the head node is reached at that interface's address, and gloo and NCCL use
    it on every node; each --sbatch-option becomes an #SBATCH line (exclusive=user replacing
    Strata's --exclusive)."""
    log = tmp_path / "calls.log"
    env = _stand_ins(tmp_path / "bin", log, "127.0.1.1 STREAM node-a\\n", "10.9.9.9")
    code, said, script = _write_job(
        tmp_path,
        capsys,
        "--net-ifname",
        "ib0",
        "--sbatch-option",
        "cpus-per-task=16",
        "--sbatch-option=--constraint=h100",
        "--sbatch-option",
        "exclusive=user",
        "--sbatch-option",
        "hint=nomultithread",
    )
    assert code == 0, said
    text = script.read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for line in (
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --constraint=h100",
        "#SBATCH --exclusive=user",
        "#SBATCH --hint=nomultithread",
        "#SBATCH --nodes=2",
    ):
        assert line in directives, line
    assert "#SBATCH --exclusive" not in directives
    launch = _run_script(script, env, log)
    assert "--rdzv-endpoint=10.0.0.5:29500" in launch and "gloo=ib0 nccl=ib0" in launch
    lookup = next(c for c in log.read_text().splitlines() if "interface_address" in c)
    assert "-w node-a" in lookup and lookup.split(" gloo=")[0].endswith(" ib0")


def test_sbatch_options_strata_writes_itself_are_refused(tmp_path, capsys):
    code, said, script = _write_job(
        tmp_path,
        capsys,
        "--sbatch-option",
        "nodes=3",
        "--sbatch-option",
        "output=mine.out",
        "--sbatch-option",
        "N=3",
        "--sbatch-option",
        "mem=",
    )
    assert code == 2 and not script.exists()
    assert "#SBATCH --nodes itself; set it with --nodes" in said
    assert "#SBATCH --output itself" in said
    assert "'N=3'" in said and "'mem='" in said and "KEY=VALUE" in said
