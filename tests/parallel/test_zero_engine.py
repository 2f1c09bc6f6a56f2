"""The ZeRO engine's bookkeeping in one process (a world of one rank: every collective is a local
copy), against a plain model trained alongside it: a parameter that gets no gradient in a step
counts as zero even though the engine's gradient buffer is reused uncleared, and with gradient
accumulation ZeRO-3 keeps the groups it would gather again at once (the embedding between
micro-batches, the head between forward and backward) once it knows how many backward passes
the step has, while nothing gathered outlives the step."""

from __future__ import annotations

import pytest
import torch

from strata.config import ModelConfig
from strata.model import build_model, lm_loss
from strata.parallel.routes import Routes
from strata.parallel.topology import Layout, build_topology
from strata.parallel.zero import ZeroEngine, ZeroPlan

CFG = ModelConfig(n_layers=3, d_model=32, n_heads=4, seq_len=16, vocab_size=64)
G = "global"
MICRO = 3


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + micro)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def sgd(params, shape_of) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1)


def engine_for(plan: ZeroPlan):
    model = build_model(CFG, CFG.vocab_size, seed=0)
    return model, ZeroEngine([model], build_topology(Layout(dp=1), 0), plan, sgd)


@pytest.mark.parametrize(
    "plan", [ZeroPlan(optim=G), ZeroPlan(grads=G, optim=G)], ids=["zero1", "zero2"]
)
def test_a_parameter_without_a_gradient_counts_as_zero(plan):
    model, engine = engine_for(plan)
    plain = build_model(CFG, CFG.vocab_size, seed=0)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    frozen = "layers.1.attn.wq.weight"
    for step in range(3):
        if step == 1:  # no gradient this step, while its piece of the buffer still holds step 0's
            model.get_parameter(frozen).requires_grad_(False)
            plain.get_parameter(frozen).requires_grad_(False)
        x, y = batch(step, 0)
        lm_loss(model(x), y).backward()
        lm_loss(plain(x), y).backward()
        engine.finish_grads(1.0)
        grads = {
            slot.segment.name: piece.grad for g in engine.groups for slot, piece, _, _ in g.segments
        }
        for name, p in plain.named_parameters():
            want = torch.zeros_like(p) if p.grad is None else p.grad
            got = grads[name].view(p.shape)
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {step} {name}: {m}"
            )
        engine.step()
        engine.zero_grad()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        if step == 1:
            model.get_parameter(frozen).requires_grad_(True)
            plain.get_parameter(frozen).requires_grad_(True)


def _train(expect: bool, monkeypatch) -> tuple[dict, list[int], list[dict]]:
    """Two ZeRO-3 steps of MICRO micro-batches (`expect`: the engine is told how many); the
    parameters after them, the gathers of each group, and the bytes held after each step."""
    model, engine = engine_for(ZeroPlan(params=G, grads=G, optim=G))
    name_of = {id(g.full): g.name for g in engine.groups}
    gathers = dict.fromkeys(name_of.values(), 0)
    real = Routes.gather

    def counted(self, chunk, fine, coarse, out, *args, **kwargs):
        if id(out) in name_of:
            gathers[name_of[id(out)]] += 1
        return real(self, chunk, fine, coarse, out, *args, **kwargs)

    monkeypatch.setattr(Routes, "gather", counted)
    held = []
    for step in range(2):
        if expect:
            engine.expect_backwards(MICRO)
        for m in range(MICRO):
            x, y = batch(step, m)
            (lm_loss(model(x), y) / MICRO).backward()
        engine.finish_grads(1.0)
        engine.step()
        engine.zero_grad()
        held.append(engine.held_bytes())
        assert not [g.name for g in engine.groups if g.gathered], (
            "a group stayed gathered past the step"
        )
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.undo()
    return params, [gathers[g.name] for g in engine.groups], held


def test_zero3_keeps_what_it_would_gather_again_at_once(monkeypatch):
    plain_params, plain_gathers, plain_held = _train(False, monkeypatch)
    params, gathers, held = _train(True, monkeypatch)
    for name, want in plain_params.items():
        assert torch.equal(params[name], want), name
    assert held == plain_held  # after each step: the shards, nothing gathered
    # Groups: embedding, the blocks, head. Each is gathered per micro-batch for its forward and
    # again for its backward, and once more by `gathered()` at the end; but when the engine
    # knows how many backward passes the step has, the head stays from its forward into its
    # backward, and the embedding from one micro-batch's backward into the next one's forward.
    every = 2 * (2 * MICRO) + 1
    assert plain_gathers == [every] * (CFG.n_layers + 2)
    assert gathers == [2 * (MICRO + 1) + 1, *[every] * CFG.n_layers, 2 * MICRO + 1]
