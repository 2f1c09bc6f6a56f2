"""torch.distributed.checkpoint's `.metadata` for a Strata checkpoint, built from its index, so
`torch.distributed.checkpoint.load` (and `format_utils.dcp_to_torch_save`) read it with DCP alone;
and a restricted unpickler to check a `.metadata` without running arbitrary pickled code.

Strata itself loads from `index.json`: DCP reads `.metadata` with a bare `pickle.load`.
"""

from __future__ import annotations

import io
import pickle
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from strata.checkpoint.blob import torch_dtype

DCP_VERSION = "1.0.0"  # torch 2.13's CURRENT_DCP_VERSION


OPTIMIZER_KEYS = ("optim", "optimizer")  # Strata's own, and torchtitan's name for the same state


def _path(key: str) -> tuple[str, ...]:
    """DCP's planner_data: the nested path a flattened key came from."""
    for top in OPTIMIZER_KEYS:
        if key.startswith(f"{top}.state."):
            fqn, kind = key[len(f"{top}.state.") :].rsplit(".", 1)
            return (top, "state", fqn, kind)
        if key == f"{top}.param_groups":
            return (top, "param_groups")
    head, _, rest = key.partition(".")
    return (head, rest) if rest else (head,)


def build(index: dict, checkpoint_id: str) -> Metadata:
    """Metadata for an index: `tensors` (with `aliases` pointing at the same bytes) and `objects`."""
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    planner: dict[str, Any] = {}
    tensors = dict(index["tensors"])
    tensors.update(
        {alias: index["tensors"][key] for alias, key in index.get("aliases", {}).items()}
    )
    objects = dict(index.get("objects", {}))
    # dcp.load with {"optimizer": get_optimizer_state_dict(...)} (torchtitan's key) finds the same
    # bytes
    for entries in (tensors, objects):
        entries.update(
            {
                "optimizer." + k[len("optim.") :]: v
                for k, v in list(entries.items())
                if k.startswith("optim.")
            }
        )
    for key, entry in tensors.items():
        sdm[key] = TensorStorageMetadata(
            TensorProperties(dtype=torch_dtype(entry["dtype"])),
            torch.Size(entry["shape"]),
            [
                ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                for c in entry["chunks"]
            ],
        )
        for c in entry["chunks"]:
            storage[MetadataIndex(key, torch.Size(c["offsets"]))] = _StorageInfo(
                c["file"], c["offset"], c["length"]
            )
        planner[key] = _path(key)
    for key, where in objects.items():
        sdm[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo(where["file"], where["offset"], where["length"])
        planner[key] = _path(key)
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=uuid.uuid4().hex),
        version=DCP_VERSION,
    )


def to_bytes(metadata: Metadata) -> bytes:
    """The `.metadata` file's contents: the Metadata pickled, as DCP writes it."""
    return pickle.dumps(metadata)


class _SafeUnpickler(pickle.Unpickler):
    """Only the classes a DCP `.metadata` holds (ours and DCP-written ones)."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        """The class a pickle names, only if it is one the metadata may hold (ALLOWED, or a torch
        dtype); anything else is refused."""
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


def read_safely(path: Path) -> Metadata:
    """A `.metadata` file, unpickled with only DCP's metadata classes allowed."""
    return _SafeUnpickler(io.BytesIO(Path(path).read_bytes())).load()
