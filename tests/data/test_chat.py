"""Conversations for fine-tuning: `strata data prepare` renders chat records with real chat templates
(Llama 3's; Qwen2.5's, with its default system prompt and tools; LFM2.5's, with tools and
`{% generation %}` markers; the built-in ChatML) into the ids transformers' `apply_chat_template`
gives, token for token, with its assistant mask: `return_assistant_tokens_mask` where the template
marks the assistant's text, and where it does not the mask TRL derives by rendering prefixes
(`apply_chat_template` of messages[:k] with the generation prompt, then of messages[:k+1]). The
tokenizers are small BPEs trained here and saved by transformers itself. The windows never cut a
conversation, the boundaries are the conversations', and every bad input is one error (exit 2)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.data.chat import CHATML
from strata.data.loader import make_loader
from strata.data.tokens import TokenDataset, docs_file, mask_file, read_meta
from strata.errors import DataError
from strata.model import documents_of

from conftest import run_cli

TEMPLATES = Path(__file__).parent / "templates"  # copied from each model's tokenizer_config.json
SPECIAL = [
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|startoftext|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
]
WORDS = (
    "the weather in paris is sunny cold warm what should i wear today a coat hello thanks".split()
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# (template file or None for the built-in chatml, bos, eos as the model's tokenizer_config has them)
FAMILIES = {
    "llama3": ("llama3.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": ("qwen2_5.jinja", None, "<|im_end|>"),
    "lfm2_5": ("lfm2_5.jinja", "<|startoftext|>", "<|im_end|>"),
    "chatml": (None, None, "<|endoftext|>"),
}
TOOL_FAMILIES = ("qwen2_5", "lfm2_5")
MARKED = ("lfm2_5", "chatml")  # the templates with {% generation %} markers
MARKERS = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' test for them


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversations(n: int, seed: int, tools: bool) -> list[dict]:
    """Records of several shapes: multi-turn with a system prompt, single-turn, and (with tools) an
    assistant tool call, the tool's answer and the final reply."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": text(rng, 5)}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            turns += [
                {"role": "user", "content": text(rng, rng.randint(2, 12))},
                {"role": "assistant", "content": text(rng, rng.randint(1, 15))},
            ]
        record: dict = {"messages": turns}
        if tools and i % 2:
            call = {"type": "function", "function": {"name": "get_weather", "arguments": {}}}
            call["function"]["arguments"] = {"city": rng.choice(["paris", "lima"])}
            turns[-1:] = [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": text(rng, 4)},
                {"role": "assistant", "content": text(rng, 6)},
            ]
            record["tools"] = TOOLS
        out.append(record)
    return out


def make_tokenizer(directory: Path, family: str) -> Path:
    """A byte-level BPE trained on a few sentences, with every template's special tokens, saved by
    transformers with the family's chat template, bos and eos."""
    template, bos, eos = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    tok.train_from_iterator([text(rng, 20) for _ in range(300)], trainer)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    if template is not None:
        hf.chat_template = (TEMPLATES / template).read_text()
    hf.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: make_tokenizer(root / family, family) for family in FAMILIES}


