"""The `model:` group: the shape of the decoder-only transformer (Llama-style: RoPE, RMSNorm, SwiGLU),
its RoPE scaling, and where its initial weights come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.config.schema.fields import nested, opt
from strata.config.vocabulary import ALL_LINEAR, LORA_TARGETS

ROPE_SCALINGS = ("none", "llama3", "linear", "dynamic", "yarn")
ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts feed-forward layers (num_experts 0: a dense model)."""

    num_experts: int = opt(
        0, "routed experts per MoE layer (0: dense feed-forward everywhere)", min=0
    )
    top_k: int = opt(2, "experts each token is routed to", min=1)
    expert_ffn: int | None = opt(
        None, "each expert's SwiGLU inner size (null: model.ffn_hidden's value)", min=1
    )
    first_dense_layers: int = opt(
        0,
        "the first this many blocks keep a dense feed-forward (DeepSeek's first_k_dense_replace)",
        min=0,
    )
    shared_experts: int = opt(
        0, "shared experts every token passes through besides its routed ones", min=0
    )
    shared_ffn: int | None = opt(
        None,
        "the shared experts' joint SwiGLU inner size (null: shared_experts · expert_ffn)",
        min=1,
    )
    shared_expert_gate: bool = opt(
        False, "scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE)"
    )
    router: str = opt(
        "softmax",
        "expert scores: softmax over all experts (Mixtral, Qwen3-MoE), or sigmoid per expert "
        "(DeepSeek-V3)",
        choices=ROUTERS,
    )
    norm_topk: bool = opt(True, "renormalise the chosen experts' scores to sum to one")
    routed_scale: float = opt(
        1.0,
        "multiply the routed experts' gate weights by this (DeepSeek's routed_scaling_factor)",
        min=0.0,
    )
    bias_update_rate: float = opt(
        0.0,
        "auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's selection "
        "bias moves by this "
        "toward balance (0: off; DeepSeek-V3 used 0.001)",
        min=0.0,
    )
    aux_loss_coef: float = opt(
        0.0,
        "weight of the load-balancing loss E·Σ f_e·P_e over each micro-batch (Switch; "
        "transformers')",
        min=0.0,
    )
    seq_aux_loss_coef: float = opt(
        0.0, "weight of DeepSeek-V3's sequence-wise balance loss", min=0.0
    )
    z_loss_coef: float = opt(
        0.0, "weight of the router z-loss mean(logsumexp(logits)²) (ST-MoE)", min=0.0
    )
    route_groups: int = opt(
        1,
        "experts split into this many equal groups, and each token's top_k chosen inside "
        "route_group_limit of them (DeepSeek-V3's n_group; a group's score is the sum of its two "
        "best experts'). With as many groups as the nodes an expert-parallel group spans this is "
        "node-limited routing: a token's experts on at most route_group_limit nodes (1: no group "
        "limit)",
        min=1,
    )
    route_group_limit: int = opt(
        1, "groups each token's experts may come from (DeepSeek-V3's topk_group)", min=1
    )
    capacity_factor: float | None = opt(
        None,
        "cap each expert at ceil(factor · tokens · top_k / num_experts) assignments per "
        "micro-batch and rank, "
        "dropping the lowest-weighted beyond it (null: dropless)",
        min=0.0,
        min_exclusive=True,
        # any factor from num_experts / top_k up drops nothing; far beyond, the count overflows
        max=1e6,
    )

    @property
    def enabled(self) -> bool:
        """Whether the model has MoE layers."""
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` (0-based) has the MoE feed-forward."""
        return self.enabled and index >= self.first_dense_layers

    def expert_ffn_size(self, model: ModelConfig) -> int:
        """One routed expert's SwiGLU inner width."""
        return self.expert_ffn or model.ffn_size

    def shared_ffn_size(self, model: ModelConfig) -> int:
        """The shared experts' joint inner width (0: none)."""
        if not self.shared_experts:
            return 0
        return self.shared_ffn or self.shared_experts * self.expert_ffn_size(model)


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the blocks' linear layers: every weight of the model is frozen
    and each targeted layer computes W x + (B A dropout(x))·alpha/rank, only A and B training
    (rank 0: off, every weight trains)."""

    rank: int = opt(
        0, "the adapters' rank r (PEFT's r; 0: no adapters, every weight trains)", min=0
    )
    alpha: float = opt(
        16.0,
        "the adapters' output is scaled by alpha/rank (PEFT's lora_alpha)",
        min=0.0,
        min_exclusive=True,
    )
    dropout: float = opt(
        0.0,
        "dropout on an adapter's input in training (PEFT's lora_dropout)",
        min=0.0,
        max=1.0,
        max_exclusive=True,
    )
    target_modules: tuple[str, ...] = opt(
        ("q_proj", "v_proj"),
        "the linear layers that get adapters, by the names PEFT uses for Llama: q_proj, k_proj, "
        "v_proj, o_proj (attention), gate_proj, up_proj, down_proj (the SwiGLU feed-forward, and "
        "in an MoE layer its shared experts'; the routed experts get none yet), or all-linear "
        "(all of them; never the output layer)",
        choices=(*LORA_TARGETS, ALL_LINEAR),
        min_items=1,
    )

    init_from: str | None = opt(
        None,
        "start the adapters from a PEFT adapter directory (adapter_config.json and "
        "adapter_model.safetensors: PEFT's save_pretrained, or `strata ckpt export --format "
        "peft`) instead of their initial values, on the base model of model.init_from; its r, "
        "lora_alpha and adapted layers must be this config's",
    )

    @property
    def enabled(self) -> bool:
        """Whether the model has adapters."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """What an adapter's output is multiplied by: alpha/rank."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer (Llama-style: RoPE, RMSNorm, SwiGLU)."""

    n_layers: int = opt(4, "number of transformer blocks", min=1)
    d_model: int = opt(128, "hidden size (width of the residual stream)", min=1)
    n_heads: int = opt(4, "attention heads; must divide d_model unless head_dim is set", min=1)
    n_kv_heads: int | None = opt(
        None, "key/value heads for grouped-query attention (null: = n_heads)", min=1
    )
    head_dim: int | None = opt(
        None,
        "size of each attention head (null: d_model/n_heads); n_heads·head_dim may differ "
        "from d_model",
        min=2,
    )
    qkv_bias: bool = opt(
        False, "bias on the query/key/value projections (Qwen2); the output projection has none"
    )
    qk_norm: bool = opt(
        False, "RMSNorm over each head's query and key before RoPE, one weight of head_dim (Qwen3)"
    )
    ffn_hidden: int | None = opt(
        None, "SwiGLU inner size (null: 8/3·d_model rounded up to a multiple of 32)", min=1
    )
    vocab_size: int | None = opt(
        None, "vocabulary size (null: the data's, padded to pad_vocab_multiple)", min=1
    )
    pad_vocab_multiple: int = opt(
        64, "pad a data-derived vocabulary up to a multiple of this", min=1
    )
    seq_len: int = opt(128, "tokens per training sequence (context length)", min=1)
    rope_theta: float = opt(10000.0, "RoPE base frequency", min=0.0, min_exclusive=True)
    rope_scaling: str = opt(
        "none",
        "RoPE frequency scaling, as transformers defines each: none; llama3 (Llama 3.1's); linear "
        "(positions divided by rope_factor); dynamic (NTK: the base grows with the sequence beyond "
        "rope_original_max_position_embeddings, recomputed for each input's length: in decoding, "
        "the sequence so far); yarn (YaRN: interpolated low frequencies, kept high ones, cos/sin "
        "scaled by the attention factor)",
        choices=ROPE_SCALINGS,
    )
    rope_factor: float = opt(
        8.0,
        "RoPE scaling factor (llama3, linear, dynamic, yarn): how much longer the context is",
        min=1.0,
    )
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
        8192,
        "llama3, yarn and dynamic RoPE scaling: the context length the model was pretrained with "
        "(dynamic: transformers' max_position_embeddings)",
        min=1,
    )
    rope_beta_fast: float = opt(
        32.0,
        "yarn RoPE scaling: rotations below which a frequency is interpolated",
        min=0.0,
        min_exclusive=True,
    )
    rope_beta_slow: float = opt(
        1.0,
        "yarn RoPE scaling: rotations above which a frequency is kept",
        min=0.0,
        min_exclusive=True,
    )
    rope_attention_factor: float | None = opt(
        None,
        "yarn RoPE scaling: the factor cos and sin are multiplied by (null: 0.1·ln(rope_factor)+1, "
        "or DeepSeek's ratio when rope_mscale and rope_mscale_all_dim are set)",
        min=0.0,
        min_exclusive=True,
    )
    rope_mscale: float | None = opt(
        None, "yarn RoPE scaling: DeepSeek's mscale (with rope_mscale_all_dim)"
    )
    rope_mscale_all_dim: float | None = opt(
        None, "yarn RoPE scaling: DeepSeek's mscale_all_dim (with rope_mscale)"
    )
    rope_truncate: bool = opt(
        True, "yarn RoPE scaling: round the correction range to whole dimensions"
    )
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", min=0.0, min_exclusive=True)
    tie_embeddings: bool = opt(False, "share the token embedding with the output projection")
    init_from: str | None = opt(
        None,
        "start a new run from these weights (the optimizer, data position and step start fresh): a "
        "local Hugging Face model directory (config.json + model.safetensors or shards; the other "
        "model keys are derived from its config.json, and one set to a different value is an "
        "error), or a Strata checkpoint",
    )
    moe: MoEConfig = nested(MoEConfig)
    lora: LoraConfig = nested(LoraConfig)
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
