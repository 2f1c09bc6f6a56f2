"""Expert parallelism end to end (`strata train` in every rank of a gloo world): MoE models trained
with their experts split over 2 and 4 ranks (all-to-all dispatch, hierarchical where the 4 ranks
are 2 nodes of 2; expert gradients reduced over the expert-data-parallel ranks), alone and under
ZeRO-1/2/3, must give the losses and final weights of the same model trained in one process
(dropless routing, auxiliary and z losses on, so the router's gradient is checked too); a
checkpoint saved at ep=4 resumes at ep=2 and in one process, router biases and optimizer state
included."""

from __future__ import annotations

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint

from worlds import ZERO3, final_params, losses_from, train_run

pytestmark = pytest.mark.slow  # each case starts a 2- or 4-process world

MOE = {
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.expert_ffn": 32,
    "model.moe.aux_loss_coef": 0.01,
    "model.moe.z_loss_coef": 0.001,
    "model.moe.router": "sigmoid",
    "model.moe.bias_update_rate": 0.01,
    "log.interval": 1,
    "checkpoint.save_final": True,
    "checkpoint.interval": 3,
    "train.micro_batch_size": 1,
}


def train(
    data_dir, root, nproc: int, *extra: str, **settings
) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    train_run(data_dir, root, nproc, *extra, **{**MOE, **settings})
    return losses_from(root / "t"), final_params(root / "t" / "checkpoints")


@pytest.fixture(scope="module")
def one_process(small_data_dir, tmp_path_factory):
    return train(small_data_dir, tmp_path_factory.mktemp("ep1"), 1)


def assert_same_run(got, want) -> None:
    (losses, params), (ref_losses, ref_params) = got, want
    assert losses.keys() == ref_losses.keys()
    for step, loss in ref_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), f"step {step}"
    assert params.keys() == ref_params.keys()
    for key, ref in ref_params.items():
        torch.testing.assert_close(
            params[key], ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{key}: {m}"
        )


@pytest.mark.parametrize(
    ("nproc", "settings"),
    [
        (4, {"parallel.ep": 4, "parallel.ranks_per_node": 2, **ZERO3}),
        (
            4,
            {
                "parallel.ep": 2,
                "zero.optim.shard_over": "global",
                "zero.grads.shard_over": "global",
            },
        ),
        (
            4,
            {
                "parallel.tp": 2,
                "parallel.sequence_parallel": True,
                "parallel.ep": 4,
                "zero.optim.shard_over": "global",
            },
        ),
        (2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
        (
            4,
            {
                "parallel.ep": 2,
                "parallel.ranks_per_node": 4,
                "parallel.ranks_per_gpu": 2,
                "zero.params.shard_over": "gpu",
                "zero.grads.shard_over": "node",
                "zero.optim.shard_over": "global",
            },
        ),
        (2, {"parallel.ep": 2, "zero.optim.shard_over": "global", "offload.optim.device": "cpu"}),
        (
            2,
            {
                "parallel.ep": 2,
                "zero.optim.shard_over": "global",
                "offload.optim.device": "nvme",
                "nvme": True,
            },
        ),
        (
            2,
            {
                "parallel.ep": 2,
                "parallel.pp": 1,
                "activations.recompute": "selective",
                "train.compile": True,
            },
        ),
    ],
    ids=[
        "ep4-2nodes-zero3",
        "ep2-dp4-zero2",
        "tp2-sp-ep4-zero1",
        "tp2-sp-ep1",
        "ep2-3level",
        "ep2-optim-cpu",
        "ep2-optim-nvme",
        "ep2-compile-selective",
    ],
)
def test_expert_parallel_training_matches_one_process(
    small_data_dir, tmp_path, one_process, nproc, settings
):
    """Composed with ZeRO at every level (3-level: a GPU's GCD pair, the node, the world, for experts
    and dense state each over their own ranks), optimizer offload to host memory and NVMe, and
    compilation with selective recomputation (the MoE layers run eagerly inside compiled blocks)."""
    settings = dict(settings)
    if settings.pop("nvme", False):
        settings["offload.nvme_path"] = str(tmp_path / "swap")
    assert_same_run(train(small_data_dir, tmp_path, nproc, **settings), one_process)


@pytest.fixture(scope="module")
def ep4(small_data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ep4")
    return root, train(small_data_dir, root, 4, **{"parallel.ep": 4})


@pytest.mark.parametrize(
    ("nproc", "settings"),
    [(2, {"parallel.ep": 2}), (2, {"parallel.pp": 2})],
    ids=["to-ep2", "to-ep1-pp2"],
)
def test_a_checkpoint_saved_at_ep4_resumes_in_other_layouts(
    small_data_dir, tmp_path, ep4, nproc, settings
):
    """Experts resharded like any tensor (rows of the stacked weights), their optimizer state and
    the router biases with them: the resumed run's steps 4-6 and final weights are the saving run's."""
    root, (losses, params) = ep4
    saved = store.step_dir(root / "t" / "checkpoints", 3)
    assert Checkpoint(saved).tensors("model.")["layers.1.mlp.router.expert_bias"].abs().sum() > 0
    resumed, resumed_params = train(
        small_data_dir, tmp_path, nproc, "--resume", str(saved), **settings
    )
    assert sorted(resumed) == [4, 5, 6]
    assert_same_run((resumed, resumed_params), ({s: losses[s] for s in (4, 5, 6)}, params))