def reference(directory: Path, family: str, record: dict, loss_on: str = "assistant"):
    """transformers' ids and mask of a record: return_assistant_tokens_mask for a marked template,
    else TRL's prefix rendering (each assistant turn from the end of messages[:k] with the
    generation prompt to the end of messages[:k+1]; a completion from the end of the prompt)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(directory)
    template = hf.chat_template if FAMILIES[family][0] else CHATML  # chatml: Strata's built-in
    messages, tools = record["messages"], record.get("tools")

    def ids(msgs: list[dict], prompt: bool = False) -> list[int]:
        out = hf.apply_chat_template(
            msgs, tools=tools, chat_template=template, add_generation_prompt=prompt
        )
        return list(out["input_ids"])

    out = hf.apply_chat_template(
        messages, tools=tools, chat_template=template, return_assistant_tokens_mask=True
    )
    full = list(out["input_ids"])
    if loss_on == "all":
        return full, [1] * len(full)
    if loss_on == "completion":
        prompt = len(ids(messages[:1], True))
        return full, [0] * prompt + [1] * (len(full) - prompt)
    if MARKERS.search(template):
        mask = list(out["assistant_masks"])
    else:
        mask = [0] * len(full)
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                start, end = len(ids(messages[:k], True)), ids(messages[: k + 1])
                assert full[: len(end)] == end  # the template renders prefixes as prefixes
                mask[start : len(end)] = [1] * (len(end) - start)
    if loss_on == "last_turn":  # the last run of ones
        last = max(i for i, v in enumerate(mask) if v)
        first = last
        while first > 0 and mask[first - 1]:
            first -= 1
        mask = [int(first <= i <= last) for i in range(len(mask))]
    return full, mask


def prepare(tmp: Path, records: list[dict], tok: Path, *extra: str, capsys, name="in.jsonl"):
    src = tmp / name
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp / "out"
    argv = ["data", "prepare", str(src), "--out", str(out), "--tokenizer", str(tok)]
    code, said = run_cli([*argv, "--workers", "1", *extra], capsys)
    return code, said, out


def stored(out: Path, split: str = "train") -> list[tuple[list[int], list[int]]]:
    """Each stored conversation's (ids, mask), read through SPLIT.docs.bin, after checking the
    layout: conversations inside one window each, ended by the end-of-document token and holding
    it nowhere else, everything else padding with that id and no loss."""
    meta = read_meta(out).raw
    window, eot = meta["chat"]["window"], meta["eot"]
    tokens = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"]).astype(np.int64)
    mask = np.fromfile(out / mask_file(split), np.uint8)
    docs = np.fromfile(out / docs_file(split), np.int64).reshape(-1, 2)
    assert len(tokens) == len(mask) and len(tokens) % window == 0
    covered = np.zeros(len(tokens), bool)
    result = []
    for start, end in docs:
        assert start // window == (end - 1) // window  # never across two windows
        assert tokens[end - 1] == eot and not (tokens[start : end - 1] == eot).any()
        assert mask[start] == 0 and mask[end - 1] == 0
        covered[start:end] = True
        result.append((tokens[start : end - 1].tolist(), mask[start : end - 1].tolist()))
    assert (tokens[~covered] == eot).all() and not mask[~covered].any()
    return result


def template_text(family: str) -> str:
    file = FAMILIES[family][0]
    return (TEMPLATES / file).read_text() if file else CHATML


@pytest.mark.parametrize("family", list(FAMILIES))
def test_conversations_are_transformers_ids_and_assistant_mask(
    tmp_path, tokenizers_dir, family, capsys
):
    tok = tokenizers_dir[family]
    records = conversations(12, 1, tools=family in TOOL_FAMILIES)
    options = ["--seq-len", "4096", "--val-fraction", "0"]
    options += ["--chat-template", "chatml"] if family == "chatml" else []
    code, said, out = prepare(tmp_path, records, tok, *options, capsys=capsys)
    assert code == 0, said
    got = stored(out)
    want = []
    for record in records:
        want_ids, want_mask = reference(tok, family, record)
        want_mask[0] = 0  # a conversation's first token is never a target
        want.append((want_ids, want_mask))
    assert sorted(got) == sorted(want)  # packing places them longest first
    assert all(sum(mask) > 0 for _, mask in got)
    meta = read_meta(out).raw
    assert meta["format"] == 3 and meta["chat"]["records"]["messages"] == 12
    assert meta["chat"]["conversations"] == {"train": 12, "val": 0}
    marked = MARKERS.search(template_text(family)) is not None
    assert meta["chat"]["template"]["generation_markers"] == marked == (family in MARKED)
    assert (out / "chat_template.jinja").read_text() == template_text(family)
    # a chat model's eos_token is often its end of turn: the boundary is a token the template
    # does not write
    assert meta["tokenizer"]["eot_token"] == "<|endoftext|>"
    assert "<|endoftext|>" not in template_text(family)


def as_messages(record: dict) -> dict:
    """A prompt/completion or Alpaca record as the user and assistant messages Strata renders."""
    if "messages" in record:
        return record
    if "instruction" in record:
        user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return {"messages": [{"role": "user", "content": user},
                             {"role": "assistant", "content": record["output"]}]}  # fmt: skip
    if isinstance(record["prompt"], list):
        return {"messages": record["prompt"] + record["completion"]}
    return {"messages": [{"role": "user", "content": record["prompt"]},
                         {"role": "assistant", "content": record["completion"]}]}  # fmt: skip


def pairs(n: int, seed: int) -> list[dict]:
    """prompt/completion strings, TRL's conversational prompt/completion, and Alpaca records."""
    rng = random.Random(seed)
    out: list[dict] = []
    for i in range(n):
        a, b = text(rng, rng.randint(2, 10)), text(rng, rng.randint(1, 10))
        out.append(
            [
                {"prompt": a, "completion": b},
                {
                    "prompt": [{"role": "user", "content": a}],
                    "completion": [{"role": "assistant", "content": b}],
                },  # fmt: skip
                {"instruction": a, "input": text(rng, 3) if i % 2 else "", "output": b},
            ][i % 3]
        )
    return out


