"""`strata data prepare`: tokenize text, JSON Lines and Parquet files (or the Python standard
library's sources) into train.bin, val.bin and meta.json in parallel worker processes."""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.errors import StrataError
from strata.launch.commands.common import CommandHelp, Subcommand, file_errors, fraction, whole

HELP = CommandHelp(
    "data",
    summary="prepare token files",
    description="Tokenize text files, JSON Lines (.jsonl, one object per line) and Parquet "
    "(.parquet) into train.bin, val.bin and meta.json (plus tokenizer.json for a tokenizer other "
    "than bytes), in parallel worker processes; each document is followed by the tokenizer's "
    "end-of-document token. A text file is one document and goes wholly to train or val by a hash "
    "of its path; a JSON Lines or Parquet document goes by a hash of (path, line or row number).",
    examples=(
        "strata data prepare ~/books --glob '*.txt' --out data/books",
        "strata data prepare corpus.jsonl --text-field content --tokenizer bpe:32000 --out data/c",
        "strata data prepare shards/ --glob '*.parquet' --tokenizer ~/models/Llama-3.2-1B "
        "--out data/l",
        "strata data prepare --stdlib --out data/stdlib",
        "strata train configs/tiny.yaml data.path=data/books",
    ),
)


PREPARE = CommandHelp(
    "prepare",
    summary="tokenize text, JSON Lines or Parquet into train.bin, val.bin and meta.json",
    usage=(
        "strata data prepare FILES_OR_DIRS --out DIR "
        "[--tokenizer bytes|tokenizer.json|HF_DIR|bpe:N]"
        "\n                           [--text-field F] [--workers N] [--glob '*.txt'] "
        "[--val-fraction 0.05]",
        "strata data prepare --stdlib --out DIR [--tokenizer ...]",
    ),
    description=HELP.description,
    examples=HELP.examples,
)


def add_arguments(d: argparse.ArgumentParser) -> None:
    """Nothing of its own: `prepare` (SUBCOMMANDS) has the arguments."""


def _add_prepare_arguments(d: argparse.ArgumentParser) -> None:
    """`strata data prepare`'s inputs, output, tokenizer and workers."""
    d.add_argument(
        "inputs", nargs="*", help="text, .jsonl/.ndjson or .parquet files, or directories"
    )
    d.add_argument(
        "--out",
        required=True,
        help="output directory (train.bin, val.bin, meta.json, tokenizer.json): new, empty, or an "
        "earlier output (which is replaced); never inside an input directory",
    )
    d.add_argument(
        "--glob", default="*", help="file pattern inside input directories (e.g. '*.txt')"
    )
    d.add_argument(
        "--val-fraction",
        type=fraction,
        default=0.05,
        help="share of documents held out for evaluation",
    )
    d.add_argument(
        "--stdlib",
        action="store_true",
        help="use the Python standard library sources as the corpus",
    )
    d.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (UTF-8 bytes, 257 ids), the path of a tokenizer.json or of a Hugging Face "
        "model directory holding one, or bpe:N (train a byte-level BPE of N ids on the inputs, "
        "saved as OUT/tokenizer.json)",
    )
    d.add_argument(
        "--text-field",
        default="text",
        help="the JSON field (.jsonl) or column (.parquet) holding each document",
    )
    d.add_argument(
        "--eot-token",
        help="the tokenizer.json's end-of-document token (default: the model directory's "
        "eos_token, else the first of <|endoftext|>, <|end_of_text|>, </s>, <eos> it has)",
    )
    d.add_argument("--workers", type=whole(1), help="tokenizing processes (default: one per CPU)")


def run(args: argparse.Namespace) -> int:
    """Write the token files and print what they hold."""
    import sysconfig

    from strata.data import prepare

    root: Path | None
    if args.stdlib:
        files, root = prepare.stdlib_corpus_files(), Path(sysconfig.get_paths()["stdlib"])
        prepare.check_output_outside_inputs(Path(args.out), [root])
    else:
        if not args.inputs:
            raise StrataError(
                "strata data prepare: give input files/directories, or --stdlib for "
                "the built-in corpus"
            )
        files, root = prepare.expand_inputs(args.inputs, args.glob, out_dir=Path(args.out))
    with file_errors("strata data prepare"):
        meta = prepare.prepare(
            files,
            Path(args.out),
            args.val_fraction,
            root=root,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            workers=args.workers,
            eot_token=args.eot_token,
            progress=True,
        )
    tok = meta["tokenizer"]
    print(
        f"wrote {args.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
        f"from {meta['documents']:,} documents in {meta['files']:,} files ({meta['dtype']}, "
        f"vocab {meta['vocab_size']}, tokenizer {tok['source']}, end of document "
        f"{tok['eot_token']} = {meta['eot']})"
    )
    return 0


SUBCOMMANDS = (Subcommand(PREPARE, _add_prepare_arguments, run),)
