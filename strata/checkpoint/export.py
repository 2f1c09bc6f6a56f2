"""Consolidated weights for use outside Strata: `strata ckpt export DIR OUT --format safetensors`
writes the whole model's weights (global names and shapes, as a plain `strata.model.GPT`'s
state_dict) into one safetensors file, atomically, with the checkpoint's config beside it;
`--format hf` writes a Hugging Face model directory (config.json, sharded safetensors with their
index, the tokenizer) that transformers' `from_pretrained` loads with no Strata code, a LoRA run's
adapters merged into their weights; `--format peft` writes a LoRA run's adapters alone as a PEFT
adapter directory, for `peft.PeftModel.from_pretrained` on the base model.

Export writes only the two files its OUT names (OUT.safetensors and OUT.config.yaml, or
OUT/model.safetensors and OUT/config.yaml), replaces them only when asked to, never writes into a
checkpoint, and ships the config only after checking it against the checksum the checkpoint
recorded: an exported model is loaded elsewhere by that config, so a corrupted one must not leave."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from strata.atomic import atomic_directory, write_file_atomic
from strata.checkpoint import integrity, store
from strata.checkpoint.blob import torch_dtype
from strata.checkpoint.hf_metadata import hf_metadata
from strata.checkpoint.pieces import Piece, whole_piece
from strata.checkpoint.reader import Checkpoint
from strata.config.schema import Config
from strata.errors import CheckpointError
from strata.hf import config_json, tensor_names
from strata.parallel.flat import Box

FORMATS = ("safetensors", "hf", "peft")
# per safetensors shard of an hf export (transformers' save_pretrained: 5 GB)
SHARD_BYTES = 2 * 2**30
# What an hf export writes: an --overwrite replaces a directory holding nothing else.
HF_FILES = re.compile(
    r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|"
    r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja"
)


def outputs(out: Path) -> tuple[Path, Path]:
    """The weights file and config file an OUT names: a .safetensors file and `<stem>.config.yaml`
    beside it (never a shared `config.yaml`, which could be another export's or the user's), or a
    directory's model.safetensors and config.yaml."""
    out = Path(out)
    if out.suffix == ".safetensors":
        return out, out.with_name(f"{out.stem}.config.yaml")
    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"strata ckpt export: OUT {str(out)!r} is an existing file; give a .safetensors file "
            "name or a directory"
        )
    return out / "model.safetensors", out / "config.yaml"


def checkpoint_destination(directory: Path) -> Path | None:
    """The checkpoint directory (or checkpoints root) that `directory` is or lies in, if any:
    writing there would change a checkpoint or mix files into one."""
    directory = Path(directory).absolute()
    if directory.is_dir():
        if (directory / "index.json").exists() or any(store.committed(directory)):
            return directory
        if any(store.is_checkpoint_name(p.name) for p in directory.iterdir() if p.is_dir()):
            return directory
    for d in [directory, *directory.parents]:
        if store.is_checkpoint_name(d.name) or (d / store.MARKER).exists():
            return d
    return None


def check_destination(weights: Path, config: Path, overwrite: bool) -> None:
    """Refuse to write into a checkpoint, or over existing files unless `overwrite`."""
    inside = checkpoint_destination(weights.parent)
    if inside is not None:
        raise CheckpointError(
            f"strata ckpt export: OUT {str(weights.parent)!r} is in the checkpoint directory "
            f"{str(inside)!r}; writing there would alter checkpoints, so give an OUT outside it"
        )
    existing = [str(p) for p in (weights, config) if p.exists() or p.is_symlink()]
    if existing and not overwrite:
        raise CheckpointError(
            f"strata ckpt export: {' and '.join(existing)} already exist(s); give another OUT, or "
            "pass --overwrite to replace them"
        )


def verified_config(ckpt: Checkpoint) -> bytes:
    """The checkpoint's config.yaml, checked against the size and CRC its commit marker records."""
    path = ckpt.path / "config.yaml"
    want = ckpt.files.get("config.yaml")
    if not isinstance(want, dict):
        raise CheckpointError(
            f"{ckpt.path / store.MARKER} records no checksum for config.yaml; it cannot be verified"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e}); nothing was exported") from e
    block = want.get("block")
    crcs = integrity.block_checksums(data, block) if block else [integrity.checksum(data)]
    if len(data) != want.get("bytes") or crcs != integrity.checksums_of(want):
        raise CheckpointError(
            f"{path}: does not match the checksum in its commit marker (corrupted); nothing was "
            "exported. Export another checkpoint (`strata ckpt verify` checks one)"
        )
    return data


