"""`strata data prepare` for conversations (supervised fine-tuning data): JSON Lines or Parquet
records (`messages`, `prompt`/`completion`, Alpaca's `instruction`/`input`/`output`) rendered with a
chat template (`strata.data.chat`), tokenized with their loss mask by worker processes, and packed
into windows of seq_len + 1 tokens that never cut a conversation.

Each conversation is its template's tokens followed by the end-of-document token, which must not
occur inside any conversation (a chat model's eos_token is often its end of turn, so the default
is the first usual end-of-document token the template does not write). Conversations are packed
best-fit decreasing (TRL's `bfd`; `Packer`): a worker task's conversations, longest first, each
into the open window whose free space it fills best; what is left of a window is padding (the
end-of-document id, mask 0). One longer than seq_len tokens is
truncated to its first seq_len tokens (TRL's and torchtune's default) or dropped (`--long drop`);
one with no trained token left is dropped; meta.json counts both. A conversation's first token
never carries loss (nothing before it in its window may predict it, as transformers'
DataCollatorWithFlattening labels it), nor does its end-of-document token or padding.

Preference pairs (records with `chosen` and `rejected`; all records of an input, or none) become
two conversations, prompt + chosen then prompt + rejected, each trained on its completion only
(TRL's completion mask), packed side by side in one window that never cuts the pair: a window's
conversations alternate chosen, rejected, so its conversations 2k and 2k+1 are pair k, and
meta.json's chat block says `"pairs": true`. A pair longer than the window is truncated as TRL's
`keep_start` truncates both sequences to one `max_length`, the largest that fits the pair in the
window (or dropped with `--long drop`); one with a side left without a trained token is dropped.

The split between train and val is per conversation (per pair), by the hash `strata data prepare`
uses for any JSON Lines or Parquet document; the output does not depend on the number of workers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.atomic import atomic_directory
from strata.data import tokenize
from strata.data.chat import (
    LONG_POLICIES,
    LOSS_ON,
    ChatTemplate,
    conversation,
    end_of_turn,
    is_chat_record,
    is_preference_record,
    load_template,
    loss_spans,
    preference,
    render,
    token_mask,
)
from strata.data.packing import Encoded, Packer
from strata.data.prepare import (
    CHUNK_BYTES,
    PARQUET_ROWS_PER_BATCH,
    Task,
    check_output,
    copy_range,
    input_format,
    is_val,
    open_parquet,
    plan,
    progress_bar,
    remove_stale_temporaries,
    task_results,
)
from strata.data.tokenize import EOT_CANDIDATES, TokenizerInfo
from strata.data.tokens import docs_file, mask_file
from strata.errors import DataError

FORMAT_VERSION = 3  # 3: conversations, with meta.json's "chat" block, masks and boundaries
CHAT_COLUMNS = (
    "messages",
    "prompt",
    "completion",
    "instruction",
    "input",
    "output",
    "tools",
    "chosen",
    "rejected",
)
SPLITS = ("train", "val")


# --- reading records ----------------------------------------------------------------------------


def _jsonl_records(task: Task) -> list[tuple[str, str, dict]]:
    """(split key, where, record) for each non-blank line of a JSON Lines task."""
    path, name = task.items[0]
    with open(path, "rb") as f:
        f.seek(task.start)
        data = f.read(task.end - task.start)
    out = []
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        where = f"{path}:{task.first + i}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"{where}: not valid JSON ({e}); each line must be one object") from e
        if not isinstance(record, dict):
            raise DataError(f"{where}: a JSON {type(record).__name__}, not a conversation object")
        out.append((f"{name}:{task.first + i}", where, record))
    return out


def _parquet_records(task: Task) -> list[tuple[str, str, dict]]:
    """(split key, where, record) for each row of a Parquet task's row group (its conversation
    columns only)."""
    import pyarrow as pa

    path, name = task.items[0]
    pf = open_parquet(path, None)
    columns = [c for c in CHAT_COLUMNS if c in pf.schema_arrow.names]
    out, row = [], task.first
    try:
        for batch in pf.iter_batches(
            batch_size=PARQUET_ROWS_PER_BATCH, row_groups=[task.row_group], columns=columns
        ):
            for record in batch.to_pylist():
                out.append((f"{name}:{row}", f"{path} row {row}", record))
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"{path}: row group {task.row_group} cannot be read ({e}); the Parquet file is damaged"
        ) from e
    return out


def holds_conversations(files: list[Path], text_field: str) -> bool:
    """Whether the inputs are conversations: the first record of the first JSON Lines or Parquet
    file has no `text_field` but has a conversation's fields."""
    record = _first_record(files)
    return record is not None and text_field not in record and is_chat_record(record)


