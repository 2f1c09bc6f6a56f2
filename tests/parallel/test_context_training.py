"""Context parallelism end to end (`strata train` in every rank of a gloo world): each sequence split
over cp ranks (causal load-balanced), attention across the split by the K/V ring or the all-to-all,
alone and with data parallelism under ZeRO-3 and 3-level partitioning, with tensor + sequence
parallelism, with the pipeline, with selective recompute and compile, full recompute, activation
offload, and with an MoE model's experts split over ranks (its load-balancing, sequence-wise and z
losses counting the whole sequences), must give the losses (1e-5) and final weights (1e-4) of the
same model trained in one process on whole sequences; a checkpoint saved at cp = 2 resumes in one
process and at cp = 4."""

from __future__ import annotations

import pytest
import torch

from strata.checkpoint import store

from worlds import ZERO3, final_params, losses_from, train_run

pytestmark = pytest.mark.slow  # each case starts a 2- or 4-process world

BASE = {"log.interval": 1, "checkpoint.save_final": True, "model.n_kv_heads": 2}
MOE = {
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.expert_ffn": 32,
    "model.moe.aux_loss_coef": 0.01,
    "model.moe.seq_aux_loss_coef": 0.01,
    "model.moe.z_loss_coef": 0.001,
    "model.moe.router": "sigmoid",
    "train.micro_batch_size": 1,
}


def train(
    data_dir, root, nproc: int, *extra: str, **settings
) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    train_run(data_dir, root, nproc, *extra, **{**BASE, **settings})
    return losses_from(root / "t"), final_params(root / "t" / "checkpoints")


def assert_same_run(got, want) -> None:
    (losses, params), (ref_losses, ref_params) = got, want
    assert losses.keys() == ref_losses.keys() and len(losses) >= 3
    for step, loss in ref_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}"
    assert params.keys() == ref_params.keys()
    for key, ref in ref_params.items():
        torch.testing.assert_close(
            params[key], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{key}: {m}"
        )


@pytest.fixture(scope="module")
def one_process(small_data_dir, tmp_path_factory):
    return train(small_data_dir, tmp_path_factory.mktemp("cp1"), 1)


@pytest.fixture(scope="module")
def one_process_moe(small_data_dir, tmp_path_factory):
    return train(small_data_dir, tmp_path_factory.mktemp("cp1-moe"), 1, **MOE)


@pytest.mark.parametrize(
    ("nproc", "settings"),
    [
        (2, {"parallel.cp": 2, "parallel.cp_mode": "ring"}),
        (2, {"parallel.cp": 2, "parallel.cp_mode": "alltoall"}),
        (4, {"parallel.cp": 4, "parallel.cp_mode": "ring"}),
        (4, {"parallel.cp": 2, **ZERO3}),
        (4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True}),
        (4, {"parallel.cp": 2, "parallel.pp": 2, "train.micro_batch_size": 1}),
        (2, {"parallel.cp": 2, "activations.recompute": "selective", "train.compile": True}),
        (2, {"parallel.cp": 2, "activations.recompute": "full", "parallel.cp_mode": "ring"}),
        (2, {"parallel.cp": 2, "activations.offload": "cpu", "activations.min_bytes": 1024}),
        (
            4,
            {
                "parallel.cp": 2,
                "parallel.ranks_per_node": 4,
                "parallel.ranks_per_gpu": 2,
                "zero.params.shard_over": "gpu",
                "zero.grads.shard_over": "node",
                "zero.optim.shard_over": "global",
            },
        ),
    ],
    ids=[
        "cp2-ring",
        "cp2-alltoall",
        "cp4-ring",
        "cp2-dp2-zero3",
        "cp2-tp2-sp",
        "cp2-pp2",
        "cp2-selective-compile",
        "cp2-full-recompute",
        "cp2-activation-offload",
        "cp2-3-level",
    ],
)
def test_context_parallel_matches_one_process(
    one_process, small_data_dir, tmp_path, nproc, settings
):
    assert_same_run(train(small_data_dir, tmp_path, nproc, **settings), one_process)


def test_context_parallel_with_expert_parallel_matches_one_process(
    one_process_moe, small_data_dir, tmp_path
):
    got = train(small_data_dir, tmp_path, 4, **MOE, **{"parallel.cp": 2, "parallel.ep": 2})
    assert_same_run(got, one_process_moe)


@pytest.mark.parametrize(
    ("nproc", "settings"), [(1, {}), (4, {"parallel.cp": 4})], ids=["to-cp1", "to-cp4"]
)
def test_a_checkpoint_saved_at_cp2_resumes_at_any_cp(
    one_process, small_data_dir, tmp_path, nproc, settings
):
    """Saved at step 3 by a cp = 2 run (ZeRO-1 over its dp·cp ranks), resumed in another layout: steps
    4-6 and the final weights are the one-process run's."""
    first = tmp_path / "first"
    train(
        small_data_dir,
        first,
        2,
        **{"parallel.cp": 2, "checkpoint.interval": 3, "zero.optim.shard_over": "global"},
    )
    saved = store.step_dir(first / "t" / "checkpoints", 3)
    resumed, params = train(
        small_data_dir, tmp_path / "resumed", nproc, "--resume", str(saved), **settings
    )
    ref_losses, ref_params = one_process
    assert sorted(resumed) == [4, 5, 6]
    assert_same_run((resumed, params), ({s: ref_losses[s] for s in (4, 5, 6)}, ref_params))
