"""The keys and values of the tokens a model has already seen, kept between its forward passes, so
that decoding attends to them without computing them again (sampling, `strata generate`).

A batch of prompts of different lengths is left-padded to one length: row b's first `pad[b]`
slots hold no token. Its real tokens take positions 0, 1, … after the padding (the rotary
positions of the prompt alone), and no query attends to a padding slot: the cache says both
(`positions`, `mask`). The buffers are allocated once for the longest sequence the decoding will
reach (prompt + new tokens), as transformers' static cache and gpt-fast's are; each forward pass
writes its tokens' keys and values after the ones before.
"""

from __future__ import annotations

import torch


class KVCache:
    """Every layer's keys and values (layer, batch, kv_heads, max_len, head_dim) of the tokens seen
    so far (`length` of them, the padding included), and the left padding of each row."""

    def __init__(
        self,
        n_layers: int,
        pad: torch.Tensor,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (n_layers, len(pad), kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pad = pad.to(device)
        self._least_pad = int(pad.min()) if len(pad) else 0
        self.max_len, self.length = max_len, 0
        self._mask: torch.Tensor | None = None  # of the forward pass under way (`begin`)

    def begin(self, n: int) -> torch.Tensor:
        """Start a forward pass over `n` more tokens per row: their rotary positions (batch, n); the
        pass's attention mask (`mask`: batch, 1, n, length + n) is True where a query may attend: the
        keys of real tokens up to itself. A padding slot's query attends only to itself (its output is never
        used, but a row with nothing to attend would be NaN, which a masked key would still carry
        into the real queries' sums)."""
        if self.length + n > self.max_len:
            raise ValueError(
                f"the cache holds {self.max_len} tokens per row; {self.length} + {n} do not fit"
            )
        at = torch.arange(self.length, self.length + n, device=self.pad.device)
        keys = torch.arange(self.length + n, device=self.pad.device)
        real = keys.unsqueeze(0) >= self.pad.unsqueeze(1)  # (batch, keys)
        causal = keys.unsqueeze(0) <= at.unsqueeze(1)  # (n, keys)
        itself = keys.unsqueeze(0) == at.unsqueeze(1)
        self._mask = ((real.unsqueeze(1) & causal) | itself).unsqueeze(1)
        return (at.unsqueeze(0) - self.pad.unsqueeze(1)).clamp(min=0)

    def longest(self, n: int) -> int:
        """How many real tokens the longest row holds once a pass adds `n` more to each."""
        return self.length + n - self._least_pad

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s keys and values of this pass's tokens (batch, kv_heads, n, head_dim);
        returns all of the layer's so far (batch, kv_heads, length + n, head_dim)."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def mask(self) -> torch.Tensor:
        """The attention mask of the pass under way (see `begin`)."""
        assert self._mask is not None, "KVCache.begin comes before the layers"
        return self._mask

    def end(self, n: int) -> None:
        """The pass over `n` tokens is done: they are part of what later passes attend to."""
        self.length += n
        self._mask = None
