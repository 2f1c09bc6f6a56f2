"""Integrity of checkpoint files: each file's size and CRC-32C — per 256 KiB block for the large
data files, so a loader verifies just the blocks it reads — recorded in the commit marker, and a
check of a directory against it that names every missing, truncated or altered file before
anything is loaded. CRC-32C through the `crc32c` package (the CPU's CRC instruction, ~15 GB/s per
core here, 4× zlib's CRC-32; it releases the GIL), so checksums cost little beside the I/O."""

from __future__ import annotations

from pathlib import Path

import crc32c

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
    (`checksums=False`: presence and sizes only, which needs no reading)."""
    directory = Path(directory)
    out = []
    for name, want in files.items():
        path = directory / name
        if not path.is_file():
            out.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            out.append(f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated or rewritten)")
            continue
        if not checksums:
            continue
        block = want.get("block") or max(size, 1)
        with open(path, "rb") as f:
            bad = [i for i, crc in enumerate(checksums_of(want)) if checksum(f.read(block)) != crc]
        if bad:
            where = f"block(s) {', '.join(map(str, bad[:8]))} of {block} bytes" if "block" in want else "its bytes"
            out.append(f"{path}: checksum mismatch in {where} (corrupted)")
    return out
