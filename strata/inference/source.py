"""A trained model opened for use in one process: from a Strata checkpoint (saved in any layout:
each tensor is read whole), a Hugging Face model directory, or a checkpoint torch.distributed.checkpoint
wrote alone (its config given with --config); with the tokenizer it was trained with and the ids
that end a generation.

The weights are read straight into a plain `strata.model.GPT`'s tensors through the readers every
resume uses (`Checkpoint`, `hf_weights.open_weights`, `DcpCheckpoint`), checked as they are read; a
LoRA run's adapters are merged into their weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from strata.checkpoint import store
from strata.checkpoint.pieces import whole_piece
from strata.config import Config
from strata.data.tokenize import ByteTokenizer, load_file_tokenizer
from strata.errors import CheckpointError, DataError, StrataError
from strata.lora import apply_lora, is_adapter, merge_adapters
from strata.model import GPT
from strata.rope import rope_tables


class Tokenizer:
    """Text to ids and back: a tokenizer.json (the `tokenizers` library, special tokens added as the
    file's post-processor says, as transformers' fast tokenizers do), or UTF-8 bytes (`path` None)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._tok = load_file_tokenizer(path) if path is not None else None

    @property
    def library_tokenizer(self):
        """The `tokenizers.Tokenizer` under it (None for bytes)."""
        return self._tok

    def encode(self, text: str, special: bool = True) -> list[int]:
        """The ids of `text`, with the tokenizer's special tokens added unless not `special` (bytes
        have none to add)."""
        if self._tok is None:
            return ByteTokenizer().encode(text.encode()).tolist()
        return self._tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of `ids`, special tokens left out unless not `skip_special` (the byte
        tokenizer's end-of-document id decodes to nothing)."""
        if self._tok is None:
            return ByteTokenizer().decode(ids)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)


@dataclass
class Opened:
    """A model ready to run, and what it came from."""

    model: GPT
    cfg: Config
    tokenizer: Tokenizer
    stop_ids: set[int]  # a generation ends at any of these
    what: str  # the source, for the console


