"""Chat templates and loss masks for fine-tuning data: a conversation record (`messages`,
`prompt`/`completion`, or Alpaca's `instruction`/`input`/`output`) rendered with a chat template as
transformers' `apply_chat_template` renders it (the same sandboxed jinja2 environment, filters,
globals, special tokens and `{% generation %}` tracking), and the characters that carry loss.

The template is the tokenizer's own (a model directory's `chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`, as transformers resolves them), a built-in one (`chatml`)
or a `.jinja` file. Which characters are trained (`LOSS_ON`, `--loss-on`):

- `assistant`: every assistant turn. A template with `{% generation %}` markers says where they are
  (transformers' `return_assistant_tokens_mask`); without markers, assistant turn k is the text
  from the end of messages[:k] rendered with the generation prompt to the end of messages[:k+1]
  (its content and end-of-turn), found by rendering prefixes as TRL finds a completion. That needs
  a template that renders earlier turns the same whatever follows; one that does not is refused.
- `last_turn`: the last of those spans; `all`: every character;
- `completion` (prompt/completion and Alpaca records): everything after the prompt rendered with
  the generation prompt, TRL's completion mask.

A preference record (`chosen` and `rejected`, with or without a `prompt`: TRL's preference formats,
`preference`) is two conversations sharing a prompt, each trained on its completion alone.

A token is trained when its characters overlap a trained span (`token_mask`, transformers' rule).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata.errors import DataError

if TYPE_CHECKING:
    import numpy as np

LOSS_ON = ("assistant", "all", "last_turn", "completion")
LONG_POLICIES = ("truncate", "drop")
TEMPLATE_FILE = "chat_template.jinja"  # beside tokenizer.json, as transformers saves it
EXTRA_TEMPLATES = "additional_chat_templates"  # transformers' folder of named templates
SPECIAL_TOKENS = (  # what transformers passes every template (`special_tokens_map`)
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' test for markers
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# ChatML (OpenAI's, Qwen's) with the assistant turns marked: for a tokenizer without a template.
CHATML = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
            {{- message['content'] + '<|im_end|>\n' }}
        {%- endgeneration %}
    {%- else %}
        {{- message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
BUILTIN = {"chatml": CHATML}


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and what it renders with: `source` says where it came from (a built-in
    name, a file, or the tokenizer's), `special` the special tokens it sees (bos_token, ...)."""

    text: str
    source: str
    special: dict[str, str] = field(default_factory=dict)

    @property
    def marked(self) -> bool:
        """Whether `{% generation %}` markers say where the assistant's text is."""
        return GENERATION_TAG.search(self.text) is not None

    @property
    def sha256(self) -> str:
        """The SHA-256 of the template's text (UTF-8), recorded in meta.json."""
        return hashlib.sha256(self.text.encode()).hexdigest()


def _read_json(path: Path) -> dict:
    """A JSON object from `path` ({} when the file is missing); a DataError when unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{path}: not readable JSON ({e}); fix or remove it") from e
    return data if isinstance(data, dict) else {}


def special_tokens(directory: Path) -> dict[str, str]:
    """The named special tokens of a tokenizer directory as strings (tokenizer_config.json, else
    the legacy special_tokens_map.json), the variables transformers gives a template."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        for key, value in _read_json(directory / name).items():
            if isinstance(value, dict):
                value = value.get("content")
            if key in SPECIAL_TOKENS and isinstance(value, str):
                found[key] = value
    return found


