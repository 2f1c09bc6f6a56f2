"""The repository's layout: the code lives once, under strata/, and the top-level folders the layout
requires (parallel/, offload/, checkpoint/, trainer/, launch/) are symbolic links into it.

A clone without symbolic links (Windows without `core.symlinks`) checks each link out as a small
text file holding its target: these tests fail there, naming the fix, instead of the suite failing
somewhere else for a reason nobody can read. Reads the file system and git's index only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINKED = ("parallel", "offload", "checkpoint", "trainer", "launch")
FIX = (
    "clone with symbolic links: `git clone -c core.symlinks=true URL` (on Windows with Developer Mode on), "
    "or in this clone `git config core.symlinks true && git checkout -- " + " ".join(LINKED) + "`"
)


@pytest.mark.parametrize("name", LINKED)
def test_top_level_folder_is_a_link_into_strata(name):
    path = ROOT / name
    if path.is_file() and not path.is_symlink():
        text = path.read_text(errors="replace")[:80]
        pytest.fail(f"{name} is a plain file holding {text!r}, not a symbolic link: {FIX}")
    assert path.is_symlink(), f"{name} is missing or not a symbolic link to strata/{name}: {FIX}"
    assert os.readlink(path) == f"strata/{name}", (
        f"{name} links to {os.readlink(path)!r}, not strata/{name}"
    )
    assert path.resolve() == (ROOT / "strata" / name).resolve()


@pytest.mark.parametrize("name", LINKED)
def test_the_code_lives_under_strata(name):
    folder = ROOT / "strata" / name
    assert folder.is_dir() and not folder.is_symlink(), (
        f"strata/{name} must be the real folder, not a link"
    )
    assert (folder / "__init__.py").is_file(), f"strata/{name} has no __init__.py"


def test_no_other_links_under_strata():
    """Every module has one path: nothing under strata/ is reached through a link."""
    links = [str(p.relative_to(ROOT)) for p in (ROOT / "strata").rglob("*") if p.is_symlink()]
    assert not links, f"symbolic links under strata/ give modules a second name: {links}"


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout"
)
def test_git_records_the_links_as_links():
    """git's index holds each top-level folder as a link (mode 120000) and the files under strata/,
    so `git blame strata/parallel/comm.py` and `git log --follow` work on the path tracebacks print."""
    out = subprocess.run(
        ["git", "ls-files", "-s", "--", *LINKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    modes = {line.split("\t")[1]: line.split()[0] for line in out}
    assert modes == dict.fromkeys(LINKED, "120000"), (
        f"git's index should hold only links for {LINKED}: {modes}"
    )
    tracked = subprocess.run(
        ["git", "ls-files", "--", "strata/parallel/comm.py", "strata/trainer/loop.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert tracked == ["strata/parallel/comm.py", "strata/trainer/loop.py"]