@pytest.mark.parametrize("loss_on", ["completion", "all", "last_turn"])
def test_loss_on_choices_match_trl(tmp_path, tokenizers_dir, loss_on, capsys):
    tok = tokenizers_dir["qwen2_5"]
    records = pairs(9, 2) if loss_on == "completion" else conversations(9, 3, tools=True)
    code, said, out = prepare(
        tmp_path, records, tok, "--seq-len", "4096", "--val-fraction", "0", "--loss-on", loss_on,
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, said
    want = []
    for record in records:
        want_ids, want_mask = reference(tok, "qwen2_5", as_messages(record), loss_on)
        want_mask[0] = 0
        want.append((want_ids, want_mask))
    assert sorted(stored(out)) == sorted(want)
    kinds = read_meta(out).raw["chat"]["records"]
    assert sum(kinds.values()) == 9
    if loss_on == "completion":
        assert kinds == {"messages": 0, "prompt_completion": 6, "alpaca": 3, "preference": 0}


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_long_conversations_are_truncated_or_dropped_and_counted(
    tmp_path, tokenizers_dir, policy, capsys
):
    tok = tokenizers_dir["llama3"]
    records = conversations(30, 4, tools=False)
    seq_len = sorted(len(reference(tok, "llama3", r)[0]) for r in records)[15]  # half are longer
    code, said, out = prepare(
        tmp_path, records, tok, "--seq-len", str(seq_len), "--long", policy, capsys=capsys,
        name="long.jsonl",
    )  # fmt: skip
    assert code == 0, said
    want, truncated, dropped, untrained = [], 0, 0, 0
    for record in records:
        ids, mask = reference(tok, "llama3", record)
        mask[0] = 0
        if len(ids) > seq_len:  # with its end-of-document token it does not fit seq_len + 1
            if policy == "drop":
                dropped += 1
                continue
            truncated += 1
            ids, mask = ids[:seq_len], mask[:seq_len]
        if not any(mask):
            untrained += 1
            continue
        want.append((ids, mask))
    assert truncated + dropped > 3 and len(want) > 3
    got = sorted(stored(out, "train") + stored(out, "val"))
    assert got == sorted(want)
    chat = read_meta(out).raw["chat"]
    assert (chat["truncated"], chat["dropped_long"], chat["dropped_untrained"]) == (
        truncated, dropped, untrained,
    )  # fmt: skip
    assert chat["long"] == policy and chat["window"] == seq_len + 1


def test_packing_is_best_fit_decreasing_without_cutting_a_conversation(
    tmp_path, tokenizers_dir, capsys
):
    records = conversations(40, 5, tools=True)
    tok = tokenizers_dir["qwen2_5"]
    code, said, out = prepare(
        tmp_path, records, tok, "--seq-len", "256", "--val-fraction", "0", capsys=capsys
    )
    assert code == 0, said
    stored(out)  # the layout's checks
    window = 257
    docs = np.fromfile(out / docs_file("train"), np.int64).reshape(-1, 2)
    per_window = np.bincount(docs[:, 0] // window)
    assert per_window.max() >= 2 and len(per_window) >= 3
    # best-fit decreasing of the conversations' lengths, computed here: as many windows, and the
    # same fill in each (one task: every conversation is placed before any window is written)
    lengths = sorted((docs[:, 1] - docs[:, 0]).tolist(), reverse=True)
    free: list[int] = []
    for n in lengths:
        fits = [f for f in free if f >= n]
        if fits:
            free.remove(min(fits))
            free.append(min(fits) - n)
        else:
            free.append(window - n)
    filled = np.bincount(docs[:, 0] // window, weights=docs[:, 1] - docs[:, 0])
    assert sorted(filled.astype(int).tolist()) == sorted(window - f for f in free)
    meta = read_meta(out).raw
    assert (
        meta["train_tokens"]
        == len(per_window) * window
        == meta["chat"]["windows"]["train"] * window
    )


def test_parquet_and_workers_give_the_same_directory(tmp_path, tokenizers_dir, capsys):
    records = conversations(60, 6, tools=False)
    (tmp_path / "in").mkdir()
    pq.write_table(
        pa.table({"messages": [r["messages"] for r in records]}),
        tmp_path / "in" / "chats.parquet",
        row_group_size=16,
    )
    tok = tokenizers_dir["lfm2_5"]
    outs = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        argv = ["data", "prepare", str(tmp_path / "in"), "--out", str(out), "--tokenizer", str(tok)]
        code, said = run_cli([*argv, "--seq-len", "200", "--workers", workers], capsys)
        assert code == 0, said
        outs.append(out)
    names = sorted(p.name for p in outs[0].iterdir())
    assert names == sorted(p.name for p in outs[1].iterdir())
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    chat = read_meta(outs[0]).raw["chat"]
    assert chat["conversations"]["train"] > 0 and chat["conversations"]["val"] > 0
    got = stored(outs[0], "train") + stored(outs[0], "val")
    assert len(got) == sum(chat["conversations"].values()) == 60


def test_the_end_of_turn_is_never_the_boundary(tmp_path, tokenizers_dir, capsys):
    tok = tokenizers_dir["qwen2_5"]  # eos_token <|im_end|>, the template's end of turn
    records = conversations(3, 7, tools=False)
    code, said, _ = prepare(
        tmp_path, records, tok, "--seq-len", "512", "--eot-token", "<|im_end|>", capsys=capsys
    )
    assert code == 2 and "end of turn" in said and "Traceback" not in said, said
    records[1]["messages"][1]["content"] += " <|endoftext|>"
    code, said, _ = prepare(tmp_path, records, tok, "--seq-len", "512", capsys=capsys)
    assert code == 2 and "in.jsonl:2" in said and "<|endoftext|>" in said, said
    assert "Traceback" not in said
    # text prepared with that tokenizer: its end-of-document token is the end of turn, said
    (tmp_path / "chat.txt").write_text("<|im_start|>user\nhi<|im_end|>\n")
    argv = ["data", "prepare", str(tmp_path / "chat.txt"), "--out", str(tmp_path / "text")]
    code, said = run_cli([*argv, "--tokenizer", str(tok)], capsys)
    assert code == 0 and "warning" in said and "end of turn" in said, said


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tokenizers_dir) -> Path:
    """A prepared conversation directory (seq_len 96), made without the CLI."""
    from strata.data.sft import ChatOptions, prepare_chat

    root = tmp_path_factory.mktemp("packed")
    src = root / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in conversations(50, 8, tools=True)))
    prepare_chat(
        [src], root / "out", ChatOptions(96), 0.1, tokenizer=str(tokenizers_dir["qwen2_5"]),
        workers=1,
    )  # fmt: skip
    return root / "out"