def own_templates(directory: Path) -> dict[str, str]:
    """A tokenizer directory's chat templates by name ("default" for the main one), resolved as
    transformers does: chat_template.jinja and additional_chat_templates/*.jinja, else
    tokenizer_config.json's chat_template (a string, or a list of {name, template})."""
    files = {"default": directory / TEMPLATE_FILE}
    if (directory / EXTRA_TEMPLATES).is_dir():
        files |= {p.stem: p for p in sorted((directory / EXTRA_TEMPLATES).glob("*.jinja"))}
    found = {name: p.read_text(encoding="utf-8") for name, p in files.items() if p.is_file()}
    if found:
        return found
    recorded = _read_json(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(recorded, str):
        return {"default": recorded}
    if isinstance(recorded, list):
        return {
            t["name"]: t["template"]
            for t in recorded
            if isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
    return {}


def load_template(directory: Path, choice: str | None) -> ChatTemplate:
    """The template `--chat-template` names for the tokenizer in `directory`: None for the
    tokenizer's own, a built-in name (chatml), the path of a .jinja file, or the name of one of the
    tokenizer's named templates. One DataError naming the choices when none fits."""
    special = special_tokens(directory)
    if choice in BUILTIN:
        return ChatTemplate(BUILTIN[choice], choice, special)
    if choice is not None and Path(choice).expanduser().is_file():
        path = Path(choice).expanduser().resolve()
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), special)
    own = own_templates(directory)
    name = "default" if choice is None else choice
    if name in own:
        if choice is not None:
            source = f"{directory}: {name}"
        elif (directory / TEMPLATE_FILE).is_file():
            source = str(directory / TEMPLATE_FILE)
        else:
            source = str(directory / "tokenizer_config.json")
        return ChatTemplate(own[name], source, special)
    builtin = ", ".join(BUILTIN)
    if choice is None:
        raise DataError(
            f"the tokenizer in {directory} has no chat template (no {TEMPLATE_FILE}, no "
            f"chat_template in tokenizer_config.json); name one with --chat-template: a built-in "
            f"({builtin}) or a .jinja file"
        )
    names = f"; the tokenizer's own: {', '.join(sorted(own))}" if own else ""
    raise DataError(
        f"--chat-template {choice!r}: not a built-in template ({builtin}), a file, or a template "
        f"of the tokenizer in {directory}{names}"
    )


# --- rendering, as transformers renders -------------------------------------------------------


@lru_cache(maxsize=8)
def compile_template(text: str) -> Any:
    """The jinja2 template of `text` in transformers' environment: sandboxed (immutable),
    trim_blocks and lstrip_blocks, loop controls, `{% generation %}`, its tojson filter and its
    raise_exception, strftime_now, dict and namespace globals. Compiled once per process."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records where the body's output starts and
        ends in the rendered text (transformers' AssistantTracker)."""

        tags = {"generation"}

        def __init__(self, environment: Any):
            super().__init__(environment)
            environment.extend(track=self.track)
            self._tracking: tuple[list[str], list[tuple[int, int]]] | None = None

        def parse(self, parser: Any) -> Any:
            """The block as a call of `_span` with its body as the caller."""
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_span", [], [], None, None)
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _span(self, caller: Any) -> str:
            out = caller()
            if self._tracking is not None:
                blocks, spans = self._tracking
                start = len("".join(blocks))
                spans.append((start, start + len(out)))
            return out

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
            """Record the spans into `spans` while rendering appends its output to `blocks`."""
            self._tracking = (blocks, spans)
            try:
                yield
            finally:
                self._tracking = None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(text)


