"""Reading a committed checkpoint into any layout: each wanted box (a `Piece` of the loading rank)
is intersected with the saved chunks of its tensor, and just the bytes of each intersection are
read — verifying the CRC of every 8 MiB block they touch — and copied into place.

Written instead of using DCP's FileSystemReader, which torch.loads every whole saved chunk an
intersection touches and copies it again, and which needs DTensor/ShardedTensor destinations
(DTensor cannot express ZeRO's flat-range shards); measured 1.6–24× faster
(docs/design/checkpoint.md §2.3).
"""
from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import torch

from checkpoint import integrity, store
from checkpoint.pieces import Piece
from checkpoint.plan import torch_dtype
from parallel.flat import Box
from trainer.errors import CheckpointError


def _intersect(a_off, a_size, b_off, b_size) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_size, b_off, b_size)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


def _strides(sizes) -> list[int]:
    out, acc = [], 1
    for s in reversed(sizes):
        out.append(acc)
        acc *= s
    return out[::-1]


class Checkpoint:
    """A committed checkpoint directory opened for reading: its marker, index and file manifest
    (sizes checked on opening, block checksums as data is read)."""

    def __init__(self, path: Path):
        self.path = store.resolve(path)
        self.marker = store.marker(self.path)
        self.files: dict[str, dict] = self.marker.get("files", {})
        if not isinstance(self.files, dict) or "index.json" not in self.files:
            raise CheckpointError(f"{self.path} is not in this version's checkpoint format (no index.json in its "
                                  "commit marker); it was written by an older Strata")
        self.problems = self._file_problems()
        self.index: dict = {"tensors": {}, "aliases": {}, "objects": {}}
        if not any("index.json" in p for p in self.problems):
            data = (self.path / "index.json").read_bytes()
            if integrity.crc32(data) != self.files["index.json"]["crc32"]:
                self.problems.append(f"{self.path / 'index.json'}: checksum does not match the commit marker (corrupted)")
            else:
                self.index = json.loads(data)
        self._fds: dict[str, int] = {}

    def _file_problems(self) -> list[str]:
        out = []
        for name, want in self.files.items():
            path = self.path / name
            if not path.is_file():
                out.append(f"{path}: missing")
            elif path.stat().st_size != want["bytes"]:
                out.append(f"{path}: {path.stat().st_size} bytes, the manifest says {want['bytes']} (truncated or "
                           "rewritten)")
        return out

    @property
    def step(self) -> int:
        return int(self.marker.get("step", -1))

    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """{name without prefix: global shape} of the tensors under `prefix`, aliases included."""
        tensors = self.index["tensors"]
        keys = {**{k: k for k in tensors}, **self.index.get("aliases", {})}
        return {k[len(prefix):]: tuple(tensors[src]["shape"]) for k, src in keys.items() if k.startswith(prefix)}

    def has(self, key: str) -> bool:
        return self.index.get("aliases", {}).get(key, key) in self.index["tensors"]

    def object(self, key: str):
        """A non-tensor entry (trainer state, optimizer hyper-parameters), loaded with weights_only."""
        where = self.index["objects"].get(key)
        if where is None:
            raise CheckpointError(f"{self.path}: the checkpoint has no {key!r} entry")
        data = self._span(where["file"], where["offset"], where["offset"] + where["length"], verify=True, key=key)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    # --- tensors ---------------------------------------------------------------------------
    def tensors(self, prefix: str = "model.") -> dict[str, torch.Tensor]:
        """Whole tensors under `prefix` (aliases included, as copies), by name without the prefix."""
        if self.problems:
            raise CheckpointError(f"checkpoint {self.path} is damaged:\n  " + "\n  ".join(self.problems))
        names = [k for k in [*self.index["tensors"], *self.index.get("aliases", {})] if k.startswith(prefix)]
        out = {}
        for key in names:
            entry = self.index["tensors"][self.index.get("aliases", {}).get(key, key)]
            shape = tuple(entry["shape"])
            out[key] = Piece(key, shape, Box((0,) * len(shape), shape), torch.empty(shape, dtype=torch_dtype(entry["dtype"])))
        problems = self.read(list(out.values()))
        if problems:
            raise CheckpointError(f"checkpoint {self.path} is damaged:\n  " + "\n  ".join(problems))
        return {k[len(prefix):]: p.tensor for k, p in out.items()}

    def read(self, targets: list[Piece], verify: bool = True) -> list[str]:
        """Fill each target's tensor with its box of the saved tensor; returns the problems (missing
        keys, shape mismatches, uncovered boxes, checksum mismatches), one line each."""
        problems = []
        for t in targets:
            key = self.index.get("aliases", {}).get(t.key, t.key)
            entry = self.index["tensors"].get(key)
            if entry is None:
                problems.append(f"{self.path}: no tensor {t.key}")
                continue
            if tuple(entry["shape"]) != tuple(t.global_shape):
                problems.append(f"{self.path}: {t.key} has shape {tuple(entry['shape'])}, the model's is "
                                f"{tuple(t.global_shape)}")
                continue
            covered = 0
            for chunk in entry["chunks"]:
                found = _intersect(t.box.offsets, t.box.sizes, chunk["offsets"], chunk["sizes"])
                if found is None:
                    continue
                try:
                    self._copy(t, key, torch_dtype(entry["dtype"]), chunk, *found, verify)
                except CheckpointError as e:
                    problems.append(str(e))
                covered += math.prod(found[1])
            if covered != math.prod(t.box.sizes):
                problems.append(f"{self.path}: {t.key} box at {t.box.offsets} of size {t.box.sizes} is only partly "
                                "saved")
        return problems

    def _copy(self, target: Piece, key: str, dtype: torch.dtype, chunk: dict, offsets, sizes, verify: bool) -> None:
        strides = _strides(chunk["sizes"])
        rel = [o - c for o, c in zip(offsets, chunk["offsets"])]
        first = sum(r * s for r, s in zip(rel, strides))
        last = sum((r + n - 1) * s for r, n, s in zip(rel, sizes, strides))
        es = dtype.itemsize
        lo = chunk["data_offset"] + first * es
        data = self._span(chunk["file"], lo, lo + (last - first + 1) * es, verify, key)
        src = torch.frombuffer(data, dtype=dtype).as_strided(sizes, strides) if sizes else \
            torch.frombuffer(data, dtype=dtype).view(())
        dst = target.tensor[tuple(slice(o - b, o - b + n) for o, b, n in zip(offsets, target.box.offsets, sizes))]
        dst.copy_(src.to(dst.dtype))

    def _span(self, name: str, lo: int, hi: int, verify: bool, key: str) -> bytearray | memoryview:
        """Bytes [lo, hi) of a file; with `verify`, read whole checksum blocks and check them."""
        want = self.files.get(name)
        if want is None:
            raise CheckpointError(f"{self.path / name}: not in the commit marker, but the index points {key} at it")
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.path / name, os.O_RDONLY)
        block = want.get("block")
        if not verify or hi == lo:
            buf = bytearray(hi - lo)
            os.preadv(fd, [buf], lo)
            return buf
        if block is None:  # a small file with one CRC: read it whole
            blo, bhi = 0, want["bytes"]
        else:
            blo, bhi = lo // block * block, min(-(-hi // block) * block, want["bytes"])
        buf = bytearray(bhi - blo)
        if os.preadv(fd, [buf], blo) != len(buf):
            raise CheckpointError(f"{self.path / name}: short read at offset {blo} (truncated while loading?)")
        crcs = [want["crc32"]] if block is None else want["block_crc32"][blo // block:-(-bhi // block)]
        step = len(buf) if block is None else block
        for i, crc in enumerate(crcs):
            if integrity.crc32(memoryview(buf)[i * step:(i + 1) * step]) != crc:
                where = f"block {blo // step + i} (bytes {blo + i * step}–{min(blo + (i + 1) * step, bhi)})"
                raise CheckpointError(f"{self.path / name}: checksum mismatch in {where}, which holds {key} "
                                      "(corrupted)")
        return memoryview(buf)[lo - blo:hi - blo]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
