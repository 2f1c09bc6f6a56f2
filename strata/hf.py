"""Hugging Face <-> Strata mapping: the `model.*` settings a transformers config.json implies (and
the features in it Strata does not implement), the config.json for a Strata model, and the names
of the tensors on both sides. Pure functions over dicts and names (no torch, no files), below the
config layer so that config loading can derive model settings from a Hugging Face directory.

Supported families: llama, mistral, qwen2, qwen3, and the Mixture-of-Experts families qwen3_moe and
mixtral. Strata's attention uses the rotate-half RoPE layout of these families, so q/k weights map
one to one, without permutation. Their experts are separate tensors per expert in a Hugging Face
checkpoint and rows of one stacked tensor in Strata's (`expert_names` pairs them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from strata.errors import ConfigError

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


class MoEShape(Protocol):
    """What these functions read of a `strata.config.MoEConfig`."""

    @property
    def enabled(self) -> bool: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def norm_topk(self) -> bool: ...
    @property
    def router(self) -> str: ...
    @property
    def shared_experts(self) -> int: ...
    @property
    def first_dense_layers(self) -> int: ...
    @property
    def bias_update_rate(self) -> float: ...
    @property
    def routed_scale(self) -> float: ...
    @property
    def expert_ffn(self) -> int | None: ...
    @property
    def route_groups(self) -> int: ...


class ModelShape(Protocol):
    """What these functions read of a `strata.config.ModelConfig` (which this module cannot import:
    it sits below the config layer)."""

    @property
    def n_layers(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_size(self) -> int: ...
    @property
    def ffn_size(self) -> int: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> str: ...
    @property
    def rope_factor(self) -> float: ...
    @property
    def rope_low_freq_factor(self) -> float: ...
    @property
    def rope_high_freq_factor(self) -> float: ...
    @property
    def rope_original_max_position_embeddings(self) -> int: ...
    @property
    def rope_beta_fast(self) -> float: ...
    @property
    def rope_beta_slow(self) -> float: ...
    @property
    def rope_attention_factor(self) -> float | None: ...
    @property
    def rope_mscale(self) -> float | None: ...
    @property
    def rope_mscale_all_dim(self) -> float | None: ...
    @property
    def rope_truncate(self) -> bool: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def init_std(self) -> float: ...
    @property
    def moe(self) -> MoEShape: ...


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
    window = _get(hf, "sliding_window")
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
            "(Strata has "
            "biases on q/k/v only, model.qkv_bias)"
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
    is explicit (no nulls). seq_len is the user's (`model.seq_len`), needed to judge a sliding window.
    Raises ConfigError listing `unsupported(hf_config, seq_len)` when that is not empty."""
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


def conflicts(explicit: Mapping[str, object], derived: Mapping[str, object]) -> list[str]:
    """One message per `model.*` key the user set explicitly (`explicit`: YAML names without
    `model.`, with their values) that disagrees with `derived` (`model_settings(...)`). Keys the
    Hugging Face config does not decide (seq_len, init_std, ...) never conflict, nor does an
    explicit null: null means "derive it", and the Hugging Face config is where it is derived from."""
    out = []
    for key, value in explicit.items():
        # the model.moe group
        if isinstance(value, Mapping) and isinstance(derived.get(key), Mapping):
            nested = conflicts(value, derived[key])  # type: ignore[arg-type]
            out += [m.replace("model.", f"model.{key}.", 1) for m in nested]
            continue
        if value is None or key not in derived or value == derived[key]:
            continue
        want = _show(derived[key])
        out.append(
            f"model.{key}={_show(value)} disagrees with the Hugging Face config "
            f"({_SOURCE.get(key, key)} gives "
            f"{want}); remove model.{key} or set it to {want}"
        )
    return out


# --- model.* -> config.json ------------------------------------------------------------------------


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
                "attention_bias also puts "
                "a bias on the output projection)"
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


