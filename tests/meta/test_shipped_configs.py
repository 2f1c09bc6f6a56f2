"""Every config we ship fits the cluster its comment names: each file in configs/ carries a
`#   plan: ARGS` line, and `strata plan FILE ARGS` must say the layout fits (exit 0). The fine-tuning
configs' models come from a Hugging Face config.json: the published shape of the model each names
(Llama-3.2-1B, Llama-3.1-8B-Instruct, Llama-3.3-70B-Instruct), written here."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import run_cli

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PLAN_LINE = re.compile(r"^#\s+plan:\s+(.*)$", re.MULTILINE)
# meta-llama/Llama-3.2-1B's config.json (the fields the model block reads)
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}

# meta-llama/Llama-3.1-8B-Instruct's and Llama-3.3-70B-Instruct's (the same fields)
_LLAMA_3_1 = {
    **LLAMA_3_2_1B,
    "head_dim": 128,
    "rope_scaling": {**LLAMA_3_2_1B["rope_scaling"], "factor": 8.0},  # type: ignore[dict-item]
    "tie_word_embeddings": False,
    "num_key_value_heads": 8,
}
PUBLISHED = {
    "Llama-3.2-1B": LLAMA_3_2_1B,
    "Llama-3.1-8B-Instruct": {
        **_LLAMA_3_1,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "Llama-3.3-70B-Instruct": {
        **_LLAMA_3_1,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_a_shipped_config_fits_the_cluster_its_comment_names(path, tmp_path, capsys):
    found = PLAN_LINE.findall(path.read_text())
    assert len(found) == 1, (
        f"{path.name}: needs one '#   plan: --nodes N --gpus-per-node G --gpu NAME' line"
    )
    overrides = []
    init_from = (yaml.safe_load(path.read_text()).get("model") or {}).get("init_from")
    if init_from:
        model = tmp_path / Path(init_from).name
        model.mkdir()
        (model / "config.json").write_text(json.dumps(PUBLISHED[model.name]))
        overrides = [f"model.init_from={model}", "data.tokenizer=null"]
    code, out = run_cli(["plan", str(path), *overrides, *shlex.split(found[0])], capsys)
    assert code == 0, out
    assert "does not fit" not in out
