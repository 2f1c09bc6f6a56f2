"""Bring your own tokenizer and data: `strata data prepare` with a tokenizer.json, a Hugging Face model
directory or a BPE it trains, over text, JSON Lines and Parquet inputs, writes exactly the ids the
`tokenizers` library (and transformers) gives each document, plus the end-of-document token; the
output does not depend on the number of workers, is written as it goes, and every bad input is one
clear error (exit 2, no traceback)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from strata import config
from strata.data.prepare import plan, prepare
from strata.data.tokens import check_data_config, read_meta
from strata.errors import ConfigError

from conftest import run_cli
from worlds import REPO, strata

TINY = str(REPO / "configs" / "tiny.yaml")
WORDS = "the quick brown fox jumps over a lazy dog while über-naïve cafés serve 漢字 and emoji ✓ def return x y".split()


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        + rng.choice(["", "\n", ".\n\n"])
        for _ in range(n)
    ]


def train_reference_bpe(
    path: Path, vocab: int = 400, special: tuple[str, ...] = ("<|endoftext|>",)
) -> Tokenizer:
    """A byte-level BPE made with the tokenizers library directly (not through Strata)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences(2000, 0), trainer)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_reference_bpe(path)
    return path


run = run_cli


def expected_ids(tok: Tokenizer, docs: list[str], eot: int) -> list[int]:
    return [t for enc in tok.encode_batch(docs) for t in [*enc.ids, eot]]


