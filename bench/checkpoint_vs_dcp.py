"""Strata checkpoints against torch.distributed.checkpoint (DCP) on the same state, same run (CPU, gloo).

A real Strata Trainer (GPT, ~330M parameters by default, ZeRO-3 over 4 ranks, AdamW state after one
step) is saved by Strata (`checkpoint.async`) and by DCP from the very same boxes (each rank's
pieces, deduplicated as Strata writes them, wrapped as ShardedTensors), then loaded into another
layout (tp2·dp2, ZeRO-3) by both. Printed, each the slowest rank's, median over rounds:

* stall per save: the time `trainer.save()` blocks training (Strata async) against `dcp.save`
  (sync, whole save) and `dcp.async_save` (time until it returns);
* end-to-end save time: call to COMMITTED (Strata) / to `.metadata` (DCP);
* load with resharding, page cache dropped for the checkpoint's files first (posix_fadvise):
  Strata's reader (with and without block CRC checks) against `dcp.load` into ShardedTensors of the
  target boxes; the two results are compared element for element;
* write bandwidth: checkpoint bytes over Strata's write time, against the disk's raw sequential
  write bandwidth measured in the same run (`dd oflag=direct conv=fsync`, one writer per rank
  writing as many bytes as its checkpoint file, before and after the Strata saves);
* the copy floor: every rank copying as many bytes as its staging image from one buffer into
  another at once (CPU), or device-to-host into pinned memory (GPU): the least any save that
  copies the state before returning can stall, on this machine.

With `--device cuda` the model, its optimizer state and DCP's shards live on the GPUs (one rank per
GPU: NCCL takes no two ranks on one GPU), Strata stages device-to-host into its pinned image on a
side stream, and both loads go back onto the GPUs. On one GPU that is one rank, whose load cannot
reshard: it loads into the same layout.

    python bench/checkpoint_vs_dcp.py                    # 4 ranks, ~330M params: ~5 min on 2 cores
    python bench/checkpoint_vs_dcp.py --layers 2 --rounds 1   # a quick look
    python bench/checkpoint_vs_dcp.py --device cuda      # one rank per GPU
    python bench/checkpoint_vs_dcp.py --device cuda --d-model 2048 --layers 24   # ~1.2B parameters
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GiB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the training state lives"
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="ranks (default: 4 on cpu, one per GPU on cuda)"
    )
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3, help="saves of each kind (medians reported)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where checkpoints go (default: a temp dir on /tmp's disk)",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not args.worker:
        import torch

        gpus = torch.cuda.device_count()
        if not gpus:
            p.error(
                "--device cuda: torch sees no GPU here (run it on a GPU machine, or use --device cpu)"
            )
        if args.nproc is None:
            args.nproc = gpus
        elif args.nproc > gpus:
            p.error(
                f"--device cuda: {args.nproc} ranks on {gpus} GPU(s); NCCL takes one rank per GPU: --nproc {gpus}"
            )
    if args.nproc is None:
        args.nproc = 4
    return args


def launch(args: argparse.Namespace) -> int:
    from strata.config import DataConfig
    from strata.data.prepare import ensure_default_corpus
    from strata.launch.torchrun import LaunchPlan, torchrun_args

    ensure_default_corpus(
        DataConfig().cache_dir, DataConfig().val_fraction
    )  # once, before the ranks start
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(LaunchPlan(args.nproc)),
        __file__,
        "--worker",
        "--device",
        args.device,
        "--d-model",
        str(args.d_model),
        "--layers",
        str(args.layers),
        "--rounds",
        str(args.rounds),
        "--dir",
        str(work),
    ] + (["--out", str(args.out)] if args.out else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.call(cmd, env=env, cwd=REPO)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- the worker (one per rank) ----------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from strata import config
    from strata.parallel import runtime
    from strata.trainer.loop import Trainer

    warnings.filterwarnings(
        "ignore", category=FutureWarning
    )  # DCP: "use DTensor" (it cannot shard flat ranges)
    warnings.filterwarnings("ignore", category=UserWarning)
    cuda = args.device == "cuda"
    rt = runtime.start("nccl" if cuda else "gloo", 1800)
    rank, world = rt.rank, rt.world_size
    if (
        not dist.is_initialized()
    ):  # a world of one (one GPU): DCP and the timings still need a group
        dist.init_process_group("gloo")
    work = args.dir
    group = dist.new_group(backend="gloo")  # DCP's collectives, apart from training's
    clock = dist.new_group(
        backend="gloo"
    )  # the timings' (`group` may be busy in DCP's async-save thread)
    zero3 = [f"zero.{k}.shard_over=global" for k in ("params", "grads", "optim")]
    common = [
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        "model.n_heads=16",
        "model.seq_len=32",
        "train.micro_batch_size=1",
        f"train.global_batch_size={world}",
        "train.steps=1000",
        "log.progress=false",
        f"log.dir={work / 'runs'}",
        "checkpoint.keep_last=0",
        "checkpoint.async=true",
        *zero3,
    ]
    cfg = config.load(
        REPO / "configs" / "tiny.yaml", [*common, f"checkpoint.dir={work / 'strata'}"], world
    )
    trainer = Trainer(cfg, rt)
    trainer.train_step()  # the optimizer state exists from here

    def timed(fn) -> tuple[float, object]:
        """fn's time on the slowest rank (GPU work included: it is synchronised before the clock stops)."""
        dist.barrier(group=clock)
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=clock)
        return elapsed.item(), out

    figures: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "ranks": world,
        "cores": os.cpu_count(),
        "d_model": args.d_model,
        "layers": args.layers,
        "params": sum(math.prod(s) for s in trainer.model.global_shapes.values()),
    }

    # --- Strata async saves ------------------------------------------------------------------
    def save() -> tuple[float, float]:
        trainer.state.step += 1
        stall, _ = timed(trainer.save)
        total, _ = timed(trainer.checkpoints.wait)
        return stall, stall + total

    figures["strata_first_save_stall_s"] = save()[0]  # also plans and allocates the staging image
    from strata.checkpoint import store

    first = store.committed(work / "strata")[-1]
    saved_bytes = sum(p.stat().st_size for p in first.glob("__*_0.distcp"))
    image_bytes = (first / store.data_file(rank)).stat().st_size
    raw_before = raw_bandwidth(work, rank, image_bytes, clock)
    # the floor measured just before each save: this machine's copy speed drifts by tens of %
    floors, stalls, e2e = [], [], []
    for _ in range(args.rounds):
        floors.append(copy_floor(image_bytes, cuda, timed))
        stall, total = save()
        stalls.append(stall)
        e2e.append(total)
    figures["copy_floor_s"] = statistics.median(floors)
    figures["copy_floors_s"] = floors
    figures["stall_over_floor"] = statistics.median(s / f for s, f in zip(stalls, floors))
    raw_after = raw_bandwidth(work, rank, (first / store.data_file(rank)).stat().st_size, clock)
    figures.update(
        strata_stall_s=list(stalls),
        strata_save_s=list(e2e),
        checkpoint_bytes=saved_bytes,
        strata_write_gbps=[saved_bytes / (t - s) / 1e9 for t, s in zip(e2e, stalls)],
        raw_write_gbps=[raw_before, raw_after],
    )
    strata_dir = sorted((work / "strata").glob("step_*"))[-1]

    # --- DCP, same boxes ---------------------------------------------------------------------
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state, _ = dcp_state(trainer, group, rank, clock)
    sync, asyn, asyn_stall = [], [], []
    for i in range(args.rounds):
        path = work / f"dcp_sync{i}"
        t, _ = timed(
            lambda: dcp.save(
                state,
                storage_writer=FileSystemWriter(path, thread_count=2, sync_files=True),
                process_group=group,
            )
        )
        sync.append(t)
        if i < args.rounds - 1:
            shutil.rmtree(path, ignore_errors=True) if rank == 0 else None
        path = work / f"dcp_async{i}"
        stall, fut = timed(
            lambda: dcp.async_save(
                state,
                storage_writer=FileSystemWriter(path, thread_count=2, sync_files=True),
                process_group=group,
            )
        )
        total, _ = timed(fut.result)
        asyn_stall.append(stall)
        asyn.append(stall + total)
        dist.barrier(group=clock)
        shutil.rmtree(path, ignore_errors=True) if rank == 0 else None
    figures.update(dcp_save_s=sync, dcp_async_stall_s=asyn_stall, dcp_async_save_s=asyn)
    dcp_dir = work / f"dcp_sync{args.rounds - 1}"
    trainer.checkpoints.close()
    state = trainer = None  # free them before the second trainer is built
    gc.collect()

    # --- load into tp2·dp2 (or, for a world of one, the same layout) -------------------------------
    reshard = ["parallel.tp=2"] if world % 2 == 0 else []
    figures["load_layout"] = f"tp2·dp{world // 2}" if reshard else f"dp{world} (the saving layout)"
    target = config.load(
        REPO / "configs" / "tiny.yaml", [*common, *reshard, f"checkpoint.dir={work / 'x'}"], world
    )
    loader = Trainer(target, rt)
    loads = {}
    from torch.distributed.checkpoint import FileSystemReader

    def dcp_load() -> list:
        """DCP needs its destinations built first (ShardedTensors of the target boxes): timed too,
        as Strata's load allocates its new optimizer state inside the timed call."""
        target_state, pairs = dcp_state(loader, group, rank, clock, fresh=True)
        dcp.load(target_state, storage_reader=FileSystemReader(dcp_dir), process_group=group)
        return pairs

    for cache in ("cold", "warm"):
        for verify in (True, False):
            loader.cfg = config.replace(target, "checkpoint.verify_on_load", verify)
            if cache == "cold":
                drop_cache(strata_dir, rank, clock)
            loads[f"strata_load_{cache}_{'crc' if verify else 'nocrc'}_s"], _ = timed(
                lambda: loader.resume(strata_dir)
            )
        if cache == "cold":
            drop_cache(dcp_dir, rank, clock)
        loads[f"dcp_load_{cache}_s"], pairs = timed(dcp_load)
    bad = torch.tensor(sum(not torch.equal(strata, by_dcp) for strata, by_dcp in pairs))
    dist.all_reduce(bad, group=clock)
    figures.update(loads, load_mismatches=int(bad))

    if rank == 0:
        report(figures)
        if args.out:
            args.out.write_text(json.dumps(figures, indent=1))
    loader.checkpoints.close()
    runtime.stop()


