"""Integrity of checkpoint files: each file's size and CRC-32 — per 8 MiB block for the large data
files, so a loader verifies just the blocks it reads — recorded in the commit marker, and a check of
a directory against it that names every missing, truncated or altered file before anything is loaded."""
from __future__ import annotations

import zlib
from pathlib import Path

BLOCK = 8 << 20


def crc32(data) -> str:
    return f"{zlib.crc32(data):08x}"


def block_crcs(data, block: int = BLOCK) -> list[str]:
    """CRC-32 of each `block`-byte block of a bytes-like object (zlib releases the GIL)."""
    view = memoryview(data).cast("B")
    return [crc32(view[i:i + block]) for i in range(0, len(view), block)]


def entry(data, blocks: bool = False) -> dict:
    """A manifest entry for a file's bytes: {"bytes", "crc32"} or {"bytes", "block", "block_crc32"}."""
    n = memoryview(data).nbytes
    if blocks:
        return {"bytes": n, "block": BLOCK, "block_crc32": block_crcs(data)}
    return {"bytes": n, "crc32": crc32(data)}


def problems(directory: Path, files: dict[str, dict]) -> list[str]:
    """Every way the files of `directory` differ from their manifest entries, one line each."""
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
        with open(path, "rb") as f:
            if "block_crc32" in want:
                bad = [i for i, crc in enumerate(want["block_crc32"]) if crc32(f.read(want["block"])) != crc]
                if bad:
                    out.append(f"{path}: checksum mismatch in block(s) {', '.join(map(str, bad[:8]))} of "
                               f"{want['block']} bytes (corrupted)")
            elif (got := crc32(f.read())) != want["crc32"]:
                out.append(f"{path}: checksum {got} does not match the manifest's {want['crc32']} (corrupted)")
    return out
