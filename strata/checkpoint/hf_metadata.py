"""What a Hugging Face export writes besides the weights: config.json's fields beyond the model's
shape (context length and RoPE scaling, special-token ids, sliding window), the tokenizer with its
config (chat template, bos/eos/pad tokens, model_max_length) and generation_config.json.

They are carried from the model the run started from (`model.init_from`, a Hugging Face directory)
while the run's model is still that model (same shapes, same RoPE), so an imported model exports as
it came in; what the source does not say, or what the run changed, is set from the run's own
config, and a note says so. A source that is gone, or a tokenizer the run's data names but that
cannot be read, would lose fields: the export refuses, unless forced (the notes then say what is
lost)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from strata.checkpoint import store
from strata.config.schema import Config
from strata.errors import CheckpointError, ConfigError
from strata.hf import byte_tokenizer, config_json

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# The tokenizer's files besides tokenizer.json that a source model directory may hold
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CHAT_TEMPLATE = "chat_template.jinja"  # as transformers saves a tokenizer's template


@dataclass
class Metadata:
    """config.json, the other files (name -> bytes) and the notes for the console."""

    config: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Source:
    """The Hugging Face model directory the run started from, and its config.json."""

    path: Path
    config: dict[str, Any]

    def file(self, name: str) -> bytes | None:
        """The bytes of file `name` in the model directory, or None when it cannot be read."""
        try:
            return (self.path / name).read_bytes()
        except OSError:
            return None


@dataclass
class _RunTokenizer:
    """The tokenizer the run's prepared data names (None: byte-level, or no data found)."""

    data: bytes | None
    eot_token: str | None
    eot: int | None
    byte_level: bool = False  # Strata's byte tokens, spelled as a tokenizer.json (`byte_tokenizer`)
    chat: _RunChat | None = None  # conversations' template, when the data holds conversations


@dataclass
class _RunChat:
    """What a conversation directory records of its chat template: the text, the special tokens it
    was rendered with, and the ids that end an assistant turn (None: not recorded)."""

    template: str
    source: str
    special: dict[str, str]
    end_of_turn: list[int] | None


def hf_metadata(cfg: Config, computed: dict[str, Any], force: bool = False) -> Metadata:
    """The export's config.json and other files for the run of `cfg`, whose model's own config.json
    (`strata.hf.config_json.hf_config`, with the checkpoint's dtype) is `computed`. Raises
    CheckpointError where fields would be lost, unless `force`."""
    source = _source(cfg, force)
    run_tok = _run_tokenizer(cfg, force)
    same = source is not None and _same_model(source.config, cfg, computed)
    out = Metadata(dict(computed))
    if source is not None and not same:
        out.notes.append(
            f"the run's model is no longer that of {source.path} (its shape or RoPE changed): "
            "config.json is set from the run's config"
        )
    kept = source if same else None
    if kept is not None:
        _carry_config(out, kept, cfg, computed)
    if kept is not None and run_tok.data is not None:
        source_tok = kept.file("tokenizer.json")
        if source_tok is None or _digest(source_tok) != _digest(run_tok.data):
            # the run's data was tokenized otherwise: the source's token settings do not apply
            kept = None
    if kept is None:
        _set_token_ids(out, cfg, run_tok, carried=same)
    _tokenizer(out, run_tok, kept)
    _generation_config(out, kept)
    if run_tok.chat is not None and "tokenizer.json" in out.files:
        _chat_template(out, run_tok.chat, run_tok.eot)
    return out


def _source(cfg: Config, force: bool) -> _Source | None:
    """The Hugging Face directory the run's weights came from, if they came from one."""
    path = _origin(cfg.model.init_from)
    if path is None:
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict):
        return _Source(path, config)
    if not force:
        raise CheckpointError(
            f"strata ckpt export: the run started from the Hugging Face model {str(path)!r} "
            "(model.init_from), which is gone or unreadable: its context length, special-token "
            "ids, tokenizer config, chat template and generation config cannot be carried into the "
            "export. Put it back, or pass --force to set them from the run's config"
        )
    return None


def _origin(init_from: str | None) -> Path | None:
    """model.init_from when it names a Hugging Face directory (or a path that is gone); when it names
    a Strata checkpoint, the directory that checkpoint's run started from, followed through each
    config.yaml. None: the weights came from no Hugging Face model (or a checkpoint DCP wrote)."""
    for _ in range(16):  # a chain of runs, each started from the last one's checkpoint
        if not init_from:
            return None
        path = Path(init_from)
        if (path / "config.json").exists() or not path.exists():
            return path
        try:
            data = yaml.safe_load((store.resolve(path) / "config.yaml").read_text())
        except (CheckpointError, OSError, yaml.YAMLError):
            return None
        model = data.get("model") if isinstance(data, dict) else None
        init_from = model.get("init_from") if isinstance(model, dict) else None
    return None


