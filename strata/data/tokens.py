"""Prepared token files: a directory's meta.json (dtype, vocabulary, tokenizer) and its train/val
token arrays, memory-mapped; the checks of a data directory against the config; the vocabulary a
run will build, known before its data loads.

On disk (nanoGPT's layout plus a JSON header): DIR/train.bin and DIR/val.bin are flat arrays of
token ids (uint16, or uint32 for vocabularies over 65536), DIR/meta.json says dtype, vocabulary
and tokenizer (and, from `strata data prepare`, the largest id, "max_id"). Opening a directory
reads only meta.json and the files' sizes, so a run starts in the same time on any amount of data.
A training sample i is the window tokens[i·L : i·L + L + 1] (L = sequence length).

Conversations (`strata data prepare` on chat records, meta.json's "chat" block) are packed into
windows of L + 1 tokens that never cut one: sample i is tokens[i·(L+1) : (i+1)·(L+1)], so such a
directory opens only with the seq_len it was prepared for. Beside each split's tokens lie
SPLIT.mask.bin (uint8, one per token: 1 where the token is trained as a target) and SPLIT.docs.bin
(int64 pairs: each conversation's [start, end) in the split's tokens, its end-of-document token
included; what lies between is padding).

A micro-batch is a `Batch`: inputs, targets and, from a conversation directory, the targets' loss
mask. The mask travels beside the targets rather than as targets set to an ignore index (-100, as
Hugging Face and Megatron label them): the targets stay the tokens the data holds, a plain
directory's batches carry no mask at all, so its runs keep the plain mean loss, and every rank
knows from the data alone whether a step counts trained targets (`has_mask`). The trainer sets the
untrained targets to the ignore index only where its loss reads them (one tensor for the pipeline
schedule to cut and context parallelism to shard).
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
class Batch:
    """One micro-batch: `inputs` and `targets` (rows, seq_len) int64, and `mask` (rows, seq_len)
    bool, True where a target is trained; None where every target is (plain token data)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.inputs)


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
    data.document_mask and data.reset_positions split packed sequences at; a DataError without one.
    In a conversation directory it ends each conversation and pads each window, and nowhere else
    (`strata data prepare` refuses a conversation holding it), so the documents it gives are the
    conversations SPLIT.docs.bin records, never the turns."""
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


def mask_file(split: str) -> str:
    """The name of a chat split's loss mask file."""
    return f"{split}.mask.bin"


def docs_file(split: str) -> str:
    """The name of a chat split's conversation boundaries file."""
    return f"{split}.docs.bin"


@dataclass(frozen=True)
class ChatSplit:
    """What a conversation directory holds beside a split's tokens: the loss mask (uint8 per
    token) and the conversations' [start, end) offsets, both memory-mapped."""

    mask: np.ndarray
    docs: np.ndarray  # (conversations, 2) int64


