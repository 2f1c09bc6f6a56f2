"""RoPE scalings against transformers' own functions (`ROPE_INIT_FUNCTIONS`): the inverse frequencies
and YaRN's attention factor of Strata's linear, dynamic NTK and YaRN scalings, at a real model's head
size and context, for sequences shorter and longer than the original context."""

from __future__ import annotations

import pytest
import torch

from strata import hf
from strata.config import ModelConfig, loading
from strata.errors import ConfigError
from strata.rope import attention_factor, rope_frequencies, rope_tables

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

SHAPE = dict(
    vocab_size=256,
    hidden_size=512,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=8,
)


def _reference(rope: dict, max_positions: int, seq_len: int) -> tuple[torch.Tensor, float]:
    config = transformers.LlamaConfig(
        **SHAPE, max_position_embeddings=max_positions, rope_parameters=dict(rope)
    )
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu", seq_len=seq_len)


def _ours(rope: dict, max_positions: int, seq_len: int) -> ModelConfig:
    config = transformers.LlamaConfig(
        **SHAPE, max_position_embeddings=max_positions, rope_parameters=dict(rope)
    )
    return ModelConfig(**hf.model_settings(config.to_dict(), seq_len), seq_len=seq_len)  # type: ignore[arg-type]


CASES = {
    "linear": (dict(rope_type="linear", rope_theta=10000.0, factor=4.0), 4096),
    "dynamic": (dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0), 4096),
    "yarn": (
        dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=4096),
        16384,
    ),
    "yarn-deepseek-mscale": (
        dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=1.0,
            mscale_all_dim=0.707,
            beta_fast=32,
            beta_slow=1,
        ),
        163840,
    ),
    "yarn-attention-factor-untruncated": (
        dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=8.0,
            original_max_position_embeddings=2048,
            attention_factor=1.25,
            truncate=False,
        ),
        16384,
    ),
}


@pytest.mark.parametrize("seq_len", [1024, 12288])
@pytest.mark.parametrize("name", list(CASES))
def test_scaled_frequencies_equal_transformers(name, seq_len):
    rope, max_positions = CASES[name]
    expected, expected_factor = _reference(rope, max_positions, seq_len)
    cfg = _ours(rope, max_positions, seq_len)
    assert cfg.rope_scaling == rope["rope_type"]
    ours = rope_frequencies(cfg)
    torch.testing.assert_close(ours.float(), expected, rtol=2e-6, atol=0)
    assert attention_factor(cfg) == pytest.approx(expected_factor, rel=1e-12)
    plain = rope_frequencies(ModelConfig(d_model=512, n_heads=8, rope_theta=rope["rope_theta"]))
    if name != "dynamic" or seq_len > max_positions:
        assert not torch.allclose(ours, plain)  # the scaling changed something at this length
    else:
        assert torch.equal(
            ours, plain
        )  # dynamic NTK leaves a sequence within the original context alone


def test_yarn_tables_carry_the_attention_factor():
    rope, max_positions = CASES["yarn-attention-factor-untruncated"]
    cfg = _ours(rope, max_positions, 64)
    cos, sin = rope_tables(cfg)
    assert cos[0].max().item() == pytest.approx(1.25)  # angle 0: cos is the factor itself
    assert (cos.pow(2) + sin.pow(2)).sub(1.25**2).abs().max().item() < 1e-5


def test_bad_scaling_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="rope_beta_fast=1 must exceed model.rope_beta_slow=2"):
        loading.load(
            None, ["model.rope_scaling=yarn", "model.rope_beta_fast=1", "model.rope_beta_slow=2"]
        )
    with pytest.raises(ConfigError, match="rope_scaling"):
        loading.load(None, ["model.rope_scaling=ntk"])
