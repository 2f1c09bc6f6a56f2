"""Gradient reduction behind backward, in a real 4-rank gloo world laid out as 2 nodes × 2 ranks:
for plain data parallelism, ZeRO-1/2/3 (flat and hierarchical) and per-node gradients, training
with the reductions overlapped gives bit for bit the parameters of the serial path (reduce after
backward); each bucket's reduction starts inside backward, before the last gradients of the step
exist; with gradient accumulation a level that keeps whole gradients (data parallel, ZeRO-1)
communicates only after the last micro-batch, one that partitions them (ZeRO-2/3) after every
micro-batch; and a hierarchical chain's later hops are started by the lanes, not the training thread."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from strata.config import ModelConfig
from strata.model import build_model, lm_loss
from strata.parallel import overlap
from strata.parallel.topology import Layout, build_topology
from strata.parallel.zero import ZeroEngine, ZeroPlan

from worlds import join_world, run_world

pytestmark = pytest.mark.slow  # a 4-process world trains every scheme twice

WORLD, STEPS, MICRO = 4, 2, 3
LAYOUT = Layout(dp=WORLD, ranks_per_node=2)
CFG = ModelConfig(n_layers=3, d_model=32, n_heads=4, seq_len=16, vocab_size=64)
G = "global"
SCHEMES = {
    "dp": dict(),
    "zero1": dict(optim=G),
    "zero2-flat": dict(grads=G, optim=G, hierarchical=False),
    "zero3": dict(params=G, grads=G, optim=G),
    "node-grads": dict(params="node", grads="node", optim=G),
}


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def adamw(params, shape_of) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def _train(topo, plan: ZeroPlan, rank: int, overlapped: bool) -> dict:
    model = build_model(CFG, CFG.vocab_size, seed=0)
    engine = ZeroEngine([model], topo, plan, adamw, overlap=overlapped)
    events: list[tuple] = []
    phase = ["idle"]
    real_start, real_advance = overlap.Reducer.start, overlap.Reducer._advance

    def start(self, buf, hops):
        events.append(("start", phase[0], grads_seen[0]))
        return real_start(self, buf, hops)

    def advance(self, job, i, buf):
        events.append(("hop", i, threading.current_thread() is threading.main_thread()))
        return real_advance(self, job, i, buf)

    overlap.Reducer.start, overlap.Reducer._advance = start, advance
    grads_seen = [0]
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: grads_seen.__setitem__(0, grads_seen[0] + 1))
    try:
        for step in range(STEPS):
            engine.expect_backwards(MICRO)
            for m in range(MICRO):
                x, y = batch(rank, step, m)
                grads_seen[0] = 0
                loss = lm_loss(model(x), y) / MICRO
                phase[0] = f"backward {m}"
                loss.backward()
                phase[0] = "idle"
            engine.finish_grads(1 / WORLD)
            engine.clip_grad_norm(1.0)
            engine.step()
            engine.zero_grad()
    finally:
        overlap.Reducer.start, overlap.Reducer._advance = real_start, real_advance
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    n_params = len(list(model.parameters()))
    return {"params": params, "events": events, "groups": len(engine.groups), "n_params": n_params}


def _worker(rank: int, size: int, port: int, out_dir: str) -> None:
    join_world(rank, size, port, timeout_s=90)
    try:
        topo = build_topology(LAYOUT, rank)
        results = {}
        for name, kw in SCHEMES.items():
            plan = ZeroPlan(**kw)
            results[name] = {"serial": _train(topo, plan, rank, False), "overlap": _train(topo, plan, rank, True)}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("overlap"), timeout_s=400)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_overlapped_reduction_gives_the_serial_parameters_bit_for_bit(ranks, scheme):
    for r, result in enumerate(ranks):
        serial, overlapped = result[scheme]["serial"], result[scheme]["overlap"]
        assert not serial["events"]  # the serial path starts no background reduction
        for name, want in serial["params"].items():
            assert torch.equal(overlapped["params"][name], want), f"rank {r} {scheme} {name}"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_each_bucket_starts_reducing_inside_backward(ranks, scheme):
    run = ranks[0][scheme]["overlap"]
    starts = [e for e in run["events"] if e[0] == "start"]
    groups = run["groups"]
    assert groups >= 4  # embedding, three blocks, head: several buckets to overlap
    assert all(phase.startswith("backward") for _, phase, _ in starts), starts
    last = [e for e in starts if e[1] == f"backward {MICRO - 1}"]
    assert len(last) == STEPS * groups  # every bucket, every step, from its backward
    partitioned = scheme.startswith(("zero2", "zero3", "node"))
    earlier = [e for e in starts if e[1] != f"backward {MICRO - 1}"]
    # The first bucket's reduction is under way before backward has produced the other gradients.
    assert last[0][2] < run["n_params"] / 2
    # Whole gradients (dp, ZeRO-1) accumulate locally: no traffic before the last micro-batch.
    assert len(earlier) == (STEPS * (MICRO - 1) * groups if partitioned else 0)


def test_hierarchical_chains_continue_on_the_lanes(ranks):
    hops = [e for e in ranks[0]["zero3"]["overlap"]["events"] if e[0] == "hop"]
    first = [e for e in hops if e[1] == 0]
    later = [e for e in hops if e[1] > 0]
    assert first and all(main for _, _, main in first)  # started by backward itself
    assert later and not any(main for _, _, main in later)  # the node → global hops: on a lane
