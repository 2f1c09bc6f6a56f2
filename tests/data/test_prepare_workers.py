"""`strata data prepare --workers N` killed with SIGKILL leaves nothing behind: its tokenizing
workers die with it, and the next prepare of the same output removes the temporary directory the
killed one left."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from worlds import strata_command, wait_for


def _corpus(root: Path, files: int, mb: int) -> Path:
    corpus = root / "corpus"
    corpus.mkdir()
    line = "def tokenize(text, vocab):\n    return [vocab.get(w, 0) for w in text.split()]  # x\n"
    chunk = line * (mb * (1 << 20) // len(line))
    for i in range(files):
        (corpus / f"doc{i}.txt").write_text(chunk + f"# {i}\n")
    return corpus


@pytest.mark.slow  # ~20 s: a BPE trained on a small corpus, then a kill -9 mid-tokenizing
def test_a_killed_prepare_leaves_no_worker_and_no_temporary_directory(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    tok_dir = tmp_path / "tok"
    subprocess.run(
        strata_command(
            "data", "prepare", str(small), "--tokenizer", "bpe:300", "--out", str(tok_dir)
        ),
        check=True,
        capture_output=True,
    )
    corpus = _corpus(tmp_path, files=4, mb=16)  # minutes of tokenizing per worker
    out = tmp_path / "out"
    argv = ["data", "prepare", str(corpus), "--tokenizer", str(tok_dir / "tokenizer.json")]
    proc = subprocess.Popen(
        strata_command(*argv, "--workers", "2", "--out", str(out)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    parent = psutil.Process(proc.pid)

    def workers() -> list[psutil.Process]:
        try:
            kids = parent.children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [k for k in kids if "spawn_main" in " ".join(_cmdline(k))]

    busy: list[psutil.Process] = []
    try:
        wait_for(lambda: len(workers()) == 2, 60, "two tokenizing workers")
        busy = workers()
        time.sleep(2)  # well inside their first tasks
        temporaries = list(tmp_path.glob(".out.tmp-*"))
        assert temporaries
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        gone = psutil.wait_procs(busy, timeout=15)[1]
        assert gone == [], f"workers outlived their killed parent: {gone}"
    finally:
        for k in busy:  # never left running, whatever failed
            if k.is_running():
                k.kill()
    # the next prepare of the same output clears what the killed one left
    subprocess.run(
        strata_command("data", "prepare", str(small), "--out", str(out)),
        check=True,
        capture_output=True,
    )
    assert list(tmp_path.glob(".out.tmp-*")) == [] and (out / "meta.json").exists()


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []
