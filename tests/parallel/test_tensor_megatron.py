"""Our tensor-parallel linears against an independent numerical reference: megatron-core's
`ColumnParallelLinear` / `RowParallelLinear`, in a real 2-process gloo world with tp=2, plus a
single-process `nn.Linear` reference.

Both sides get the same full weight: megatron slices it itself (its CPU initialisation builds the
master weight with our `init_method`, which copies the full weight in, and keeps each rank's
contiguous chunk — output rows for column, input columns for row), while ours slices the same
`nn.Linear`. With the same input and the same upstream gradient we compare, per rank, outputs,
input gradients and weight-shard gradients (fp32): each layer alone, and column → GELU → row (an
MLP) against megatron and against the unsharded MLP.

Process layout: pytest runs this file as a child process (megatron's import is slow — ~10 s —
and its module-level state must not leak into other tests); the child imports megatron once and
forks the two ranks (`worlds.run_world`, start method fork), which rendezvous over TCP with a
short timeout; it reports their largest absolute differences as JSON. Megatron runs on CPU here
only with `use_cpu_initialization=True` and the default (non-sequence-parallel) path: its
sequence-parallel gathers allocate on `torch.cuda.current_device()`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worlds import REPO, TESTS

pytestmark = pytest.mark.slow  # megatron-core's layers in a 2-process gloo world (module fixture)

TP = 2
SEQ, BATCH, D_IN, D_FF, D_OUT = 5, 3, 12, 16, 10  # megatron activations are (seq, batch, hidden)
TOL = 1e-6  # relative; fp32 rounding here is ~2e-7 (0 against megatron); a wrong shard or collective is O(1)


# ---------------------------------------------------------------------------------------------
# the two ranks (run in the child process)
# ---------------------------------------------------------------------------------------------


def _full_tensors():
    """Identical on every rank: full weights, inputs and upstream gradients."""
    import torch

    g = torch.Generator().manual_seed(1234)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32)  # noqa: E731
    return {
        "w_col": rand(D_FF, D_IN),
        "w_row": rand(D_OUT, D_FF),
        "x": rand(SEQ, BATCH, D_IN),
        "x_row": rand(SEQ, BATCH, D_FF),
        "dy_col": rand(SEQ, BATCH, D_FF),
        "dy_row": rand(SEQ, BATCH, D_OUT),
    }


def _rank_body(rank: int) -> dict[str, float]:
    """Per compared quantity on this rank: max |ours − reference| / max |reference|."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mtp
    from megatron.core.model_parallel_config import ModelParallelConfig
    from torch import nn

    from strata.parallel import tensor as ours

    ps.initialize_model_parallel(tensor_model_parallel_size=TP, create_gloo_process_groups=False)
    group = ps.get_tensor_model_parallel_group()
    assert ps.get_tensor_model_parallel_rank() == rank
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=TP,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )
    t = _full_tensors()
    diffs: dict[str, float] = {}

    def record(name, a, b):  # largest |a − b| relative to the reference's largest entry
        assert a.shape == b.shape, (name, tuple(a.shape), tuple(b.shape))
        diffs[name] = ((a.detach() - b.detach()).abs().max() / b.detach().abs().max()).item()

    def copy_of(
        full,
    ):  # megatron's init_method: the master weight it then slices is our full weight
        return lambda master: master.copy_(full)

    def linear(full):
        layer = nn.Linear(full.shape[1], full.shape[0], bias=False)
        with torch.no_grad():
            layer.weight.copy_(full)
        return layer

    def mg_column(full):
        layer = mtp.ColumnParallelLinear(
            full.shape[1],
            full.shape[0],
            config=cfg,
            init_method=copy_of(full),
            bias=False,
            gather_output=False,
            keep_master_weight_for_test=True,
        )
        assert torch.equal(layer.master_weight, full)
        return layer

    def mg_row(full):
        layer = mtp.RowParallelLinear(
            full.shape[1],
            full.shape[0],
            config=cfg,
            init_method=copy_of(full),
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            keep_master_weight_for_test=True,
        )
        assert torch.equal(layer.master_weight, full)
        return layer

    def leaf(x):
        return x.clone().requires_grad_(True)

    chunk = lambda x, dim: x.chunk(TP, dim=dim)[rank]  # noqa: E731  (this rank's contiguous piece)

    # --- column: y_local = x W_localᵀ, input replicated, output split along features --------
    w, x, dy = t["w_col"], t["x"], t["dy_col"]
    a, b = ours.ColumnParallelLinear(linear(w), group, rank, TP), mg_column(w)
    record("column/weight shard", a.weight, b.weight)
    single = linear(w)
    xa, xb, xr = leaf(x), leaf(x), leaf(x)
    ya, (yb, _), yr = a(xa), b(xb), single(xr)
    ya.backward(chunk(dy, -1))
    yb.backward(chunk(dy, -1))
    yr.backward(dy)
    for ref, other in (
        ("megatron", (yb, xb.grad, b.weight.grad)),
        ("single", (chunk(yr, -1), xr.grad, chunk(single.weight.grad, 0))),
    ):
        record(f"column/output vs {ref}", ya, other[0])
        record(f"column/input grad vs {ref}", xa.grad, other[1])
        record(f"column/weight grad vs {ref}", a.weight.grad, other[2])

    # --- row: y = Σ_ranks x_local W_localᵀ, input split along features, output replicated ---
    w, x, dy = t["w_row"], t["x_row"], t["dy_row"]
    a, b = ours.RowParallelLinear(linear(w), group, rank, TP), mg_row(w)
    record("row/weight shard", a.weight, b.weight)
    single = linear(w)
    xa, xb, xr = leaf(chunk(x, -1)), leaf(chunk(x, -1)), leaf(x)
    ya, (yb, _), yr = a(xa), b(xb), single(xr)
    for y in (ya, yb, yr):
        y.backward(dy)
    for ref, other in (
        ("megatron", (yb, xb.grad, b.weight.grad)),
        ("single", (yr, chunk(xr.grad, -1), chunk(single.weight.grad, 1))),
    ):
        record(f"row/output vs {ref}", ya, other[0])
        record(f"row/input grad vs {ref}", xa.grad, other[1])
        record(f"row/weight grad vs {ref}", a.weight.grad, other[2])

    # --- MLP: column → GELU → row, against megatron's pair and the unsharded MLP ------------
    w1, w2, x, dy = t["w_col"], t["w_row"], t["x"], t["dy_row"]
    col_a = ours.ColumnParallelLinear(linear(w1), group, rank, TP)
    row_a = ours.RowParallelLinear(linear(w2), group, rank, TP)
    col_b, row_b = mg_column(w1), mg_row(w2)
    single = nn.Sequential(linear(w1), nn.GELU(), linear(w2))
    xa, xb, xr = leaf(x), leaf(x), leaf(x)
    ya = row_a(F.gelu(col_a(xa)))
    yb, _ = row_b(F.gelu(col_b(xb)[0]))
    yr = single(xr)
    for y in (ya, yb, yr):
        y.backward(dy)
    for name, other in (
        ("megatron", (yb, xb.grad, col_b.weight.grad, row_b.weight.grad)),
        ("single", (yr, xr.grad, chunk(single[0].weight.grad, 0), chunk(single[2].weight.grad, 1))),
    ):
        record(f"mlp/output vs {name}", ya, other[0])
        record(f"mlp/input grad vs {name}", xa.grad, other[1])
        record(f"mlp/column weight grad vs {name}", col_a.weight.grad, other[2])
        record(f"mlp/row weight grad vs {name}", row_a.weight.grad, other[3])
    ps.destroy_model_parallel()
    return diffs


