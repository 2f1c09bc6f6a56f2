"""Hugging Face <-> Strata: the model families Strata computes exactly as transformers does, mapped
both ways. Pure functions over dicts and names (no torch, no files), in the base below the config
layer, so that config loading can fill the `model:` block from a Hugging Face directory.

The package, from the bottom up (each module imports only those below it):

- `shape`: what the mapping reads of a Strata model config (`ModelShape`, `MoEShape`, protocols)
  and the Mixture-of-Experts family such a model maps to (`moe_family`);
- `config_json`: a config.json's `model.*` settings, the features Strata refuses
  (`unsupported`, `model_settings`, `conflicts`, `rope_parameters`), and the config.json for
  export (`hf_config`);
- `tensor_names`: state_dict names both ways (`to_hf`, `to_strata`, `hf_sources`, `hf_targets`,
  `expert_names`, `unused`, `missing`; a LoRA adapter's tensors as PEFT names them: `to_peft`,
  `from_peft`);
- `byte_tokenizer`: the tokenizer.json that spells Strata's byte-level tokens, for an export.

Code imports the module it needs; the names below are re-exported for `from strata.hf import X`.
"""

from strata.hf.config_json import (
    MOE_FAMILIES,
    SUPPORTED,
    conflicts,
    hf_config,
    model_settings,
    rope_parameters,
    unsupported,
)
from strata.hf.shape import ModelShape, MoEShape, moe_family
from strata.hf.tensor_names import (
    expert_names,
    from_peft,
    hf_sources,
    hf_targets,
    missing,
    strata_names,
    to_hf,
    to_peft,
    to_strata,
    unused,
)

__all__ = [
    "MOE_FAMILIES",
    "SUPPORTED",
    "ModelShape",
    "MoEShape",
    "conflicts",
    "expert_names",
    "from_peft",
    "hf_config",
    "hf_sources",
    "hf_targets",
    "missing",
    "model_settings",
    "moe_family",
    "rope_parameters",
    "strata_names",
    "to_hf",
    "to_peft",
    "to_strata",
    "unsupported",
    "unused",
]
