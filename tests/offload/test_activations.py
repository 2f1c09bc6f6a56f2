"""Activation offload and recomputation (strata/offload/activations.py) on a tiny GPT, fp32, two
micro-batches accumulated as the trainer does: loss and every gradient bit-identical to keeping
activations, for host and swap-file offload, full and selective recomputation, and both together
(selective recomputation repeating the element-wise ops and none of the matmuls); and the behaviour
behind it — deduplicated storages, parameters kept by reference, real file reads and writes,
forwarding while writes are in flight, prefetch per micro-batch, release when autograd drops a
saved tensor, regions reused across steps, and a smaller peak of saved bytes held."""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from strata.config import ModelConfig
from strata.model import GPT, lm_loss
from strata.offload.activations import (
    WRITE_WINDOW,
    ActivationOffloader,
    _Saved,
    apply_recompute,
    blocks_of,
)
from strata.offload.files import SwapDir
from strata.offload.io_engine import IOEngine, SwapIOError
from strata.offload.pool import HostPool
from strata.offload.swap import Mover

CFG = ModelConfig(n_layers=4, d_model=64, n_heads=4, seq_len=64)
VOCAB = 128
MIN_BYTES = (
    16 << 10
)  # (4, 64, 64) fp32 activations are 64 KiB: offloaded; norms' statistics are not
SLAB = 256 << 10


pytestmark = pytest.mark.usefixtures("one_thread")


def micro_batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (4, CFG.seq_len), generator=gen),
            torch.randint(0, VOCAB, (4, CFG.seq_len), generator=gen),
        )
        for _ in range(n)
    ]


def build() -> GPT:
    model = GPT(CFG, VOCAB)
    model.init_weights(0)
    return model


class GatedEngine(IOEngine):
    """Writes wait for `gate`: backward then starts while every write is still in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def write(self, *args, **kwargs):
        self.gate.wait(30)
        return super().write(*args, **kwargs)


@contextlib.contextmanager
def swap_setup(tmp_path, engine_cls=IOEngine):
    """The nvme path as the trainer builds it: an engine, a small pool, the activations mover and file."""
    engine = engine_cls(threads=2)
    pool = HostPool(staging_bytes=4 * SLAB, slab_bytes=SLAB, min_slabs={"activations": 2})
    mover = Mover(pool, engine, "activations")
    swap_dir = SwapDir(tmp_path, rank=0)
    try:
        yield mover, swap_dir.file("activations")
    finally:
        mover.close()
        engine.close()
        pool.close()
        swap_dir.close()


def train_step(model: GPT, off: ActivationOffloader | None, batches, before_backward=None) -> float:
    """Trainer.forward_backward's loop (backward per micro-batch), inside `saving()` when offloading."""
    total = 0.0
    with off.saving() if off else contextlib.nullcontext():
        for x, y in batches:
            loss = lm_loss(model(x), y) / len(batches)
            if before_backward:
                before_backward()
            loss.backward()
            total += loss.item()
    return total


def run(
    mode: str | None = None,
    recompute: bool | str = False,
    mover=None,
    swap_file=None,
    before_backward=None,
    **kw,
) -> tuple[float, dict[str, torch.Tensor], ActivationOffloader | None]:
    model = build()
    if recompute:
        apply_recompute([model], "full" if recompute is True else recompute)
    off = None
    if mode:
        off = ActivationOffloader(mode, MIN_BYTES, mover, swap_file, **kw)
        off.attach([model])
    loss = train_step(
        model, off, micro_batches(), before_backward and (lambda: before_backward(off))
    )
    if off:
        off.end_step()
    return loss, {n: p.grad for n, p in model.named_parameters()}, off


@pytest.fixture(scope="module")
def reference():
    return run()


def assert_identical(result, reference) -> None:
    loss, grads, _ = result
    ref_loss, ref_grads, _ = reference
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    different = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
    assert not different, f"gradients differ: {different}"


