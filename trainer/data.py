"""Token data: reading prepared token files, and the deterministic, resumable, data-parallel
batch loader over them. Preparing them (tokenizers, `strata data prepare`) is
`strata.trainer.prepare` and `strata.trainer.tokenize`.

On disk (nanoGPT's layout plus a JSON header): DIR/train.bin and DIR/val.bin are flat arrays of
token ids (uint16, or uint32 for vocabularies over 65536), DIR/meta.json says dtype, vocabulary
and tokenizer. A training sample i is the window tokens[i·L : i·L + L + 1] (L = sequence length).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from strata.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

    from strata.config import Config

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


def read_meta(data_dir: Path) -> TokenMeta:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise DataError(
            f"data.path={str(data_dir)!r}: no meta.json there; make the directory with "
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

    def __init__(self, data_dir: Path, split: str, seq_len: int):
        meta = read_meta(data_dir)
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"data.path={str(data_dir)!r}: missing {split}.bin")
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


class BatchLoader:
    """Deterministic, resumable data-parallel batches (Megatron's consumed-samples scheme).

    The global sample stream is epoch after epoch of a permutation seeded by (seed, epoch). Each
    optimizer step takes the next `global_batch` positions; data-parallel rank r reads the r-th
    contiguous slice of them, in micro-batches. The only state is `consumed_samples`, global, so a
    run resumes exactly, even with another dp size, and each sample is read once per epoch.
    """

    def __init__(
        self,
        dataset: TokenDataset,
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
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _sample_at(self, position: int) -> int:
        n = len(self.dataset)
        epoch, offset = divmod(position, n)
        if not self.shuffle:
            return offset
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._perm_epoch = epoch
        assert self._perm is not None
        return int(self._perm[offset])

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
    dataset: TokenDataset, n_batches: int, micro_batch: int, dp_rank: int, dp_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same validation micro-batches at every evaluation: the first n_batches·micro_batch·dp
    windows in order (wrapping if the split is small), rank r taking every dp-th micro-batch."""
    n = len(dataset)
    for b in range(n_batches):
        first = (b * dp_size + dp_rank) * micro_batch
        yield dataset.batch([(first + k) % n for k in range(micro_batch)])
