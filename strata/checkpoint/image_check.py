"""The checks a checkpoint's staged image passes before it is written, made by the writer process of
an asynchronous save on the CPU: every floating-point element finite, and the largest magnitude of
the tensors a bound names (the parameters, for `checkpoint.max_abs_weight`).

Made there, after `save()` has returned, the checks cost training nothing: on a CPU they read the
state once more, about a fifth of the copy that is the whole of a save's stall. The writer refuses
a failing image before it writes a byte, and the trainer learns of it at its next step
(`CheckpointManager.poll`). A synchronous save, and a save staged from a GPU (checked there, on the
device), check as they copy (`stage`).

NumPy only, like the writer: float32, float64 and float16 are read as they are, bfloat16 widened to
float32 chunk by chunk; an image holding another floating-point type (float8) is checked as it is
staged instead (`checkable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CHUNK = 1 << 20  # elements read at a time: 4 MiB of float32 stays in cache for the checks

_NUMPY = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
CHECKABLE = frozenset({*_NUMPY, "bfloat16"})


@dataclass(frozen=True)
class Span:
    """One floating-point tensor box in the image: `numel` elements of `dtype` (a checkpoint
    index's dtype name) at byte `offset`; `bounded` if its magnitude counts against the limit."""

    offset: int
    numel: int
    dtype: str
    bounded: bool


@dataclass(frozen=True)
class Screen:
    """What the writer checks before it writes: the spans, and the limit on the bounded spans'
    magnitude (0: none)."""

    spans: tuple[Span, ...]
    limit: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """An image's check: every element finite, and the bounded spans' largest magnitude (0.0 where
    none is bounded or an element is not finite)."""

    finite: bool
    largest: float

    def passes(self, limit: float) -> bool:
        """Whether an image with this verdict may be written under `limit` (0: no limit)."""
        return self.finite and not (limit and self.largest > limit)


def checkable(dtypes: Sequence[str]) -> bool:
    """Whether the writer can check tensors of these (floating-point) dtypes."""
    return all(d in CHECKABLE for d in dtypes)


def check(image: memoryview, spans: Sequence[Span]) -> Verdict:
    """Read every span of `image` once, chunk by chunk."""
    largest = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for span in spans:
            for chunk in _chunks(image, span):
                if span.bounded:
                    low, high = float(chunk.min()), float(chunk.max())  # NaN propagates
                    if not (np.isfinite(low) and np.isfinite(high)):
                        return Verdict(False, 0.0)
                    largest = max(largest, -low, high)
                # a sum of finite elements is finite unless it overflows: then the exact check
                elif not np.isfinite(chunk.sum()) and not np.isfinite(chunk).all():
                    return Verdict(False, 0.0)
    return Verdict(True, largest)


def _chunks(image: memoryview, span: Span):
    """The span's elements as NumPy arrays of at most CHUNK elements (bfloat16 widened)."""
    wide = span.dtype == "bfloat16"
    dtype = np.uint16 if wide else _NUMPY[span.dtype]
    size = np.dtype(dtype).itemsize
    for start in range(0, span.numel, CHUNK):
        n = min(CHUNK, span.numel - start)
        chunk = np.frombuffer(image, dtype, n, span.offset + start * size)
        if wide:  # bfloat16 is the high half of a float32
            chunk = (chunk.astype(np.uint32) << 16).view(np.float32)
        yield chunk
