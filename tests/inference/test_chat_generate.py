"""`strata generate --chat` against transformers: a prompt is a user message rendered with the chat
template as `apply_chat_template(add_generation_prompt=True)` renders and tokenizes it, and greedy
decoding stops where transformers' `generate` stops with the same end-of-turn ids, token for token.
The models are tiny random Llamas saved by transformers with small BPE tokenizers that carry a real
chat template (Llama 3's, Qwen2.5's; tests/data/templates), built here offline. A run fine-tuned on
conversations exports a tokenizer whose `apply_chat_template` is the data's, and a
generation_config.json that stops at the end of the turn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.data.chat import BUILTIN, ChatTemplate, end_of_turn, load_template
from strata.data.tokenize import load_file_tokenizer

from conftest import hf_run_overrides, run_cli

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
SPECIAL = [
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]
WORDS = "the weather in paris is sunny cold warm what should i wear today a coat hello".split()
# template file (None: no template), bos, eos as each model's tokenizer_config.json has them
FAMILIES = {
    "llama3": ("llama3.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": ("qwen2_5.jinja", None, "<|im_end|>"),
    "none": (None, None, "<|endoftext|>"),
}
VOCAB = 320
PROMPTS = ["what should i wear today", "hello"]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_model(directory: Path, family: str, seed: int = 0) -> Path:
    """A tiny random Llama and a byte-level BPE with the family's template, bos and eos, both saved
    by transformers into `directory`."""
    template, bos, eos = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    tok.train_from_iterator([_sentence(rng, 20) for _ in range(200)], trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    if template is not None:
        hf.chat_template = (TEMPLATES / template).read_text()
    hf.save_pretrained(directory)
    torch.manual_seed(seed)
    vocab = tok.get_vocab()
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=vocab[bos] if bos else None,
        eos_token_id=vocab[eos],
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


def reference(directory: Path, prompt: str, eos: list[int], n: int) -> list[int]:
    """transformers' greedy reply to one user message: apply_chat_template with the generation
    prompt, then generate stopping at `eos`."""
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return out[0, len(ids) :].tolist()


def replies(out: str) -> list[str]:
    """The replies `strata generate` printed, one per prompt (each followed by a rule)."""
    return out.split("-" * 40 + "\n")[:-1]


@pytest.mark.parametrize(
    "family, expected",
    [
        ("llama3", ["<|eot_id|>"]),
        ("qwen2_5", ["<|im_end|>"]),
        ("chatml", ["<|im_end|>", "<|endoftext|>"]),
    ],
)
def test_the_end_of_turn_is_the_token_after_the_assistants_text(tmp_path, family, expected):
    if family == "chatml":
        directory = chat_model(tmp_path / "m", "none")
        template = ChatTemplate(BUILTIN["chatml"], "chatml", {"eos_token": "<|endoftext|>"})
    else:
        directory = chat_model(tmp_path / "m", family)
        template = load_template(directory, None)
    tok = load_file_tokenizer(directory / "tokenizer.json")
    vocab = tok.get_vocab(with_added_tokens=True)
    assert end_of_turn(template, tok) == [(t, vocab[t]) for t in expected]


@pytest.mark.parametrize("family", ["llama3", "qwen2_5"])
def test_generate_chat_is_transformers_chat_template_and_generate(tmp_path, family, capsys):
    directory = chat_model(tmp_path / "m", family)
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    turn = tok.convert_tokens_to_ids(FAMILIES[family][2])
    # a stop id the random model reaches: generation_config.json's list ends the reply there too
    free = reference(directory, PROMPTS[0], [turn], 12)
    stop = free[4]
    gen = json.loads((directory / "generation_config.json").read_text())
    gen["eos_token_id"] = [turn, stop]
    (directory / "generation_config.json").write_text(json.dumps(gen))
    want = [reference(directory, p, [turn, stop], 12) for p in PROMPTS]
    assert want[0] == free[: free.index(stop) + 1]

    args = ["generate", str(directory), "--chat", "--max-new-tokens", "12"]
    code, out = run_cli([*args, *(a for p in PROMPTS for a in ("--prompt", p))], capsys)
    assert code == 0, out
    texts = [tok.decode([t for t in w if t not in (turn, stop)], skip_special_tokens=True)
             for w in want]  # fmt: skip
    assert replies(out) == [t + "\n" for t in texts]
    assert f"end of turn: {FAMILIES[family][2]}" in out

    from strata.inference.chat import open_chat
    from strata.inference.generate import generate
    from strata.inference.source import open_model

    opened = open_model(directory)
    chat = open_chat(directory, opened)
    assert chat.stop_ids == {turn, stop}
    ids = [opened.tokenizer.encode(chat.prompt(p), special=False) for p in PROMPTS]
    got = generate(opened.model, ids, 12, stop_ids=chat.stop_ids).tokens
    assert got == want


def test_a_model_without_a_chat_template_is_one_error(tmp_path, capsys):
    directory = chat_model(tmp_path / "m", "none")
    code, out = run_cli(["generate", str(directory), "--chat", "--prompt", "hi"], capsys)
    assert code == 2, out
    assert "has no chat template" in out and "--chat-template" in out
    assert "Traceback" not in out
    code, out = run_cli(
        ["generate", str(directory), "--chat", "--chat-template", "chatml", "--prompt", "hi"],
        capsys,
    )
    assert code == 0, out
    assert "chat template: chatml (end of turn: <|im_end|>, <|endoftext|>)" in out
    code, out = run_cli(["generate", str(directory), "--chat-template", "x", "--prompt", "hi"],
                        capsys)  # fmt: skip
    assert code == 2 and "add --chat" in out, out


def conversations(n: int) -> list[dict]:
    rng = random.Random(1)
    return [
        {
            "messages": [
                {"role": "user", "content": _sentence(rng, rng.randint(2, 6))},
                {"role": "assistant", "content": _sentence(rng, rng.randint(2, 8))},
            ]
        }
        for _ in range(n)
    ]


@pytest.mark.slow  # prepares conversations, trains LoRA for 4 steps, exports, generates
@pytest.mark.parametrize(
    "family, choice, turn_token",
    [("llama3", None, "<|eot_id|>"), ("none", "chatml", "<|im_end|>")],
)
def test_a_chat_runs_export_carries_its_template_and_end_of_turn(
    tmp_path, capsys, family, choice, turn_token
):
    """The tokenizer's own template (Llama 3's), and one the data was prepared with in place of
    a tokenizer that has none (chatml): the export's is the data's either way."""
    from worlds import strata

    source = chat_model(tmp_path / "m", family)
    template = BUILTIN[choice] if choice else (TEMPLATES / "llama3.jinja").read_text()
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in conversations(64)))
    data = tmp_path / "sft"
    prep = strata(
        "data", "prepare", str(chats), "--tokenizer", str(source), "--seq-len", "64",
        "--out", str(data), "--workers", "1", *(["--chat-template", choice] if choice else []),
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr[-3000:]
    overrides = hf_run_overrides(
        source, data, tmp_path / "runs", 64, **{"model.lora.rank": 4, "data.document_mask": "true"}
    )
    (tmp_path / "sft.yaml").write_text("{}\n")
    done = strata("train", str(tmp_path / "sft.yaml"), *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    step = tmp_path / "runs" / "t" / "checkpoints" / "step_00000004"
    out = tmp_path / "export"
    code, said = run_cli(["ckpt", "export", str(step), str(out), "--format", "hf"], capsys)
    assert code == 0, said

    # the export's tokenizer renders conversations as the source's does, and stops at the turn
    ours = transformers.AutoTokenizer.from_pretrained(out)
    theirs = transformers.AutoTokenizer.from_pretrained(source)
    for record in conversations(3):
        messages = record["messages"][:1]
        assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
            theirs.apply_chat_template(messages, add_generation_prompt=True, chat_template=template)
        )
    assert (out / "chat_template.jinja").read_text() == template
    turn = theirs.convert_tokens_to_ids(turn_token)
    config = transformers.GenerationConfig.from_pretrained(out)
    assert turn in (
        [config.eos_token_id] if isinstance(config.eos_token_id, int) else config.eos_token_id
    )

    # generate --chat on the checkpoint: the export's greedy reply under transformers
    code, said = run_cli(
        ["generate", str(step), "--chat", "--max-new-tokens", "10", "--prompt", PROMPTS[0]],
        capsys,
    )
    assert code == 0, said
    ids = ours.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[
            0, len(ids) :
        ]
    stops = set(
        config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    )
    text = ours.decode([t for t in want.tolist() if t not in stops], skip_special_tokens=True)
    assert replies(said) == [text + "\n"]
    assert f"chat template: {data / 'chat_template.jinja'}" in said
