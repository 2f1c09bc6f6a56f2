"""Blended sources (`data.sources`), as Megatron's blended dataset: several prepared directories
in one stream, `blend` giving each global sample to the source furthest behind its share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from strata.data.tokenize import tokenizer_problem
from strata.data.tokens import Batch, TokenDataset, TokenMeta, read_meta
from strata.errors import ConfigError, DataError

if TYPE_CHECKING:
    from strata.config.schema import DataConfig


def normalise(weights: Sequence[float]) -> list[float]:
    """Weights as shares summing to 1, computed as Megatron's `normalize` does (float64 w / sum)."""
    w = np.asarray(weights, dtype=np.float64)
    shares: list[float] = (w / np.sum(w)).tolist()
    return shares


def blend(
    shares: Sequence[float], size: int, start: int = 0, counts: Sequence[int] | None = None
) -> tuple[list[int], list[int], list[int]]:
    """Megatron's `build_blending_indices` from global sample `start` on, `counts[j]` samples having
    gone to source j before it: for each of the next `size` samples, the source j with the largest
    shares[j]·max(i, 1) − counts[j] (the first on a tie), and that source's count before it (the
    sample's position within the source). Returns (sources, positions, counts after).

    The arithmetic is Megatron's, operation for operation (Python floats are doubles), so the
    sequence is the one its compiled helper gives, ties included."""
    counts = [0] * len(shares) if counts is None else list(counts)
    shares = [float(w) for w in shares]
    sources, positions = [], []
    for i in range(start, start + size):
        x = max(float(i), 1.0)
        best, best_err = 0, shares[0] * x - counts[0]
        for j in range(1, len(shares)):
            err = shares[j] * x - counts[j]
            if err > best_err:
                best, best_err = j, err
        sources.append(best)
        positions.append(counts[best])
        counts[best] += 1
    return sources, positions, counts


def content_id(data_dir: Path) -> str:
    """A prepared directory's identity that survives moving it: its meta.json's SHA-256 (which
    records the tokenizer, the token counts and the inputs), 16 hex digits."""
    return hashlib.sha256((Path(data_dir) / "meta.json").read_bytes()).hexdigest()[:16]


def _tokenizer_identity(meta: TokenMeta) -> str:
    """What the ids mean, as meta.json records it: bytes, the tokenizer.json's digest, or "unknown"."""
    recorded = meta.raw.get("tokenizer")
    if recorded == "byte":
        return "bytes"
    if not isinstance(recorded, dict):
        return recorded if isinstance(recorded, str) else "unknown"
    kind = recorded.get("kind", "unknown")
    if kind == "bytes":
        return "bytes"
    sha = recorded.get("sha256")
    return (
        f"{kind} (tokenizer.json sha256 {sha[:12]})"
        if isinstance(sha, str)
        else f"{kind} {recorded.get('source')}"
    )


def describe_sources(sources: list[dict]) -> str:
    """A state's source signatures in words, for messages."""
    return "; ".join(
        f"{s.get('path')} (weight {s.get('weight', 0):.4g}, {s.get('n_samples')} samples, id "
        f"{s.get('id')})"
        for s in sources
    )