def dcp_state(trainer, group, rank: int, clock, fresh: bool = False) -> tuple[dict, list]:
    """The trainer's pieces as DCP wants them: a ShardedTensor per tensor over the boxes the ranks
    hold, a box several ranks hold split among them exactly as Strata writes it (ShardedTensor
    shards may not overlap), plain tensors for 0-d entries. With `fresh`, new tensors to load into
    (the trainer's are left alone). Also returns (the trainer's view, the state's tensor) pairs."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    from strata.checkpoint.write_plan import Descriptor, assign, dtype_name

    pieces = [
        p for p in trainer.state.contents(trainer.step).pieces if not p.key.startswith("rng.")
    ]
    descs = [Descriptor(p.key, tuple(p.global_shape), dtype_name(p.dtype), p.box) for p in pieces]
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, descs, group=clock)
    where = [str(pieces[0].tensor.device) if pieces else "cpu"] * len(every)
    dist.all_gather_object(
        where, where[rank], group=clock
    )  # each rank's device, for the shard metadata
    by_key: dict[str, list] = {}
    for r, rank_items in enumerate(assign(every)):
        for it in rank_items:
            by_key.setdefault(it.key, []).append((r, it))
    state, pairs = {}, []

    def view(it):
        n = math.prod(it.box.sizes)
        live = pieces[it.piece].tensor.reshape(-1)[it.start : it.start + n].view(it.box.sizes)
        pairs.append((live, live.clone() if fresh else live))
        return pairs[-1][1]

    for key, holders in by_key.items():
        shape = holders[0][1].global_shape
        mine = [it for r, it in holders if r == rank]
        if not shape:
            if mine:
                state[key] = view(mine[0])
            continue
        local = [
            Shard(
                view(it),
                ShardMetadata(
                    list(it.box.offsets), list(it.box.sizes), f"rank:{rank}/{where[rank]}"
                ),
            )
            for it in mine
        ]
        meta = ShardedTensorMetadata(
            [
                ShardMetadata(list(it.box.offsets), list(it.box.sizes), f"rank:{r}/{where[r]}")
                for r, it in holders
            ],
            torch.Size(shape),
            TensorProperties(dtype=getattr(torch, holders[0][1].dtype)),
        )
        state[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
            local, meta, process_group=group
        )
    return state, pairs


def drop_cache(directory: Path, rank: int, clock) -> None:
    """Evict a checkpoint's files from the page cache (they are fsynced, so clean): a cold read."""
    import torch.distributed as dist

    if rank == 0:
        for path in Path(directory).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier(group=clock)


