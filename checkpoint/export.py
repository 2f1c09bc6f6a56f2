"""Consolidated weights for use outside Strata: `strata ckpt export DIR OUT --format safetensors`
writes the whole model's weights (global names and shapes, as a plain `strata.model.GPT`'s
state_dict) into one safetensors file, atomically, with the checkpoint's config beside it.

Export writes only the two files its OUT names (OUT.safetensors and OUT.config.yaml, or
OUT/model.safetensors and OUT/config.yaml), replaces them only when asked to, never writes into a
checkpoint, and ships the config only after checking it against the checksum the checkpoint
recorded: an exported model is loaded elsewhere by that config, so a corrupted one must not leave."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save as safetensors_bytes

from strata.atomic import write_file_atomic
from strata.checkpoint import integrity, store
from strata.checkpoint.reader import Checkpoint
from strata.errors import CheckpointError

FORMATS = ("safetensors",)


def outputs(out: Path) -> tuple[Path, Path]:
    """The weights file and config file an OUT names: a .safetensors file and `<stem>.config.yaml`
    beside it (never a shared `config.yaml`, which could be another export's or the user's), or a
    directory's model.safetensors and config.yaml."""
    out = Path(out)
    if out.suffix == ".safetensors":
        return out, out.with_name(f"{out.stem}.config.yaml")
    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"strata ckpt export: OUT {str(out)!r} is an existing file; give a .safetensors file name or a directory"
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
            f"strata ckpt export: OUT {str(weights.parent)!r} is in the checkpoint directory {str(inside)!r}; "
            "writing there would alter checkpoints, so give an OUT outside it"
        )
    existing = [str(p) for p in (weights, config) if p.exists() or p.is_symlink()]
    if existing and not overwrite:
        raise CheckpointError(
            f"strata ckpt export: {' and '.join(existing)} already exist(s); give another OUT, or pass "
            "--overwrite to replace them"
        )


def verified_config(ckpt: Checkpoint) -> bytes:
    """The checkpoint's config.yaml, checked against the size and CRC its commit marker records."""
    path = ckpt.path / "config.yaml"
    want = ckpt.files.get("config.yaml")
    if not isinstance(want, dict):
        raise CheckpointError(f"{ckpt.path / store.MARKER} records no checksum for config.yaml; it cannot be verified")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e}); nothing was exported") from e
    block = want.get("block")
    crcs = integrity.block_checksums(data, block) if block else [integrity.checksum(data)]
    if len(data) != want.get("bytes") or crcs != integrity.checksums_of(want):
        raise CheckpointError(
            f"{path}: does not match the checksum in its commit marker (corrupted); nothing was exported. "
            "Export another checkpoint (`strata ckpt verify` checks one)"
        )
    return data


def export(path: Path, out: Path, fmt: str = "safetensors", overwrite: bool = False) -> tuple[Path, Path]:
    """Write the weights of the checkpoint at `path` and its verified config to the files `out`
    names (see `outputs`); returns (weights file, config file). Everything is checked before
    anything is written."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; supported: {', '.join(FORMATS)}")
    weights, config = outputs(Path(out))
    check_destination(weights, config, overwrite)
    ckpt = Checkpoint(path)
    try:
        config_yaml = verified_config(ckpt)
        tensors = ckpt.tensors("model.")  # a tied weight's names are separate copies (safetensors wants that)
    finally:
        ckpt.close()
    metadata = {"format": "pt", "strata_step": str(ckpt.step), "strata_checkpoint": str(ckpt.path)}
    write_file_atomic(weights, safetensors_bytes(tensors, metadata=metadata))
    write_file_atomic(config, config_yaml)
    return weights, config
