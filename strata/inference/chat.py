"""Prompts as a chat model's user messages (`strata generate --chat`): each rendered with the chat
template as transformers' `apply_chat_template(add_generation_prompt=True)` renders it, tokenized
without added special tokens (as it tokenizes), and generation stopped at the end of the assistant's
turn.

The template is, in order: the one `--chat-template` names (a built-in such as `chatml`, a `.jinja`
file, or one of the tokenizer's named templates); for a Strata checkpoint, the one its run's data
was prepared with (`chat_template.jinja` in the data directory, with the special tokens meta.json
recorded); for a Hugging Face directory, its own (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`). None of these is one error naming `--chat-template`.

A generation stops at any of the model's stop ids (generation_config.json's `eos_token_id`, a single
id or a list, for a Hugging Face directory; the data's end-of-document id for a checkpoint) and at
the template's end of turn (`strata.data.chat.end_of_turn`: `<|eot_id|>`, `<|im_end|>`, and its
eos_token).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from strata.data.chat import (
    BUILTIN,
    TEMPLATE_FILE,
    ChatTemplate,
    end_of_turn,
    load_template,
    render,
    special_tokens,
)
from strata.data.tokens import read_meta
from strata.errors import DataError
from strata.inference.source import Opened


@dataclass(frozen=True)
class Chat:
    """The template prompts are rendered with, and the ids that end the assistant's turn (the
    model's own stop ids among them)."""

    template: ChatTemplate
    stop_ids: frozenset[int]
    end_of_turn: tuple[str, ...]  # the tokens found as the template's end of turn, for the console

    def prompt(self, user: str) -> str:
        """The text of one user message with the generation prompt after it."""
        text, _ = render(
            self.template, [{"role": "user", "content": user}], None, True, "--chat prompt"
        )
        return text


def _recorded(data_dir: Path) -> tuple[str | None, dict[str, str], Path | None]:
    """What a prepared data directory says of its conversations: the template it was prepared with
    (None for text data), the special tokens the template saw, and the directory of the tokenizer
    it named (None when unknown or gone)."""
    try:
        meta = read_meta(data_dir).raw
    except DataError:  # gone or not prepared data: nothing recorded
        meta = {}
    chat = meta.get("chat") if isinstance(meta.get("chat"), dict) else None
    found = meta.get("tokenizer")
    tokenizer: dict = found if isinstance(found, dict) else {}
    source = tokenizer.get("source")
    origin = Path(source) if isinstance(source, str) and tokenizer.get("kind") == "file" else None
    if origin is not None and origin.is_file():
        origin = origin.parent
    if origin is not None and not origin.is_dir():
        origin = None
    template = None
    if chat is not None and (data_dir / TEMPLATE_FILE).is_file():
        template = (data_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
    block = chat.get("template") if chat is not None else None
    recorded = block.get("special") if isinstance(block, dict) else None
    if isinstance(recorded, dict):
        special = {k: v for k, v in recorded.items() if isinstance(v, str)}
    else:  # data prepared before the special tokens were recorded: the tokenizer's own
        special = special_tokens(origin) if origin is not None else {}
    return template, special, origin


def _checkpoint_template(opened: Opened, choice: str | None) -> ChatTemplate:
    """The template of a Strata checkpoint: `choice`, else the run's data's."""
    prepared = opened.cfg.data.prepared_dir()
    data_dir = Path(prepared) if prepared else None
    text, special, origin = _recorded(data_dir) if data_dir else (None, {}, None)
    if choice is None and text is not None and data_dir is not None:
        return ChatTemplate(text, str(data_dir / TEMPLATE_FILE), special)
    if choice is None:
        what = (
            f"its data {data_dir} holds text, not conversations"
            if data_dir
            else "it trained on the built-in corpus"
        )
        raise DataError(
            f"strata generate --chat: {opened.what} has no chat template ({what}); name one with "
            f"--chat-template: a built-in ({', '.join(BUILTIN)}), a .jinja file, or a template of "
            "the tokenizer's"
        )
    found = load_template(origin or data_dir or Path("."), choice)
    return ChatTemplate(found.text, found.source, special or found.special)


def open_chat(path: Path, opened: Opened, choice: str | None = None) -> Chat:
    """The chat set-up of the model opened from `path` (see the module docstring)."""
    if (Path(path) / "config.json").is_file():
        try:
            template = load_template(Path(path), choice)
        except DataError as e:
            raise DataError(f"strata generate --chat: {e}") from e
    else:
        template = _checkpoint_template(opened, choice)
    tok = opened.tokenizer.library_tokenizer
    turn = end_of_turn(template, tok) if tok is not None else []
    stops = frozenset(opened.stop_ids | {i for _, i in turn})
    return Chat(template, stops, tuple(t for t, _ in turn))