def write_corpus(root: Path) -> list[str]:
    """Text files, a JSON Lines file and a Parquet file (two row groups, a null row); the documents
    in the order prepare reads them (sorted paths; lines, rows)."""
    root.mkdir(parents=True)
    docs: list[str] = []
    for i, text in enumerate(sentences(3, 1)):
        (root / f"a{i}.txt").write_text(text, encoding="utf-8")
        docs.append(text)
    lines = sentences(50, 2)
    with open(root / "b.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(lines):
            f.write(json.dumps({"id": i, "body": text}) + "\n")
            if i == 10:
                f.write("\n")  # a blank line is skipped
    docs += lines
    rows = sentences(30, 3)
    pq.write_table(
        pa.table({"body": [*rows[:5], None, *rows[5:]], "n": list(range(31))}),
        root / "c.parquet",
        row_group_size=16,
    )
    docs += rows
    return docs


def tokens(out: Path, split: str = "train") -> np.ndarray:
    return np.fromfile(out / f"{split}.bin", dtype=read_meta(out).dtype)


def test_tokenizer_json_gives_the_librarys_ids_for_text_jsonl_and_parquet(tmp_path, bpe, capsys):
    docs = write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    argv = ["data", "prepare", str(tmp_path / "in"), "--out", str(out), "--tokenizer", str(bpe)]
    code, text = run([*argv, "--text-field", "body", "--val-fraction", "0"], capsys)
    assert code == 0, text
    tok = Tokenizer.from_file(str(bpe))
    eot = tok.token_to_id("<|endoftext|>")
    assert tokens(out).tolist() == expected_ids(tok, docs, eot)
    meta = json.loads((out / "meta.json").read_text())
    assert (
        meta["eot"] == eot
        and meta["vocab_size"] == tok.get_vocab_size()
        and meta["dtype"] == "uint16"
    )
    assert meta["tokenizer"]["kind"] == "file" and meta["tokenizer"]["source"] == str(bpe.resolve())
    assert meta["tokenizer"]["eot_token"] == "<|endoftext|>" and meta["documents"] == len(docs)
    assert (out / "tokenizer.json").read_bytes() == bpe.read_bytes()


def test_documents_split_between_train_and_val_whole(tmp_path, bpe, capsys):
    docs = write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    code, text = run(
        [
            "data",
            "prepare",
            str(tmp_path / "in"),
            "--out",
            str(out),
            "--tokenizer",
            str(bpe),
            "--text-field",
            "body",
        ]
        + ["--val-fraction", "0.3"],
        capsys,
    )
    assert code == 0, text
    tok = Tokenizer.from_file(str(bpe))
    eot = tok.token_to_id("<|endoftext|>")

    def split(a: np.ndarray) -> list[tuple[int, ...]]:
        cuts = np.flatnonzero(a == eot)
        return [tuple(x) for x in np.split(a, cuts + 1)[:-1]]

    train, val = split(tokens(out, "train")), split(tokens(out, "val"))
    assert train and val
    want = [tuple(e.ids) + (eot,) for e in tok.encode_batch(docs)]
    assert sorted(train + val) == sorted(want)
    assert train == [d for d in want if d in set(train)]  # input order kept within a split


def test_model_directory_uses_its_eos_token_and_matches_transformers(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "model"
    tok = train_reference_bpe(tmp_path / "raw.json", special=("<|endoftext|>", "</s>"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(model_dir)
    docs = sentences(40, 5)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    argv = [
        "data",
        "prepare",
        str(tmp_path / "in"),
        "--out",
        str(out),
        "--tokenizer",
        str(model_dir),
    ]
    code, text = run([*argv, "--val-fraction", "0"], capsys)
    assert code == 0, text
    eos = fast.convert_tokens_to_ids("</s>")
    assert read_meta(out).raw["eot"] == eos != tok.token_to_id("<|endoftext|>")
    reference = fast(docs)["input_ids"]
    assert tokens(out).tolist() == [t for ids in reference for t in [*ids, eos]]
    assert tokens(out).tolist() == expected_ids(
        Tokenizer.from_file(str(model_dir / "tokenizer.json")), docs, eos
    )


def test_bpe_is_trained_saved_and_its_ids_written(tmp_path, capsys):
    docs = write_corpus(tmp_path / "in")
    out = tmp_path / "out"
    argv = ["data", "prepare", str(tmp_path / "in"), "--out", str(out), "--tokenizer", "bpe:300"]
    code, text = run([*argv, "--text-field", "body", "--val-fraction", "0"], capsys)
    assert code == 0, text
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    meta = read_meta(out).raw
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["source"] == "bpe:300"
    assert meta["vocab_size"] == tok.get_vocab_size() <= 300 and meta["eot"] == tok.token_to_id(
        "<|endoftext|>"
    )
    assert tokens(out).tolist() == expected_ids(tok, docs, meta["eot"])
    assert tok.decode(tok.encode(docs[0]).ids) == docs[0]  # byte-level: any text round-trips


def test_output_is_the_same_for_any_number_of_workers(tmp_path, bpe):
    write_corpus(tmp_path / "in")
    files = sorted((tmp_path / "in").iterdir())
    assert len(plan(files, tmp_path / "in", "body", chunk_bytes=256)) > 6
    for w in (1, 2):
        prepare(
            files,
            tmp_path / f"w{w}",
            0.2,
            tmp_path / "in",
            tokenizer=str(bpe),
            text_field="body",
            workers=w,
            chunk_bytes=256,
        )
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()


def test_byte_tokenizer_reads_jsonl_and_parquet_as_utf8(tmp_path):
    write_corpus(tmp_path / "in")
    files = sorted((tmp_path / "in").glob("c.parquet"))
    meta = prepare(files, tmp_path / "out", 0.0, tmp_path / "in", text_field="body")
    rows = [r for r in pq.read_table(files[0])["body"].to_pylist() if r is not None]
    assert tokens(tmp_path / "out").tolist() == [t for r in rows for t in [*r.encode(), 256]]
    assert meta["documents"] == len(rows) and meta["tokenizer"]["kind"] == "bytes"


STREAM_CHECK = """
import json, resource, sys
from pathlib import Path
from strata.data.prepare import prepare
files = sorted(Path(sys.argv[1]).iterdir())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # after the imports
meta = prepare(files, Path(sys.argv[2]), 0.05, Path(sys.argv[1]), workers=2, chunk_bytes=1 << 20)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"grew_kib": grew, "child_kib": child, "tokens": meta["train_tokens"] + meta["val_tokens"]}))
"""


@pytest.mark.slow
def test_a_corpus_larger_than_the_memory_it_uses_streams(tmp_path):
    """96 MiB of text is 192 MiB of uint16 tokens; the preparing process does not grow by a quarter
    of that, nor does a worker (imports included) reach half: tasks are tokenized and written one
    by one."""
    src = tmp_path / "in"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(24):
        (src / f"{i:02d}.txt").write_bytes(rng.integers(32, 127, 4 << 20, dtype=np.uint8).tobytes())
    res = subprocess.run(
        [sys.executable, "-c", STREAM_CHECK, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    token_kib = stats["tokens"] * 2 // 1024
    assert token_kib > 190 * 1024
    assert stats["grew_kib"] < token_kib / 4, stats
    assert stats["child_kib"] < token_kib / 2, stats


def bad_jsonl(root: Path, lines: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "d.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize(
    ("make", "extra", "message"),
    [
        (
            lambda r: bad_jsonl(r, ['{"text": "a"}', '{"body": "b"}']),
            [],
            "d.jsonl:2: no 'text' field (fields: body)",
        ),
        (
            lambda r: bad_jsonl(r, ['{"text": "a"}', "", '{"text": "b"']),
            [],
            "d.jsonl:3: not valid JSON",
        ),
        (
            lambda r: bad_jsonl(r, ['{"text": 3}']),
            [],
            "d.jsonl:1: field 'text' holds a int, not text",
        ),
        (lambda r: bad_jsonl(r, ["[1, 2]"]), [], "d.jsonl:1: a JSON list, not an object"),
        (
            lambda r: bad_jsonl(r, ['{"text": "a"}']),
            ["--tokenizer", "missing/tokenizer.json"],
            "no such file or directory",
        ),
        (
            lambda r: bad_jsonl(r, ['{"text": "a"}']),
            ["--tokenizer", "bpe:12"],
            "bpe:N needs a whole vocabulary size",
        ),
        (
            lambda r: bad_jsonl(r, ['{"text": "a"}']),
            ["--eot-token", "</s>"],
            "--eot-token names a token of a tokenizer.json",
        ),
    ],
)
def test_bad_jsonl_or_tokenizer_is_one_clear_error(
    tmp_path, monkeypatch, capsys, make, extra, message
):
    monkeypatch.chdir(tmp_path)
    src = make(tmp_path / "in")
    code, out = run(["data", "prepare", str(src), "--out", str(tmp_path / "out"), *extra], capsys)
    assert code == 2 and message in out and "Traceback" not in out, out
    assert not (tmp_path / "out").exists()


def test_bad_parquet_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.parquet").write_bytes(b"PAR1 this is not parquet")
    code, out = run(["data", "prepare", str(tmp_path / "a"), "--out", str(tmp_path / "o")], capsys)
    assert (
        code == 2 and "x.parquet: not a readable Parquet file" in out and "Traceback" not in out
    ), out
    (tmp_path / "b").mkdir()
    pq.write_table(pa.table({"content": ["a"], "n": [1]}), tmp_path / "b" / "y.parquet")
    code, out = run(["data", "prepare", str(tmp_path / "b"), "--out", str(tmp_path / "o")], capsys)
    assert (
        code == 2
        and "y.parquet: no column 'text' (columns: content, n)" in out
        and "--text-field" in out
    ), out
    code, out = run(
        ["data", "prepare", str(tmp_path / "b"), "--out", str(tmp_path / "o"), "--text-field", "n"],
        capsys,
    )
    assert code == 2 and "column 'n' holds int64, not text" in out, out


def test_a_tokenizer_without_an_end_of_document_token_asks_for_one(tmp_path, capsys):
    tok_path = tmp_path / "plain.json"
    train_reference_bpe(tok_path, special=("<pad>",))
    bad_jsonl(tmp_path / "in", ['{"text": "hello"}'])
    argv = [
        "data",
        "prepare",
        str(tmp_path / "in"),
        "--out",
        str(tmp_path / "o"),
        "--tokenizer",
        str(tok_path),
    ]
    code, out = run(argv, capsys)
    assert code == 2 and "name its end-of-document token with --eot-token" in out, out
    code, out = run([*argv, "--eot-token", "<unk>"], capsys)
    assert code == 2 and "--eot-token '<unk>' is not a token of" in out, out
    code, out = run([*argv, "--eot-token", "<pad>", "--val-fraction", "0"], capsys)
    assert code == 0, out
    assert read_meta(tmp_path / "o").raw["eot"] == Tokenizer.from_file(str(tok_path)).token_to_id(
        "<pad>"
    )


@pytest.fixture
def bpe_data(tmp_path, bpe) -> Path:
    src = tmp_path / "in"
    src.mkdir()
    (src / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in sentences(400, 7)))
    out = tmp_path / "data"
    prepare([src / "d.jsonl"], out, 0.1, src, tokenizer=str(bpe), workers=1)
    return out


def cfg_for(data: Path, **keys) -> config.Config:
    return config.load(
        None, [f"data.path={data}", *(f"{k}={v}" for k, v in keys.items())], world_size=1
    )


def test_config_tokenizer_must_be_the_datas(bpe_data, bpe, tmp_path):
    check_data_config(bpe_data, cfg_for(bpe_data))  # null: the data's
    check_data_config(bpe_data, cfg_for(bpe_data, **{"data.tokenizer": str(bpe)}))
    check_data_config(
        bpe_data, cfg_for(bpe_data, **{"data.tokenizer": str(bpe_data / "tokenizer.json")})
    )
    check_data_config(
        bpe_data, cfg_for(bpe_data, **{"data.tokenizer": str(bpe.parent)})
    )  # its directory
    other = tmp_path / "other.json"
    train_reference_bpe(other, special=("<|endoftext|>", "<pad>"))
    for setting, message in [
        ("bytes", "data.tokenizer='bytes' but"),
        ("bpe:400", "data.tokenizer='bpe:400' but"),
        (str(other), "is not the tokenizer the data was prepared with"),
        (str(tmp_path / "nothing.json"), "no such file or directory"),
    ]:
        with pytest.raises(ConfigError, match="records tokenizer|no such file") as e:
            check_data_config(bpe_data, cfg_for(bpe_data, **{"data.tokenizer": setting}))
        assert message in str(e.value)


def test_config_tokenizer_form_is_checked_when_loading():
    with pytest.raises(ConfigError, match="bpe:N needs a whole vocabulary size"):
        config.load(None, ["data.path=x", "data.tokenizer=bpe:ten"], world_size=1)
    with pytest.raises(ConfigError, match="needs data.path"):
        config.load(None, ["data.tokenizer=bpe:1000"], world_size=1)
    assert config.load(None, ["data.tokenizer=bytes"], world_size=1).data.tokenizer == "bytes"


def test_a_model_vocabulary_smaller_than_the_datas_is_refused_naming_both(
    bpe_data, tmp_path, capsys
):
    vocab = read_meta(bpe_data).vocab_size
    with pytest.raises(ConfigError) as e:
        check_data_config(bpe_data, cfg_for(bpe_data, **{"model.vocab_size": 256}))
    assert "model.vocab_size=256 is smaller than the data's vocabulary" in str(e.value)
    assert f"vocab_size={vocab}" in str(e.value)
    argv = [
        "train",
        TINY,
        f"data.path={bpe_data}",
        f"log.dir={tmp_path / 'runs'}",
        "model.vocab_size=256",
    ]
    code, out = run([*argv, "model.seq_len=16"], capsys)
    assert (
        code == 2 and "model.vocab_size=256" in out and str(vocab) in out and "Traceback" not in out
    ), out


def test_an_earlier_output_with_its_tokenizer_is_replaced_but_a_users_tokenizer_json_is_kept(
    tmp_path, bpe, capsys
):
    bad_jsonl(tmp_path / "in", ['{"text": "hello world"}', '{"text": "again"}'])
    out = tmp_path / "out"
    argv = ["data", "prepare", str(tmp_path / "in"), "--out", str(out)]
    assert (
        run([*argv, "--tokenizer", str(bpe)], capsys)[0] == 0 and (out / "tokenizer.json").is_file()
    )
    assert run(argv, capsys)[0] == 0  # bytes now: the whole directory is replaced
    assert not (out / "tokenizer.json").exists() and read_meta(out).tokenizer == "bytes"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_bytes(bpe.read_bytes())
    code, text = run(["data", "prepare", str(tmp_path / "in"), "--out", str(mine)], capsys)
    assert (
        code == 2
        and "it has no meta.json" in text
        and (mine / "tokenizer.json").read_bytes() == bpe.read_bytes()
    )


@pytest.mark.parametrize("command", ["train", "launch"])
def test_strata_refuses_a_run_whose_tokenizer_is_not_the_datas(bpe_data, tmp_path, command):
    """Before anything trains (and, under `strata launch`, before any worker starts): exit 2."""
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    argv = [
        command,
        str(experiment),
        f"data.path={bpe_data}",
        "data.tokenizer=bytes",
        f"log.dir={tmp_path / 'runs'}",
    ]
    if command == "launch":
        argv += ["--nproc", "2"]
    proc = strata(*argv)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data.tokenizer='bytes' but" in proc.stderr and "Traceback" not in proc.stderr
    assert "torch.distributed.run" not in proc.stdout  # no worker was started
