"""Preference pairs for the DPO tests: a small BPE saved by transformers with ChatML as its chat
template, records in TRL's conversational format, `strata data prepare` on them, and the pairs of
a prepared split read back."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.data.tokens import TokenDataset

SEQ = 128
WORDS = "the sky is blue green red what colour should i say today a cat dog yes no".split()
ROLES = "<|im_start|>system\n <|im_start|>user\n <|im_start|>assistant\n <|im_end|>\n".split(" ")


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def save_tokenizer(directory: Path) -> Path:
    """A small BPE saved by transformers into `directory`, with ChatML as its own chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    tok.train_from_iterator(
        [text(rng, 20) + rng.choice(ROLES) for _ in range(400)],
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    import transformers

    from strata.data.chat import CHATML

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(directory)
    return directory


def pair_records(n: int, seed: int) -> list[dict]:
    """Conversational pairs (TRL's explicit-prompt format) of uneven lengths, some multi-turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [{"role": "user", "content": text(rng, rng.randint(2, 8))}]
        if i % 3 == 0:
            prompt = [
                {"role": "system", "content": text(rng, 3)},
                *prompt,
                {"role": "assistant", "content": text(rng, 2)},
                {"role": "user", "content": text(rng, 2)},
            ]
        out.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": text(rng, rng.randint(1, 12))}],
                "rejected": [{"role": "assistant", "content": text(rng, rng.randint(1, 12))}],
            }
        )
    return out


def prepare_pairs(records: list[dict], root: Path, tok_dir: Path, *extra: str) -> Path:
    from strata.launch.cli import main

    root.mkdir(parents=True, exist_ok=True)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["data", "prepare", str(root / "pairs.jsonl"), "--out", str(root / "data")]
    argv += ["--tokenizer", str(tok_dir), "--seq-len", str(SEQ), "--workers", "1", *extra]
    assert main(argv) == 0, f"strata {' '.join(argv)} failed"
    return root / "data"


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
