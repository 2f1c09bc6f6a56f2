"""Staging a rank's state as the image of its checkpoint file: the plan (who writes which boxes,
where in the file), the blob templates written once per plan, and the per-save copy of the pieces
into a shared-memory buffer. Both the disk checkpoints (`checkpoint.manager`) and the in-memory
snapshots (`checkpoint.snapshot`) stage this way, so a snapshot holds exactly a checkpoint's bytes.

The copy is the only part of a save that stalls training, so everything around it is done once per
plan: the views of the image and of the pieces (`Sources`, checked piece by piece at every save),
and the finiteness check a checkpoint needs, with the parameters' largest magnitude, is made on
the bytes just copied, while they are in cache. On a GPU the pieces are copied device-to-host into
the pinned image on a side stream, every copy in flight at once, and checked on the device.
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.checkpoint.blob import object_bytes, template, torch_dtype
from strata.checkpoint.pieces import Piece
from strata.checkpoint.write_plan import Descriptor, Item, assign, dtype_name, place, tensor_index
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
        # Also if the image is dropped without close(): a mapping unmapped while CUDA still has it
        # registered makes a later, unrelated CUDA call fail (cudaErrorAlreadyMapped, seen on an
        # H200).
        self._release = weakref.finalize(
            self, _release, self.fd, self.tensor if self.pinned else None
        )
        # at exit the process's mappings go with it, and CUDA may be gone first
        self._release.atexit = False

    def close(self) -> None:
        """Unregister the image from CUDA, close its descriptor and unmap it (left to the process's
        exit while a view of it is still alive)."""
        self._release()
        self.tensor = None  # type: ignore[assignment]  # no view of the mapping may outlive close()
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass


def _release(fd: int, pinned: torch.Tensor | None) -> None:
    """Unregister an image's memory from CUDA and close its descriptor (the mapping has its own)."""
    if pinned is not None:
        unpin_host(pinned)
    os.close(fd)


def descriptor(p: Piece) -> Descriptor:
    """The piece without its tensor (key, global shape, dtype name, box): what ranks exchange to plan a save."""
    return Descriptor(p.key, tuple(p.global_shape), dtype_name(p.dtype), p.box)


def descriptors(pieces: list[Piece]) -> list[Descriptor]:
    """`descriptor` of every piece, in order."""
    return [descriptor(p) for p in pieces]


class Sources:
    """The source view of every item of one plan (elements [start, start + n) of its piece), made
    once and kept while its piece is unchanged: slicing ~120 views costs ~1 ms of Python a save, the
    copy of 2.85 MB through them 0.2 ms.

    `take(pieces)` checks each piece against the plan: one that is the same Piece object with the
    same tensor, address and dtype as at the last save costs four comparisons; any other (the RNG
    state is a new tensor at every save; a resume installs new optimizer state) is described again,
    compared with the plan's descriptor and has its views made again."""

    def __init__(self, items: list[Item], mine: list[Descriptor]):
        self.items, self.mine = items, mine
        self.by_piece: list[list[int]] = [[] for _ in mine]
        for j, it in enumerate(items):
            self.by_piece[it.piece].append(j)
        self.views: list[torch.Tensor | None] = [None] * len(items)
        self._seen: list[tuple] = [()] * len(mine)  # per piece: (Piece, tensor, address, dtype)

    def take(self, pieces: list[Piece]) -> bool:
        """Whether `pieces` hold the boxes this plan was made for (False: plan again); on True
        every item's view is of these pieces."""
        if len(pieces) != len(self.mine):
            return False
        seen = self._seen
        for i, p in enumerate(pieces):
            t = p.tensor
            s = seen[i]
            if s and s[0] is p and s[1] is t and s[2] == t.data_ptr() and s[3] is t.dtype:
                continue
            seen[i] = ()
            if descriptor(p) != self.mine[i]:
                return False
            contiguous = t.is_contiguous()
            flat = t.view(-1) if contiguous else t.reshape(-1)  # a copy, valid for this save only
            for j in self.by_piece[i]:
                it = self.items[j]
                self.views[j] = flat[it.start : it.start + it.box.numel]
            if contiguous:
                seen[i] = (p, t, t.data_ptr(), t.dtype)
        return True