def render(
    template: ChatTemplate,
    messages: list[dict],
    tools: list | None,
    add_generation_prompt: bool,
    where: str,
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans its `{% generation %}` blocks wrote. A
    template that fails or refuses the conversation (raise_exception) is a DataError at `where`."""
    import jinja2

    try:
        compiled = compile_template(template.text)
    except jinja2.TemplateError as e:
        raise DataError(
            f"chat template {template.source}: not a valid jinja2 template ({e})"
        ) from e
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    try:
        with compiled.environment.track(blocks, spans):
            for block in compiled.generate(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **template.special,
            ):
                blocks.append(block)
    # a template is a program: a bad record can fail it in any of Python's usual ways
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise DataError(
            f"{where}: the chat template ({template.source}) cannot render this conversation: "
            f"{type(e).__name__}: {e}; fix the record or choose another --chat-template"
        ) from e
    return "".join(blocks), spans


# --- records as conversations -----------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """One record as the template sees it: its messages, its tools (JSON schemas), and for a
    prompt/completion or Alpaca record how many messages are the prompt (None for `messages`)."""

    messages: list[dict]
    tools: list | None
    prompt_messages: int | None
    kind: str  # messages, prompt_completion or alpaca


def _message(m: object, where: str) -> dict:
    """A message as transformers passes it: keys whose value is null dropped, the reasoning under
    each name templates read (`reasoning_content`, `thinking`)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise DataError(
            f"{where}: each message must be an object with a text 'role' (and 'content'), got "
            f"{json.dumps(m, default=str)[:80]}"
        )
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def _messages(value: object, where: str, name: str) -> list[dict]:
    """A list of messages (a record's `messages`, or a conversational prompt or completion)."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: {name!r} must be a non-empty list of messages ({{role, content}} objects), "
            f"got {json.dumps(value, default=str)[:80]}"
        )
    return [_message(m, where) for m in value]


def _tools(record: dict, where: str) -> list | None:
    """The record's `tools` (a list of JSON schemas, or that list as a JSON string), or None."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise DataError(f"{where}: 'tools' is a string but not JSON ({e})") from e
    if tools is not None and not isinstance(tools, list):
        raise DataError(
            f"{where}: 'tools' must be a list of JSON schemas, got {type(tools).__name__}"
        )
    return tools or None


SHAPES = (
    "'messages' (a list of {role, content}), 'prompt' and 'completion', or 'instruction' and "
    "'output' (Alpaca, with an optional 'input')"
)


def is_chat_record(record: dict) -> bool:
    """Whether a record has one of the conversation shapes (`SHAPES`) or is a preference pair."""
    return (
        is_preference_record(record)
        or "messages" in record
        or {"prompt", "completion"} <= record.keys()
        or {"instruction", "output"} <= record.keys()
    )


def conversation(record: dict, where: str) -> Conversation:
    """The conversation of one record: `messages` as they are; a `prompt`/`completion` pair of
    strings as a user and an assistant message (lists of messages as they are, TRL's
    conversational form); Alpaca's instruction (and input, after a blank line) as the user message
    and its output as the assistant's. A DataError at `where` for anything else."""
    tools = _tools(record, where)
    if "messages" in record:
        return Conversation(
            _messages(record["messages"], where, "messages"), tools, None, "messages"
        )
    if {"prompt", "completion"} <= record.keys():
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            pair = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion},
            ]
            return Conversation(pair, tools, 1, "prompt_completion")
        first = _messages(prompt, where, "prompt")
        rest = _messages(completion, where, "completion")
        return Conversation(first + rest, tools, len(first), "prompt_completion")
    if {"instruction", "output"} <= record.keys():
        instruction, extra, output = record["instruction"], record.get("input"), record["output"]
        if not all(isinstance(v, str) for v in (instruction, output)) or not isinstance(
            extra, (str, type(None))
        ):
            raise DataError(f"{where}: 'instruction', 'input' and 'output' must be text")
        user = f"{instruction}\n\n{extra}" if extra else instruction
        pair = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return Conversation(pair, tools, 1, "alpaca")
    raise DataError(
        f"{where}: not a conversation (fields: {', '.join(list(record)[:10])}); a record needs "
        f"{SHAPES}"
    )


def is_preference_record(record: dict) -> bool:
    """Whether a record is a preference pair (`chosen` and `rejected`, TRL's preference formats)."""
    return {"chosen", "rejected"} <= record.keys()


