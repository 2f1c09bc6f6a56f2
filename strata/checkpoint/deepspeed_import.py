"""Import a DeepSpeed ZeRO-1/2/3 checkpoint, written by DeepSpeed itself, as a Strata checkpoint in
the global layout: whole fp32 weights and Adam moments under each parameter's name, the step and
the samples consumed, so training continues in Strata under any layout (another dp size too).

DeepSpeed's files are read with torch.load(weights_only=True): its pickles name three DeepSpeed
classes, which are allow-listed as inert stand-ins, so deepspeed need not be installed and nothing
in the files can run code. Each rank's fp32 partition is mapped to per-parameter flat ranges —
ZeRO-3 partitions every parameter separately (rank r holds [r·⌈n/W⌉, (r+1)·⌈n/W⌉) of it), ZeRO-1/2
partition each parameter group's concatenation (rank r holds [r·P, (r+1)·P), alignment padding
after each parameter) — as DeepSpeed's own zero_to_fp32.py does for the weights; the optimizer
moments follow the same ranges. Layout read from DeepSpeed 0.19.8 (docs/design/checkpoint.md §5).
"""

from __future__ import annotations

import math
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from strata.checkpoint.manager import write_whole
from strata.errors import CheckpointError


class _ZeroStageEnum(int):  # deepspeed.runtime.zero.config.ZeroStageEnum (an int enum)
    pass


class _LossScaler:  # deepspeed.runtime.fp16.loss_scaler.LossScaler (state only)
    pass


class _FragmentAddress:  # deepspeed.utils.tensor_fragment.fragment_address (numel, start)
    pass