@dataclass
class Staging:
    """This rank's file layout for one save plan: every rank's descriptors, this rank's items, its
    file's size, the index of the whole checkpoint, and the views its saves copy from."""

    descs: list
    items: list[Item]
    nbytes: int
    tensors: dict
    rank: int = 0
    image: SharedImage | None = field(default=None, repr=False)
    sources: Sources = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.sources = Sources(self.items, self.descs[self.rank])


def plan_staging(every: list[list[Descriptor]], rank: int) -> Staging:
    """The layout of `rank`'s file from every rank's descriptors (the same on every rank)."""
    placed = [place(items) for items in assign(every)]
    items, nbytes = placed[rank]
    return Staging(every, items, nbytes, tensor_index([p for p, _ in placed], every), rank)


def replan(pieces: list[Piece], rank: int, group) -> Staging:
    """A new plan from every rank's pieces (collective), its sources taken from `pieces`."""
    staging = plan_staging(comm.all_gather_objects(descriptors(pieces), group), rank)
    taken = staging.sources.take(pieces)
    assert taken  # planned from these very pieces
    return staging


def write_templates(image: torch.Tensor, items: list[Item]) -> None:
    """The torch.save header and trailer of every blob, around where its data goes."""
    arr = image.numpy()
    for it in items:
        head, tail = template(it.box.sizes, torch_dtype(it.dtype))
        arr[it.offset : it.offset + len(head)] = np.frombuffer(head, np.uint8)
        end = it.offset + it.length
        arr[end - len(tail) : end] = np.frombuffer(tail, np.uint8)


def copy_pieces(image: torch.Tensor, items: list[Item], pieces: list[Piece]) -> None:
    """Each item's elements of its piece into the image, every view made anew (offline tools; a
    training job's saves go through `image_views` and `stage`)."""
    for it in items:
        n = it.box.numel
        dst = image[it.data_offset : it.data_offset + n * torch_dtype(it.dtype).itemsize]
        dst.view(torch_dtype(it.dtype)).copy_(
            pieces[it.piece].tensor.reshape(-1)[it.start : it.start + n]
        )


# elements copied, then checked, at a time: 1 MiB of fp32 stays in cache between the two
CHECK_GRAIN = 1 << 18


def image_views(image: torch.Tensor, items: list[Item]) -> list[torch.Tensor]:
    """The view of `image` every item's data goes into (made once per plan and image)."""
    out = []
    for it in items:
        dtype = torch_dtype(it.dtype)
        out.append(
            image[it.data_offset : it.data_offset + it.box.numel * dtype.itemsize].view(dtype)
        )
    return out


def prepare_image(image: torch.Tensor, items: list[Item]) -> list[torch.Tensor]:
    """Ready `image` for a plan's saves: every blob's torch.save header and trailer written
    (`write_templates`); returns the views `stage` copies each item's data into (`image_views`)."""
    write_templates(image, items)
    return image_views(image, items)


@dataclass(frozen=True)
class StageCheck:
    """What `stage` found in the bytes it copied: whether every floating-point element is finite
    (True where that was not checked) and the largest magnitude among the bounded items' elements
    (0.0 where none is bounded or one is not finite)."""

    finite: bool = True
    largest: float = 0.0


