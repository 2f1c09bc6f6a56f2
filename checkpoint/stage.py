"""Staging a rank's state as the image of its checkpoint file: the plan (who writes which boxes,
where in the file), the blob templates written once per plan, and the per-save copy of the pieces
into a shared-memory buffer. Both the disk checkpoints (`checkpoint.manager`) and the in-memory
snapshots (`checkpoint.snapshot`) stage this way, so a snapshot holds exactly a checkpoint's bytes.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.checkpoint.blob import object_bytes, template
from strata.checkpoint.pieces import Piece
from strata.checkpoint.plan import Descriptor, Item, assign, dtype_name, place, tensor_index, torch_dtype
from strata.parallel import comm
from strata.parallel.runtime import pin_host, unpin_host

OBJECTS_FILE = "__0_1.distcp"


class SharedImage:
    """A page-aligned shared-memory buffer (a memfd) another process can map by descriptor."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.fd = (
            os.memfd_create("strata-ckpt-staging")
            if hasattr(os, "memfd_create")
            else os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
        )
        os.ftruncate(self.fd, max(nbytes, 1))
        self.map = mmap.mmap(self.fd, max(nbytes, 1))
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)[:nbytes]
        self.tensor.zero_()  # fault the pages in now, not during the first save's copy
        self.pinned = pin_host(self.tensor)  # copies from a GPU then run at full speed

    def close(self) -> None:
        if self.pinned:
            unpin_host(self.tensor)
        self.tensor = None  # type: ignore[assignment]  # no view of the mapping may outlive close()
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        os.close(self.fd)


@dataclass
class Staging:
    """This rank's file layout for one save plan: every rank's descriptors, this rank's items, its
    file's size, and the index of the whole checkpoint."""

    descs: list
    items: list[Item]
    nbytes: int
    tensors: dict
    image: SharedImage | None = field(default=None, repr=False)


def descriptors(pieces: list[Piece]) -> list[Descriptor]:
    return [Descriptor(p.key, tuple(p.global_shape), dtype_name(p.dtype), p.box) for p in pieces]


def plan_staging(every: list[list[Descriptor]], rank: int) -> Staging:
    """The layout of `rank`'s file from every rank's descriptors (the same on every rank)."""
    placed = [place(items) for items in assign(every)]
    items, nbytes = placed[rank]
    return Staging(every, items, nbytes, tensor_index([p for p, _ in placed], every))


def gather_plan(previous: Staging | None, pieces: list[Piece], rank: int, group) -> tuple[Staging, bool]:
    """The staging plan for these pieces (collective): `previous` while every rank holds what it
    held then (the usual case: shapes and layout are fixed for a run), else planned again from every
    rank's pieces. Returns (plan, whether it is new)."""
    descs = descriptors(pieces)
    same = previous is not None and previous.descs[rank] == descs
    if comm.all_true(same, group, dim="checkpoint"):
        assert previous is not None  # every rank, this one too, had the same plan
        return previous, False
    return plan_staging(comm.all_gather_objects(descs, group), rank), True


def write_templates(image: torch.Tensor, items: list[Item]) -> None:
    """The torch.save header and trailer of every blob, around where its data goes."""
    arr = image.numpy()
    for it in items:
        head, tail = template(it.box.sizes, torch_dtype(it.dtype))
        arr[it.offset : it.offset + len(head)] = np.frombuffer(head, np.uint8)
        end = it.offset + it.length
        arr[end - len(tail) : end] = np.frombuffer(tail, np.uint8)


def copy_pieces(image: torch.Tensor, items: list[Item], pieces: list[Piece]) -> None:
    """Each item's elements of its piece into the image (the one per-save copy)."""
    for it in items:
        n = it.box.numel
        dst = image[it.data_offset : it.data_offset + n * torch_dtype(it.dtype).itemsize]
        dst.view(torch_dtype(it.dtype)).copy_(pieces[it.piece].tensor.reshape(-1)[it.start : it.start + n])


def objects_blob(objects: dict) -> tuple[bytes, dict]:
    """Rank 0's non-tensor entries as one `__0_1.distcp` file's bytes, and where each one is."""
    blobs, where, pos = [], {}, 0
    for key, obj in objects.items():
        blobs.append(object_bytes(obj))
        where[key] = {"file": OBJECTS_FILE, "offset": pos, "length": len(blobs[-1])}
        pos += len(blobs[-1])
    return b"".join(blobs), where


def index_of(step: int, layout: dict, staging: Staging, objects_where: dict, aliases: dict[str, str]) -> dict:
    """The checkpoint's index (`index.json`): tensors with their chunks, objects, aliases."""
    return {
        "step": step,
        "layout": layout,
        "tensors": staging.tensors,
        "objects": objects_where,
        "aliases": {a: k for a, k in aliases.items() if k in staging.tensors},
    }
