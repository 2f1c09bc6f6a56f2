"""A checkpoint written by torch.distributed.checkpoint alone (a plain `dcp.save`, an FSDP2 job,
torchtitan), opened read-only under Strata's names for `--resume` and `model.init_from`: model
weights keyed as Strata's GPT names them (with or without a `model.` prefix) or as torchtitan's
Llama does, and the Adam state when it is keyed as `get_optimizer_state_dict` keys it.

DCP's own `.metadata` says where each saved chunk is; it is unpickled with DCP's classes only
(`dcp_meta.read_safely`), and each chunk, a torch.save blob, with `weights_only=True`. Objects
(DCP stores them pickled) are never read: a foreign checkpoint's step and data position start at 0.
Not DCP's own load: it needs destinations shaped as the saved tensors or DTensors, which ZeRO's
flat-range pieces are not, and it unpickles objects with `weights_only=False`."""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from strata.checkpoint import dcp_meta, store
from strata.checkpoint.layout import listed
from strata.checkpoint.pieces import Piece
from strata.errors import CheckpointError
from strata.hf import tensor_names
from strata.hf.shape import ModelShape
from strata.parallel.flat import Box

METADATA = store.DCP_METADATA

# torchtitan's Llama module names -> Strata's (inside `layers.N.`, and at the top)
_TORCHTITAN = [
    (re.compile(r"^(layers\.\d+\.)attention\.qkv_linear\.(w[qkv])\."), r"\1attn.\2."),
    (re.compile(r"^(layers\.\d+\.)attention\.(w[qkvo])\."), r"\1attn.\2."),
    (re.compile(r"^(layers\.\d+\.)attention_norm\."), r"\1attn_norm."),
    (re.compile(r"^(layers\.\d+\.)feed_forward\.(w[123])\."), r"\1mlp.\2."),
    (re.compile(r"^(layers\.\d+\.)ffn_norm\."), r"\1mlp_norm."),
    (re.compile(r"^lm_head\.weight$"), "output.weight"),
]
_TORCHTITAN_NAME = re.compile(
    r"(^|\.)(attention|feed_forward|attention_norm|ffn_norm)\.|^lm_head\.weight$"
)
# RoPE pairs: torchtitan's differ from Strata's
_ROTATED = re.compile(r"^layers\.\d+\.attn\.w([qk])\.weight$")


@dataclass
class _Source:
    key: str  # the DCP key
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows_per_head: int = 0  # > 0: torchtitan's interleaved RoPE rows, permuted to Strata's halves


def _strata_name(name: str) -> tuple[str, bool]:
    """(Strata's parameter name, whether it was torchtitan's) for a model key without its prefix."""
    if not _TORCHTITAN_NAME.search(name):
        return name, False
    for pattern, replacement in _TORCHTITAN:
        name = pattern.sub(replacement, name)
    return name, True


