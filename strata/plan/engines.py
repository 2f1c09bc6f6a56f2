"""Which training program a step-time prediction is for. `strata plan` predicts Strata's own
trainer (`STRATA`); bench/plan_published.py predicts other frameworks' published runs, which
differ from Strata's trainer in what a Strata config cannot say: which collectives hide behind
compute, what their parameter gathers move, how attention and element-wise work run, and what
their selective checkpointing recomputes.

Strata's trainer runs tensor-parallel collectives between its matmuls (nothing hides them), gathers
its float32 ZeRO-sharded parameters after the update before the next step starts, fuses
element-wise work only under `train.compile`, and its selective recomputation redoes element-wise
work only. Megatron-LM with `--tp-comm-overlap` (userbuffers) and torchtitan's async TP split each
sequence-parallel all-gather and reduce-scatter into chunks pipelined with the GEMM that consumes
or produces them; Megatron's `--overlap-param-gather` issues the distributed optimizer's bf16
parameter all-gather in the next step's forward. Strata has no setting for either because its
trainer does neither; a planner setting would promise what the trainer does not do.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.config.schema import ModelConfig


@dataclass(frozen=True)
class Engine:
    """How the predicted program runs what its config does not say (see the module docstring)."""

    name: str
    # "fused": flash attention (no score matrix in memory); "unfused": the batch·heads·seq² score
    # matrix goes through memory (Megatron-LM before flash attention)
    attention: str = "fused"
    # tensor-parallel collectives chunked and pipelined with the block's GEMMs: only the first
    # chunk of each and what outlasts the GEMMs show
    tp_comm_overlap: bool = False
    # the parameter all-gather after a sharded update overlaps the next step's first forward
    param_gather_overlap: bool = False
    # bytes per parameter its gathers of sharded parameters move: Strata's ZeRO gathers its
    # float32 parameters; Megatron's distributed optimizer and FSDP2 with a bf16 parameter dtype
    # gather bf16 copies (gradients are reduced in float32 by all of them)
    param_bytes: int = 4
    # its element-wise work fused into few kernels (Megatron's fused kernels); None: as the
    # config's train.compile says (PyTorch eager runs each op as its own kernel)
    fused_elementwise: bool | None = None
    # the block's linear layers its selective checkpointing recomputes in backward (Strata's
    # recomputes element-wise work only; torchtitan's op-level policy every second matmul)
    selective_recompute: tuple[str, ...] = ()

    def fused(self, compiled: bool) -> bool:
        """Whether element-wise work runs fused, for a config with train.compile = `compiled`."""
        return compiled if self.fused_elementwise is None else self.fused_elementwise

    def recomputed_flops(self, m: ModelConfig, tp: int, index: int) -> float:
        """Forward FLOPs per token of layer `index`'s linear layers that selective checkpointing
        runs again in backward on one tensor-parallel rank (a dense layer's; an MoE layer's
        attention projections only)."""
        d, q, kv, f = m.d_model, m.n_heads * m.head_size, m.kv_heads * m.head_size, m.ffn_size
        sizes = {"wq": d * q, "wk": d * kv, "wv": d * kv, "wo": q * d}
        if not m.moe.is_moe_layer(index):
            sizes.update({"w1": d * f, "w3": d * f, "w2": f * d})
        return sum(2 * sizes.get(name, 0) / tp for name in self.selective_recompute)


STRATA = Engine("strata")