def _moe_config(m: ModelShape, dense: dict[str, Any]) -> dict[str, Any]:
    """config.json of the Mixture-of-Experts family computing what Strata's MoE model does: Qwen3-MoE
    with qk_norm, else Mixtral; what neither has is refused, naming the key."""
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
                "every layer is MoE in both",
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
    family = moe_family(m)
    if family == "mixtral" and not moe.norm_topk:
        problems.append(
            "model.moe.norm_topk=false: Mixtral renormalises the top-k weights (set model.qk_norm "
            "for Qwen3-MoE)"
        )
    if problems:
        raise ConfigError(problems)
    out = {k: v for k, v in dense.items() if k not in ("architectures", "model_type")}
    experts = {
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "output_router_logits": False,
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


def moe_family(model_cfg: ModelShape) -> str:
    """The Hugging Face family of an MoE model: qwen3_moe (per-head q/k norms), else mixtral."""
    return "qwen3_moe" if model_cfg.qk_norm else "mixtral"


# --- tensor names ------------------------------------------------------------------------------------

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {  # Strata's name inside block N (`layers.N.`) -> HF's inside `model.layers.N.`
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_STRATA_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# older checkpoints saved RoPE's buffer: recomputed
_HF_BUFFERS = re.compile(r".*\.rotary_emb\.inv_freq")


def to_hf(strata_name: str) -> str:
    """HF's name of a parameter of Strata's GPT state_dict (`layers.3.attn.wq.bias` ->
    `model.layers.3.self_attn.q_proj.bias`). Raises ValueError for a name Strata's GPT has no
    counterpart of."""
    if strata_name in _TOP:
        return _TOP[strata_name]
    match = _STRATA_LAYER.fullmatch(strata_name)
    if match and match[2] in _LAYER:
        return f"model.layers.{match[1]}.{_LAYER[match[2]]}"
    raise ValueError(f"{strata_name!r} is not a parameter name of Strata's GPT")


def to_strata(hf_name: str) -> str | None:
    """Strata's name of a tensor in a HF checkpoint, or None when Strata's GPT has no such tensor
    (RoPE buffers of old checkpoints, which Strata recomputes, but also weights of features it lacks:
    see `unused` to catch those)."""
    if hf_name in _TOP_BACK:
        return _TOP_BACK[hf_name]
    match = _HF_LAYER.fullmatch(hf_name)
    if match and match[2] in _LAYER_BACK:
        return f"layers.{match[1]}.{_LAYER_BACK[match[2]]}"
    return None


# An MoE layer's tensors: the router (one to one) and each stacked expert weight (one HF tensor per
# expert, named with the expert's index), per family.
_MOE_ROUTER = {"qwen3_moe": "mlp.gate.weight", "mixtral": "block_sparse_moe.gate.weight"}
_MOE_EXPERT = {
    "qwen3_moe": {
        "w1": "mlp.experts.{e}.gate_proj.weight",
        "w3": "mlp.experts.{e}.up_proj.weight",
        "w2": "mlp.experts.{e}.down_proj.weight",
    },
    "mixtral": {
        "w1": "block_sparse_moe.experts.{e}.w1.weight",
        "w3": "block_sparse_moe.experts.{e}.w3.weight",
        "w2": "block_sparse_moe.experts.{e}.w2.weight",
    },
}


def expert_names(model_cfg: ModelShape) -> dict[str, list[str]]:
    """Each stacked expert weight of Strata's MoE model (`layers.N.mlp.experts.w1`, shape (E, ...))
    -> the HF names of its E rows, in order. Empty for a dense model."""
    if not model_cfg.moe.enabled:
        return {}
    family, E = moe_family(model_cfg), model_cfg.moe.num_experts
    return {
        f"layers.{i}.mlp.experts.{w}": [f"model.layers.{i}.{pattern.format(e=e)}" for e in range(E)]
        for i in range(model_cfg.n_layers)
        for w, pattern in _MOE_EXPERT[family].items()
    }


def strata_names(model_cfg: ModelShape) -> list[str]:
    """The keys of Strata's GPT state_dict for this config, in its order (with tie_embeddings both
    tok_embeddings.weight and output.weight, as state_dict lists both names of the one tensor)."""
    per_layer = ["attn_norm.weight"]
    for proj in ("wq", "wk", "wv"):
        per_layer += [f"attn.{proj}.weight"] + ([f"attn.{proj}.bias"] if model_cfg.qkv_bias else [])
    per_layer.append("attn.wo.weight")
    if model_cfg.qk_norm:
        per_layer += ["attn.q_norm.weight", "attn.k_norm.weight"]
    per_layer.append("mlp_norm.weight")
    ffn = (
        ["mlp.router.weight"]
        if model_cfg.moe.enabled
        else ["mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight"]
    )
    layers = [f"layers.{i}.{name}" for i in range(model_cfg.n_layers) for name in per_layer + ffn]
    return ["tok_embeddings.weight", *layers, "norm.weight", "output.weight"]


def _to_hf(model_cfg: ModelShape, strata_name: str) -> str:
    """`to_hf`, with an MoE layer's router named as its family names it."""
    match = _STRATA_LAYER.fullmatch(strata_name)
    if match and match[2] == "mlp.router.weight":
        return f"model.layers.{match[1]}.{_MOE_ROUTER[moe_family(model_cfg)]}"
    return to_hf(strata_name)


def hf_sources(model_cfg: ModelShape) -> dict[str, str]:
    """For import: each Strata state_dict name -> the HF tensor to read its value from (an MoE
    model's stacked experts: `expert_names`). With tie_embeddings, output.weight reads
    model.embed_tokens.weight: HF checkpoints of tied models usually have no lm_head.weight (and
    transformers ignores one if present)."""
    out = {name: _to_hf(model_cfg, name) for name in strata_names(model_cfg)}
    if model_cfg.tie_embeddings:
        out["output.weight"] = _TOP["tok_embeddings.weight"]
    return out


def hf_targets(model_cfg: ModelShape) -> dict[str, str]:
    """For export: each Strata state_dict name -> the HF name to write it under. With
    tie_embeddings, output.weight is left out (it is the embedding; config.json's
    tie_word_embeddings says so), as transformers' save_pretrained does."""
    out = {name: _to_hf(model_cfg, name) for name in strata_names(model_cfg)}
    if model_cfg.tie_embeddings:
        del out["output.weight"]
    return out


def unused(hf_names: Iterable[str], model_cfg: ModelShape) -> list[str]:
    """The tensors of a HF checkpoint that an import by `hf_sources` would not read, apart from
    those safe to drop (RoPE buffers; lm_head.weight of a tied model): weights of a feature Strata
    lacks (an output-projection bias, say), or of more layers than model.n_layers. An importer
    should refuse a checkpoint for which this is not empty."""
    read = set(hf_sources(model_cfg).values()) | {
        n for rows in expert_names(model_cfg).values() for n in rows
    }
    if model_cfg.tie_embeddings:
        read.add(_TOP["output.weight"])
    return [name for name in hf_names if name not in read and not _HF_BUFFERS.fullmatch(name)]


def missing(hf_names: Iterable[str], model_cfg: ModelShape) -> list[str]:
    """The tensors `hf_sources` needs that a HF checkpoint lacks (an importer refuses it then)."""
    have = set(hf_names)
    needed = [
        *hf_sources(model_cfg).values(),
        *(n for rows in expert_names(model_cfg).values() for n in rows),
    ]
    return sorted({name for name in needed if name not in have})
