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
