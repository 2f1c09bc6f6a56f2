"""Packing conversations into the fixed windows `strata data prepare` writes for chat data:
best-fit decreasing (TRL's `packing_strategy="bfd"`) over a bounded set of open windows, each
window written with its loss mask and its conversations' boundaries as it is closed."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import IO

import numpy as np


@dataclass
class Encoded:
    """A task's kept conversations of one split: their tokens and masks one after another (one
    array each, cheap to send between processes), and each conversation's length (its
    end-of-document token included)."""

    tokens: np.ndarray
    masks: np.ndarray
    lengths: list[int]

    @staticmethod
    def of(conversations: list[tuple[np.ndarray, np.ndarray]], dtype: str) -> Encoded:
        """The conversations' (ids, mask) pairs joined."""
        if not conversations:
            return Encoded(np.zeros(0, dtype), np.zeros(0, np.uint8), [])
        ids, masks = zip(*conversations)
        return Encoded(np.concatenate(ids), np.concatenate(masks), [len(i) for i in ids])


@dataclass
class _Window:
    """A window being filled: its tokens and mask, and each conversation's [start, end) in it."""

    tokens: np.ndarray
    mask: np.ndarray
    fill: int = 0
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class Packer:
    """Best-fit decreasing packing of one split's conversations into windows of `window` tokens
    (TRL's `packing_strategy="bfd"`): each task's conversations, longest first, each into the open
    window it fills best, else a new one. At most `open_windows` windows stay open; past that the
    fullest is written (tokens to SPLIT.bin, the mask to SPLIT.mask.bin, each conversation's
    [start, end) to SPLIT.docs.bin), so memory stays bounded and later tasks fill the gaps earlier
    ones left. A window's unused tail is `pad` with mask 0. With `pairs`, conversations come two by
    two (chosen, rejected) and a pair is placed whole, side by side, in one window."""

    def __init__(
        self,
        files: tuple[IO, IO, IO],
        window: int,
        pad: int,
        dtype: str,
        pairs: bool = False,
        open_windows: int | None = None,
    ):
        self.files, self.window, self.pad, self.group = files, window, pad, 2 if pairs else 1
        self.dtype = dtype
        # enough open windows to fill gaps well, at most ~16M tokens of them
        self.open_windows = open_windows or max(8, min(256, 2**24 // window))
        self.open: list[_Window] = []  # by free space, least first (ties: placed in first)
        self.free: list[int] = []  # their free space, in that order
        self.windows = self.conversations = self.trained = 0

    def add(self, part: Encoded) -> None:
        """Place a task's conversations (each group at most `window` tokens)."""
        starts = np.concatenate([[0], np.cumsum(part.lengths)]).astype(np.int64)
        groups = range(0, len(part.lengths), self.group)
        sizes = {k: int(starts[k + self.group] - starts[k]) for k in groups}
        for k in sorted(groups, key=lambda k: -sizes[k]):  # stable: input order among equals
            target = self._window_for(sizes[k])
            for j in range(k, k + self.group):
                a, b = int(starts[j]), int(starts[j + 1])
                n = b - a
                target.tokens[target.fill : target.fill + n] = part.tokens[a:b]
                target.mask[target.fill : target.fill + n] = part.masks[a:b]
                target.spans.append((target.fill, target.fill + n))
                target.fill += n
            self._reorder(target)
        self.conversations += len(part.lengths)
        self.trained += int(np.count_nonzero(part.masks))

    def _window_for(self, n: int) -> _Window:
        """The open window with the least free space that holds `n` tokens, else a new one (the
        fullest open window written first when too many are open)."""
        at = bisect.bisect_left(self.free, n)  # least free first: the first that fits fits best
        if at < len(self.open):
            del self.free[at]
            return self.open.pop(at)
        if len(self.open) >= self.open_windows:
            del self.free[0]
            self._write(self.open.pop(0))
        return _Window(np.full(self.window, self.pad, self.dtype), np.zeros(self.window, np.uint8))

    def _reorder(self, w: _Window) -> None:
        """Put `w` back among the open windows, kept by free space (a full one is written)."""
        if w.fill == self.window:
            self._write(w)
            return
        free = self.window - w.fill
        at = bisect.bisect_right(self.free, free)
        self.free.insert(at, free)
        self.open.insert(at, w)

    def _write(self, w: _Window) -> None:
        base = self.windows * self.window
        w.tokens.tofile(self.files[0])
        w.mask.tofile(self.files[1])
        np.asarray([(base + a, base + b) for a, b in w.spans], np.int64).reshape(-1, 2).tofile(
            self.files[2]
        )
        self.windows += 1

    def close(self) -> None:
        """Write the windows still open, fullest first."""
        for w in self.open:
            self._write(w)
        self.open, self.free = [], []
