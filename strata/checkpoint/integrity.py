"""Integrity of checkpoint files: each file's size and CRC-32C — per 256 KiB block for the large
data files, so a loader verifies just the blocks it reads — recorded in the commit marker, and a
check of a directory against it that names every missing, truncated or altered file before
anything is loaded. CRC-32C through the `crc32c` package (the CPU's CRC instruction, ~15 GB/s per
core here, 4× zlib's CRC-32; it releases the GIL), so checksums cost little beside the I/O.

`checkpoint_problems` is the one structural check of a committed checkpoint that `strata ckpt
verify`, `inspect`, `export` and `--resume` all make, so no checkpoint passes one and fails another:
the marker's files, the small files' checksums, and an index that points only at bytes inside the
checkpoint's own files. Only verify also reads every data block (a load checks the blocks it reads)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TypeGuard

import crc32c

from strata.errors import CheckpointError

MARKER = "COMMITTED"
# written by every commit, read by DCP or export
REQUIRED = ("index.json", ".metadata", "config.yaml")
_PLAIN_NAME = re.compile(r"^[\w.\-]+$")
_MAX_INDEX_PROBLEMS = 20  # a wholly wrong index would otherwise list every chunk

BLOCK = 256 << 10  # small, so a load that reads part of a file checks little beyond what it reads


def checksum(data) -> str:
    """CRC-32C of a bytes-like object, as 8 hex digits (detects corruption, not tampering)."""
    return f"{crc32c.crc32c(data):08x}"


def block_checksums(data, block: int = BLOCK) -> list[str]:
    """CRC-32C of each `block`-byte block of a bytes-like object."""
    view = memoryview(data).cast("B")
    return [checksum(view[i : i + block]) for i in range(0, len(view), block)]


def entry(data, blocks: bool = False) -> dict:
    """A manifest entry for a file's bytes: {"bytes", "crc32c"} or {"bytes", "block", "block_crc32c"}."""
    n = memoryview(data).nbytes
    if blocks:
        return {"bytes": n, "block": BLOCK, "block_crc32c": block_checksums(data)}
    return {"bytes": n, "crc32c": checksum(data)}


def checksums_of(want: dict) -> list[str]:
    """A manifest entry's checksums, one per block (a small file's single block is the whole file)."""
    return want["block_crc32c"] if "block_crc32c" in want else [want["crc32c"]]


def problems(directory: Path, files: dict[str, dict], checksums: bool = True) -> list[str]:
    """Every way the files of `directory` differ from their manifest entries, one line each
    (`checksums=False`: presence and sizes of the block-checked data files, whose blocks a loader
    checks as it reads them; the small single-checksum files are always checked whole, as whoever
    uses them reads them whole). A file that resolves outside `directory` (a link) is refused."""
    directory = Path(directory)
    home = directory.resolve()
    out = []
    for name, want in files.items():
        path = directory / name
        try:
            target = path.resolve()
        # a symbolic link loop (RuntimeError before Python 3.13)
        except (RuntimeError, OSError) as e:
            out.append(
                f"{path}: cannot be resolved ({e}): a symbolic link loop (damaged or tampered)"
            )
            continue
        if target.parent != home:
            out.append(
                f"{path}: resolves to {target}, outside the checkpoint directory (damaged "
                "or tampered)"
            )
            continue
        if not path.is_file():
            out.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            out.append(
                f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated or rewritten)"
            )
            continue
        if not checksums and "block" in want:
            continue
        block = want.get("block") or max(size, 1)
        with open(path, "rb") as f:
            bad = [i for i, crc in enumerate(checksums_of(want)) if checksum(f.read(block)) != crc]
        if bad:
            where = (
                f"block(s) {', '.join(map(str, bad[:8]))} of {block} bytes"
                if "block" in want
                else "its bytes"
            )
            out.append(f"{path}: checksum mismatch in {where} (corrupted)")
    return out


def checkpoint_problems(directory: Path, record: dict, checksums: bool) -> tuple[dict, list[str]]:
    """(index, problems) of the committed checkpoint `directory` with commit marker `record`: its
    files against the marker (`checksums`: every data block too), the files every commit records,
    and index.json well-formed, pointing only at byte ranges inside the recorded files. The index is
    empty unless index.json is intact. Raises only for a marker of another format."""
    directory = Path(directory)
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or "index.json" not in files:
        raise CheckpointError(
            f"{directory} is not in this version's checkpoint format (no index.json in its commit "
            "marker); it was written by an older Strata"
        )
    out, plain = _marker_problems(directory, files)
    out += problems(directory, plain, checksums)
    index: dict = {"tensors": {}, "aliases": {}, "objects": {}}
    if not any(p.startswith(f"{directory / 'index.json'}:") for p in out):
        found, bad = _index_problems(directory, plain)
        out += bad
        if not bad:
            index = found
    return index, out


