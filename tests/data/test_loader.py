"""Token data: prepare -> read round trips, the nanoGPT file layout, and the data-parallel,
resumable batch loader (each sample once per epoch, same global stream for any dp size)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.data.loader import BatchLoader, eval_batches, eval_windows
from strata.data.prepare import expand_inputs, prepare
from strata.data.tokenize import ByteTokenizer
from strata.data.tokens import TokenDataset, check_data_dir, read_meta
from strata.errors import DataError

EOT = 256

DOCS = {
    "alpha.txt": "The quick brown fox jumps over the lazy dog.\n",
    "beta.txt": "def f(x):\n    return x * 2\n",
    "gamma.md": "# Über naïve café — ünïcödé ✓ 漢字\n",
    "delta.txt": "line one\nline two\n\nline four\n",
    "epsilon.txt": "0123456789" * 7,
    "zeta.txt": "tabs\tand\rcarriage returns\r\n",
    "eta.txt": "short",
    "theta.txt": "x" * 300,
    "iota.txt": '~!@#$%^&*()_+{}|:"<>?',
    "kappa.txt": "last document\n",
}


def write_docs(root: Path, docs: dict[str, str]) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in docs.items():
        p = root / name
        p.write_bytes(text.encode("utf-8"))
        paths.append(p)
    return paths


def split_documents(tokens: np.ndarray) -> list[str]:
    """Cut a token stream at EOT tokens and decode each piece; the stream must end with EOT."""
    tok = ByteTokenizer()
    ends = np.flatnonzero(tokens == EOT)
    assert len(tokens) == 0 or ends[-1] == len(tokens) - 1, "stream does not end with an EOT"
    docs, start = [], 0
    for end in ends:
        docs.append(tok.decode(tokens[start:end].tolist()))
        start = end + 1
    return docs


def write_token_dir(
    path: Path, tokens: np.ndarray, vocab_size: int, split: str = "train", dtype: str = "uint16"
) -> Path:
    """A data directory in nanoGPT's layout: a raw token array plus a minimal meta.json."""
    path.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype=dtype).tofile(path / f"{split}.bin")
    (path / "meta.json").write_text(json.dumps({"dtype": dtype, "vocab_size": vocab_size}))
    return path


def indexed_dataset(tmp_path: Path, n_samples: int, seq_len: int = 4) -> TokenDataset:
    """Token i·L is (i·L) mod 60000, so the first token of a window tells which sample it is."""
    tokens = np.arange(n_samples * seq_len + 1) % 60000
    d = write_token_dir(tmp_path / f"idx{n_samples}", tokens, 60000)
    ds = TokenDataset(d, "train", seq_len)
    assert len(ds) == n_samples
    return ds


