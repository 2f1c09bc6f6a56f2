"""What the fine-tuning benches share: a BPE tokenizer saved by transformers with a real chat
template (tests/data/templates/lfm2_5.jinja, which marks the assistant turns with
`{% generation %}`, so TRL's `assistant_only_loss` and Strata's `--loss-on assistant` read the same
spans), synthetic conversations with lognormal lengths, and a small random Llama saved with
`save_pretrained` for `model.init_from` and `AutoModelForCausalLM.from_pretrained` alike.

Everything is seeded: the same arguments give the same files.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "tests" / "data" / "templates" / "lfm2_5.jinja"
BOS, EOS = "<|startoftext|>", "<|im_end|>"  # as LFM2.5's tokenizer_config.json has them
EOT = "<|endoftext|>"  # the end-of-document token Strata appends (the template never writes it)
SPECIAL = [EOT, BOS, "<|im_start|>", EOS, "<|pad|>"]
SYLLABLES = "ka lo mi nu pe ra si to vu ze an el in or us ba de fi go hu".split()


def _lexicon(n: int, seed: int) -> list[str]:
    """n distinct pseudo-words of 1–4 syllables."""
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))))
    return sorted(words)


class Words:
    """Zipf-distributed pseudo-words: text whose BPE tokens are about one per word."""

    def __init__(self, seed: int = 0, n: int = 3000):
        self.words = _lexicon(n, seed)
        weights = [1.0 / (i + 1) for i in range(n)]
        total = sum(weights)
        self.cum = []
        acc = 0.0
        for w in weights:
            acc += w / total
            self.cum.append(acc)

    def text(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choices(self.words, cum_weights=self.cum, k=max(1, n)))


def make_tokenizer(directory: Path, vocab: int = 4096) -> Path:
    """A byte-level BPE of `vocab` ids (specials included) trained on the pseudo-words, saved by
    transformers with the LFM2.5 chat template, its bos and eos, and a pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (directory / "tokenizer.json").exists():
        return directory
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words, rng = Words(), random.Random(1)
    tok.train_from_iterator([words.text(rng, 200) for _ in range(2000)], trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token="<|pad|>"
    )
    hf.chat_template = TEMPLATE.read_text()
    hf.save_pretrained(directory)
    return directory


def conversations(
    n: int, seed: int, median: float, sigma: float, low: int, high: int
) -> list[dict[str, Any]]:
    """n {"messages": [...]} records: a length in words drawn lognormal (median, sigma) and clipped
    to [low, high], spread over 1–4 user/assistant exchanges (a system prompt in a third of them),
    the assistant turns about three times the user's."""
    rng, words = random.Random(seed), Words()
    out = []
    for i in range(n):
        total = int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))
        turns = rng.randint(1, 4)
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": words.text(rng, 8)})
        per_turn = max(2, total // turns)
        for _ in range(turns):
            user = max(1, per_turn // 4)
            messages.append({"role": "user", "content": words.text(rng, user)})
            messages.append({"role": "assistant", "content": words.text(rng, per_turn - user)})
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_model(
    directory: Path, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
    max_len: int,
) -> Path:  # fmt: skip
    """A random Llama (seed 0, fp32, untied) saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(directory)
    return directory
