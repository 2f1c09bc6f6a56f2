"""A DeepSpeed ZeRO-3 checkpoint written by DeepSpeed itself — 2 ranks on CPU/gloo, the Strata
model, initial values, data, AdamW groups and LR schedule (bench/_zero_worker.py), stopped after 3
of 6 steps — is imported with `strata ckpt import-deepspeed`, and training continues in Strata on
one process (another dp size): steps 4–6 have the losses of Strata's own uninterrupted run and end
on its weights. DeepSpeed is a test dependency here (.ci/run installs it, torch pinned)."""

from __future__ import annotations

import os
import subprocess

import pytest

from strata.launch.cli import main as strata_main
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from conftest import tiny_config, tiny_overrides
from worlds import assert_same_params, final_params, torchrun

pytestmark = pytest.mark.slow  # a 2-process DeepSpeed world under torchrun, then a Strata run

SETTINGS = {"train.steps": 6, "checkpoint.save_final": True, "log.interval": 1}


def test_deepspeed_zero3_checkpoint_continues_in_strata(small_data_dir, tmp_path):
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    overrides = tiny_overrides(small_data_dir, tmp_path / "ds", **SETTINGS)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    for _ in range(2):
        proc = _deepspeed_job(tmp_path, experiment, overrides, env)
        # DeepSpeed's CPU world now and then aborts in native code as it starts ("terminate called
        # without an active exception", before its first step): the peer's crash, not the import's.
        if "terminate called without an active exception" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    assert (
        strata_main(
            [
                "ckpt",
                "import-deepspeed",
                str(tmp_path / "ds-ckpt"),
                str(tmp_path / "imported"),
                *overrides,
                "--config",
                str(experiment),
            ]
        )
        == 0
    )
    reference_cfg = tiny_config(small_data_dir, tmp_path / "ref", **SETTINGS)
    reference = run(reference_cfg, start())
    resumed_cfg = tiny_config(small_data_dir, tmp_path / "resumed", **SETTINGS)
    resumed = run(resumed_cfg, start(), resume=tmp_path / "imported")
    assert sorted(resumed.losses) == [4, 5, 6]
    for step, loss in resumed.losses.items():
        assert loss == pytest.approx(reference.losses[step], rel=1e-5), step
    assert_same_params(
        final_params(resumed_cfg.checkpoint_dir()), final_params(reference_cfg.checkpoint_dir())
    )


def _deepspeed_job(
    tmp_path, experiment, overrides: list[str], env: dict
) -> subprocess.CompletedProcess:
    """DeepSpeed ZeRO-3 on 2 ranks (bench/_zero_worker.py), stopped after 3 steps with a checkpoint."""
    return torchrun(
        "bench/_zero_worker.py",
        "--side",
        "deepspeed",
        "--out",
        str(tmp_path / "ds.json"),
        "--stop-after",
        "3",
        "--save-dir",
        str(tmp_path / "ds-ckpt"),
        str(experiment),
        *overrides,
        env=env,
        timeout=600,
    )
