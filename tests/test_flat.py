"""Flat parameter buffers and flat-range-to-box mapping, checked by brute force: every element of
a range is found, in order, in exactly the boxes the mapping returns."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from parallel.flat import FlatBuffer, range_to_boxes

SHAPES = [(7,), (3, 5), (4, 1), (1, 6), (2, 3, 4), (3, 2, 2, 2), ()]


def flat_values_of_boxes(t: torch.Tensor, boxes) -> list[int]:
    return [v for box in boxes for v in t[box.index()].reshape(-1).tolist()]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_range_maps_to_boxes_that_hold_exactly_its_elements(shape):
    n = math.prod(shape)
    t = torch.arange(n).reshape(shape)
    for start, end in itertools.combinations_with_replacement(range(n + 1), 2):
        boxes = range_to_boxes(shape, start, end)
        assert flat_values_of_boxes(t, boxes) == list(range(start, end)), (start, end)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        assert all(all(s > 0 for s in b.sizes) for b in boxes)


def test_two_dimensional_ranges_are_at_most_three_boxes():
    boxes = range_to_boxes((4, 5), 3, 17)  # rest of row 0, rows 1-2, start of row 3
    assert [(b.offsets, b.sizes) for b in boxes] == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    assert range_to_boxes((4, 5), 5, 15)[0].sizes == (2, 5)  # aligned: one box of whole rows


def test_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        range_to_boxes((2, 2), 1, 5)


def _params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"p{i}", nn.Parameter(torch.randn(s, generator=gen))) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
def test_flat_buffer_keeps_values_and_makes_parameters_views(num_shards):
    named = _params([(3, 5), (7,), (2, 2, 3)])
    before = [p.detach().clone() for _, p in named]
    buf = FlatBuffer(named, num_shards)
    assert buf.numel == 15 + 7 + 12 and buf.data.numel() % num_shards == 0
    assert buf.data.numel() - buf.numel < num_shards  # padding only to even out the shards
    for (_, p), old in zip(named, before):
        assert torch.equal(p, old)
        assert p.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr()
    buf.data.mul_(2)  # a write through the buffer is seen by the parameters
    assert all(torch.equal(p, 2 * old) for (_, p), old in zip(named, before))
    assert all(buf.shard(i).numel() == buf.shard_numel for i in range(num_shards))


@pytest.mark.parametrize("num_shards", [2, 3, 5])
def test_shards_map_back_to_parameter_boxes(num_shards):
    random.seed(num_shards)
    shapes = [tuple(random.randint(1, 4) for _ in range(random.randint(1, 3))) for _ in range(5)]
    named = _params(shapes, seed=num_shards)
    originals = {n: p.detach().clone() for n, p in named}
    buf = FlatBuffer(named, num_shards)
    covered = {n: torch.zeros(p.shape, dtype=torch.int64) for n, p in named}
    for i in range(num_shards):
        start, end = buf.shard_range(i)
        pieces = buf.boxes(start, end)
        values = torch.cat([originals[n][box.index()].reshape(-1) for n, box in pieces]) if pieces else torch.empty(0)
        assert torch.equal(values, buf.shard(i)[:end - start])  # the shard's real elements, in order
        for n, box in pieces:
            covered[n][box.index()] += 1
    assert all(bool((c == 1).all()) for c in covered.values())  # every element in exactly one shard


def test_mixed_dtypes_are_refused():
    named = [("a", nn.Parameter(torch.zeros(2))), ("b", nn.Parameter(torch.zeros(2, dtype=torch.float64)))]
    with pytest.raises(ValueError, match="group parameters of one dtype and device"):
        FlatBuffer(named, 2)
