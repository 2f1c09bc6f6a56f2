"""The `model:` group: the shape of the decoder-only transformer (Llama-style: RoPE, RMSNorm, SwiGLU),
its RoPE scaling, and where its initial weights come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.config.schema.fields import opt

ROPE_SCALINGS = ("none", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer (Llama-style: RoPE, RMSNorm, SwiGLU)."""

    n_layers: int = opt(4, "number of transformer blocks", min=1)
    d_model: int = opt(128, "hidden size (width of the residual stream)", min=1)
    n_heads: int = opt(4, "attention heads; must divide d_model unless head_dim is set", min=1)
    n_kv_heads: int | None = opt(None, "key/value heads for grouped-query attention (null: = n_heads)", min=1)
    head_dim: int | None = opt(
        None, "size of each attention head (null: d_model/n_heads); n_heads·head_dim may differ from d_model", min=2
    )
    qkv_bias: bool = opt(False, "bias on the query/key/value projections (Qwen2); the output projection has none")
    qk_norm: bool = opt(False, "RMSNorm over each head's query and key before RoPE, one weight of head_dim (Qwen3)")
    ffn_hidden: int | None = opt(None, "SwiGLU inner size (null: 8/3·d_model rounded up to a multiple of 32)", min=1)
    vocab_size: int | None = opt(None, "vocabulary size (null: the data's, padded to pad_vocab_multiple)", min=1)
    pad_vocab_multiple: int = opt(64, "pad a data-derived vocabulary up to a multiple of this", min=1)
    seq_len: int = opt(128, "tokens per training sequence (context length)", min=1)
    rope_theta: float = opt(10000.0, "RoPE base frequency", min=0.0, min_exclusive=True)
    rope_scaling: str = opt(
        "none",
        "RoPE frequency scaling: none, or llama3 (Llama 3.1's, set by the rope_* keys below)",
        choices=ROPE_SCALINGS,
    )
    rope_factor: float = opt(8.0, "llama3 RoPE scaling: divisor of the low frequencies", min=1.0)
    rope_low_freq_factor: float = opt(
        1.0,
        "llama3 RoPE scaling: wavelengths above original_max/this are divided by rope_factor",
        min=0.0,
        min_exclusive=True,
    )
    rope_high_freq_factor: float = opt(
        4.0,
        "llama3 RoPE scaling: wavelengths below original_max/this are kept (between: interpolated)",
        min=0.0,
        min_exclusive=True,
    )
    rope_original_max_position_embeddings: int = opt(
        8192, "llama3 RoPE scaling: the context length the model was pretrained with", min=1
    )
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", min=0.0, min_exclusive=True)
    tie_embeddings: bool = opt(False, "share the token embedding with the output projection")
    init_from: str | None = opt(
        None,
        "start a new run from these weights (the optimizer, data position and step start fresh): a local "
        "Hugging Face model directory (config.json + model.safetensors or shards; the other model keys are "
        "derived from its config.json, and one set to a different value is an error), or a Strata checkpoint",
    )
    init_std: float = opt(
        0.02,
        "std of the normal init of weights (output projections scaled by 1/sqrt(2·n_layers))",
        min=0.0,
        min_exclusive=True,
    )

    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim, or d_model/n_heads."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads."""
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_size(self) -> int:
        """SwiGLU inner width: ffn_hidden, or Llama's 2/3·4·d_model rounded up to a multiple of 32."""
        return self.ffn_hidden or 32 * math.ceil(int(8 * self.d_model / 3) / 32)
