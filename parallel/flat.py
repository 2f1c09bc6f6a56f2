"""Flat parameter buffers, the unit a ZeRO-style engine partitions: a group of parameters (one
transformer block) packed into one contiguous tensor whose equal shards are what ranks own.
Also maps a shard's flat range back to boxes of the original tensors, so a shard can be saved in
the global layout (a box is DCP's (offsets, sizes) chunk of one tensor).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


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
        boxes.append(Box((whole_from, *[0] * (len(shape) - 1)), (whole_to - whole_from, *shape[1:])))
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


class FlatBuffer:
    """Parameters packed, in order, into one 1-D tensor padded to a multiple of `num_shards`;
    each parameter's `.data` becomes a view into it (so optimizers and modules see the same
    memory). Shard i is the flat range [i·S, (i+1)·S), S = padded size / num_shards."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], num_shards: int):
        if not named_params:
            raise ValueError("a flat buffer needs at least one parameter")
        first = named_params[0][1]
        self.segments: list[Segment] = []
        offset = 0
        for name, p in named_params:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(f"{name}: {p.dtype} on {p.device}, but the buffer holds {first.dtype} on "
                                 f"{first.device}; group parameters of one dtype and device")
            self.segments.append(Segment(name, tuple(p.shape), offset))
            offset += p.numel()
        self.numel, self.num_shards = offset, num_shards
        self.shard_numel = math.ceil(offset / num_shards)
        self.data = torch.zeros(self.shard_numel * num_shards, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for seg, (_, p) in zip(self.segments, named_params):
                view = self.data[seg.offset:seg.offset + seg.numel].view(seg.shape)
                view.copy_(p)
                p.data = view

    def shard_range(self, index: int) -> tuple[int, int]:
        """Shard `index`'s flat range, clipped to the real (unpadded) elements."""
        start = index * self.shard_numel
        return min(start, self.numel), min(start + self.shard_numel, self.numel)

    def shard(self, index: int) -> torch.Tensor:
        """Shard `index` as a view of the buffer, padding included (equal sizes for collectives)."""
        return self.data[index * self.shard_numel:(index + 1) * self.shard_numel]

    def boxes(self, start: int, end: int) -> list[tuple[str, Box]]:
        """The flat range [start, end) as (parameter name, box) pieces, in buffer order."""
        out = []
        for seg in self.segments:
            a, b = max(start, seg.offset), min(end, seg.offset + seg.numel)
            if a < b:
                out += [(seg.name, box) for box in range_to_boxes(seg.shape, a - seg.offset, b - seg.offset)]
        return out