def test_the_dataset_returns_each_windows_mask_and_conversations(packed):
    data = TokenDataset(packed, "train", 96)
    meta = read_meta(packed).raw
    eot = meta["eot"]
    mask = np.fromfile(packed / mask_file("train"), np.uint8)
    assert len(data) == meta["chat"]["windows"]["train"] > 2
    for i in range(len(data)):
        row = data.window(i)
        assert (
            len(row) == 97
            and (
                row == np.fromfile(packed / "train.bin", meta["dtype"])[i * 97 : i * 97 + 97]
            ).all()
        )
        assert (data.loss_mask(i) == mask[i * 97 : i * 97 + 97].astype(bool)).all()
        ids = data.document_ids(i)
        # the trainer's split at the end-of-document token (data.document_mask) is the stored one
        split = documents_of(torch.from_numpy(row)[None], eot, True, False).ids[0].numpy()
        inside = ids >= 0
        assert (row[~inside] == eot).all()
        same_stored = ids[inside, None] == ids[None, inside]
        same_found = split[inside, None] == split[None, inside]
        assert (same_stored == same_found).all()
        assert len(np.unique(split[~inside])) == (~inside).sum()  # padding: no document of its own
        assert not np.isin(split[~inside], split[inside]).any()
    batch = data.batch([0, 1])
    assert batch.mask is not None and torch.equal(batch.mask, data.target_mask([0, 1]))
    assert batch.mask.shape == batch.targets.shape
    assert (data.target_mask([1])[0].numpy() == data.loss_mask(1)[1:]).all()
    loader = make_loader(data, seed=0, global_batch=4, micro_batch=2, dp_rank=0, dp_size=1)
    first, _ = loader.next_step()
    assert first.inputs.shape == (2, 96) and first.mask is not None
    assert first.mask.shape == (2, 96)


