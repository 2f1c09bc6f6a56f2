"""Reading a committed checkpoint into any layout: each wanted box (a `Piece` of the loading rank)
is intersected with the saved chunks of its tensor, and just the bytes of each intersection are
read — verifying the CRC-32C of every 256 KiB block they touch — and copied into place.

Written instead of using DCP's FileSystemReader, which torch.loads every whole saved chunk an
intersection touches and copies it again, and which needs DTensor/ShardedTensor destinations
(DTensor cannot express ZeRO's flat-range shards); measured 1.6–24× faster
(docs/design/checkpoint.md §2.3).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.checkpoint import integrity, store
from strata.checkpoint.blob import torch_dtype
from strata.checkpoint.pieces import Piece, whole_piece
from strata.errors import CheckpointError
from strata.parallel.flat import Box


def _strides(sizes) -> list[int]:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return out[::-1]


@dataclass
class _Read:
    """One intersection to read: `sizes` at `offsets` (global) of a target, from a saved chunk."""

    target: Piece
    key: str
    dtype: torch.dtype
    chunk: dict
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self):
        self.strides = _strides(self.chunk["sizes"])
        rel = [o - c for o, c in zip(self.offsets, self.chunk["offsets"])]
        first = sum(r * s for r, s in zip(rel, self.strides))
        last = sum((r + n - 1) * s for r, n, s in zip(rel, self.sizes, self.strides))
        self.lo = self.chunk["data_offset"] + first * self.dtype.itemsize
        self.hi = self.chunk["data_offset"] + (last + 1) * self.dtype.itemsize
        self.contiguous = last - first + 1 == math.prod(self.sizes)  # one run of bytes in the file


# bytes of the reads after the current one the kernel is asked to fetch meanwhile
READ_AHEAD = 64 << 20


class _ReadAhead:
    """Asks the kernel (POSIX_FADV_WILLNEED) to start reading the next READ_AHEAD bytes of a
    load's reads while the current one is copied and checked: the disk queue stays full instead
    of idling during each read's CPU work, as sequential reads of 1–20 MB boxes otherwise let it."""

    def __init__(self, ckpt: Checkpoint, reads: list[_Read]):
        self.ckpt, self.reads = ckpt, reads
        self.next = 0  # the first read not advised yet
        self.advised = 0  # bytes advised so far, of reads[:next]
        self.consumed = 0  # bytes of the reads before the current one

    def advise(self, i: int) -> None:
        """Before read `i`: count the reads done, and advise the kernel of the next ones until
        READ_AHEAD bytes are ahead."""
        if i:
            self.consumed += self.reads[i - 1].hi - self.reads[i - 1].lo
        while self.next < len(self.reads) and (
            self.next <= i or self.advised - self.consumed < READ_AHEAD
        ):
            r = self.reads[self.next]
            name = r.chunk["file"]
            want = self.ckpt.files.get(name)
            if want is not None and r.hi <= want["bytes"]:
                block = want.get("block") or max(want["bytes"], 1)
                lo, hi = r.lo // block * block, min(-(-r.hi // block) * block, want["bytes"])
                # only advice: the read itself reports what is wrong
                with contextlib.suppress(OSError):
                    base = self.ckpt._bases.get(name, 0)
                    os.posix_fadvise(
                        self.ckpt._fd(name), base + lo, hi - lo, os.POSIX_FADV_WILLNEED
                    )
            self.advised += r.hi - r.lo
            self.next += 1


