"""What a checkpoint holds, for `strata ckpt inspect` and `strata ckpt verify`: its step, the
parallel layout it was saved from, its files with their integrity, and every tensor with its
global shape, size and number of saved boxes."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata

from strata.checkpoint import dcp_meta, integrity, store
from strata.checkpoint.blob import torch_dtype
from strata.checkpoint.pieces import whole_piece
from strata.checkpoint.reader import Checkpoint
from strata.config.schema import CheckpointConfig, Config
from strata.errors import CheckpointError, StrataError


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _layout(layout: dict) -> str:
    if "imported_from" in layout:
        return f"imported from {layout['imported_from']}"
    text = (
        f"world {layout.get('world')}: tp {layout.get('tp')}, pp {layout.get('pp')}, virtual "
        "stages "
        f"{layout.get('virtual_stages')}, dp {layout.get('dp')}"
    )
    if layout.get("zero"):
        z = layout["zero"]
        text += f"; zero params {z['params']}, grads {z['grads']}, optim {z['optim']}"
    return text


def _metadata_problems(ckpt: Path, index: dict) -> list[str]:
    """DCP's `.metadata` must unpickle with only DCP's classes and list the index's entries."""
    try:
        meta = dcp_meta.read_safely(ckpt / ".metadata")
    except Exception as e:  # whatever a damaged pickle raises, the file is damaged
        return [f"{ckpt / '.metadata'}: unreadable ({e})"]
    want = dcp_meta.build(index, "")
    if set(meta.state_dict_metadata) != set(want.state_dict_metadata):
        return [f"{ckpt / '.metadata'}: does not list the same entries as index.json"]
    if _storage(meta) != _storage(want):
        return [
            f"{ckpt / '.metadata'}: points DCP at other files or bytes than index.json does "
            "(damaged)"
        ]
    return []


def _storage(meta: Metadata) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    """Where DCP reads each entry from: {(key, chunk offsets): (file, offset, length)} — so a
    `.metadata` cannot send a plain DCP load outside the files the index (checked) names."""
    return {
        (i.fqn, None if i.offset is None else tuple(i.offset)): (
            str(s.relative_path),
            s.offset,
            s.length,
        )
        for i, s in meta.storage_data.items()
    }


def verify_report(
    path: Path, read_config: Callable[[bytes], Config] | None = None
) -> tuple[bool, str]:
    """(ok, report) for `strata ckpt verify`: the structural check every load makes, every data
    block's checksum, DCP's `.metadata` against the index, and (given `read_config`, which turns
    config.yaml into a Config: this layer reads only the schema) the model tensors' shapes against
    the model config.yaml describes, which an imported checkpoint's config must match too."""
    ckpt = store.resolve(path)
    record = store.marker(ckpt)  # unreadable, or not a JSON object: CheckpointError, one message
    index, problems = integrity.checkpoint_problems(ckpt, record, checksums=True)
    if not problems:
        problems = _metadata_problems(ckpt, index)
    if not problems and read_config is not None:
        problems = model_shape_problems(ckpt, index, read_config)
    if problems:
        return False, f"{ckpt}: DAMAGED\n  " + "\n  ".join(problems)
    report = f"{ckpt}: ok ({len(record['files'])} files match their sizes and CRC-32C checksums)"
    largest = largest_weight(ckpt)
    if largest is not None and largest[1] > IMPLAUSIBLE_WEIGHT:
        report += (
            f"\n  warning: the weights are finite but implausible: |{largest[0]}| reaches "
            f"{largest[1]:.3g} (trained transformers stay below ~1e3): the run that saved it had "
            "likely diverged; an earlier checkpoint may be the one to resume"
        )
    return True, report


def model_shape_problems(
    ckpt: Path, index: dict, read_config: Callable[[bytes], Config]
) -> list[str]:
    """Each model tensor whose saved shape is not the one config.yaml's model gives it, and each the
    model has that the checkpoint lacks (the vocabulary is the saved embedding's)."""
    from strata.lora import apply_lora
    from strata.model import GPT

    try:
        cfg = read_config((ckpt / "config.yaml").read_bytes())
    except (OSError, StrataError) as e:
        return [f"{ckpt / 'config.yaml'}: not a config this Strata reads ({e})"]
    aliases, tensors = index.get("aliases", {}), index["tensors"]
    saved = {
        k: tuple(tensors[aliases.get(k, k)]["shape"])
        for k in [*tensors, *aliases]
        if k.startswith("model.")
    }
    embedding = saved.get("model.tok_embeddings.weight")
    if embedding is None:
        return []  # no model in it (an optimizer-only save): nothing to hold against the config
    with torch.device("meta"):
        model = GPT(cfg.model, embedding[0])
        apply_lora(model, cfg.model.lora)
    problems = []
    for name, t in model.state_dict().items():
        have = saved.get(f"model.{name}")
        if have is None:
            problems.append(f"model.{name} is missing (config.yaml's model has it)")
        elif have != tuple(t.shape):
            problems.append(
                f"model.{name} is {have}, config.yaml's model makes it {tuple(t.shape)}"
            )
    return [f"the weights contradict config.yaml: {p}" for p in problems[:8]] + (
        [f"... and {len(problems) - 8} more"] if len(problems) > 8 else []
    )