def test_host_offload_gives_identical_gradients_and_stores_each_storage_once(reference):
    result = run("cpu")
    assert_identical(result, reference)
    s = result[2].stats
    assert (
        s["packed"] > 0 and s["deduplicated"] > 0 and s["writes"] == s["packed"] - s["deduplicated"]
    )
    assert s["skipped_leaf"] > 0 and s["skipped_small"] > 0 and s["live_saved_bytes"] == 0


def test_host_offload_through_the_mover_reuses_its_host_buffers_across_steps(reference):
    """As on a GPU: copies run on the mover's thread, and host buffers are reused, not reallocated."""
    pool = HostPool(staging_bytes=2 * SLAB, slab_bytes=SLAB)
    mover = Mover(pool, None, "activations")  # host-tensor transfers need no file engine
    try:
        model = build()
        off = ActivationOffloader("cpu", MIN_BYTES, mover)
        off.attach([model])
        reserved = []
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            loss = train_step(model, off, micro_batches(), off.flush)
            off.end_step()
            reserved.append(off.stats["host_reserved_bytes"])
        assert_identical((loss, {n: p.grad for n, p in model.named_parameters()}, off), reference)
        s = off.stats
        assert s["writes"] > 0 and s["live_saved_bytes"] == 0 and reserved[0] == reserved[1] > 0
        # less than a step's copies: the second micro-batch reuses the buffers the first one freed
        assert reserved[0] < s["bytes_offloaded"] / 2
    finally:
        mover.close()
        pool.close()


def test_swap_file_reads_back_every_storage_when_writes_finish_before_backward(reference, tmp_path):
    with swap_setup(tmp_path) as (mover, swap_file):
        result = run(
            "nvme", mover=mover, swap_file=swap_file, before_backward=ActivationOffloader.flush
        )
        s = result[2].stats
        assert_identical(result, reference)
        assert s["writes"] > 0 and s["reads"] == s["writes"] and s["forwarded"] == 0
        assert s["deduplicated"] > 0 and s["bytes_read"] == s["bytes_offloaded"] > 0
        assert (
            mover.engine.bytes_written >= s["bytes_offloaded"]
            and mover.engine.bytes_read >= s["bytes_read"]
        )
        assert os.path.getsize(swap_file.path) == s["file_bytes"] >= s["file_step_peak_bytes"] > 0


def test_unpacks_are_served_from_memory_while_writes_are_in_flight(reference, tmp_path):
    """Backward starts while the disk has not finished one write: every storage is served from
    memory, and the copies not yet handed to the mover are never written at all."""
    with swap_setup(tmp_path, GatedEngine) as (mover, swap_file):
        try:
            model = build()
            off = ActivationOffloader("nvme", MIN_BYTES, mover, swap_file)
            off.attach([model])
            loss = train_step(model, off, micro_batches())
            s = off.stats
            stored = s["packed"] - s["deduplicated"]
            assert s["forwarded"] == stored > 0 and s["reads"] == 0 and s["writes"] == WRITE_WINDOW
        finally:
            mover.engine.gate.set()
        off.end_step()  # waits for the writes in flight before the regions are reused
        s = off.stats
        assert s["writes"] == WRITE_WINDOW and s["writes_skipped"] == stored - WRITE_WINDOW
        assert_identical((loss, {n: p.grad for n, p in model.named_parameters()}, off), reference)


def test_recompute_gives_identical_gradients_alone_and_with_offload(reference, tmp_path):
    assert_identical(run(recompute=True), reference)
    kept = run("none")[2].stats["counted"]
    with swap_setup(tmp_path) as (mover, swap_file):
        result = run(
            "nvme",
            recompute=True,
            mover=mover,
            swap_file=swap_file,
            before_backward=ActivationOffloader.flush,
        )
    assert_identical(result, reference)
    s = result[2].stats
    # only what is saved outside the checkpointed blocks reaches the outer hooks: block inputs, the head
    assert 0 < s["packed"] + s["skipped_small"] < kept and s["reads"] > 0


