"""Who writes which bytes, and where: from every rank's pieces (`checkpoint.pieces`), each box held
by several ranks (dp replicas, tp-replicated norms, a tied weight on two stages) is split evenly
among its holders so every element is written exactly once and the writing is spread; then each
rank's items are laid out in its file as torch.save blobs (`checkpoint.blob`), which gives the
index of the whole checkpoint (`index.json`, and DCP's `.metadata` built from it).

Pure functions of the gathered piece descriptors, so every rank computes the same plan without
further communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.checkpoint import store
from strata.checkpoint.blob import template, torch_dtype
from strata.errors import CheckpointError
from strata.parallel.flat import Box, range_to_boxes

BLOB_ALIGN = 64  # torch.save aligns data to 64 bytes from the blob start: keep that in the file
FILE_ALIGN = 4096  # O_DIRECT writes whole pages


@dataclass(frozen=True)
class Descriptor:
    """A piece without its tensor: what ranks exchange to plan a save."""

    key: str
    global_shape: tuple[int, ...]
    dtype: str
    box: Box


@dataclass(frozen=True)
class Item:
    """One blob in a rank's file: `box` of `key`, copied from elements [start, start + box numel)
    of the rank's piece number `piece`."""

    key: str
    global_shape: tuple[int, ...]
    dtype: str
    box: Box
    piece: int
    start: int
    offset: int = 0  # of the blob in the file
    length: int = 0  # of the blob
    data_offset: int = 0  # of the raw data in the file


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as checkpoint indexes spell it: `torch.bfloat16` is "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def _any_overlap(boxes: list[Box]) -> bool:
    """Whether two boxes overlap: a sweep along dim 0, comparing each box only with those whose
    dim-0 range it starts inside (boxes from flat ranges are mostly disjoint in rows)."""
    if not boxes or not boxes[0].sizes:
        return len(boxes) > 1
    active: list[Box] = []
    for box in sorted(boxes, key=lambda b: b.offsets[0]):
        active = [a for a in active if a.offsets[0] + a.sizes[0] > box.offsets[0]]
        if any(a.intersect(box) for a in active):
            return True
        active.append(box)
    return False


def assign(descs: list[list[Descriptor]]) -> list[list[Item]]:
    """Each rank's items (unplaced): holder j of the m ranks holding the same box writes flat
    sub-range [j·n/m, (j+1)·n/m) of it. Raises if the boxes do not tile each tensor exactly once."""
    holders: dict[Descriptor, list[tuple[int, int]]] = {}
    for rank, pieces in enumerate(descs):
        for i, d in enumerate(pieces):
            holders.setdefault(d, []).append((rank, i))
    _check_tiling(holders)
    out: list[list[Item]] = [[] for _ in descs]
    for d, group in holders.items():
        n, m = math.prod(d.box.sizes), len(group)
        for j, (rank, i) in enumerate(group):
            lo, hi = j * n // m, (j + 1) * n // m
            for sub in range_to_boxes(d.box.sizes, lo, hi) if hi > lo else []:
                out[rank].append(
                    Item(d.key, d.global_shape, d.dtype, sub.shifted(d.box.offsets), i, lo)
                )
                lo += sub.numel
    return out


def _check_tiling(holders: dict[Descriptor, list]) -> None:
    """Distinct boxes of a tensor must not overlap and must cover it (else a dedup bug would write
    an incomplete or ambiguous checkpoint)."""
    by_key: dict[str, list[Descriptor]] = {}
    for d in holders:
        by_key.setdefault(d.key, []).append(d)
    problems = []
    for key, ds in by_key.items():
        shapes = {(d.global_shape, d.dtype) for d in ds}
        if len(shapes) > 1:
            problems.append(f"{key}: ranks disagree on its global shape/dtype {sorted(shapes)}")
            continue
        covered = sum(math.prod(d.box.sizes) for d in ds)
        if covered != math.prod(ds[0].global_shape):
            problems.append(
                f"{key}: the ranks' boxes cover {covered} of "
                f"{math.prod(ds[0].global_shape)} elements"
            )
        elif _any_overlap([d.box for d in ds]):
            problems.append(f"{key}: two ranks hold overlapping, different boxes")
    if problems:
        raise CheckpointError(
            "cannot save: the training state does not tile the global tensors (a bug in the "
            "layout code; please report it):\n  " + "\n  ".join(problems[:10])
        )


def place(items: list[Item]) -> tuple[list[Item], int]:
    """The items with their file positions, and the file's size (a multiple of FILE_ALIGN)."""
    out, pos = [], 0
    for it in items:
        pos = -(-pos // BLOB_ALIGN) * BLOB_ALIGN
        head, tail = template(it.box.sizes, torch_dtype(it.dtype))
        nbytes = math.prod(it.box.sizes) * torch_dtype(it.dtype).itemsize
        length = len(head) + nbytes + len(tail)
        out.append(
            Item(**{**it.__dict__, "offset": pos, "length": length, "data_offset": pos + len(head)})
        )
        pos += length
    return out, -(-pos // FILE_ALIGN) * FILE_ALIGN


def tensor_index(placed: list[list[Item]], descs: list[list[Descriptor]]) -> dict[str, dict]:
    """{key: {"shape", "dtype", "chunks": [{offsets, sizes, file, offset, length, data_offset}]}};
    a tensor with no elements has no chunks."""
    out: dict[str, dict] = {
        d.key: {"shape": list(d.global_shape), "dtype": d.dtype, "chunks": []}
        for rank_descs in descs
        for d in rank_descs
        if not math.prod(d.global_shape)
    }
    for rank, items in enumerate(placed):
        for it in items:
            entry = out.setdefault(
                it.key, {"shape": list(it.global_shape), "dtype": it.dtype, "chunks": []}
            )
            entry["chunks"].append(
                {
                    "offsets": list(it.box.offsets),
                    "sizes": list(it.box.sizes),
                    "file": store.data_file(rank),
                    "offset": it.offset,
                    "length": it.length,
                    "data_offset": it.data_offset,
                }
            )
    return out
