"""Disk problems at run time: an unwritable `checkpoint.dir` is refused when the checkpoint manager is
made (before the first step), and a save that finds no room (ENOSPC, EDQUOT, EFBIG) names the file and
the bytes missing, leaves the committed checkpoints loadable and removes its partial directory, then
stops the run or, with `checkpoint.on_disk_full: retry`, is skipped with a warning.

Running as root, permissions do not stop writes, so a full disk is made with RLIMIT_FSIZE in a
subprocess (SIGXFSZ ignored, so a write past the limit fails with EFBIG, and the async writer process
inherits the limit), and, where this machine lets the tests mount one, with a 1 MiB tmpfs (ENOSPC)."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_writer import pieces, save

from strata.checkpoint import store
from strata.checkpoint.manager import CheckpointManager
from strata.checkpoint.reader import Checkpoint
from strata.errors import CheckpointError
from strata.parallel import comm

from worlds import TESTS, join_world, run_world


def assert_loads(path: Path, step: int) -> None:
    """The checkpoint verifies and holds exactly what step `step` saved."""
    ckpt = Checkpoint(path)
    assert ckpt.step == step and ckpt.object("trainer") == {"step": step}
    try:
        got = ckpt.tensors("")
    finally:
        ckpt.close()  # its open files would keep a test's tmpfs busy
    for p in pieces(step):
        assert torch.equal(got[p.key], p.tensor), p.key


# --- an unwritable checkpoint.dir, found at construction ----------------------------------------


def test_a_checkpoint_dir_under_a_regular_file_is_refused_at_construction_naming_the_key(tmp_path):
    a_file = tmp_path / "results.csv"
    a_file.write_text("precious")
    with pytest.raises(CheckpointError, match=r"checkpoint\.dir") as err:
        CheckpointManager(a_file / "ckpts", 0, 1)
    assert str(a_file / "ckpts") in str(err.value) and "ENOTDIR" in str(err.value)
    with pytest.raises(CheckpointError, match=r"is not a directory; set checkpoint\.dir"):
        CheckpointManager(a_file, 0, 1)
    assert a_file.read_text() == "precious"


def test_a_missing_checkpoint_dir_is_made_and_left_without_probe_files(tmp_path):
    root = tmp_path / "a" / "b"
    for rank in (1, 0):  # every rank checks: each writes its data file there
        CheckpointManager(root, rank, 2)
    assert root.is_dir() and list(root.iterdir()) == []


PRELUDE = f"""
import json, resource, signal, sys
sys.path[:0] = {[os.path.dirname(__file__), str(TESTS)]!r}  # test_disk_faults, worlds
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails with EFBIG instead
from pathlib import Path
from strata.checkpoint.manager import CheckpointManager
from strata.errors import CheckpointError
from test_disk_faults import save

def limit(nbytes, mgr=None):  # files this process, and the manager's writer if it has one, may write
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))
    if mgr is not None and mgr.writer_pid is not None:
        resource.prlimit(mgr.writer_pid, resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))
"""


def run_script(body: str, root: Path) -> list[dict]:
    """Run PRELUDE + body in a fresh interpreter (the limit must not hit pytest's own files); the
    JSON lines it prints, with its stderr as the last item's "stderr"."""
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + body.replace("ROOT", repr(str(root)))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return lines + [{"stderr": out.stderr}]


def test_a_checkpoint_dir_with_no_room_for_a_file_is_refused_at_construction(tmp_path):
    root = tmp_path / "ckpts"
    (result, _) = run_script(
        """
limit(0)
try:
    CheckpointManager(Path(ROOT), 0, 1)
    print(json.dumps({"error": None}))
except CheckpointError as e:
    print(json.dumps({"error": str(e)}))
""",
        root,
    )
    assert result["error"] is not None
    assert f"checkpoint.dir {root}" in result["error"] and "EFBIG" in result["error"]


# --- no room during a save: RLIMIT_FSIZE (EFBIG) ------------------------------------------------

SAVE_WITHOUT_ROOM = """
mgr = CheckpointManager(Path(ROOT), 0, 1, async_save=ASYNC, on_disk_full=POLICY)
save(mgr, 1)
mgr.wait()
limit(8192, mgr)  # smaller than a data file: the next save finds no room
try:
    save(mgr, 2)
    mgr.wait()
    print(json.dumps({"error": None, "skipped": sorted(mgr.skipped)}))
except CheckpointError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
limit(resource.RLIM_INFINITY, mgr)  # the disk frees up: the next save commits
save(mgr, 3)
mgr.close()
print(json.dumps({"after": "saved 3"}))
"""


def _save_without_room(root: Path, policy: str, async_save: bool) -> list[dict]:
    return run_script(
        SAVE_WITHOUT_ROOM.replace("ASYNC", str(async_save)).replace("POLICY", repr(policy)), root
    )


@pytest.mark.parametrize(
    "async_save", [False, pytest.param(True, marks=pytest.mark.slow)]
)  # a writer process
def test_no_room_with_policy_stop_raises_naming_the_file_and_bytes_and_the_last_checkpoint_loads(
    tmp_path, async_save
):
    root = tmp_path / "ckpts"
    result, _ = _save_without_room(root, "stop", async_save)
    error = result["error"]
    assert error is not None and "checkpoint step 2 was not saved" in error
    data_file = store.partial_dir(root, 2) / store.data_file(0)
    assert f"no room for {data_file}" in error and "EFBIG" in error
    assert "could not be written" in error and "free on its file system" in error
    missing, size = (
        int(n) for n in re.search(r"(\d+) bytes \([\d.]+ MiB\) of its (\d+) could", error).groups()
    )
    assert 0 < missing < size  # the bytes the limit let through were written
    assert "checkpoint.on_disk_full: retry" in error  # says how to train on instead
    assert not store.partial_dir(root, 2).exists()  # the failed save's partial directory is gone
    assert [p.name for p in store.committed(root)] == ["step_00000001"]
    assert_loads(root, 1)


@pytest.mark.parametrize(
    "async_save", [False, pytest.param(True, marks=pytest.mark.slow)]
)  # a writer process
def test_no_room_with_policy_retry_warns_trains_on_and_the_next_save_commits(tmp_path, async_save):
    root = tmp_path / "ckpts"
    result, after, err = _save_without_room(root, "retry", async_save)
    assert result == {"error": None, "skipped": [2]} and after == {"after": "saved 3"}
    warning = err["stderr"]
    assert "warning: checkpoint step 2 was not saved: no room" in warning
    assert str(store.partial_dir(root, 2) / store.data_file(0)) in warning and "EFBIG" in warning
    assert [p.name for p in store.committed(root)] == ["step_00000001", "step_00000003"]
    assert not store.partial_dir(root, 2).exists()
    assert_loads(store.step_dir(root, 1), 1)
    assert_loads(root, 3)


# --- no room during a save: a full tmpfs (ENOSPC) -----------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and mount; skipped where the machine does not allow it)."""
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)]).returncode != 0:
            subprocess.run(
                ["umount", "-l", str(mount)], check=True
            )  # busy: detach it now, freed when let go


