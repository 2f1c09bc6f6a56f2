"""The Mixture-of-Experts layer against independent references: transformers' Qwen3-MoE sparse block
(same weights, softmax router with and without renormalising), its load-balancing loss, a per-token
loop over the experts, the DeepSeek-V3 formulas written out loop by loop, and autograd on the
explicitly added auxiliary loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from strata.config import ModelConfig, MoEConfig, from_dict
from strata.errors import ConfigError
from strata.model import build_model, count_params, flops_per_token
from strata.moe import (
    MoE,
    load_balancing_loss,
    sequence_balance_loss,
    update_expert_bias,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def moe_cfg(**moe) -> ModelConfig:
    base = dict(num_experts=4, top_k=2, expert_ffn=16)
    base.update(moe)
    return ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=8, moe=MoEConfig(**base))


def layer(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Σ_k weight · SwiGLU_e(x) token by token, from the router's own choice."""
    flat = x.reshape(-1, x.shape[-1])
    routing = moe.router(flat)
    ex = moe.experts
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(flat.shape[1])
        for slot in range(routing.experts.shape[1]):
            e, w = int(routing.experts[t, slot]), routing.weights[t, slot]
            if routing.kept is not None and not routing.kept[t, slot]:
                continue
            h = F.silu(ex.w1[e] @ flat[t]) * (ex.w3[e] @ flat[t])
            acc = acc + w * (ex.w2[e] @ h)
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.view(x.shape)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_matches_transformers_qwen3_moe_block(norm_topk):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = moe_cfg(norm_topk=norm_topk)
    moe = layer(cfg)
    hf = Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(
            hidden_size=32,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=norm_topk,
        )
    )
    with torch.no_grad():
        hf.gate.weight.copy_(moe.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
        hf.experts.down_proj.copy_(moe.experts.w2)
    x = torch.randn(3, 8, 32)
    torch.testing.assert_close(moe(x), hf(x), rtol=0, atol=1e-5)


def test_dispatch_equals_a_per_token_loop_with_shared_experts_and_gate():
    moe = layer(moe_cfg(shared_experts=2, shared_expert_gate=True, top_k=3))
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(moe(x), naive(moe, x), rtol=0, atol=1e-5)


def test_grouped_matmul_equals_the_expert_loop_forward_and_backward():
    moe = layer(moe_cfg())
    x = torch.randn(40, 32)
    counts = torch.tensor([10, 0, 25, 5])
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    grouped, looped = moe.experts(a, counts), moe.experts.loop(b, counts)
    torch.testing.assert_close(grouped, looped, rtol=0, atol=1e-5)
    grouped.square().sum().backward()
    grad_grouped = [p.grad.clone() for p in moe.experts.parameters()]
    moe.experts.zero_grad()
    looped.square().sum().backward()
    for g, p in zip(grad_grouped, moe.experts.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-4)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)


def test_load_balancing_loss_equals_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    moe = layer(moe_cfg(top_k=2))
    routing = moe.router(torch.randn(64, 32))
    ours = load_balancing_loss(routing, 4)
    theirs = load_balancing_loss_func((routing.logits,), num_experts=4, top_k=2)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert 2.0 <= float(ours) < 8.0  # k when balanced, E·k at worst


def test_auxiliary_losses_train_the_router_as_if_added_to_the_loss():
    coefs = dict(aux_loss_coef=0.3, seq_aux_loss_coef=0.2, z_loss_coef=0.05)
    with_aux, plain = layer(moe_cfg(**coefs)), layer(moe_cfg())
    plain.load_state_dict(with_aux.state_dict())
    x, r = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    with_aux.aux_grad_scale = 1.0
    (with_aux(x) * r).sum().backward()
    routing = plain.router(x.reshape(-1, 32))
    explicit = (
        0.3 * load_balancing_loss(routing, 4)
        + 0.2 * sequence_balance_loss(routing, 4, 2)
        + 0.05 * routing.logits.logsumexp(-1).square().mean()
    )
    ((plain(x) * r).sum() + explicit).backward()
    torch.testing.assert_close(
        with_aux.router.weight.grad, plain.router.weight.grad, rtol=1e-5, atol=1e-6
    )
    stats = with_aux.stats.as_tensor()[4:].tolist()  # calls, tokens, dropped, aux, seq_aux, z
    assert stats[:3] == [1, 16, 0]
    assert stats[3] == pytest.approx(float(load_balancing_loss(routing, 4)), rel=1e-6)
    assert stats[5] == pytest.approx(float(routing.logits.logsumexp(-1).square().mean()), rel=1e-6)


