"""The offload host pool (strata/offload/pool.py): one arena, page-aligned slabs reused across transfers,
a budget that is never exceeded — a borrow beyond it waits for a slab to come back, or fails
naming who holds them — each stream's guaranteed share, and pinning once when CUDA exists."""

from __future__ import annotations

import threading

import pytest
import torch

from strata.errors import ConfigError
from strata.offload.io_engine import ALIGN
from strata.offload.pool import HostPool, OffloadBudgetError

SLAB = 4 * ALIGN


def test_slabs_are_aligned_disjoint_and_reused_within_the_fixed_arena():
    pool = HostPool(staging_bytes=3 * SLAB, slab_bytes=SLAB, resident_bytes=5000)
    arena_size = pool.arena.numel()
    resident = pool.resident(5000)
    assert resident.data_ptr() % ALIGN == 0
    seen = set()
    for size in (SLAB, 3 * SLAB + 17, 10 * SLAB):  # transfers of any size stream through slabs
        for start in range(0, size, SLAB):
            slabs = [pool.borrow("params") for _ in range(min(3, -(-(size - start) // SLAB)))]
            ptrs = {s.tensor.data_ptr() for s in slabs}
            assert len(ptrs) == len(slabs) and all(p % ALIGN == 0 for p in ptrs)
            assert all(
                p >= resident.data_ptr() + 8192 for p in ptrs
            )  # never inside the resident region
            seen |= ptrs
            for s in slabs:
                pool.give_back(s)
    assert (
        len(seen) == 3 and pool.arena.numel() == arena_size and pool.peak_staging_bytes == 3 * SLAB
    )
    with pytest.raises(OffloadBudgetError, match="resident region"):
        pool.resident(ALIGN)


def test_a_borrow_beyond_the_budget_waits_for_a_slab_to_come_back():
    pool = HostPool(staging_bytes=2 * SLAB, slab_bytes=SLAB)
    held = [pool.borrow("optim"), pool.borrow("optim")]
    threading.Timer(0.2, pool.give_back, args=(held[0],)).start()
    got = pool.borrow("optim", timeout_s=30)
    assert got.index == held[0].index and pool.waits == 1 and pool.wait_s > 0
    with pytest.raises(
        OffloadBudgetError, match=r"2 slabs .* stayed exhausted for 0.1 s .* held by optim:2"
    ):
        pool.borrow("params", timeout_s=0.1)


def test_each_stream_keeps_its_guaranteed_share():
    pool = HostPool(
        staging_bytes=4 * SLAB, slab_bytes=SLAB, min_slabs={"params": 1, "activations": 1}
    )
    burst = [pool.borrow("activations") for _ in range(3)]  # its own slab and the two shared ones
    with pytest.raises(OffloadBudgetError):
        pool.borrow("activations", timeout_s=0.05)
    pool.borrow("params", timeout_s=0.05)  # still there for the reads the next block waits on
    assert len(burst) == 3
    with pytest.raises(ConfigError, match="set it to at least"):
        HostPool(staging_bytes=SLAB, slab_bytes=SLAB, min_slabs={"params": 1, "optim": 1})


def test_the_arena_is_pinned_once_when_cuda_exists(monkeypatch):
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    pool = HostPool(staging_bytes=2 * SLAB, slab_bytes=SLAB, resident_bytes=ALIGN)
    for _ in range(3):
        pool.give_back(pool.borrow("params"))
    pool.close()
    # once, the whole arena (resident + staging), however many slabs went through it
    assert calls == [
        ("register", pool.arena.data_ptr(), ALIGN + 2 * SLAB, 0),
        ("unregister", pool.arena.data_ptr()),
    ]
    assert pool.pinned is False