def sample_ids(ds: TokenDataset, inputs: torch.Tensor) -> list[int]:
    return [int(row[0]) // ds.seq_len for row in inputs]


# --- prepare ----------------------------------------------------------------------------------


def test_prepare_round_trip(tmp_path):
    files = write_docs(tmp_path / "src", DOCS)
    out = tmp_path / "tokens"
    meta = prepare(files, out, val_fraction=0.5, root=tmp_path / "src")

    raw_train = (out / "train.bin").read_bytes()
    raw_val = (out / "val.bin").read_bytes()
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert len(raw_train) == 2 * len(train) and len(raw_val) == 2 * len(val)  # 2 bytes per token
    assert train.max() <= EOT and val.max() <= EOT

    train_docs, val_docs = split_documents(train), split_documents(val)
    assert train_docs and val_docs, "with 10 documents and val_fraction 0.5 both splits get some"
    # every document appears exactly once, whole, in one of the splits, in input order within a split
    assert sorted(train_docs + val_docs) == sorted(DOCS.values())
    order = list(DOCS.values())
    assert train_docs == [d for d in order if d in train_docs]
    assert val_docs == [d for d in order if d in val_docs]
    # bytes: each document's UTF-8 then one EOT
    assert train.tolist() == [t for d in train_docs for t in list(d.encode("utf-8")) + [EOT]]

    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk == meta
    assert (
        meta["dtype"] == "uint16"
        and meta["vocab_size"] == 257
        and meta["tokenizer"]["kind"] == "bytes"
    )
    assert meta["eot"] == EOT and meta["documents"] == len(DOCS) and meta["format"] == 2
    assert meta["train_tokens"] == len(train) == sum(len(d.encode()) + 1 for d in train_docs)
    assert meta["val_tokens"] == len(val) == sum(len(d.encode()) + 1 for d in val_docs)
    m = read_meta(out)
    assert (m.dtype, m.vocab_size, m.tokenizer) == ("uint16", 257, "bytes")


def test_split_depends_only_on_document_name(tmp_path):
    """The same documents split the same way wherever the corpus lives and whatever the file order."""
    a = write_docs(tmp_path / "a" / "src", DOCS)
    b = write_docs(tmp_path / "b" / "deeper" / "src", DOCS)
    prepare(a, tmp_path / "out_a", val_fraction=0.5, root=tmp_path / "a" / "src")
    prepare(
        list(reversed(b)),
        tmp_path / "out_b",
        val_fraction=0.5,
        root=tmp_path / "b" / "deeper" / "src",
    )
    for split in ("train", "val"):
        da = split_documents(np.fromfile(tmp_path / "out_a" / f"{split}.bin", dtype=np.uint16))
        db = split_documents(np.fromfile(tmp_path / "out_b" / f"{split}.bin", dtype=np.uint16))
        assert sorted(da) == sorted(db)


def test_prepare_replaces_existing_directory_atomically(tmp_path):
    src = tmp_path / "src"
    out = tmp_path / "tokens"
    prepare(
        write_docs(src, {"old1.txt": "old " * 50, "old2.txt": "older " * 50}),
        out,
        val_fraction=0.5,
        root=src,
    )
    (out / "val.bin").unlink()  # an earlier output missing a file is still one prepare may replace

    new_src = tmp_path / "src2"
    files = write_docs(new_src, {k: v for k, v in list(DOCS.items())[:4]})
    meta = prepare(files, out, val_fraction=0.5, root=new_src)

    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    docs = split_documents(np.fromfile(out / "train.bin", dtype=np.uint16)) + split_documents(
        np.fromfile(out / "val.bin", dtype=np.uint16)
    )
    assert sorted(docs) == sorted(list(DOCS.values())[:4])
    assert json.loads((out / "meta.json").read_text()) == meta and meta["documents"] == 4
    # no temporary or old copies left next to it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "src2", "tokens"]


def test_prepare_failure_leaves_existing_directory_intact(tmp_path):
    src = tmp_path / "src"
    out = tmp_path / "tokens"
    files = write_docs(src, DOCS)
    prepare(files, out, val_fraction=0.5, root=src)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(Exception):
        prepare(files + [src / "missing.txt"], out, val_fraction=0.5, root=src)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "tokens"]


