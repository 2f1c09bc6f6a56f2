"""Measure this machine for the planner (`strata plan --calibrate`): the sustained rate at which
it runs Strata's own training step on the config's model — one micro-batch's forward and
backward, the gradient hooks, clipping and the rest of the step on one rank, with `ranks`
processes training at once, since ranks share the machine's cores and memory bandwidth, each
step ending at a barrier as training's steps end at the gradients' reduction; the step's AdamW
update is timed apart and taken out, as the time model adds its own — the AdamW
update's rate, and the bandwidth and latency of a gloo all-reduce between two local processes
(the intra-node link). The inter-node link cannot be measured from one machine: give it
(`--inter-node-gbps`) or measure it across nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from strata.config import Config
from strata.net import free_port
from strata.plan.cluster import Device, ram_gib
from strata.plan.shapes import head_flops, layer_flops

# What the workers run, imported once by the server they are forked from.
WORKER_IMPORTS = ["strata.trainer.calibrate", "strata.trainer.loop", "strata.parallel.runtime"]


@dataclass(frozen=True)
class Calibration:
    """What was measured: a Device whose rate is the model's training-step rate per rank,
    the intra-node link's bandwidth (Gbit/s one way) and per-step latency (s), AdamW's rate."""

    device: Device
    intra_node_gbps: float
    latency_s: float
    adam_gparams_s: float
    ranks: int


def executed_flops(cfg: Config, vocab: int, tokens: int) -> float:
    """Matmul FLOPs a forward and backward of the whole model execute on `tokens` tokens (causal
    attention computes half of its score matrix), as the time model counts them."""
    m = cfg.model
    return 3.0 * tokens * (m.n_layers * layer_flops(m, 1) + head_flops(m, vocab, 1))


def step_config(cfg: Config) -> Config:
    """`cfg`'s model, data, precision, micro-batch and recomputation on one rank: one micro-batch
    per step, nothing partitioned, offloaded, saved, evaluated or logged."""
    import tempfile

    import yaml

    from strata import config as config_mod

    raw = config_mod.to_dict(cfg)
    keep = {group: raw[group] for group in ("model", "data", "optim")}
    keep["train"] = {
        "precision": cfg.train.precision,
        "micro_batch_size": cfg.train.micro_batch_size,
        "global_batch_size": cfg.train.micro_batch_size,
        "steps": 1_000_000,
        "eval_interval": 0,
        "compile": cfg.train.compile,
    }
    keep["activations"] = {"recompute": cfg.activations.recompute}
    keep["checkpoint"] = {"save_final": False, "interval": 0}
    keep["log"] = {"progress": False, "dir": tempfile.gettempdir()}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(yaml.safe_dump(keep))
        f.flush()
        return config_mod.load(f.name, world_size=1)


def _compute_worker(rank: int, cfg: Config, seconds: float, barrier, results) -> None:
    from strata.parallel import runtime as runtime_mod
    from strata.trainer.loop import Trainer

    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1)
    # a measurement: it writes no run and leaves checkpoint.dir (perhaps a live run's) alone
    trainer = Trainer(cfg, runtime_mod.start("gloo"), writes=[], saves=False)
    try:
        start = time.perf_counter()
        trainer.train_step()  # warm-up: buffers, the optimizer's state
        warm_s = time.perf_counter() - start
        elements = sum(p.numel() for p in trainer.model.params)
        flat = torch.nn.Parameter(torch.zeros(elements))
        flat.grad = torch.ones_like(flat)
        # the step's own AdamW
        kernel = {k: trainer.model.optimizer.defaults[k] for k in ("fused", "foreach")}
        adam = torch.optim.AdamW([flat], lr=1e-3, **kernel)
        adam.step()
        start = time.perf_counter()
        for _ in range(3):
            adam.step()
        adam_s = (time.perf_counter() - start) / 3
        # Training's steps end together (the gradients' reduction waits for every rank), so each
        # timed step ends at a barrier too: on shared cores a step takes as long as its slowest
        # rank.
        if rank == 0:  # every rank must take as many steps: rank 0's warm-up decides
            results["steps"] = max(2, round(seconds / warm_s))
        barrier.wait()
        steps = results["steps"]
        barrier.wait()
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
            barrier.wait()
        per_step = (time.perf_counter() - start) / steps
    finally:
        trainer.checkpoints.close()
        trainer.model.close()
    results[rank] = (per_step - adam_s, elements / adam_s)


def _link_worker(rank: int, port: int, results) -> None:
    """Time all-reduces between two local processes through `parallel.comm`, as training runs them."""
    import torch.distributed as dist

    from strata.parallel import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        world = dist.group.WORLD

        def timed(t: torch.Tensor, times: int) -> float:
            start = time.perf_counter()
            for _ in range(times):
                comm.all_reduce(t, world, "dp")
            return (time.perf_counter() - start) / times

        small, big = torch.zeros(1), torch.zeros(4 * 2**20)
        timed(small, 1)  # warm-up: connections and buffers
        timed(big, 1)
        latency = timed(small, 50) / 2  # a 2-rank all-reduce: two steps
        seconds = timed(big, 3)
        if rank == 0:
            # 2 ranks: each sends its whole buffer once
            results[0] = (big.numel() * 4 / seconds, latency)
    finally:
        dist.destroy_process_group()


def calibrate_local(cfg: Config, vocab: int, ranks: int = 1, seconds: float = 3.0) -> Calibration:
    """Measure this machine with `ranks` processes computing at once (see the module docstring)."""
    one_rank = step_config(cfg)
    if one_rank.data.path is None and not one_rank.data.sources:
        from strata.data.prepare import ensure_default_corpus

        # once, not by every process
        ensure_default_corpus(one_rank.data.cache_dir, one_rank.data.val_fraction)
    # Every process is a fork of one server that has imported torch and the trainer once: spawning
    # each would import them anew (seconds apiece, with the cores the others are measuring on).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_IMPORTS)
    with ctx.Manager() as manager:
        results = manager.dict()
        barrier = manager.Barrier(ranks)
        mp.start_processes(
            _compute_worker,
            args=(one_rank, seconds, barrier, results),
            nprocs=ranks,
            start_method="forkserver",
        )
        per_step = sum(results[r][0] for r in range(ranks)) / ranks
        adam = sum(results[r][1] for r in range(ranks)) / ranks
        link = manager.dict()
        mp.start_processes(
            _link_worker, args=(free_port(), link), nprocs=2, start_method="forkserver"
        )
        bytes_s, latency = link[0]
    rate = executed_flops(cfg, vocab, cfg.train.micro_batch_size * cfg.model.seq_len) / per_step
    mem_gib = ram_gib() / ranks
    device = Device(
        "cpu (calibrated)",
        mem_gib=mem_gib,
        peak_tflops=rate / 1e12,
        matmul_efficiency=1.0,
        mem_bw_gbs=adam * 32 / 1e9,
        measured=True,
        host_memory=True,
    )
    return Calibration(device, bytes_s * 8 / 1e9, latency, adam / 1e9, ranks)
