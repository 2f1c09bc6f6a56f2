"""The Llama-style GPT against independent references: naive attention with complex-number RoPE
(Meta's formulation, on Hugging Face's rotate-half pairs), hand-written RMSNorm/SwiGLU, q/k biases
and per-head q/k norms, hand FLOP and parameter counts."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from strata.config import ModelConfig, padded_vocab_size
from strata.errors import StrataError
from strata.model import (
    GPT,
    Attention,
    RMSNorm,
    SwiGLU,
    build_model,
    count_params,
    ffn_hidden_size,
    flops_per_token,
    lm_loss,
)
from strata.rope import rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**kw) -> ModelConfig:
    base = dict(n_layers=2, d_model=32, n_heads=4, seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def randomize_norms(model: nn.Module, seed: int = 0) -> None:
    """Norm weights start at one; make them random so a reference that ignores them would fail."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen))


# --- independent references (float64) ---------------------------------------------------------


def ref_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w.double()


def ref_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    x = x.double()
    gate = x @ w1.double().T
    silu = gate * (1.0 / (1.0 + torch.exp(-gate)))
    return (silu * (x @ w3.double().T)) @ w2.double().T


def ref_freqs_cis(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """Meta Llama's precompute_freqs_cis, in float64 (no frequency scaling)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].double() / head_dim))
    t = torch.arange(seq_len, dtype=torch.float64)
    angles = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex128 (seq, head_dim/2)


def ref_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim). Pairs (i, i + head_dim/2) viewed as complex numbers and
    rotated: Hugging Face's rotate-half layout (Meta's code pairs (2i, 2i+1) instead)."""
    half = x.shape[-1] // 2
    xc = torch.complex(x[..., :half].double(), x[..., half:].double())
    rotated = xc * freqs_cis[: x.shape[1]][None, :, None, :]
    return torch.cat((rotated.real, rotated.imag), dim=-1)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return x @ w.double().T + (0 if b is None else b.double())


def ref_attention(
    x: torch.Tensor,
    wq,
    wk,
    wv,
    wo,
    n_heads: int,
    n_kv_heads: int,
    theta: float,
    biases=(None, None, None),
    norms=None,
) -> torch.Tensor:
    """Naive causal multi-head attention with GQA by repeating each kv head (Llama's repeat_kv);
    optional q/k/v biases (Qwen2) and q/k RMSNorms over each head before RoPE (Qwen3)."""
    b, s, d = x.shape
    hd = wq.shape[0] // n_heads
    x = x.double()
    q = linear(x, wq, biases[0]).view(b, s, n_heads, hd)
    k = linear(x, wk, biases[1]).view(b, s, n_kv_heads, hd)
    v = linear(x, wv, biases[2]).view(b, s, n_kv_heads, hd)
    if norms is not None:
        (q_w, k_w), eps = norms
        q, k = ref_rmsnorm(q, q_w, eps), ref_rmsnorm(k, k_w, eps)
    fc = ref_freqs_cis(hd, s, theta)
    q, k = ref_rope(q, fc), ref_rope(k, fc)
    rep = n_heads // n_kv_heads
    k = k[:, :, :, None, :].expand(b, s, n_kv_heads, rep, hd).reshape(b, s, n_heads, hd)
    v = v[:, :, :, None, :].expand(b, s, n_kv_heads, rep, hd).reshape(b, s, n_heads, hd)
    out = torch.empty(b, s, n_heads, hd, dtype=torch.float64)
    for bi in range(b):
        for h in range(n_heads):
            scores = q[bi, :, h] @ k[bi, :, h].T / math.sqrt(hd)  # (s, s)
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
            scores = scores.masked_fill(mask, float("-inf"))
            probs = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            out[bi, :, h] = probs @ v[bi, :, h]
    return out.reshape(b, s, n_heads * hd) @ wo.double().T


def attention_extras(attn: Attention, eps: float) -> dict:
    """ref_attention's bias and q/k-norm arguments for this attention module."""
    norms = None if attn.q_norm is None else ((attn.q_norm.weight, attn.k_norm.weight), eps)
    return {"biases": (attn.wq.bias, attn.wk.bias, attn.wv.bias), "norms": norms}


def ref_gpt(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    cfg = model.cfg
    kv = cfg.n_kv_heads or cfg.n_heads
    x = model.tok_embeddings.weight.double()[tokens]
    for layer in model.layers:
        a = layer.attn
        h = ref_rmsnorm(x, layer.attn_norm.weight, cfg.norm_eps)
        x = x + ref_attention(
            h,
            a.wq.weight,
            a.wk.weight,
            a.wv.weight,
            a.wo.weight,
            cfg.n_heads,
            kv,
            cfg.rope_theta,
            **attention_extras(a, cfg.norm_eps),
        )
        m = layer.mlp
        x = x + ref_swiglu(
            ref_rmsnorm(x, layer.mlp_norm.weight, cfg.norm_eps),
            m.w1.weight,
            m.w3.weight,
            m.w2.weight,
        )
    return ref_rmsnorm(x, model.norm.weight, cfg.norm_eps) @ model.output.weight.double().T


# --- shapes and vocabulary --------------------------------------------------------------------


@pytest.mark.parametrize(
    "data_vocab, multiple, expected",
    [
        (257, 64, 320),
        (256, 64, 256),
        (1, 64, 64),
        (64, 64, 64),
        (65, 64, 128),
        (257, 1, 257),
        (257, 128, 384),
        (50257, 64, 50304),
    ],
)
def test_padded_vocab_size(data_vocab, multiple, expected):
    assert padded_vocab_size(ModelConfig(pad_vocab_multiple=multiple), data_vocab) == expected


def test_explicit_vocab_size_is_used():
    assert padded_vocab_size(ModelConfig(vocab_size=300), 257) == 300
    assert build_model(tiny(vocab_size=300), 257, 0).output.out_features == 300


def test_configured_vocab_smaller_than_data_is_rejected():
    """padded_vocab_size's doc says a configured model.vocab_size 'must cover the data', but a
    vocabulary smaller than the data's is accepted; the model then fails with an index error on
    the first token id >= vocab_size instead of a clear user error."""
    with pytest.raises(StrataError):
        build_model(tiny(vocab_size=100), 257, 0)


@pytest.mark.parametrize("kv", [None, 4, 2, 1])
def test_output_shape_with_padded_vocab_and_gqa(kv):
    cfg = tiny(n_kv_heads=kv)
    model = build_model(cfg, 257, seed=0)
    assert model.vocab_size == 320
    hd = cfg.head_size
    kv_heads = kv or cfg.n_heads
    for blk in model.layers:
        assert blk.attn.wq.weight.shape == (cfg.n_heads * hd, cfg.d_model)
        assert blk.attn.wk.weight.shape == blk.attn.wv.weight.shape == (kv_heads * hd, cfg.d_model)
    tokens = torch.randint(0, 257, (3, 11), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (3, 11, 320) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    full = model(torch.randint(0, 257, (2, cfg.seq_len)))
    assert full.shape == (2, cfg.seq_len, 320)


def test_tied_embeddings_share_one_tensor():
    model = build_model(tiny(tie_embeddings=True), 100, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    untied = build_model(tiny(), 100, seed=0)
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()


# --- causality and init -----------------------------------------------------------------------


@pytest.mark.parametrize("kv", [None, 2])
def test_future_tokens_do_not_change_earlier_logits(kv):
    model = build_model(tiny(n_kv_heads=kv, init_std=0.2), 64, seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    with torch.no_grad():
        base = model(tokens)
        for t in (1, 7, 15):
            changed = tokens.clone()
            changed[:, t:] = (
                changed[:, t:] + 1 + torch.randint(0, 62, changed[:, t:].shape, generator=gen)
            ) % 64
            assert (changed[:, t:] != tokens[:, t:]).all()
            out = model(changed)
            torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-5, rtol=1e-5)
            assert (
                out[:, t] - base[:, t]
            ).abs().max() > 1e-3  # the changed position itself does change


def test_same_seed_same_init_different_seed_different():
    a = build_model(tiny(), 257, seed=11)
    torch.manual_seed(999)  # the global RNG must not matter
    b = build_model(tiny(), 257, seed=11)
    c = build_model(tiny(), 257, seed=12)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
        if sa[k].ndim >= 2:
            assert not torch.equal(sa[k], sc[k]), k
    tokens = torch.randint(0, 257, (2, 8))
    assert torch.equal(a(tokens), b(tokens))


def test_init_statistics():
    cfg = ModelConfig(
        n_layers=4, d_model=128, n_heads=4, seq_len=16, init_std=0.05, qkv_bias=True, qk_norm=True
    )
    model = build_model(cfg, 257, seed=0)
    out_std = 0.05 / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            expected = out_std if name.endswith(("attn.wo.weight", "mlp.w2.weight")) else 0.05
            assert p.std().item() == pytest.approx(expected, rel=0.06), name
            assert abs(p.mean().item()) < 0.1 * expected, name


# --- components against hand-written formulas -------------------------------------------------


def test_rmsnorm_matches_formula():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, eps=1e-3)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=gen))
    x = 3 * torch.randn(2, 5, 24, generator=gen)
    torch.testing.assert_close(
        norm(x).double(), ref_rmsnorm(x, norm.weight, 1e-3), atol=1e-5, rtol=1e-5
    )
    # eps matters for small inputs
    small = 1e-2 * torch.randn(3, 24, generator=gen)
    torch.testing.assert_close(
        norm(small).double(), ref_rmsnorm(small, norm.weight, 1e-3), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("ffn", [None, 40])
def test_swiglu_matches_formula(ffn):
    cfg = tiny(ffn_hidden=ffn, d_model=48)
    mlp = SwiGLU(cfg)
    hidden = ffn or 32 * math.ceil(int(2 * 4 * 48 / 3) / 32)
    assert mlp.w1.out_features == mlp.w3.out_features == mlp.w2.in_features == hidden
    x = torch.randn(2, 7, 48, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        mlp(x).double(),
        ref_swiglu(x, mlp.w1.weight, mlp.w3.weight, mlp.w2.weight),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    "d_model, expected", [(128, 352), (96, 256), (100, 288), (32, 96), (4096, 10944)]
)
def test_ffn_hidden_follows_llama_rule(d_model, expected):
    # Llama: hidden = int(2 * 4d / 3), rounded up to multiple_of (32 here). Hand-computed values.
    assert ffn_hidden_size(ModelConfig(d_model=d_model, n_heads=4)) == expected
    assert ffn_hidden_size(ModelConfig(d_model=d_model, n_heads=4, ffn_hidden=77)) == 77


@pytest.mark.parametrize(
    "n_heads, kv, theta, extra",
    [
        (4, None, 10000.0, {}),
        (4, 2, 500.0, {}),
        (8, 1, 10000.0, {}),
        (4, 2, 10000.0, {"head_dim": 24, "qkv_bias": True}),  # n_heads·head_dim = 96 != d_model
        (4, 2, 10000.0, {"head_dim": 8, "qk_norm": True, "norm_eps": 1e-3}),
    ],
)
def test_attention_matches_naive_reference(n_heads, kv, theta, extra):
    cfg = tiny(
        d_model=64,
        n_heads=n_heads,
        n_kv_heads=kv,
        rope_theta=theta,
        seq_len=24,
        init_std=0.25,
        **extra,
    )
    model = build_model(cfg, 64, seed=5)
    randomize_norms(model)
    attn: Attention = model.layers[0].attn
    with torch.no_grad():  # biases start at zero
        for b in (attn.wq.bias, attn.wk.bias, attn.wv.bias):
            if b is not None:
                b.normal_(0, 0.5)
    x = torch.randn(
        2, 13, 64, generator=torch.Generator().manual_seed(1)
    )  # shorter than the rope tables
    cos, sin = rope_tables(cfg)
    out = attn(x, cos, sin)
    ref = ref_attention(
        x,
        attn.wq.weight,
        attn.wk.weight,
        attn.wv.weight,
        attn.wo.weight,
        n_heads,
        kv or n_heads,
        theta,
        **attention_extras(attn, cfg.norm_eps),
    )
    assert ref.abs().max() > 0.1  # a meaningful comparison, not two near-zero tensors
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_rope_is_position_dependent_and_norm_preserving():
    """Sanity of the reference itself: rotation keeps each pair's norm, and depends on position."""
    x = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    fc = ref_freqs_cis(8, 6, 10000.0)
    r = ref_rope(x, fc)
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(r[:, 0], x[:, 0])  # position 0: angle 0
    assert not torch.allclose(r[:, 1:], x[:, 1:])


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(n_kv_heads=2, tie_embeddings=True, ffn_hidden=40),
        dict(n_kv_heads=2, head_dim=12, qkv_bias=True, qk_norm=True),
    ],
)
def test_whole_model_matches_reference(kw):
    cfg = tiny(init_std=0.2, norm_eps=1e-4, **kw)
    model = build_model(cfg, 100, seed=2)
    randomize_norms(model)
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens).double(), ref_gpt(model, tokens), atol=1e-4, rtol=1e-4
        )