def fill(disk: Path) -> Path:
    """A file taking all the free space of `disk`."""
    filler = disk / "filler"
    fd = os.open(
        filler, os.O_WRONLY | os.O_CREAT, 0o644
    )  # unbuffered: nothing left to fail at close
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


@pytest.mark.parametrize("policy", ["stop", "retry"])
def test_a_full_tmpfs_gives_enospc_naming_the_file_and_the_policy_applies(
    small_disk, policy, capfd
):
    root = small_disk / "ckpts"
    mgr = CheckpointManager(root, 0, 1, on_disk_full=policy)
    save(mgr, 1)
    filler = fill(small_disk)
    data_file = store.partial_dir(root, 2) / store.data_file(0)
    if policy == "stop":
        with pytest.raises(CheckpointError, match="ENOSPC") as err:
            save(mgr, 2)
        assert f"no room for {data_file}" in str(err.value) and "bytes" in str(err.value)
    else:
        save(mgr, 2)
        assert "ENOSPC" in mgr.skipped[2] and str(data_file) in capfd.readouterr().err
    assert not store.partial_dir(root, 2).exists()
    assert_loads(root, 1)
    filler.unlink()  # the disk frees up
    save(mgr, 3)
    mgr.close()
    assert [p.name for p in store.committed(root)] == ["step_00000001", "step_00000003"]
    assert_loads(root, 3)


# --- two ranks: one rank's full disk is every rank's verdict --------------------------------------


def _two_rank_worker(rank: int, size: int, port: int, out_dir: str, policy: str) -> None:
    """Both ranks hold the whole state (so each writes half of it); only rank 1's files hit the limit."""
    join_world(rank, size, port)
    try:
        root = Path(out_dir) / "ckpts"
        mgr = CheckpointManager(root, rank, size, group=comm.new_gloo_group(), on_disk_full=policy)
        save(mgr, 1)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        error = None
        try:
            save(mgr, 2)
        except CheckpointError as e:
            error = str(e)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        save(mgr, 3)
        mgr.close()
        torch.save(
            {"error": error, "skipped": sorted(mgr.skipped)}, Path(out_dir) / f"rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a gloo world of two processes
@pytest.mark.parametrize("policy", ["stop", "retry"])
def test_one_ranks_full_disk_stops_or_skips_the_save_on_every_rank(tmp_path, policy):
    ranks = run_world(_two_rank_worker, 2, tmp_path, policy)
    root = tmp_path / "ckpts"
    if policy == "stop":
        for r in ranks:
            assert r["error"] is not None and "checkpoint step 2 was not saved" in r["error"]
            assert (
                f"rank 1: writing {store.partial_dir(root, 2)}" in r["error"]
                and "EFBIG" in r["error"]
            )
            assert "rank 0:" not in r["error"]
    else:
        assert [r["error"] for r in ranks] == [None, None] and [r["skipped"] for r in ranks] == [
            [2],
            [2],
        ]
    assert [p.name for p in store.committed(root)] == ["step_00000001", "step_00000003"]
    assert not store.partial_dir(root, 2).exists()
    assert_loads(store.step_dir(root, 1), 1)
    assert_loads(root, 3)
