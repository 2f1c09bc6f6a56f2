"""Data parallelism in a real 2-process gloo world started by `strata launch` (torchrun, c10d
rendezvous), checked against the 1-process run with the same global batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from checkpoint import store
from conftest import tiny_config, tiny_overrides
from parallel.runtime import start
from trainer.loop import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strata(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": REPO})


def losses_from(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.parametrize("micro_batch", [2, 4])
def test_two_process_dp_matches_single_process(small_data_dir, tmp_path, micro_batch):
    extra = {"train.micro_batch_size": micro_batch, "log.interval": 1, "checkpoint.save_final": True,
             "train.eval_interval": 3}
    reference_cfg = tiny_config(small_data_dir, tmp_path / "ref", **extra)
    reference = run(reference_cfg, start())

    empty = tmp_path / "experiment.yaml"
    empty.write_text("{}\n")
    proc = strata("launch", str(empty), *tiny_overrides(small_data_dir, tmp_path / "dp2", **extra), "--nproc", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world 2 (dp 2)" in proc.stdout

    # The bucketed all-reduce moved every gradient once per step (fp32), plus one scalar loss per
    # step and one scalar per evaluation (steps 3 and 6).
    n_params = sum(t.numel() for t in torch.load(store.step_dir(reference_cfg.checkpoint_dir(), 6) / "model.pt",
                                                 weights_only=True).values())
    summary = json.loads((tmp_path / "dp2" / "t" / "summary.json").read_text())
    assert summary["comm_bytes"]["dp/all_reduce"] == 6 * (4 * n_params + 4) + 2 * 4

    dp_losses = losses_from(tmp_path / "dp2" / "t")
    assert sorted(dp_losses) == sorted(reference.losses)
    for step, loss in reference.losses.items():
        assert dp_losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    ref_params = torch.load(store.step_dir(reference_cfg.checkpoint_dir(), 6) / "model.pt", weights_only=True)
    dp_params = torch.load(store.step_dir(tmp_path / "dp2" / "t" / "checkpoints", 6) / "model.pt", weights_only=True)
    for name, ref in ref_params.items():
        torch.testing.assert_close(dp_params[name], ref, rtol=1e-4, atol=1e-6, msg=name)