def _marker_problems(directory: Path, files: dict) -> tuple[list[str], dict[str, dict]]:
    """Problems of the marker's file list itself, and its well-formed entries of plain file names."""
    where = directory / MARKER
    out, plain = [], {}
    for name, want in files.items():
        if not _PLAIN_NAME.match(name) or set(name) == {"."}:
            out.append(
                f"{where}: names {name!r}, which is outside the checkpoint directory "
                "(damaged, or not Strata's)"
            )
        elif not _entry_ok(want):
            out.append(f"{where}: the entry for {name} is malformed (damaged)")
        else:
            plain[name] = want
    out += [
        f"{where}: records no checksum for {name} (damaged)"
        for name in REQUIRED
        if name not in files
    ]
    return out, plain


def _entry_ok(want) -> bool:
    if not isinstance(want, dict) or not _count(want.get("bytes")):
        return False
    if "block" in want:
        crcs, block = want.get("block_crc32c"), want["block"]
        return (
            isinstance(block, int)
            and block > 0
            and isinstance(crcs, list)
            and len(crcs) == max(-(-want["bytes"] // block), 1 if want["bytes"] else 0)
        )
    return isinstance(want.get("crc32c"), str)


def _count(x: object) -> TypeGuard[int]:
    """A byte count, offset or size: a non-negative int (JSON's true/false are not)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _index_problems(directory: Path, files: dict[str, dict]) -> tuple[dict, list[str]]:
    """(index, problems) of an index.json that matched its checksum: its shape, and every chunk
    and object inside the bytes of a file the marker records."""
    path = directory / "index.json"
    try:
        index = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        return {}, [f"{path}: unreadable ({e}) (a damaged index)"]
    if not isinstance(index, dict) or not all(
        isinstance(index.get(k, {}), dict) for k in ("tensors", "objects")
    ):
        return {}, [f"{path}: not a checkpoint index (a damaged index)"]
    index.setdefault("tensors", {})
    index.setdefault("objects", {})
    aliases = index.setdefault("aliases", {})
    out = [
        f"{path}: {line} (a damaged index)" for line in _tensor_problems(index["tensors"], files)
    ]
    for key, where in index["objects"].items():
        out += [
            f"{path}: {line} (a damaged index)"
            for line in _range_problems(f"object {key}", where, files)
        ]
    if not isinstance(aliases, dict) or any(v not in index["tensors"] for v in aliases.values()):
        out.append(f"{path}: an alias names a tensor the index does not have (a damaged index)")
    if len(out) > _MAX_INDEX_PROBLEMS:
        out = out[:_MAX_INDEX_PROBLEMS] + [
            f"{path}: and {len(out) - _MAX_INDEX_PROBLEMS} more problems"
        ]
    return index, out


def _tensor_problems(tensors: dict, files: dict[str, dict]) -> list[str]:
    # torch: not for the writer processes importing this
    from strata.checkpoint.blob import torch_dtype

    out = []
    for key, entry in tensors.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (
            not isinstance(shape, list)
            or not all(map(_count, shape))
            or not isinstance(entry.get("chunks"), list)
        ):
            out.append(f"tensor {key} has no valid shape and chunk list")
            continue
        try:
            itemsize = torch_dtype(str(entry.get("dtype"))).itemsize
        except CheckpointError:
            out.append(f"tensor {key} has an unknown dtype {entry.get('dtype')!r}")
            continue
        for i, chunk in enumerate(entry["chunks"]):
            out += _chunk_problems(f"{key} chunk {i}", chunk, shape, itemsize, files)
    return out


def _chunk_problems(
    what: str, chunk, shape: list[int], itemsize: int, files: dict[str, dict]
) -> list[str]:
    """A chunk's box must lie in its tensor and its data (box's bytes) inside its blob in a file."""
    if not isinstance(chunk, dict):
        return [f"{what} is not a chunk"]
    offsets, sizes = chunk.get("offsets"), chunk.get("sizes")
    if not (
        isinstance(offsets, list)
        and isinstance(sizes, list)
        and len(offsets) == len(sizes) == len(shape)
    ):
        return [f"{what} has no box of {len(shape)} dimensions"]
    if not all(map(_count, [*offsets, *sizes])) or any(
        o + n > s for o, n, s in zip(offsets, sizes, shape)
    ):
        return [f"{what} box at {offsets} of size {sizes} lies outside the shape {shape}"]
    bad = _range_problems(what, chunk, files)
    if bad:
        return bad
    lo, hi = chunk.get("data_offset"), chunk["offset"] + chunk["length"]
    if not _count(lo) or lo < chunk["offset"] or lo + math.prod(sizes) * itemsize > hi:
        return [
            f"{what} has its data at {lo!r}, outside its bytes {chunk['offset']}–{hi} of "
            f"{chunk['file']}"
        ]
    return []


def _range_problems(what: str, where, files: dict[str, dict]) -> list[str]:
    """`where` ({file, offset, length}) must name a file of the checkpoint and bytes inside it."""
    if not isinstance(where, dict) or not isinstance(where.get("file"), str):
        return [f"{what} names no file"]
    name = where["file"]
    if name not in files:
        return [
            f"{what} is in {name!r}, which is not a file of this checkpoint (outside it, or "
            "not recorded)"
        ]
    lo, n = where.get("offset"), where.get("length")
    if not _count(lo) or not _count(n) or lo + n > files[name]["bytes"]:
        return [
            f"{what} points at bytes {lo!r}+{n!r} of {name}, which has {files[name]['bytes']} bytes"
        ]
    return []
