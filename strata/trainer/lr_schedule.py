"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay to
`optim.min_lr_ratio` of the peak."""

from __future__ import annotations

import math

from strata.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr. A
    warm-up longer than the run is cut short to the run (the rate reaches lr at the last step, and
    never decays), so a short trial of a long config still learns instead of crawling at a tiny lr."""
    warmup = min(optim.warmup_steps, total_steps)
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    if optim.schedule == "constant":
        return optim.lr
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
    min_lr = optim.lr * optim.min_lr_ratio
    return min_lr + (optim.lr - min_lr) * shape