def copy_floor(nbytes: int, cuda: bool, timed) -> float:
    """The least a save that copies the state before it returns can stall here: every rank at once
    copying `nbytes` (its staging image's size) from one buffer into another (median of 3), from
    the GPU into pinned host memory with `cuda`. Both buffers are touched first, as the state and
    the staging image are."""
    import torch

    src = torch.ones(nbytes // 4, device="cuda" if cuda else "cpu")
    dst = torch.ones(nbytes // 4, pin_memory=cuda)
    times = sorted(timed(lambda: dst.copy_(src, non_blocking=cuda))[0] for _ in range(3))
    return times[1]


def raw_bandwidth(work: Path, rank: int, file_bytes: int, clock) -> float:
    """GB/s of `dd oflag=direct conv=fsync` with every rank writing as many bytes as its
    checkpoint data file at once (random bytes from /dev/shm, so nothing is compressible or cached)."""
    import torch
    import torch.distributed as dist

    blocks = -(-file_bytes // 2**24)
    src = Path(f"/dev/shm/ckpt-bench-raw-{rank}")
    with open(src, "wb") as f:
        for _ in range(blocks):
            f.write(os.urandom(2**24))
    dist.barrier(group=clock)
    t0 = time.perf_counter()
    subprocess.run(
        [
            "dd",
            f"if={src}",
            f"of={work / f'raw-{rank}'}",
            "bs=16M",
            f"count={blocks}",
            "oflag=direct",
            "conv=fsync",
        ],
        check=True,
        capture_output=True,
    )
    elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=clock)
    nbytes = torch.tensor(blocks * 2**24, dtype=torch.float64)
    dist.all_reduce(nbytes, group=clock)
    os.unlink(work / f"raw-{rank}")
    src.unlink()
    return nbytes.item() / elapsed.item() / 1e9


def report(f: dict) -> None:
    med = statistics.median
    print(
        f"\n{f['ranks']} ranks on {f['cores']} cores ({f['device']}), GPT d_model {f['d_model']} × {f['layers']} "
        f"layers ({f['params'] / 1e6:.0f}M parameters), ZeRO-3 + AdamW; "
        f"checkpoint {f['checkpoint_bytes'] / GiB:.2f} GiB of data files"
    )
    print(
        f"stall per save     Strata async {med(f['strata_stall_s']):7.3f} s   "
        f"dcp.save {med(f['dcp_save_s']):7.3f} s   "
        f"dcp.async_save {med(f['dcp_async_stall_s']):7.3f} s   ratio dcp.save/Strata "
        f"{med(f['dcp_save_s']) / med(f['strata_stall_s']):.1f}x (goal >= 20x)"
    )
    print(
        f"  (Strata's first save, which also plans and allocates the staging image: "
        f"{f['strata_first_save_stall_s']:.3f} s)"
    )
    floor = f["copy_floor_s"]
    print(
        f"copy floor         {floor:7.3f} s: every rank copying its image's bytes at once "
        f"({'device to pinned host' if f['device'] != 'cpu' else 'memory to memory'}); dcp.save / floor "
        f"{med(f['dcp_save_s']) / floor:.1f}x is the most any save that copies before it returns can reach here; "
        f"Strata's stall is {f['stall_over_floor']:.2f}x the floor (median of each save's stall "
        "over the floor measured just before it)"
    )
    print(
        f"save end to end    Strata {med(f['strata_save_s']):7.3f} s   dcp.save {med(f['dcp_save_s']):7.3f} s   "
        f"dcp.async_save {med(f['dcp_async_save_s']):7.3f} s   ratio DCP/Strata "
        f"{med(f['dcp_save_s']) / med(f['strata_save_s']):.2f}x (goal > 1)"
    )
    for cache in ("cold", "warm"):
        crc, nocrc, ref = (
            f[f"strata_load_{cache}_crc_s"],
            f[f"strata_load_{cache}_nocrc_s"],
            f[f"dcp_load_{cache}_s"],
        )
        print(
            f"load {cache}, dp{f['ranks']} ZeRO-3 -> {f['load_layout']} ZeRO-3: Strata {crc:.3f} s (CRCs checked), "
            f"{nocrc:.3f} s (not)   "
            f"dcp.load {ref:.3f} s   ratio DCP/Strata {ref / crc:.2f}x checked, {ref / nocrc:.2f}x not (goal > 1)"
        )
    print(f"  boxes loaded differently by Strata and DCP: {f['load_mismatches']}")
    raw = med(f["raw_write_gbps"])
    print(
        f"write bandwidth    Strata {med(f['strata_write_gbps']):.2f} GB/s   raw dd {raw:.2f} GB/s "
        f"(before {f['raw_write_gbps'][0]:.2f}, after {f['raw_write_gbps'][1]:.2f})   ratio "
        f"{med(f['strata_write_gbps']) / raw:.2f} (goal >= 0.8)"
    )


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(worker(arguments) or 0 if arguments.worker else launch(arguments))
