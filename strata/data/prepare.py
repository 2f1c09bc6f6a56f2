"""`strata data prepare`: text, JSON Lines and Parquet files tokenized in parallel worker processes
into the nanoGPT layout (DIR/train.bin, DIR/val.bin: flat token ids) plus DIR/meta.json, and
DIR/tokenizer.json for any tokenizer but `bytes`.

Inputs by suffix: `.jsonl`/`.ndjson` hold one JSON object per line (the text in one field),
`.parquet` one document per row (the text in one column), anything else is one text document per
file. The work is cut into tasks of about `CHUNK_BYTES` (groups of text files, line ranges of a
JSON Lines file, Parquet row groups), fixed by the inputs alone; workers tokenize tasks and return
their token arrays, and the parent appends them to the open output files in task order, so the
output is the same for any number of workers and neither the corpus nor its tokens are ever held
in memory whole (at most 2 tasks per worker are in flight).

Validation split: a text file goes wholly to val or train by a hash of its path (relative to the
inputs' common directory); a JSON Lines document by a hash of (that path, its line number), a
Parquet document by (that path, its row number from 0), so a split does not depend on how the work
was cut or on where the corpus lives.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from strata.atomic import atomic_directory
from strata.data import tokenize
from strata.data.tokenize import BYTES_INFO, ByteTokenizer, TokenizerInfo
from strata.data.tokens import docs_file, mask_file
from strata.errors import DataError

FORMAT_VERSION = 2  # 2: meta.json's tokenizer is an object, tokenizer.json may sit beside the data
CHUNK_BYTES = 4 << 20
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_ROWS_PER_BATCH = 4096
# what prepare writes (conversations add their masks, boundaries and chat template): the only
# files of a directory it may replace
OUTPUT_FILES = frozenset(
    {"meta.json", "train.bin", "val.bin", tokenize.TOKENIZER_FILE, "chat_template.jinja"}
    | {name(split) for name in (mask_file, docs_file) for split in ("train", "val")}
)

__all__ = ["ByteTokenizer", "prepare", "check_output", "expand_inputs", "stdlib_corpus_files"]


def stdlib_corpus_files() -> list[Path]:
    """The Python standard library's own .py sources (no tests, no site-packages), sorted:
    a real text corpus present on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def is_val(name: str, val_fraction: float) -> bool:
    """Deterministic per-document split by a hash of its name (stable across machines)."""
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "little")
    return h / 2**64 < val_fraction


def input_format(path: Path) -> str:
    suffix = path.suffix.lower()
    return "jsonl" if suffix in JSONL_SUFFIXES else "parquet" if suffix == ".parquet" else "text"


# --- cutting the work into tasks (in the parent) ----------------------------------------------


@dataclass(frozen=True)
class Task:
    """One unit of work: text files, a byte range of whole lines of one JSON Lines file, or one
    Parquet row group. `first` is the line number at `start` (JSON Lines) or the group's first row
    (Parquet)."""

    fmt: str
    items: tuple[tuple[str, str], ...]  # (path, name for the split hash)
    start: int = 0
    end: int = 0
    first: int = 0
    row_group: int = 0


