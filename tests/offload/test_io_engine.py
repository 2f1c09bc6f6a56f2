"""The swap I/O engine (strata/offload/io_engine.py): aligned O_DIRECT reads and writes on a thread pool
come back byte for byte, and every failure names the file, offset, size and errno; a swap directory
that cannot hold the state is refused at start-up."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from strata.offload.io_engine import ALIGN, IOEngine, SwapIOError, check_swap_dir


def aligned(nbytes: int) -> torch.Tensor:
    """A page-aligned host buffer (what the offload buffer pool hands out)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def test_written_bytes_read_back_identical_across_chunks_and_threads(tmp_path):
    n = 5 * 64 * ALIGN + 3 * ALIGN  # 5 full chunks and a short one
    data = aligned(n)
    data.copy_(
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    )
    engine = IOEngine(threads=3, chunk_bytes=64 * ALIGN)
    try:
        first, second = (
            engine.write(tmp_path / "a.swap", data),
            engine.write(tmp_path / "b.swap", data[: 2 * ALIGN]),
        )
        first.wait()
        second.wait()
        back = aligned(n)
        engine.read(tmp_path / "a.swap", back).wait()
        assert torch.equal(back, data)
        middle = aligned(2 * ALIGN)
        engine.read(tmp_path / "a.swap", middle, offset=64 * ALIGN).wait()  # a range of the file
        assert torch.equal(middle, data[64 * ALIGN : 66 * ALIGN])
        assert os.path.getsize(tmp_path / "a.swap") == n
        assert (engine.bytes_written, engine.bytes_read) == (n + 2 * ALIGN, n + 2 * ALIGN)
    finally:
        engine.close()


def test_a_failed_read_names_file_offset_size_and_errno(tmp_path):
    engine = IOEngine(threads=1)
    try:
        engine.write(tmp_path / "short.swap", aligned(ALIGN)).wait()
        with pytest.raises(
            SwapIOError,
            match=r"read of 4096 bytes at offset 4096 of .*short\.swap failed: .*"
            r"\(errno \d+ ENODATA\)",
        ):
            engine.read(tmp_path / "short.swap", aligned(2 * ALIGN)).wait()
    finally:
        engine.close()


def test_unaligned_buffers_are_refused_before_any_io(tmp_path):
    engine = IOEngine(threads=1)
    try:
        with pytest.raises(ValueError, match="4096-byte alignment"):
            engine.write(tmp_path / "x.swap", aligned(2 * ALIGN)[1 : ALIGN + 1])
        with pytest.raises(ValueError, match="file offset"):
            engine.write(tmp_path / "x.swap", aligned(ALIGN), offset=100)
        assert not (tmp_path / "x.swap").exists()
    finally:
        engine.close()


def test_swap_directory_is_checked_at_start_up(tmp_path):
    check_swap_dir(tmp_path / "swap", ALIGN)  # fine: created, probed, and left clean
    assert list((tmp_path / "swap").iterdir()) == []
    with pytest.raises(SwapIOError, match=r"GiB free, the swapped state needs .* GiB"):
        check_swap_dir(tmp_path / "swap", 1 << 60)
    (tmp_path / "file").write_text("")
    with pytest.raises(SwapIOError, match="cannot create it"):
        check_swap_dir(tmp_path / "file" / "swap", ALIGN)
