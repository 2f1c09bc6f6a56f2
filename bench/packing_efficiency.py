"""Useful-token fraction of conversation batches: trained tokens / tokens computed, for Strata's
packed windows (`strata data prepare` on {"messages": [...]} records) against TRL's `SFTTrainer`
batches of the same conversations, with the same tokenizer, chat template and assistant-only loss.

    python bench/packing_efficiency.py                      # 2000 conversations, seq 2048, B 8
    python bench/packing_efficiency.py --n 200 --seq-len 512 --batch 4   # a smoke run, seconds

The conversations (bench/_sft_common.py) have lognormal lengths (median --median words, sigma
--sigma, clipped to --low..--high words; one word is about one token), rendered with LFM2.5's chat
template, whose `{% generation %}` markers say which tokens are the assistant's. Each side's
batches are what its trainer would feed the model over one epoch:

- strata: `prepare_chat` (what `strata data prepare --seq-len S --loss-on assistant` runs), windows
  of S tokens (best-fit decreasing, a conversation never cut, the tail of a window padding);
  every window is one row of S computed tokens.
- trl padded: `SFTTrainer(packing=False, max_length=S, assistant_only_loss=True)`, its own
  prepared data set and train dataloader (random order, per_device_train_batch_size B): each batch
  is padded to its longest row, B × longest tokens computed. Also with
  `train_sampling_strategy="group_by_length"` (transformers' LengthGroupedSampler: batches of
  similar lengths, less padding).
- trl packed bfd: `packing=True` (best-fit decreasing, which turns padding-free on): rows of up to
  S tokens, each batch of B rows flattened into one row, nothing padded.
- trl packed wrapped: `packing=True, packing_strategy="wrapped"`: the token stream cut every S
  tokens (conversations cut across rows, and attended across), rows of S, no padding. It keeps
  every token of a conversation longer than S where the others truncate it to S, so it trains
  more tokens of the same records.

Trained tokens are the targets that carry loss (labels != -100 after the model's shift); tokens
computed are the positions of the batches' input_ids (padding included). No timing: the figures are
deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sft_common import EOT, conversations, make_model, make_tokenizer, write_jsonl  # noqa: E402


def strata_side(src: Path, out: Path, tok: Path, seq_len: int) -> dict[str, int]:
    """Prepare the conversations as `strata data prepare` does; count windows, tokens, trained."""
    import numpy as np

    from strata.data.sft import ChatOptions, prepare_chat

    prepare_chat(
        [src], out, ChatOptions(seq_len, loss_on="assistant"), 0.0, tokenizer=str(tok), workers=1,
        eot_token=EOT,
    )  # fmt: skip
    window = seq_len + 1
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16).reshape(-1, window)
    mask = np.fromfile(out / "train.mask.bin", dtype=np.uint8).reshape(-1, window)
    docs = np.fromfile(out / "train.docs.bin", dtype=np.int64).reshape(-1, 2)
    meta = json.loads((out / "meta.json").read_text())
    lengths = np.sort(docs[:, 1] - docs[:, 0])
    rows = len(tokens)
    return {
        "rows": rows,
        "conversations": len(docs),
        "computed": rows * seq_len,  # a window's inputs are its first seq_len tokens
        "trained": int(mask[:, 1:].sum()),  # mask[i] marks token i as a target of token i - 1
        "data_tokens": int(lengths.sum()),
        "median_len": int(np.median(lengths)),
        "p10_len": int(np.percentile(lengths, 10)),
        "p90_len": int(np.percentile(lengths, 90)),
        "max_len": int(lengths[-1]),
        "truncated": int(meta.get("chat", {}).get("truncated", 0)),
        "bfd_rows": best_fit_decreasing(lengths.tolist(), window),
    }


def best_fit_decreasing(lengths: list[int], window: int) -> int:
    """How many windows best-fit decreasing fills with these conversations, computed here over the
    whole set (a check of `strata data prepare`'s windows, packed per worker task)."""
    import bisect

    free: list[int] = []  # the open windows' free space, sorted
    for n in sorted(lengths, reverse=True):
        i = bisect.bisect_left(free, n)
        if i == len(free):
            bisect.insort(free, window - n)
        else:
            bisect.insort(free, free.pop(i) - n)
    return len(free)


def trl_side(
    records: list[dict], tok_dir: Path, model_dir: Path, work: Path, seq_len: int, batch: int,
    packing: bool, strategy: str = "bfd", sampling: str = "random",
) -> dict[str, int]:  # fmt: skip
    """One epoch of SFTTrainer's own train dataloader with these settings: rows, computed and
    trained tokens."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = SFTConfig(
        output_dir=str(work),
        per_device_train_batch_size=batch,
        max_length=seq_len,
        packing=packing,
        packing_strategy=strategy,
        assistant_only_loss=True,
        report_to="none",
        seed=0,
        use_cpu=True,
        dataset_num_proc=None,
        save_strategy="no",
        train_sampling_strategy=sampling,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok
    )
    computed = trained = 0
    for b in trainer.get_train_dataloader():  # padding-free: a batch's rows flattened into one
        computed += b["input_ids"].numel()
        trained += int((b["labels"][:, 1:] != -100).sum())
    rows = len(trainer.train_dataset)
    data_tokens = sum(len(x) for x in trainer.train_dataset["input_ids"])
    return {
        "rows": rows,
        "computed": computed,
        "trained": trained,
        "data_tokens": data_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="conversations")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="rows per batch (B)")
    p.add_argument("--median", type=float, default=350.0, help="median length in words")
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--low", type=int, default=50)
    p.add_argument("--high", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import datasets
    import transformers

    datasets.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    records = conversations(args.n, args.seed, args.median, args.sigma, args.low, args.high)
    with tempfile.TemporaryDirectory(prefix="strata-packing-") as tmp:
        work = Path(tmp)
        tok = make_tokenizer(work / "tok")
        model = make_model(work / "model", 4096, 32, 1, 2, 2, 64, args.seq_len)
        src = write_jsonl(work / "conversations.jsonl", records)
        sides = {"strata windows (bfd)": strata_side(src, work / "strata", tok, args.seq_len)}
        for i, (name, packing, strategy, sampling) in enumerate(
            (
                ("trl padded (default)", False, "bfd", "random"),
                ("trl padded, group_by_length", False, "bfd", "group_by_length"),
                ("trl packed bfd (padding-free)", True, "bfd", "random"),
                ("trl packed wrapped", True, "wrapped", "random"),
            )
        ):
            sides[name] = trl_side(
                records, tok, model, work / f"trl{i}", args.seq_len, args.batch, packing,
                strategy, sampling,
            )  # fmt: skip
    print(
        f"bench/packing_efficiency: {args.n} conversations, lognormal lengths (median "
        f"{args.median:g} words, sigma {args.sigma:g}, {args.low}..{args.high}), seq_len "
        f"{args.seq_len}, B {args.batch}, loss on the assistant turns"
    )
    print(
        "| batches of | rows | tokens computed | trained tokens | **useful fraction** | vs strata |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for name, s in sides.items():
        frac = s["trained"] / s["computed"]
        base = base or frac
        s["useful_fraction"] = frac
        print(
            f"| {name} | {s['rows']:,} | {s['computed']:,} | {s['trained']:,} | **{frac:.3f}** "
            f"| {frac / base:.2f}x |"
        )
    st, pb = sides["strata windows (bfd)"], sides["trl packed bfd (padding-free)"]
    print(
        f"check: best-fit decreasing of the same lengths, computed here over the whole set: "
        f"{st['bfd_rows']:,} windows (Strata wrote {st['rows']:,})"
    )
    print(
        f"conversation lengths in tokens (end-of-document token included): median "
        f"{st['median_len']}, p10 {st['p10_len']}, p90 {st['p90_len']}, max {st['max_len']}; "
        f"{st['truncated']} truncated to {args.seq_len}"
    )
    print(
        f"trained / all tokens of the data (the bound, no padding at all): strata "
        f"{st['trained'] / st['data_tokens']:.3f}, trl {pb['trained'] / pb['data_tokens']:.3f}; "
        f"strata's windows are {st['data_tokens'] / st['computed']:.1%} full"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(sides, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