def test_selective_recompute_gives_identical_gradients_alone_and_with_offload(reference):
    assert_identical(run(recompute="selective"), reference)
    assert_identical(run("cpu", recompute="selective"), reference)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run while it is active, by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(recompute: str | None) -> collections.Counter:
    """The ops backward of one micro-batch runs (recomputation included) with `recompute`."""
    model = build()
    if recompute:
        apply_recompute([model], recompute)
    x, y = micro_batches(1)[0]
    loss = lm_loss(model(x), y)
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_selective_recompute_repeats_the_element_wise_ops_but_no_matmul():
    kept, selective, full = backward_ops(None), backward_ops("selective"), backward_ops("full")
    matmuls = ("mm", "addmm", "bmm")
    # backward's own matmuls only (input and weight gradients); full recomputation adds the forward's
    assert sum(selective[op] for op in matmuls) == sum(kept[op] for op in matmuls) > 0
    assert sum(full[op] for op in matmuls) > sum(kept[op] for op in matmuls)
    attention = [op for op in full if op.startswith("_scaled_dot_product") and "backward" not in op]
    assert attention and not any(selective[op] > kept[op] for op in attention)
    # what selective recomputes: every block's SwiGLU activation and norms run again in backward
    norm = (
        "_fused_rms_norm" if full["_fused_rms_norm"] else "rsqrt"
    )  # a kernel, or torch's decomposition
    for op in ("silu", norm):
        assert selective[op] == full[op] > kept[op], op