class Checkpoint:
    """A committed checkpoint directory opened for reading: its marker, index and file manifest
    (structure, sizes and small files checked on opening, as `strata ckpt verify` checks them;
    block checksums as data is read). `problems` lists the damage found on opening."""

    def __init__(self, path: Path):
        self.path = store.resolve(path)
        self.marker = store.marker(self.path)
        # the structural check `strata ckpt verify` makes too; block checksums as data is read
        self.index, self.problems = integrity.checkpoint_problems(
            self.path, self.marker, checksums=False
        )
        self.files: dict[str, dict] = self.marker["files"]
        self._fds: dict[str, int] = {}
        # where each file starts in its descriptor (0 for real files)
        self._bases: dict[str, int] = {}
        self.checksummed = True
        self._verified: dict[str, set[int]] = {}  # blocks whose CRC was checked, per file
        self._window: dict[str, tuple[int, int, torch.Tensor]] = {}  # the last bytes read, per file

    @classmethod
    def from_images(
        cls, label: str, step: int, index: dict, files: dict[str, tuple[int, int, int]]
    ) -> Checkpoint:
        """A checkpoint held in memory (an in-memory snapshot): `files` maps each file name of the
        index to (descriptor, offset of the file in it, bytes). The images were checked as wholes
        when they were assembled, so reads are not verified per block."""
        self = cls.__new__(cls)
        self.path = Path(label)
        self.marker = {"step": step}
        self.files = {name: {"bytes": n} for name, (_, _, n) in files.items()}
        self.problems, self.index, self.checksummed = [], index, False
        self._fds = {name: fd for name, (fd, _, _) in files.items()}
        self._bases = {name: base for name, (_, base, _) in files.items()}
        self._verified, self._window = {}, {}
        return self

    @classmethod
    def foreign(
        cls, path: Path, index: dict, file_bytes: dict[str, int], step: int = 0
    ) -> Checkpoint:
        """Files another tool wrote (a Hugging Face model's safetensors, a plain DCP save), read in
        place through an `index` built from their own headers. They carry no checksums; their sizes
        are checked against what the index points at, as for Strata's own."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self.marker = {"step": step}
        self.files = {name: {"bytes": n} for name, n in file_bytes.items()}
        self.problems, self.index, self.checksummed = [], index, False
        self._fds, self._bases, self._verified, self._window = {}, {}, {}, {}
        return self

    @property
    def step(self) -> int:
        """The step the checkpoint was saved at (-1 when its marker has none)."""
        return int(self.marker.get("step", -1))

    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """{name without prefix: global shape} of the tensors under `prefix`, aliases included."""
        tensors = self.index["tensors"]
        keys = {**{k: k for k in tensors}, **self.index.get("aliases", {})}
        return {
            k[len(prefix) :]: tuple(tensors[src]["shape"])
            for k, src in keys.items()
            if k.startswith(prefix)
        }

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds tensor `key` (itself, or as an alias of a tied tensor)."""
        return self.index.get("aliases", {}).get(key, key) in self.index["tensors"]

    def has_object(self, key: str) -> bool:
        """Whether the checkpoint holds object `key` (rank 0's: the trainer's state, the optimizer's
        hyper-parameters)."""
        return key in self.index.get("objects", {})

    def object(self, key: str):
        """A non-tensor entry (trainer state, optimizer hyper-parameters), loaded with weights_only."""
        where = self.index["objects"].get(key)
        if where is None:
            raise CheckpointError(f"{self.path}: the checkpoint has no {key!r} entry")
        data = self._bytes(
            where["file"], where["offset"], where["offset"] + where["length"], self.checksummed, key
        )
        return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=True)

    # --- tensors ---------------------------------------------------------------------------
    def tensors(self, prefix: str = "model.") -> dict[str, torch.Tensor]:
        """Whole tensors under `prefix` (aliases included, as copies), by name without the prefix."""
        if self.problems:
            raise CheckpointError(
                f"checkpoint {self.path} is damaged:\n  " + "\n  ".join(self.problems)
            )
        names = [
            k
            for k in [*self.index["tensors"], *self.index.get("aliases", {})]
            if k.startswith(prefix)
        ]
        out = {}
        for key in names:
            entry = self.index["tensors"][self.index.get("aliases", {}).get(key, key)]
            shape = tuple(entry["shape"])
            out[key] = whole_piece(key, torch.empty(shape, dtype=torch_dtype(entry["dtype"])))
        problems = self.read(list(out.values()))
        if problems:
            raise CheckpointError(f"checkpoint {self.path} is damaged:\n  " + "\n  ".join(problems))
        return {k[len(prefix) :]: p.tensor for k, p in out.items()}

    def read(self, targets: list[Piece], verify: bool = True) -> list[str]:
        """Fill each target's tensor with its box of the saved tensor; returns the problems (missing
        keys, shape mismatches, uncovered boxes, checksum mismatches), one line each. Reads go in
        file order, so neighbouring small boxes share one read (and one check) of their blocks."""
        problems, reads = [], []
        verify = verify and self.checksummed
        for t in targets:
            key = self.index.get("aliases", {}).get(t.key, t.key)
            entry = self.index["tensors"].get(key)
            if entry is None:
                problems.append(f"{self.path}: no tensor {t.key}")
                continue
            if tuple(entry["shape"]) != tuple(t.global_shape):
                problems.append(
                    f"{self.path}: {t.key} has shape {tuple(entry['shape'])}, the model's is "
                    f"{tuple(t.global_shape)}"
                )
                continue
            covered = 0
            for chunk in entry["chunks"]:
                found = t.box.intersect(Box(tuple(chunk["offsets"]), tuple(chunk["sizes"])))
                if found is not None:
                    reads.append(
                        _Read(
                            t, key, torch_dtype(entry["dtype"]), chunk, found.offsets, found.sizes
                        )
                    )
                    covered += found.numel
            if covered != math.prod(t.box.sizes):
                problems.append(
                    f"{self.path}: {t.key} box at {t.box.offsets} of size {t.box.sizes} is only "
                    "partly saved"
                )
        ordered = sorted(reads, key=lambda r: (r.chunk["file"], r.lo))
        ahead = _ReadAhead(self, ordered)
        for i, r in enumerate(ordered):
            try:
                ahead.advise(i)
                self._copy(r, verify)
            except CheckpointError as e:
                problems.append(str(e))
        self._window.clear()
        return problems

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.path / name, os.O_RDONLY)
        return fd

    def _copy(self, r: _Read, verify: bool) -> None:
        dst = r.target.tensor[
            tuple(
                slice(o - b, o - b + n) for o, b, n in zip(r.offsets, r.target.box.offsets, r.sizes)
            )
        ]
        if (
            r.contiguous
            and dst.is_contiguous()
            and dst.dtype == r.dtype
            and dst.device.type == "cpu"
        ):
            into = dst.reshape(-1).view(torch.uint8)
            self._bytes(r.chunk["file"], r.lo, r.hi, False, r.key, into=into)  # straight into place
            if verify:
                self._verify_in_place(r, into)
            return
        data = self._bytes(r.chunk["file"], r.lo, r.hi, verify, r.key)
        src = data.view(r.dtype)
        dst.copy_(src.as_strided(r.sizes, r.strides) if r.sizes else src.view(()))

    def _verify_in_place(self, r: _Read, data: torch.Tensor) -> None:
        """Check the blocks under bytes [r.lo, r.hi) of the file just read into `data`: blocks wholly
        inside from `data` itself, the (at most two) partial ones at the ends by reading them."""
        name = r.chunk["file"]
        want = self.files[name]
        block = want.get("block") or max(want["bytes"], 1)
        first, end = -(-r.lo // block), r.hi // block  # blocks wholly inside
        if first < end:
            self._verify(
                name,
                want,
                data[first * block - r.lo : end * block - r.lo],
                first * block,
                block,
                r.key,
            )
        for i in (
            {r.lo // block, (r.hi - 1) // block}
            - set(range(first, end))
            - self._verified.get(name, set())
        ):
            lo, hi = i * block, min((i + 1) * block, want["bytes"])
            self._bytes(name, lo, hi, True, r.key)

    def _bytes(
        self, name: str, lo: int, hi: int, verify: bool, key: str, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Bytes [lo, hi) of a file (as uint8), or read into `into`. With `verify`, whole checksum
        blocks are read and each is checked once; the last read stays as a window later reads of
        the same bytes are served from."""
        want = self.files.get(name)
        if want is None or hi > want["bytes"] or lo < 0:
            raise CheckpointError(
                f"{self.path}: the index points {key} at bytes {lo}–{hi} of {name}, which the "
                "commit marker does not have (a damaged index)"
            )
        window = self._window.get(name)
        if into is None and window is not None and window[0] <= lo and hi <= window[1]:
            return window[2][lo - window[0] : hi - window[0]]
        fd = self._fd(name)
        block = want.get("block") or max(want["bytes"], 1)  # a small file has one CRC for all of it
        blo, bhi = (
            (lo // block * block, min(-(-hi // block) * block, want["bytes"]))
            if verify
            else (lo, hi)
        )
        buf = (
            into.reshape(-1).view(torch.uint8)
            if into is not None
            else torch.empty(bhi - blo, dtype=torch.uint8)
        )
        if (
            bhi > blo
            and os.preadv(fd, [buf.numpy().data], blo + self._bases.get(name, 0)) != bhi - blo
        ):
            raise CheckpointError(
                f"{self.path / name}: short read at offset {blo} (truncated while loading?)"
            )
        if verify:
            self._verify(name, want, buf, blo, block, key)
        self._window[name] = (blo, bhi, buf)
        return buf[lo - blo : hi - blo]

    def _verify(
        self, name: str, want: dict, buf: torch.Tensor, start: int, block: int, key: str
    ) -> None:
        """Check the blocks of `buf` (file bytes from `start`, a block boundary) not checked before."""
        crcs = integrity.checksums_of(want)
        done = self._verified.setdefault(name, set())
        data = buf.numpy().data
        for i in range(start // block, start // block + -(-len(data) // block)):
            if i not in done:
                piece = data[i * block - start : (i + 1) * block - start]
                if integrity.checksum(piece) != crcs[i]:
                    raise CheckpointError(
                        f"{self.path / name}: checksum mismatch in block {i} (bytes {i * block}–"
                        f"{i * block + len(piece)}), which holds {key} (corrupted)"
                    )
                done.add(i)

    def close(self) -> None:
        """Close every data file the reads opened."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