def test_a_conversation_directory_opens_only_whole(packed, tmp_path):
    with pytest.raises(DataError, match="--seq-len 128"):
        TokenDataset(packed, "train", 128)
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in packed.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    with open(broken / mask_file("val"), "r+b") as f:
        f.truncate(5)
    with pytest.raises(DataError, match="val.mask.bin"):
        TokenDataset(broken, "val", 96)
    (broken / docs_file("train")).unlink()
    with pytest.raises(DataError, match="missing train.docs.bin"):
        TokenDataset(broken, "train", 96)


def test_plain_token_directories_read_as_before(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("plain text, no conversations " * 20)
    code, said = run_cli(
        ["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o")], capsys
    )
    assert code == 0, said
    data = TokenDataset(tmp_path / "o", "train", 16)
    assert data.loss_mask(0).all() and len(data.loss_mask(0)) == 17
    assert data.document_ids(0) is None and data.stride == 16


@pytest.mark.parametrize(
    "records, extra, said",
    [
        ([{"messages": "hello"}], [], "'messages' must be a non-empty list"),
        ([{"messages": [{"content": "x"}]}], [], "text 'role'"),
        (conversations(2, 9, False), ["--loss-on", "completion"], "--loss-on completion needs"),
        (conversations(2, 9, False), ["--chat-template", "nope"], "--chat-template 'nope'"),
        ([{"messages": [{"role": "user"}]}], ["--chat-template", "chatml"], "cannot render"),
    ],
)
def test_bad_conversations_are_one_error(tmp_path, tokenizers_dir, records, extra, said, capsys):
    tok = tokenizers_dir["llama3"]
    code, text_out, out = prepare(tmp_path, records, tok, "--seq-len", "64", *extra, capsys=capsys)
    assert code == 2 and said in text_out and "Traceback" not in text_out, text_out
    assert not out.exists()


def test_what_conversations_need_is_asked_for(tmp_path, tokenizers_dir, capsys):
    records = conversations(2, 10, False)
    code, said, _ = prepare(tmp_path, records, tokenizers_dir["llama3"], capsys=capsys)
    assert code == 2 and "give --seq-len" in said, said
    code, said, _ = prepare(
        tmp_path, records, tokenizers_dir["chatml"], "--seq-len", "64", capsys=capsys
    )
    assert code == 2 and "no chat template" in said and "chatml" in said, said
    code, said, _ = prepare(tmp_path, records, "bpe:300", "--seq-len", "64", capsys=capsys)
    assert code == 2 and "tokenizer of the model" in said, said
    (tmp_path / "t.txt").write_text("text")
    argv = [
        "data",
        "prepare",
        str(tmp_path / "t.txt"),
        "--out",
        str(tmp_path / "o"),
        "--seq-len",
        "64",
    ]
    code, said = run_cli([*argv, "--tokenizer", str(tokenizers_dir["llama3"])], capsys)
    assert code == 2 and "is a text file" in said, said


def test_a_token_across_the_edge_of_a_turn_is_masked_as_transformers_masks_it(
    tmp_path, tokenizers_dir, capsys
):
    """A generation span that starts inside a word: the token holding its first characters is
    trained (transformers' rule: a token is trained when its characters overlap the span)."""
    template = (
        "{%- for m in messages %}{{- m['role'] + ': ' }}{%- if m['role'] == 'assistant' %}"
        "{{- 'hel' }}{%- generation %}{{- m['content'] + '<|im_end|>' }}{%- endgeneration %}"
        "{%- else %}{{- m['content'] + '<|im_end|>' }}{%- endif %}{%- endfor %}"
    )
    (tmp_path / "edge.jinja").write_text(template)
    record = {
        "messages": [
            {"role": "user", "content": "what should i wear"},
            {"role": "assistant", "content": "lo a coat"},
        ]
    }
    tok = tokenizers_dir["chatml"]
    code, said, out = prepare(
        tmp_path, [record], tok, "--seq-len", "256", "--val-fraction", "0",
        "--chat-template", str(tmp_path / "edge.jinja"), capsys=capsys,
    )  # fmt: skip
    assert code == 0, said
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tok)
    want = hf.apply_chat_template(
        record["messages"], chat_template=template, return_assistant_tokens_mask=True
    )
    ((ids, mask),) = stored(out)
    assert ids == list(want["input_ids"]) and mask == list(want["assistant_masks"])
    # the case is real: the first trained token starts before the span, inside "hel"
    text = hf.apply_chat_template(record["messages"], chat_template=template, tokenize=False)
    encoding = Tokenizer.from_file(str(tok / "tokenizer.json")).encode(
        text, add_special_tokens=False
    )
    assert encoding.offsets[mask.index(1)][0] < text.index("lo a coat")