def test_leaves_are_kept_by_reference_and_never_offloaded():
    model = build()
    off = ActivationOffloader("cpu", 0, None, None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = []
    pack = off._pack
    off._pack = lambda t: (
        packed.append((t, pack(t))) or packed[-1][1]
    )  # saving() takes the hooks from here
    train_step(model, off, micro_batches(1))
    leaves = [(t, out) for t, out in packed if (t._base if t._base is not None else t).is_leaf]
    assert any(isinstance(t, torch.nn.Parameter) for t, _ in leaves)
    assert all(out is t for t, out in leaves)
    offloaded = [out for _, out in packed if isinstance(out, _Saved)]
    assert offloaded and not any(
        s.entry.storage() is not None and s.entry.storage().data_ptr() in params for s in offloaded
    )
    packed.clear()
    del leaves, offloaded
    off.end_step()


def test_peak_of_saved_bytes_held_is_below_keeping_them(tmp_path):
    """With writes bounded in flight (unbounded, the peak depends on how far the disk lags compute)
    the saved bytes held at once are: the small ones, a few pending writes, and in backward the
    layer being differentiated plus the one read ahead."""
    keep = run("none")[2].stats["peak_live_saved_bytes"]
    with swap_setup(tmp_path) as (mover, swap_file):
        off = run("nvme", mover=mover, swap_file=swap_file, max_inflight_bytes=128 << 10)[2]
    assert 0 < off.stats["peak_live_saved_bytes"] < 0.6 * keep


def test_prefetch_reads_the_previous_layer_of_the_same_micro_batch(tmp_path):
    """Two forwards before either backward (a pipeline's warm-up): each backward reads only its own
    micro-batch, one read on demand (the last layer's first) and the rest ahead."""
    with swap_setup(tmp_path) as (mover, swap_file):
        model = build()
        off = ActivationOffloader("nvme", MIN_BYTES, mover, swap_file)
        off.attach([model])
        with off.saving():
            losses = [lm_loss(model(x), y) for x, y in micro_batches()]
        assert {key[:2] for key in off._groups} == {(0, 0), (0, 1)}
        off.flush()
        losses[0].backward()
        first = off.stats
        assert first["reads"] == first["writes"] // 2 and first["demand_reads"] == 1
        losses[1].backward()
        assert off.stats["reads"] == first["writes"] and off.stats["demand_reads"] == 2
        del losses
        off.end_step()


def test_saved_tensors_are_released_when_autograd_drops_them_not_at_first_unpack(tmp_path):
    """A second backward over a retained graph (as the zero-bubble schedules' weight pass) unpacks again."""
    with swap_setup(tmp_path) as (mover, swap_file):
        outs = {}
        for mode in (None, "nvme"):
            model = build()
            off = mode and ActivationOffloader(mode, MIN_BYTES, mover, swap_file)
            if off:
                off.attach([model])
            ((x, y),) = micro_batches(1)
            with off.saving() if off else contextlib.nullcontext():
                loss = lm_loss(model(x), y)
            if off:
                off.flush()
            first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
            if off:
                assert off.stats["live_saved_bytes"] > 0  # still held: the graph is
                with pytest.raises(RuntimeError, match="still referenced"):
                    off.end_step()
            loss.backward()
            outs[mode] = (first, [p.grad for p in model.parameters()])
            del loss
            if off:
                off.end_step()
                assert (
                    off.stats["live_saved_bytes"] == 0 and off.stats["reads"] == off.stats["writes"]
                )
    for a, b in zip(outs[None], outs["nvme"]):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_file_regions_are_reused_step_after_step(tmp_path):
    with swap_setup(tmp_path) as (mover, swap_file):
        model = build()
        off = ActivationOffloader("nvme", MIN_BYTES, mover, swap_file)
        off.attach([model])
        sizes = []
        for _ in range(3):
            train_step(model, off, micro_batches())
            off.end_step()
            sizes.append(os.path.getsize(swap_file.path))
        s = off.stats
        assert s["steps"] == 3 and s["file_grows"] == 1 and sizes == [s["file_bytes"]] * 3
        # more bytes went through the file than one step's room: regions were reused. (How much a
        # step offloads varies under load, as writes still in flight keep some activations in memory.)
        assert (
            s["bytes_offloaded"] > s["file_step_peak_bytes"] * 1.5
            and s["file_step_peak_bytes"] <= s["file_bytes"]
        )


def test_a_full_disk_while_growing_the_file_names_the_keys(tmp_path, monkeypatch):
    with swap_setup(tmp_path) as (mover, swap_file):

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", full)
        model = build()
        off = ActivationOffloader("nvme", MIN_BYTES, mover, swap_file)
        with pytest.raises(SwapIOError, match=r"activations\.offload.*ENOSPC.*offload\.nvme_path"):
            train_step(model, off, micro_batches(1))
        off.close()


def test_two_live_storages_at_one_address_are_never_merged():
    buf = bytearray(64 << 10)

    class Over(torch.autograd.Function):
        """A new storage object over the same memory on every call."""

        @staticmethod
        def forward(ctx, a):
            out = torch.frombuffer(buf, dtype=torch.float32)
            out.copy_(a)
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            (out,) = ctx.saved_tensors
            return grad * out

    off = ActivationOffloader("cpu", 0)
    a = torch.ones(16 << 10, requires_grad=True)
    with off.saving():
        y1, y2 = Over.apply(a), Over.apply(a)
        assert y1.data_ptr() == y2.data_ptr() and y1.untyped_storage() is not y2.untyped_storage()
        z = y1.sin()  # saves y1 again: the same live storage
    assert off.stats["writes"] == 2 and off.stats["deduplicated"] == 1
    (z.sum() + y2.sum()).backward()
    del y1, y2, z
    off.end_step()


def test_recompute_fires_block_hooks_once_per_forward():
    model = build()
    apply_recompute([model])
    apply_recompute([model])  # idempotent
    calls = []
    for i, block in enumerate(blocks_of(model)):
        block.register_forward_pre_hook(lambda m, args, i=i: calls.append(("pre", i)))
        block.register_forward_hook(lambda m, args, out, i=i: calls.append(("post", i)))
    train_step(model, None, micro_batches())
    assert calls == [(when, i) for i in range(CFG.n_layers) for when in ("pre", "post")] * 2
    with torch.no_grad():
        model(micro_batches(1)[0][0])  # evaluation: no checkpointing at all


def test_unknown_mode_and_missing_swap_file_are_refused():
    with pytest.raises(ValueError, match="none, cpu, nvme"):
        ActivationOffloader("disk", 0)
    with pytest.raises(ValueError, match="mover"):
        ActivationOffloader("nvme", 0)