def test_prepare_without_files_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no input files"):
        prepare([], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("val_fraction", [0.05, 0.2, 0.5])
def test_single_file_still_gets_a_validation_split(tmp_path, val_fraction):
    text = "".join(f"line {i}: some text for the one document\n" for i in range(40))
    (f,) = write_docs(tmp_path / "src", {"only.txt": text})
    meta = prepare([f], tmp_path / "out", val_fraction=val_fraction)
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    assert len(val) > 0 and len(train) > 0
    assert meta["val_tokens"] == len(val) and meta["train_tokens"] == len(train)
    total = len(text.encode()) + 1
    assert len(train) + len(val) == total
    assert abs(len(val) - val_fraction * total) <= 1  # val is the last val_fraction of the stream
    stream = np.concatenate([train, val])
    assert split_documents(stream) == [text]


def test_expand_inputs_then_prepare_with_relative_paths(tmp_path, monkeypatch):
    """`strata data prepare docs/ -o out` runs expand_inputs then prepare(files, root=common).
    expand_inputs returns the files as given (relative) but the common root resolved (absolute),
    so prepare's f.relative_to(root) raises ValueError for any relative input."""
    write_docs(tmp_path / "docs", DOCS)
    write_docs(tmp_path / "docs" / "nested", {"n.txt": "nested file\n"})
    monkeypatch.chdir(tmp_path)
    files, root = expand_inputs(["docs"])
    assert len(files) == len(DOCS) + 1
    meta = prepare(files, Path("out"), val_fraction=0.3, root=root)
    assert meta["documents"] == len(DOCS) + 1
    docs = split_documents(np.fromfile("out/train.bin", dtype=np.uint16)) + split_documents(
        np.fromfile("out/val.bin", dtype=np.uint16)
    )
    assert sorted(docs) == sorted(list(DOCS.values()) + ["nested file\n"])


def test_expand_inputs_files_dirs_and_pattern(tmp_path):
    write_docs(tmp_path / "d", {"a.txt": "a", "b.md": "b"})
    write_docs(tmp_path / "d" / "sub", {"c.txt": "c"})
    (single,) = write_docs(tmp_path / "e", {"x.txt": "x"})
    files, root = expand_inputs([str(tmp_path / "d")], "*.txt")
    assert files == [tmp_path / "d" / "a.txt", tmp_path / "d" / "sub" / "c.txt"]
    assert root == (tmp_path / "d").resolve()
    files, root = expand_inputs([str(single)])
    assert files == [single] and root == single.parent.resolve()
    with pytest.raises(DataError, match="does not exist"):
        expand_inputs([str(tmp_path / "nope")])


def test_prepared_data_loads_as_windows(small_data_dir):
    L = 32
    ds = TokenDataset(small_data_dir, "train", L)
    raw = np.fromfile(small_data_dir / "train.bin", dtype=np.uint16)
    assert len(ds) == (len(raw) - 1) // L and ds.vocab_size == 257
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        assert ds.window(i).tolist() == raw[i * L : i * L + L + 1].tolist()
    batch = ds.batch([3, 0, len(ds) - 1])
    inputs, targets = batch.inputs, batch.targets
    assert batch.mask is None  # plain tokens: every target trained
    assert inputs.shape == targets.shape == (3, L) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert (
        inputs[0].tolist() == raw[3 * L : 4 * L].tolist()
        and targets[0].tolist() == raw[3 * L + 1 : 4 * L + 1].tolist()
    )


# --- the nanoGPT layout -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype, vocab", [("uint16", 50257), ("uint32", 100277)])
def test_nanogpt_layout_loads(tmp_path, dtype, vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=1000)
    d = tmp_path / "nanogpt"
    d.mkdir()
    np.array(tokens, dtype=dtype).tofile(d / "train.bin")  # exactly as nanoGPT's prepare.py
    (d / "meta.json").write_text(json.dumps({"dtype": dtype, "vocab_size": vocab}))
    L = 64
    ds = TokenDataset(d, "train", L)
    assert len(ds) == (1000 - 1) // L == 15 and ds.vocab_size == vocab
    for i in range(len(ds)):
        assert ds.window(i).tolist() == tokens[i * L : i * L + L + 1].tolist()
    assert read_meta(d).tokenizer == "unknown"


# --- dataset errors ---------------------------------------------------------------------------


def test_dataset_without_meta_is_a_clear_error(tmp_path):
    d = tmp_path / "bare"
    d.mkdir()
    np.arange(100, dtype=np.uint16).tofile(d / "train.bin")
    with pytest.raises(DataError, match="meta.json") as info:
        TokenDataset(d, "train", 8)
    assert str(d) in str(info.value) and "strata data prepare" in str(info.value)


def test_dataset_with_too_few_tokens_is_a_clear_error(tmp_path):
    d = write_token_dir(tmp_path / "few", np.arange(9), 100)
    assert len(TokenDataset(d, "train", 8)) == 1  # 9 tokens = one window of 8+1
    d = write_token_dir(tmp_path / "fewer", np.arange(8), 100)
    with pytest.raises(DataError, match="too few") as info:
        TokenDataset(d, "train", 8)
    assert "seq_len" in str(info.value)


def test_dataset_missing_split_and_bad_meta(tmp_path):
    d = write_token_dir(tmp_path / "t", np.arange(100), 100)
    with pytest.raises(DataError, match="missing val.bin"):
        TokenDataset(d, "val", 8)
    (d / "meta.json").write_text(json.dumps({"dtype": "float32", "vocab_size": 100}))
    with pytest.raises(DataError, match="dtype"):
        TokenDataset(d, "train", 8)
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    with pytest.raises(DataError, match="vocab_size"):
        TokenDataset(d, "train", 8)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_opening_a_huge_dataset_reads_no_tokens(tmp_path, dtype):
    """A run starts in constant time: opening a data directory reads meta.json and file sizes,
    never the tokens, for either dtype (a sparse file stands in for terabytes of data)."""
    d = tmp_path / "huge"
    d.mkdir()
    size = 20 << 30
    for split in ("train", "val"):
        with open(d / f"{split}.bin", "wb") as f:
            try:
                f.truncate(size)
            except OSError:
                size = 4 << 30
                f.truncate(size)
    (d / "meta.json").write_text(json.dumps({"dtype": dtype, "vocab_size": 128256}))
    start = time.perf_counter()
    ds = TokenDataset(d, "train", 8192)
    check_data_dir(d, 8192)
    assert time.perf_counter() - start < 0.5
    assert len(ds) == (size // np.dtype(dtype).itemsize - 1) // 8192
    assert ds.window(len(ds) - 1).tolist() == [0] * 8193


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    """Without a recorded max_id, the window holding an id too large is refused with the file and
    the offset; with one, opening the directory is."""
    tokens = np.arange(1000) % 90
    tokens[517] = 70000
    d = write_token_dir(tmp_path / "bad", tokens, 100, dtype="uint32")
    ds = TokenDataset(d, "train", 8)
    assert ds.window(0).tolist() == tokens[:9].tolist()
    with pytest.raises(DataError, match="token id 70000 at offset 517") as info:
        ds.batch([64, 65])  # window 64 is tokens 512..520
    assert str(d / "train.bin") in str(info.value) and "vocab_size=100" in str(info.value)
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "max_id": 70000}))
    with pytest.raises(DataError, match="token id 70000 .*vocab_size=100") as info:
        TokenDataset(d, "train", 8)
    assert "at least 70001" in str(info.value)


