"""Direct Preference Optimization (train.objective: dpo) against TRL 1.16's DPOTrainer and a plain
torch implementation. Preference records in TRL's three shapes (conversational prompt and
completions, text, whole conversations sharing a prompt) are prepared by `strata data prepare`
into windows whose conversations alternate chosen, rejected, with the completion tokens TRL's own
tokenization trains. On a tiny random Llama imported from transformers, with PEFT LoRA adapters
that are not zero (so policy and reference differ), the first step's loss and TRL's
rewards/chosen, rewards/rejected, rewards/accuracies and rewards/margins equal DPOTrainer's on the
same pairs (the reference: the adapters off), for the sigmoid and the ipo loss; the step's
gradient of every adapter equals a plain torch implementation's (each sequence alone, no
packing), in one process with gradient accumulation and with dp 2 and tp 2 (the vocab-parallel
log-probabilities). What DPO does not run with is refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from strata import config
from strata.data.loader import BatchLoader
from strata.data.tokens import TokenDataset, read_meta
from strata.errors import ConfigError, DataError
from strata.hf.tensor_names import to_peft
from strata.lora import is_adapter
from strata.parallel.tensor import placement_of
from strata.trainer.hooks import StepHook

from conftest import hf_run_overrides
from worlds import run_world, worker_env

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")

SEQ = 128
WORDS = "the sky is blue green red what colour should i say today a cat dog yes no".split()
ROLES = "<|im_start|>system\n <|im_start|>user\n <|im_start|>assistant\n <|im_end|>\n".split(" ")
LORA = {
    "model.lora.rank": 4,
    "model.lora.alpha": 8,
    "model.lora.target_modules": "[all-linear]",
}


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A small BPE saved by transformers with ChatML as its own chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    tok.train_from_iterator(
        [_text(rng, 20) + rng.choice(ROLES) for _ in range(400)],
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    from strata.data.chat import CHATML

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    directory = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(directory)
    return directory


def _records(n: int, seed: int) -> list[dict]:
    """Conversational pairs (TRL's explicit-prompt format) of uneven lengths, some multi-turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [{"role": "user", "content": _text(rng, rng.randint(2, 8))}]
        if i % 3 == 0:
            prompt = [
                {"role": "system", "content": _text(rng, 3)},
                *prompt,
                {"role": "assistant", "content": _text(rng, 2)},
                {"role": "user", "content": _text(rng, 2)},
            ]
        out.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": _text(rng, rng.randint(1, 12))}],
                "rejected": [{"role": "assistant", "content": _text(rng, rng.randint(1, 12))}],
            }
        )
    return out


def _prepare(records: list[dict], root: Path, tok_dir: Path, *extra: str) -> Path:
    from strata.launch.cli import main

    root.mkdir(parents=True, exist_ok=True)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["data", "prepare", str(root / "pairs.jsonl"), "--out", str(root / "data")]
    argv += ["--tokenizer", str(tok_dir), "--seq-len", str(SEQ), "--workers", "1", *extra]
    assert main(argv) == 0
    return root / "data"


@pytest.fixture(scope="module")
def pairs_dir(tok_dir, tmp_path_factory) -> Path:
    return _prepare(_records(24, 0), tmp_path_factory.mktemp("pairs"), tok_dir)


def unpack(data_dir: Path, split: str = "train") -> list[tuple]:
    """Every pair of a split, in order: ((chosen ids, mask), (rejected ids, mask)), each side's
    ids without its end-of-document token, its mask the stored one (1: a trained token)."""
    data = TokenDataset(data_dir, split, SEQ)
    assert data.chat is not None
    tokens = np.asarray(data.tokens)
    sides = [
        (tokens[a : b - 1].astype(np.int64), np.asarray(data.chat.mask[a : b - 1]))
        for a, b in np.asarray(data.chat.docs)
    ]
    return list(zip(sides[::2], sides[1::2]))


# --- data --------------------------------------------------------------------------------------