def holds_pairs(files: list[Path]) -> bool:
    """Whether the inputs are preference pairs: the first record of the first JSON Lines or Parquet
    file has `chosen` and `rejected`."""
    record = _first_record(files)
    return record is not None and is_preference_record(record)


def _first_record(files: list[Path]) -> dict | None:
    """The first record of the first JSON Lines or Parquet file (a Parquet file's column names, as
    keys), or None: no such file, or a first line that is not a JSON object (the text reader says
    what is wrong with it)."""
    first = next((f for f in files if input_format(Path(f)) != "text"), None)
    if first is None:
        return None
    if input_format(Path(first)) == "parquet":
        return dict.fromkeys(open_parquet(str(first), None).schema_arrow.names)
    with open(first, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return None
                return record if isinstance(record, dict) else None
    return None


# --- encoding in a worker -----------------------------------------------------------------------


@dataclass(frozen=True)
class ChatJob:
    """What each worker needs to encode conversations (sent with every task)."""

    template: ChatTemplate
    loss_on: str
    seq_len: int
    long: str
    eot: int
    eot_token: str
    dtype: str
    val_fraction: float
    pairs: bool = False  # preference pairs: every record a (chosen, rejected) pair


def _fit(ids: np.ndarray, mask: np.ndarray, job: ChatJob, counts: Counter) -> tuple | None:
    """One conversation's ids and mask as stored (end-of-document token appended, the long policy
    applied, the first token's loss off), or None when dropped; counts what happened."""
    if len(ids) + 1 > job.seq_len + 1:
        if job.long == "drop":
            counts["dropped_long"] += 1
            return None
        counts["truncated"] += 1
        ids, mask = ids[: job.seq_len], mask[: job.seq_len]
    ids = np.append(ids, job.eot).astype(job.dtype)
    mask = np.append(mask, 0).astype(np.uint8)
    mask[0] = 0
    if not mask.any():
        counts["dropped_untrained"] += 1
        return None
    return ids, mask


def _pair_cut(a: int, b: int, window: int) -> int | None:
    """The `max_length` both sides of a pair of `a` and `b` tokens are cut to so that both, each
    with its end-of-document token, fill at most `window` (TRL's keep_start truncation with the
    largest max_length that fits), or None when the pair fits whole."""
    short, long = sorted((a, b))
    if a + b + 2 <= window:
        return None
    if 2 * short + 2 <= window:
        return window - 2 - short
    return (window - 2) // 2


def _fit_pair(
    chosen: tuple[np.ndarray, np.ndarray],
    rejected: tuple[np.ndarray, np.ndarray],
    job: ChatJob,
    counts: Counter,
) -> list[tuple] | None:
    """A pair's two conversations as stored (`_fit`'s), cut to fit one window together, or None
    when dropped; counts what happened (once per pair)."""
    cut = _pair_cut(len(chosen[0]), len(rejected[0]), job.seq_len + 1)
    if cut is not None:
        if job.long == "drop":
            counts["dropped_long"] += 1
            return None
        counts["truncated"] += 1
    sides = []
    for ids, mask in (chosen, rejected):
        ids, mask = ids[:cut], mask[:cut]  # [:None] keeps all
        mask = np.append(mask, 0).astype(np.uint8)
        mask[0] = 0
        sides.append((np.append(ids, job.eot).astype(job.dtype), mask))
    if not all(mask.any() for _, mask in sides):
        counts["dropped_untrained"] += 1
        return None
    return sides


def _conversations(records: list, job: ChatJob, counts: Counter) -> list[tuple]:
    """(key, where, text, spans) of each conversation of the records (a pair's two in a row)."""
    rendered = []
    for key, where, record in records:
        if is_preference_record(record) != job.pairs:
            raise DataError(
                f"{where}: "
                + (
                    "not a preference pair ('chosen' and 'rejected'), but the first record is"
                    if job.pairs
                    else "a preference pair ('chosen' and 'rejected'), but the first record is not"
                )
                + "; prepare preference pairs and other conversations into directories of their own"
            )
        convs = preference(record, where) if job.pairs else (conversation(record, where),)
        counts[convs[0].kind] += 1
        for conv in convs:
            loss_on = "completion" if job.pairs else job.loss_on
            text, spans = loss_spans(job.template, conv, loss_on, where)
            rendered.append((key, where, text, spans))
    return rendered


def encode_task(task: Task, job: ChatJob) -> tuple[dict[str, Encoded], Counter]:
    """A task's conversations rendered, tokenized and masked, by split; and the counts of records
    read (by kind), truncated and dropped. A pair's two conversations stay side by side."""
    tok = tokenize._worker_tok
    assert tok is not None and not isinstance(tok, tokenize.ByteTokenizer)
    tok.no_truncation()  # transformers ignores a tokenizer.json's own truncation and padding
    tok.no_padding()
    records = _jsonl_records(task) if task.fmt == "jsonl" else _parquet_records(task)
    counts: Counter = Counter()
    rendered = _conversations(records, job, counts)
    encodings = tok.encode_batch([text for _, _, text, _ in rendered], add_special_tokens=False)
    kept: dict[str, list] = {split: [] for split in SPLITS}
    masked = []
    for (key, where, _, spans), enc in zip(rendered, encodings):
        ids = np.asarray(enc.ids, np.int64)
        if (ids == job.eot).any():
            raise DataError(
                f"{where}: the conversation holds the end-of-document token {job.eot_token} "
                f"(id {job.eot}), which must mark only where conversations end: the chat template "
                "writes it as its end of turn or the text contains it; name a token the template "
                "does not write with --eot-token (e.g. <|endoftext|> or <|end_of_text|>)"
            )
        masked.append((key, ids, token_mask(enc.offsets, spans)))
    if job.pairs:
        for (key, *chosen), (_, *rejected) in zip(masked[::2], masked[1::2]):
            sides = _fit_pair(tuple(chosen), tuple(rejected), job, counts)  # type: ignore[arg-type]
            if sides is not None:
                kept["val" if is_val(key, job.val_fraction) else "train"].extend(sides)
    else:
        for key, ids, mask in masked:
            fitted = _fit(ids, mask, job, counts)
            if fitted is not None:
                kept["val" if is_val(key, job.val_fraction) else "train"].append(fitted)
    return {split: Encoded.of(kept[split], job.dtype) for split in SPLITS}, counts


# --- packing (in the parent) ---------------------------------------------------------------------


def _write_packed(
    tmp: Path, tasks: list[Task], job: ChatJob, workers: int, tok_path: str, progress: bool
) -> tuple[dict[str, Packer], Counter, int]:
    """Encode the tasks (by `workers` processes) and pack each split into tmp; returns the packers
    (their counts), the records' counts and the largest token id written."""
    counts: Counter = Counter()
    max_id = job.eot
    bar = progress_bar(progress)
    with ExitStack() as files, bar:
        packers = {
            split: Packer(
                tuple(  # type: ignore[arg-type]
                    files.enter_context(open(tmp / name, "wb"))
                    for name in (f"{split}.bin", mask_file(split), docs_file(split))
                ),
                job.seq_len + 1,
                job.eot,
                job.dtype,
                job.pairs,
            )
            for split in SPLITS
        }
        for parts, task_counts in task_results(tasks, (job,), workers, tok_path, encode_task):
            counts.update(task_counts)
            for split, part in parts.items():
                packers[split].add(part)
                if len(part.tokens):
                    max_id = max(max_id, int(part.tokens.max()))
                bar.update(len(part.tokens))
            bar.set_postfix_str(f"{sum(counts[k] for k in KINDS):,} conversations", refresh=False)
        for packer in packers.values():
            packer.close()
    return packers, counts, max_id


KINDS = ("messages", "prompt_completion", "alpaca", "preference")


def _ensure_val_windows(tmp: Path, window: int, itemsize: int, windows: dict, docs: dict,
                        val_fraction: float) -> bool:  # fmt: skip
    """If the hash left one split empty, val becomes the last val_fraction of the windows (with
    their masks and conversations, offsets rebased); `windows` and `docs` are updated. Returns
    whether anything moved."""
    total = windows["train"] + windows["val"]
    if val_fraction <= 0 or total == 0 or (windows["train"] and windows["val"]):
        return False
    src = "train" if windows["train"] else "val"
    cut = int(total * (1 - val_fraction))
    spans = np.fromfile(tmp / docs_file(src), np.int64).reshape(-1, 2)
    moved = int(np.searchsorted(spans[:, 0], cut * window))
    for name, size in ((f"{src}.bin", itemsize), (mask_file(src), 1)):
        copy_range(tmp / name, tmp / f"{name}.tail", cut * window * size)
        os.truncate(tmp / name, cut * window * size)
    (spans[moved:] - cut * window).tofile(tmp / f"{docs_file(src)}.tail")
    spans[:moved].tofile(tmp / docs_file(src))
    for name in (f"{src}.bin", mask_file(src), docs_file(src)):
        os.replace(tmp / name, tmp / name.replace(src, "train", 1))
        os.replace(tmp / f"{name}.tail", tmp / name.replace(src, "val", 1))
    windows.update(train=cut, val=total - cut)
    docs.update(train=moved, val=len(spans) - moved)
    return True


# --- the end-of-document token --------------------------------------------------------------


def _template_ids(tok, template: ChatTemplate) -> set[int]:
    """The ids a short conversation rendered by the template holds (its end-of-turn tokens among
    them); with a system message if the template takes one."""
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "bye"},
    ]
    try:
        text, _ = render(template, [{"role": "system", "content": "s"}, *turns], None, False, "")
    except DataError:
        text, _ = render(template, turns, None, False, "a probe conversation")
    return set(tok.encode(text, add_special_tokens=False).ids)