def _run_tokenizer(cfg: Config, force: bool) -> _RunTokenizer:
    """The tokenizer.json the run's prepared data names (data.path, or the first source's: one
    tokenizer), with its end-of-document token; for byte-level tokens (`strata data prepare
    --tokenizer bytes`, the built-in corpus) the one `byte_tokenizer` spells."""
    prepared = cfg.data.prepared_dir()
    data = Path(prepared) if prepared else None
    try:
        meta = json.loads((data / "meta.json").read_text()) if data else None
    except (OSError, ValueError):
        meta = None
    info = meta.get("tokenizer") if isinstance(meta, dict) else None
    byte_level = info == "byte" or isinstance(info, dict) and info.get("kind") == "bytes"
    # the built-in corpus is byte-level too, but a model that started elsewhere (an import) has
    # its source's tokenizer, not the corpus's
    builtin = data is None and not cfg.model.init_from
    if builtin or byte_level:  # "byte": meta.json's first format, byte-level only
        spelled = json.dumps(byte_tokenizer.byte_level_tokenizer(), ensure_ascii=False)
        return _RunTokenizer(
            spelled.encode(), byte_tokenizer.EOT_TOKEN, byte_tokenizer.EOT_ID, byte_level=True
        )
    if data is None or not isinstance(info, dict) or not info.get("file"):
        return _RunTokenizer(None, None, None)
    eot_token = info.get("eot_token") if isinstance(info.get("eot_token"), str) else None
    eot = meta.get("eot") if isinstance(meta, dict) and isinstance(meta.get("eot"), int) else None
    try:
        data_bytes = (data / info["file"]).read_bytes()
    except OSError as e:
        if not force:
            raise CheckpointError(
                f"strata ckpt export: the run's tokenizer {data / info['file']} cannot be read "
                f"({e}); the export "
                "would have none. Restore it, or pass --force to export without a tokenizer"
            ) from e
        return _RunTokenizer(None, eot_token, eot)
    recorded = info.get("sha256")
    actual = hashlib.sha256(data_bytes).hexdigest()
    if isinstance(recorded, str) and actual != recorded:
        if not force:
            raise CheckpointError(
                f"strata ckpt export: {data / info['file']} (sha256 {actual[:12]}) is not the "
                f"tokenizer {data / 'meta.json'} records (sha256 {recorded[:12]}); the export "
                "would ship a tokenizer the model was not trained with. Put back the "
                "tokenizer.json the data was prepared with, or pass --force to export without a "
                "tokenizer"
            )
        return _RunTokenizer(None, eot_token, eot)
    chat = _run_chat(data, meta) if isinstance(meta, dict) else None
    return _RunTokenizer(data_bytes, eot_token, eot, chat=chat)


