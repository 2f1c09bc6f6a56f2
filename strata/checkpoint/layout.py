"""Matching a checkpoint to the model and optimizer loading it: the model's keys and global shapes
against the saved ones (every difference reported at once, before any state changes), and torch
optimizer state loaded with the saved hyper-parameters of each parameter group."""

from __future__ import annotations

from typing import Any

import torch


def listed(keys: list[str]) -> str:
    """Names for a one-line message: the first 8, and how many there are in all."""
    return ", ".join(keys[:8]) + (f" … ({len(keys)} in all)" if len(keys) > 8 else "")


def model_state_problems(
    expected: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]
) -> list[str]:
    """How a checkpoint's {name: global shape} differs from the model's: missing keys, unexpected
    keys, shape mismatches (each kind on one line, keys listed)."""

    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [
        f"{k} {tuple(saved[k])} (model: {tuple(expected[k])})"
        for k in expected
        if k in saved and tuple(saved[k]) != tuple(expected[k])
    ]
    return (
        ([f"missing keys: {listed(missing)}"] if missing else [])
        + ([f"unexpected keys: {listed(unexpected)}"] if unexpected else [])
        + ([f"shape mismatches: {listed(shapes)}"] if shapes else [])
    )


def optimizer_problems(
    optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]]
) -> list[str]:
    """Why the saved optimizer state does not fit `optimizer` (a different number of parameter
    groups), as messages; empty when it fits."""
    if len(saved_groups) != len(optimizer.param_groups):
        return [
            f"the checkpoint has {len(saved_groups)} optimizer parameter groups, this optimizer "
            f"{len(optimizer.param_groups)}"
        ]
    return []


def load_optimizer(
    optimizer: torch.optim.Optimizer,
    state: dict[int, dict[str, Any]],
    saved_groups: list[dict[str, Any]],
) -> None:
    """Load per-index state with the saved hyper-parameters of each parameter group (checked
    with `optimizer_problems` first; the saved groups' `params` name parameters, not indices)."""
    sd = optimizer.state_dict()
    groups = [
        {**saved, "params": g["params"]} for saved, g in zip(saved_groups, sd["param_groups"])
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's hyper-parameters (lr, betas, weight decay, ...), without its `params`:
    what a checkpoint saves beside the per-parameter state."""
    return [
        {k: v for k, v in g.items() if k != "params"}
        for g in optimizer.state_dict()["param_groups"]
    ]
