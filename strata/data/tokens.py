"""Prepared token files: a directory's meta.json (dtype, vocabulary, tokenizer) and its train/val
token arrays, memory-mapped; the checks of a data directory against the config; the vocabulary a
run will build, known before its data loads.

On disk (nanoGPT's layout plus a JSON header): DIR/train.bin and DIR/val.bin are flat arrays of
token ids (uint16, or uint32 for vocabularies over 65536), DIR/meta.json says dtype, vocabulary
and tokenizer (and, from `strata data prepare`, the largest id, "max_id"). Opening a directory
reads only meta.json and the files' sizes, so a run starts in the same time on any amount of data.
A training sample i is the window tokens[i·L : i·L + L + 1] (L = sequence length).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from strata.data.tokenize import ByteTokenizer, tokenizer_problem
from strata.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

    from strata.config.schema import Config


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
    from strata.config.vocabulary import padded_vocab_size

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
            f"{path}: not valid JSON ({e}); rewrite it with `strata data prepare`, or fix it to "
            "hold "
            '{"dtype": "uint16", "vocab_size": N}'
        ) from e
    if not isinstance(meta, dict):
        raise DataError(
            f'{path}: must be a JSON object like {{"dtype": "uint16", "vocab_size": '
            f"N}}, got {meta!r:.60}"
        )
    vocab = meta.get("vocab_size")
    if (
        meta.get("dtype") not in ("uint16", "uint32")
        or not isinstance(vocab, int)
        or isinstance(vocab, bool)
    ):
        raise DataError(
            f'{path}: needs "dtype" (uint16 or uint32) and an integer "vocab_size"; '
            f"got dtype={meta.get('dtype')!r}, vocab_size={vocab!r}"
        )
    if vocab < 1:
        raise DataError(
            f'{path}: "vocab_size" is {vocab}; it must be >= 1 (the number of distinct token ids)'
        )
    tokenizer = meta.get("tokenizer", "unknown")
    if isinstance(tokenizer, dict):
        tokenizer = tokenizer.get("source", "unknown")
    return TokenMeta(
        meta["dtype"], vocab, tokenizer if isinstance(tokenizer, str) else "unknown", meta
    )


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
            f"{key}={str(data_dir)!r}: data.document_mask and data.reset_positions need the "
            "end-of-document token "
            f'id as "eot" in meta.json (found {eot!r}); prepare the data again with `strata data '
            "prepare`, which "
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
            f"{path}: {size} bytes is not a whole number of {dtype} tokens ({itemsize} bytes "
            "each); the file is "
            "truncated or meta.json names the wrong dtype: prepare the data again with `strata "
            "data prepare`"
        )
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def _recorded_max_id(path: Path, meta: TokenMeta, vocab_size: int) -> bool:
    """Refuse a directory whose meta.json records a largest token id ("max_id", written by `strata
    data prepare`) outside the vocabulary. Returns whether the ids are known to be in range without
    reading the tokens: recorded, or the dtype cannot hold an id that large."""
    top = meta.raw.get("max_id")
    if isinstance(top, int) and not isinstance(top, bool):
        if top >= vocab_size:
            raise DataError(
                f"{path}: holds token id {top} (meta.json's max_id), but meta.json says "
                f"vocab_size={vocab_size} (ids must be below it); set vocab_size to at least "
                f"{top + 1}, or prepare the data again"
            )
        return True
    return vocab_size > np.iinfo(np.dtype(meta.dtype)).max


class TokenDataset:
    """Non-overlapping (seq_len+1)-token windows of one split, read from a memory map. Opening one
    reads only meta.json and the file's size, never the tokens: a directory whose meta.json does
    not record its largest id has each window checked against the vocabulary as it is read."""

    def __init__(self, data_dir: Path, split: str, seq_len: int, key: str = "data.path"):
        meta = read_meta(data_dir, key)
        path = Path(data_dir) / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"{key}={str(data_dir)!r}: missing {split}.bin")
        self.path = path
        self.tokens = _open_tokens(path, meta.dtype)
        self._ids_in_range = _recorded_max_id(path, meta, meta.vocab_size)
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
        """Window `i`: tokens i·seq_len to (i+1)·seq_len inclusive (inputs and the targets one token
        on), as int64."""
        start = i * self.seq_len
        row = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if not self._ids_in_range and len(row) and int(row.max()) >= self.vocab_size:
            at = int(np.argmax(row >= self.vocab_size))
            raise DataError(
                f"{self.path}: token id {int(row[at])} at offset {start + at} (token index; byte "
                f"{(start + at) * self.tokens.itemsize}), but meta.json says "
                f"vocab_size={self.vocab_size} (ids must be below it); set vocab_size to at least "
                f"{int(row.max()) + 1}, or prepare the data again with `strata data prepare`"
            )
        return row

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
            f"{Path(data_dir) / 'meta.json'} says vocab_size={meta.vocab_size} (tokenizer "
            f"{meta.tokenizer}); set model.vocab_size >= {meta.vocab_size} or leave it null"
        )
    if problems:
        raise ConfigError(problems)


def check_data_dir(data_dir: Path, seq_len: int, cfg: Config | None = None) -> None:
    """Everything `TokenDataset` refuses about a data directory at opening (meta.json, both token
    files, the largest id meta.json records), and with `cfg` what `check_data_config` refuses,
    checked before any worker starts."""
    if cfg is not None:
        check_data_config(data_dir, cfg)
    for split in ("train", "val"):
        TokenDataset(data_dir, split, seq_len)
