"""Strata's swap I/O engine (strata/offload/io_engine.py) against the disk's raw sequential bandwidth,
measured in the same run: `dd` with O_DIRECT (and `fio`, when installed) writing and reading the
same number of bytes in the same directory, with as many streams as the engine has threads. Rounds
alternate which side goes first, because this kind of disk changes speed from minute to minute;
medians are reported, with the ratio engine/raw (goal ≥ 0.9).

    python bench/nvme_bandwidth.py                       # 1 GiB, 5 rounds, in a temp dir under /tmp
    python bench/nvme_bandwidth.py --dir /nvme/scratch --gib 4 --threads 4 --chunk-mb 4
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from strata.offload.io_engine import IOEngine

BS = 4 << 20  # dd/fio request size: the engine's chunk size by default


def engine_pass(path: Path, buf: torch.Tensor, op: str, threads: int, chunk: int) -> float:
    engine = IOEngine(threads=threads, chunk_bytes=chunk)
    try:
        t0 = time.perf_counter()
        getattr(engine, op)(path, buf).wait()
        if op == "write":
            fd = os.open(
                path, os.O_RDONLY
            )  # fsync through any descriptor flushes the file, as dd's conv=fsync
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return time.perf_counter() - t0
    finally:
        engine.close()


def dd_pass(path: Path, source: Path, nbytes: int, op: str, streams: int) -> float:
    """`streams` dd processes at once, each on its own quarter (…) of the file: the same number of
    requests in flight as the engine keeps, so both measure the device, not the queue depth."""
    count = nbytes // BS // streams
    procs = []
    t0 = time.perf_counter()
    for i in range(streams):
        args = (
            [
                f"if={source}",
                f"of={path}",
                "oflag=direct",
                "conv=fsync,notrunc",
                f"seek={i * count}",
                f"skip={i * count}",
            ]
            if op == "write"
            else [f"if={path}", "of=/dev/null", "iflag=direct", f"skip={i * count}"]
        )
        procs.append(
            subprocess.Popen(
                ["dd", *args, f"bs={BS}", f"count={count}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    if any(p.wait() for p in procs):
        raise RuntimeError(f"dd {op} failed")
    return time.perf_counter() - t0


def fio_pass(path: Path, nbytes: int, op: str, streams: int) -> float | None:
    """fio with `streams` jobs, each on its own part of the file (when fio is installed)."""
    if not shutil.which("fio"):
        return None
    part = nbytes // streams
    out = subprocess.run(
        [
            "fio",
            "--name=raw",
            f"--filename={path}",
            f"--rw={op}",
            f"--bs={BS}",
            f"--size={part}",
            f"--numjobs={streams}",
            f"--offset_increment={part}",
            "--group_reporting",
            "--direct=1",
            "--ioengine=psync",
            "--end_fsync=1",
            "--output-format=json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    job = json.loads(out)["jobs"][0][op]
    return nbytes / (job["bw_bytes"] or 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--chunk-mb", type=int, default=4)
    args = p.parse_args()
    nbytes = int(args.gib * 2**30) // BS * BS
    work = Path(tempfile.mkdtemp(prefix="nvme-bench-", dir=args.dir))
    source = Path("/dev/shm") / f"nvme-bench-{os.getpid()}"
    buf = torch.frombuffer(
        mmap.mmap(-1, nbytes), dtype=torch.uint8
    )  # page-aligned, like the pool's slabs
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))  # incompressible
    source.write_bytes(buf.numpy().tobytes())
    times: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            sides = ["engine", "dd", "fio"] if r % 2 == 0 else ["fio", "dd", "engine"]
            for op in ("write", "read"):
                for side in sides:
                    path = work / f"{side}.bin"
                    if side == "engine":
                        if op == "read" and not path.exists():
                            engine_pass(path, buf, "write", args.threads, args.chunk_mb << 20)
                        t = engine_pass(path, buf, op, args.threads, args.chunk_mb << 20)
                    elif side == "dd":
                        t = dd_pass(path, source, nbytes, op, args.threads)
                    else:
                        t = fio_pass(path, nbytes, op, args.threads)
                    if t is not None:
                        times.setdefault(f"{side}_{op}", []).append(t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        source.unlink(missing_ok=True)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    print(
        f"{nbytes / 2**30:.2f} GiB, {args.rounds} rounds alternating order, {args.threads} threads × "
        f"{args.chunk_mb} MiB requests, in {work.parent}"
    )
    for op in ("write", "read"):
        raw = [gbps[f"{s}_{op}"] for s in ("dd", "fio") if f"{s}_{op}" in gbps]
        best = max(raw)
        line = "  ".join(
            f"{s} {gbps[f'{s}_{op}']:.2f}" for s in ("dd", "fio") if f"{s}_{op}" in gbps
        )
        print(
            f"{op:5s}  engine {gbps[f'engine_{op}']:.2f} GB/s   raw: {line} GB/s   "
            f"engine / best raw {gbps[f'engine_{op}'] / best:.2f} (goal >= 0.9)"
        )
    print(json.dumps({k: [round(x, 4) for x in v] for k, v in times.items()}))


if __name__ == "__main__":
    main()
