"""The ring attention's blocks, without the ring: every rank's blocks computed in one process (each
rank's K/V shards at hand instead of arriving from its neighbour), their partial outputs merged by
log-sum-exp and their gradients summed where the ring would carry them, against SDPA over the whole
sequence. This checks the block kernels of each device (the CPU's flash kernel, the GPU's
memory-efficient one) and the document masks per block, at a longer sequence on a GPU;
tests/parallel/test_context.py checks the ring itself across processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.model import Documents
from strata.parallel.context import (
    _block_backward,
    _block_forward,
    _Blocks,
    _merge,
    positions,
    shard,
    unshard,
)

DEVICES = [
    pytest.param("cpu", 2, 4, 64, id="cpu"),
    pytest.param("cuda", 4, 8, 8192, id="cuda", marks=pytest.mark.gpu),
]


def documents(batch: int, seq: int, seed: int) -> Documents:
    """Documents of random lengths (1 to seq/4 tokens) packed into each sequence."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        cuts = torch.randint(1, max(2, seq // 4), (seq,), generator=g).cumsum(0)
        ends = torch.zeros(seq, dtype=torch.long)
        ends[cuts[cuts < seq]] = 1
        rows.append(ends.cumsum(0))
    return Documents(torch.stack(rows))


def emulated_ring(q, k, v, dout, cp: int, docs: Documents | None):
    """What the ring computes, every rank in turn: out, dq, dk, dv of the whole sequence."""
    scale = q.shape[-1] ** -0.5
    seq = q.shape[2]
    ids = None if docs is None else docs.ids.to(q.device)
    qs, ks, vs, ds = (
        [shard(t, cp, r, dim=2).contiguous() for r in range(cp)] for t in (q, k, v, dout)
    )
    outs, dqs = [], []
    dks = [torch.zeros_like(t, dtype=torch.float32) for t in ks]
    dvs = [torch.zeros_like(t, dtype=torch.float32) for t in vs]
    for rank in range(cp):
        blocks = _Blocks(ids, seq, cp, rank)
        out = torch.zeros(qs[rank].shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qs[rank].shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(cp):
            rows, keys, causal, mask, empty = blocks(step)
            src = (rank - step) % cp
            if not empty:
                block_out, block_lse = _block_forward(
                    qs[rank][:, :, rows],
                    ks[src][:, :, keys],
                    vs[src][:, :, keys],
                    causal,
                    scale,
                    mask,
                )
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        out = out.to(q.dtype)
        dq = torch.zeros(qs[rank].shape, dtype=torch.float32, device=q.device)
        for step in range(cp):
            rows, keys, causal, mask, empty = blocks(step)
            src = (rank - step) % cp
            if empty:
                continue
            dqb, dkb, dvb = _block_backward(
                ds[rank][:, :, rows],
                qs[rank][:, :, rows],
                ks[src][:, :, keys],
                vs[src][:, :, keys],
                out[:, :, rows],
                lse[:, :, rows],
                causal,
                scale,
                mask,
            )
            dq[:, :, rows] += dqb
            dks[src][:, :, keys] += dkb
            dvs[src][:, :, keys] += dvb
        outs.append(out)
        dqs.append(dq)
    return [unshard(parts, dim=2) for parts in (outs, dqs, dks, dvs)]


@pytest.mark.parametrize("device, cp, kv_heads, seq", DEVICES)
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_the_ring_blocks_merged_are_whole_sequence_attention(device, cp, kv_heads, seq, packed):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(seq + packed)
    b, heads, d = 2, 8, 64
    q = torch.randn(b, heads, seq, d, generator=g).to(device)
    k, v = (torch.randn(b, kv_heads, seq, d, generator=g).to(device) for _ in range(2))
    dout = torch.randn(b, heads, seq, d, generator=g).to(device)
    docs = documents(b, seq, seed=seq) if packed else None
    got = emulated_ring(q, k, v, dout, cp, docs)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None if docs is None else docs.mask().to(device)
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=kv_heads != heads
    )
    want.backward(dout)
    tol = 1e-5 if device == "cpu" else 2e-4
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(x.to(ref.dtype), ref.detach(), rtol=tol, atol=tol, msg=name)


def test_ring_blocks_cut_the_document_mask_and_skip_the_empty_ones():
    """Each ring block's mask is the whole sequence's document mask at its query rows and keys, and
    a block no query may attend is marked empty (so no kernel runs on it)."""
    seq, cp = 32, 4
    lengths = ([3, 9, 1, 12, 7], [2, 6, 6, 4, 6, 8])
    docs = Documents(
        torch.stack(
            [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths]
        )
    )
    whole = docs.mask()[:, 0]  # (b, seq, seq)
    empty = 0
    for rank in range(cp):
        blocks = _Blocks(docs.ids, seq, cp, rank)
        for step in range(cp):
            rows, keys, causal, mask, skip = blocks(step)
            src = (rank - step) % cp
            cut = whole[:, positions(seq, cp, rank)[rows]][:, :, positions(seq, cp, src)[keys]]
            assert not causal and mask is not None and torch.equal(mask[:, 0], cut)
            assert skip == (not cut.any())
            empty += skip
    assert empty >= 2  # these documents leave whole blocks out
