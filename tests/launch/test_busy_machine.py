"""On a machine whose cores are already busy when it starts, the `strata` command has OpenMP's threads
sleep at barriers (OMP_WAIT_POLICY=PASSIVE) instead of spinning; on an idle one it leaves libgomp's
default; a value the user set always wins. bench/busy_machine.py measures what each costs."""

from __future__ import annotations

import os

import pytest

from strata.launch import cli


@pytest.mark.parametrize(
    ("samples", "cores", "busy"),
    [
        (["0.10 0.20 0.30 1/128 999"] * 5, 2, False),  # idle: this process alone is runnable
        (["4.43 4.42 3.71 5/128 999"] * 5, 2, True),  # four others runnable on 2 cores
        (
            ["3.00 3.00 3.00 1/128 999"] * 5,
            2,
            False,
        ),  # a load that lingers from work that has ended
        (
            ["0.5 0.4 0.3 3/128 999"] * 4 + ["0.5 0.4 0.3 1/128 999"],
            2,
            True,
        ),  # the median of the readings
        (
            ["0.5 0.4 0.3 9/128 999"] + ["0.5 0.4 0.3 1/128 999"] * 4,
            2,
            False,
        ),  # one busy reading alone
        (["1.90 1.00 0.50 3/128 999"] * 5, 16, False),  # the same on 16 cores is idle
    ],
)
def test_the_cores_are_busy_when_the_runnable_tasks_reach_them(samples, cores, busy):
    assert cli.cpus_busy(samples, cores) is busy


def test_passive_waiting_is_set_only_on_a_busy_machine_and_a_users_value_wins(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(cli, "cpus_busy", lambda: True)
    cli.main(["config", "explain", "train.steps"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(cli, "cpus_busy", lambda: False)
    cli.main(["config", "explain", "train.steps"])
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setattr(cli, "cpus_busy", lambda: True)
    cli.main(["config", "explain", "train.steps"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