def open_parquet(path: str, text_field: str | None):
    """The Parquet file at `path`, its `text_field` checked to be a text column (None: any
    columns, as conversations are read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    if text_field is None:
        return pf
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"{path}: no column {text_field!r} (columns: {', '.join(schema.names[:10])}); "
            "name the text column with --text-field"
        )
    kind = schema.field(text_field).type
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
    ):
        raise DataError(
            f"{path}: column {text_field!r} holds {kind}, not text; name the text "
            "column with --text-field"
        )
    return pf


def _jsonl_tasks(path: Path, name: str, chunk_bytes: int) -> Iterator[Task]:
    """Ranges of whole lines of about chunk_bytes, with the line number each starts at."""
    size = path.stat().st_size
    start, line = 0, 1
    with open(path, "rb") as f:
        while start < size:
            f.seek(start)
            data = f.read(chunk_bytes)
            if start + len(data) < size and not data.endswith(b"\n"):
                data += f.readline()
            yield Task("jsonl", ((str(path), name),), start, start + len(data), line)
            start += len(data)
            line += data.count(b"\n")


def plan(
    files: list[Path], root: Path | None, text_field: str | None, chunk_bytes: int = CHUNK_BYTES
) -> list[Task]:
    """The tasks for `files`, in output order. Parquet files are opened here, so a file that is not
    Parquet or lacks the text column (`text_field`; None for conversations) fails before any work
    starts."""
    tasks: list[Task] = []
    group: list[tuple[str, str]] = []
    group_bytes = 0
    for f in files:
        f = Path(f)
        name = str(f.relative_to(root)) if root else f.name
        fmt = input_format(f)
        if fmt == "text":
            group.append((str(f), name))
            group_bytes += f.stat().st_size
            if group_bytes >= chunk_bytes:
                tasks.append(Task("text", tuple(group)))
                group, group_bytes = [], 0
            continue
        if group:
            tasks.append(Task("text", tuple(group)))
            group, group_bytes = [], 0
        if fmt == "jsonl":
            tasks += _jsonl_tasks(f, name, chunk_bytes)
        else:
            meta = open_parquet(str(f), text_field).metadata
            first = 0
            for g in range(meta.num_row_groups):
                tasks.append(Task("parquet", ((str(f), name),), first=first, row_group=g))
                first += meta.row_group(g).num_rows
    if group:
        tasks.append(Task("text", tuple(group)))
    return tasks


# --- reading documents (in a worker, or the parent when training a BPE) ----------------------


def read_documents(
    task: Task, text_field: str, as_bytes: bool
) -> Iterator[tuple[str, str | bytes]]:
    """(split key, document) for each document of the task, in order; bytes when `as_bytes`."""
    if task.fmt == "text":
        return _text_documents(task, as_bytes)
    if task.fmt == "jsonl":
        return _jsonl_documents(task, text_field, as_bytes)
    return _parquet_documents(task, text_field, as_bytes)


def _text_documents(task: Task, as_bytes: bool) -> Iterator[tuple[str, str | bytes]]:
    """Each text file of the task whole, keyed by its name (UTF-8, undecodable bytes replaced)."""
    for path, name in task.items:
        data = Path(path).read_bytes()
        yield name, data if as_bytes else data.decode("utf-8", errors="replace")


def _jsonl_documents(
    task: Task, text_field: str, as_bytes: bool
) -> Iterator[tuple[str, str | bytes]]:
    """The `text_field` of each line in the task's byte range, keyed by name and line number; blank
    lines and null texts are skipped, any other line that holds no text is a DataError naming it."""
    path, name = task.items[0]
    with open(path, "rb") as f:
        f.seek(task.start)
        data = f.read(task.end - task.start)
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        text = _jsonl_text(line, f"{path}:{task.first + i}", text_field)
        if text is None:
            continue
        yield f"{name}:{task.first + i}", text.encode() if as_bytes else text


def _jsonl_text(line: bytes, where: str, text_field: str) -> str | None:
    """The text of one JSON Lines record (None when the field is null); a DataError at `where`
    when the line is not a JSON object with a text `text_field`."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({e}); each line must be one JSON object") from e
    if not isinstance(obj, dict):
        raise DataError(
            f"{where}: a JSON {type(obj).__name__}, not an object with a {text_field!r} field"
        )
    if text_field not in obj:
        raise DataError(
            f"{where}: no {text_field!r} field (fields: {', '.join(list(obj)[:10])}); "
            "name the text field with --text-field"
        )
    text = obj[text_field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} holds a {type(text).__name__}, not text")
    return text


def _parquet_documents(
    task: Task, text_field: str, as_bytes: bool
) -> Iterator[tuple[str, str | bytes]]:
    """The non-null `text_field` of each row of the task's row group, keyed by name and row number;
    a DataError when the row group cannot be read."""
    import pyarrow as pa

    path, name = task.items[0]
    pf = open_parquet(path, text_field)
    row = task.first
    try:
        batches = pf.iter_batches(
            batch_size=PARQUET_ROWS_PER_BATCH, row_groups=[task.row_group], columns=[text_field]
        )
        for batch in batches:
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield f"{name}:{row}", text.encode() if as_bytes else text
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"{path}: row group {task.row_group} cannot be read ({e}); the Parquet file is damaged"
        ) from e


def run_task(
    task: Task, text_field: str, val_fraction: float, eot: int, dtype: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """A task's (train tokens, val tokens, documents), each document followed by the end-of-document id."""
    as_bytes = isinstance(tokenize._worker_tok, ByteTokenizer)
    parts: dict[bool, list] = {False: [], True: []}
    n = 0
    for key, doc in read_documents(task, text_field, as_bytes):
        parts[is_val(key, val_fraction)].append(doc)
        n += 1
    return (
        tokenize.encode_documents(parts[False], eot, dtype),
        tokenize.encode_documents(parts[True], eot, dtype),
        n,
    )


# --- preparing ------------------------------------------------------------------------------


def task_results(
    tasks: list[Task], args: tuple, workers: int, tok_path: str | None, work: Callable = run_task
) -> Iterator:
    """`work`'s results (run_task's, or another top-level function of a task and `args`) in task
    order: in this process for one worker, else from a pool with at most 2 tasks per worker in
    flight (which bounds memory whatever the corpus size)."""
    if workers <= 1:
        tokenize.start_worker(tok_path, threads=True)
        for t in tasks:
            yield work(t, *args)
        return
    ctx = get_context("spawn")  # fork after the tokenizers library has started its threads can hang
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_start_worker, initargs=(tok_path, os.getpid())
    )
    try:
        pending: deque[Future] = deque()
        todo = iter(tasks)
        for t in todo:
            pending.append(pool.submit(work, t, *args))
            if len(pending) >= 2 * workers:
                break
        while pending:
            result = pending.popleft().result()
            following = next(todo, None)
            if following is not None:
                pending.append(pool.submit(work, following, *args))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _start_worker(tok_path: str | None, parent: int) -> None:
    """A pool worker's start: it dies with `parent` (`die_with_parent`), then loads the
    tokenizer."""
    die_with_parent(parent)
    tokenize.start_worker(tok_path, False)


