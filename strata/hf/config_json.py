"""config.json <-> `model:` settings: the `model.*` values a transformers config.json implies (and
the features in it Strata does not implement, each refusal naming its field), the conflicts with
what a user set explicitly, and the config.json of the Hugging Face model computing what a Strata
model does. Pure functions over dicts (no torch, no files), below the config layer so that config
loading can derive model settings from a Hugging Face directory.

Supported families: llama, mistral, qwen2, qwen3, and the Mixture-of-Experts families qwen3_moe and
mixtral; RoPE default, llama3, linear, dynamic and yarn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strata.errors import ConfigError
from strata.hf.shape import ModelShape, moe_family

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")
# What the other MoE families need beyond Strata's model (named in the refusal).
_MOE_MISSING = {
    "deepseek_v3": "multi-head latent attention (MLA) and grouped top-k routing",
    "deepseek_v2": "multi-head latent attention (MLA) and grouped top-k routing",
    "gpt_oss": "attention sinks, clamped SwiGLU with biases and alternating sliding-window layers",
    "qwen2_moe": "Qwen2-MoE's per-layer sparse step with shared-expert gating as transformers "
    "lays it out",
}

# Defaults of transformers' config classes for fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "head_dim": 128,
    },
    "qwen3_moe": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "norm_topk_prob": False},
    "mixtral": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32},
}
_REQUIRED = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
_MOE_FIELDS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn")
# model.* key <- rope_parameters key, for the scalings that have it
_ROPE_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_position_embeddings": "original_max_position_embeddings",
    "rope_beta_fast": "beta_fast",
    "rope_beta_slow": "beta_slow",
    "rope_attention_factor": "attention_factor",
    "rope_mscale": "mscale",
    "rope_mscale_all_dim": "mscale_all_dim",
    "rope_truncate": "truncate",
}
# transformers' defaults for the optional ones, and the keys that are not floats
_ROPE_DEFAULTS: dict[str, object] = {
    "rope_beta_fast": 32.0,
    "rope_beta_slow": 1.0,
    "rope_truncate": True,
}
_ROPE_TYPE: dict[str, type] = {"rope_original_max_position_embeddings": int, "rope_truncate": bool}
_ROPE_USES = {
    "llama3": (
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_position_embeddings",
    ),
    "linear": ("rope_factor",),
    "dynamic": ("rope_factor",),
    "yarn": (
        "rope_factor",
        "rope_original_max_position_embeddings",
        "rope_beta_fast",
        "rope_beta_slow",
        "rope_attention_factor",
        "rope_mscale",
        "rope_mscale_all_dim",
        "rope_truncate",
    ),
}

# The config.json field each `model.*` key comes from (for messages).
_SOURCE = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_hidden": "intermediate_size",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_type",
    "rope_factor": "rope factor",
    "rope_low_freq_factor": "rope low_freq_factor",
    "rope_high_freq_factor": "rope high_freq_factor",
    "rope_original_max_position_embeddings": "rope original_max_position_embeddings",
    "rope_beta_fast": "rope beta_fast",
    "rope_beta_slow": "rope beta_slow",
    "rope_attention_factor": "rope attention_factor",
    "rope_mscale": "rope mscale",
    "rope_mscale_all_dim": "rope mscale_all_dim",
    "rope_truncate": "rope truncate",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "model_type",
    "qk_norm": "model_type",
}

# --- config.json -> model.* ----------------------------------------------------------------------


def _get(hf: Mapping[str, Any], key: str) -> Any:
    return hf.get(key, _DEFAULTS.get(hf.get("model_type", ""), {}).get(key))


def _rope(hf: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the field it was read from, the RoPE parameters) in transformers 5's form (`rope_type`,
    `rope_theta`, ...), from either `rope_parameters` (transformers 5) or the older `rope_scaling`
    (with `type` or `rope_type`) plus a top-level `rope_theta`."""
    field, params = "rope_parameters", hf.get("rope_parameters")
    if not params:
        field, params = "rope_scaling", hf.get("rope_scaling")
    params = dict(params or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", hf.get("rope_theta", _DEFAULT_THETA))
    if "partial_rotary_factor" in hf:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", _get(hf, "max_position_embeddings"))
    return field, params


def rope_parameters(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json's RoPE parameters in transformers 5's form (`rope_type`, `rope_theta`, ...)."""
    return _rope(hf_config)[1]


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    """The attention window of the layers that slide, or None when none does (transformers' rules:
    Mistral slides every layer whenever sliding_window is set; Qwen2/3 only with use_sliding_window,
    in the layers layer_types marks, by default those from max_window_layers on)."""
    window: int | None = _get(hf, "sliding_window")
    if window is None:
        return None
    if hf.get("model_type") in ("qwen2", "qwen3", "qwen3_moe"):
        if not hf.get("use_sliding_window", False):
            return None
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            return window if "sliding_attention" in layer_types else None
        return window if _get(hf, "max_window_layers") < hf.get("num_hidden_layers", 0) else None
    return window


def _moe_unsupported(hf: Mapping[str, Any]) -> list[str]:
    """The Mixture-of-Experts layouts Strata's MoE layers do not match."""
    model_type, out = hf.get("model_type"), []
    moe = [f"{key}={hf[key]}" for key in _MOE_FIELDS if hf.get(key)]
    if moe and model_type not in MOE_FAMILIES:
        out.append(
            f"{', '.join(moe)}: mixture-of-experts layers of model_type {model_type!r} are "
            "not implemented"
        )
    if model_type == "qwen3_moe":
        if hf.get("mlp_only_layers"):
            out.append(
                f"mlp_only_layers={hf['mlp_only_layers']}: dense layers among the MoE ones "
                "are not implemented"
            )
        if hf.get("decoder_sparse_step", 1) != 1:
            out.append(
                f"decoder_sparse_step={hf['decoder_sparse_step']}: MoE in every other "
                "layer is not implemented"
            )
    return out


def unsupported(hf_config: Mapping[str, Any], seq_len: int) -> list[str]:
    """One message per feature of this config.json that Strata's model does not implement, each
    naming the config.json field (empty: Strata computes exactly what transformers does). A sliding
    window counts only where it changes attention: with seq_len <= sliding_window every token sees
    all earlier ones anyway, as in full causal attention."""
    hf = hf_config
    model_type = hf.get("model_type")
    if model_type in _MOE_MISSING:
        return [
            f"model_type={model_type!r} is not supported: Strata's MoE model lacks "
            f"{_MOE_MISSING[model_type]}"
        ]
    if model_type not in SUPPORTED:
        return [f"model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"]
    out = [f"{key} is missing (the model's shape needs it)" for key in _REQUIRED if key not in hf]
    out += _moe_unsupported(hf)
    window = _sliding_window(hf)
    if window is not None and seq_len > window:
        flag = " with use_sliding_window=true" if model_type != "mistral" else ""
        out.append(
            f"sliding_window={window}{flag}: sliding-window attention is not implemented; it "
            "equals full causal "
            f"attention only for model.seq_len <= {window} (model.seq_len={seq_len})"
        )
    if hf.get("attention_bias"):
        out.append(
            "attention_bias=true: biases on the attention's output projection are not implemented "
            "(Strata has biases on q/k/v only, model.qkv_bias)"
        )
    if hf.get("mlp_bias"):
        out.append("mlp_bias=true: biases in the MLP are not implemented")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act={act!r}: only silu (SwiGLU) is implemented")
    field, rope = _rope(hf)
    if any(isinstance(v, dict) for v in rope.values()):
        out.append(f"{field}: RoPE parameters per layer type are not implemented")
    elif rope["rope_type"] not in _ROPE_TYPES:
        key = "rope_type" if "rope_type" in (hf.get(field) or {}) else "type"
        out.append(
            f"{field}.{key}={rope['rope_type']!r}: only {', '.join(_ROPE_TYPES)} RoPE are "
            "implemented"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        out.append(
            f"partial_rotary_factor={rope['partial_rotary_factor']}: RoPE on part of each head is "
            "not implemented"
        )
    if hf.get("quantization_config"):
        out.append(
            "quantization_config: quantized weights are not supported (use a "
            "full-precision checkpoint)"
        )
    return out


def model_settings(hf_config: Mapping[str, Any], seq_len: int) -> dict[str, object]:
    """The `model.*` values (YAML names, without `model.`) this config.json implies: n_layers,
    d_model, n_heads, n_kv_heads, head_dim, ffn_hidden, vocab_size, rope_theta, rope_scaling (and
    the rope_* keys its scaling reads), norm_eps, tie_embeddings, qkv_bias, qk_norm. Every size
    is explicit (no nulls). seq_len is the user's (`model.seq_len`), needed to judge a sliding
    window. Raises ConfigError listing `unsupported(hf_config, seq_len)` when that is not empty."""
    problems = unsupported(hf_config, seq_len)
    if problems:
        raise ConfigError(problems)
    hf = hf_config
    model_type = hf["model_type"]
    n_heads = hf["num_attention_heads"]
    _, rope = _rope(hf)
    out: dict[str, object] = {
        "n_layers": hf["num_hidden_layers"],
        "d_model": hf["hidden_size"],
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "head_dim": _get(hf, "head_dim") or hf["hidden_size"] // n_heads,
        "ffn_hidden": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": "none",
        "norm_eps": float(_get(hf, "rms_norm_eps")),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": model_type
        == "qwen2",  # Qwen2 always has them; elsewhere attention_bias is unsupported
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
    }
    if model_type in MOE_FAMILIES:
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        out["moe"] = {
            "num_experts": experts,
            "top_k": hf["num_experts_per_tok"],
            "expert_ffn": hf["moe_intermediate_size"]
            if model_type == "qwen3_moe"
            else hf["intermediate_size"],
            "norm_topk": bool(_get(hf, "norm_topk_prob")) if model_type == "qwen3_moe" else True,
            "router": "softmax",
            # the weight transformers gives the load-balancing loss when it trains with
            # output_router_logits; Strata's training adds it always, so a continued pretraining
            # keeps the source's balancing (model.moe.aux_loss_coef set explicitly overrides it)
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", _ROUTER_AUX_LOSS_COEF)),
        }
    out.update(_rope_settings(hf, rope))
    return out


def _rope_settings(hf: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, object]:
    """The model.rope_* values of a config.json's RoPE parameters (transformers' defaults for the
    optional ones: beta_fast 32, beta_slow 1, truncate true; attention_factor, mscale and
    mscale_all_dim null). Dynamic NTK's original context is max_position_embeddings, as transformers
    reads it."""
    kind = rope["rope_type"]
    if kind == "default":
        return {}
    out: dict[str, object] = {"rope_scaling": kind}
    for key in _ROPE_USES[kind]:
        value = rope.get(_ROPE_KEYS[key])
        # transformers' `get(...) or default`
        value = _ROPE_DEFAULTS.get(key) if value is None else value
        out[key] = None if value is None else _ROPE_TYPE.get(key, float)(value)
    if kind == "dynamic":
        out["rope_original_max_position_embeddings"] = int(_get(hf, "max_position_embeddings"))
    if kind == "yarn" and rope.get("factor") is None:
        out["rope_factor"] = (
            _get(hf, "max_position_embeddings") / rope["original_max_position_embeddings"]
        )
    return out


def _show(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


_ROUTER_AUX_LOSS_COEF = 0.001  # transformers' default in Mixtral's and Qwen3-MoE's configs
# derived values that are a run's choice rather than the model's: an explicit value overrides them
_CHOICES = {"aux_loss_coef"}


def conflicts(explicit: Mapping[str, object], derived: Mapping[str, object]) -> list[str]:
    """One message per `model.*` key the user set explicitly (`explicit`: YAML names without
    `model.`, with their values) that disagrees with `derived` (`model_settings(...)`). Keys the
    Hugging Face config does not decide (seq_len, init_std, ...) never conflict, nor does an
    explicit null: null means "derive it", and the Hugging Face config is where it is derived
    from."""
    out = []
    for key, value in explicit.items():
        # the model.moe group
        if isinstance(value, Mapping) and isinstance(derived.get(key), Mapping):
            nested = conflicts(value, derived[key])  # type: ignore[arg-type]
            out += [m.replace("model.", f"model.{key}.", 1) for m in nested]
            continue
        if value is None or key not in derived or value == derived[key] or key in _CHOICES:
            continue
        want = _show(derived[key])
        out.append(
            f"model.{key}={_show(value)} disagrees with the Hugging Face config "
            f"({_SOURCE.get(key, key)} gives {want}); remove model.{key} or set it to {want}"
        )
    return out


# --- model.* -> config.json ----------------------------------------------------------------------


def hf_config(model_cfg: ModelShape, vocab_size: int | None = None) -> dict[str, Any]:
    """The config.json of the Hugging Face model computing what Strata's model of `model_cfg` does:
    Qwen3ForCausalLM with qk_norm, Qwen2ForCausalLM with qkv_bias, else LlamaForCausalLM.
    `vocab_size` is the model's (padded) vocabulary, needed when model.vocab_size is null. RoPE is
    written both as transformers 5's `rope_parameters` and as the older `rope_theta`/`rope_scaling`.
    Token ids (bos/eos/pad) and the dtype are the tokenizer's and the exporter's to add."""
    m = model_cfg
    vocab = vocab_size or m.vocab_size
    if not vocab:
        raise ConfigError(
            ["hf_config needs the vocabulary size: model.vocab_size is null and none was given"]
        )
    if m.qk_norm and m.qkv_bias:
        raise ConfigError(
            [
                "model.qkv_bias with model.qk_norm has no Hugging Face family (Qwen3's "
                "attention_bias also puts a bias on the output projection)"
            ]
        )
    model_type, arch = (
        ("qwen3", "Qwen3ForCausalLM")
        if m.qk_norm
        else ("qwen2", "Qwen2ForCausalLM")
        if m.qkv_bias
        else ("llama", "LlamaForCausalLM")
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    max_positions = m.seq_len
    if m.rope_scaling != "none":
        for key in _ROPE_USES[m.rope_scaling]:
            value = getattr(m, key)
            if value is not None:
                rope[_ROPE_KEYS[key]] = value
        rope["rope_type"] = m.rope_scaling
    if m.rope_scaling in ("llama3", "yarn"):
        # as Llama 3.1's config
        max_positions = int(m.rope_original_max_position_embeddings * m.rope_factor)
    elif m.rope_scaling == "dynamic":
        # the length beyond which the base grows
        max_positions = m.rope_original_max_position_embeddings
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions
        if m.rope_scaling == "dynamic"
        else max(m.seq_len, max_positions),
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "attention_dropout": 0.0,
        "rope_theta": m.rope_theta,
        "rope_parameters": rope,
    }
    if m.rope_scaling == "llama3":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if m.moe.enabled:
        return _moe_config(m, out)
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layers)
        if model_type == "qwen3":
            out["attention_bias"] = False
    return out


def _moe_problems(m: ModelShape) -> list[str]:
    """One message per `model.moe.*` setting (and q/k bias) that the MoE model's Hugging Face family
    (`moe_family`) has no place for, naming the key."""
    moe = m.moe
    problems = [
        f"model.moe.{key}={value}: {why}"
        for key, value, bad, why in (
            (
                "shared_experts",
                moe.shared_experts,
                moe.shared_experts > 0,
                "neither Qwen3-MoE nor Mixtral has them",
            ),
            (
                "router",
                moe.router,
                moe.router != "softmax",
                "Qwen3-MoE and Mixtral route by softmax",
            ),
            (
                "first_dense_layers",
                moe.first_dense_layers,
                moe.first_dense_layers > 0,
                "Mixtral has no dense layers, and Qwen3-MoE's (mlp_only_layers) are not "
                "implemented",
            ),
            (
                "bias_update_rate",
                moe.bias_update_rate,
                moe.bias_update_rate > 0,
                "the selection bias has no place",
            ),
            (
                "routed_scale",
                moe.routed_scale,
                moe.routed_scale != 1.0,
                "the gate weights are not scaled in both",
            ),
            (
                "route_groups",
                moe.route_groups,
                moe.route_groups > 1,
                "both route over every expert, without groups",
            ),
            ("qkv_bias", m.qkv_bias, m.qkv_bias, "neither family has q/k/v biases"),
        )
        if bad
    ]
    if moe_family(m) == "mixtral" and not moe.norm_topk:
        problems.append(
            "model.moe.norm_topk=false: Mixtral renormalises the top-k weights (set model.qk_norm "
            "for Qwen3-MoE)"
        )
    return problems


def _moe_config(m: ModelShape, dense: dict[str, Any]) -> dict[str, Any]:
    """config.json of the Mixture-of-Experts family computing what Strata's MoE model does:
    Qwen3-MoE with qk_norm, else Mixtral; what neither has is refused, naming the key."""
    problems = _moe_problems(m)
    if problems:
        raise ConfigError(problems)
    moe, family = m.moe, moe_family(m)
    out = {k: v for k, v in dense.items() if k not in ("architectures", "model_type")}
    experts = {
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": moe.aux_loss_coef,
    }
    if family == "qwen3_moe":
        expert_ffn = moe.expert_ffn or m.ffn_size
        extra: dict[str, Any] = {
            "moe_intermediate_size": expert_ffn,
            "norm_topk_prob": moe.norm_topk,
        }
        extra.update(
            decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None
        )
        extra["attention_bias"] = False
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **out,
            **experts,
            **extra,
        }
    out["intermediate_size"] = moe.expert_ffn or m.ffn_size
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **out,
        **experts,
        "sliding_window": None,
    }