def _chat_split(
    data_dir: Path, meta: TokenMeta, split: str, seq_len: int, n_tokens: int, key: str
) -> ChatSplit | None:
    """A split's mask and boundaries when meta.json has a "chat" block (None without one), after
    checking, from the files' sizes alone, that they belong to the tokens and to `seq_len`."""
    chat = meta.raw.get("chat")
    if not isinstance(chat, dict):
        return None
    data_dir = Path(data_dir)
    packed = chat.get("seq_len")
    if packed != seq_len:
        raise DataError(
            f"{key}={str(data_dir)!r} holds conversations packed for model.seq_len={packed} "
            f"(windows of {packed}+1 tokens that never cut one), the run has model.seq_len="
            f"{seq_len}; set model.seq_len={packed}, or prepare again with --seq-len {seq_len}"
        )
    again = "; the directory is damaged or incomplete: prepare it again with `strata data prepare`"
    if n_tokens % (seq_len + 1):
        raise DataError(
            f"{data_dir / (split + '.bin')}: {n_tokens} tokens is not a whole number of "
            f"windows of {seq_len + 1}{again}"
        )
    mask_path, docs_path = data_dir / mask_file(split), data_dir / docs_file(split)
    for path in (mask_path, docs_path):
        if not path.is_file():
            raise DataError(f"{key}={str(data_dir)!r}: missing {path.name}{again}")
    if mask_path.stat().st_size != n_tokens:
        raise DataError(
            f"{mask_path}: {mask_path.stat().st_size} bytes, but {split}.bin holds {n_tokens} "
            f"tokens (one mask byte each){again}"
        )
    recorded = chat.get("conversations")
    count = recorded.get(split) if isinstance(recorded, dict) else None
    size = docs_path.stat().st_size
    if size % 16 or (isinstance(count, int) and size // 16 != count):
        raise DataError(
            f"{docs_path}: {size} bytes is not the {count} conversations meta.json records "
            f"(16 bytes each){again}"
        )
    mask = np.memmap(mask_path, np.uint8, mode="r") if n_tokens else np.zeros(0, np.uint8)
    docs = (
        np.memmap(docs_path, np.int64, mode="r").reshape(-1, 2)
        if size
        else np.zeros((0, 2), np.int64)
    )
    return ChatSplit(mask, docs)


class TokenDataset:
    """Non-overlapping (seq_len+1)-token windows of one split, read from a memory map. Opening one
    reads only meta.json and the files' sizes, never the tokens: a directory whose meta.json does
    not record its largest id has each window checked against the vocabulary as it is read. A
    conversation directory (`chat`) has a loss mask and conversation boundaries per window."""

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
        self.chat = _chat_split(Path(data_dir), meta, split, seq_len, len(self.tokens), key)
        # packed conversations: windows side by side; plain tokens: each window's last token is
        # the next one's first
        self.stride = seq_len + 1 if self.chat else seq_len
        self.n_samples = (len(self.tokens) - (0 if self.chat else 1)) // self.stride
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
        start = i * self.stride
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

    @property
    def has_mask(self) -> bool:
        """Whether the split's batches carry a loss mask (a conversation directory's do)."""
        return self.chat is not None

    def batch(self, indices: Iterable[int]) -> Batch:
        """The windows `indices` as a `Batch` ((len(indices), seq_len) each), with their targets'
        loss mask when the split has one."""
        import torch  # here, so the launcher checks a data directory without loading torch

        indices = list(indices)
        rows = torch.from_numpy(np.stack([self.window(i) for i in indices]))
        mask = self.target_mask(indices) if self.has_mask else None
        return Batch(rows[:, :-1], rows[:, 1:], mask)

    def loss_mask(self, i: int) -> np.ndarray:
        """Window `i`'s loss mask, aligned with `window(i)` (seq_len+1 bools, True where that token
        is trained as a target: its [1:] goes with the targets): the stored mask of conversations
        (padding, prompts and each conversation's first token False), all True for plain tokens."""
        if self.chat is None:
            return np.ones(self.seq_len + 1, dtype=bool)
        start = i * self.stride
        row = np.asarray(self.chat.mask[start : start + self.stride])
        if len(row) and int(row.max()) > 1:
            raise DataError(
                f"{self.path.with_name(mask_file(self.path.stem))}: mask byte {int(row.max())} in "
                f"window {i} (only 0 and 1 are written); prepare the data again"
            )
        return row.astype(bool)

    def target_mask(self, indices: Iterable[int]) -> torch.Tensor:
        """The loss mask of `batch(indices)`'s targets: (len(indices), seq_len) bool."""
        import torch

        return torch.from_numpy(np.stack([self.loss_mask(i)[1:] for i in indices]))

    def document_ids(self, i: int) -> np.ndarray | None:
        """Which stored conversation each token of window `i` belongs to (0, 1, ... in the window;
        -1 for padding), from SPLIT.docs.bin: the boundaries data.document_mask must see. None for
        plain tokens, whose documents are found by their end-of-document token."""
        if self.chat is None:
            return None
        start, end = i * self.stride, (i + 1) * self.stride
        docs = self.chat.docs
        first = int(np.searchsorted(docs[:, 0], start, side="left"))
        last = int(np.searchsorted(docs[:, 0], end, side="left"))
        ids = np.full(self.stride, -1, dtype=np.int64)
        for k, (a, b) in enumerate(np.asarray(docs[first:last])):
            ids[a - start : b - start] = k
        return ids


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
