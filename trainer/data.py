"""Token data: reading prepared token files, and the deterministic, resumable, data-parallel
batch loader over them. Preparing them (tokenizers, `strata data prepare`) is
`strata.trainer.prepare` and `strata.trainer.tokenize`.

On disk (nanoGPT's layout plus a JSON header): DIR/train.bin and DIR/val.bin are flat arrays of
token ids (uint16, or uint32 for vocabularies over 65536), DIR/meta.json says dtype, vocabulary
and tokenizer. A training sample i is the window tokens[i·L : i·L + L + 1] (L = sequence length).

Several prepared directories blend into one stream (`data.sources`) as Megatron's blended dataset
does: `blend` gives each global sample to the source furthest behind its share, and
`MixtureLoader` reads each source in its own seeded epoch order.
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from strata.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

    from strata.config import Config, DataConfig

# Preparing moved to strata.trainer.prepare; these names stay importable from here.
from strata.trainer.prepare import (  # noqa: E402
    OUTPUT_FILES,
    ByteTokenizer,
    check_output,
    check_output_outside_inputs,
    default_corpus_dir,
    ensure_default_corpus,
    expand_inputs,
    prepare,
    stdlib_corpus_files,
)
from strata.trainer.tokenize import tokenizer_problem  # noqa: E402

__all__ = [
    "OUTPUT_FILES",
    "ByteTokenizer",
    "check_output",
    "check_output_outside_inputs",
    "default_corpus_dir",
    "ensure_default_corpus",
    "expand_inputs",
    "prepare",
    "stdlib_corpus_files",
    "TokenMeta",
    "read_meta",
    "TokenDataset",
    "check_data_dir",
    "check_data_config",
    "BatchLoader",
    "eval_batches",
    "blend",
    "Mixture",
    "MixtureLoader",
    "open_mixture",
    "make_loader",
]


# --- reading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenMeta:
    """meta.json: `tokenizer` is what it was prepared with (bytes, bpe:N, a tokenizer.json's path;
    "byte" in format 1, "unknown" when not recorded); `raw` is the whole file."""

    dtype: str
    vocab_size: int
    tokenizer: str
    raw: dict = field(default_factory=dict, compare=False, repr=False)


BYTE_VOCAB = 256  # the built-in corpus is byte-level


def planned_vocab(cfg: Config) -> int:
    """The padded vocabulary the trainer will build, known before any data is loaded:
    model.vocab_size, else the one its data's meta.json records (the built-in corpus: bytes)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    from strata.config import padded_vocab_size

    source = cfg.data.prepared_dir()
    if source and (Path(source) / "meta.json").is_file():
        return padded_vocab_size(cfg.model, read_meta(Path(source)).vocab_size)
    return padded_vocab_size(cfg.model, BYTE_VOCAB)


