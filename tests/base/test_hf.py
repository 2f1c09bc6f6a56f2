"""Hugging Face models through `strata.hf`, with transformers as the independent reference: tiny
random Llama (GQA, tied and untied; Llama 3.1, linear, dynamic NTK and YaRN RoPE scalings at twice the
original context), Mistral, Qwen2 and Qwen3 models are
saved with save_pretrained, loaded into Strata's GPT by the derived model settings and the mapped
tensor names, and must give transformers' logits; Strata models exported by `hf_config` and
`to_hf` must load into transformers and give Strata's. Plus what `unsupported` and `conflicts` say.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata import hf
from strata.config import ModelConfig
from strata.errors import ConfigError
from strata.model import GPT, build_model
from strata.rope import rope_frequencies

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 16
VOCAB = 96
TOL = 1e-5
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # Small, so that with head_dim 8 (wavelengths 6.3, 63, 628, 6283) every branch of the scaling
    # is taken: kept (< 64/4), interpolated (between), divided by factor (> 64/1).
    original_max_position_embeddings=64,
)

# name: (config class, settings beyond SHAPE)
FAMILIES = {
    "llama-gqa-head_dim": (
        "LlamaConfig",
        dict(num_key_value_heads=2, head_dim=16, rope_parameters=None),
    ),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "llama3-rope": ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
    "mistral-window-covers-seq": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=SEQ)),
    "qwen2": (
        "Qwen2Config",
        dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    "qwen3-head_dim": (
        "Qwen3Config",
        dict(num_key_value_heads=2, head_dim=12, tie_word_embeddings=True),
    ),
    # Each long-context scaling at a sequence (SEQ = 16) twice its original context (8).
    "llama-linear-rope": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
    ),
    "llama-dynamic-rope": (
        "LlamaConfig",
        dict(
            max_position_embeddings=8,
            rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0),
        ),
    ),
    "qwen2-yarn-rope": (
        "Qwen2Config",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=32,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=8
            ),
        ),
    ),
}


def hf_model(name: str):
    cls, extra = FAMILIES[name]
    kw = {
        **SHAPE,
        "max_position_embeddings": 128,
        **{k: v for k, v in extra.items() if v is not None},
    }
    config = getattr(transformers, cls)(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with (
        torch.no_grad()
    ):  # norms start at one and biases at zero: randomise them so their mapping is checked
        for p in model.parameters():
            p.copy_(
                torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.15) + (1.0 if p.ndim == 1 else 0.0)
            )
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def strata_from_hf_dir(path: Path) -> GPT:
    """What an importer does: config.json -> model settings; safetensors -> names -> state_dict."""
    settings = hf.model_settings(json.loads((path / "config.json").read_text()), SEQ)
    cfg = ModelConfig(**settings, seq_len=SEQ)  # type: ignore[arg-type]
    tensors = load_file(path / "model.safetensors")
    assert hf.unused(tensors, cfg) == [] and hf.missing(tensors, cfg) == []
    model = GPT(cfg, cfg.vocab_size or 0)
    model.load_state_dict(
        {name: tensors[src] for name, src in hf.hf_sources(cfg).items()}, strict=True
    )
    return model.eval()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_checkpoint_loads_into_strata_with_equal_logits(tmp_path, name):
    reference = hf_model(name)
    reference.save_pretrained(tmp_path)
    model = strata_from_hf_dir(tmp_path)
    if reference.config.tie_word_embeddings:
        assert "lm_head.weight" not in load_file(
            tmp_path / "model.safetensors"
        )  # the case hf_sources covers
        assert model.output.weight is model.tok_embeddings.weight
    x = tokens()
    with torch.no_grad():
        expected, actual = reference(x).logits, model(x)
    assert expected.abs().max() > 1.0  # a meaningful comparison
    assert (actual - expected).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(n_kv_heads=2, tie_embeddings=True, rope_theta=5e5),
        dict(
            n_kv_heads=2,
            head_dim=16,
            rope_scaling="llama3",
            rope_original_max_position_embeddings=64,
        ),
        dict(qkv_bias=True, n_kv_heads=1, norm_eps=1e-6),
        dict(qk_norm=True, head_dim=12, n_kv_heads=2, tie_embeddings=True),
        dict(rope_scaling="linear", rope_factor=2.0),
        dict(rope_scaling="dynamic", rope_factor=2.0, rope_original_max_position_embeddings=8),
        dict(
            rope_scaling="yarn",
            rope_factor=4.0,
            rope_original_max_position_embeddings=8,
            head_dim=16,
        ),
        dict(
            qkv_bias=True,
            rope_scaling="yarn",
            rope_factor=3.0,
            rope_original_max_position_embeddings=8,
            rope_mscale=1.0,
            rope_mscale_all_dim=0.5,
            rope_beta_fast=16.0,
            rope_truncate=False,
        ),
    ],
)
def test_strata_model_exports_to_transformers_with_equal_logits(tmp_path, kw):
    cfg = ModelConfig(
        n_layers=2, d_model=32, n_heads=4, ffn_hidden=48, seq_len=SEQ, vocab_size=VOCAB, **kw
    )
    model = build_model(cfg, VOCAB, seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.15)
                + (1.0 if name.endswith("norm.weight") else 0)
            )
    state = model.state_dict()
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(cfg)))
    save_file(
        {dst: state[src].contiguous() for src, dst in hf.hf_targets(cfg).items()},
        tmp_path / "model.safetensors",
    )
    reference, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(reference).__name__ == hf.hf_config(cfg)["architectures"][0]
    x = tokens()
    with torch.no_grad():
        expected, actual = reference.eval()(x).logits, model(x)
    assert expected.abs().max() > 1.0
    assert (actual - expected).abs().max().item() <= TOL
    # and the exported config.json derives the same model back
    back = hf.model_settings(json.loads((tmp_path / "config.json").read_text()), SEQ)
    resolved = {"n_kv_heads": cfg.kv_heads, "head_dim": cfg.head_size, "ffn_hidden": cfg.ffn_size}
    assert back == {k: resolved.get(k, getattr(cfg, k)) for k in back}


def test_dynamic_rope_logits_equal_transformers_at_every_length(tmp_path):
    # transformers recomputes dynamic NTK frequencies from each input's length (above its original
    # context of 8); lengths in increasing order, as its cached frequencies only grow above it
    reference = hf_model("llama-dynamic-rope")
    reference.save_pretrained(tmp_path)
    model = strata_from_hf_dir(tmp_path)
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    for length in (5, 8, 12, SEQ, 40):
        with torch.no_grad():
            expected, actual = reference(x[:, :length]).logits, model(x[:, :length])
        assert (actual - expected).abs().max().item() <= TOL, length


def test_dynamic_rope_greedy_generation_equals_transformers(tmp_path):
    from strata.inference.generate import generate

    reference = hf_model("llama-dynamic-rope")
    reference.save_pretrained(tmp_path)
    model = strata_from_hf_dir(tmp_path)
    prompts = [[5, 17, 3, 60, 21], [9, 33, 70]]  # shorter than the original context, then past it
    for prompt in prompts:
        [mine] = generate(model, [prompt], 30).tokens
        ids = torch.tensor([prompt])
        with torch.no_grad():
            fresh = hf_model("llama-dynamic-rope")
            want = fresh.generate(
                ids, max_new_tokens=30, do_sample=False, attention_mask=torch.ones_like(ids)
            )
        assert mine == want[0, len(prompt) :].tolist()
    # a batch, left-padded: every row's frequencies are the longest row's, as in transformers
    got = generate(model, prompts, 30).tokens
    batch = torch.tensor([prompts[0], [0, 0, *prompts[1]]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    with torch.no_grad():
        want = hf_model("llama-dynamic-rope").generate(
            batch, max_new_tokens=30, do_sample=False, attention_mask=mask, pad_token_id=0
        )
    assert got == want[:, 5:].tolist()


def test_llama3_rope_frequencies_equal_transformers():
    config = transformers.LlamaConfig(**SHAPE, rope_parameters=dict(LLAMA3_ROPE))
    expected, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config)
    cfg = ModelConfig(**hf.model_settings(config.to_dict(), SEQ), seq_len=SEQ)  # type: ignore[arg-type]
    ours = rope_frequencies(cfg)
    torch.testing.assert_close(ours.float(), expected, rtol=1e-6, atol=0)
    plain = rope_frequencies(ModelConfig(d_model=32, n_heads=4))
    assert (ours < plain).any() and (
        ours == plain.float().double()
    ).sum() >= 1  # scaled and kept bands both occur


# --- config.json -> model settings ---------------------------------------------------------------


def test_old_and_new_rope_styles_give_the_same_settings():
    new = transformers.LlamaConfig(
        **SHAPE, rope_parameters={**LLAMA3_ROPE, "rope_theta": 5e5}
    ).to_dict()
    assert "rope_parameters" in new
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(
        rope_theta=5e5, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    )
    assert hf.model_settings(old, SEQ) == hf.model_settings(new, SEQ)
    settings = hf.model_settings(new, SEQ)
    assert (
        settings["rope_theta"] == 5e5
        and settings["rope_scaling"] == "llama3"
        and settings["rope_factor"] == 8.0
    )
    assert settings["rope_original_max_position_embeddings"] == 64
    old["rope_scaling"] = {
        "type": "llama3",
        **{k: v for k, v in old["rope_scaling"].items() if k != "rope_type"},
    }
    assert hf.model_settings(old, SEQ) == settings  # the oldest form names the type `type`


def llama(**kw) -> dict:
    return {**transformers.LlamaConfig(**SHAPE).to_dict(), **kw}


@pytest.mark.parametrize(
    "config, field",
    [
        (llama(num_local_experts=8, num_experts_per_tok=2), "num_local_experts"),
        ({**transformers.Qwen2Config(**SHAPE).to_dict(), "num_experts": 4}, "num_experts"),
        (transformers.MistralConfig(**SHAPE, sliding_window=8).to_dict(), "sliding_window"),
        (
            transformers.Qwen2Config(
                **SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=1
            ).to_dict(),
            "sliding_window",
        ),
        (llama(attention_bias=True), "attention_bias"),
        (llama(mlp_bias=True), "mlp_bias"),
        (llama(hidden_act="gelu"), "hidden_act"),
        (
            llama(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
            "rope_parameters.rope_type",
        ),
        (
            {**llama(rope_scaling={"type": "su", "factor": 2.0}), "rope_parameters": None},
            "rope_scaling.type",
        ),
        (llama(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (llama(quantization_config={"quant_method": "gptq"}), "quantization_config"),
        ({k: v for k, v in llama().items() if k != "intermediate_size"}, "intermediate_size"),
    ],
)
def test_unsupported_features_are_named(config, field):
    problems = hf.unsupported(config, SEQ)
    assert len(problems) == 1 and field in problems[0], problems
    with pytest.raises(ConfigError, match=field.split(".")[0]):
        hf.model_settings(config, SEQ)


def test_unknown_family_names_model_type_and_the_supported_ones():
    (problem,) = hf.unsupported({**llama(), "model_type": "gemma"}, SEQ)
    assert "model_type='gemma'" in problem and all(
        t in problem for t in ("llama", "mistral", "qwen2", "qwen3")
    )


def test_sliding_window_that_never_slides_is_accepted():
    """Full causal attention is what the window gives when it covers the sequence, or when the
    family's flags leave it off (transformers' rules for Qwen2/3)."""
    mistral = transformers.MistralConfig(**SHAPE, sliding_window=SEQ).to_dict()
    assert hf.unsupported(mistral, SEQ) == [] and hf.unsupported(mistral, SEQ + 1) != []
    qwen = dict(**SHAPE, sliding_window=8)
    assert (
        hf.unsupported(transformers.Qwen2Config(**qwen, use_sliding_window=False).to_dict(), SEQ)
        == []
    )
    no_layer = transformers.Qwen3Config(
        **qwen, use_sliding_window=True, max_window_layers=2
    ).to_dict()
    assert no_layer["layer_types"] == ["full_attention"] * 2 and hf.unsupported(no_layer, SEQ) == []


def test_conflicts_name_each_explicit_key_that_disagrees():
    derived = hf.model_settings(
        transformers.Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=8).to_dict(), SEQ
    )
    explicit = {
        "d_model": 64,
        "n_layers": 2,
        "n_kv_heads": None,
        "qk_norm": False,
        "seq_len": 128,
        "init_std": 0.1,
    }
    problems = hf.conflicts(explicit, derived)
    assert len(problems) == 2, problems
    assert "model.d_model=64" in problems[0] and "hidden_size gives 32" in problems[0]
    assert "model.qk_norm=false" in problems[1] and "true" in problems[1]
    assert (
        hf.conflicts({k: derived[k] for k in ("d_model", "rope_theta", "tie_embeddings")}, derived)
        == []
    )


# --- tensor names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(tie_embeddings=True),
        dict(qkv_bias=True, qk_norm=True, head_dim=12, n_kv_heads=2),
    ],
)
def test_names_cover_the_state_dict_and_round_trip(kw):
    cfg = ModelConfig(n_layers=3, d_model=32, n_heads=4, seq_len=SEQ, **kw)
    names = list(GPT(cfg, VOCAB).state_dict())
    assert hf.strata_names(cfg) == names
    for name in names:
        assert hf.to_strata(hf.to_hf(name)) == name
    assert len({hf.to_hf(n) for n in names}) == len(names)
    assert ("output.weight" in hf.hf_targets(cfg)) != cfg.tie_embeddings
    assert hf.to_hf("layers.2.attn.wq.bias") == "model.layers.2.self_attn.q_proj.bias"
    assert hf.to_hf("layers.0.mlp.w1.weight") == "model.layers.0.mlp.gate_proj.weight"


def test_tensors_strata_cannot_hold_are_reported():
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=4, seq_len=SEQ)
    present = list(hf.hf_targets(cfg).values())
    extra = ["model.layers.0.self_attn.o_proj.bias", "model.layers.1.mlp.up_proj.weight"]
    buffer = "model.layers.0.self_attn.rotary_emb.inv_freq"
    assert hf.to_strata(buffer) is None and hf.to_strata(extra[0]) is None
    assert hf.unused([*present, *extra, buffer], cfg) == extra
    assert hf.missing(present[1:], cfg) == [present[0]]
    with pytest.raises(ValueError, match="attn.wo.bias"):
        hf.to_hf("layers.0.attn.wo.bias")


@pytest.mark.parametrize("family", ["Qwen3MoeConfig", "MixtralConfig"])
def test_the_router_loss_coefficient_is_carried_by_import_and_export(family):
    from strata.config.loading import from_dict

    moe = dict(num_key_value_heads=2, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    experts = {"num_experts": 4} if family == "Qwen3MoeConfig" else {"num_local_experts": 4}
    hf_cfg = getattr(transformers, family)(**SHAPE, **moe, **experts).to_dict()
    settings = hf.model_settings(hf_cfg, SEQ)
    assert settings["moe"]["aux_loss_coef"] == 0.02
    cfg = from_dict({"model": {**settings, "seq_len": SEQ}}).model
    assert cfg.moe.aux_loss_coef == 0.02
    back = hf.hf_config(cfg)
    assert back["router_aux_loss_coef"] == 0.02 and back["model_type"] == hf_cfg["model_type"]
    # transformers' default where the config.json leaves it out; a run's own value is no conflict
    del hf_cfg["router_aux_loss_coef"]
    assert hf.model_settings(hf_cfg, SEQ)["moe"]["aux_loss_coef"] == 0.001
    assert hf.conflicts({"moe": {"aux_loss_coef": 0.0}}, hf.model_settings(hf_cfg, SEQ)) == []
