"""Attention across a sequence split over cp ranks against one process: causal SDPA on the whole
sequence is the reference; ring attention and the all-to-all (Ulysses) attention on each rank's
load-balanced shard must give its output and the gradients of q, k and v at that rank's tokens, with
grouped-query heads and without, at cp = 2 (two groups of a 4-rank world) and cp = 4; and with packed
documents, against SDPA under the document mask (short documents, so whole blocks and rows of
blocks are masked)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from strata.model import Documents
from strata.parallel import comm
from strata.parallel.context import alltoall_attention, positions, ring_attention, shard, unshard

from worlds import join_world, run_world

pytestmark = pytest.mark.slow  # a 4-process gloo world

WORLD, B, HEADS, SEQ, D = 4, 2, 4, 32, 8
KINDS = {"ring": ring_attention, "alltoall": alltoall_attention}
CASES = [(cp, kind, kv, False) for cp in (2, 4) for kind in KINDS for kv in (HEADS, 2, 1)]
CASES += [(cp, kind, kv, True) for cp in (2, 4) for kind in KINDS for kv in (HEADS, 1)]
# each sequence's documents by length: a one-token document, ones inside a chunk and ones across chunks
LENGTHS = ([3, 9, 1, 12, 7], [2, 6, 6, 4, 6, 8])


def documents() -> Documents:
    ids = [
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        for lengths in LENGTHS
    ]
    return Documents(torch.stack(ids))


def inputs(kv_heads: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and the gradient arriving at the output, for the whole sequence."""
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(B, HEADS, SEQ, D, generator=g)
    k, v = (torch.randn(B, kv_heads, SEQ, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(B, HEADS, SEQ, D, generator=g)


def reference(kv_heads: int, packed: bool) -> dict[str, torch.Tensor]:
    q, k, v, grad = inputs(kv_heads)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = documents().mask() if packed else None
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=not packed, enable_gqa=kv_heads != HEADS
    )
    out.backward(grad)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _worker(rank: int, size: int, port: int, out_dir: str) -> None:
    join_world(rank, size, port)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results = {}
        for cp, kind, kv_heads, packed in CASES:
            group = dist.group.WORLD if cp == WORLD else pairs[rank // 2]
            me = dist.get_rank(group)
            q, k, v, grad = (shard(t, cp, me, dim=2).clone() for t in inputs(kv_heads))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            before = sum(n for (dim, _), n in comm.bytes_moved.items() if dim == "cp")
            out = KINDS[kind](q, k, v, group, documents=documents() if packed else None)
            out.backward(grad)
            moved = sum(n for (dim, _), n in comm.bytes_moved.items() if dim == "cp") - before
            grads = {"q": q.grad, "k": k.grad, "v": v.grad}
            results[(cp, kind, kv_heads, packed)] = {"out": out.detach(), **grads, "bytes": moved}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("context"), timeout_s=120)


@pytest.mark.parametrize("cp, kind, kv_heads, packed", CASES)
def test_split_attention_matches_one_process(ranks, cp, kind, kv_heads, packed):
    ref, case = reference(kv_heads, packed), (cp, kind, kv_heads, packed)
    group_ranks = range(cp)  # the first group (ranks 0..cp-1); the second pair computes the same
    for name in ("out", "q", "k", "v"):
        whole = unshard([ranks[r][case][name] for r in group_ranks], dim=2)
        torch.testing.assert_close(
            whole, ref[name], rtol=1e-5, atol=1e-5, msg=f"{name} ({kind}, cp={cp})"
        )
    if cp == 2:
        for name in ("out", "q", "k", "v"):
            torch.testing.assert_close(ranks[2][case][name], ranks[0][case][name])


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_moves_each_kv_block_round_the_ring_and_back(ranks, cp):
    """Forward passes K and V cp−1 times; backward passes them cp−1 times more and their float32
    gradients cp times."""
    for kv_heads in (HEADS, 1):
        block = B * kv_heads * (SEQ // cp) * D * 4  # one of K or V on one rank, float32
        want = 2 * block * (cp - 1) * 2 + 2 * block * cp
        assert ranks[0][(cp, "ring", kv_heads, False)]["bytes"] == want
        if kv_heads == 1:  # with documents too: a block every kernel skips still goes round
            assert ranks[0][(cp, "ring", kv_heads, True)]["bytes"] == want


def test_the_load_balanced_split_covers_the_sequence_once():
    for cp in (1, 2, 4):
        held = torch.cat([positions(SEQ, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(SEQ))
        x = torch.arange(SEQ).view(1, SEQ)
        assert torch.equal(unshard([shard(x, cp, r) for r in range(cp)]), x)
    assert positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