def test_lm_loss_is_mean_next_token_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen)
    targets = torch.randint(0, 7, (2, 5), generator=gen)
    logp = logits.double() - torch.logsumexp(logits.double(), dim=-1, keepdim=True)
    manual = -logp.gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(lm_loss(logits, targets).double(), manual, atol=1e-6, rtol=1e-6)
    assert lm_loss(logits.bfloat16(), targets).dtype == torch.float32


# --- it learns --------------------------------------------------------------------------------


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    cfg = tiny(seq_len=16)
    model = build_model(cfg, 64, seed=0)
    rows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(7))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(150):
        loss = lm_loss(model(inputs), targets)
        if first is None:
            first = loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = lm_loss(model(inputs), targets).item()
    assert first == pytest.approx(math.log(64), rel=0.1)  # small init: near-uniform predictions
    assert final < 0.5 and final < 0.15 * first, (first, final)


# --- parameter and FLOP counts ----------------------------------------------------------------

COUNT_CASES = [
    dict(),
    dict(tie_embeddings=True),
    dict(n_kv_heads=2),
    dict(n_kv_heads=1, ffn_hidden=40, tie_embeddings=True, n_layers=3),
    dict(d_model=48, n_heads=6, seq_len=32),
    dict(n_kv_heads=2, head_dim=12, qkv_bias=True),
    dict(head_dim=6, qk_norm=True, tie_embeddings=True),
]