def test_prepare_records_the_largest_id(tmp_path):
    out = tmp_path / "out"
    meta = prepare(write_docs(tmp_path / "docs", DOCS), out, 0.3, workers=1)
    everything = np.concatenate(
        [np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]
    )
    assert meta["max_id"] == int(everything.max()) == EOT


# --- the batch loader -------------------------------------------------------------------------


def gather_step(ds, seed, gb, mb, dp, consumed: int, shuffle: bool = True) -> list[list[int]]:
    """One optimizer step's indices from every dp rank (each rank its own loader), rank order."""
    per_rank = []
    for r in range(dp):
        loader = BatchLoader(ds, seed, gb, mb, dp_rank=r, dp_size=dp, shuffle=shuffle)
        loader.consumed_samples = consumed
        per_rank.append([i for micro in loader.step_indices() for i in micro])
    return per_rank


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_sample_once_per_epoch_for_any_dp(tmp_path, dp):
    n, gb, mb = 48, 8, 2
    ds = indexed_dataset(tmp_path, n)
    loaders = [
        BatchLoader(ds, seed=5, global_batch=gb, micro_batch=mb, dp_rank=r, dp_size=dp)
        for r in range(dp)
    ]
    reference = BatchLoader(ds, seed=5, global_batch=gb, micro_batch=mb)  # dp = 1
    seen = []
    for _ in range(2 * n // gb):  # two epochs
        per_rank = [loader.step_indices() for loader in loaders]
        for micro_batches in per_rank:
            assert len(micro_batches) == gb // (mb * dp) and all(
                len(m) == mb for m in micro_batches
            )
        step = [i for micro_batches in per_rank for m in micro_batches for i in m]
        assert step == [i for m in reference.step_indices() for i in m]  # same samples, same order
        assert len(set(step)) == gb  # ranks are disjoint
        seen += step
    first, second = seen[:n], seen[n:]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert first != second  # each epoch has its own order
    assert first != list(range(n))  # and it is shuffled


