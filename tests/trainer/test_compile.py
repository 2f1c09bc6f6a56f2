"""Regional compilation (`train.compile`): the compiled trainer against the eager one — one process,
then composed with tensor parallelism (sequence parallel, ZeRO-3, selective recomputation) and with
pipeline parallelism (ZeRO-3, full recomputation, activation offload) in real gloo worlds started
in in-process worlds (`worlds.train_run`), each against the eager single-process run of the same global batch, and a
compiled run resumed from its own checkpoint. Every block runs one compiled graph."""

from __future__ import annotations

import pytest

from strata.checkpoint import store
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer

from conftest import tiny_config
from worlds import COMMON, ZERO3, assert_same_params, final_params, losses_from, train_run

pytestmark = pytest.mark.slow  # each test compiles (tens of seconds on 2 cores)

# Compiled kernels fuse element-wise ops and may sum in another order: fp32 rounding, no more.
LOSS_TOLERANCE = {"rel": 1e-5, "abs": 1e-6}


def test_compiled_training_matches_eager_and_shares_one_graph(small_data_dir, tmp_path):
    import torch._dynamo

    shared = {**COMMON, "model.n_layers": 4, "checkpoint.interval": 0}
    eager = run(tiny_config(small_data_dir, tmp_path / "eager", **shared), start())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = tiny_config(small_data_dir, tmp_path / "compiled", **shared, **{"train.compile": True})
    compiled = run(cfg, start())
    assert sorted(compiled.losses) == sorted(eager.losses) == list(range(1, 7))
    for step, loss in eager.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, **LOSS_TOLERANCE), step
    # four blocks, one compiled frame: the training graph, and the evaluation's (no grad) once
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] in (1, 2)
    assert sum(torch._dynamo.utils.counters["recompiles"].values()) <= 1


def test_compile_leaves_hooks_and_communicating_layers_eager(small_data_dir, tmp_path):
    """What the trainer compiles: each block's forward, with its module hooks outside."""
    cfg = tiny_config(
        small_data_dir, tmp_path, **{"train.compile": True, "activations.recompute": "selective"}
    )
    trainer = Trainer(cfg, start())
    try:
        (part,) = trainer.model.parts
        for block in part.layers:
            assert "forward" in block.__dict__ and hasattr(
                block.forward, "_torchdynamo_orig_callable"
            )
        calls = []
        part.layers[0].register_forward_pre_hook(lambda m, args: calls.append("pre"))
        trainer.train_step()
        micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
        assert (
            calls == ["pre"] * micro
        )  # once per real forward: not traced away, not repeated by recompute
    finally:
        trainer.checkpoints.close()
        trainer.model.close()


# name: (processes, parallel settings, settings shared with the reference)
LAYOUTS = {
    "tp2-dp2-sp-zero3-selective": (
        4,
        {
            **ZERO3,
            "parallel.tp": 2,
            "parallel.sequence_parallel": True,
            "activations.recompute": "selective",
        },
        {},
    ),
    "pp2-dp2-zero3-full-offload": (
        4,
        {**ZERO3, "parallel.pp": 2, "activations.recompute": "full", "activations.offload": "cpu"},
        {"model.n_layers": 4, "activations.min_bytes": 0},
    ),
}
RESUMED = {"pp2-dp2-zero3-full-offload"}  # a compiled resume, once: each compiles the world anew


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layouts_match_the_eager_single_process_run(small_data_dir, tmp_path, name):
    nproc, parallel, shared = LAYOUTS[name]
    reference_cfg = tiny_config(small_data_dir, tmp_path / "ref", **COMMON, **shared)
    reference = run(reference_cfg, start())

    compiled = {**COMMON, **shared, **parallel, "train.compile": True}
    train_run(small_data_dir, tmp_path / "par", nproc, **compiled)
    par_losses = losses_from(tmp_path / "par" / "t")
    assert sorted(par_losses) == sorted(reference.losses)
    for step, loss in reference.losses.items():
        assert par_losses[step] == pytest.approx(loss, **LOSS_TOLERANCE), step
    ref_params = final_params(reference_cfg.checkpoint_dir())
    assert_same_params(final_params(tmp_path / "par" / "t" / "checkpoints"), ref_params)

    if name not in RESUMED:
        return
    # the compiled run resumed from its own step-3 checkpoint ends where it did
    train_run(
        small_data_dir,
        tmp_path / "resumed",
        nproc,
        f"--resume={store.step_dir(tmp_path / 'par' / 't' / 'checkpoints', 3)}",
        **compiled,
    )
    resumed = losses_from(tmp_path / "resumed" / "t")
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(par_losses[step], **LOSS_TOLERANCE), step
    assert_same_params(final_params(tmp_path / "resumed" / "t" / "checkpoints"), ref_params)