class DcpCheckpoint:
    """The read side of `strata.checkpoint.reader.Checkpoint` (shapes, has, has_object, object,
    read, close, path, step, problems) over a DCP-only directory, for `TrainState.load` and
    `TrainState.load_weights`. `notes` says what was taken and what starts fresh."""

    def __init__(self, path: Path, model_cfg: ModelShape):
        self.path = Path(path)
        try:
            self.meta: Metadata = dcp_meta.read_safely(self.path / METADATA)
        except Exception as e:  # whatever a damaged or hostile pickle raises
            raise CheckpointError(
                f"{self.path / METADATA}: not a torch.distributed.checkpoint metadata file ({e})"
            ) from e
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.sources: dict[str, _Source] = {}
        self._map(model_cfg)
        self._cache: tuple[str, torch.Tensor] | None = None  # the last whole tensor assembled

    step = 0  # a foreign checkpoint's step and data position are not read: the run counts from 0

    def _map(self, model_cfg: ModelShape) -> None:
        tensors = {
            k: v
            for k, v in self.meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        model_keys, optim_keys, unmatched = {}, {}, []
        known = set(tensor_names.strata_names(model_cfg))
        for key, md in tensors.items():
            for prefix in ("optimizer.state.", "optim.state."):
                if key.startswith(prefix):
                    fqn, _, kind = key[len(prefix) :].rpartition(".")
                    optim_keys[key] = (fqn, kind, md)
                    break
            else:
                name = key[len("model.") :] if key.startswith("model.") else key
                strata, titan = _strata_name(name)
                if strata in known:
                    model_keys[key] = (strata, titan, md)
                else:
                    unmatched.append(key)
        kv_heads, heads = model_cfg.kv_heads, model_cfg.n_heads
        for key, (name, titan, md) in model_keys.items():
            rows = 0
            if titan and (m := _ROTATED.match(name)):
                rows = md.size[0] // (heads if m[1] == "q" else kv_heads)
            self.sources[f"model.{name}"] = _Source(key, tuple(md.size), md.properties.dtype, rows)
        if model_cfg.tie_embeddings and "model.tok_embeddings.weight" in self.sources:
            self.sources.setdefault(
                "model.output.weight", self.sources["model.tok_embeddings.weight"]
            )
        by_name = {v[0]: v for v in model_keys.values()}
        # a tied output is the embedding
        missing = [n for n in tensor_names.hf_targets(model_cfg) if n not in by_name]
        if missing:
            self.problems.append(
                f"{self.path}: no weights for {listed(missing)} "
                "(the model's names, with or without a model. prefix, or torchtitan's)"
            )
        if unmatched:
            self.problems.append(
                f"{self.path}: tensors that match no parameter of this model: "
                f"{listed(sorted(unmatched))}"
            )
        self._map_optimizer(optim_keys, by_name)

    def _map_optimizer(self, optim_keys: dict, by_name: dict) -> None:
        """Adam's exp_avg/exp_avg_sq/step per parameter, when every parameter has them; else none."""
        found: dict[str, dict[str, _Source]] = {}
        for key, (fqn, kind, md) in optim_keys.items():
            name = fqn[len("model.") :] if fqn.startswith("model.") else fqn
            strata, _ = _strata_name(name)
            param = self.sources.get(f"model.{strata}")
            if param is None or kind not in ("exp_avg", "exp_avg_sq", "step"):
                continue
            rows = param.rows_per_head if kind != "step" else 0
            found.setdefault(strata, {})[kind] = _Source(
                key, tuple(md.size), md.properties.dtype, rows
            )
        complete = by_name and all(
            set(found.get(n, {})) >= {"exp_avg", "exp_avg_sq"} for n in by_name
        )
        if complete:
            for name, kinds in found.items():
                for kind, src in kinds.items():
                    self.sources[f"optim.state.{name}.{kind}"] = src
            self.notes.append("Adam state taken from the checkpoint")
        else:
            self.notes.append(
                "no Adam state recognised for every parameter (exp_avg and exp_avg_sq, keyed as "
                "get_optimizer_state_dict keys them): the optimizer starts fresh"
            )

    # --- the reader's interface -------------------------------------------------------------------
    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """The global shape of every tensor whose key starts with `prefix`, by the rest of its
        key."""
        return {k[len(prefix) :]: s.shape for k, s in self.sources.items() if k.startswith(prefix)}

    def has(self, key: str) -> bool:
        """Whether the checkpoint holds tensor `key`."""
        return key in self.sources

    def has_object(self, key: str) -> bool:
        """Whether it holds object `key`: only the trainer's, which a DCP checkpoint stands in
        for."""
        return key == "trainer"

    def object(self, key: str):
        """The trainer's state, at step 0 with no data consumed (DCP keeps neither); any other
        object is refused."""
        if key != "trainer":
            raise CheckpointError(f"{self.path}: a DCP checkpoint's {key!r} is not read")
        return {"step": 0, "data": {"consumed_samples": 0}}

    def read(self, targets: list[Piece], verify: bool = True) -> list[str]:
        """Fill each target's box from the saved tensor of its key; returns the problems (a missing
        key, another shape) instead of raising."""
        problems = []
        for t in sorted(targets, key=lambda t: t.key):
            src = self.sources.get(t.key)
            if src is None:
                problems.append(f"{self.path}: no tensor {t.key}")
                continue
            if src.shape != tuple(t.global_shape):
                problems.append(
                    f"{self.path}: {t.key} has shape {src.shape}, the model's is "
                    f"{tuple(t.global_shape)}"
                )
                continue
            whole = self._whole(src)
            t.tensor.copy_(
                whole[tuple(slice(o, o + n) for o, n in zip(t.box.offsets, t.box.sizes))]
            )
        self._cache = None
        return problems

    def _whole(self, src: _Source) -> torch.Tensor:
        """The saved tensor, assembled from its chunks (one whole tensor in memory at a time)."""
        if self._cache is not None and self._cache[0] == src.key:
            return self._cache[1]
        md = self.meta.state_dict_metadata[src.key]
        out = torch.empty(src.shape, dtype=src.dtype)
        covered = 0
        for chunk in md.chunks:  # type: ignore[union-attr]
            data = self._chunk(src.key, tuple(chunk.offsets))
            box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
            out[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] = data.view(
                box.sizes
            )
            covered += math.prod(box.sizes)
        if covered != math.prod(src.shape):
            raise CheckpointError(
                f"{self.path}: the chunks of {src.key} do not cover it (an incomplete save)"
            )
        if src.rows_per_head:
            out = _halves_from_pairs(out, src.rows_per_head)
        self._cache = (src.key, out)
        return out

    def _chunk(self, key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        info = self.meta.storage_data[MetadataIndex(key, torch.Size(offsets))]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{self.path}: {key} is stored transformed ({info.transform_descriptors}); not read"
            )
        path = self.path / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be read ({e})") from e
        if len(blob) != info.length:
            raise CheckpointError(f"{path}: shorter than its metadata says (truncated?)")
        try:
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:  # a damaged blob
            raise CheckpointError(
                f"{path}: {key} at byte {info.offset} is not a saved tensor ({e})"
            ) from e

    def close(self) -> None:
        """Drop the last tensor assembled (no file stays open)."""
        self._cache = None


def _halves_from_pairs(w: torch.Tensor, rows_per_head: int) -> torch.Tensor:
    """q/k rows of a model whose RoPE rotates adjacent pairs (torchtitan's complex RoPE) reordered
    for one that rotates halves (Strata, Hugging Face): within each head, rows (2i, 2i+1) become
    (i, i + rows/2) — the permutation of Hugging Face's Llama conversion script."""
    heads = w.shape[0] // rows_per_head
    rest = w.shape[1:]
    return (
        w.reshape(heads, rows_per_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()
    )
