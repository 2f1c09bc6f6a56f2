"""Flat layouts: where a parameter sits in a ZeRO flat group (`Segment`), and how a flat range
of a tensor maps back to boxes of it, so a shard can be saved in the global layout (a box is
DCP's (offsets, sizes) chunk of one tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """A dense sub-block of a tensor: index ranges [offsets[d], offsets[d] + sizes[d])."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        """The box both cover, or None if they are disjoint."""
        lo = [max(a, b) for a, b in zip(self.offsets, other.offsets)]
        hi = [
            min(a + n, b + m)
            for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        ]
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi)))

    def shifted(self, by: tuple[int, ...]) -> Box:
        """This box inside a box at `by` (offsets added)."""
        return Box(tuple(o + b for o, b in zip(by, self.offsets)), self.sizes)


def range_to_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The row-major flat range [start, end) of a tensor of `shape` as boxes, in order. A range
    of a 2-D tensor is at most three (a partial row, whole rows, a partial row); in general at
    most 2·ndim − 1."""
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"range [{start}, {end}) outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [Box((start,), (end - start,))] if shape else [Box((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row  # rows the range touches

    def within(r: int, a: int, b: int) -> list[Box]:
        return [Box((r, *box.offsets), (1, *box.sizes)) for box in range_to_boxes(shape[1:], a, b)]

    if first == last:
        if end - start == row:
            return [Box((first, *[0] * (len(shape) - 1)), (1, *shape[1:]))]
        return within(first, start - first * row, end - first * row)
    boxes: list[Box] = []
    whole_from, whole_to = first, last + 1
    if start % row:
        boxes += within(first, start % row, row)
        whole_from = first + 1
    if end % row:
        whole_to = last
    if whole_to > whole_from:
        boxes.append(
            Box((whole_from, *[0] * (len(shape) - 1)), (whole_to - whole_from, *shape[1:]))
        )
    if end % row:
        boxes += within(last, 0, end % row)
    return boxes


@dataclass(frozen=True)
class Segment:
    """Where one parameter lives in a flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