def stage(
    dsts: list[torch.Tensor],
    sources: Sources,
    check_finite: bool = False,
    bounded: Sequence[bool] = (),
) -> StageCheck:
    """Copy every item's source view into its image view (the one per-save copy). With
    `check_finite`, also whether every floating-point element is finite, and for each item whose
    `bounded` flag is set its largest magnitude, both checked on each grain of the image just after
    it is copied (a second pass over the state would read it from memory again: a separate
    `_foreach_norm(inf)` over the parameters took longer than the whole copy; `isfinite().all()`
    would also allocate a bool per element)."""
    srcs = sources.views
    if any(s is not None and s.is_cuda for s in srcs):
        return _stage_from_device(dsts, srcs, check_finite, bounded)  # type: ignore[arg-type]
    if not check_finite:
        torch._foreach_copy_(dsts, srcs)  # type: ignore[arg-type]  # every view is set by take()
        return StageCheck()
    finite, largest = True, 0.0
    for i, (dst, src) in enumerate(zip(dsts, srcs)):
        assert src is not None  # set by Sources.take
        if not dst.is_floating_point():
            dst.copy_(src)
            continue
        measure = i < len(bounded) and bounded[i]
        for lo in range(0, max(dst.numel(), 1), CHECK_GRAIN):
            d = dst[lo : lo + CHECK_GRAIN]
            d.copy_(src[lo : lo + CHECK_GRAIN])
            if measure and d.numel():
                low, high = (float(x) for x in torch.aminmax(d))
                finite = finite and math.isfinite(low) and math.isfinite(high)
                largest = max(largest, -low, high)
            else:
                finite = finite and _finite(d)
    return StageCheck(finite, largest if finite else 0.0)


def _finite(t: torch.Tensor) -> bool:
    """Whether every element of a floating-point tensor is finite. A NaN or ±inf makes the sum
    non-finite, and a sum of finite elements is finite unless it overflows, which the exact check
    then settles. Measured on 200 MB of fp32, one core, just copied (in cache): the sum adds 8-24 %
    to the copy, aminmax (which also gives the magnitude) 29-33 %, the infinity norm 7×;
    `isfinite().all()` alone, which allocates a bool per element, takes 12× the copy."""
    return math.isfinite(t.sum().item()) or bool(torch.isfinite(t).all())


_SIDE_STREAMS: dict = {}


def _stage_from_device(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], check_finite: bool, bounded: Sequence[bool]
) -> StageCheck:
    """Pieces on a GPU: device-to-host copies into the (pinned) image, all queued on a side stream
    that first waits for the training stream's work, then one synchronisation; the finiteness
    check and the bounded items' magnitudes are computed on the device, so the host never reads the
    state."""
    device = next(s.device for s in srcs if s.is_cuda)
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    finite, largest, on_device, sizes = True, 0.0, [], []
    with torch.cuda.stream(stream):
        for i, (dst, src) in enumerate(zip(dsts, srcs)):
            if check_finite and src.is_floating_point() and src.numel():
                measure = i < len(bounded) and bounded[i]
                if src.is_cuda:
                    on_device.append(src.isfinite().all().float())
                    if measure:
                        sizes.append(src.detach().abs().amax().float())
                else:  # a host piece beside the GPU's (the CPU RNG state is not floating point)
                    finite = finite and _finite(src)
                    if measure:
                        largest = max(largest, float(src.abs().amax()))
            dst.copy_(src, non_blocking=src.is_cuda)
        flags = torch.stack(on_device).min() if on_device else None
        size = torch.stack(sizes).max() if sizes else None
    stream.synchronize()  # the image is complete, and the sources may change again
    finite = finite and (flags is None or bool(flags))
    if size is not None:
        largest = max(largest, float(size))
    return StageCheck(finite, largest if finite else 0.0)


def objects_blob(objects: dict) -> tuple[bytes, dict]:
    """Rank 0's non-tensor entries as one `__0_1.distcp` file's bytes, and where each one is."""
    blobs, where, pos = [], {}, 0
    for key, obj in objects.items():
        blobs.append(object_bytes(obj))
        where[key] = {"file": OBJECTS_FILE, "offset": pos, "length": len(blobs[-1])}
        pos += len(blobs[-1])
    return b"".join(blobs), where


def index_of(
    step: int, layout: dict, staging: Staging, objects_where: dict, aliases: dict[str, str]
) -> dict:
    """The checkpoint's index (`index.json`): tensors with their chunks, objects, aliases."""
    return {
        "step": step,
        "layout": layout,
        "tensors": staging.tensors,
        "objects": objects_where,
        "aliases": {a: k for a, k in aliases.items() if k in staging.tensors},
    }
