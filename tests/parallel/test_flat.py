"""Flat-range-to-box mapping, checked by brute force: every element of a range is found, in order,
in exactly the boxes the mapping returns."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from strata.parallel.flat import range_to_boxes

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
    assert [(b.offsets, b.sizes) for b in boxes] == [
        ((0, 3), (1, 2)),
        ((1, 0), (2, 5)),
        ((3, 0), (1, 2)),
    ]
    assert range_to_boxes((4, 5), 5, 15)[0].sizes == (2, 5)  # aligned: one box of whole rows


def test_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        range_to_boxes((2, 2), 1, 5)