# the ceiling a save is refused above, by default
IMPLAUSIBLE_WEIGHT = CheckpointConfig().max_abs_weight


def largest_weight(ckpt: Path) -> tuple[str, float] | None:
    """The model tensor with the largest magnitude and that magnitude (read one tensor at a time), or
    None for a checkpoint without model tensors."""
    reader = Checkpoint(ckpt)
    try:
        best: tuple[str, float] | None = None
        for key, entry in reader.index["tensors"].items():
            if not key.startswith("model.") or not str(entry.get("dtype", "")).startswith(
                ("float", "bfloat")
            ):
                continue
            piece = whole_piece(
                key, torch.empty(tuple(entry["shape"]), dtype=torch_dtype(entry["dtype"]))
            )
            if reader.read([piece]) or not piece.tensor.numel():
                continue
            value = float(piece.tensor.abs().max())
            if best is None or value > best[1]:
                best = (key[len("model.") :], value)
        return best
    finally:
        reader.close()


def describe(path: Path) -> str:
    """The `strata ckpt inspect` report: `verify_report`, then the index and the trainer state."""
    return inspect_report(path)[1]


def inspect_report(path: Path) -> tuple[bool, str]:
    """(ok, report) for `strata ckpt inspect`: ok as `verify_report` says (a damaged checkpoint's
    report stops after its files), the report as `describe`."""
    ok, integrity = verify_report(path)
    ckpt = Checkpoint(path)
    index = ckpt.index
    lines = [
        f"checkpoint {ckpt.path}",
        f"step {ckpt.step}, saved from layout: {_layout(index.get('layout', {}))}",
        f"integrity: {integrity}",
        "files:",
    ]
    for name, entry in ckpt.files.items():
        check = (
            f"{len(entry['block_crc32c'])} block crc32cs"
            if "block_crc32c" in entry
            else f"crc32c {entry['crc32c']}"
        )
        lines.append(f"  {name:22s} {_size(entry['bytes']):>10s}  {check}")
    if not ok:
        ckpt.close()
        return False, "\n".join(lines)
    tensors, aliases = index["tensors"], index.get("aliases", {})
    model = {k: v for k, v in tensors.items() if k.startswith("model.")}

    def nbytes(entry: dict) -> int:
        return math.prod(entry["shape"]) * torch_dtype(entry["dtype"]).itemsize

    lines.append(
        f"model: {len(model)} tensors, {sum(math.prod(e['shape']) for e in model.values()):,} "
        f"elements ({_size(sum(nbytes(e) for e in model.values()))}), global shapes:"
    )
    lines += [
        f"  {key[6:]:40s} {str(tuple(e['shape'])):18s} {e['dtype']:9s} {_size(nbytes(e)):>10s}  "
        f"{len(e['chunks'])} box(es)"
        for key, e in model.items()
    ]
    lines += [f"  {alias[6:]:40s} same tensor as {key[6:]}" for alias, key in aliases.items()]
    optim = [k[len("optim.state.") :] for k in tensors if k.startswith("optim.state.")]
    kinds = sorted({k.rsplit(".", 1)[1] for k in optim})
    lines.append(
        f"optimizer: state for {len({k.rsplit('.', 1)[0] for k in optim})} parameter names "
        f"({', '.join(kinds)}), {_size(sum(nbytes(tensors['optim.state.' + k]) for k in optim))}"
    )
    try:
        trainer = ckpt.object("trainer")
        groups = ckpt.object("optim.param_groups")
    except CheckpointError as e:
        return False, "\n".join(lines + [f"cannot read: {e}"])
    finally:
        ckpt.close()
    lines.append(f"{len(groups)} parameter groups, lr {groups[0].get('lr')}")
    lines.append(f"trainer: step {trainer['step']}, data position {trainer['data']}")
    return True, "\n".join(lines)
