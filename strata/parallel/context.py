"""Context parallelism: one sequence split over the `cp` ranks of a group, attention computed across
the split, everything else (projections, norms, feed-forward, loss) local to each rank's tokens.

The split is the causal load-balanced one of Megatron-core and torchtitan: the sequence is cut
into 2·cp chunks and rank i holds chunks i and 2·cp−1−i, so every rank has as many early tokens
(cheap: few keys to attend) as late ones. `positions` says which tokens a rank holds.

Two ways to attend across the split, each a drop-in for causal SDPA on the local (b, heads, s, d)
q/k/v:

- `ring_attention`: K/V blocks travel around the ring (`comm.shift_async`, the next block in flight
  while this one is computed); each block's partial output is merged with the others by its
  log-sum-exp. Backward runs the ring again with the merged output and log-sum-exp (the
  flash-attention identity: a block's gradients need only those), the K/V gradients travelling
  with their blocks back to their owners. Memory: one extra K/V block in flight, nothing of size
  (sequence × sequence).
- `alltoall_attention` (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a head
  split, each rank attends over the whole sequence for heads/cp heads with ordinary SDPA, and a
  second all-to-all turns it back. Needs cp to divide the (query) heads.

Own code, not torch's `context_parallel`: that one patches SDPA through DTensor and handles only
the CUDA attention kernels (flash, efficient, cuDNN), none of which runs on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.model import Documents
from strata.moe import TokenShards
from strata.parallel import comm


def positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The token positions rank `rank` of `cp` holds, in its local order: chunk `rank` then chunk
    2·cp−1−rank of the sequence cut into 2·cp equal chunks."""
    n = seq_len // (2 * cp)
    first = torch.arange(rank * n, (rank + 1) * n)
    return torch.cat((first, torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n)))


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` along `dim` (its length the whole sequence)."""
    if cp == 1:
        return x
    return x.index_select(dim, positions(x.shape[dim], cp, rank).to(x.device))


def _group_order(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """Every rank's `positions`, in group-rank order: where each token of the ranks' shards laid
    end to end sits in the sequence."""
    return torch.cat([positions(seq_len, cp, r) for r in range(cp)]).to(device)


def unshard(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's `shard` (in group-rank order): the inverse of `shard`."""
    cp = len(pieces)
    if cp == 1:
        return pieces[0]
    whole = torch.cat(pieces, dim)
    return whole.index_select(dim, torch.argsort(_group_order(whole.shape[dim], cp, whole.device)))


# --- one block of attention, with its log-sum-exp --------------------------------------------------


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query K/V (b, kv_heads, s, d) repeated to `heads` heads."""
    group = heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand`: the heads sharing a K/V head summed back into it."""
    b, heads, s, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean attention mask as the additive one the fused kernels take (0 kept, −inf masked)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def _block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp (b, heads, s_q) in float32) of q attending to k/v, causally or where the
    boolean `mask` (b, 1, s_q, s_k) allows; a row the mask empties gets output 0 and log-sum-exp −inf
    (the kernels report 0, which a merge would count as weight)."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    bias = _bias(mask, q.dtype)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )[:2]
        lse = lse[..., : q.shape[2]]
    lse = lse.float()
    if mask is not None:
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def _block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block, given the *whole* attention's output and log-sum-exp at q's rows."""
    kv_heads = k.shape[1]
    ke, ve = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    bias = _bias(mask, q.dtype)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    else:
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            ke,
            ve,
            bias,
            out,
            lse,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold a block's partial attention into the running one, in place (float32 `out` and `lse`;
    the running `lse` finite, as it is after a rank's own block, where every token sees itself)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_((lse - new).exp().unsqueeze(-1)).add_(
        block_out.float() * (block_lse - new).exp().unsqueeze(-1)
    )
    lse.copy_(new)


# --- ring attention -------------------------------------------------------------------------------


def _block_of(step: int, rank: int, cp: int, n: int) -> tuple[slice, slice, bool]:
    """Which local query rows attend to which rows of the K/V block that reaches `rank` at ring
    step `step` (the block of rank (rank − step) mod cp), and whether causally. Step 0 is the
    rank's own two chunks: causal over them as laid out (chunk rank comes first). An earlier
    rank's block: every query row attends to its first chunk (its second chunk is later than all
    of ours). A later rank's: only our second chunk attends, to both of its chunks."""
    src = (rank - step) % cp
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    if src < rank:
        return everything, slice(0, n), False
    return slice(n, None), everything, False