def read_meta(data_dir: Path, key: str = "data.path") -> TokenMeta:
    """meta.json of a prepared directory; `key` is the config key that named it, for messages."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise DataError(
            f"{key}={str(data_dir)!r}: no meta.json there; make the directory with "
            '`strata data prepare`, or add meta.json with {"dtype": "uint16", "vocab_size": N}'
        )
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DataError(
            f"{path}: not valid JSON ({e}); rewrite it with `strata data prepare`, or fix it to hold "
            '{"dtype": "uint16", "vocab_size": N}'
        ) from e
    if not isinstance(meta, dict):
        raise DataError(f'{path}: must be a JSON object like {{"dtype": "uint16", "vocab_size": N}}, got {meta!r:.60}')
    vocab = meta.get("vocab_size")
    if meta.get("dtype") not in ("uint16", "uint32") or not isinstance(vocab, int) or isinstance(vocab, bool):
        raise DataError(
            f'{path}: needs "dtype" (uint16 or uint32) and an integer "vocab_size"; '
            f"got dtype={meta.get('dtype')!r}, vocab_size={vocab!r}"
        )
    if vocab < 1:
        raise DataError(f'{path}: "vocab_size" is {vocab}; it must be >= 1 (the number of distinct token ids)')
    tokenizer = meta.get("tokenizer", "unknown")
    if isinstance(tokenizer, dict):
        tokenizer = tokenizer.get("source", "unknown")
    return TokenMeta(meta["dtype"], vocab, tokenizer if isinstance(tokenizer, str) else "unknown", meta)


def prepared_tokenizer(data_dir: Path, key: str = "data.path") -> tuple[Path | None, int | None]:
    """The tokenizer.json a prepared directory was tokenized with (None: byte-level tokens) and its
    end-of-document id (None when a tokenizer.json's is not recorded), from its meta.json."""
    meta = read_meta(data_dir, key).raw
    info, eot = meta.get("tokenizer"), meta.get("eot")
    file = info.get("file") if isinstance(info, dict) else None
    if not isinstance(eot, int):
        eot = None if file else ByteTokenizer.eot
    return (Path(data_dir) / file if file else None), eot


def end_of_document(data_dir: Path, key: str = "data.path") -> int:
    """The end-of-document token id `strata data prepare` recorded in meta.json ("eot"), which
    data.document_mask and data.reset_positions split packed sequences at; a DataError without one."""
    meta = read_meta(data_dir, key)
    eot = meta.raw.get("eot")
    if not isinstance(eot, int) or isinstance(eot, bool) or not 0 <= eot < meta.vocab_size:
        raise DataError(
            f"{key}={str(data_dir)!r}: data.document_mask and data.reset_positions need the end-of-document token "
            f'id as "eot" in meta.json (found {eot!r}); prepare the data again with `strata data prepare`, which '
            "records it, or turn both off"
        )
    return eot


def _open_tokens(path: Path, dtype: str) -> np.ndarray:
    """The token file as a read-only memory map; a file that cannot hold whole tokens is a DataError."""
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, dtype=np.dtype(dtype))
    if size % itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {dtype} tokens ({itemsize} bytes each); the file is "
            "truncated or meta.json names the wrong dtype: prepare the data again with `strata data prepare`"
        )
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def _check_ids(path: Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Refuse token ids outside the vocabulary (the embedding lookup would fail mid-run): one pass
    over the file, unless the dtype cannot hold an id that large."""
    if len(tokens) == 0 or vocab_size > np.iinfo(tokens.dtype).max:
        return
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(
            f"{path}: holds token id {top}, but meta.json says vocab_size={vocab_size} (ids must be below it); "
            f"set vocab_size to at least {top + 1}, or prepare the data again"
        )


class TokenDataset:
    """Non-overlapping (seq_len+1)-token windows of one split, read from a memory map."""

    def __init__(self, data_dir: Path, split: str, seq_len: int, key: str = "data.path"):
        meta = read_meta(data_dir, key)
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"{key}={str(data_dir)!r}: missing {split}.bin")
        self.tokens = _open_tokens(path, meta.dtype)
        _check_ids(path, self.tokens, meta.vocab_size)
        self.seq_len = seq_len
        self.vocab_size = meta.vocab_size
        self.n_samples = (len(self.tokens) - 1) // seq_len
        if self.n_samples < 1:
            raise DataError(
                f"{path}: {len(self.tokens)} tokens is too few for one sequence of "
                f"model.seq_len={seq_len}+1; use more data or a shorter seq_len"
            )

    def __len__(self) -> int:
        return self.n_samples

    def window(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (len(indices), seq_len) int64."""
        import torch  # here, so the launcher checks a data directory without loading torch

        rows = torch.from_numpy(np.stack([self.window(i) for i in indices]))
        return rows[:, :-1], rows[:, 1:]


def check_data_config(data_dir: Path, cfg: Config) -> None:
    """What the config says about the data that the prepared directory contradicts: data.tokenizer
    (when set) must be the tokenizer data_dir was prepared with, and model.vocab_size (when set)
    must cover the data's vocabulary. One ConfigError naming both sides."""
    meta = read_meta(data_dir)
    problems = []
    if cfg.data.tokenizer is not None:
        problem = tokenizer_problem(cfg.data.tokenizer, meta.raw, Path(data_dir))
        if problem:
            problems.append(problem)
    if cfg.model.vocab_size and cfg.model.vocab_size < meta.vocab_size:
        problems.append(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's vocabulary: "
            f"{Path(data_dir) / 'meta.json'} says vocab_size={meta.vocab_size} (tokenizer {meta.tokenizer}); "
            f"set model.vocab_size >= {meta.vocab_size} or leave it null"
        )
    if problems:
        raise ConfigError(problems)


def check_data_dir(data_dir: Path, seq_len: int, cfg: Config | None = None) -> None:
    """Everything `TokenDataset` refuses about a data directory (meta.json, both token files, their
    ids), and with `cfg` what `check_data_config` refuses, checked before any worker starts."""
    if cfg is not None:
        check_data_config(data_dir, cfg)
    for split in ("train", "val"):
        TokenDataset(data_dir, split, seq_len)


class EpochOrder:
    """Which sample of a dataset of n sits at each position of its endless stream: epoch after
    epoch, a permutation seeded by (seed, epoch) (or 0..n-1 in order without shuffling)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def at(self, position: int) -> int:
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
                f"global batch {global_batch} is not a multiple of micro_batch·dp = {micro_batch}·{dp_size}"
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

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.dataset.batch(mb) for mb in self.step_indices()]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "n_samples": len(self.dataset)}

    def state_problems(self, state: dict) -> list[str]:
        """Why a saved position does not fit this loader (nothing: it does). A state without
        seed/n_samples (imported from another framework, which counts only consumed samples) fits."""
        if "sources" in state:
            return [
                f"cannot resume the data position: the checkpoint was taken over a mixture of "
                f"{len(state['sources'])} sources (data.sources: {_describe(state['sources'])}), this run reads "
                f"one dataset of {len(self.dataset)} samples (data.path); resume with the same data.sources"
            ]
        if state.get("n_samples", len(self.dataset)) != len(self.dataset) or state.get("seed", self.seed) != self.seed:
            return [
                f"cannot resume the data position: the checkpoint was taken with seed {state['seed']} over "
                f"{state['n_samples']} samples, this run has seed {self.seed} over {len(self.dataset)}; "
                "resume with the same data, model.seq_len and train.seed"
            ]
        return []

    def load_state_dict(self, state: dict) -> None:
        """Restore the position (see `state_problems`)."""
        problems = self.state_problems(state)
        if problems:
            raise DataError(problems[0])
        self.consumed_samples = int(state["consumed_samples"])


def eval_batches(
    dataset: TokenDataset | Mixture, n_batches: int, micro_batch: int, dp_rank: int, dp_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same validation micro-batches at every evaluation: the first n_batches·micro_batch·dp
    windows in order (wrapping if the split is small), rank r taking every dp-th micro-batch. With
    n_batches 0, every window of the split once: the last micro-batches shorter, or none for a rank
    the split's end leaves out."""
    n = len(dataset)
    if n_batches == 0:
        for first in range(dp_rank * micro_batch, n, dp_size * micro_batch):
            yield dataset.batch(list(range(first, min(first + micro_batch, n))))
        return
    for b in range(n_batches):
        first = (b * dp_size + dp_rank) * micro_batch
        yield dataset.batch([(first + k) % n for k in range(micro_batch)])


# --- mixtures ---------------------------------------------------------------------------------


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
    return f"{kind} (tokenizer.json sha256 {sha[:12]})" if isinstance(sha, str) else f"{kind} {recorded.get('source')}"


def _describe(sources: list[dict]) -> str:
    """A state's source signatures in words, for messages."""
    return "; ".join(
        f"{s.get('path')} (weight {s.get('weight', 0):.4g}, {s.get('n_samples')} samples, id {s.get('id')})"
        for s in sources
    )


class Mixture:
    """One split of several sources blended by weight: what the model and evaluation see as a
    dataset. `batch` takes global blended indices: sample i is window positions[i] (wrapped) of
    source sources[i], in each source's own order without shuffling, so evaluation reads the first
    windows of every source's val split in the training proportions."""

    def __init__(self, datasets: list[TokenDataset], weights: Sequence[float], names: list[str], ids: list[str]):
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

    def window_of(self, source: int, position: int) -> np.ndarray:
        return self.datasets[source].window(position)

    def batch(self, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the blended samples `indices`."""
        import torch

        indices = list(indices)
        need = max(indices) + 1
        if need > len(self._sources):  # the blend of samples 0..need-1, kept for later evaluations
            self._sources, self._positions, _ = blend(self.shares, need)
        rows = [
            self.datasets[self._sources[i]].window(self._positions[i] % len(self.datasets[self._sources[i]]))
            for i in indices
        ]
        stacked = torch.from_numpy(np.stack(rows))
        return stacked[:, :-1], stacked[:, 1:]


def open_mixture(data: DataConfig, seq_len: int, model_vocab: int | None = None) -> tuple[Mixture, Mixture]:
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
                f"{keys[i]}={names[i]!r} was prepared with another vocabulary than {keys[0]}={names[0]!r}: "
                f"{names[0]} has vocab_size={first.vocab_size}, tokenizer {a}; {names[i]} has "
                f"vocab_size={meta.vocab_size}, tokenizer {b}; prepare every source with the same "
                "--tokenizer (`strata data prepare`)"
            )
    problems = []
    if data.tokenizer is not None:
        for name, meta in zip(names, metas):
            problem = tokenizer_problem(data.tokenizer, meta.raw, Path(name))
            if problem:
                problems.append(problem)
    if model_vocab and model_vocab < first.vocab_size:
        problems.append(
            f"model.vocab_size={model_vocab} is smaller than the data's vocabulary: data.sources say "
            f"vocab_size={first.vocab_size} (tokenizer {first.tokenizer}); set model.vocab_size >= "
            f"{first.vocab_size} or leave it null"
        )
    if problems:
        raise ConfigError(problems)
    ids = [content_id(Path(name)) for name in names]
    weights = [s.weight for s in sources]
    splits = (
        Mixture([TokenDataset(Path(n), split, seq_len, k) for n, k in zip(names, keys)], weights, names, ids)
        for split in ("train", "val")
    )
    train, val = splits
    return train, val


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
        return self._consumed

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        """Move to global sample `value`, deriving every source's count from it (by replaying the
        blend from the nearer of here and the start)."""
        value = int(value)
        if value >= self._consumed:
            _, _, counts = blend(self.dataset.shares, value - self._consumed, self._consumed, self.source_samples)
        else:
            _, _, counts = blend(self.dataset.shares, value)
        self._consumed, self.source_samples = value, counts

    def step_indices(self) -> list[list[tuple[int, int]]]:
        """This rank's (source, sample) pairs for the next optimizer step, as micro-batches; advances."""
        sources, positions, counts = blend(self.dataset.shares, self.global_batch, self._consumed, self.source_samples)
        per_rank = self.global_batch // self.dp_size
        first = self.dp_rank * per_rank
        pairs = [(j, self._orders[j].at(k)) for j, k in zip(sources[first : first + per_rank], positions[first:])]
        self._consumed += self.global_batch
        self.source_samples = counts
        return [pairs[k : k + self.micro_batch] for k in range(0, per_rank, self.micro_batch)]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        import torch

        steps = []
        for micro in self.step_indices():
            rows = torch.from_numpy(np.stack([self.dataset.window_of(j, i) for j, i in micro]))
            steps.append((rows[:, :-1], rows[:, 1:]))
        return steps

    def source_counts(self) -> dict[str, int]:
        """Samples read so far from each source, by its path (for metrics)."""
        return dict(zip(self.dataset.names, self.source_samples))

    def state_dict(self) -> dict:
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
                f"(data.sources: {_describe(mine)}); resume with the same data.path"
            ]
        if state.get("seed", self.seed) != self.seed:
            return [
                f"cannot resume the data position: the checkpoint was taken with seed {state['seed']}, "
                f"this run has seed {self.seed}; {fix}"
            ]
        saved = state.get("sources")
        if saved is None:
            return []
        key = ("id", "weight", "n_samples")
        if len(saved) != len(mine) or any(
            tuple(a.get(k) for k in key) != tuple(b[k] for k in key) for a, b in zip(saved, mine)
        ):
            return [
                f"cannot resume the data position: the checkpoint blends data.sources {_describe(saved)}, "
                f"this run blends {_describe(mine)}; {fix}"
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
                f"cannot resume the data position: the checkpoint's per-source counts {counts} are not what "
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
            self._consumed, self.source_samples = int(state["consumed_samples"]), [int(c) for c in counts]


def make_loader(
    train: TokenDataset | Mixture, seed: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
) -> BatchLoader | MixtureLoader:
    """The loader for a training split: one dataset's, or a mixture's."""
    if isinstance(train, Mixture):
        return MixtureLoader(train, seed, global_batch, micro_batch, dp_rank, dp_size)
    return BatchLoader(train, seed, global_batch, micro_batch, dp_rank, dp_size)