def test_sequence_balance_loss_follows_deepseek_v3():
    """Eqs. 17-20 of the DeepSeek-V3 report, loop by loop: per sequence f_i = N/(K·T) Σ_t 1(i in topk_t),
    P_i = 1/T Σ_t s'_{i,t} (scores normalised over experts), L = Σ_i f_i P_i; averaged over sequences."""
    moe = layer(moe_cfg(router="sigmoid"))
    S, T, N, K = 3, 8, 4, 2
    routing = moe.router(torch.randn(S * T, 32))
    total = 0.0
    for s in range(S):
        rows = range(s * T, (s + 1) * T)
        loss = 0.0
        for i in range(N):
            f = N / (K * T) * sum(int(i in routing.experts[t].tolist()) for t in rows)
            p = sum(float(routing.scores[t, i] / routing.scores[t].sum()) for t in rows) / T
            loss += f * p
        total += loss / S
    assert float(sequence_balance_loss(routing, N, S)) == pytest.approx(total, rel=1e-6)


def test_capacity_keeps_the_highest_weighted_assignments_per_expert():
    moe = layer(moe_cfg(capacity_factor=0.5))
    x = torch.randn(1, 24, 32)
    routing = moe.router(x.reshape(-1, 32))
    capacity = math.ceil(0.5 * 24 * 2 / 4)
    assert routing.kept is not None and not routing.kept.all()
    for e in range(4):
        mine = routing.experts == e
        kept_w = routing.weights[mine & routing.kept]
        dropped_w = routing.weights[mine & ~routing.kept]
        assert len(kept_w) == min(capacity, int(mine.sum()))
        if len(dropped_w):
            assert float(dropped_w.max()) <= float(kept_w.min())
    torch.testing.assert_close(moe(x), naive(moe, x), rtol=0, atol=1e-5)
    assert float(moe.stats.as_tensor()[6]) == float((~routing.kept).sum())


def test_sigmoid_router_bias_changes_the_choice_not_the_weights_and_moves_toward_balance():
    moe = layer(moe_cfg(router="sigmoid", bias_update_rate=0.01))
    x = torch.randn(32, 32)
    before = moe.router(x)
    assert moe.router.expert_bias is not None
    moe.router.expert_bias.copy_(torch.tensor([5.0, 5.0, 0.0, 0.0]))  # experts 0 and 1 always win
    biased = moe.router(x)
    assert set(biased.experts.flatten().tolist()) == {0, 1}
    torch.testing.assert_close(
        biased.weights,
        before.scores.gather(1, biased.experts)
        / before.scores.gather(1, biased.experts).sum(-1, keepdim=True),
    )
    load = torch.tensor([40.0, 24.0, 0.0, 0.0])
    update_expert_bias(moe, load, 0.01)
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([4.99, 4.99, 0.01, 0.01]))
    assert "router.expert_bias" in moe.state_dict()


