"""The planner's memory model (`strata.plan.memory.estimate_memory`) against the bytes real
training ranks hold: one 4-rank gloo world trains two steps of every layout in
`memory_probe.LAYOUTS` (plain data parallelism, ZeRO-1/2/3 with one and two groups prefetched,
3-level and per-node partitioning, hpZ, tensor parallelism with sequence parallelism, 1F1B, GPipe
and interleaved pipelines, recomputation, activation offload to host memory and NVMe, optimizer
offload to host memory and NVMe, bf16 autocast, MoE models under expert parallelism, context
parallelism by ring and all-to-all, alone and with tp + SP and ZeRO-3), and every
rank's bytes of each kind and tier, measured from its tensors (`memory_probe.measure`), must be
within 10% of the model's figure for its pipeline stage (4 KiB where both are smaller than that;
for an MoE model's activations, the fullest rank of the stage: routing decides each rank's share).
Gradient buckets are reported, not compared: how long they live depends on how far the overlapped
reductions lag behind backward.

The probe itself is checked first, in one process, on a graph whose saved tensors are known.
"""

from __future__ import annotations

import pytest
import torch

from memory_probe import LAYOUTS, SavedTensors, compare, run_probe


def test_probe_counts_each_saved_storage_once_while_autograd_holds_it():
    x = torch.randn(1000, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(1000))
    probe = SavedTensors(lambda: {w.untyped_storage().data_ptr()})
    with probe.watching():
        y = x.exp()  # saves y (4000 bytes)
        z = y.sin()  # saves y again: the same storage, counted once
        u = z * w  # saves z (4000 bytes) and w (a parameter: not an activation)
        v = u[:500] * 2.0  # a view and a multiply by a constant: nothing saved
    assert probe.saved.now == 8000
    v.sum().backward()
    assert probe.saved.now == 0  # autograd freed the graph: every handle went
    assert probe.saved.peak == 8000
    assert probe.copies.peak == 0


def test_probe_sees_autocast_weight_copies():
    lin = torch.nn.Linear(64, 32, bias=False)
    ptrs = {lin.weight.untyped_storage().data_ptr()}
    probe = SavedTensors(lambda: ptrs)
    x = torch.randn(8, 64, requires_grad=True)
    with probe.watching(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)
    # the bf16 copies of the weight (32·64·2) and of the input (8·64·2), both saved by the matmul
    assert probe.copies.now == 32 * 64 * 2
    assert probe.saved.now == 32 * 64 * 2 + 8 * 64 * 2
    out.float().sum().backward()
    assert probe.saved.now == probe.copies.now == 0


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("memprobe")
    return run_probe(list(LAYOUTS), root / "ranks", root / "nvme", timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_kind_is_within_ten_percent_of_the_model(measured, layout, tmp_path):
    rows = compare(layout, measured[layout], tmp_path)
    assert rows, "nothing measured"
    bad = [
        f"rank {r['rank']} (stage {r['pp_stage']}) {r['key']}: predicted {r['predicted']}, measured "
        f"{r['measured']} ({100 * r['error']:+.1f}%)"
        for r in rows
        if not r["ok"]
    ]
    assert not bad, f"{layout}:\n" + "\n".join(bad)
