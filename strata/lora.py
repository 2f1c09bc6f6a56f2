"""Low-rank adapters (LoRA, `model.lora`) on a plain GPT's linear layers, and which parameters
train (`model.lora`, `train.freeze`), applied from outside the model as the parallel
transformations are.

An adapted layer keeps its own module and weight (so a base weight's name, initial value and
checkpoint key do not change) and gains two children, PEFT's: `lora_A` (rank × in) and `lora_B`
(out × rank), with `lora_dropout`. A forward hook adds their product to the layer's output,

    y = base(x) + lora_B(lora_A(dropout(x))) · alpha/rank,

so whatever the base module is (nn.Linear, a tensor-parallel shard) the adapter follows it; tensor
parallelism swaps `lora_A`/`lora_B` for sharded ones (`strata.parallel.tensor`). The names are
PEFT's inside each module (`layers.3.attn.wq.lora_A.weight` is PEFT's
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`), and the initial values are
PEFT's: A kaiming-uniform, B zero (`strata.model.initial_value`), so step 0 computes exactly what
the base model does. `adapters_off` turns them off for a block (the reference model of DPO).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from strata.config.schema import Config, LoraConfig
from strata.config.vocabulary import LORA_TARGETS, frozen_by, lora_target_kinds
from strata.errors import ConfigError
from strata.model import GPT, SwiGLU, named_blocks
from strata.moe import MoE

ADAPTER_PARTS = ("lora_A", "lora_B")


def _add_low_rank(
    module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
) -> torch.Tensor:
    """The forward hook of an adapted layer: its output plus the adapter's."""
    if module.__dict__.get("lora_off"):
        return out
    a, b, dropout, scale = cast(tuple[nn.Module, nn.Module, nn.Module, float], adapter_of(module))
    return out + b(a(dropout(args[0]))) * scale


@contextlib.contextmanager
def adapters_off(parts: Iterable[nn.Module]) -> Iterator[None]:
    """Every adapter of `parts` adds nothing inside the block: the base model computes (PEFT's
    `disable_adapter`), the reference of preference training."""
    layers = [m for part in parts for m in part.modules() if adapter_of(m) is not None]
    for m in layers:
        m.__dict__["lora_off"] = True
    try:
        yield
    finally:
        for m in layers:
            m.__dict__.pop("lora_off", None)


def attach(
    module: nn.Module, lora_A: nn.Module, lora_B: nn.Module, dropout: nn.Module, scale: float
) -> None:
    """Give `module` the adapter (`lora_A`, `lora_B`, `lora_dropout` children; the hook that adds
    their product, times `scale`, to its output)."""
    module.lora_A, module.lora_B, module.lora_dropout = lora_A, lora_B, dropout
    # plain attributes, beside the children
    module.__dict__.update(lora_scale=scale, lora_hook=module.register_forward_hook(_add_low_rank))


def adapter_of(module: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, float] | None:
    """(lora_A, lora_B, lora_dropout, scale) of an adapted layer, or None."""
    if not hasattr(module, "lora_A"):
        return None
    parts = [cast(nn.Module, getattr(module, n)) for n in ("lora_A", "lora_B", "lora_dropout")]
    return parts[0], parts[1], parts[2], cast(float, module.lora_scale)


def add_adapter(linear: nn.Linear, lora: LoraConfig) -> None:
    """Adapt one linear layer (its A and B are filled where the model's parameters are)."""
    dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
    attach(
        linear,
        nn.Linear(linear.in_features, lora.rank, bias=False),
        nn.Linear(lora.rank, linear.out_features, bias=False),
        dropout,
        lora.scale,
    )


def adapted_layers(model: nn.Module, lora: LoraConfig) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every linear layer `lora.target_modules` names in a GPT's blocks: the
    attention's projections, the SwiGLU's, and an MoE layer's shared experts'."""
    out = []
    for key, block in named_blocks(model):
        for kind in lora_target_kinds(lora.target_modules):
            path = LORA_TARGETS[kind]
            owner, attr = path.split(".")
            parent = getattr(block, owner)
            if isinstance(parent, MoE):
                parent = parent.shared
                if parent is None:
                    continue
                path = f"mlp.shared.{attr}"
            elif owner == "mlp" and not isinstance(parent, SwiGLU):
                continue
            out.append((f"layers.{key}.{path}", getattr(parent, attr)))
    return out


def apply_lora(model: GPT, lora: LoraConfig) -> None:
    """Adapters on the layers `lora.target_modules` names (none when rank is 0)."""
    if not lora.enabled:
        return
    for _, linear in adapted_layers(model, lora):
        add_adapter(linear, lora)


def is_adapter(name: str) -> bool:
    """Whether parameter `name` belongs to an adapter."""
    return any(f".{part}." in name for part in ADAPTER_PARTS)


def trainable_names(model: nn.Module, cfg: Config) -> set[str]:
    """The names (every name of a tied one) of the parameters that train: with adapters only
    theirs, else all; in either case none that an item of train.freeze names. Refuses an item that
    names no parameter of the model, and a model with nothing left to train."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    unmatched = [item for item in cfg.train.freeze if not any(frozen_by(item, n) for n in names)]
    if unmatched:
        raise ConfigError(
            [
                f"train.freeze: {item!r} names no parameter of this model (e.g. "
                f"{', '.join(names[:3])}; `strata ckpt inspect` lists a checkpoint's)"
                for item in unmatched
            ]
        )
    lora = cfg.model.lora
    trains = {
        n
        for n in names
        if (is_adapter(n) or not lora.enabled)
        and not any(frozen_by(item, n) for item in cfg.train.freeze)
    }
    if not trains:
        raise ConfigError(
            [
                f"train.freeze: {list(cfg.train.freeze)} freezes every parameter the run would "
                "train; freeze fewer, or add adapters (model.lora.rank)"
            ]
        )
    return trains


def freeze(parts: Iterable[nn.Module], trainable: set[str]) -> None:
    """Set requires_grad on this rank's parameters: False for those not `trainable` (a tied weight
    trains only where every name of it does)."""
    for part in parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            if name not in trainable:
                p.requires_grad_(False)


def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its layer's weight, W + (B·A)·alpha/rank (PEFT's merge), and remove
    it: a plain model computing what the adapted one does (without dropout)."""
    for module in list(model.modules()):
        adapter = adapter_of(module)
        if adapter is None:
            continue
        a, b, _, scale = adapter
        weight, a_weight, b_weight = module.weight, a.weight, b.weight
        assert isinstance(weight, torch.Tensor) and isinstance(a_weight, torch.Tensor)
        assert isinstance(b_weight, torch.Tensor)
        with torch.no_grad():
            weight += merged_delta(a_weight, b_weight, scale).to(weight.dtype)
        cast(RemovableHandle, module.lora_hook).remove()
        for attr in ("lora_A", "lora_B", "lora_dropout", "lora_scale", "lora_hook"):
            delattr(module, attr)


def merged_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """What an adapter adds to its layer's weight: (B·A)·scale, in float32."""
    return (b.float() @ a.float()) * scale
