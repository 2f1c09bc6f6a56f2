"""Hugging Face <-> Strata mapping: the `model.*` settings a transformers config.json implies (and
the features in it Strata does not implement), the config.json for a Strata model, and the names
of the tensors on both sides. Pure functions over dicts and names (no torch, no files), below the
config layer so that config loading can derive model settings from a Hugging Face directory.

Supported families: llama, mistral, qwen2, qwen3. Strata's attention uses the rotate-half RoPE
layout of these families, so q/k weights map one to one, without permutation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from strata.errors import ConfigError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")

# Defaults of transformers' config classes for fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "head_dim": 128,
    },
}
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
_DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta

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
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "model_type",
    "qk_norm": "model_type",
}


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
    def norm_eps(self) -> float: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def init_std(self) -> float: ...


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
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", _get(hf, "max_position_embeddings"))
    return field, params


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    """The attention window of the layers that slide, or None when none does (transformers' rules:
    Mistral slides every layer whenever sliding_window is set; Qwen2/3 only with use_sliding_window,
    in the layers layer_types marks, by default those from max_window_layers on)."""
    window = _get(hf, "sliding_window")
    if window is None:
        return None
    if hf.get("model_type") in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False):
            return None
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            return window if "sliding_attention" in layer_types else None
        return window if _get(hf, "max_window_layers") < hf.get("num_hidden_layers", 0) else None
    return window


def unsupported(hf_config: Mapping[str, Any], seq_len: int) -> list[str]:
    """One message per feature of this config.json that Strata's model does not implement, each
    naming the config.json field (empty: Strata computes exactly what transformers does). A sliding
    window counts only where it changes attention: with seq_len <= sliding_window every token sees
    all earlier ones anyway, as in full causal attention."""
    hf = hf_config
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        return [f"model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"]
    out = [f"{key} is missing (the model's shape needs it)" for key in _REQUIRED if key not in hf]
    moe = [f"{key}={hf[key]}" for key in _MOE_FIELDS if hf.get(key)]
    if moe:
        out.append(f"{', '.join(moe)}: mixture-of-experts layers are not implemented (Strata's MLP is dense)")
    window = _sliding_window(hf)
    if window is not None and seq_len > window:
        flag = " with use_sliding_window=true" if model_type != "mistral" else ""
        out.append(
            f"sliding_window={window}{flag}: sliding-window attention is not implemented; it equals full causal "
            f"attention only for model.seq_len <= {window} (model.seq_len={seq_len})"
        )
    if hf.get("attention_bias"):
        out.append(
            "attention_bias=true: biases on the attention's output projection are not implemented (Strata has "
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
    elif rope["rope_type"] not in ("default", "llama3"):
        key = "rope_type" if "rope_type" in (hf.get(field) or {}) else "type"
        out.append(f"{field}.{key}={rope['rope_type']!r}: only default and llama3 RoPE are implemented")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        out.append(
            f"partial_rotary_factor={rope['partial_rotary_factor']}: RoPE on part of each head is not implemented"
        )
    if hf.get("quantization_config"):
        out.append("quantization_config: quantized weights are not supported (use a full-precision checkpoint)")
    return out


def model_settings(hf_config: Mapping[str, Any], seq_len: int) -> dict[str, object]:
    """The `model.*` values (YAML names, without `model.`) this config.json implies: n_layers,
    d_model, n_heads, n_kv_heads, head_dim, ffn_hidden, vocab_size, rope_theta, rope_scaling (and,
    for llama3, rope_factor, rope_low_freq_factor, rope_high_freq_factor,
    rope_original_max_position_embeddings), norm_eps, tie_embeddings, qkv_bias, qk_norm. Every size
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
        "qkv_bias": model_type == "qwen2",  # Qwen2 always has them; elsewhere attention_bias is unsupported
        "qk_norm": model_type == "qwen3",
    }
    if rope["rope_type"] == "llama3":
        out.update(
            rope_scaling="llama3",
            rope_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
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
        if value is None or key not in derived or value == derived[key]:
            continue
        want = _show(derived[key])
        out.append(
            f"model.{key}={_show(value)} disagrees with the Hugging Face config ({_SOURCE.get(key, key)} gives "
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
        raise ConfigError(["hf_config needs the vocabulary size: model.vocab_size is null and none was given"])
    if m.qk_norm and m.qkv_bias:
        raise ConfigError(
            [
                "model.qkv_bias with model.qk_norm has no Hugging Face family (Qwen3's attention_bias also puts "
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
    if m.rope_scaling == "llama3":
        max_positions = int(m.rope_original_max_position_embeddings * m.rope_factor)  # as Llama 3.1's config
        rope.update(
            rope_type="llama3",
            factor=m.rope_factor,
            low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor,
            original_max_position_embeddings=m.rope_original_max_position_embeddings,
        )
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
        "max_position_embeddings": max(m.seq_len, max_positions),
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "attention_dropout": 0.0,
        "rope_theta": m.rope_theta,
        "rope_parameters": rope,
    }
    if m.rope_scaling == "llama3":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layers)
        if model_type == "qwen3":
            out["attention_bias"] = False
    return out


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
_HF_BUFFERS = re.compile(r".*\.rotary_emb\.inv_freq")  # older checkpoints saved RoPE's buffer: recomputed


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


def strata_names(model_cfg: ModelShape) -> list[str]:
    """The keys of Strata's GPT state_dict for this config, in its order (with tie_embeddings both
    tok_embeddings.weight and output.weight, as state_dict lists both names of the one tensor)."""
    per_layer = ["attn_norm.weight"]
    for proj in ("wq", "wk", "wv"):
        per_layer += [f"attn.{proj}.weight"] + ([f"attn.{proj}.bias"] if model_cfg.qkv_bias else [])
    per_layer.append("attn.wo.weight")
    if model_cfg.qk_norm:
        per_layer += ["attn.q_norm.weight", "attn.k_norm.weight"]
    per_layer += ["mlp_norm.weight", "mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight"]
    layers = [f"layers.{i}.{name}" for i in range(model_cfg.n_layers) for name in per_layer]
    return ["tok_embeddings.weight", *layers, "norm.weight", "output.weight"]


def hf_sources(model_cfg: ModelShape) -> dict[str, str]:
    """For import: each Strata state_dict name -> the HF tensor to read its value from. With
    tie_embeddings, output.weight reads model.embed_tokens.weight: HF checkpoints of tied models
    usually have no lm_head.weight (and transformers ignores one if present)."""
    out = {name: to_hf(name) for name in strata_names(model_cfg)}
    if model_cfg.tie_embeddings:
        out["output.weight"] = _TOP["tok_embeddings.weight"]
    return out


def hf_targets(model_cfg: ModelShape) -> dict[str, str]:
    """For export: each Strata state_dict name -> the HF name to write it under. With
    tie_embeddings, output.weight is left out (it is the embedding; config.json's
    tie_word_embeddings says so), as transformers' save_pretrained does."""
    out = {name: to_hf(name) for name in strata_names(model_cfg)}
    if model_cfg.tie_embeddings:
        del out["output.weight"]
    return out


def unused(hf_names: Iterable[str], model_cfg: ModelShape) -> list[str]:
    """The tensors of a HF checkpoint that an import by `hf_sources` would not read, apart from
    those safe to drop (RoPE buffers; lm_head.weight of a tied model): weights of a feature Strata
    lacks (an output-projection bias, say), or of more layers than model.n_layers. An importer
    should refuse a checkpoint for which this is not empty."""
    read = set(hf_sources(model_cfg).values())
    if model_cfg.tie_embeddings:
        read.add(_TOP["output.weight"])
    return [name for name in hf_names if name not in read and not _HF_BUFFERS.fullmatch(name)]


def missing(hf_names: Iterable[str], model_cfg: ModelShape) -> list[str]:
    """The tensors `hf_sources` needs that a HF checkpoint lacks (an importer refuses it then)."""
    have = set(hf_names)
    return sorted({name for name in hf_sources(model_cfg).values() if name not in have})
