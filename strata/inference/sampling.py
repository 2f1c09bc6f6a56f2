"""The next token from a model's logits: greedy, or sampled with temperature, top-k and top-p
(nucleus) applied in the order transformers' `generate` applies them, drawing from a seeded
generator so that one seed gives one output."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (the most likely token); otherwise the
    logits are divided by the temperature, cut to the `top_k` most likely tokens (0: all), then to
    the smallest set whose probability reaches `top_p` (1.0: all), and a token drawn."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def problems(self) -> list[str]:
        """What is wrong with the settings, one message per flag (empty when they can sample)."""
        p = []
        if self.temperature < 0:
            p.append(f"--temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            p.append(f"--top-k {self.top_k}: must be >= 0 (0 keeps every token)")
        if not 0.0 < self.top_p <= 1.0:
            p.append(f"--top-p {self.top_p}: must be in (0, 1]")
        return p


def next_tokens(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of `logits` (batch, vocab)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filtered_scores(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def filtered_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The logits (batch, vocab) in float32 divided by the temperature, −inf where top-k or top-p
    removes a token (transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)."""
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = scores.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores
