"""`strata data prepare` on preference pairs (TRL's formats): each pair becomes two conversations
side by side in one window, chosen then rejected, whose tokens and completion masks are those TRL's
own tokenization gives; TRL's three shapes of a pair and Parquet input prepare alike; long pairs are
truncated as TRL's keep_start truncates (or dropped), and counted; mixed inputs are refused."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from strata.data.tokens import TokenDataset, read_meta

from preference_pairs import SEQ, pair_records, prepare_pairs, save_tokenizer, text, unpack

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def pairs_dir(tok_dir, tmp_path_factory) -> Path:
    return prepare_pairs(pair_records(24, 0), tmp_path_factory.mktemp("pairs"), tok_dir)


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
    for record in pair_records(24, 0):
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
        for _ids, mask in pair:  # the completion: every token after the prompt, to its end
            start = int(np.argmax(mask))
            assert mask[start:].all() and not mask[:start].any()
    assert sorted(got) == sorted(want)


def test_trls_three_shapes_of_a_pair_and_parquet_prepare_alike(tok_dir, tmp_path):
    conversational = pair_records(6, 1)
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
        prepare_pairs(records, tmp_path / name, tok_dir, "--val-fraction", "0")
        for name, records in (("conv", single), ("text", text), ("implicit", implicit))
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    from strata.launch.cli import main

    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.Table.from_pylist(single), tmp_path / "parquet" / "pairs.parquet")
    argv = ["data", "prepare", str(tmp_path / "parquet" / "pairs.parquet"), "--tokenizer"]
    argv += [str(tok_dir), "--seq-len", str(SEQ), "--workers", "1", "--val-fraction", "0"]
    assert main([*argv, "--out", str(tmp_path / "parquet" / "data")]) == 0
    dirs.append(tmp_path / "parquet" / "data")
    first = unpack(dirs[0])
    assert len(first) == len(single) > 1
    for other in dirs[1:]:
        for (c, r), (c2, r2) in zip(first, unpack(other), strict=True):
            for x, y in ((c, c2), (r, r2)):
                assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])


def test_long_pairs_are_truncated_as_trl_keep_start_or_dropped(tok_dir, tmp_path):
    rng = random.Random(3)
    long = {
        "prompt": [{"role": "user", "content": text(rng, 5)}],
        "chosen": [{"role": "assistant", "content": text(rng, 200)}],
        "rejected": [{"role": "assistant", "content": text(rng, 3)}],
    }
    records = [long, *pair_records(3, 4)]
    kept = prepare_pairs(records, tmp_path / "cut", tok_dir, "--val-fraction", "0")
    chat = read_meta(kept).raw["chat"]
    assert chat["truncated"] == 1 and chat["conversations"]["train"] == 8
    (c, r), *_ = unpack(kept)
    assert len(c[0]) + len(r[0]) + 2 <= SEQ + 1  # both, with their end tokens, in one window
    assert len(r[0]) < len(c[0])  # the short side whole, the long one cut (keep_start)
    dropped = prepare_pairs(
        records, tmp_path / "drop", tok_dir, "--val-fraction", "0", "--long", "drop"
    )
    chat = read_meta(dropped).raw["chat"]
    assert chat["dropped_long"] == 1 and chat["conversations"]["train"] == 6


def test_mixed_pairs_and_conversations_are_refused(tok_dir, tmp_path, capsys):
    records = [*pair_records(2, 5), {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(AssertionError, match="failed"):
        prepare_pairs(records, tmp_path / "mixed", tok_dir)
    assert "pairs.jsonl:3: not a preference pair" in capsys.readouterr().err
