"""Float8 training (`train.precision: fp8`): refused where it cannot run, the blocks' linear layers
swapped for torchao's float8 ones without touching parameters or checkpoint names, and — through
torchao's emulation (`train.fp8_emulate`), which runs float8's casts and scales on a CPU — its
numerics composed with ZeRO-3 and tensor parallelism against the single-process float8 run, and
checkpoints resumed across bf16 and fp8. The speed of real float8 matmuls is measured on a GPU by
bench/gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="float8 training needs torchao: pip install -e '.[test]'")

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.errors import ConfigError
from strata.parallel.runtime import start
from strata.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer

from conftest import run_cli, tiny_config, tiny_overrides
from worlds import COMMON, ZERO3, final_params, losses_from, train_run

EMULATED = {"train.precision": "fp8", "train.fp8_emulate": True}


def test_fp8_needs_compile_on_a_gpu_and_not_under_emulation(small_data_dir, tmp_path):
    with pytest.raises(ConfigError, match="train.compile=true"):
        tiny_config(small_data_dir, tmp_path, **{"train.precision": "fp8"})
    tiny_config(small_data_dir, tmp_path, **{"train.precision": "fp8", "train.compile": True})
    tiny_config(small_data_dir, tmp_path, **EMULATED)
    with pytest.raises(ConfigError, match="fp8_recipe"):
        tiny_config(small_data_dir, tmp_path, **EMULATED, **{"train.fp8_recipe": "blockwise"})


def test_fp8_is_refused_on_a_cpu_with_one_message_and_exit_2(small_data_dir, tmp_path, capsys):
    overrides = tiny_overrides(
        small_data_dir, tmp_path, **{"train.precision": "fp8", "train.compile": True}
    )
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    code, out = run_cli(["train", str(experiment), *overrides], capsys)
    assert code == 2, out
    assert (
        "FP8 tensor cores" in out
        and "this process trains on cpu" in out
        and "precision=bf16" in out
    )
    assert "Traceback" not in out
    assert not list((tmp_path / "t").glob("checkpoints/step_*")), (
        "nothing may be written before the refusal"
    )


def test_blocks_linears_become_float8_with_the_same_parameters(small_data_dir, tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    plain = Trainer(tiny_config(small_data_dir, tmp_path / "plain"), start())
    trainer = Trainer(tiny_config(small_data_dir, tmp_path / "fp8", **EMULATED), start())
    try:
        (part,) = trainer.model.parts
        swapped = [n for n, m in part.named_modules() if isinstance(m, Float8Linear)]
        linears = [n for n, m in part.named_modules() if type(m) is nn.Linear]
        # every linear layer of every block; the output layer stays
        assert len(swapped) == 7 * len(part.layers) and linears == ["output"], (swapped, linears)
        (ref,) = plain.model.parts
        assert list(part.state_dict()) == list(ref.state_dict())  # checkpoints see the same names
        for (name, p), (_, q) in zip(part.named_parameters(), ref.named_parameters()):
            assert p.dtype == torch.float32 and torch.equal(p, q), (
                name
            )  # fp32 master weights, same init
    finally:
        for t in (plain, trainer):
            t.checkpoints.close()
            t.model.close()


@pytest.mark.slow  # emulated fp8 and bf16 runs side by side: ~8 s on 2 cores
def test_emulated_fp8_trains_close_to_bf16_but_not_equal(small_data_dir, tmp_path):
    shared = {**COMMON, "checkpoint.interval": 0}
    bf16 = run(
        tiny_config(small_data_dir, tmp_path / "bf16", **shared, **{"train.precision": "bf16"}),
        start(),
    )
    fp8 = run(tiny_config(small_data_dir, tmp_path / "fp8", **shared, **EMULATED), start())
    rowwise = run(
        tiny_config(
            small_data_dir,
            tmp_path / "row",
            **shared,
            **EMULATED,
            **{"train.fp8_recipe": "rowwise"},
        ),
        start(),
    )
    for step, loss in bf16.losses.items():
        # float8 rounds each operand to 3 mantissa bits: a different loss, within a few percent
        assert fp8.losses[step] == pytest.approx(loss, rel=0.05), step
        assert rowwise.losses[step] == pytest.approx(loss, rel=0.05), step
    assert any(abs(fp8.losses[s] - bf16.losses[s]) > 1e-4 * bf16.losses[s] for s in bf16.losses)
    assert any(abs(fp8.losses[s] - rowwise.losses[s]) > 1e-6 for s in bf16.losses)


def test_checkpoints_resume_across_bf16_and_fp8(small_data_dir, tmp_path):
    """Float8 changes only the products: a checkpoint of either precision resumes under the other,
    with every saved tensor loaded as it was."""
    settings = {**COMMON, "checkpoint.interval": 3}
    for saved, resumed in (
        (EMULATED, {"train.precision": "bf16"}),
        ({"train.precision": "bf16"}, EMULATED),
    ):
        root = tmp_path / f"{saved['train.precision']}-to-{resumed['train.precision']}"
        first = run(tiny_config(small_data_dir, root / "a", **settings, **saved), start())
        step3 = store.step_dir(root / "a" / "t" / "checkpoints", 3)
        cfg = tiny_config(small_data_dir, root / "b", **settings, **resumed)
        trainer = Trainer(cfg, start())
        try:
            trainer.resume(step3)
            assert trainer.step == 3
            (part,) = trainer.model.parts
            saved_params = Checkpoint(step3).tensors("model.")
            for name, p in part.state_dict().items():
                if f"model.{name}" in saved_params:
                    assert torch.equal(p, saved_params[f"model.{name}"]), name
        finally:
            trainer.checkpoints.close()
            trainer.model.close()
        second = run(cfg, start(), resume=step3)
        assert sorted(second.losses) == [4, 5, 6]
        for step, loss in second.losses.items():
            assert loss == pytest.approx(first.losses[step], rel=0.05), (
                step
            )  # the other precision's rounding


# name: (processes, parallel settings, tolerance of the loss against the single-process fp8 run)
LAYOUTS = {
    # each rank casts with the scales one process would choose for the same micro-batch and weights
    # (measured: within 1e-7)
    "dp2-zero3-rowwise": (2, {**ZERO3, "train.fp8_recipe": "rowwise"}, 1e-5),
    # a tensor-parallel shard is scaled by its own absolute maximum, not the whole tensor's, and bf16
    # partial products are summed across ranks: measured within 1.2e-3 of one process over 6 steps
    "tp2-dp2-sp-zero3": (4, {**ZERO3, "parallel.tp": 2, "parallel.sequence_parallel": True}, 5e-3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_layouts_match_the_single_process_fp8_run(small_data_dir, tmp_path, name):
    nproc, parallel, rel = LAYOUTS[name]
    recipe = {k: v for k, v in parallel.items() if k == "train.fp8_recipe"}
    reference = run(
        tiny_config(small_data_dir, tmp_path / "ref", **COMMON, **EMULATED, **recipe), start()
    )
    train_run(small_data_dir, tmp_path / "par", nproc, **COMMON, **EMULATED, **parallel)
    got = losses_from(tmp_path / "par" / "t")
    assert sorted(got) == sorted(reference.losses)
    for step, loss in reference.losses.items():
        assert got[step] == pytest.approx(loss, rel=rel), step
    params = final_params(tmp_path / "par" / "t" / "checkpoints")
    want = final_params(tmp_path / "ref" / "t" / "checkpoints")
    assert params.keys() == want.keys()
    for key, ref in want.items():
        torch.testing.assert_close(
            params[key], ref, rtol=10 * rel, atol=10 * rel, msg=lambda m: f"{key}: {m}"
        )
    if parallel.get("parallel.tp", 1) > 1:
        # the tolerance above is wider than float8's own effect: the same layout in bf16 shows the
        # tensor-parallel layers really multiplied in float8
        bf16 = {k: v for k, v in parallel.items() if not k.startswith("train.fp8")}
        train_run(
            small_data_dir,
            tmp_path / "bf16",
            nproc,
            **COMMON,
            **bf16,
            **{"train.precision": "bf16"},
        )
        plain = losses_from(tmp_path / "bf16" / "t")
        assert max(abs(got[s] - plain[s]) / plain[s] for s in plain) > 1e-4


def test_tensor_parallel_layers_take_the_float8_product():
    """The tensor-parallel layers' local product is the one place float8 enters them: with it, the
    layer computes torchao's float8 matmul of its shard (emulated here), and the collectives around
    it are unchanged."""
    from dataclasses import replace

    from strata.config import TrainConfig
    from strata.trainer.float8 import float8_config, float8_matmul

    train = replace(TrainConfig(), precision="fp8", fp8_emulate=True)
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=True)
    column = ColumnParallelLinear(linear, None, 0, 1, entry="ready")
    row = RowParallelLinear(nn.Linear(48, 32, bias=False), None, 0, 1)
    x = torch.randn(4, 32)
    assert torch.equal(column(x), nn.functional.linear(x, linear.weight, linear.bias))
    from torchao.float8.float8_linear import Float8Linear

    reference = Float8Linear.from_float(nn.Linear(32, 48, bias=True), config=float8_config(train))
    reference.load_state_dict(linear.state_dict())
    column.matmul = float8_matmul(float8_config(train))
    got = column(x)
    assert torch.equal(got, reference(x))
    assert not torch.equal(got, nn.functional.linear(x, linear.weight, linear.bias))
    assert row.matmul is nn.functional.linear