def test_pairs_are_packed_side_by_side_with_trls_completions(pairs_dir, tok_dir, tmp_path):
    meta = read_meta(pairs_dir).raw
    chat = meta["chat"]
    assert chat["pairs"] is True and chat["records"]["preference"] == 24
    data = TokenDataset(pairs_dir, "train", SEQ)
    assert data.chat is not None
    window = SEQ + 1
    docs = np.asarray(data.chat.docs)
    assert len(docs) % 2 == 0
    for (a, _), (_, d) in zip(docs[::2], docs[1::2]):  # a pair never crosses a window
        assert a // window == (d - 1) // window
    # TRL's own tokenization of the same records: the same pairs, the same completions
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    want = []
    for record in _records(24, 0):
        ids = {
            side: tok.apply_chat_template(record["prompt"] + record[side], return_dict=False)
            for side in ("chosen", "rejected")
        }
        prompt = tok.apply_chat_template(
            record["prompt"], add_generation_prompt=True, return_dict=False
        )
        want.append(tuple((tuple(ids[s]), len(prompt)) for s in ("chosen", "rejected")))
    got = [
        tuple((tuple(ids.tolist()), int(np.argmax(mask))) for ids, mask in pair)
        for split in ("train", "val")
        for pair in unpack(pairs_dir, split)
    ]
    for pair in unpack(pairs_dir) + unpack(pairs_dir, "val"):
        for ids, mask in pair:  # the completion: every token after the prompt, to its end
            start = int(np.argmax(mask))
            assert mask[start:].all() and not mask[:start].any()
    assert sorted(got) == sorted(want)


def test_trls_three_shapes_of_a_pair_prepare_alike(tok_dir, tmp_path):
    conversational = _records(6, 1)
    single = [r for r in conversational if len(r["prompt"]) == 1]
    text = [
        {
            "prompt": r["prompt"][0]["content"],
            "chosen": r["chosen"][0]["content"],
            "rejected": r["rejected"][0]["content"],
        }
        for r in single
    ]
    implicit = [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
        for r in single
    ]
    dirs = [
        _prepare(records, tmp_path / name, tok_dir, "--val-fraction", "0")
        for name, records in (("conv", single), ("text", text), ("implicit", implicit))
    ]
    first = unpack(dirs[0])
    assert len(first) == len(single) > 1
    for other in dirs[1:]:
        for (c, r), (c2, r2) in zip(first, unpack(other), strict=True):
            for x, y in ((c, c2), (r, r2)):
                assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])


def test_long_pairs_are_truncated_as_trl_keep_start_or_dropped(tok_dir, tmp_path):
    rng = random.Random(3)
    long = {
        "prompt": [{"role": "user", "content": _text(rng, 5)}],
        "chosen": [{"role": "assistant", "content": _text(rng, 200)}],
        "rejected": [{"role": "assistant", "content": _text(rng, 3)}],
    }
    records = [long, *_records(3, 4)]
    kept = _prepare(records, tmp_path / "cut", tok_dir, "--val-fraction", "0")
    chat = read_meta(kept).raw["chat"]
    assert chat["truncated"] == 1 and chat["conversations"]["train"] == 8
    (c, r), *_ = unpack(kept)
    assert len(c[0]) + len(r[0]) + 2 <= SEQ + 1  # both, with their end tokens, in one window
    assert len(r[0]) < len(c[0])  # the short side whole, the long one cut (keep_start)
    dropped = _prepare(records, tmp_path / "drop", tok_dir, "--val-fraction", "0", "--long", "drop")
    chat = read_meta(dropped).raw["chat"]
    assert chat["dropped_long"] == 1 and chat["conversations"]["train"] == 6


def test_mixed_pairs_and_conversations_are_refused(tok_dir, tmp_path, capsys):
    records = [*_records(2, 5), {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(AssertionError):
        _prepare(records, tmp_path / "mixed", tok_dir)
    assert "pairs.jsonl:3: not a preference pair" in capsys.readouterr().err
