"""Tensor names both ways: Strata's GPT state_dict keys <-> a Hugging Face checkpoint's, for import
(`hf_sources`, with `unused` and `missing` to refuse a checkpoint that does not fit) and export
(`hf_targets`). An MoE model's experts are separate tensors per expert in a Hugging Face checkpoint
and rows of one stacked tensor in Strata's (`expert_names` pairs them). A LoRA adapter's tensors
are named as PEFT names them in an adapter directory (`to_peft`, `from_peft`). Strata's attention
uses the rotate-half RoPE layout of the supported families, so q/k weights map one to one, without
permutation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from strata.hf.shape import ModelShape, moe_family

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
    (RoPE buffers of old checkpoints, which Strata recomputes, but also weights of features it
    lacks: see `unused` to catch those)."""
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


# PEFT's key of an adapter tensor: the base model's module path under `base_model.model.`, then the
# adapter's part (lora_A, lora_B) and `.weight` (the adapter's own name, "default", left out).
PEFT_PREFIX = "base_model.model."
_ADAPTER = re.compile(r"(.+)\.(lora_[AB])\.weight")


def to_peft(strata_name: str) -> str:
    """PEFT's key of an adapter tensor of Strata's GPT (`layers.3.attn.wq.lora_A.weight` ->
    `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`). Raises ValueError for a
    name that is no adapter of a layer Hugging Face's model has."""
    match = _ADAPTER.fullmatch(strata_name)
    if not match:
        raise ValueError(f"{strata_name!r} is not a LoRA adapter tensor of Strata's GPT")
    base = to_hf(f"{match[1]}.weight").removesuffix(".weight")
    return f"{PEFT_PREFIX}{base}.{match[2]}.weight"


def from_peft(peft_name: str) -> str | None:
    """Strata's name of a tensor in a PEFT adapter file, or None when Strata's GPT has no such
    adapter (its module is not one of the GPT's, or it is not a LoRA A or B)."""
    match = _ADAPTER.fullmatch(peft_name.removeprefix(PEFT_PREFIX))
    if not match or not peft_name.startswith(PEFT_PREFIX):
        return None
    base = to_strata(f"{match[1]}.weight")
    if base is None or not base.startswith("layers."):  # adapters sit in the blocks only
        return None
    return f"{base.removesuffix('.weight')}.{match[2]}.weight"