def _run_chat(data: Path, meta: dict) -> _RunChat | None:
    """The chat template of a conversation directory (meta.json's "chat" block and the
    chat_template.jinja beside it); None for text data."""
    chat = meta.get("chat")
    if not isinstance(chat, dict):
        return None
    try:
        text = (data / CHAT_TEMPLATE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    found = chat.get("template")
    template: dict = found if isinstance(found, dict) else {}
    found = template.get("special")
    special: dict = found if isinstance(found, dict) else {}
    turns = chat.get("end_of_turn")
    ids = None
    if isinstance(turns, list):
        ids = [t["id"] for t in turns if isinstance(t, dict) and isinstance(t.get("id"), int)]
    return _RunChat(
        text,
        str(template.get("source", data / CHAT_TEMPLATE)),
        {k: v for k, v in special.items() if isinstance(v, str)},
        ids,
    )


def _same_model(source: dict[str, Any], cfg: Config, computed: dict[str, Any]) -> bool:
    """Whether the run's model is still the source's: every model.* value the source's config.json
    implies equals the run's, and the vocabulary has its size."""
    try:
        settings = config_json.model_settings(source, cfg.model.seq_len)
    except ConfigError:
        return False
    for key, value in settings.items():
        if key == "moe":
            moe: dict = value  # type: ignore[assignment]
            if any(getattr(cfg.model.moe, k) != v for k, v in moe.items() if k != "aux_loss_coef"):
                return False
        elif key == "vocab_size":
            if value != computed["vocab_size"]:
                return False
        elif getattr(cfg.model, key) != value:
            return False
    return True


def _carry_config(out: Metadata, source: _Source, cfg: Config, computed: dict[str, Any]) -> None:
    """The source's config.json, in the checkpoint's dtype; its context length raised to the run's
    when the run trained longer (not for dynamic NTK, whose base grows past it)."""
    out.config = {**source.config}
    keys = [k for k in ("torch_dtype", "dtype") if k in source.config] or ["torch_dtype"]
    out.config.update(dict.fromkeys(keys, computed["torch_dtype"]))
    if "router_aux_loss_coef" in computed:  # the run's, which may differ from the source's
        out.config["router_aux_loss_coef"] = computed["router_aux_loss_coef"]
    rope = config_json.rope_parameters(source.config)
    longest = source.config.get("max_position_embeddings")
    if isinstance(longest, int) and cfg.model.seq_len > longest and rope["rope_type"] != "dynamic":
        out.config["max_position_embeddings"] = cfg.model.seq_len
        out.notes.append(
            f"max_position_embeddings: {cfg.model.seq_len}, the run's model.seq_len (the source's "
            f"{longest} is shorter)"
        )


def _set_token_ids(out: Metadata, cfg: Config, run_tok: _RunTokenizer, carried: bool) -> None:
    """Token ids from the run's tokenizer (its end-of-document token ends a generation), and a note
    of what the run's config decided."""
    for key in TOKEN_IDS:
        out.config.pop(key, None)
    if run_tok.eot is not None:
        out.config["eos_token_id"] = run_tok.eot
    what = (
        ""
        if carried
        else f"max_position_embeddings {out.config['max_position_embeddings']} (model.seq_len "
        f"{cfg.model.seq_len}), no sliding window, "
    )
    out.notes.append(
        f"config.json from the run's config and tokenizer: {what}eos_token_id "
        f"{out.config.get('eos_token_id', 'none')} (the run's end-of-document token), no bos or "
        "pad token"
    )


def _tokenizer(out: Metadata, run_tok: _RunTokenizer, source: _Source | None) -> None:
    """tokenizer.json (the run's, else the source's) and its config: the source's files when its
    tokenizer is the one the run used (`source` given), else one set from the run's config."""
    tokenizer = run_tok.data
    if source is not None:
        tokenizer = tokenizer or source.file("tokenizer.json")
        out.files.update((n, d) for n in TOKENIZER_EXTRAS if (d := source.file(n)) is not None)
    if tokenizer is None:
        out.notes.append(
            "no tokenizer exported: the run's data records none (or its tokenizer was not found)"
        )
        return
    out.files["tokenizer.json"] = tokenizer
    if "tokenizer_config.json" in out.files:
        return
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": out.config["max_position_embeddings"],
    }
    if run_tok.eot_token is not None:
        settings["eos_token"] = run_tok.eot_token
    out.files["tokenizer_config.json"] = (json.dumps(settings, indent=2) + "\n").encode()
    if run_tok.byte_level:
        out.notes.append(
            "tokenizer.json for the run's byte-level tokens: ids 0..255 are UTF-8 bytes, "
            f"{run_tok.eot} is {run_tok.eot_token}"
        )
    out.notes.append(
        "tokenizer_config.json from the run's config: model_max_length "
        f"{settings['model_max_length']}, "
        f"eos_token {settings.get('eos_token', 'none')}"
        + ("" if run_tok.chat is not None else ", no chat template")
    )


def _generation_config(out: Metadata, source: _Source | None) -> None:
    """The source's generation_config.json, else the one transformers makes from config.json's ids."""
    data = source.file("generation_config.json") if source is not None else None
    if data is None:
        ids = {k: out.config[k] for k in TOKEN_IDS if out.config.get(k) is not None}
        data = (json.dumps({"_from_model_config": True, **ids}, indent=2) + "\n").encode()
        out.notes.append(
            "generation_config.json from config.json's token ids (greedy decoding by default)"
        )
    out.files["generation_config.json"] = data


def _chat_template(out: Metadata, chat: _RunChat, eot: int | None) -> None:
    """The chat template the run's conversations were rendered with, as transformers saves one
    (chat_template.jinja, and tokenizer_config.json's chat_template for older readers) with the
    special tokens it saw; generation_config.json's eos_token_id extended by the end of turn and
    the data's end-of-document id `eot` (where `strata generate` stops on the checkpoint)."""
    out.files[CHAT_TEMPLATE] = chat.template.encode()
    settings = json.loads(out.files["tokenizer_config.json"])
    settings.update(chat.special)
    settings["chat_template"] = chat.template
    out.files["tokenizer_config.json"] = (json.dumps(settings, indent=2) + "\n").encode()
    out.notes.append(f"chat template: the run's data's ({chat.source})")
    if chat.end_of_turn is None:
        out.notes.append(
            "the run's data records no end-of-turn token: generation_config.json keeps its "
            "eos_token_id (prepare the data again with this version to record it)"
        )
        return
    generation = json.loads(out.files["generation_config.json"])
    eos = generation.get("eos_token_id")
    before = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ends = [*chat.end_of_turn, *([] if eot is None else [eot])]
    ids = before + [i for i in dict.fromkeys(ends) if i not in before]
    if ids != before:
        generation["eos_token_id"] = ids
        out.files["generation_config.json"] = (json.dumps(generation, indent=2) + "\n").encode()
        out.notes.append(
            f"generation_config.json: eos_token_id {ids} (with the end of turn and of a document)"
        )


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
