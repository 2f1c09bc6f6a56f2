"""Strata's MoE feed-forward (`strata.moe.MoE`) against transformers' Qwen3-MoE sparse block on the
same weights, sizes and tokens: forward + backward time of one layer, in one process.

Both layers route by softmax top-k with renormalised weights and run SwiGLU experts; the outputs are
checked equal first. transformers' block loops over the experts that received tokens, gathering each
one's tokens with `torch.where` on a one-hot mask; Strata sorts the token copies by expert once and
runs every expert in one grouped matmul (`torch._grouped_mm`; `--experts loop` runs Strata's
per-expert loop instead). The figure is the median of `--reps` timed passes of each, interleaved, as
a ratio Strata / transformers (below 1.0: Strata is faster); beside it, the expert products alone
(the same token counts through the same expert weights, forward and backward) by grouped matmul
against the per-expert loop.

    python bench/moe_layer.py                       # CPU: d_model 512, 8 experts, top-2, 4096 tokens
    python bench/moe_layer.py --experts loop        # Strata's per-expert loop instead of grouped matmul
    python bench/moe_layer.py --device cuda --dtype bf16 --tokens 16384 --experts-n 64 --top-k 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from strata.config import ModelConfig, MoEConfig
from strata.moe import MoE


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = ModelConfig(
        d_model=args.d_model,
        n_heads=8,
        moe=MoEConfig(
            num_experts=args.experts_n, top_k=args.top_k, expert_ffn=args.ffn, norm_topk=True
        ),
    )
    torch.manual_seed(0)
    ours = MoE(cfg)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.05)
    hf = Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(
            hidden_size=args.d_model,
            moe_intermediate_size=args.ffn,
            num_experts=args.experts_n,
            num_experts_per_tok=args.top_k,
            norm_topk_prob=True,
        )
    )
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
        hf.experts.down_proj.copy_(ours.experts.w2)
    return ours.to(device, dtype), hf.to(device, dtype)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024, help="each expert's SwiGLU width")
    parser.add_argument("--experts-n", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--experts", choices=("grouped", "loop"), default="grouped")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    device, dtype = (
        torch.device(args.device),
        {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype],
    )
    ours, hf = build(args, device, dtype)
    if args.experts == "loop":
        ours.experts.forward = ours.experts.loop  # type: ignore[method-assign]
    x = torch.randn(1, args.tokens, args.d_model, device=device, dtype=dtype)
    with torch.no_grad():
        diff = (ours(x) - hf(x)).abs().max().item()
    routing = ours.router(x.view(-1, args.d_model))
    counts = torch.bincount(routing.experts.flatten(), minlength=args.experts_n)
    sorted_x = (
        x.view(-1, args.d_model)[routing.experts.flatten().argsort() // args.top_k]
        .detach()
        .requires_grad_()
    )

    def step(layer):
        def run():
            layer.zero_grad(set_to_none=True)
            layer(x).float().square().mean().backward()

        return run

    def experts_only(forward):
        def run():
            ours.zero_grad(set_to_none=True)
            sorted_x.grad = None
            forward(sorted_x, counts).float().square().mean().backward()

        return run

    runs = {
        "strata": step(ours),
        "transformers": step(hf),
        "strata experts": experts_only(ours.experts),
        "loop experts": experts_only(ours.experts.loop),
    }
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, fn in runs.items():
            times[name].append(timed(fn, device))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"MoE layer fwd+bwd, {args.tokens} tokens, d_model {args.d_model}, {args.experts_n} experts of {args.ffn}, "
        f"top-{args.top_k}, {args.dtype} on {device.type} (Strata's experts: {args.experts}); "
        f"outputs differ by {diff:.1e}"
    )
    for name, t in med.items():
        print(f"  {name:>16}: {t * 1e3:8.1f} ms")
    ratio = med["strata"] / med["transformers"]
    print(f"step ratio Strata / transformers: {ratio:.2f} (goal <= 1.0)")
    grouped = med["strata experts"] / med["loop experts"]
    print(
        f"expert products alone (same token counts): grouped matmul / per-expert loop = {grouped:.2f}"
    )
    result = {
        "ms": {k: v * 1e3 for k, v in med.items()},
        "ratio": ratio,
        "grouped_over_loop": grouped,
        "diff": diff,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
