"""Consolidated weights for use outside Strata: `strata ckpt export DIR OUT --format safetensors`
writes the whole model's weights (global names and shapes, as a plain `strata.model.GPT`'s
state_dict) into one safetensors file, atomically, with the checkpoint's config beside it."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save as safetensors_bytes

from strata.atomic import write_file_atomic
from strata.checkpoint.reader import Checkpoint

FORMATS = ("safetensors",)


def export(path: Path, out: Path, fmt: str = "safetensors") -> Path:
    """Write the weights of the checkpoint at `path` to `out` (a .safetensors file, or a directory
    that gets model.safetensors and config.yaml); returns the weights file."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; supported: {', '.join(FORMATS)}")
    ckpt = Checkpoint(path)
    try:
        tensors = ckpt.tensors("model.")  # a tied weight's names are separate copies (safetensors wants that)
    finally:
        ckpt.close()
    out = Path(out)
    target = out if out.suffix == ".safetensors" else out / "model.safetensors"
    metadata = {"format": "pt", "strata_step": str(ckpt.step), "strata_checkpoint": str(ckpt.path)}
    write_file_atomic(target, safetensors_bytes(tensors, metadata=metadata))
    shutil.copyfile(ckpt.path / "config.yaml", target.with_name("config.yaml"))
    return target