def _worker(rank: int, size: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from worlds import join_world

    join_world(rank, size, port, timeout_s=60)
    try:
        torch.save(_rank_body(rank), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _child_main(out_dir: str) -> None:
    """Import megatron once, fork the ranks (they inherit the import), print their results."""
    import warnings

    warnings.simplefilter("ignore")
    import megatron.core.tensor_parallel  # noqa: F401  (slow; done once, before forking)

    from worlds import run_world

    results = run_world(_worker, TP, Path(out_dir), start_method="fork", timeout_s=240)
    print(json.dumps({str(r): results[r] for r in range(TP)}))


# ---------------------------------------------------------------------------------------------
# the tests (pytest process)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def diffs(tmp_path_factory) -> dict:
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip(
            "megatron-core not installed (pip install -e '.[test]' installs megatron-core==0.16.1)"
        )
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )  # worlds
    out_dir = tmp_path_factory.mktemp("megatron")
    proc = subprocess.run(
        [sys.executable, __file__, str(out_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(diffs: dict, prefix: str) -> None:
    for rank in map(str, range(TP)):
        mine = {k: v for k, v in diffs[rank].items() if k.startswith(prefix)}
        assert mine, f"rank {rank}: nothing compared for {prefix}"
        bad = {k: v for k, v in mine.items() if not v <= TOL}
        assert not bad, f"rank {rank}: max |ours − reference| / max |reference| above {TOL}: {bad}"


def test_column_parallel_linear_matches_megatron(diffs):
    _check(diffs, "column/")
    assert {"column/weight grad vs megatron", "column/input grad vs single"} <= set(diffs["0"])


def test_row_parallel_linear_matches_megatron(diffs):
    _check(diffs, "row/")


def test_mlp_matches_megatron_and_single_process(diffs):
    _check(diffs, "mlp/")
    assert sum(k.startswith("mlp/") for k in diffs["1"]) == 8  # 4 quantities × 2 references


if __name__ == "__main__":  # child process of the `diffs` fixture
    _child_main(sys.argv[1])
