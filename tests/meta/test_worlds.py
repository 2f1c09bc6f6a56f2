"""The suite's subprocess guard: a run that stalls (no output, no computing) is killed as a hang, while
a run that is silent but computing, as a run slowed by a busy machine is, goes on to its end."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from worlds import REPO, run_guarded


def test_a_stalled_process_is_taken_for_a_hang(tmp_path):
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_guarded(
            [sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"],
            tmp_path,
            None,
            2,
        )
    assert time.monotonic() - began < 20


@pytest.mark.slow  # computes for 5 s
def test_a_silent_but_computing_process_runs_to_its_end(tmp_path):
    spin = (
        "import time\nend = time.monotonic() + 5\nwhile time.monotonic() < end: pass\nprint('done')"
    )
    done = run_guarded([sys.executable, "-c", spin], REPO, None, 2)
    assert done.returncode == 0 and done.stdout == "done\n"
