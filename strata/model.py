"""The decoder-only transformer (Llama-style: RoPE, RMSNorm, SwiGLU, causal SDPA; optionally
Qwen2's q/k/v biases, Qwen3's per-head q/k norms, RoPE scalings from strata.rope), as plain torch
modules with no parallel code inside. Parallelism is applied to it from outside (parallel/).

Attention reads its head count from its weight shapes, not from the config, so a tensor-parallel
transformation can swap its linears for sharded ones without touching this file.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from strata.config.schema import ModelConfig
from strata.config.vocabulary import padded_vocab_size
from strata.kv_cache import KVCache
from strata.moe import MoE
from strata.rope import apply_rope, dynamic_length, rope_tables


def ffn_hidden_size(cfg: ModelConfig) -> int:
    """SwiGLU inner width: Llama's 2/3 · 4·d rounded up to a multiple of 32, unless set."""
    return cfg.ffn_size


class RMSNorm(nn.Module):
    """Root-mean-square normalisation of the last dimension, with a learned scale (`weight`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@dataclass(frozen=True)
class Documents:
    """The documents packed into a micro-batch: `ids` (batch, seq), which document each token of the
    whole sequence belongs to (an end-of-document token ends its own), for attention inside each
    (`data.document_mask`; None: plain causal attention); `positions` (batch, this rank's tokens),
    each token's rotary position counted from the start of its document (`data.reset_positions`;
    None: the sequence's own positions)."""

    ids: torch.Tensor | None
    positions: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """(batch, 1, seq, seq) bool, True where a query may attend: causal and inside its document."""
        assert self.ids is not None
        seq = self.ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=self.ids.device).tril()
        return (causal & (self.ids.unsqueeze(2) == self.ids.unsqueeze(1))).unsqueeze(1)

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables (positions, ...) at each token's position: the rows of its position in
        its document when positions restart per document, else the tables as they are."""
        if self.positions is None:
            return cos, sin
        return cos[self.positions], sin[self.positions]


def documents_of(tokens: torch.Tensor, eot: int, mask: bool, reset_positions: bool) -> Documents:
    """The `Documents` of input tokens (batch, seq) whose documents end with token `eot`; the
    positions are the whole sequence's (context parallelism cuts them to a rank's tokens)."""
    ends = tokens == eot
    ids = ends.long().cumsum(dim=1) - ends.long()  # the end token belongs to the document it ends
    positions = None
    if reset_positions:
        index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        starts = torch.where(
            ids != F.pad(ids, (1, 0), value=-1)[:, :-1], index, torch.zeros_like(index)
        )
        positions = index - starts.cummax(dim=1).values
    return Documents(ids if mask else None, positions)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
) -> torch.Tensor:
    """Causal SDPA over (batch, heads, seq, head_dim), grouped-query K/V allowed, inside each
    packed document when `documents` says where they are: what an `Attention` attends with unless
    context parallelism gives it a function that attends across the ranks a sequence is split over
    (`strata.parallel.context`)."""
    gqa = q.shape[1] != k.shape[1]
    if documents is None or documents.ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.mask(), enable_gqa=gqa)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped-query heads (`kv_heads` shared by
    `n_heads`): q/k/v projections (optional bias), optional per-head q/k RMSNorm, SDPA, output projection.
    Given a `KVCache` (decoding), it attends to the cached keys and values of the tokens before as well."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.head_dim, self.layer = cfg.head_size, layer
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        # One weight of head_dim shared by every head (Qwen3), so tensor parallelism replicates it.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.attend: Callable[..., torch.Tensor] = causal_attention

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        q = self.wq(x)
        b, s, _ = q.shape  # from q, not x: a sequence-parallel x may hold only part of the sequence
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = self.attend(q, k, v, documents)
        else:
            k, v = cache.update(self.layer, k, v)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=cache.mask(), enable_gqa=q.shape[1] != k.shape[1]
            )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    """The feed-forward layer: w2(silu(w1 x) * w3 x), gate and up projections to `ffn_hidden_size`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = ffn_hidden_size(cfg)
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm transformer block: x + attention(norm(x)), then + feed-forward(norm(x)): SwiGLU,
    or the Mixture-of-Experts layer (`strata.moe`) in the blocks `model.moe` makes sparse."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, index)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg) if cfg.moe.is_moe_layer(index) else SwiGLU(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, documents, cache)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); with a `KVCache`, the tokens after those
    it holds (decoding: the rotary positions and the mask are the cache's)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        # Given its weight, the embedding skips its own init, whose normal_ on the meta device
        # (where parallelize builds the model) imports torch._dynamo, as rope_frequencies explains.
        # Every user of the model fills the weights itself (init_weights, materialize, a
        # checkpoint).
        self.tok_embeddings = nn.Embedding(
            vocab_size, cfg.d_model, _weight=torch.empty(vocab_size, cfg.d_model)
        )
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.rope_rows_cut = (
            False  # the tables hold a context-parallel rank's rows (set_rope_buffers)
        )

    def forward(
        self, tokens: torch.Tensor, documents: Documents | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        cos, sin = self.rotary_tables(tokens.shape[1], cache)
        if cache is not None:
            documents = Documents(None, cache.begin(tokens.shape[1]))
        if documents is not None:
            cos, sin = documents.rotary(cos, sin)
        for layer in self.layers:
            x = layer(x, cos, sin, documents, cache)
        if cache is not None:
            cache.end(tokens.shape[1])
        return self.output(self.norm(x))

    def rotary_tables(
        self, n: int, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables of a pass over `n` tokens (after those `cache` holds): the buffers,
        unless a dynamic NTK scaling's frequencies are those of another length than model.seq_len.
        As transformers', that length is the sequence's so far: the pass's tokens, or in decoding
        the real tokens of the longest row, cached ones included."""
        cos, sin = cast(torch.Tensor, self.rope_cos), cast(torch.Tensor, self.rope_sin)
        cfg = self.cfg
        if cfg.rope_scaling != "dynamic" or self.rope_rows_cut:
            return cos, sin
        length = n if cache is None else cache.longest(n)
        if dynamic_length(cfg, length) == dynamic_length(cfg, cfg.seq_len):
            return cos, sin
        device = cos.device
        cos, sin = rope_tables(cfg, max(length, n), length)
        return cos.to(device), sin.to(device)

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed` (see `initial_value`)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(initial_value(self.cfg, name, tuple(p.shape), seed))


def named_blocks(part: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks of a GPT, or of a pipeline stage (whose `layers` is an nn.ModuleDict
    keyed by the block's index in the whole model), with those keys, in forward order."""
    layers = part.layers
    keyed = (
        layers.items()
        if isinstance(layers, nn.ModuleDict)
        else enumerate(cast(nn.ModuleList, layers))
    )
    return [(str(key), block) for key, block in keyed]


def moe_layers(part: nn.Module) -> list[tuple[int, MoE]]:
    """(layer index in the whole model, layer) of every MoE feed-forward in a model or pipeline stage."""
    return [
        (int(key), block.mlp) for key, block in named_blocks(part) if isinstance(block.mlp, MoE)
    ]


def set_rope_buffers(
    module: nn.Module, cfg: ModelConfig, device: torch.device, positions: torch.Tensor | None = None
) -> None:
    """Set `module`'s rope_cos/rope_sin buffers to the tables for cfg, on `device`: their rows at
    `positions` when given (the tokens a context-parallel rank holds, in its order)."""
    cos, sin = rope_tables(cfg)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    module.rope_cos, module.rope_sin = cos.to(device), sin.to(device)
    # cut rows are no longer indexed by position: a dynamic NTK scaling keeps those of seq_len,
    # the length of every training sequence
    module.rope_rows_cut = positions is not None  # type: ignore[assignment]


def initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial value of parameter `name` (its whole, unsharded tensor): normal(0, init_std)
    for matrices, with residual output projections (wo, w2) scaled by 1/sqrt(2·n_layers) as in
    GPT-2/Megatron; biases to zero; norms to one; an MoE layer's experts (stacked 3-D weights) like
    the dense layer's; LoRA adapters as PEFT's (A uniform in ±1/√fan_in, B zero). Each parameter
    draws from its own generator, seeded by the run seed and its name, so any rank can build any
    parameter (or slice) without the others — the value never depends on which parameters a rank
    holds."""
    if name.endswith((".bias", ".lora_B.weight")):  # an adapter starts at zero: the base model
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    if cfg.tie_embeddings and name == "output.weight":
        name = "tok_embeddings.weight"  # one tensor under two names
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    if name.endswith(".lora_A.weight"):  # PEFT's kaiming_uniform_(a=√5): U(±1/√fan_in)
        bound = 1 / math.sqrt(shape[-1])
        return torch.rand(shape, generator=gen, dtype=torch.float32).mul_(2 * bound).sub_(bound)
    scaled = name.endswith(
        ("attn.wo.weight", "mlp.w2.weight", "mlp.experts.w2", "mlp.shared.w2.weight")
    )
    std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if scaled else cfg.init_std
    return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std)


def build_model(cfg: ModelConfig, data_vocab_size: int, seed: int) -> GPT:
    """The plain GPT for `cfg` (vocabulary: the config's, else the data's padded up), with initial
    values seeded by `seed` and each parameter's name."""
    model = GPT(cfg, padded_vocab_size(cfg, data_vocab_size))
    model.init_weights(seed)
    return model


IGNORE_INDEX = -100  # a target trained on nothing (torch's and transformers' ignore_index)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in fp32: the mean over the targets, or their sum (`reduction`
    "sum"), or each target's (`reduction` "none": flat, 0 at IGNORE_INDEX); a target of
    IGNORE_INDEX counts for nothing."""
    return F.cross_entropy(
        logits.float().flatten(0, 1),
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def count_params(cfg: ModelConfig, vocab_size: int, active: bool = False) -> int:
    """Parameters of the model built from cfg with this (padded) vocabulary; `active`: those one
    token passes through (an MoE layer's top_k routed experts, not all of them)."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    attention = 2 * d * q + 2 * d * kv + 2 * d
    if cfg.qkv_bias:
        attention += q + 2 * kv
    if cfg.qk_norm:
        attention += 2 * cfg.head_size
    embed = vocab_size * d * (1 if cfg.tie_embeddings else 2)
    ffn = [
        moe_ffn_params(cfg, active) if cfg.moe.is_moe_layer(i) else 3 * d * ffn_hidden_size(cfg)
        for i in range(cfg.n_layers)
    ]
    return cfg.n_layers * attention + sum(ffn) + embed + d


def moe_ffn_params(cfg: ModelConfig, active: bool = False) -> int:
    """Parameters of one MoE feed-forward: router, routed experts (`active`: top_k of them), shared
    experts and their gate."""
    moe, d = cfg.moe, cfg.d_model
    routed = (moe.top_k if active else moe.num_experts) * 3 * d * moe.expert_ffn_size(cfg)
    shared = 3 * d * moe.shared_ffn_size(cfg) + (
        d if moe.shared_experts and moe.shared_expert_gate else 0
    )
    return moe.num_experts * d + routed + shared


def flops_per_token(cfg: ModelConfig, vocab_size: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), counting matmuls only.

    Forward matmul FLOPs per token: 2·(weights touched) for every linear including the output
    projection (the embedding lookup is free; an MoE layer touches its router, top_k routed experts
    and the shared ones), plus attention scores and weighted sum: 2·2·s·q per layer for full
    (non-causal-skipping) attention, as Megatron's MFU formula counts it, where q =
    n_heads·head_size (d_model unless head_dim says otherwise). Biases and norms are not matmuls.
    """
    d, s, L = cfg.d_model, cfg.seq_len, cfg.n_layers
    q, kv = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    ffn = sum(
        moe_ffn_params(cfg, active=True)
        if cfg.moe.is_moe_layer(i)
        else 3 * d * ffn_hidden_size(cfg)
        for i in range(L)
    )
    linear = L * (2 * d * q + 2 * d * kv) + ffn + d * vocab_size
    attention = L * 2 * s * q
    return 3.0 * 2.0 * (linear + attention)