def test_group_limited_router_equals_transformers_deepseek_v3():
    """Sigmoid scores, a selection bias, 4 groups of 4 experts of which 2 may be used, top 3,
    renormalised and scaled: the experts and gate weights of transformers' DeepSeek-V3 router."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    moe = layer(
        moe_cfg(
            num_experts=16,
            top_k=3,
            router="sigmoid",
            bias_update_rate=0.01,
            route_groups=4,
            route_group_limit=2,
            routed_scale=2.5,
        )
    )
    hf_cfg = DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    ref = DeepseekV3TopkRouter(hf_cfg)
    assert moe.router.expert_bias is not None
    with torch.no_grad():
        ref.weight.copy_(moe.router.weight)
        moe.router.expert_bias.normal_(0, 0.2)
        ref.e_score_correction_bias.copy_(moe.router.expert_bias)
    x = torch.randn(64, 32)
    ours = moe.router(x)
    _, weights, experts = ref(x)
    mine_sorted, order = ours.experts.sort(dim=1)
    theirs_sorted, ref_order = experts.sort(dim=1)
    assert torch.equal(mine_sorted, theirs_sorted)
    torch.testing.assert_close(ours.weights.gather(1, order), weights.gather(1, ref_order))
    assert all(len(set((row // 4).tolist())) <= 2 for row in ours.experts)
    assert len((ours.experts // 4).unique()) > 2  # different tokens chose different groups


def test_model_counts_and_names():
    cfg = ModelConfig(
        n_layers=3,
        d_model=32,
        n_heads=4,
        seq_len=8,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_ffn=16,
            first_dense_layers=1,
            shared_experts=1,
            shared_expert_gate=True,
        ),
    )
    model = build_model(cfg, 64, seed=0)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg, 64)
    names = dict(model.named_parameters())
    assert "layers.0.mlp.w1.weight" in names and "layers.1.mlp.experts.w1" in names
    assert names["layers.2.mlp.experts.w2"].shape == (4, 32, 16)
    per_moe_layer = 4 * 32 + 4 * 3 * 32 * 16 + 3 * 32 * 16 + 32  # router, experts, shared, gate
    active_moe_layer = 4 * 32 + 2 * 3 * 32 * 16 + 3 * 32 * 16 + 32
    assert count_params(cfg, 64) - count_params(cfg, 64, active=True) == 2 * (
        per_moe_layer - active_moe_layer
    )
    dense = ModelConfig(n_layers=3, d_model=32, n_heads=4, seq_len=8)
    extra = 2 * (active_moe_layer - 3 * 32 * dense.ffn_size)
    assert flops_per_token(cfg, 64) - flops_per_token(dense, 64) == pytest.approx(6 * extra)


def test_moe_config_problems_are_named():
    with pytest.raises(ConfigError) as info:
        from_dict(
            {
                "model": {
                    "n_layers": 2,
                    "moe": {"num_experts": 3, "top_k": 4, "first_dense_layers": 2},
                },
                "parallel": {"ep": 2, "tp": 2},
            },
            world_size=4,
        )
    text = str(info.value)
    for part in (
        "top_k=4 exceeds",
        "first_dense_layers=2 leaves no MoE layer",
        "sequence_parallel=true",
        "ep=2 must divide model.moe.num_experts=3",
    ):
        assert part in text
    with pytest.raises(ConfigError) as info:
        from_dict(
            {
                "model": {
                    "moe": {"num_experts": 8, "top_k": 3, "route_groups": 4, "route_group_limit": 1}
                }
            }
        )
    assert "top_k=3 exceeds the 2 experts of route_group_limit=1 groups of 2" in str(info.value)
    with pytest.raises(ConfigError, match="route_groups=3 must divide model.moe.num_experts=8"):
        from_dict({"model": {"moe": {"num_experts": 8, "route_groups": 3}}})
    with pytest.raises(ConfigError, match="needs an MoE model"):
        from_dict({"parallel": {"ep": 2}}, world_size=2)
    with pytest.raises(ConfigError, match="must divide a pipeline stage's tp·dp"):
        from_dict({"model": {"moe": {"num_experts": 6}}, "parallel": {"ep": 3}}, world_size=4)


def test_export_refuses_what_qwen3_moe_and_mixtral_cannot_hold():
    from strata.hf import hf_config

    cfg = moe_cfg(router="sigmoid", shared_experts=1, route_groups=2, route_group_limit=1)
    with pytest.raises(ConfigError) as info:
        hf_config(cfg, 64)
    text = str(info.value)
    for part in (
        "shared_experts=1",
        "router=sigmoid",
        "route_groups=2: both route over every expert",
    ):
        assert part in text
    assert hf_config(moe_cfg(), 64)["model_type"] == "mixtral"
