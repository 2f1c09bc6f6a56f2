"""Byte templates for torch.save archives of one tensor, so a box can be written as raw bytes between
a fixed header and trailer and still be a complete torch.save file (what DCP's reader loads).

Two torch.save archives of same-shape, same-dtype tensors differ only in their data bytes once
zip CRCs are off (`serialization_id` is constant), so the header and trailer are computed once per
(shape, dtype) by a dry run that never touches the data (docs/design/checkpoint.md §1.3).
"""

from __future__ import annotations

import functools
import io
from typing import IO, cast

import torch
from torch.utils.serialization import config as serialization_config

from strata.errors import CheckpointError


class _DryRun(io.RawIOBase):
    """A stream torch.save writes into: keeps every write except the tensor's data, which is found
    by its address (a metadata record can have the same length as the data)."""

    def __init__(self, data_ptr: int, nbytes: int):
        self.parts: list[bytes | None] = []
        self.ptr, self.nbytes = data_ptr, nbytes

    def writable(self) -> bool:
        """Always True: torch.save only writes to a writable stream."""
        return True

    def write(self, b) -> int:
        """Keep a copy of `b`, or a placeholder where it is the tensor's data itself; returns the
        bytes taken."""
        view = memoryview(b)
        if self.nbytes and view.nbytes == self.nbytes and _address(view) == self.ptr:
            self.parts.append(None)
        else:
            self.parts.append(bytes(view))
        return view.nbytes


def _address(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view.cast("B"), np.uint8).ctypes.data


@functools.lru_cache(maxsize=4096)
def template(sizes: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, bytes]:
    """(head, tail): head + the tensor's row-major bytes + tail is exactly what torch.save writes
    for a contiguous tensor of this shape and dtype (with zip CRCs off and 64-byte alignment)."""
    t = torch.empty(sizes, dtype=dtype)  # never written to: its pages are never touched
    nbytes = t.numel() * t.element_size()
    config = serialization_config.save
    saved = config.compute_crc32, config.storage_alignment
    config.compute_crc32, config.storage_alignment = False, 64
    try:
        sink = _DryRun(t.data_ptr(), nbytes)
        torch.save(t, cast(IO[bytes], sink))  # a RawIOBase; torch.save's annotation names IO[bytes]
    finally:
        config.compute_crc32, config.storage_alignment = saved
    if not nbytes:
        return b"".join(p for p in sink.parts if p is not None), b""
    i = sink.parts.index(None)
    return b"".join(sink.parts[:i]), b"".join(sink.parts[i + 1 :])  # type: ignore[arg-type]


def object_bytes(obj) -> bytes:
    """A non-tensor value as DCP stores it (its BYTE_IO entries): torch.save bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype an index's name spells; CheckpointError for a name torch does not have."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint index")
    return dtype