def die_with_parent(parent: int) -> None:
    """End this process when process `parent` dies, however it dies: a pool's workers otherwise
    outlive a `kill -9` of their parent, each tokenizing on, for as long as their tasks last. On
    Linux the kernel sends SIGKILL (prctl PR_SET_PDEATHSIG); elsewhere a thread watches the parent
    id. A parent already gone (before the prctl took effect) ends the process at once."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:
                os._exit(1)
            return
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def remove_stale_temporaries(out_dir: Path) -> None:
    """Remove the temporary directories earlier writes of out_dir left when they were killed
    (`atomic_directory` names them .NAME.tmp-PID): those of processes no longer running on this
    host, so a killed run costs no disk once the next one starts."""
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether process `pid` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def copy_range(src: Path, dst: Path, start: int) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fi.seek(start)
        shutil.copyfileobj(fi, fo, 1 << 20)


def _ensure_val_split(
    tmp: Path, itemsize: int, n_train: int, n_val: int, val_fraction: float
) -> tuple[int, int]:
    """If the hash left one split empty (e.g. one input file), val becomes the last val_fraction of
    the token stream, moved on disk without reading the stream into memory."""
    total = n_train + n_val
    if val_fraction <= 0 or total == 0 or (n_train and n_val):
        return n_train, n_val
    src = tmp / ("train.bin" if n_train else "val.bin")
    cut = int(total * (1 - val_fraction))
    copy_range(src, tmp / "val.tail", cut * itemsize)
    os.truncate(src, cut * itemsize)
    os.replace(src, tmp / "train.bin")
    os.replace(tmp / "val.tail", tmp / "val.bin")
    return cut, total - cut


def progress_bar(enabled: bool):
    from tqdm import tqdm

    return tqdm(
        desc="data prepare",
        unit="tok",
        unit_scale=True,
        file=sys.stderr,
        disable=None if enabled else True,
        leave=True,
    )


def _tokenizer_source(
    tokenizer: str, eot_token: str | None
) -> tuple[int | None, TokenizerInfo, Path | None]:
    """What `--tokenizer` and `--eot-token` name: (the vocabulary of a BPE to train, or None; the
    tokenizer's info, the bytes' until a BPE is trained; the tokenizer.json to copy, or None)."""
    bpe = tokenize.bpe_vocab(tokenizer)
    if tokenizer != "bytes" and bpe is None:
        info, tok_src = tokenize.file_info(tokenizer, eot_token)
        return bpe, info, tok_src
    if eot_token is not None:
        raise DataError(
            f"--eot-token names a token of a tokenizer.json; --tokenizer {tokenizer} has its own "
            "end-of-document token"
        )
    return bpe, BYTES_INFO, None


def _write_splits(
    tmp: Path, tasks: list[Task], args: tuple, workers: int, tok_path: str | None, progress: bool
) -> tuple[dict[str, int], int, int]:
    """Tokenize the tasks (by `workers` processes) into tmp/train.bin and tmp/val.bin, in task
    order; returns the tokens written to each split, the documents read and the largest token id
    written (-1 when none)."""
    n_docs = 0
    max_id = -1
    counts = {"train": 0, "val": 0}
    bar = progress_bar(progress)
    with open(tmp / "train.bin", "wb") as train_f, open(tmp / "val.bin", "wb") as val_f, bar:
        for train, val, n in task_results(tasks, args, workers, tok_path):
            train.tofile(train_f)
            val.tofile(val_f)
            counts["train"] += len(train)
            counts["val"] += len(val)
            n_docs += n
            for part in (train, val):
                if len(part):
                    max_id = max(max_id, int(part.max()))
            bar.update(len(train) + len(val))
            bar.set_postfix_str(f"{n_docs:,} documents", refresh=False)
    return counts, n_docs, max_id


def prepare(
    files: list[Path],
    out_dir: Path,
    val_fraction: float = 0.05,
    root: Path | None = None,
    *,
    tokenizer: str = "bytes",
    text_field: str = "text",
    workers: int | None = None,
    eot_token: str | None = None,
    progress: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict:
    """Tokenize `files` into out_dir/{train,val}.bin and meta.json (see the module docstring), each
    document followed by the end-of-document token; returns meta.json's content. `tokenizer` is
    bytes, bpe:N (trained here on all input documents, saved as out_dir/tokenizer.json) or the path
    of a tokenizer.json or a model directory holding one (copied to out_dir/tokenizer.json).
    `workers` processes tokenize (None: one per CPU). If the split leaves val or train empty
    (e.g. one file), val is the last val_fraction of the token stream. Written atomically: out_dir
    is either the old complete version or the new one. out_dir must be new, empty or an earlier
    output (`check_output`): replacing it must not delete the user's files. `progress` shows a
    progress bar on stderr when it is a terminal."""
    if not files:
        raise DataError(
            "data prepare: no input files; give text, .jsonl or .parquet files, or directories "
            "holding them"
        )
    check_output(Path(out_dir), files)
    bpe, info, tok_src = _tokenizer_source(tokenizer, eot_token)
    tasks = plan(list(files), root, text_field, chunk_bytes)
    workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    remove_stale_temporaries(Path(out_dir))
    with atomic_directory(Path(out_dir)) as tmp:
        tok_file = tmp / tokenize.TOKENIZER_FILE
        if bpe is not None:
            docs = (
                str(doc) for t in tasks for _, doc in read_documents(t, text_field, as_bytes=False)
            )
            info = tokenize.train_bpe(bpe, docs, tok_file)
        elif tok_src is not None:
            shutil.copyfile(tok_src, tok_file)
        dtype = info.dtype
        args = (text_field, val_fraction, info.eot, dtype)
        tok_path = None if info.kind == "bytes" else str(tok_file)
        counts, n_docs, max_id = _write_splits(tmp, tasks, args, workers, tok_path, progress)
        itemsize = np.dtype(dtype).itemsize
        n_train, n_val = _ensure_val_split(
            tmp, itemsize, counts["train"], counts["val"], val_fraction
        )
        meta = {
            "format": FORMAT_VERSION,
            "dtype": dtype,
            "vocab_size": info.vocab_size,
            "eot": info.eot,
            # the largest id in either split: opening the data checks it against the vocabulary
            # instead of reading every token
            "max_id": max_id,
            "tokenizer": info.meta(),
            "train_tokens": n_train,
            "val_tokens": n_val,
            "documents": n_docs,
            "files": len(files),
            "text_field": text_field,
            "val_fraction": val_fraction,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


# --- where the output may go ----------------------------------------------------------------


def _is_earlier_output(out_dir: Path) -> bool:
    """Whether out_dir holds exactly what `prepare` writes (its meta.json with the format and
    tokenizer keys, train.bin, val.bin, perhaps tokenizer.json): the only non-empty directory
    prepare may replace, since anything else there is the user's and replacing the directory
    would delete it."""
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
            f"data prepare: --out {str(out_dir)!r} is a symbolic link; name the directory it "
            "points to, or a new one"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(
            f"data prepare: --out {str(out_dir)!r} is an existing file, not a directory; "
            "name a new directory (it is created) so the file is kept"
        )
    inside = [f for f in files if _inside(Path(f), out_dir)]
    if inside:
        raise DataError(
            f"data prepare: input {str(inside[0])!r} lies inside --out {str(out_dir)!r}, which is "
            "replaced by the output; name an --out directory outside the inputs"
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
            f"data prepare: --out {str(out_dir)!r} is not empty and not an earlier `strata data "
            f"prepare` output ({what}); it would be replaced, so name a new or empty directory"
        )


def check_output_outside_inputs(out_dir: Path, input_dirs: list[Path]) -> None:
    """Refuse an output directory inside an input directory: the next run would tokenize it."""
    for d in input_dirs:
        if _inside(Path(out_dir), Path(d)):
            raise DataError(
                f"data prepare: --out {str(out_dir)!r} lies inside the input directory "
                f"{str(d)!r}, so a later "
                "run would tokenize its own output; name an --out directory outside the inputs"
            )


def expand_inputs(
    inputs: list[str], pattern: str = "*", out_dir: Path | None = None
) -> tuple[list[Path], Path | None]:
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
    """The built-in corpus directory (byte-level), preparing it on first use (a few seconds)."""
    out = default_corpus_dir(cache_dir)
    if not (out / "meta.json").is_file():
        root = Path(sysconfig.get_paths()["stdlib"])
        prepare(stdlib_corpus_files(), out, val_fraction, root=root, workers=1)
    return out