def test_epoch_boundary_inside_a_step(tmp_path):
    """When n is not a multiple of the global batch, epochs still each contain every sample once."""
    n, gb = 21, 8
    ds = indexed_dataset(tmp_path, n)
    loader = BatchLoader(ds, seed=1, global_batch=gb, micro_batch=4)
    stream = [i for _ in range(3 * n // gb + 1) for m in loader.step_indices() for i in m]
    for e in range(3):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))


def test_next_step_batches_hold_the_indexed_windows(tmp_path):
    ds = indexed_dataset(tmp_path, 40, seq_len=4)
    a = BatchLoader(ds, seed=3, global_batch=8, micro_batch=2, dp_rank=1, dp_size=2)
    b = BatchLoader(ds, seed=3, global_batch=8, micro_batch=2, dp_rank=1, dp_size=2)
    for _ in range(3):
        indices = a.step_indices()
        batches = b.next_step()
        assert len(batches) == len(indices) == 2
        for micro, batch in zip(indices, batches):
            assert sample_ids(ds, batch.inputs) == micro
            expected = torch.stack([torch.from_numpy(ds.window(i)) for i in micro])
            assert torch.equal(batch.inputs, expected[:, :-1])
            assert torch.equal(batch.targets, expected[:, 1:])


def test_unshuffled_order_is_sequential(tmp_path):
    ds = indexed_dataset(tmp_path, 10)
    loader = BatchLoader(ds, seed=0, global_batch=4, micro_batch=2, shuffle=False)
    stream = [i for _ in range(5) for m in loader.step_indices() for i in m]
    assert stream == list(range(10)) * 2


def test_same_seed_same_order_different_seed_different(tmp_path):
    ds = indexed_dataset(tmp_path, 64)

    def stream(seed):
        loader = BatchLoader(ds, seed=seed, global_batch=8, micro_batch=4)
        return [i for _ in range(8) for m in loader.step_indices() for i in m]

    assert stream(7) == stream(7)
    assert stream(7) != stream(8)
    assert sorted(stream(8)) == list(range(64))


def test_batch_size_must_divide(tmp_path):
    ds = indexed_dataset(tmp_path, 16)
    with pytest.raises(DataError, match="not a multiple"):
        BatchLoader(ds, seed=0, global_batch=8, micro_batch=3)
    with pytest.raises(DataError, match="not a multiple"):
        BatchLoader(ds, seed=0, global_batch=8, micro_batch=4, dp_rank=0, dp_size=4)


@pytest.mark.parametrize("k", [0, 1, 5, 7])
def test_resume_continues_the_same_stream(tmp_path, k):
    ds = indexed_dataset(tmp_path, 30)
    straight = BatchLoader(ds, seed=9, global_batch=6, micro_batch=3)
    first = BatchLoader(ds, seed=9, global_batch=6, micro_batch=3)
    for _ in range(k):
        straight.step_indices()
        first.step_indices()
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = BatchLoader(ds, seed=9, global_batch=6, micro_batch=3)
    resumed.load_state_dict(state)
    for _ in range(12):  # past an epoch boundary
        expected = straight.next_step()
        got = resumed.next_step()
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert torch.equal(g.inputs, e.inputs) and torch.equal(g.targets, e.targets)