def chat_eot(tok, path: Path, eot_token: str | None, template: ChatTemplate) -> tuple[str, int]:
    """The end-of-document token of conversations: --eot-token unless the template writes it, else
    the first of the model directory's eos_token and the usual ones that the template does not
    write (a chat model's eos_token is often its end of turn)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    written = _template_ids(tok, template)
    if eot_token is not None:
        name, eot = tokenize.find_eot(tok, path, eot_token)
        if eot in written:
            raise DataError(
                f"--eot-token {eot_token}: the chat template ({template.source}) writes it in "
                "every "
                "conversation (an end of turn), so each turn would become its own document; name "
                "a token it does not write, e.g. <|endoftext|> or <|end_of_text|>"
            )
        return name, eot
    for candidate in (template.special.get("eos_token"), *EOT_CANDIDATES):
        if candidate is not None and candidate in vocab and vocab[candidate] not in written:
            return candidate, vocab[candidate]
    raise DataError(
        f"tokenizer {str(path)!r}: none of its eos_token and the usual end-of-document tokens "
        f"({', '.join(EOT_CANDIDATES)}) is a token the chat template does not write; name one that "
        "marks where a conversation ends with --eot-token"
    )


# --- preparing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatOptions:
    """The chat settings of `strata data prepare`: `template` as `--chat-template` names it (None:
    the tokenizer's own), `loss_on` one of LOSS_ON, `seq_len` the model.seq_len the windows are
    packed for, `long` one of LONG_POLICIES."""

    seq_len: int
    template: str | None = None
    loss_on: str = "assistant"
    long: str = "truncate"
    pairs: bool = False  # the records are preference pairs (set by `prepare_chat`)

    def problems(self) -> list[str]:
        """What is wrong with the settings (nothing: they are fine)."""
        out = []
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            out.append(f"--seq-len {self.seq_len}: must be a whole number >= 2 (model.seq_len)")
        if self.loss_on not in LOSS_ON:
            out.append(f"--loss-on {self.loss_on!r}: must be one of {', '.join(LOSS_ON)}")
        if self.loss_on not in ("assistant", "completion") and self.pairs:
            out.append(
                f"--loss-on {self.loss_on}: preference pairs train each completion (TRL's "
                "completion mask); leave --loss-on out"
            )
        if self.long not in LONG_POLICIES:
            out.append(f"--long {self.long!r}: must be one of {', '.join(LONG_POLICIES)}")
        return out


def _chat_tokenizer(tokenizer: str, eot_token: str | None, options: ChatOptions):
    """The tokenizer.json `--tokenizer` names, the chat template and the tokenizer's info (its
    end-of-document token chosen for conversations)."""
    if tokenizer == "bytes" or tokenizer.startswith("bpe:"):
        raise DataError(
            f"--tokenizer {tokenizer}: conversations are tokenized with the tokenizer of the model "
            "to fine-tune; name its tokenizer.json or Hugging Face model directory"
        )
    path = tokenize.tokenizer_file(tokenizer)
    tok = tokenize.load_file_tokenizer(path)
    template = load_template(path.parent, options.template)
    name, eot = chat_eot(tok, path, eot_token, template)
    info = TokenizerInfo(
        "file",
        str(path),
        tokenize.TOKENIZER_FILE,
        tokenize.sha256_file(path),
        name,
        eot,
        tokenize.vocab_size_of(tok),
    )
    return path, template, info


def _chat_meta(job: ChatJob, options: ChatOptions, packers: dict, counts: Counter) -> dict:
    """meta.json's "chat" block."""
    window = options.seq_len + 1
    return {
        "seq_len": options.seq_len,
        "window": window,
        "pad": job.eot,
        "loss_on": "completion" if job.pairs else options.loss_on,
        "long": options.long,
        "template": {
            "source": job.template.source,
            "file": "chat_template.jinja",
            "sha256": job.template.sha256,
            "generation_markers": job.template.marked,
        },
        "records": {kind: counts[kind] for kind in KINDS},
        "pairs": job.pairs,
        "conversations": {split: packers[split].conversations for split in SPLITS},
        "truncated": counts["truncated"],
        "dropped_long": counts["dropped_long"],
        "dropped_untrained": counts["dropped_untrained"],
        "trained_tokens": {split: packers[split].trained for split in SPLITS},
        "windows": {split: packers[split].windows for split in SPLITS},
    }