def _shared_prompt(chosen: object, rejected: object, where: str) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) of a pair given as two whole conversations: the prompt is their
    longest common prefix of messages (TRL's `extract_prompt`)."""
    c, r = _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected")
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    if n == 0 or n == len(c) or n == len(r):
        raise DataError(
            f"{where}: without a 'prompt', 'chosen' and 'rejected' must be whole conversations "
            "that share their first messages (the prompt) and then differ; these "
            + ("share no first message" if n == 0 else "do not differ after a shared prompt")
            + ": give the prompt apart as 'prompt'"
        )
    return c[:n], c[n:], r[n:]


def preference(record: dict, where: str) -> tuple[Conversation, Conversation]:
    """The (chosen, rejected) conversations of a preference record, each with its prompt's message
    count (trained on the completion after it): `prompt`, `chosen` and `rejected` as text (a user
    and an assistant message, as a prompt/completion record) or as lists of messages (TRL's
    conversational format), or `chosen` and `rejected` alone as whole conversations sharing a
    prompt. A DataError at `where` for anything else."""
    tools = _tools(record, where)
    chosen, rejected = record["chosen"], record["rejected"]
    if "prompt" not in record:
        prompt, chosen, rejected = _shared_prompt(chosen, rejected, where)
    elif all(isinstance(v, str) for v in (record["prompt"], chosen, rejected)):
        prompt = [{"role": "user", "content": record["prompt"]}]
        chosen = [{"role": "assistant", "content": chosen}]
        rejected = [{"role": "assistant", "content": rejected}]
    else:
        prompt = _messages(record["prompt"], where, "prompt")
        chosen = _messages(chosen, where, "chosen")
        rejected = _messages(rejected, where, "rejected")
    return (
        Conversation(prompt + chosen, tools, len(prompt), "preference"),
        Conversation(prompt + rejected, tools, len(prompt), "preference"),
    )


# --- what is trained ----------------------------------------------------------------------------


def _prefix_spans(template: ChatTemplate, conv: Conversation, text: str, where: str) -> list:
    """Each assistant turn's span found by rendering prefixes (see the module docstring)."""
    spans = []
    for k, message in enumerate(conv.messages):
        if message["role"] != "assistant":
            continue
        before, _ = render(template, conv.messages[:k], conv.tools, True, where)
        through, _ = render(template, conv.messages[: k + 1], conv.tools, False, where)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(
                f"{where}: the chat template ({template.source}) renders earlier turns differently "
                "once later turns follow, so the assistant turns cannot be found by rendering "
                "prefixes; use a template with {% generation %} markers around the assistant's "
                "text (--chat-template FILE), or --loss-on all"
            )
        spans.append((len(before), len(through)))
    return spans


def loss_spans(
    template: ChatTemplate, conv: Conversation, loss_on: str, where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans to train on (`LOSS_ON`), in order."""
    text, marked = render(template, conv.messages, conv.tools, False, where)
    if loss_on == "all":
        return text, [(0, len(text))]
    if loss_on == "completion":
        if conv.prompt_messages is None:
            raise DataError(
                f"{where}: --loss-on completion needs prompt/completion or instruction/output "
                "records, this one has messages; use --loss-on assistant or last_turn"
            )
        prompt, _ = render(template, conv.messages[: conv.prompt_messages], conv.tools, True, where)
        if not text.startswith(prompt):
            raise DataError(
                f"{where}: the chat template ({template.source}) renders the prompt differently "
                "once the completion follows; use --loss-on assistant with a template that has "
                "{% generation %} markers"
            )
        return text, [(len(prompt), len(text))]
    spans = marked if template.marked else _prefix_spans(template, conv, text, where)
    return text, spans[-1:] if loss_on == "last_turn" else spans


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token (its character `offsets`) that overlaps a span, else 0: transformers'
    rule for `return_assistant_tokens_mask` (spans in order)."""
    import numpy as np  # here, so that the command line's parser does not load numpy

    mask = np.zeros(len(offsets), np.uint8)
    if not spans or not offsets:
        return mask
    bounds = np.asarray(offsets, np.int64).reshape(-1, 2)
    starts = np.asarray([s for s, _ in spans], np.int64)
    ends = np.asarray([e for _, e in spans], np.int64)
    first = np.searchsorted(ends, bounds[:, 0], side="right")  # the first span ending after it
    inside = first < len(spans)
    mask[inside] = bounds[inside, 1] > starts[first[inside]]
    return mask


def end_of_turn_problem(template: ChatTemplate, eot_token: str) -> str | None:
    """Why `eot_token` looks like the template's end of turn (None when it does not): the template
    writes it, literally or as its eos_token. Text prepared with such an end-of-document token has
    a document boundary after every turn under data.document_mask."""
    named = template.special.get("eos_token") == eot_token and "eos_token" in template.text
    if eot_token not in template.text and not named:
        return None
    return (
        f"the end-of-document token {eot_token} is the chat template's end of turn "
        f"({template.source}): if these documents are rendered conversations, "
        "data.document_mask and data.reset_positions would cut every turn into its own document; "
        "give conversations as records (messages, prompt/completion) so prepare packs and masks "
        "them, or name another end-of-document token with --eot-token"
    )


def end_of_turn(template: ChatTemplate, tok: Any) -> list[tuple[str, int]]:
    """The tokens that end an assistant turn: the first added (special) token the template writes
    after an assistant message's content (`<|eot_id|>`, `<|im_end|>`), and the template's
    eos_token where the tokenizer has it, as (token, id) pairs in that order. `tok` is a
    `tokenizers.Tokenizer`. A template whose assistant turn cannot be found gives its eos_token
    alone (or nothing)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    found: list[tuple[str, int]] = []
    user = [{"role": "user", "content": "hi"}]
    marker = "MARKER"  # plain text no template adds to
    try:
        prompt, _ = render(template, user, None, True, "a probe conversation")
        full, _ = render(
            template, [*user, {"role": "assistant", "content": marker}], None, False, ""
        )
    except DataError:
        prompt = full = ""
    at = full.find(marker, len(prompt) if full.startswith(prompt) else 0)
    if at >= 0:
        tail = full[at + len(marker) :]
        for piece in tok.encode(tail, add_special_tokens=False).tokens:
            if piece in added:
                found.append((piece, vocab[piece]))
                break
    eos = template.special.get("eos_token")
    if eos is not None and eos in vocab and all(eos != t for t, _ in found):
        found.append((eos, vocab[eos]))
    return found