def _document_mask(ids: torch.Tensor, q_at: torch.Tensor, k_at: torch.Tensor) -> torch.Tensor:
    """(b, 1, len(q_at), len(k_at)) bool: where a query at sequence position q_at may attend to a key at
    k_at: not later than itself, and in its document (`ids` (b, seq): the whole sequence's)."""
    causal = q_at.unsqueeze(1) >= k_at.unsqueeze(0)
    return (causal & (ids[:, q_at].unsqueeze(2) == ids[:, k_at].unsqueeze(1))).unsqueeze(1)


class _Blocks:
    """The blocks one rank computes, step by step around the ring: the query rows and keys of each
    (`_block_of`) and, with packed documents, the block's mask (None: plain causal or full) and
    whether it masks everything (no kernel to run: with short documents most blocks far from the
    diagonal are empty)."""

    def __init__(self, ids: torch.Tensor | None, seq_len: int, cp: int, rank: int):
        self.ids, self.cp, self.rank = ids, cp, rank
        self.n = seq_len // (2 * cp)
        self.order = (
            None if ids is None else _group_order(seq_len, cp, ids.device).view(cp, 2 * self.n)
        )

    def __call__(self, step: int) -> tuple[slice, slice, bool, torch.Tensor | None, bool]:
        rows, keys, causal = _block_of(step, self.rank, self.cp, self.n)
        if self.ids is None or self.order is None:
            return rows, keys, causal, None, False
        src = (self.rank - step) % self.cp
        mask = _document_mask(self.ids, self.order[self.rank][rows], self.order[src][keys])
        return rows, keys, False, mask, not bool(mask.any())


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ids, group, cp: int, rank: int, scale: float):  # type: ignore[override]
        blocks = _Blocks(ids, cp * q.shape[2], cp, rank)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k, v]
        for step in range(cp):
            ahead = comm.shift_async(kv, group, "cp") if step + 1 < cp else None
            rows, keys, causal, mask, empty = blocks(step)
            if not empty:
                block_out, block_lse = _block_forward(
                    q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal, scale, mask
                )
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
                del block_out, block_lse  # not alive through the next block's kernel
            if ahead is not None:
                ahead[1].wait()
                kv = ahead[0]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, ids)
        ctx.group, ctx.cp, ctx.rank, ctx.scale = group, cp, rank, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, ids = ctx.saved_tensors
        group, cp, rank, scale = ctx.group, ctx.cp, ctx.rank, ctx.scale
        blocks = _Blocks(ids, cp * q.shape[2], cp, rank)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = [k, v]
        # the K/V gradient of the block held now, from the ranks before
        dkv: list[torch.Tensor] | None = None
        incoming = None
        for step in range(cp):
            ahead = comm.shift_async(kv, group, "cp") if step + 1 < cp else None
            rows, keys, causal, mask, empty = blocks(step)
            if incoming is not None:
                incoming[1].wait()
                dkv = incoming[0]
            else:
                dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
            if not empty:
                dqb, dkb, dvb = _block_backward(
                    dout[:, :, rows],
                    q[:, :, rows],
                    kv[0][:, :, keys],
                    kv[1][:, :, keys],
                    out[:, :, rows],
                    lse[:, :, rows],
                    causal,
                    scale,
                    mask,
                )
                dq[:, :, rows] += dqb
                dkv[0][:, :, keys] += dkb
                dkv[1][:, :, keys] += dvb
                del dqb, dkb, dvb  # not alive through the next block's kernel
            # on to the next rank, which sees this block next
            incoming = comm.shift_async(dkv, group, "cp")
            if ahead is not None:
                ahead[1].wait()
                kv = ahead[0]
        assert incoming is not None
        incoming[1].wait()  # after cp steps our own block's gradient has come round to us
        dk, dv = incoming[0]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    scale: float | None = None,
    documents: Documents | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's q over the whole sequence's k/v (b, heads, s_local, d; k/v
    may have fewer heads, grouped-query), the sequence split over `group` as `positions` lays it
    out; with `documents` (the whole sequence's), inside each packed document. Without a group,
    plain causal SDPA."""
    if group is None:
        return _whole_attention(q, k, v, scale, documents)
    cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ids = None if documents is None else documents.ids
    return _RingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), ids, group, cp, rank, scale
    )


# --- all-to-all (Ulysses) attention ----------------------------------------------------------------


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, h, s_local, d), the sequence split -> (b, h/cp, s, d) in sequence order, the heads split."""
    b, h, s, d = x.shape
    parts = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).reshape(cp, -1)
    # row j: rank j's tokens of our heads
    got = comm.all_to_all(parts, [1] * cp, [1] * cp, group, "cp")
    whole = got.view(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
    return whole.index_select(2, torch.argsort(_group_order(cp * s, cp, x.device)))


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`."""
    b, hl, total, d = x.shape
    s = total // cp
    # rank 0's tokens, then rank 1's, ...
    ranks_order = x.index_select(2, _group_order(total, cp, x.device))
    mine = ranks_order.view(b, hl, cp, s, d).permute(2, 0, 1, 3, 4).reshape(cp, -1)
    # row j: our tokens of rank j's heads
    got = comm.all_to_all(mine, [1] * cp, [1] * cp, group, "cp")
    return got.view(cp, b, hl, s, d).transpose(0, 1).reshape(b, cp * hl, s, d)


class _Relayout(torch.autograd.Function):
    """The sequence split to the head split (`to_heads`) or back; backward is the other way."""

    @staticmethod
    def forward(ctx, x, group, cp: int, to_heads: bool):  # type: ignore[override]
        ctx.group, ctx.cp, ctx.to_heads = group, cp, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, cp)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return back(grad.contiguous(), ctx.group, ctx.cp), None, None, None


def alltoall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    scale: float | None = None,
    documents: Documents | None = None,
) -> torch.Tensor:
    """The same result as `ring_attention`, by DeepSpeed-Ulysses' all-to-all: cp must divide the
    query heads; grouped-query K/V whose heads cp does not divide are repeated up to the query
    heads first (the all-to-all then carries the copies). With `documents` (the whole sequence's),
    attention stays inside each packed document."""
    if group is None:
        return _whole_attention(q, k, v, scale, documents)
    cp = torch.distributed.get_world_size(group)
    if k.shape[1] % cp:
        k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    qh, kh, vh = (_Relayout.apply(t.contiguous(), group, cp, True) for t in (q, k, v))
    return _Relayout.apply(_whole_attention(qh, kh, vh, scale, documents), group, cp, False)


def _whole_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    documents: Documents | None,
) -> torch.Tensor:
    """Causal SDPA over whole sequences (inside each document when `documents` says where they are)."""
    mask = None if documents is None or documents.ids is None else documents.mask()
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )


# --- on a model -----------------------------------------------------------------------------------


def attention_mode(mode: str, heads: int, kv_heads: int, cp: int) -> str:
    """parallel.cp_mode resolved for a tensor-parallel rank's `heads` query and `kv_heads` K/V heads:
    auto is the all-to-all where cp divides both (no head is copied), the ring otherwise."""
    if mode != "auto":
        return mode
    return "alltoall" if heads % cp == 0 and kv_heads % cp == 0 else "ring"


class ContextAttention:
    """What an `Attention` attends with under context parallelism: `ring_attention` or
    `alltoall_attention` over `group`. Kept out of torch.compile's graphs (a compiled block breaks
    its graph around it: the collectives run eagerly), and shared, not copied, by a deep copy of
    the model (a process group cannot be copied)."""

    def __init__(self, mode: str, group):
        self.mode, self.group = mode, group
        self._attend = ring_attention if mode == "ring" else alltoall_attention

    @torch.compiler.disable
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        return self._attend(q, k, v, self.group, documents=documents)

    def __deepcopy__(self, memo: dict) -> ContextAttention:
        return self


class ContextShards:
    """An MoE layer's tokens split over the context-parallel group (and, inside it, whatever split
    them before: sequence parallelism's tensor-parallel ranks): the routing counts of its auxiliary
    losses summed over both, and each rank's share weighted by cp, since the data-parallel average
    of the gradients counts the context-parallel ranks."""

    def __init__(self, inner: TokenShards, group, cp: int):
        self.inner, self.group = inner, group
        self.size, self.loss_weight = inner.size * cp, inner.loss_weight * cp

    def sum(self, counts: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(self.inner.sum(counts).clone(), self.group, dim="cp")


def apply_context_parallel(model: torch.nn.Module, group, mode: str) -> str:
    """Every attention layer of `model` attends across the ranks of `group` (its heads are this
    tensor-parallel rank's), and every MoE layer's auxiliary losses count the tokens of the whole
    sequence (`ContextShards`); returns the attention mode used. The rotary tables are the caller's
    to cut to this rank's `positions` (`strata.model.set_rope_buffers`)."""
    from strata.model import Attention
    from strata.moe import MoE

    cp = torch.distributed.get_world_size(group)
    chosen = mode
    for module in model.modules():
        if isinstance(module, Attention):
            heads, kv_heads = (m.weight.shape[0] // module.head_dim for m in (module.wq, module.wk))
            chosen = attention_mode(mode, heads, kv_heads, cp)
            module.attend = ContextAttention(chosen, group)
        elif isinstance(module, MoE):
            module.shards = ContextShards(module.shards, group, cp)
    return chosen
