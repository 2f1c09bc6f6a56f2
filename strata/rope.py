"""Rotary position embedding: the inverse frequencies for each RoPE scaling transformers defines
(none, llama3, linear, dynamic NTK, YaRN), the cos/sin tables the attention reads, and the rotation
itself. Computed in float64 and rounded once, so a scaled table equals transformers' within float32
rounding; `tests/base/test_rope.py` checks each against transformers' own functions.
"""

from __future__ import annotations

import math

import torch

from strata.config.schema import ModelConfig


def _base_frequencies(theta: float, dim: int) -> torch.Tensor:
    # on the CPU even under a meta-device context (parallelize's): arange on meta goes through
    # torch's reference implementations, which import torch._dynamo (~0.8 s of start-up)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))


def _llama3(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`: wavelengths longer than original/low_freq_factor
    are divided by rope_factor, shorter than original/high_freq_factor kept, those between
    interpolated smoothly."""
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def _dynamic_theta(cfg: ModelConfig, length: int) -> float:
    """transformers' `_compute_dynamic_ntk_parameters` for a sequence of `length` tokens: the base
    grows once the sequence is longer than the original context."""
    dim, factor, original = (
        cfg.head_size,
        cfg.rope_factor,
        cfg.rope_original_max_position_embeddings,
    )
    length = max(length, original)
    return cfg.rope_theta * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))


def _yarn(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`: frequencies that turn fewer than beta_slow times
    over the original context are interpolated (divided by rope_factor), more than beta_fast times
    kept, a linear ramp between."""
    dim, factor = cfg.head_size, cfg.rope_factor
    original = cfg.rope_original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (
            2 * math.log(cfg.rope_theta)
        )

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers': no division by zero
    ramp = (
        (torch.arange(dim // 2, dtype=torch.float64, device=inv_freq.device) - low) / (high - low)
    ).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1.0 for every other scaling)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor is not None:
        return cfg.rope_attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return mscale(cfg.rope_factor, cfg.rope_mscale) / mscale(
            cfg.rope_factor, cfg.rope_mscale_all_dim
        )
    return mscale(cfg.rope_factor)


def dynamic_length(cfg: ModelConfig, length: int) -> int:
    """The sequence length whose dynamic NTK frequencies a sequence of `length` tokens uses: never
    less than the original context (below it the frequencies are the unscaled ones)."""
    return max(length, cfg.rope_original_max_position_embeddings)


def rope_frequencies(cfg: ModelConfig, length: int | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies (head_size/2,), float64: theta^(-2i/head_size), scaled as
    model.rope_scaling says; a dynamic NTK scaling's are those of a sequence of `length` tokens
    (default model.seq_len), as transformers recomputes them for each input's length."""
    kind = cfg.rope_scaling
    if kind == "dynamic":
        theta = _dynamic_theta(cfg, cfg.seq_len if length is None else length)
    else:
        theta = cfg.rope_theta
    inv_freq = _base_frequencies(theta, cfg.head_size)
    if kind == "llama3":
        return _llama3(cfg, inv_freq)
    if kind == "linear":
        return inv_freq / cfg.rope_factor
    if kind == "yarn":
        return _yarn(cfg, inv_freq)
    return inv_freq


def rope_tables(
    cfg: ModelConfig, length: int | None = None, sequence: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (length, head_size/2) for rotary position embedding (YaRN's
    attention factor included): `length` positions (default model.seq_len) at the frequencies of
    a sequence of `sequence` tokens (default model.seq_len; only dynamic NTK scaling depends on
    it)."""
    positions = torch.arange(
        cfg.seq_len if length is None else length, dtype=torch.float64, device="cpu"
    )
    angles = torch.outer(positions, rope_frequencies(cfg, sequence))
    scale = attention_factor(cfg)
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + head_dim/2]) of x: (batch, heads, seq, head_dim) by angle i; `cos`
    and `sin` are (seq, head_dim/2) tables, or (batch, seq, head_dim/2) rows per sequence.

    The rotate-half layout of Hugging Face's Llama family and Megatron-core's default (not Meta's
    original interleaved pairs (x[2i], x[2i+1])): their q/k weights then load as they are, with no
    per-head row permutation, the step a converter most often gets wrong."""
    x1, x2 = x.chunk(2, dim=-1)
    if cos.dim() == 3:  # (batch, seq, head_dim/2): each sequence's own positions (packed documents)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    else:
        cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
