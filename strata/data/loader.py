"""The deterministic, resumable, data-parallel batch loaders (Megatron's consumed-samples scheme)
over one prepared dataset or a mixture of them (`MixtureLoader` reads each source in its own seeded
epoch order), and the fixed evaluation batches of a split.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import numpy as np

from strata.data.mixture import Mixture, blend, describe_sources
from strata.data.tokens import Batch, TokenDataset
from strata.errors import DataError


class EpochOrder:
    """Which sample of a dataset of n sits at each position of its endless stream: epoch after
    epoch, a permutation seeded by (seed, epoch) (or 0..n-1 in order without shuffling)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def at(self, position: int) -> int:
        """The index of the sample at `position` of the stream (the permutation of its epoch made
        once and kept)."""
        epoch, offset = divmod(position, self.n)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        assert self._perm is not None
        return int(self._perm[offset])


class _StepSplit(abc.ABC):
    """What the loaders share: each optimizer step's global_batch samples, split into dp slices of
    micro-batches. A loader sets up its own position in `_start`."""

    def __init__(
        self,
        dataset: TokenDataset | Mixture,
        seed: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
    ):
        if global_batch % (micro_batch * dp_size):
            raise DataError(
                f"global batch {global_batch} is not a multiple of micro_batch·dp = "
                f"{micro_batch}·{dp_size}"
            )
        self.seed, self.shuffle = seed, shuffle
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._start(dataset)

    @abc.abstractmethod
    def _start(self, dataset: TokenDataset | Mixture) -> None:
        """Take `dataset` and start at its first sample."""


class BatchLoader(_StepSplit):
    """Deterministic, resumable data-parallel batches (Megatron's consumed-samples scheme).

    The global sample stream is epoch after epoch of a permutation seeded by (seed, epoch). Each
    optimizer step takes the next `global_batch` positions; data-parallel rank r reads the r-th
    contiguous slice of them, in micro-batches. The only state is `consumed_samples`, global, so a
    run resumes exactly, even with another dp size, and each sample is read once per epoch.
    """

    def _start(self, dataset: TokenDataset | Mixture) -> None:
        assert isinstance(dataset, TokenDataset)
        self.dataset = dataset
        self.consumed_samples = 0
        self._order = EpochOrder(len(dataset), self.seed, self.shuffle)

    def _sample_at(self, position: int) -> int:
        return self._order.at(position)

    def step_indices(self) -> list[list[int]]:
        """This rank's sample indices for the next optimizer step, as micro-batches; advances."""
        per_rank = self.global_batch // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        indices = [self._sample_at(start + k) for k in range(per_rank)]
        self.consumed_samples += self.global_batch
        return [indices[k : k + self.micro_batch] for k in range(0, per_rank, self.micro_batch)]

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next step (with their loss masks where the data has
        them), the position moved past them."""
        return [self.dataset.batch(mb) for mb in self.step_indices()]

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the loader: its position, its seed, and the dataset's size to
        check on resume."""
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "n_samples": len(self.dataset),
        }

    def state_problems(self, state: dict) -> list[str]:
        """Why a saved position does not fit this loader (nothing: it does). A state without
        seed/n_samples (imported from another framework, which counts only consumed samples) fits."""
        if "sources" in state:
            return [
                f"cannot resume the data position: the checkpoint was taken over a mixture of "
                f"{len(state['sources'])} sources (data.sources: "
                f"{describe_sources(state['sources'])}), this run reads "
                f"one dataset of {len(self.dataset)} samples (data.path); resume with the same "
                "data.sources"
            ]
        if (
            state.get("n_samples", len(self.dataset)) != len(self.dataset)
            or state.get("seed", self.seed) != self.seed
        ):
            return [
                "cannot resume the data position: the checkpoint was taken with seed "
                f"{state['seed']} over {state['n_samples']} samples, this run has seed {self.seed} "
                f"over {len(self.dataset)}; resume with the same data, model.seq_len and train.seed"
            ]
        return []

    def load_state_dict(self, state: dict) -> None:
        """Restore the position (see `state_problems`)."""
        problems = self.state_problems(state)
        if problems:
            raise DataError(problems[0])
        self.consumed_samples = int(state["consumed_samples"])


def eval_windows(split: int, n_batches: int, global_batch: int) -> int:
    """How many of a split of `split` windows an evaluation reads: the first n_batches ×
    global_batch (`train.eval_batches` global batches, as Megatron's eval_iters ×
    global_batch_size), the whole split where that is more or n_batches is 0. A count of the
    global batch, so the same at every data-parallel size."""
    return split if n_batches == 0 else min(split, n_batches * global_batch)


def eval_batches(
    dataset: TokenDataset | Mixture, windows: int, micro_batch: int, dp_rank: int, dp_size: int
) -> Iterator[Batch]:
    """The same validation micro-batches at every evaluation and every dp size: the split's first
    `windows` windows in order (`eval_windows`), cut into micro-batches (the last one shorter where
    micro_batch does not divide them), rank r taking every dp-th from the r-th; a rank the end
    leaves out gets one micro-batch fewer, or none."""
    for first in range(dp_rank * micro_batch, windows, dp_size * micro_batch):
        yield dataset.batch(list(range(first, min(first + micro_batch, windows))))