class Mixture:
    """One split of several sources blended by weight: what the model and evaluation see as a
    dataset. `batch` takes global blended indices: sample i is window positions[i] (wrapped) of
    source sources[i], in each source's own order without shuffling, so evaluation reads the first
    windows of every source's val split in the training proportions."""

    def __init__(
        self,
        datasets: list[TokenDataset],
        weights: Sequence[float],
        names: list[str],
        ids: list[str],
    ):
        self.datasets, self.names, self.ids = datasets, names, ids
        self.weights = [float(w) for w in weights]
        self.shares = normalise(weights)
        self.seq_len = datasets[0].seq_len
        self.vocab_size = datasets[0].vocab_size
        self._sources: list[int] = []
        self._positions: list[int] = []

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def signature(self) -> list[dict]:
        """What a saved data position must agree with: each source's path (for messages: a moved
        directory is the same source), content id, normalised weight and sample count, in order."""
        return [
            {"path": name, "id": ident, "weight": share, "n_samples": len(d)}
            for name, ident, share, d in zip(self.names, self.ids, self.shares, self.datasets)
        ]

    @property
    def has_mask(self) -> bool:
        """Whether the batches carry a loss mask: when any source is conversations (the rows of
        the others then have every target trained), so every step of a run takes one path."""
        return any(d.has_mask for d in self.datasets)

    def window_of(self, source: int, position: int) -> np.ndarray:
        """Window `position` (seq_len + 1 tokens) of source `source`."""
        return self.datasets[source].window(position)

    def rows(self, pairs: Sequence[tuple[int, int]]) -> Batch:
        """The `Batch` of windows given as (source, position) pairs, with the loss mask of each
        row's source where the mixture has one."""
        import torch

        stacked = torch.from_numpy(np.stack([self.window_of(j, i) for j, i in pairs]))
        mask = None
        if self.has_mask:
            masks = [self.datasets[j].loss_mask(i)[1:] for j, i in pairs]
            mask = torch.from_numpy(np.stack(masks))
        return Batch(stacked[:, :-1], stacked[:, 1:], mask)

    def batch(self, indices: Iterable[int]) -> Batch:
        """The `Batch` of the blended samples `indices`."""
        indices = list(indices)
        need = max(indices) + 1
        if need > len(self._sources):  # the blend of samples 0..need-1, kept for later evaluations
            self._sources, self._positions, _ = blend(self.shares, need)
        return self.rows(
            [
                (self._sources[i], self._positions[i] % len(self.datasets[self._sources[i]]))
                for i in indices
            ]
        )


def open_mixture(
    data: DataConfig, seq_len: int, model_vocab: int | None = None
) -> tuple[Mixture, Mixture]:
    """The train and val splits of data.sources, after checking every source as `data.path` is
    checked, and that all of them share one vocabulary and tokenizer (their ids mean the same
    tokens). One DataError or ConfigError naming the sources that disagree."""
    sources = data.sources or ()
    names = [s.path for s in sources]
    keys = [f"data.sources[{i}].path" for i in range(len(names))]
    metas = [read_meta(Path(name), key) for name, key in zip(names, keys)]
    first = metas[0]
    for i, meta in enumerate(metas[1:], 1):
        a, b = _tokenizer_identity(first), _tokenizer_identity(meta)
        if meta.vocab_size != first.vocab_size or (a != b and "unknown" not in (a, b)):
            raise DataError(
                f"{keys[i]}={names[i]!r} was prepared with another vocabulary than "
                f"{keys[0]}={names[0]!r}: {names[0]} has vocab_size={first.vocab_size}, tokenizer "
                f"{a}; {names[i]} has vocab_size={meta.vocab_size}, tokenizer {b}; prepare every "
                "source with the same --tokenizer (`strata data prepare`)"
            )
    problems = []
    if data.tokenizer is not None:
        for name, meta in zip(names, metas):
            problem = tokenizer_problem(data.tokenizer, meta.raw, Path(name))
            if problem:
                problems.append(problem)
    if model_vocab and model_vocab < first.vocab_size:
        problems.append(
            f"model.vocab_size={model_vocab} is smaller than the data's vocabulary: data.sources "
            "say "
            f"vocab_size={first.vocab_size} (tokenizer {first.tokenizer}); set model.vocab_size >= "
            f"{first.vocab_size} or leave it null"
        )
    if problems:
        raise ConfigError(problems)
    ids = [content_id(Path(name)) for name in names]
    weights = [s.weight for s in sources]
    splits = (
        Mixture(
            [TokenDataset(Path(n), split, seq_len, k) for n, k in zip(names, keys)],
            weights,
            names,
            ids,
        )
        for split in ("train", "val")
    )
    train, val = splits
    return train, val
