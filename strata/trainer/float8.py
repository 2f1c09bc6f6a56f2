"""Float8 training (`train.precision: fp8`): the transformer blocks' linear layers multiply in float8
through torchao's float8 training (dynamic scaling, `train.fp8_recipe` tensorwise or rowwise), with bf16
autocast around them, as torchtitan trains in float8. Weights, gradients and optimizer state stay fp32:
only the matmuls' operands are cast (and scaled) on the way in, so the parameters, their names and
every checkpoint are those of a bf16 run, and a checkpoint resumes under either precision.

A plain `nn.Linear` inside a block becomes torchao's `Float8Linear` (the same Parameter objects, so the
ZeRO engine's flat buffers, tying and the checkpoint's names are untouched). Tensor parallelism's
layers keep their collectives and have their local product replaced by torchao's float8 matmul (the
autograd function `Float8Linear` runs); under `train.compile` that product is compiled on its own,
since those layers run eagerly inside a compiled block. Each rank scales what it holds: a
tensor-parallel shard's scale is its shard's, as torchao's layer would choose on a local weight.
The embedding, the output layer and layers whose dimensions are not multiples of 16 (float8
matmuls need them) stay in bf16.

Float8's products need FP8 tensor cores (compute capability 8.9 and newer: L4, L40S, H100, H200,
B200) and torchao; anything else is refused at start-up with the reason. `train.fp8_emulate` runs the
same casts and scales with the products in higher precision (torchao's emulation), on any device:
that is how the CPU tests check float8's numerics and composition.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from strata.config import TrainConfig
from strata.errors import ConfigError
from strata.model import named_blocks
from strata.parallel.tensor import ColumnParallelLinear, LocalMatmul, RowParallelLinear

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89), Hopper (sm_90) and newer
MIN_TORCH = (2, 11)  # torchao 0.18's float8 training


def _import_torchao() -> None:
    # torchao's import warns when its compiled kernels do not load (a CPU build of torch, another
    # CUDA), which float8 training does not use, and torch warns about how torchao registers an enum
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def float8_problems(train: TrainConfig, device: torch.device) -> list[str]:
    """Why this process cannot train with `train.precision=fp8` (empty: it can)."""
    if train.precision != "fp8":
        return []
    p: list[str] = []
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        p.append(
            f"train.precision=fp8 needs torch >= {'.'.join(map(str, MIN_TORCH))} (torchao's float8 "
            f"training); this is torch {torch.__version__}: upgrade torch, or use precision=bf16"
        )
    try:
        _import_torchao()
    except ImportError:
        p.append(
            "train.precision=fp8 needs torchao: pip install 'strata-train[fp8]' (torchao 0.18), "
            "or use precision=bf16"
        )
    if train.fp8_emulate:
        return p
    if device.type != "cuda":
        p.append(
            f"train.precision=fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: L4, L40S, H100, H200, B200); this process "
            "trains on "
            f"{device.type}: use precision=bf16 (train.fp8_emulate=true only checks fp8's "
            "numerics, slowly)"
        )
    else:
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            p.append(
                "train.precision=fp8 needs FP8 tensor cores (compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+); {torch.cuda.get_device_name(device)} "
                f"has {capability[0]}.{capability[1]}: use precision=bf16"
            )
    return p


def check_float8(train: TrainConfig, device: torch.device) -> None:
    """Raise a ConfigError naming every reason fp8 cannot run here."""
    problems = float8_problems(train, device)
    if problems:
        raise ConfigError(problems)


def float8_config(train: TrainConfig) -> Any:
    """torchao's `Float8LinearConfig` for the run's recipe (and emulation)."""
    _import_torchao()
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(train.fp8_recipe)
    return dataclasses.replace(config, emulate=train.fp8_emulate)


def float8_matmul(config: Any) -> LocalMatmul:
    """(x, weight, bias) -> x·weightᵀ + bias through torchao's float8 autograd function: the product
    torchao's `Float8Linear.forward` computes, for a weight the caller holds (a tensor-parallel shard)."""
    from torchao.float8 import LinearMMConfig, ScaledMMConfig
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    def gemm(g: Any) -> Any:
        return ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)

    mm_config = LinearMMConfig(
        gemm(config.gemm_config_output),
        gemm(config.gemm_config_grad_input),
        gemm(config.gemm_config_grad_weight),
    )

    def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # as Float8Linear: under CUDA autocast the input takes autocast's dtype first
        if torch.is_autocast_enabled("cuda"):
            x = x.to(torch.get_autocast_dtype("cuda"))
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)
        return y if bias is None else y + bias.to(y.dtype)

    return matmul


def _fits(weight: torch.Tensor) -> bool:
    """Float8 matmuls need both dimensions of the (local) weight to be multiples of 16."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def apply_float8(parts: list[nn.Module], train: TrainConfig, compile_matmul: bool = False) -> int:
    """Put float8 products into every transformer block's linear layers of `parts`, in place (before
    the ZeRO engine: the Parameter objects stay the same). Returns how many layers multiply in
    float8; the others (dimensions not multiples of 16) stay in bf16."""
    config = float8_config(train)
    from torchao.float8 import convert_to_float8_training

    local = float8_matmul(config)
    if compile_matmul:
        local = torch.compile(local)
    converted = 0

    def plain(module: nn.Module, _fqn: str) -> bool:
        nonlocal converted
        fits = type(module) is nn.Linear and _fits(module.weight)
        converted += fits
        return fits

    for part in parts:
        for _, block in named_blocks(part):
            for module in block.modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and _fits(
                    module.weight
                ):
                    module.matmul = local
                    converted += 1
            convert_to_float8_training(block, module_filter_fn=plain, config=config)
    return converted
