"""Measure this machine for the planner (`strata plan --calibrate`): the sustained rate of the
config's own model — forward and backward, with `ranks` processes computing at once, since ranks
share the machine's cores and memory bandwidth — the AdamW update's rate, and the bandwidth and
latency of a gloo all-reduce between two local processes (the intra-node link). The inter-node
link cannot be measured from one machine: give it (`--inter-node-gbps`) or measure it across
nodes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from strata.config import Config
from strata.model import GPT, lm_loss
from strata.net import free_port
from strata.trainer.plan.cluster import Device
from strata.trainer.plan.shapes import head_flops, layer_flops


@dataclass(frozen=True)
class Calibration:
    """What was measured: a Device whose rate is the model's forward+backward rate per rank,
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


def _compute_worker(rank: int, cfg: Config, vocab: int, seconds: float, barrier, results) -> None:
    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1)
    torch.manual_seed(rank)
    model = GPT(cfg.model, vocab)
    model.init_weights(rank)
    batch = (cfg.train.micro_batch_size, cfg.model.seq_len)
    tokens = torch.randint(0, vocab, batch)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=cfg.train.precision == "bf16")

    def step() -> None:
        with autocast:
            loss = lm_loss(model(tokens), tokens)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    barrier.wait()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds or n < 2:
        step()
        n += 1
    per_step = (time.perf_counter() - start) / n
    flat = torch.zeros(4 * 2**20)
    opt = torch.optim.AdamW([torch.nn.Parameter(flat)], lr=1e-3, foreach=True)
    opt.param_groups[0]["params"][0].grad = torch.ones_like(flat)
    opt.step()
    start = time.perf_counter()
    for _ in range(5):
        opt.step()
    adam_s = (time.perf_counter() - start) / 5
    results[rank] = (per_step, flat.numel() / adam_s)


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
            results[0] = (big.numel() * 4 / seconds, latency)  # 2 ranks: each sends its whole buffer once
    finally:
        dist.destroy_process_group()


def calibrate_local(cfg: Config, vocab: int, ranks: int = 1, seconds: float = 3.0) -> Calibration:
    """Measure this machine with `ranks` processes computing at once (see the module docstring)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        barrier = manager.Barrier(ranks)
        mp.start_processes(
            _compute_worker, args=(cfg, vocab, seconds, barrier, results), nprocs=ranks, start_method="spawn"
        )
        per_step = sum(results[r][0] for r in range(ranks)) / ranks
        adam = sum(results[r][1] for r in range(ranks)) / ranks
        link = manager.dict()
        mp.start_processes(_link_worker, args=(free_port(), link), nprocs=2, start_method="spawn")
        bytes_s, latency = link[0]
    rate = executed_flops(cfg, vocab, cfg.train.micro_batch_size * cfg.model.seq_len) / per_step
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks
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
