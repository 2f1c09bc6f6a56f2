"""The tokenizer.json of Strata's byte-level tokens, for a Hugging Face export of a model trained on
them: ids 0..255 are the UTF-8 bytes and 256 the end-of-document token, as `strata data prepare
--tokenizer bytes` writes them.

It is a byte-level BPE with no merges, the form GPT-2's tokenizer takes (each byte spelled by one
printable character, `bytes_to_unicode`), so the `tokenizers` library and transformers'
`PreTrainedTokenizerFast` encode any text to exactly its UTF-8 bytes and decode them back. One
difference from Strata's own byte tokenizer: the text "<|endoftext|>" becomes the special token
256 there, as in GPT-2, where Strata's reads its 13 bytes.

A pure function over dicts (this package's rule: no files, no third-party imports).
"""

from __future__ import annotations

from typing import Any

EOT_ID = 256
EOT_TOKEN = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte: the printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict(zip(printable, map(chr, printable)))
    extra = (b for b in range(256) if b not in chars)
    chars.update((b, chr(0x100 + n)) for n, b in enumerate(extra))
    return chars


def byte_level_tokenizer() -> dict[str, Any]:
    """The tokenizer.json (as a dict) that encodes text as its UTF-8 bytes, ids 0..255, with the
    end-of-document token `EOT_TOKEN` as special id 256."""
    chars = bytes_to_unicode()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": EOT_ID,
                "content": EOT_TOKEN,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        # no regex split: every byte is its own token whatever surrounds it
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {chars[b]: b for b in range(256)},
            "merges": [],
        },
    }
