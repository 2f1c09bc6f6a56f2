"""`strata generate`'s decoding against transformers' `generate` on the same model and prompts, in
one process: a random Llama built by transformers (saved offline with save_pretrained) is read by
Strata from its directory (`strata.inference.source.open_model`, as `strata generate DIR` reads
it); both decode the same batch of prompts of different lengths greedily, left-padded, for exactly
--new tokens per row (no end-of-text stop), with their key/value caches. The figure is new tokens
per second (prefill included), the median of --reps interleaved runs each, and the ratio
Strata / transformers (goal >= 1.0); the rows' tokens are compared too.

    python bench/generate.py                                    # CPU, fp32: batch 4 and batch 1
    python bench/generate.py --device cuda --dtype bf16 --layers 16 --d-model 2048 --new 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def save_model(directory: Path, args: argparse.Namespace) -> None:
    """A random Llama with a word-level tokenizer over its ids (Strata's reader wants one beside it)."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.d_model * 8 // 3 // 32 * 32,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    Tokenizer(WordLevel({str(i): i for i in range(args.vocab)}, unk_token="0")).save(
        str(directory / "tokenizer.json")
    )


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    lengths = [16 + (48 * i) // max(1, batch - 1) for i in range(batch)]  # 16 ... 64 tokens
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def run_strata(model, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from strata.inference.generate import generate

    sync(model)
    start = time.perf_counter()
    out = generate(model, batch, new).tokens
    sync(model)
    return time.perf_counter() - start, out


def run_transformers(model, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    longest = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    device = next(model.parameters()).device
    sync(model)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    sync(model)
    return time.perf_counter() - start, out[:, longest:].tolist()


def sync(model) -> None:
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def measure(ours, theirs, batch: list[list[int]], args: argparse.Namespace) -> dict:
    run_strata(ours, batch, 4)  # warm-up: first-call allocations and kernel selection
    run_transformers(theirs, batch, 4)
    times: dict[str, list[float]] = {"strata": [], "transformers": []}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.reps):
        for name, fn, model in (
            ("strata", run_strata, ours),
            ("transformers", run_transformers, theirs),
        ):
            seconds, outputs[name] = fn(model, batch, args.new)
            times[name].append(seconds)
    tokens = len(batch) * args.new
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    same = sum(a == b for a, b in zip(outputs["strata"], outputs["transformers"]))
    return {
        "batch": len(batch),
        "prompt_tokens": [len(p) for p in batch],
        "new_tokens_per_row": args.new,
        "tokens_per_s": rate,
        "times_s": times,
        "ratio": rate["strata"] / rate["transformers"],
        "rows_identical": f"{same}/{len(batch)}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--new", type=int, default=64, help="new tokens per row")
    ap.add_argument("--batches", default="4,1", help="batch sizes to measure")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--out", default="generate.json")
    args = ap.parse_args()

    import transformers

    from strata.inference.source import open_model

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp), args)
        ours = open_model(Path(tmp), overrides=["model.seq_len=512"], dtype=dtype).model.to(
            args.device
        )
        theirs = (
            transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
            .to(args.device)
            .eval()
        )
    results = {
        "args": vars(args),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": [],
    }
    print(
        f"## greedy decoding, {args.layers} layers, d_model {args.d_model}, {args.device} {args.dtype}"
    )
    print(
        "\n| batch | prompt tokens | Strata tokens/s | transformers tokens/s | Strata / transformers | same rows |"
    )
    print("|---|---|---|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        row = measure(ours, theirs, prompts(b, args.vocab), args)
        results["rows"].append(row)
        rate = row["tokens_per_s"]
        print(
            f"| {b} | {min(row['prompt_tokens'])}-{max(row['prompt_tokens'])} | {rate['strata']:.1f} | "
            f"{rate['transformers']:.1f} | **{row['ratio']:.2f}** (goal >= 1.0) | {row['rows_identical']} |"
        )
    Path(args.out).write_text(json.dumps(results, indent=1))
    first = results["rows"][0]  # the batch the figure is quoted at
    summary = {
        "ratio": first["ratio"],
        "tokens_per_s": first["tokens_per_s"]["strata"],
        "batch": first["batch"],
    }
    summary["ratios"] = {r["batch"]: r["ratio"] for r in results["rows"]}
    print(f"\nRESULT {json.dumps(summary)}")
    print(f"raw figures: {args.out}")


if __name__ == "__main__":
    main()