def open_model(
    path: Path,
    config_path: Path | None = None,
    overrides: list[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Opened:
    """The model at `path`, on the CPU in `dtype` (move it with `.to`); `config_path` and
    `overrides` replace or amend the config it carries."""
    from strata.config import loading

    path, overrides = Path(path), list(overrides or [])
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such file or directory; give a run's checkpoint directory, a step_* "
            "directory, a Hugging Face model directory or a DCP checkpoint"
        )
    if (path / "config.json").is_file():
        cfg = loading.load(config_path, [*overrides, f"model.init_from={path}"])
        return _open_hf(path, cfg, dtype)
    if store.is_dcp_only(path):
        if config_path is None:
            raise StrataError(
                f"{path} is a checkpoint torch.distributed.checkpoint wrote alone: it holds no "
                "model shape; give the experiment's config with --config CFG"
            )
        from strata.checkpoint.dcp_source import DcpCheckpoint

        cfg = loading.load(config_path, overrides)
        tokenizer, stop = _run_tokenizer(cfg)
        model = _read_into_model(DcpCheckpoint(path, cfg.model), cfg, dtype, str(path))
        return Opened(model, cfg, tokenizer, stop, f"DCP checkpoint {path}")
    from strata.checkpoint.export import verified_config
    from strata.checkpoint.reader import Checkpoint

    ckpt = Checkpoint(path)
    if ckpt.problems:  # the structural and size check every resume makes
        raise CheckpointError(
            f"checkpoint {ckpt.path} is damaged:\n  " + "\n  ".join(ckpt.problems)
        )
    if config_path is None:
        cfg = loading.from_yaml(verified_config(ckpt), overrides)
    else:
        cfg = loading.load(config_path, overrides)
    what = f"Strata checkpoint {ckpt.path} (step {ckpt.step})"
    tokenizer, stop = _run_tokenizer(cfg)
    return Opened(_read_into_model(ckpt, cfg, dtype, str(ckpt.path)), cfg, tokenizer, stop, what)


def _open_hf(path: Path, cfg: Config, dtype: torch.dtype) -> Opened:
    from strata.checkpoint import hf_weights

    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(
            f"{path}: no tokenizer.json; generation needs the model's fast tokenizer beside it"
        )
    model = _read_into_model(hf_weights.open_weights(path, cfg.model), cfg, dtype, str(path))
    return Opened(
        model,
        cfg,
        Tokenizer(path / "tokenizer.json"),
        _hf_stop_ids(path),
        f"Hugging Face model {path}",
    )


def _hf_stop_ids(path: Path) -> set[int]:
    """eos_token_id of generation_config.json, else of config.json (an id or a list of ids)."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((path / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if eos is not None:
            return {eos} if isinstance(eos, int) else {int(e) for e in eos}
    return set()


def _run_tokenizer(cfg: Config) -> tuple[Tokenizer, set[int]]:
    """The tokenizer of the run's prepared data (its meta.json names it) and its end-of-document
    id; bytes for the built-in corpus."""
    from strata.data.tokens import prepared_tokenizer

    source = cfg.data.prepared_dir()
    if not source:
        return Tokenizer(None), {ByteTokenizer.eot}
    try:
        file, eot = prepared_tokenizer(Path(source))
    except DataError as e:
        raise DataError(
            f"{e}\n(the run's data names its tokenizer: give data.path=DIR for where the prepared "
            "data is now)"
        ) from e
    if file is not None:
        _check_recorded_tokenizer(Path(source), file)
    return Tokenizer(file), set() if eot is None else {eot}


def _check_recorded_tokenizer(data_dir: Path, file: Path) -> None:
    """Refuse a tokenizer.json that is not the one meta.json records (by its sha256): the ids would
    mean other text than the model was trained on."""
    from strata.data.tokenize import sha256_file
    from strata.data.tokens import read_meta

    info = read_meta(data_dir).raw.get("tokenizer")
    recorded = info.get("sha256") if isinstance(info, dict) else None
    if not isinstance(recorded, str) or not file.is_file():
        return  # nothing recorded to check against; a missing file fails where it is read
    actual = sha256_file(file)
    if actual != recorded:
        raise DataError(
            f"{file} (sha256 {actual[:12]}) is not the tokenizer {data_dir / 'meta.json'} records "
            f"(sha256 {recorded[:12]}): the model was trained on ids of another; put back the "
            "tokenizer.json the data was prepared with"
        )


def _read_into_model(source, cfg: Config, dtype: torch.dtype, what: str) -> GPT:
    """A plain GPT of `cfg` holding the weights `source` (a checkpoint reader) has."""
    shapes = source.shapes("model.")  # by name without the prefix
    embedding = shapes.get("tok_embeddings.weight")
    if embedding is None:
        raise CheckpointError(
            f"{what}: holds no model.tok_embeddings.weight; is it a model checkpoint?"
        )
    with torch.device("meta"):
        model = GPT(cfg.model, embedding[0])
        if any(is_adapter(n) for n in shapes):  # a LoRA run's: merged once read
            apply_lora(model, cfg.model.lora)
    model = model.to_empty(device="cpu")
    state = model.state_dict()
    missing = [f"model.{n}" for n in state if n not in shapes]
    if missing:
        raise CheckpointError(
            f"{what}: lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    try:
        problems = source.read([whole_piece(f"model.{n}", t) for n, t in state.items()])
    finally:
        source.close()
    if problems:
        raise CheckpointError(f"{what} is damaged:\n  " + "\n  ".join(problems))
    merge_adapters(model)
    cos, sin = rope_tables(cfg.model)
    model.rope_cos, model.rope_sin = cos, sin
    return model.to(dtype).eval()


def extend_positions(model: GPT, length: int) -> None:
    """Rotary tables for `length` positions when the model's are shorter (generating past
    model.seq_len: the frequencies stay those the model was trained with, but for a dynamic NTK
    scaling's, which the model recomputes for each length)."""
    have = cast(torch.Tensor, model.rope_cos)
    if length > have.shape[0]:
        cos, sin = rope_tables(model.cfg, length)
        model.rope_cos, model.rope_sin = cos.to(have.device), sin.to(have.device)
