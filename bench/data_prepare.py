"""Tokens/s of `strata data prepare` with a byte-level BPE against a single-process `tokenizers`
`encode_batch` loop (the peer) over the same JSON Lines files, measured in the same run.

The corpus is the Python standard library's sources cut into documents of about 4 KiB at line
boundaries, written as JSON Lines shards until it reaches --mb megabytes (sources repeat when the
library is smaller). The bench trains the BPE once (on the first shard; not timed). The peer reads
each shard, json-decodes each line, encodes batches of documents with `Tokenizer.encode_batch`
(its own Rust thread pool runs across the cores), appends the ids and the end-of-document id to
one uint16 file. Strata runs `strata data prepare SHARDS --tokenizer tokenizer.json
--val-fraction 0` as a user would (a subprocess; start-up included). Both outputs must be equal.

    python bench/data_prepare.py [--mb 64] [--vocab 8192] [--workers N] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from strata.data.prepare import stdlib_corpus_files

PEER_BATCH = 1024


def write_corpus(out: Path, megabytes: int, shard_mb: int = 8) -> list[Path]:
    """JSON Lines shards of ~4 KiB documents cut from the stdlib sources, `megabytes` in all."""
    out.mkdir(parents=True, exist_ok=True)
    target, shard_bytes = megabytes << 20, shard_mb << 20
    shards: list[Path] = []
    written = 0
    f = None
    sources = stdlib_corpus_files()
    rep = 0
    while written < target:
        for src in sources:
            text = src.read_text(encoding="utf-8", errors="replace")
            doc: list[str] = []
            size = 0
            for line in text.splitlines(keepends=True):
                doc.append(line)
                size += len(line)
                if size < 4096:
                    continue
                if f is None or f.tell() >= shard_bytes:
                    if f is not None:
                        f.close()
                    shards.append(out / f"shard{len(shards):03d}.jsonl")
                    f = open(shards[-1], "w", encoding="utf-8")
                body = "".join(doc) if not rep else f"# copy {rep}\n" + "".join(doc)
                line_out = json.dumps({"text": body}) + "\n"
                f.write(line_out)
                written += len(line_out)
                doc, size = [], 0
                if written >= target:
                    break
            if written >= target:
                break
        rep += 1
    assert f is not None
    f.close()
    return shards


def train_tokenizer(shard: Path, vocab: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with open(shard, encoding="utf-8") as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    tok.save(str(out))


def peer(shards: list[Path], tokenizer: Path, out: Path) -> int:
    """Single process: read, decode, encode_batch, append. Returns the tokens written."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eot = tok.token_to_id("<|endoftext|>")
    n = 0
    with open(out, "wb") as fo:
        for shard in shards:
            with open(shard, encoding="utf-8") as f:
                docs = [json.loads(line)["text"] for line in f]
            for i in range(0, len(docs), PEER_BATCH):
                ids: list[int] = []
                for enc in tok.encode_batch(docs[i : i + PEER_BATCH]):
                    ids += enc.ids
                    ids.append(eot)
                arr = np.array(ids, np.uint16)
                arr.tofile(fo)
                n += len(arr)
    return n


def strata_prepare(shards: list[Path], tokenizer: Path, out: Path, workers: int | None) -> None:
    cmd = [
        sys.executable,
        "-m",
        "strata.launch.cli",
        "data",
        "prepare",
        *map(str, shards),
        "--out",
        str(out),
    ]
    cmd += ["--tokenizer", str(tokenizer), "--val-fraction", "0"]
    if workers:
        cmd += ["--workers", str(workers)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="corpus size in MiB")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="strata data prepare --workers (default: one per CPU)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each; the best counts")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="strata-bench-data-") as tmp_name:
        tmp = Path(tmp_name)
        shards = write_corpus(tmp / "corpus", args.mb)
        tok = tmp / "tokenizer.json"
        t = time.perf_counter()
        train_tokenizer(shards[0], args.vocab, tok)
        print(
            f"corpus: {len(shards)} shards, {sum(s.stat().st_size for s in shards) / 2**20:.0f} MiB of JSON Lines"
        )
        print(
            f"trained a {args.vocab}-id byte-level BPE on {shards[0].name} in {time.perf_counter() - t:.1f} s"
        )
        print(
            f"cpus: {os.cpu_count()}, load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        best_peer = best_strata = float("inf")
        tokens = 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            tokens = peer(shards, tok, tmp / "peer.bin")
            best_peer = min(best_peer, time.perf_counter() - t)
            t = time.perf_counter()
            strata_prepare(shards, tok, tmp / "out", args.workers)
            best_strata = min(best_strata, time.perf_counter() - t)
        same = (tmp / "peer.bin").read_bytes() == (tmp / "out" / "train.bin").read_bytes()
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"tokens: {tokens:,}; outputs identical: {same}")
        print(
            f"peer (tokenizers encode_batch, 1 process): {best_peer:6.2f} s  {tokens / best_peer / 1e6:6.2f} M tok/s"
        )
        workers = args.workers or os.cpu_count()
        rate = tokens / best_strata / 1e6
        print(
            f"strata data prepare --workers {workers}:     {best_strata:6.2f} s  {rate:6.2f} M tok/s"
        )
        print(f"ratio (strata / peer tokens/s): {best_peer / best_strata:.2f}x")
        if not same:
            sys.exit("outputs differ")


if __name__ == "__main__":
    main()
