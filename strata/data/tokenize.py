"""Tokenizers for `strata data prepare`: the built-in byte tokenizer, any Hugging Face
`tokenizer.json` (a file or a model directory holding one, through the `tokenizers` library), and
a byte-level BPE trained on the corpus (`bpe:N`).

A tokenizer is named by one string, the same on the command line (`--tokenizer`) and in the config
(`data.tokenizer`): `bytes`, `bpe:N`, or a path. Every tokenizer has an end-of-document token,
appended after each document. What a prepared directory was made with is recorded in its
meta.json (`describe`), and `tokenizer_problem` says whether a config's `data.tokenizer` agrees.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.config.vocabulary import bpe_problem
from strata.errors import DataError

# Tried in order when the tokenizer names no end-of-document token itself (GPT-2/GPT-NeoX, Llama 3,
# Llama 2/Mistral/T5, Gemma, and a few others).
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|end|>")
BPE_EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token 256."""

    name = "byte"
    vocab_size = 257
    eot = 256

    def encode(self, data: bytes) -> np.ndarray:
        """The UTF-8 bytes as ids 0..255 (uint16, the token files' type)."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens: Iterable[int]) -> str:
        """The text of `tokens`, the end-of-document id (256) left out and bad UTF-8 replaced."""
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def bpe_vocab(spec: str) -> int | None:
    """N for a `bpe:N` spec, None for any other spec; a malformed or out-of-range N is an error."""
    problem = bpe_problem(spec)
    if problem is not None:
        raise DataError(problem)
    return int(spec[4:]) if spec.startswith("bpe:") else None


def spec_problem(spec: str) -> str | None:
    """Why `spec` cannot name a tokenizer, without touching files (None: it can)."""
    if not isinstance(spec, str) or not spec.strip():
        return (
            "expected bytes, bpe:N, or the path of a tokenizer.json or of a directory holding one"
        )
    try:
        bpe_vocab(spec)
    except DataError as e:
        return str(e)
    return None


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json a path spec names: the file itself, or the one in a model directory."""
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / TOKENIZER_FILE
        if not p.is_file():
            raise DataError(
                f"tokenizer {spec!r}: the directory holds no {TOKENIZER_FILE}; name a Hugging "
                "Face model directory "
                "with a fast tokenizer (tokenizer.json), the file itself, bytes, or bpe:N"
            )
    elif not p.is_file():
        raise DataError(
            f"tokenizer {spec!r}: no such file or directory; give bytes, bpe:N, or the path of a "
            "tokenizer.json or of a Hugging Face model directory holding one"
        )
    return p.resolve()


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks: how meta.json pins the tokenizer.json."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _config_eos(directory: Path) -> str | None:
    """eos_token from a model directory's tokenizer_config.json (a string or {"content": ...})."""
    path = directory / "tokenizer_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


@dataclass(frozen=True)
class TokenizerInfo:
    """What meta.json records about the tokenizer (the `tokenizer` object) and what preparing needs."""

    kind: str  # bytes, file or bpe
    source: str  # the spec as given: bytes, bpe:N, or the path (resolved)
    # tokenizer.json in the prepared directory (a copy, or the trained BPE); None for bytes
    file: str | None
    sha256: str | None  # of that file
    eot_token: str
    eot: int
    vocab_size: int  # largest id + 1

    @property
    def dtype(self) -> str:
        """The token files' element type: uint16 while every id fits, else uint32."""
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def meta(self) -> dict:
        """What meta.json records of the tokenizer: its kind, source, file, checksum and
        end-of-document token."""
        return {
            "kind": self.kind,
            "source": self.source,
            "file": self.file,
            "sha256": self.sha256,
            "eot_token": self.eot_token,
        }


BYTES_INFO = TokenizerInfo(
    "bytes", "bytes", None, None, "<byte 256>", ByteTokenizer.eot, ByteTokenizer.vocab_size
)