def prepare_chat(
    files: list[Path],
    out_dir: Path,
    options: ChatOptions,
    val_fraction: float = 0.05,
    root: Path | None = None,
    *,
    tokenizer: str,
    workers: int | None = None,
    eot_token: str | None = None,
    progress: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict:
    """Conversations from JSON Lines and Parquet `files` into out_dir (see the module docstring):
    train.bin/val.bin packed windows, their .mask.bin and .docs.bin, tokenizer.json,
    chat_template.jinja and meta.json (with its "chat" block), written atomically as `prepare`
    writes; returns meta.json's content."""
    if not files:
        raise DataError("data prepare: no input files; give .jsonl or .parquet conversations")
    options = dataclasses.replace(options, pairs=holds_pairs(list(files)))
    problems = options.problems()
    if problems:
        raise DataError("; ".join(problems))
    text = [f for f in files if input_format(Path(f)) == "text"]
    if text:
        raise DataError(
            f"data prepare: {text[0]} is a text file; conversations come as .jsonl or .parquet "
            "records, so prepare text files apart (without the chat options)"
        )
    check_output(Path(out_dir), files)
    path, template, info = _chat_tokenizer(tokenizer, eot_token, options)
    turn_end = end_of_turn(template, tokenize.load_file_tokenizer(path))
    job = ChatJob(
        template,
        options.loss_on,
        options.seq_len,
        options.long,
        info.eot,
        info.eot_token,
        info.dtype,
        val_fraction,
        options.pairs,
    )
    tasks = plan(list(files), root, None, chunk_bytes)
    workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    remove_stale_temporaries(Path(out_dir))
    with atomic_directory(Path(out_dir)) as tmp:
        shutil.copyfile(path, tmp / tokenize.TOKENIZER_FILE)
        (tmp / "chat_template.jinja").write_text(template.text, encoding="utf-8")
        tok_path = str(tmp / tokenize.TOKENIZER_FILE)
        packers, counts, max_id = _write_packed(tmp, tasks, job, workers, tok_path, progress)
        window = options.seq_len + 1
        windows = {split: packers[split].windows for split in SPLITS}
        docs = {split: packers[split].conversations for split in SPLITS}
        itemsize = np.dtype(info.dtype).itemsize
        moved = _ensure_val_windows(tmp, window, itemsize, windows, docs, val_fraction)
        for split in SPLITS:  # the counts as they lie after any move to val
            packers[split].windows, packers[split].conversations = windows[split], docs[split]
        chat = _chat_meta(job, options, packers, counts)
        chat["template"]["special"] = template.special
        chat["end_of_turn"] = [{"token": t, "id": i} for t, i in turn_end]
        if moved:
            chat["trained_tokens"] = _trained(tmp)
        meta = {
            "format": FORMAT_VERSION,
            "dtype": info.dtype,
            "vocab_size": info.vocab_size,
            "eot": info.eot,
            "max_id": max_id,
            "tokenizer": info.meta(),
            "train_tokens": windows["train"] * window,
            "val_tokens": windows["val"] * window,
            "documents": docs["train"] + docs["val"],
            "files": len(files),
            "val_fraction": val_fraction,
            "chat": chat,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _trained(tmp: Path) -> dict[str, int]:
    """The trained tokens of each split, counted from the mask files (after a move to val)."""
    return {
        split: int(np.count_nonzero(np.memmap(tmp / mask_file(split), np.uint8, mode="r")))
        if (tmp / mask_file(split)).stat().st_size
        else 0
        for split in SPLITS
    }