def export(
    path: Path,
    out: Path,
    fmt: str = "safetensors",
    overwrite: bool = False,
    read_config: Callable[[bytes], Config] | None = None,
    force: bool = False,
    note: Callable[[str], None] = print,
) -> tuple[Path, Path]:
    """Write the weights of the checkpoint at `path` and its verified config to the files `out`
    names (see `outputs`); returns (weights file, config file). Everything is checked before
    anything is written. The Hugging Face format needs `read_config`, which turns the checkpoint's
    config.yaml into a validated Config (`strata.config.loading.from_yaml`: this layer reads only
    the schema); `force` and `note` are the Hugging Face export's (`export_hf`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; supported: {', '.join(FORMATS)}")
    if fmt in ("hf", "peft"):
        if read_config is None:
            raise ValueError(f"export to the {fmt} format needs read_config")
        if fmt == "peft":
            return export_peft(Path(path), Path(out), read_config, overwrite)
        return export_hf(Path(path), Path(out), read_config, overwrite, force, note)
    weights, config = outputs(Path(out))
    check_destination(weights, config, overwrite)
    ckpt = Checkpoint(path)
    try:
        config_yaml = verified_config(ckpt)
        # a tied weight's names are separate copies (safetensors wants that)
        tensors = ckpt.tensors("model.")
    finally:
        ckpt.close()
    metadata = {"format": "pt", "strata_step": str(ckpt.step), "strata_checkpoint": str(ckpt.path)}
    write_file_atomic(weights, safetensors_bytes(tensors, metadata=metadata))
    write_file_atomic(config, config_yaml)
    return weights, config


def export_hf(
    path: Path,
    out: Path,
    read_config: Callable[[bytes], Config],
    overwrite: bool = False,
    force: bool = False,
    note: Callable[[str], None] = print,
) -> tuple[Path, Path]:
    """Write the checkpoint at `path` as a Hugging Face model directory `out`: config.json for the
    architecture that computes what Strata's model does, the weights under HF's names in shards of
    at most SHARD_BYTES (read one shard at a time, never the whole model) with
    model.safetensors.index.json, the tokenizer and generation_config.json, with what the source
    model said carried (`hf_metadata`: `force` exports where fields would be lost; each field set
    from the run's config goes to `note`). The directory appears complete or not at all. Returns
    (out, its config.json)."""
    out = Path(out)
    _check_hf_destination(out, overwrite)
    ckpt = Checkpoint(path)
    try:
        cfg = read_config(verified_config(ckpt))
        shapes = ckpt.shapes("model.")
        dtypes = {
            k: ckpt.index["tensors"][k]["dtype"]
            for k in ckpt.index["tensors"]
            if k.startswith("model.")
        }
        # first what no Hugging Face family can express, by key: such a model's tensors are not
        # those the names below expect
        embedding = shapes.get("tok_embeddings.weight")
        hf_cfg = config_json.hf_config(cfg.model, None if embedding is None else embedding[0])
        # Strata name -> HF name (a tied output is the embedding)
        names = tensor_names.hf_targets(cfg.model)
        # a stacked expert weight -> the HF name of each row
        experts = tensor_names.expert_names(cfg.model)
        problems = [f"no tensor model.{n}" for n in [*names, *experts] if n not in shapes]
        if problems:
            raise CheckpointError(
                f"{ckpt.path}: does not hold the model its config.yaml describes: {problems[:5]}"
            )
        hf_cfg["torch_dtype"] = dtypes["model.tok_embeddings.weight"]
        metadata = hf_metadata(cfg, hf_cfg, force)
        outputs = [_Output(hf_name, n, None) for n, hf_name in names.items()]
        outputs += [
            _Output(row_name, n, e)
            for n, rows in experts.items()
            for e, row_name in enumerate(rows)
        ]
        dtype_of = {o.strata: torch_dtype(dtypes[f"model.{o.strata}"]) for o in outputs}
        shards = _shards(outputs, shapes, dtype_of)
        _refuse_what_this_export_does_not_write(out, _hf_outputs(len(shards), metadata.files))
        merge = Merge(adapters_of(shapes), cfg.model.lora.scale if cfg.model.lora.enabled else 0)
        with atomic_directory(out) as tmp:
            _write_weights(ckpt, tmp, shards, shapes, dtype_of, merge)
            (tmp / "config.json").write_text(json.dumps(metadata.config, indent=2) + "\n")
            for name, data in metadata.files.items():
                (tmp / name).write_bytes(data)
    finally:
        ckpt.close()
    for line in metadata.notes:
        note(f"note: {line}")
    return out, out / "config.json"


@dataclass(frozen=True)
class Merge:
    """LoRA adapters to fold into the weights they sit on ({weight: (its A, its B)}), and
    alpha/rank."""

    adapters: dict[str, tuple[str, str]]
    scale: float

    def apply(self, ckpt: Checkpoint, name: str, weight: torch.Tensor) -> None:
        """W + (B·A)·scale in place of the weight `name` (as PEFT's merge_and_unload computes it),
        when an adapter sits on it."""
        if name not in self.adapters:
            return
        tensors = ckpt.index["tensors"]
        a, b = (
            whole_piece(
                f"model.{n}",
                torch.empty(
                    tensors[f"model.{n}"]["shape"],
                    dtype=torch_dtype(tensors[f"model.{n}"]["dtype"]),
                ),
            )
            for n in self.adapters[name]
        )
        problems = ckpt.read([a, b])
        if problems:
            raise CheckpointError(
                f"{ckpt.path} is damaged; nothing was exported:\n  " + "\n  ".join(problems)
            )
        delta = (b.tensor.float() @ a.tensor.float()) * self.scale
        weight.copy_((weight.float() + delta).to(weight.dtype))


def adapters_of(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, str]]:
    """{weight name: (its lora_A, its lora_B)} of every adapted layer among a checkpoint's
    tensors."""
    out = {}
    for name in shapes:
        if name.endswith(".lora_A.weight"):
            stem = name.removesuffix(".lora_A.weight")
            out[f"{stem}.weight"] = (name, f"{stem}.lora_B.weight")
    return out


PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def export_peft(
    path: Path, out: Path, read_config: Callable[[bytes], Config], overwrite: bool = False
) -> tuple[Path, Path]:
    """Write the LoRA adapters of the checkpoint at `path` as a PEFT adapter directory `out`
    (adapter_config.json, adapter_model.safetensors under PEFT's names), which
    `peft.PeftModel.from_pretrained` loads onto the base model the run started from (the Hugging
    Face model of model.init_from): the base weights do not change in a LoRA run, so base and
    adapter compute what the run's model does. Returns (out, its adapter_config.json)."""
    out = Path(out)
    _check_hf_destination(out, overwrite, PEFT_FILES)
    ckpt = Checkpoint(path)
    try:
        cfg = read_config(verified_config(ckpt))
        shapes = ckpt.shapes("model.")
        lora = cfg.model.lora
        names = sorted(n for n in shapes if n.endswith((".lora_A.weight", ".lora_B.weight")))
        if not lora.enabled or not names:
            raise CheckpointError(
                f"strata ckpt export --format peft: {ckpt.path} holds no LoRA adapters (its "
                "model.lora.rank is 0); export the whole model with --format hf"
            )
        embedding = shapes["tok_embeddings.weight"]
        config_json.hf_config(cfg.model, embedding[0])  # refuses what no family expresses
        pieces = [
            whole_piece(f"model.{n}", torch.empty(shapes[n], dtype=torch.float32)) for n in names
        ]
        problems = ckpt.read(pieces)
        if problems:
            raise CheckpointError(
                f"{ckpt.path} is damaged; nothing was exported:\n  " + "\n  ".join(problems)
            )
    finally:
        ckpt.close()
    tensors = {tensor_names.to_peft(n): p.tensor for n, p in zip(names, pieces)}
    kinds = {tensor_names.to_hf(n.rsplit(".", 2)[0] + ".weight").split(".")[-2] for n in names}
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.model.init_from,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(kinds),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    with atomic_directory(out) as tmp:
        (tmp / "adapter_model.safetensors").write_bytes(
            safetensors_bytes(tensors, metadata={"format": "pt"})
        )
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out, out / "adapter_config.json"


def _write_weights(
    ckpt: Checkpoint,
    tmp: Path,
    shards: list[list[_Output]],
    shapes: dict[str, tuple[int, ...]],
    dtype_of: dict[str, torch.dtype],
    merge: Merge,
) -> None:
    """Each shard's tensors, read from `ckpt` one shard at a time (LoRA adapters merged into their
    weights), as its safetensors file in `tmp`, with model.safetensors.index.json where there is
    more than one."""
    weight_map = {}
    for i, shard in enumerate(shards):
        file = _weights_file(i, len(shards))
        pieces = [o.piece(shapes[o.strata], dtype_of[o.strata]) for o in shard]
        problems = ckpt.read(pieces)
        if problems:
            raise CheckpointError(
                f"{ckpt.path} is damaged; nothing was exported:\n  " + "\n  ".join(problems)
            )
        for o, p in zip(shard, pieces):
            if o.row is None:
                merge.apply(ckpt, o.strata, p.tensor)
        tensors = {o.hf: p.tensor if o.row is None else p.tensor[0] for o, p in zip(shard, pieces)}
        (tmp / file).write_bytes(safetensors_bytes(tensors, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(tensors, file))
        del pieces, tensors
    if len(shards) > 1:
        total = sum(o.nbytes(shapes[o.strata], dtype_of[o.strata]) for s in shards for o in s)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _weights_file(i: int, shards: int) -> str:
    """The name of weight file `i` of `shards`, as transformers' save_pretrained names them."""
    return "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"


def _hf_outputs(shards: int, other_files: dict[str, bytes]) -> set[str]:
    """The names of the files a Hugging Face export of `shards` weight files writes."""
    weights = {_weights_file(i, shards) for i in range(shards)}
    if shards > 1:
        weights.add("model.safetensors.index.json")
    return {"config.json", *weights, *other_files}


def _refuse_what_this_export_does_not_write(out: Path, writes: set[str]) -> None:
    """--overwrite replaces what this export writes and nothing else: OUT may hold only those names
    (an earlier export's tokenizer, when this run exports none, is the user's to keep)."""
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    kept = [name for name in present if name not in writes]
    if kept:
        raise CheckpointError(
            f"strata ckpt export: {str(out)!r} holds files this export does not write "
            f"({', '.join(kept[:5])}), which replacing the directory would delete; --overwrite "
            "replaces only what the export writes: move them, or give another OUT"
        )


def _check_hf_destination(out: Path, overwrite: bool, files: tuple[str, ...] = ()) -> None:
    """OUT must be a new or empty directory outside any checkpoint, or, with --overwrite, an
    earlier export holding only the files an export writes (nothing else of the user's is lost):
    `files`, a PEFT export's, else a Hugging Face export's."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"strata ckpt export --format hf: OUT {str(out)!r} is a file; give a directory"
        )
    inside = checkpoint_destination(out if out.exists() else out.parent)
    if inside is not None:
        raise CheckpointError(
            f"strata ckpt export: OUT {str(out)!r} is in the checkpoint directory {str(inside)!r}; "
            "writing there would alter checkpoints, so give an OUT outside it"
        )
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not overwrite:
        raise CheckpointError(
            f"strata ckpt export: {str(out)!r} is not empty; give a new directory, or pass "
            "--overwrite to replace an earlier export there"
        )
    foreign = [
        name for name in present if not (name in files if files else HF_FILES.fullmatch(name))
    ]
    if foreign:
        raise CheckpointError(
            f"strata ckpt export: {str(out)!r} holds files an export does not write "
            f"({', '.join(foreign[:5])}); "
            "--overwrite replaces only an earlier export: give another OUT"
        )


@dataclass(frozen=True)
class _Output:
    """One tensor of a Hugging Face export: `hf` written from the Strata tensor `strata`, whole, or
    its row `row` (an MoE layer's stacked experts are one tensor per expert in Hugging Face's)."""

    hf: str
    strata: str
    row: int | None

    def nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return math.prod(shape[1:] if self.row is not None else shape) * dtype.itemsize

    def piece(self, shape: tuple[int, ...], dtype: torch.dtype) -> Piece:
        """The read target: the whole tensor, or the box of its row."""
        if self.row is None:
            return whole_piece(f"model.{self.strata}", torch.empty(shape, dtype=dtype))
        box = Box((self.row,) + (0,) * (len(shape) - 1), (1, *shape[1:]))
        return Piece(
            f"model.{self.strata}", tuple(shape), box, torch.empty((1, *shape[1:]), dtype=dtype)
        )


def _shards(
    outputs: list[_Output], shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]
) -> list[list[_Output]]:
    """The export's tensors in HF order, cut into shards of at most SHARD_BYTES (a bigger tensor alone)."""
    shards: list[list[_Output]] = [[]]
    size = 0
    for out in outputs:
        n = out.nbytes(shapes[out.strata], dtypes[out.strata])
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(out)
        size += n
    return shards