def load_file_tokenizer(path: Path):
    """A `tokenizers.Tokenizer` from a tokenizer.json; an unreadable file is a DataError."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    # the library raises its own Exception subclass for every kind of bad file
    except Exception as e:
        raise DataError(
            f"tokenizer {str(path)!r}: not a tokenizer.json the tokenizers library reads ({e})"
        ) from e


def vocab_size_of(tok) -> int:
    """Largest id + 1 (added tokens may lie beyond the model's own vocabulary)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def find_eot(tok, path: Path, eot_token: str | None) -> tuple[str, int]:
    """The end-of-document token: --eot-token, else the model directory's eos_token, else a common one."""
    vocab = tok.get_vocab(with_added_tokens=True)
    if eot_token is not None:
        if eot_token not in vocab:
            raise DataError(
                f"--eot-token {eot_token!r} is not a token of {str(path)!r}; name one of its tokens"
            )
        return eot_token, vocab[eot_token]
    for name in (_config_eos(path.parent), *EOT_CANDIDATES):
        if name is not None and name in vocab:
            return name, vocab[name]
    raise DataError(
        f"tokenizer {str(path)!r} has none of the usual end-of-document tokens "
        f"({', '.join(EOT_CANDIDATES)}) and no "
        "eos_token in a tokenizer_config.json beside it; name its end-of-document token with "
        "--eot-token"
    )


def file_info(spec: str, eot_token: str | None) -> tuple[TokenizerInfo, Path]:
    """The info for a path spec, and the tokenizer.json it names (not yet copied)."""
    path = tokenizer_file(spec)
    tok = load_file_tokenizer(path)
    name, eot = find_eot(tok, path, eot_token)
    info = TokenizerInfo(
        "file", str(path), TOKENIZER_FILE, sha256_file(path), name, eot, vocab_size_of(tok)
    )
    return info, path


def train_bpe(vocab_size: int, documents: Iterator[str], out: Path) -> TokenizerInfo:
    """Train a byte-level BPE (GPT-2's scheme: ByteLevel pre-tokenizer and decoder, every byte in the
    alphabet, so any text encodes) with `<|endoftext|>` as id 0, and save it as `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer)
    tok.save(str(out))
    eot = tok.token_to_id(BPE_EOT)
    assert eot is not None  # a special token of the trainer: always in the vocabulary
    return TokenizerInfo(
        "bpe", f"bpe:{vocab_size}", out.name, sha256_file(out), BPE_EOT, eot, vocab_size_of(tok)
    )


# --- encoding in a worker -------------------------------------------------------------------

_worker_tok = None


def start_worker(path: str | None, threads: bool) -> None:
    """Per worker process: load the tokenizer once. Worker processes encode one batch each without
    the library's own threads (the processes are the parallelism; both would oversubscribe)."""
    global _worker_tok
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tok = ByteTokenizer() if path is None else load_file_tokenizer(Path(path))


def encode_documents(docs: list, eot: int, dtype: str) -> np.ndarray:
    """The documents' ids, each followed by the end-of-document id, as one flat array. Text goes
    through Tokenizer.encode_batch_fast (encode_batch's ids without the offsets); bytes through the
    byte tokenizer."""
    tok = _worker_tok
    if not docs:
        return np.zeros(0, dtype)
    if isinstance(tok, ByteTokenizer):
        sep = np.array([eot], np.uint16)
        return np.concatenate([part for d in docs for part in (tok.encode(d), sep)]).astype(
            dtype, copy=False
        )
    assert tok is not None
    out: list[int] = []
    for enc in tok.encode_batch_fast(docs):
        out += enc.ids
        out.append(eot)
    return np.array(out, dtype)


def tokenizer_problem(setting: str, meta: dict, data_dir: Path) -> str | None:
    """Why the config's data.tokenizer does not describe the tokenizer data_dir was prepared with
    (None: it does). bytes and bpe:N compare by name; a path by the content of its tokenizer.json."""
    recorded = meta.get("tokenizer")
    if isinstance(recorded, str):  # format 1: only byte-level data existed
        recorded = (
            {"kind": "bytes", "source": "bytes"}
            if recorded == "byte"
            else {"kind": recorded, "source": recorded}
        )
    if not isinstance(recorded, dict):
        recorded = {"kind": "unknown", "source": "unknown"}
    was = f"{data_dir / 'meta.json'} records tokenizer {recorded.get('source')!r}"
    fix = "set data.tokenizer to null (use the data's), to what it was prepared with, or prepare the data again"
    if setting == "bytes" or setting.startswith("bpe:"):
        if recorded.get("source") != setting or (setting == "bytes") != (
            recorded.get("kind") == "bytes"
        ):
            return f"data.tokenizer={setting!r} but {was}; {fix}"
        return None
    try:
        path = tokenizer_file(setting)
    except DataError as e:
        return f"data.tokenizer: {e}"
    if recorded.get("sha256") != sha256_file(path):
        return f"data.tokenizer={setting!r} ({path}) is not the tokenizer the data was prepared with: {was}; {fix}"
    return None