@pytest.mark.parametrize("kw", COUNT_CASES)
@pytest.mark.parametrize("data_vocab", [257, 100])
def test_count_params_matches_built_model(kw, data_vocab):
    cfg = tiny(**kw)
    model = build_model(cfg, data_vocab, seed=0)
    actual = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    assert count_params(cfg, model.vocab_size) == actual
    if cfg.tie_embeddings:
        untied = build_model(tiny(**{**kw, "tie_embeddings": False}), data_vocab, seed=0)
        assert (
            sum(p.numel() for p in untied.parameters()) - actual == model.vocab_size * cfg.d_model
        )


def forward_matmul_flops_per_token(model: GPT, batch: int = 2) -> float:
    """Count forward matmul FLOPs by instrumenting every nn.Linear (2·in·out per row), plus
    attention scores and weighted sum as full s×s products: 2·2·s·(heads·head size) per token per
    layer."""
    cfg = model.cfg
    total = 0

    def hook(mod, inputs, _out):
        nonlocal total
        x = inputs[0]
        rows = x.numel() // x.shape[-1]
        total += 2 * mod.in_features * mod.out_features * rows

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            model(torch.zeros(batch, cfg.seq_len, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    tokens = batch * cfg.seq_len
    attention = cfg.n_layers * 2 * 2 * cfg.seq_len * cfg.n_heads * model.layers[0].attn.head_dim
    return total / tokens + attention


@pytest.mark.parametrize("kw", COUNT_CASES)
def test_flops_per_token_matches_instrumented_count(kw):
    cfg = tiny(**kw)
    model = build_model(cfg, 257, seed=0)
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert n_linear == cfg.n_layers * 7 + 1
    assert flops_per_token(cfg, model.vocab_size) == pytest.approx(
        3 * forward_matmul_flops_per_token(model), rel=1e-12
    )
