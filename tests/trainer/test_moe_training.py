"""Training an MoE model in one process: the auxiliary losses weigh each micro-batch as its loss does
(accumulated micro-batches equal the loss terms added by hand), routing statistics reach
metrics.jsonl, the auxiliary-loss-free bias moves toward balance, and a checkpoint resumes with the
router biases as saved."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.model import build_model, lm_loss, moe_layers
from strata.moe import load_balancing_loss
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer

from conftest import tiny_config

MOE = {
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.expert_ffn": 32,
}


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_aux_loss_gradient_equals_the_loss_added_by_hand(small_data_dir, tmp_path):
    """One step's gradient with model.moe.aux_loss_coef over 4 micro-batches equals autograd on
    mean over micro-batches of (lm loss + coef · E·Σ f·P) written out on the plain model."""
    cfg = tiny_config(
        small_data_dir, tmp_path, **MOE, **{"model.moe.aux_loss_coef": 0.5, "log.interval": 1}
    )
    trainer = Trainer(cfg, start())
    micro = trainer.loader.next_step()
    plain = dataclasses.replace(
        cfg.model, moe=dataclasses.replace(cfg.model.moe, aux_loss_coef=0.0)
    )
    reference = build_model(
        plain, trainer.train_set.vocab_size, cfg.train.seed
    )  # no loss of its own
    reference.load_state_dict(trainer.model.parts[0].state_dict())
    routings = []
    for block in reference.layers:
        block.mlp.router.register_forward_hook(lambda m, a, out: routings.append(out))
    total = torch.zeros(())
    for batch in micro:
        routings.clear()
        logits = reference(batch.inputs)
        aux = sum(load_balancing_loss(r, 4) for r in routings)
        total = total + (lm_loss(logits, batch.targets) + 0.5 * aux) / len(micro)
    total.backward()
    want = dict(reference.named_parameters())

    model = trainer.model
    # weighted once, when the model was built, for the step's micro-batches; an evaluation in
    # between (forward only, another number of micro-batches) leaves the weight and the gradient
    layers = [layer for part in model.parts for _, layer in moe_layers(part)]
    assert layers and {layer.aux_grad_scale for layer in layers} == {1 / len(micro)}
    model.eval_loss(micro[0])
    model.forward_backward(micro)
    model.reduce_and_clip(float("inf"))
    checked = 0
    for g in model.engine.groups:
        for slot, piece, _, _ in g.segments:
            name = slot.aliases[0]
            expected = want[name].grad.flatten()
            assert (
                piece.grad is not None and piece.numel() == expected.numel()
            )  # one process: whole tensors
            torch.testing.assert_close(
                piece.grad, expected, rtol=1e-4, atol=1e-7, msg=lambda s: f"{name}: {s}"
            )
            checked += "router" in name
    assert checked == 2


def test_routing_metrics_and_bias_balance(small_data_dir, tmp_path):
    settings = {
        **MOE,
        "model.moe.router": "sigmoid",
        "model.moe.bias_update_rate": 0.01,
        "model.moe.seq_aux_loss_coef": 0.01,
        "model.moe.z_loss_coef": 0.001,
        "model.moe.capacity_factor": 1.0,
        "log.interval": 1,
        "train.steps": 4,
        "checkpoint.save_final": True,
    }
    cfg = tiny_config(small_data_dir, tmp_path, **settings)
    run(cfg, start())
    lines = [r for r in records(tmp_path / "t") if "moe" in r]
    assert len(lines) == 4
    moe = lines[-1]["moe"]
    assert set(moe) >= {"layer_0", "layer_1", "mean_load_max_over_mean", "mean_dropped_fraction"}
    layer = moe["layer_1"]
    assert layer["load_max_over_mean"] >= 1.0
    assert 0.0 <= layer["dropped_fraction"] < 0.5
    assert layer["seq_aux_loss"] > 0 and layer["z_loss"] > 0
    assert layer["aux_loss"] == 0.0  # its coefficient is off
    saved = Checkpoint(store.step_dir(tmp_path / "t" / "checkpoints", 4)).tensors("model.")
    bias = saved["layers.1.mlp.router.expert_bias"]
    # four updates of ±0.01 each: every entry is a multiple of 0.01 within ±0.04, and they are not all zero
    assert bias.abs().max() <= 0.04 + 1e-6 and bias.abs().sum() > 0
    torch.testing.assert_close(bias * 100, (bias * 100).round(), rtol=0, atol=1e-4)

    # resuming puts the biases back as saved (and the run goes on from there)
    more = tiny_config(small_data_dir, tmp_path, **{**settings, "train.steps": 5})
    trainer = Trainer(more, start())
    trainer.resume(store.step_dir(tmp_path / "t" / "checkpoints", 4))
    live = trainer.model.persistent_buffers()["layers.1.mlp.router.expert_bias"]
    torch.testing.assert_close(live, bias)


@pytest.mark.slow  # two runs of 30 steps: ~6 s
def test_bias_update_balances_the_load(small_data_dir, tmp_path):
    """Aux-loss-free balancing: over the last 10 of 30 steps the experts' load is far more even with
    the bias update than in the same run without it (a tiny router collapses onto two experts)."""

    def window_imbalance(rate: float, name: str) -> float:
        settings = {
            **MOE,
            "model.moe.num_experts": 8,
            "model.moe.router": "sigmoid",
            "model.moe.bias_update_rate": rate,
            "log.name": name,
            "train.steps": 30,
        }
        trainer = Trainer(tiny_config(small_data_dir, tmp_path, **settings), start())
        load = torch.zeros(8, dtype=torch.float64)
        for step in range(30):
            trainer.train_step()
            assert trainer.routing is not None and trainer.routing.totals is not None
            if step >= 20:
                load += trainer.routing.totals[1, :8]
        return float(load.max() / load.mean())

    balanced, free = window_imbalance(0.05, "bias"), window_imbalance(0.0, "none")
    print(
        f"max/mean load over steps 21-30: {balanced:.2f} with the bias update, {free:.2f} without"
    )
    assert balanced < 0.75 * free
