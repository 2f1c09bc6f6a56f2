"""A local Hugging Face model directory (config.json with model.safetensors, or shards listed in
model.safetensors.index.json) opened as a read-only checkpoint of model weights under Strata's
names. The safetensors headers say where each tensor's bytes are, so every rank reads only the
boxes its tp/pp/ZeRO placement owns, through the same reader as Strata's own checkpoints: no rank
ever holds the whole model.

Not transformers' loader, nor DCP's HuggingFaceStorageReader: both read whole tensors (the latter
plans by DTensor shards, which cannot express ZeRO's flat-range pieces)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from strata.checkpoint.layout import listed
from strata.checkpoint.manager import write_whole
from strata.checkpoint.reader import Checkpoint
from strata.errors import CheckpointError
from strata.hf import tensor_names
from strata.hf.shape import ModelShape

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"

# safetensors dtype codes -> torch dtype names (checkpoint.plan.torch_dtype reads these)
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def weight_files(directory: Path) -> list[str]:
    """The safetensors files holding the weights, relative to `directory`."""
    directory = Path(directory)
    if (directory / SHARD_INDEX).is_file():
        try:
            weight_map = json.loads((directory / SHARD_INDEX).read_text(encoding="utf-8"))[
                "weight_map"
            ]
            files = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{directory / SHARD_INDEX}: not a safetensors shard index ({e})"
            ) from e
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{directory}: {SHARD_INDEX} lists shards that are not there: "
                f"{', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}; copy the whole model directory"
            )
        return files
    if (directory / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    found = sorted(p.name for p in directory.glob("*.bin")) if directory.is_dir() else []
    hint = f" (it has {found[0]}: convert pickled weights to safetensors first)" if found else ""
    raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {SHARD_INDEX}{hint}")


def header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data starts."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 2**20:
                raise ValueError(f"a {n}-byte header")
            entries = json.loads(f.read(n))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file ({e})") from e
    if not isinstance(entries, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    entries.pop("__metadata__", None)
    return entries, 8 + n


def open_weights(directory: Path, model_cfg: ModelShape) -> Checkpoint:
    """The model directory's weights as a checkpoint at step 0 whose tensors are `model.<Strata
    name>` for Strata's model of `model_cfg`. A tensor the model needs that the directory lacks, or
    a weight of a feature the model does not have (an output bias, more layers), is an error listing
    them; RoPE buffers some exports include are skipped."""
    directory = Path(directory)
    found: dict[str, tuple[str, dict, int]] = {}  # HF name -> (file, header entry, data start)
    sizes: dict[str, int] = {}
    for name in weight_files(directory):
        path = directory / name
        entries, start = header(path)
        sizes[name] = path.stat().st_size
        found.update((hf_name, (name, entry, start)) for hf_name, entry in entries.items())
    problems = []
    missing = tensor_names.missing(found, model_cfg)
    if missing:
        problems.append(f"missing tensors: {listed(missing)}")
    unused = tensor_names.unused(found, model_cfg)
    if unused:
        problems.append(
            "tensors this model has no place for (a feature Strata lacks, or other layers): "
            f"{listed(unused)}"
        )
    untied = _untied_head(directory, found, model_cfg)
    if untied:
        problems.append(untied)
    if problems:
        raise CheckpointError(
            f"{directory}: the weights do not fit the model its config.json describes: "
            + "; ".join(problems)
        )
    tensors = {}
    expected = _model_shapes(model_cfg, found)
    mismatched = []
    for strata_name, hf_name in tensor_names.hf_sources(model_cfg).items():
        dtype, shape, chunk = _chunk(directory, hf_name, found, sizes)
        want = expected.get(strata_name)
        if want is not None and tuple(shape) != want:
            mismatched.append(f"{hf_name} is {tuple(shape)}, config.json makes it {want}")
        tensors[f"model.{strata_name}"] = {"shape": shape, "dtype": dtype, "chunks": [chunk]}
    # one HF tensor per expert: rows of one
    for strata_name, rows in tensor_names.expert_names(model_cfg).items():
        tensors[f"model.{strata_name}"] = _stacked(
            directory, rows, found, sizes, expected.get(strata_name), mismatched
        )
    if mismatched:
        raise CheckpointError(
            f"{directory}: the weights' shapes contradict its config.json, {len(mismatched)} "
            "shape mismatches: "
            + "; ".join(mismatched[:8])
            + ". Use the config.json the weights were saved with"
        )
    return Checkpoint.foreign(directory, {"tensors": tensors, "objects": {}}, sizes)


ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PATTERNS = ("rank_pattern", "alpha_pattern")  # PEFT's per-layer ranks and alphas


def open_adapter(directory: Path, rank: int, alpha: float) -> Checkpoint:
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) as a
    read-only checkpoint of `model.<Strata name>` adapter tensors (`tensor_names.from_peft`),
    after checking that its adapters compute what this run's do: LoRA, rank `rank`, alpha `alpha`,
    PEFT's plain scaling (no rsLoRA, no DoRA), no trained biases, and every tensor one Strata has
    a place for. Which adapters it holds, and their shapes, the loader checks against the model."""
    directory = Path(directory)
    try:
        adapter = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        assert isinstance(adapter, dict)
    except (OSError, UnicodeDecodeError, ValueError, AssertionError) as e:
        raise CheckpointError(
            f"model.lora.init_from: {directory / ADAPTER_CONFIG} is not a PEFT adapter config ({e})"
        ) from e
    want = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
    }
    differ = [
        f"{k}: {adapter.get(k)!r} (this run: {v!r})"
        for k, v in want.items()
        if adapter.get(k, v if k not in ("peft_type", "r", "lora_alpha") else None) != v
    ]
    differ += [f"{k}: {adapter[k]!r} (per-layer values)" for k in PATTERNS if adapter.get(k)]
    if differ:
        raise CheckpointError(
            f"model.lora.init_from: {directory / ADAPTER_CONFIG} describes other adapters than "
            f"model.lora's: {'; '.join(differ)}; set model.lora.rank and model.lora.alpha to the "
            "adapter's r and lora_alpha (rsLoRA, DoRA, trained biases, fan_in_fan_out and "
            "per-layer ranks are not Strata's LoRA)"
        )
    path = directory / ADAPTER_FILE
    entries, start = header(path)
    sizes = {ADAPTER_FILE: path.stat().st_size}
    found = {name: (ADAPTER_FILE, entry, start) for name, entry in entries.items()}
    foreign = [n for n in found if tensor_names.from_peft(n) is None]
    if foreign:
        raise CheckpointError(
            f"model.lora.init_from: {path} holds tensors that are no LoRA adapter of a layer "
            f"Strata's model has: {listed(foreign)}"
        )
    tensors = {}
    for name in found:
        dtype, shape, chunk = _chunk(directory, name, found, sizes)
        strata_name = tensor_names.from_peft(name)
        tensors[f"model.{strata_name}"] = {"shape": shape, "dtype": dtype, "chunks": [chunk]}
    return Checkpoint.foreign(directory, {"tensors": tensors, "objects": {}}, sizes)


def _untied_head(
    directory: Path, found: dict[str, tuple[str, dict, int]], model_cfg: ModelShape
) -> str | None:
    """Why a tied model's files cannot load as tied: they hold an output projection that is not the
    embedding (transformers would untie the two and warn; Strata refuses, so that the trained model
    is the one the files describe). None when untied, or when the head is absent or equal."""
    embed_name = tensor_names.hf_sources(model_cfg)["tok_embeddings.weight"]
    if not model_cfg.tie_embeddings or "lm_head.weight" not in found or embed_name not in found:
        return None
    (head_file, head, head_start), (embed_file, embed, embed_start) = (
        found["lm_head.weight"],
        found[embed_name],
    )
    same = head.get("dtype") == embed.get("dtype") and head.get("shape") == embed.get("shape")
    try:
        same = same and _same_bytes(
            directory / head_file,
            head_start + int(head["data_offsets"][0]),
            directory / embed_file,
            embed_start + int(embed["data_offsets"][0]),
            int(head["data_offsets"][1]) - int(head["data_offsets"][0]),
        )
    except (KeyError, TypeError, ValueError, IndexError, OSError):
        same = False
    if same:
        return None
    return (
        f"config.json ties the word embeddings (tie_word_embeddings: true), but {head_file} holds "
        f"an lm_head.weight that differs from {embed_name} (transformers would untie them, with a "
        "warning). Set tie_word_embeddings: false in config.json to load both as they are, or "
        "delete lm_head.weight to tie the head to the embedding"
    )


def _same_bytes(
    a: Path, a_start: int, b: Path, b_start: int, length: int, block: int = 16 * 2**20
) -> bool:
    """Whether `length` bytes of file `a` from `a_start` equal those of `b` from `b_start`."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(a_start)
        fb.seek(b_start)
        for done in range(0, length, block):
            n = min(block, length - done)
            if fa.read(n) != fb.read(n):
                return False
    return True


def _chunk(
    directory: Path, hf_name: str, found: dict[str, tuple[str, dict, int]], sizes: dict[str, int]
) -> tuple[object, list[int], dict]:
    """(dtype, shape, the index chunk of its bytes) of the HF tensor `hf_name`, from its file's header
    entry; a malformed entry or one pointing past its file's end is a CheckpointError."""
    file, entry, start = found[hf_name]
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        lo, hi = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{directory / file}: a malformed header entry for {hf_name} ({e!r})"
        ) from e
    if start + hi > sizes[file] or lo > hi:
        raise CheckpointError(
            f"{directory / file}: {hf_name} points at bytes {lo}–{hi} past the file's end "
            "(truncated?)"
        )
    chunk = {"offsets": [0] * len(shape), "sizes": shape, "file": file, "offset": start + lo}
    return dtype, shape, {**chunk, "length": hi - lo, "data_offset": start + lo}


def _stacked(
    directory: Path,
    rows: list[str],
    found: dict[str, tuple[str, dict, int]],
    sizes: dict[str, int],
    want: tuple[int, ...] | None,
    mismatched: list[str],
) -> dict:
    """The index entry of a stacked expert weight whose row e is the HF tensor `rows[e]`: one chunk
    per expert, so a rank reads only the experts it holds."""
    chunks, dtype, shape = [], None, None
    for e, hf_name in enumerate(rows):
        dtype, row, chunk = _chunk(directory, hf_name, found, sizes)
        if want is not None and tuple(row) != want[1:]:
            mismatched.append(f"{hf_name} is {tuple(row)}, config.json makes it {want[1:]}")
        shape = shape or row
        chunks.append({**chunk, "offsets": [e, *chunk["offsets"]], "sizes": [1, *row]})
    return {"shape": [len(rows), *(shape or [])], "dtype": dtype, "chunks": chunks}


def _model_shapes(
    model_cfg: ModelShape, found: dict[str, tuple[str, dict, int]]
) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the model `model_cfg` describes (built on the meta device, so no
    memory), by Strata name; the vocabulary is config.json's, else the embedding's rows."""
    import torch

    from strata.model import GPT

    vocab = model_cfg.vocab_size
    if vocab is None:
        embedding = found.get(tensor_names.hf_sources(model_cfg)["tok_embeddings.weight"])
        vocab = int(embedding[1]["shape"][0]) if embedding else 1
    with torch.device("meta"):
        model = GPT(model_cfg, vocab)  # type: ignore[arg-type]  # a ModelConfig; hf reads it as a ModelShape
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def import_hf(
    directory: Path,
    out_root: Path,
    config_yaml: str,
    model_cfg: ModelShape,
    overwrite: bool = False,
) -> Path:
    """Write the model directory's weights, as saved (same dtype), as the Strata checkpoint of step 0
    under `out_root`, with no optimizer state: `--resume` it (the optimizer starts fresh) or name it
    in model.init_from. `config_yaml` is the Strata config to continue with. Reads whole tensors:
    an offline tool, not a rank of a job (a job reads its own boxes through model.init_from)."""
    ckpt = open_weights(directory, model_cfg)
    try:
        tensors = ckpt.tensors("model.")
    finally:
        ckpt.close()
    aliases = {}
    if model_cfg.tie_embeddings:  # one tensor, two names, as a training job saves it
        del tensors["output.weight"]
        aliases["model.output.weight"] = "model.tok_embeddings.weight"
    origin = f"hugging face {Path(directory).resolve()}"
    trainer_state = {"step": 0, "data": {"consumed_samples": 0}, "imported_from": origin}
    return write_whole(
        Path(out_root),
        0,
        {f"model.{name}": t for name, t in tensors.items()},
        {"trainer": trainer_state},
        aliases,
        config_yaml,
        {"imported_from": origin},
        overwrite,
        "strata ckpt import-hf",
    )
