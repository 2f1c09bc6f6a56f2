"""Sampling text from a model: a batch of prompts of any lengths, left-padded to one, run once
through the model to fill a `KVCache` (prefill), then one token per row per step, each step
attending to the cache, until every row has produced a stop id or `max_new_tokens` tokens.

The padding never shows: each row's positions start at 0 at its first real token and no query
attends to a padding slot, so a row's tokens are those its prompt would give alone (greedy
decoding equals transformers' `generate` on the exported model; tests/inference checks it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata.inference.sampling import Sampling, next_tokens
from strata.inference.source import extend_positions
from strata.kv_cache import KVCache
from strata.model import GPT

GREEDY = Sampling()


@dataclass
class Generation:
    """The new tokens of each prompt (a stop id included where one ended it), and the time taken."""

    tokens: list[list[int]]
    prefill_s: float
    decode_s: float

    @property
    def new_tokens(self) -> int:
        """How many tokens were generated over every prompt, stop ids included."""
        return sum(len(t) for t in self.tokens)


def generate(
    model: GPT,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    on_step: Callable[[list[int | None]], bool | None] | None = None,
) -> Generation:
    """Continue each prompt (token ids) with up to `max_new_tokens` tokens. `on_step` gets each
    step's token per row (None for a row already stopped), for streaming; it returns True to end
    the generation there (its caller's own stop rule, such as stop strings, ended every row)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    param = next(model.parameters())
    device, rows, longest = param.device, len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts])
    batch = torch.zeros(rows, longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, int(pad[i]) :] = torch.tensor(p)
    extend_positions(model, longest + max_new_tokens)
    cfg = model.cfg
    cache = KVCache(
        cfg.n_layers,
        pad,
        cfg.kv_heads,
        cfg.head_size,
        longest + max_new_tokens,
        param.dtype,
        device,
    )
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    out: list[list[int]] = [[] for _ in prompts]
    running = [True] * rows
    with torch.inference_mode():
        start = time.perf_counter()
        logits = model(batch.to(device), cache=cache)[:, -1]
        prefill = time.perf_counter() - start
        for step in range(max_new_tokens):
            chosen = next_tokens(logits, sampling, generator)
            ids = chosen.tolist()
            shown: list[int | None] = []
            for i, t in enumerate(ids):
                shown.append(t if running[i] else None)
                if running[i]:
                    out[i].append(t)
                    running[i] = t not in stop_ids
            ended = on_step is not None and on_step(shown)
            if ended or not any(running) or step + 1 == max_new_tokens:
                break
            logits = model(chosen.unsqueeze(1), cache=cache)[:, -1]
    return Generation(out, prefill, time.perf_counter() - start - prefill)
