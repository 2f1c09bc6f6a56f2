"""Token data: preparing text into memory-mapped token files, and the deterministic, resumable,
data-parallel batch loader that reads them.

On disk (nanoGPT's layout plus a JSON header): DIR/train.bin and DIR/val.bin are flat arrays of
token ids (uint16, or uint32 for vocabularies over 65535), DIR/meta.json says dtype, vocabulary
and tokenizer. A training sample i is the window tokens[i·L : i·L + L + 1] (L = sequence length).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from strata.atomic import atomic_directory
from strata.errors import DataError

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-document token 256."""

    name = "byte"
    vocab_size = 257
    eot = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens: Iterable[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


# --- preparing token files ------------------------------------------------------------------


def stdlib_corpus_files() -> list[Path]:
    """The Python standard library's own .py sources (no tests, no site-packages), sorted:
    a real text corpus present on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def _is_val(name: str, val_fraction: float) -> bool:
    """Deterministic per-document split by a hash of its name (stable across machines)."""
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "little")
    return h / 2**64 < val_fraction


def prepare(files: list[Path], out_dir: Path, val_fraction: float = 0.05, root: Path | None = None) -> dict:
    """Tokenize `files` (byte-level, documents separated by EOT) into out_dir/{train,val}.bin and
    meta.json. Each file goes wholly to train or val by a hash of its path relative to `root`;
    if that leaves val empty (e.g. one file), val is the last val_fraction of the token stream.
    Written atomically: out_dir is either the old complete version or the new one. out_dir must be
    new, empty or an earlier output (`check_output`): replacing it must not delete the user's files."""
    if not files:
        raise DataError("data prepare: no input files; give text files or directories that contain them")
    check_output(Path(out_dir), files)
    tok = ByteTokenizer()
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    eot = np.array([tok.eot], dtype=np.uint16)
    for f in files:
        name = str(f.relative_to(root)) if root else f.name
        split = "val" if _is_val(name, val_fraction) else "train"
        parts[split] += [tok.encode(Path(f).read_bytes()), eot]
    train = np.concatenate(parts["train"]) if parts["train"] else np.zeros(0, np.uint16)
    val = np.concatenate(parts["val"]) if parts["val"] else np.zeros(0, np.uint16)
    if val_fraction > 0 and (len(val) == 0 or len(train) == 0):
        stream = np.concatenate([train, val])
        cut = int(len(stream) * (1 - val_fraction))
        train, val = stream[:cut], stream[cut:]
    meta = {
        "format": FORMAT_VERSION,
        "dtype": "uint16",
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.name,
        "eot": tok.eot,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "documents": len(files),
    }
    with atomic_directory(Path(out_dir)) as tmp:
        train.tofile(tmp / "train.bin")
        val.tofile(tmp / "val.bin")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


OUTPUT_FILES = frozenset({"meta.json", "train.bin", "val.bin"})


def _is_earlier_output(out_dir: Path) -> bool:
    """Whether out_dir holds exactly what `prepare` writes (its meta.json with the format and
    tokenizer keys, train.bin, val.bin): the only non-empty directory prepare may replace, since
    anything else there is the user's and replacing the directory would delete it."""
    names = {p.name for p in out_dir.iterdir()}
    if not names <= OUTPUT_FILES or "meta.json" not in names:
        return False
    if any(not (out_dir / n).is_file() or (out_dir / n).is_symlink() for n in names):
        return False
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "format" in meta and "tokenizer" in meta


def _inside(path: Path, directory: Path) -> bool:
    """Whether `path` is `directory` or lies under it (both resolved, so links and .. count)."""
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def check_output(out_dir: Path, files: list[Path]) -> None:
    """Refuse an output directory whose replacement would destroy data Strata did not write: an
    existing file, a directory holding anything but an earlier `prepare` output, or one that
    holds input files."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        raise DataError(
            f"data prepare: --out {str(out_dir)!r} is a symbolic link; name the directory it points to, or a new one"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(
            f"data prepare: --out {str(out_dir)!r} is an existing file, not a directory; "
            "name a new directory (it is created) so the file is kept"
        )
    inside = [f for f in files if _inside(Path(f), out_dir)]
    if inside:
        raise DataError(
            f"data prepare: input {str(inside[0])!r} lies inside --out {str(out_dir)!r}, which is replaced "
            "by the output; name an --out directory outside the inputs"
        )
    if out_dir.is_dir() and any(out_dir.iterdir()) and not _is_earlier_output(out_dir):
        extra = sorted(p.name for p in out_dir.iterdir() if p.name not in OUTPUT_FILES)
        if extra:
            what = f"it holds {', '.join(extra[:5])}"
        elif not (out_dir / "meta.json").is_file():
            what = "it has no meta.json"
        else:
            what = "its meta.json is not one `strata data prepare` wrote"
        raise DataError(
            f"data prepare: --out {str(out_dir)!r} is not empty and not an earlier `strata data prepare` "
            f"output ({what}); it would be replaced, so name a new or empty directory"
        )


def check_output_outside_inputs(out_dir: Path, input_dirs: list[Path]) -> None:
    """Refuse an output directory inside an input directory: the next run would tokenize it."""
    for d in input_dirs:
        if _inside(Path(out_dir), Path(d)):
            raise DataError(
                f"data prepare: --out {str(out_dir)!r} lies inside the input directory {str(d)!r}, so a later "
                "run would tokenize its own output; name an --out directory outside the inputs"
            )


def expand_inputs(inputs: list[str], pattern: str = "*", out_dir: Path | None = None) -> tuple[list[Path], Path | None]:
    """Files named directly, plus files matching `pattern` under named directories, sorted;
    with `out_dir`, refuse it when it lies inside one of the directories."""
    if out_dir is not None:
        check_output_outside_inputs(out_dir, [Path(i) for i in inputs if Path(i).is_dir()])
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files += sorted(q.resolve() for q in p.rglob(pattern) if q.is_file())
        elif p.is_file():
            files.append(p.resolve())
        else:
            raise DataError(f"data prepare: input {item!r} does not exist")
    common = Path(os.path.commonpath([str(f) for f in files])) if files else None
    if common is not None and common.is_file():
        common = common.parent
    return files, common


def default_corpus_dir(cache_dir: str | None) -> Path:
    base = Path(cache_dir or os.environ.get("STRATA_CACHE") or Path.home() / ".cache" / "strata")
    return base / "stdlib-byte"


def ensure_default_corpus(cache_dir: str | None, val_fraction: float) -> Path:
    """The built-in corpus directory, preparing it on first use (a few seconds)."""
    out = default_corpus_dir(cache_dir)
    if not (out / "meta.json").is_file():
        root = Path(sysconfig.get_paths()["stdlib"])
        prepare(stdlib_corpus_files(), out, val_fraction, root=root)
    return out


# --- reading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenMeta:
    dtype: str
    vocab_size: int
    tokenizer: str


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
    return TokenMeta(meta["dtype"], vocab, tokenizer if isinstance(tokenizer, str) else "unknown")


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


def check_data_dir(data_dir: Path, seq_len: int) -> None:
    """Everything `TokenDataset` refuses about a data directory (meta.json, both token files, their
    ids), checked before any worker starts."""
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
