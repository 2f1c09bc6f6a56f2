"""Hang detection (strata/parallel/watchdog.py) in real gloo worlds of 3 processes: one rank stops (SIGSTOP),
stays busy outside any collective, or waits in a collective the others never join. Every rank must
exit within a few seconds of the hang timeout, far below the collective timeout, with one verdict
naming the stuck rank, its host and its last collective; a long checkpoint phase is not a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from strata.net import free_port
from strata.parallel import comm, watchdog
from strata.parallel.watchdog import HANG_EXIT

from worlds import join_world, run_world

pytestmark = pytest.mark.slow  # 3-process gloo worlds that hang on purpose

SIZE, STUCK, HANG_AFTER_S = 3, 1, 2.0
COLLECTIVE_TIMEOUT_S = 60  # what would end the job without the watchdog
HANG_AT_STEP = 4
STEP_S = (
    0.3  # longer than the heartbeat interval, as real steps are: a stopped rank's record is current
)


def _worker(rank: int, size: int, port: int, out_dir: str, store_port: int, scenario: str) -> None:
    out = Path(out_dir)
    sys.stderr = open(out / f"rank{rank}.err", "w", buffering=1)  # noqa: SIM115 - os._exit ends the process
    join_world(rank, size, port, timeout_s=COLLECTIVE_TIMEOUT_S)
    pair = dist.new_group([STUCK, STUCK + 1])  # every rank creates it; only the stuck rank uses it
    store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=10))
    dog = watchdog.start(store, "test", rank, size, HANG_AFTER_S)
    t = torch.ones(1)
    with dog.guard():
        _steps(rank, out, scenario, pair, t)
    dog.stop()
    comm.barrier()
    dist.destroy_process_group()


def _steps(rank: int, out: Path, scenario: str, pair, t: torch.Tensor) -> None:
    for step in range(1, 8):
        if step == HANG_AT_STEP:
            if rank == STUCK and scenario != "long save":
                (out / "hung_at").write_text(str(time.time()))
                if scenario == "stopped":
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif scenario == "busy":
                    time.sleep(3 * COLLECTIVE_TIMEOUT_S)
                elif scenario == "other collective":
                    comm.barrier(
                        pair
                    )  # rank STUCK + 1 is in the world's all-reduce instead: deadlock
            elif rank == 0 and scenario == "long save":
                with watchdog.paused("checkpoint save"):
                    time.sleep(3 * HANG_AFTER_S)  # the others wait for it in the all-reduce below
        comm.all_reduce(t, dist.group.WORLD, "dp")
        watchdog.step_done(step)
        time.sleep(STEP_S)


def _run(tmp_path: Path, scenario: str) -> tuple[list[int | None], float, dict | None]:
    """Exit codes in rank order, seconds from the hang to the last exit, and the verdict."""
    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    codes = run_world(
        _worker,
        SIZE,
        tmp_path,
        store_port,
        scenario,
        timeout_s=COLLECTIVE_TIMEOUT_S,
        exit_codes=True,
        late=f"{scenario}: the hang was not detected",
    )
    ended = time.time()
    hung_at = tmp_path / "hung_at"
    took = ended - float(hung_at.read_text()) if hung_at.exists() else 0.0
    key = "strata/watchdog/test/verdict"
    verdict = json.loads(store.get(key)) if store.check([key]) else None
    return codes, took, verdict


def _errors(tmp_path: Path, rank: int) -> list[str]:
    return [
        line for line in (tmp_path / f"rank{rank}.err").read_text().splitlines() if "hang:" in line
    ]


@pytest.mark.parametrize(
    ("scenario", "why", "last"),
    [
        ("stopped", "is not responding (stopped, frozen or gone)", "after all_reduce over dp"),
        ("busy", "is busy outside any collective", "after all_reduce over dp"),
        (
            "other collective",
            "waits in a different collective than the others (all_reduce over dp)",
            "in barrier",
        ),
    ],
)
def test_a_stuck_rank_is_named_and_every_rank_exits_long_before_the_collective_timeout(
    tmp_path, scenario, why, last
):
    codes, took, verdict = _run(tmp_path, scenario)
    assert verdict is not None, [(tmp_path / f"rank{r}.err").read_text() for r in range(SIZE)]
    assert verdict["stuck"] == [STUCK]
    message = verdict["message"]
    assert f"rank {STUCK} (host {socket.gethostname()}, pid " in message, message
    assert f"last collective: {last})" in message, message
    assert why in message, message
    # A stopped rank cannot act: a live rank on its host ends it. The others exit on the verdict.
    expected = [HANG_EXIT] * SIZE
    if scenario == "stopped":
        expected[STUCK] = -signal.SIGKILL
    assert codes == expected, codes
    for rank in range(SIZE):
        if rank != STUCK or scenario != "stopped":
            assert _errors(tmp_path, rank) == [f"strata: rank {rank}: {message}"]
    assert took < HANG_AFTER_S + 4, f"{took:.1f}s from the hang to every rank's exit"


def test_a_long_checkpoint_phase_is_not_a_hang(tmp_path):
    codes, _, verdict = _run(tmp_path, "long save")
    assert verdict is None, verdict
    assert codes == [0] * SIZE
