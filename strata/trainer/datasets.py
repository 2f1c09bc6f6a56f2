"""The data a run trains and evaluates on, as its config names it: one prepared directory (checked
against the config: its tokenizer and vocabulary), a mixture of sources, or the built-in corpus,
which rank 0 prepares once; the start-up banner's line about it, the warning for conversations
trained without data.document_mask, and the check that preference pairs meet train.objective=dpo."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from strata.config import Config, DataConfig
from strata.data.mixture import Mixture, open_mixture
from strata.data.prepare import ensure_default_corpus
from strata.data.tokens import TokenDataset, check_data_config, read_meta
from strata.errors import DataError
from strata.parallel import comm


@dataclass(frozen=True)
class RunData:
    """A run's training and validation splits, and the (first) prepared directory they come from,
    with the config key that names it."""

    train: TokenDataset | Mixture
    val: TokenDataset | Mixture
    path: Path
    key: str


def open_data(cfg: Config, rank: int) -> RunData:
    """The splits `cfg` trains and evaluates on (collective when it names no data: the built-in
    corpus)."""
    data, seq_len = cfg.data, cfg.model.seq_len
    train: TokenDataset | Mixture
    val: TokenDataset | Mixture
    if data.sources:
        train, val = open_mixture(data, seq_len, cfg.model.vocab_size)
        return RunData(train, val, Path(data.sources[0].path), "data.sources[0].path")
    path = Path(data.path) if data.path else _default_corpus(data, rank)
    check_data_config(path, cfg)  # data.tokenizer and model.vocab_size against meta.json
    train, val = TokenDataset(path, "train", seq_len), TokenDataset(path, "val", seq_len)
    return RunData(train, val, path, "data.path")


def describe(data: DataConfig) -> str:
    """What a run trains on and its tokenizer, for the start-up banner."""
    if data.sources:
        return (
            f"a mixture of {len(data.sources)} sources ({', '.join(s.path for s in data.sources)})"
        )
    if data.path:
        return f"{data.path} (tokenizer: {read_meta(Path(data.path)).tokenizer})"
    return (
        "the built-in corpus (Python's standard library sources, byte-level tokens, "
        f"{data.val_fraction:g} held "
        "out); set data.path to a directory `strata data prepare` made to train on your own"
    )


def _default_corpus(data: DataConfig, rank: int) -> Path:
    """Rank 0 prepares the built-in corpus once; the others wait, then read it."""
    if rank == 0:
        ensure_default_corpus(data.cache_dir, data.val_fraction)
    comm.barrier()
    return ensure_default_corpus(data.cache_dir, data.val_fraction)


def document_mask_warning(cfg: Config, data: RunData) -> str | None:
    """The start-up warning for conversations (loss masks) trained without data.document_mask: the
    conversations packed into one window would attend to each other. A warning, not a default that
    depends on the data: the config says what a run does, and a run may mean to attend across them
    (as transformers' trainers do on packed data without padding-free attention)."""
    train = data.train
    if cfg.data.document_mask or not train.has_mask:
        return None
    where = f"{data.key}={str(data.path)!r}"
    if isinstance(train, Mixture):
        where = next(
            f"data.sources[{i}].path={name!r}"
            for i, (name, source) in enumerate(zip(train.names, train.datasets))
            if source.has_mask
        )
    return (
        f"{where} holds conversations packed several to a window, and "
        "data.document_mask is off: each conversation attends to those before it in its window; "
        "set data.document_mask=true (and data.reset_positions=true for positions counted from "
        "each conversation's start) to train each as if alone"
    )


def check_objective(cfg: Config, data: RunData) -> None:
    """Preference pairs (meta.json's chat block says "pairs") train with train.objective=dpo
    only, and dpo trains on nothing else: a DataError naming the fix otherwise."""
    chat = read_meta(data.path, data.key).raw.get("chat")
    pairs = isinstance(chat, dict) and chat.get("pairs") is True
    where = f"{data.key}={str(data.path)!r}"
    if cfg.train.objective == "dpo" and not pairs:
        raise DataError(
            f"train.objective=dpo trains on preference pairs, but {where} holds none; prepare "
            "records with 'chosen' and 'rejected' (and 'prompt') with `strata data prepare "
            "--chat-template ...`, or set train.objective=lm"
        )
    if pairs and cfg.train.objective != "dpo":
        raise DataError(
            f"{where} holds preference pairs, which train.objective=lm would train on both the "
            "chosen and the rejected completion; set train.objective=dpo"
        )