class MixtureLoader(_StepSplit):
    """`BatchLoader` over a `Mixture`: the global sample stream gives sample i to a source by
    `blend`, and a source's k-th sample is position k of its own `EpochOrder` (seeded by (seed,
    epoch) exactly as a single dataset's, so a one-source mixture reads what data.path would).
    Each step takes the next `global_batch` samples and rank r reads the r-th contiguous slice.

    `consumed_samples` alone determines every source's position (the blend is a function of the
    global index); the per-source counts are kept beside it so that resuming does not replay the
    blend from sample 0, and saved with the sources' signature so that resuming with other
    sources or weights is refused."""

    def _start(self, dataset: TokenDataset | Mixture) -> None:
        assert isinstance(dataset, Mixture)
        mixture = self.dataset = dataset
        self._orders = [EpochOrder(len(d), self.seed, self.shuffle) for d in mixture.datasets]
        self._consumed = 0
        self.source_samples = [0] * len(mixture.datasets)

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed so far, over every data-parallel rank and source."""
        return self._consumed

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        """Move to global sample `value`, deriving every source's count from it (by replaying the
        blend from the nearer of here and the start)."""
        value = int(value)
        if value >= self._consumed:
            _, _, counts = blend(
                self.dataset.shares, value - self._consumed, self._consumed, self.source_samples
            )
        else:
            _, _, counts = blend(self.dataset.shares, value)
        self._consumed, self.source_samples = value, counts

    def step_indices(self) -> list[list[tuple[int, int]]]:
        """This rank's (source, sample) pairs for the next optimizer step, as micro-batches; advances."""
        sources, positions, counts = blend(
            self.dataset.shares, self.global_batch, self._consumed, self.source_samples
        )
        per_rank = self.global_batch // self.dp_size
        first = self.dp_rank * per_rank
        pairs = [
            (j, self._orders[j].at(k))
            for j, k in zip(sources[first : first + per_rank], positions[first:])
        ]
        self._consumed += self.global_batch
        self.source_samples = counts
        return [pairs[k : k + self.micro_batch] for k in range(0, per_rank, self.micro_batch)]

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches of the next step, each row read from the source the blend gave
        it to (with its loss mask where the mixture has them)."""
        return [self.dataset.rows(micro) for micro in self.step_indices()]

    def source_counts(self) -> dict[str, int]:
        """Samples read so far from each source, by its path (for metrics)."""
        return dict(zip(self.dataset.names, self.source_samples))

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the loader: its position, seed and each source's count, and
        the sources' signature to check on resume."""
        return {
            "consumed_samples": self._consumed,
            "seed": self.seed,
            "source_samples": list(self.source_samples),
            "sources": self.dataset.signature(),
        }

    def state_problems(self, state: dict) -> list[str]:
        """Why a saved position does not fit this loader (nothing: it does). The sources must be the
        same, in the same order, with the same weights (after normalising) and sizes; a directory
        may have moved. A state with only consumed_samples (imported) fits: the counts follow."""
        mine = self.dataset.signature()
        fix = "resume with the same data.sources (contents, weights and order), model.seq_len and train.seed"
        if "sources" not in state and "n_samples" in state:
            return [
                f"cannot resume the data position: the checkpoint was taken over one dataset of "
                f"{state['n_samples']} samples (data.path), this run blends {len(mine)} sources "
                f"(data.sources: {describe_sources(mine)}); resume with the same data.path"
            ]
        if state.get("seed", self.seed) != self.seed:
            return [
                "cannot resume the data position: the checkpoint was taken with seed "
                f"{state['seed']}, this run has seed {self.seed}; {fix}"
            ]
        saved = state.get("sources")
        if saved is None:
            return []
        key = ("id", "weight", "n_samples")
        if len(saved) != len(mine) or any(
            tuple(a.get(k) for k in key) != tuple(b[k] for k in key) for a, b in zip(saved, mine)
        ):
            return [
                "cannot resume the data position: the checkpoint blends data.sources "
                f"{describe_sources(saved)}, this run blends {describe_sources(mine)}; {fix}"
            ]
        counts = state.get("source_samples")
        consumed = int(state["consumed_samples"])
        if counts is not None and (
            len(counts) != len(mine)
            or sum(counts) != consumed
            # the blend keeps each source within a sample or two of its share
            or any(abs(c - s["weight"] * consumed) > 2 for c, s in zip(counts, mine))
        ):
            return [
                f"cannot resume the data position: the checkpoint's per-source counts {counts} "
                "are not what "
                f"blending {consumed} samples gives; the checkpoint's trainer state is damaged"
            ]
        return []

    def load_state_dict(self, state: dict) -> None:
        """Restore the position (see `state_problems`)."""
        problems = self.state_problems(state)
        if problems:
            raise DataError(problems[0])
        counts = state.get("source_samples")
        if counts is None:
            self._consumed, self.source_samples = 0, [0] * len(self.source_samples)
            self.consumed_samples = int(state["consumed_samples"])
        else:
            self._consumed, self.source_samples = (
                int(state["consumed_samples"]),
                [int(c) for c in counts],
            )


def make_loader(
    train: TokenDataset | Mixture,
    seed: int,
    global_batch: int,
    micro_batch: int,
    dp_rank: int,
    dp_size: int,
) -> BatchLoader | MixtureLoader:
    """The loader for a training split: one dataset's, or a mixture's."""
    if isinstance(train, Mixture):
        return MixtureLoader(train, seed, global_batch, micro_batch, dp_rank, dp_size)
    return BatchLoader(train, seed, global_batch, micro_batch, dp_rank, dp_size)