@pytest.mark.parametrize("dp_before, dp_after", [(1, 2), (2, 4), (4, 1), (2, 2)])
def test_resume_with_another_dp_size_keeps_the_global_stream(tmp_path, dp_before, dp_after):
    n, gb, mb = 40, 8, 2
    ds = indexed_dataset(tmp_path, n)
    reference = BatchLoader(ds, seed=4, global_batch=gb, micro_batch=mb)
    expected = [[i for m in reference.step_indices() for i in m] for _ in range(12)]

    before = [BatchLoader(ds, 4, gb, mb, dp_rank=r, dp_size=dp_before) for r in range(dp_before)]
    got = []
    for _ in range(5):
        got.append([i for loader in before for m in loader.step_indices() for i in m])
    states = [loader.state_dict() for loader in before]
    assert all(s == states[0] for s in states)  # the position is global: every rank saves the same

    after = [BatchLoader(ds, 4, gb, mb, dp_rank=r, dp_size=dp_after) for r in range(dp_after)]
    for loader in after:
        loader.load_state_dict(states[0])
    for _ in range(7):
        got.append([i for loader in after for m in loader.step_indices() for i in m])
    assert got == expected


def test_resume_with_another_seed_or_dataset_is_refused(tmp_path):
    ds = indexed_dataset(tmp_path, 30)
    loader = BatchLoader(ds, seed=1, global_batch=6, micro_batch=3)
    loader.step_indices()
    state = loader.state_dict()
    with pytest.raises(DataError, match="seed"):
        BatchLoader(ds, seed=2, global_batch=6, micro_batch=3).load_state_dict(state)
    other = indexed_dataset(tmp_path, 31)
    with pytest.raises(DataError, match="samples"):
        BatchLoader(other, seed=1, global_batch=6, micro_batch=3).load_state_dict(state)
    fresh = BatchLoader(ds, seed=1, global_batch=6, micro_batch=3)
    assert fresh.consumed_samples == 0  # a refused load changes nothing


def test_loader_over_prepared_corpus_covers_each_window_once(small_data_dir):
    ds = TokenDataset(small_data_dir, "train", 32)
    n = len(ds)
    gb = 16
    loaders = [
        BatchLoader(ds, seed=1234, global_batch=gb, micro_batch=4, dp_rank=r, dp_size=2)
        for r in range(2)
    ]
    seen = []
    for _ in range(-(-n // gb)):
        for loader in loaders:
            seen += [i for m in loader.step_indices() for i in m]
    assert sorted(seen[:n]) == list(range(n))


# --- evaluation batches -----------------------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_eval_batches_are_fixed_and_the_same_windows_at_every_dp_size(tmp_path, dp):
    ds = indexed_dataset(tmp_path, 50)
    n_batches, global_batch, mb = 3, 8, 2
    windows = eval_windows(len(ds), n_batches, global_batch)
    assert windows == n_batches * global_batch  # global batches: no dp in it

    def ids(rank):
        return [sample_ids(ds, b.inputs) for b in eval_batches(ds, windows, mb, rank, dp)]

    per_rank = [ids(r) for r in range(dp)]
    assert per_rank == [ids(r) for r in range(dp)]  # identical at every evaluation
    for r in range(dp):
        batches = list(eval_batches(ds, windows, mb, r, dp))
        assert len(batches) == windows // (mb * dp)  # every rank as many: the same collectives
        for b in batches:
            assert b.inputs.shape == b.targets.shape == (mb, ds.seq_len)
            assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    # micro-batch b of every rank in rank order is the dp=1 stream's micro-batches b·dp .. b·dp+dp-1
    interleaved = [per_rank[r][b] for b in range(len(per_rank[0])) for r in range(dp)]
    flat = [i for batch in interleaved for i in batch]
    assert flat == list(range(windows))  # the first windows in order, each once, at any dp


def test_a_split_shorter_than_the_eval_batches_is_read_whole_each_window_once(tmp_path):
    ds = indexed_dataset(tmp_path, 5)
    assert eval_windows(5, 4, 2) == eval_windows(5, 0, 2) == 5
    assert eval_windows(50, 0, 2) == 50 and eval_windows(50, 4, 2) == 8
    got = [sample_ids(ds, b.inputs) for b in eval_batches(ds, 5, 2, 0, 1)]
    assert got == [[0, 1], [2, 3], [4]]
