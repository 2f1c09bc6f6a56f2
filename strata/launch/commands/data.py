"""`strata data prepare`: tokenize text, JSON Lines and Parquet files (or the Python standard
library's sources) into train.bin, val.bin and meta.json in parallel worker processes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strata.data.chat import BUILTIN, LONG_POLICIES, LOSS_ON
from strata.errors import StrataError
from strata.launch.commands.common import CommandHelp, Subcommand, file_errors, fraction, whole

HELP = CommandHelp(
    "data",
    summary="prepare token files",
    description="Tokenize text files, JSON Lines (.jsonl, one object per line) and Parquet "
    "(.parquet) into train.bin, val.bin and meta.json (plus tokenizer.json for a tokenizer other "
    "than bytes), in parallel worker processes; each document is followed by the tokenizer's "
    "end-of-document token. A text file is one document and goes wholly to train or val by a hash "
    "of its path; a JSON Lines or Parquet document goes by a hash of (path, line or row number). "
    "Conversations (records with 'messages', 'prompt' and 'completion', or Alpaca's "
    "'instruction', 'input' and 'output') are rendered with the tokenizer's chat template, "
    "masked so that only the assistant's tokens are trained (--loss-on), and packed into windows "
    "of --seq-len + 1 tokens that never cut a conversation; beside the tokens lie the loss mask "
    "(SPLIT.mask.bin) and the conversations' boundaries (SPLIT.docs.bin). Preference pairs "
    "(records with 'chosen' and 'rejected', and 'prompt' or a shared first turn: TRL's formats) "
    "become two conversations side by side in one window, each trained on its completion, for "
    "train.objective=dpo.",
    examples=(
        "strata data prepare ~/books --glob '*.txt' --out data/books",
        "strata data prepare corpus.jsonl --text-field content --tokenizer bpe:32000 --out data/c",
        "strata data prepare shards/ --glob '*.parquet' --tokenizer ~/models/Llama-3.2-1B "
        "--out data/l",
        "strata data prepare chats.jsonl --tokenizer ~/models/Qwen2.5-0.5B-Instruct --seq-len "
        "4096 --out data/sft",
        "strata data prepare pairs.parquet --tokenizer ~/models/base --chat-template chatml "
        "--loss-on completion --seq-len 2048 --long drop --out data/pairs",
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
        "strata data prepare CONVERSATIONS --out DIR --tokenizer tokenizer.json|HF_DIR "
        "--seq-len N\n                           [--chat-template chatml|FILE.jinja|NAME] "
        "[--loss-on assistant|all|last_turn|completion] [--long truncate|drop]",
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
        "eos_token, else the first of <|endoftext|>, <|end_of_text|>, </s>, <eos> it has; for "
        "conversations, the first of those that the chat template does not write)",
    )
    d.add_argument("--workers", type=whole(1), help="tokenizing processes (default: one per CPU)")
    _add_chat_arguments(d)


def _add_chat_arguments(d: argparse.ArgumentParser) -> None:
    """`strata data prepare`'s options for conversations."""
    chat = d.add_argument_group(
        "conversations",
        "JSON Lines or Parquet records with 'messages' (a list of {role, content}, optional "
        "'tools'), 'prompt' and 'completion', or 'instruction', 'input' and 'output' (Alpaca) are "
        "conversations: rendered with the chat template, masked, packed (docs: README, Data)",
    )
    chat.add_argument(
        "--seq-len",
        type=whole(2),
        help="the model.seq_len to train with (required for conversations): they are packed into "
        "windows of seq-len + 1 tokens, several per window, none cut across two; the rest of a "
        "window is padding without loss; the directory opens only with this model.seq_len",
    )
    chat.add_argument(
        "--chat-template",
        metavar="TEMPLATE",
        help="default: the tokenizer's own (chat_template.jinja or tokenizer_config.json's "
        f"chat_template, as transformers reads it); {', '.join(BUILTIN)} (built in, for a "
        "tokenizer "
        "without one), a .jinja file, or the name of one of the tokenizer's named templates",
    )
    chat.add_argument(
        "--loss-on",
        choices=LOSS_ON,
        default=None,
        help="the tokens trained: assistant (every assistant turn, the default), all, last_turn "
        "(the last assistant turn), completion (what follows the prompt of prompt/completion or "
        "Alpaca records, as TRL's completion_only_loss)",
    )
    chat.add_argument(
        "--long",
        choices=LONG_POLICIES,
        default=None,
        help="a conversation longer than --seq-len tokens: truncate (keep its first seq-len "
        "tokens, the default, as TRL and torchtune do) or drop; meta.json counts either",
    )


CHAT_FLAGS = ("seq_len", "chat_template", "loss_on", "long")


def _run_chat(args: argparse.Namespace, files: list[Path], root: Path | None) -> int:
    """Prepare conversations and print what the directory holds."""
    from strata.data import sft

    if args.seq_len is None:
        raise StrataError(
            "strata data prepare: the inputs are conversations, which are packed into windows of "
            "model.seq_len + 1 tokens; give --seq-len (the model.seq_len you will train with)"
        )
    options = sft.ChatOptions(
        args.seq_len, args.chat_template, args.loss_on or "assistant", args.long or "truncate"
    )
    with file_errors("strata data prepare"):
        meta = sft.prepare_chat(
            files,
            Path(args.out),
            options,
            args.val_fraction,
            root,
            tokenizer=args.tokenizer,
            workers=args.workers,
            eot_token=args.eot_token,
            progress=True,
        )
    chat, tok = meta["chat"], meta["tokenizer"]
    # a pair is two conversations
    per, what = (2, "preference pairs") if chat.get("pairs") else (1, "conversations")
    print(
        f"wrote {args.out}: {chat['conversations']['train'] // per:,} train + "
        f"{chat['conversations']['val'] // per:,} val {what} in {chat['windows']['train']:,} + "
        f"{chat['windows']['val']:,} windows of {chat['window']} tokens "
        f"({chat['trained_tokens']['train']:,} train tokens with loss, --loss-on "
        f"{chat['loss_on']}); {chat['truncated']:,} truncated, {chat['dropped_long']:,} dropped "
        f"as longer than {chat['seq_len']}, {chat['dropped_untrained']:,} with nothing to train "
        f"dropped; template {chat['template']['source']}, end of conversation "
        f"{tok['eot_token']} = {meta['eot']}; train with model.seq_len={chat['seq_len']}"
    )
    return 0


def _warn_end_of_turn(tokenizer: str, eot_token: str) -> None:
    """Say when text was prepared with the tokenizer's chat end-of-turn as end-of-document."""
    from strata.data import chat, tokenize

    try:
        template = chat.load_template(tokenize.tokenizer_file(tokenizer).parent, None)
    except StrataError:
        return  # no chat template: nothing to confuse
    problem = chat.end_of_turn_problem(template, eot_token)
    if problem:
        print(f"strata: warning: {problem}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Write the token files and print what they hold."""
    import sysconfig

    from strata.data import prepare, sft

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
            conversations = sft.holds_conversations(files, args.text_field)
        if conversations or any(getattr(args, f) is not None for f in CHAT_FLAGS):
            return _run_chat(args, files, root)
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
    if tok["kind"] == "file":
        _warn_end_of_turn(args.tokenizer, tok["eot_token"])
    return 0


SUBCOMMANDS = (Subcommand(PREPARE, _add_prepare_arguments, run),)