# (typed as torch.serialization.safe_globals takes them: classes are callables)
_STANDINS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (_ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _load(path: Path) -> dict:
    """One of DeepSpeed's files, loaded safely; a file that needs anything else to load (a pickle
    that would call a function or build another class) or is no torch file at all is refused."""
    try:
        with torch.serialization.safe_globals(_STANDINS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's own message advises weights_only=False, which would run whatever the file holds
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({named.group(1)})" if named else ""
        raise CheckpointError(
            f"{path}: not a DeepSpeed checkpoint torch can load safely: it asks to load "
            f"something{what} other than tensors and DeepSpeed's own state, and loading it could "
            "run code; nothing was imported. Import only checkpoints DeepSpeed wrote"
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(
            f"{path}: not a DeepSpeed checkpoint torch can read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'damaged'}); nothing was imported"
        ) from None


def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _tag_dir(path: Path) -> Path:
    """The checkpoint directory: `path` itself, or the tag its `latest` file names."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not list(path.glob("*_optim_states.pt")) or not list(path.glob("*model_states.pt")):
        raise CheckpointError(
            f"{path}: not a DeepSpeed ZeRO checkpoint (no *_optim_states.pt / *model_states.pt); "
            "pass the directory given to engine.save_checkpoint or one of its tags"
        )
    return path


def _zero3_spans(
    rank: int, world: int, shapes: list[tuple[str, tuple]], group_of: dict[str, int], groups: int
) -> Iterator[tuple[str, int, int, int, int]]:
    """(name, group, offset, a, b) of each parameter in rank `rank`'s ZeRO-3 partition: [a, b) of
    the flattened parameter, at `offset` in the rank's flat group. Every parameter is partitioned on
    its own (rank r holds [r·⌈n/W⌉, (r+1)·⌈n/W⌉)), in group order."""
    offsets = [0] * groups
    for name, shape in shapes:
        gi, n = group_of[name], math.prod(shape)
        part = math.ceil(n / world)
        yield name, gi, offsets[gi], min(rank * part, n), min((rank + 1) * part, n)
        offsets[gi] += part


def _zero12_spans(
    rank: int, param_shapes: list[dict], flat: list[torch.Tensor], padding: list | None
) -> Iterator[tuple[str, int, int, int, int]]:
    """(name, group, offset, a, b) of each parameter rank `rank`'s ZeRO-1/2 partition overlaps:
    [a, b) of the flattened parameter, at `offset` in the rank's flat group. Each group's
    concatenation is partitioned (rank r holds [r·P, (r+1)·P)), with alignment padding after each
    parameter."""
    for gi, group in enumerate(param_shapes):
        size, start = flat[gi].numel(), 0
        lo = rank * size
        for pi, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            a, b = max(lo, start), min(lo + size, start + n)
            if a < b:
                yield name, gi, a - lo, a - start, b - start
            start += n + (padding[gi][pi] if padding else 0)


def _slice(
    flat: torch.Tensor, inner: dict, offset: int, length: int
) -> tuple[dict[str, torch.Tensor], dict]:
    """A parameter's piece of a rank's flat fp32 group (`param`) and of each optimizer moment of
    that group, and the group's scalar optimizer state (Adam's step)."""
    pieces = {"param": flat[offset : offset + length]}
    pieces.update(
        {k: v[offset : offset + length] for k, v in inner.items() if torch.is_tensor(v) and v.ndim}
    )
    return pieces, {k: v for k, v in inner.items() if not (torch.is_tensor(v) and v.ndim)}


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict]:
    """(weights by name, Adam state by name, meta: stage, dp, global_steps, global_samples,
    param_groups) of a DeepSpeed ZeRO checkpoint."""
    tag = _tag_dir(path)
    model_states = _load(sorted(tag.glob("*model_states.pt"), key=_natural)[0])
    shapes = [
        (name, tuple(shape))
        for group in model_states["param_shapes"]
        for name, shape in group.items()
    ]
    group_of = {name: gi for gi, group in enumerate(model_states["param_shapes"]) for name in group}
    ranks = [
        _load(f)["optimizer_state_dict"]
        for f in sorted(tag.glob("*_optim_states.pt"), key=_natural)
    ]
    stage, world = int(ranks[0]["zero_stage"]), len(ranks)
    weights = {name: torch.full(shape, float("nan")) for name, shape in shapes}
    states: dict[str, dict] = {name: {} for name, _ in shapes}
    for r, o in enumerate(ranks):
        if stage == 3:
            flat, inner = o["fp32_flat_groups"], o["optimizer_state_dict"]["state"]
            spans = _zero3_spans(r, world, shapes, group_of, len(flat))
        else:
            flat, inner = o["single_partition_of_fp32_groups"], o["base_optimizer_state"]["state"]
            padding = o.get("param_alignment_paddings")
            spans = _zero12_spans(r, model_states["param_shapes"], flat, padding)
        for name, gi, offset, a, b in spans:
            pieces, scalars = _slice(flat[gi], inner[gi], offset, b - a)
            weights[name].view(-1)[a:b] = pieces.pop("param")
            for key, piece in pieces.items():
                states[name].setdefault(key, torch.zeros(weights[name].shape)).view(-1)[a:b] = piece
            states[name].update(scalars)
    unfilled = [name for name, t in weights.items() if torch.isnan(t).any()]
    if unfilled:
        raise CheckpointError(
            f"{tag}: the ranks' partitions do not cover {unfilled[:5]}; a rank's "
            "*_optim_states.pt is missing or from another run"
        )
    inner0 = ranks[0]["optimizer_state_dict"] if stage == 3 else ranks[0]["base_optimizer_state"]
    meta = {
        "stage": stage,
        "dp": world,
        "global_steps": int(model_states["global_steps"]),
        "global_samples": int(model_states["global_samples"]),
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in inner0["param_groups"]
        ],
    }
    return weights, states, meta


def import_checkpoint(
    path: Path,
    out_root: Path,
    config_yaml: str,
    aliases: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write DeepSpeed checkpoint `path` as the Strata checkpoint of its step under `out_root`,
    with `config_yaml` (the Strata config to continue with) as its config. `aliases` adds names
    for the same tensor ({'output.weight': 'tok_embeddings.weight'} for a tied embedding, which
    DeepSpeed saves once). An `out_root` holding committed checkpoints is refused unless
    `overwrite` (`store.output_refusal`)."""
    weights, states, meta = read(path)
    tensors = {f"model.{name}": w for name, w in weights.items()}
    for name, entry in states.items():
        for kind, value in entry.items():
            tensors[f"optim.state.{name}.{kind}"] = (
                torch.as_tensor(value, dtype=torch.float32)
                if not torch.is_tensor(value) or value.ndim == 0
                else value
            )
    trainer_state = {
        "step": meta["global_steps"],
        "data": {"consumed_samples": meta["global_samples"]},
        "imported_from": f"deepspeed ZeRO-{meta['stage']} dp{meta['dp']}",
    }
    return write_whole(
        out_root,
        meta["global_steps"],
        tensors,
        {"trainer": trainer_state, "optim.param_groups": meta["param_groups"]},
        {f"model.{a}": f"model.{n}" for a, n in (aliases or {}).items()},
        config_yaml,
        {"imported_from": trainer_state["imported_from"]},
        overwrite,
        "strata ckpt import-deepspeed",
    )
