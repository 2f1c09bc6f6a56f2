"""`strata generate`: text from a trained model, in this process: a Strata checkpoint (any layout),
a Hugging Face model directory or a DCP checkpoint, its own tokenizer, a key/value cache, greedy or
sampled decoding (`strata.inference`).

Refused before anything is allocated: a temperature that is not a finite number >= 0, a device
torch cannot use here (the message lists those it can), and a --max-new-tokens whose key/value
cache and rotary tables (prompt + new tokens, for every prompt) would not fit in the memory free on
the device (the message names the most that fits). Generating past model.seq_len stays allowed,
with a note: memory, not the trained length, is the limit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from strata.errors import StrataError
from strata.launch.commands.common import OVERRIDES, CommandHelp, whole

DTYPES = ("fp32", "bf16")


HELP = CommandHelp(
    "generate",
    summary="continue prompts with a trained model (a checkpoint of any layout, a Hugging Face "
    "directory)",
    usage=(
        "strata generate CKPT_OR_HF_DIR [--prompt TEXT ... | --prompts FILE] [--max-new-tokens N]"
        "\n                       [--temperature T --top-k K --top-p P --seed S] [--stream] "
        "[key=value ...]",
    ),
    description="""\
Continue each prompt with up to --max-new-tokens tokens, decoded with the model's own
tokenizer (the run's prepared data's, or the Hugging Face directory's), stopping at its
end-of-text id. Greedy unless --temperature > 0. Prompts of different lengths run as one batch.
With --chat each prompt is a user message, rendered with the chat template (the run's data's,
the directory's, or --chat-template) and the assistant's generation prompt, as transformers'
apply_chat_template renders it; the reply stops at the template's end of turn (and
generation_config.json's eos ids) and is printed alone.""",
    examples=(
        "strata generate runs/tiny/checkpoints --prompt 'def main(' --max-new-tokens 64",
        "strata generate ./Qwen2-0.5B --prompts prompts.txt --temperature 0.8 --top-p 0.95 "
        "--seed 1",
        "strata generate runs/tiny/checkpoints/step_00000100 --prompt 'import ' --stream",
        "strata generate dcp_ckpt/ --config configs/tiny.yaml --prompt 'x = '",
        "strata generate runs/sft/checkpoints --chat --prompt 'What is RoPE?'",
    ),
)


def add_arguments(g: argparse.ArgumentParser) -> None:
    """The model, the overrides, the prompts, the sampling and where the model runs."""
    g.add_argument(
        "path",
        metavar="CKPT_OR_HF_DIR",
        help="a run's checkpoint directory, a step_* directory, a "
        "Hugging Face model directory, or a DCP checkpoint (with --config)",
    )
    g.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=OVERRIDES)
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    g.add_argument(
        "--prompts", help='a file of prompts: one per line, or JSON lines with a "prompt" field'
    )
    g.add_argument(
        "--max-new-tokens",
        type=whole(1),
        default=128,
        help="tokens to add to each prompt (default 128)",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample"
    )
    g.add_argument(
        "--top-k", type=whole(0), default=0, help="sample from the k most likely tokens (0: all)"
    )
    g.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the smallest set of this probability"
    )
    g.add_argument("--seed", type=int, default=0, help="the sampling seed (one seed, one output)")
    g.add_argument(
        "--stream", action="store_true", help="print the tokens as they come (one prompt)"
    )
    g.add_argument(
        "--config",
        help="a YAML experiment in place of the one the checkpoint carries (needed for DCP)",
    )
    g.add_argument(
        "--dtype", choices=DTYPES, default="fp32", help="the weights' and activations' type"
    )
    g.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    g.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message: rendered with the chat template and the generation "
        "prompt, stopped at the end of the turn; prints the reply alone",
    )
    g.add_argument(
        "--chat-template",
        metavar="NAME_OR_FILE",
        help="with --chat: a built-in template (chatml), a .jinja file or a named template of the "
        "tokenizer, in place of the one the run's data was prepared with or the directory carries",
    )


def usable_devices() -> list[str]:
    """The devices torch can run on here: cpu, each CUDA device, mps."""
    import torch

    found = ["cpu"]
    if torch.cuda.is_available():
        found += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def check_device(name: str) -> None:
    """Refuse a --device torch cannot use here, listing those it can."""
    import torch

    usable = usable_devices()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is not None and (
        device.type == "cpu"
        or (
            device.type == "cuda"
            and torch.cuda.is_available()
            and (device.index or 0) < torch.cuda.device_count()
        )
        or (device.type == "mps" and "mps" in usable)
    ):
        return
    raise StrataError(f"--device {name}: torch cannot use it here; usable: {', '.join(usable)}")


def free_bytes(device: str) -> int:
    """Memory free for new allocations on `device` (`runtime.available_bytes`: the GPU's free
    memory, else the host's MemAvailable), or the host's free pages where that cannot be read."""
    import torch

    from strata.parallel.runtime import available_bytes

    free = available_bytes(torch.device(device))
    if free is not None:
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_length(
    model_cfg, prompts: int, longest_prompt: int, max_new: int, element: int, free: int
) -> None:
    """Refuse a --max-new-tokens whose key/value cache (every layer's keys and values of every
    prompt's positions) and rotary tables would not fit in `free` bytes, naming the most that
    fits."""
    per_position = (
        2 * model_cfg.n_layers * prompts * model_cfg.kv_heads * model_cfg.head_size * element
        + 2 * model_cfg.head_size * 4  # the rotary cos and sin tables, fp32
    )
    need = (longest_prompt + max_new) * per_position
    if need <= free:
        return
    most = free // per_position - longest_prompt
    fits = (
        f"at most {most} new tokens fit"
        if most > 0
        else "not even the prompt fits; use fewer or shorter prompts"
    )
    raise StrataError(
        f"--max-new-tokens {max_new}: the key/value cache for {longest_prompt} + {max_new} "
        f"positions of {prompts} prompt(s) needs {need / 2**30:.1f} GiB, more than the "
        f"{free / 2**30:.1f} GiB free; {fits}"
    )


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt's and --prompts' prompts, in order."""
    prompts = list(args.prompt)
    if args.prompts:
        path = Path(args.prompts)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise StrataError(f"--prompts {path}: cannot be read as UTF-8 text ({e})") from e
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    prompts.append(str(json.loads(line)["prompt"]))
                except (ValueError, KeyError, TypeError) as e:
                    raise StrataError(
                        f'--prompts {path}:{n}: expected a JSON object with a "prompt" ({e})'
                    ) from e
            else:
                prompts.append(line)
    if not prompts:
        raise StrataError(
            "strata generate: no prompt; give --prompt TEXT (repeatable) or --prompts FILE"
        )
    if args.stream and len(prompts) > 1:
        raise StrataError(
            f"--stream prints one prompt's tokens as they come; got {len(prompts)} prompts"
        )
    return prompts


def run(args: argparse.Namespace) -> int:
    """Generate and print each prompt's continuation; timing on stderr."""
    import torch

    from strata.inference.generate import generate
    from strata.inference.sampling import Sampling
    from strata.inference.source import open_model

    if not math.isfinite(args.temperature):
        raise StrataError(f"--temperature {args.temperature}: must be a finite number >= 0")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    problems = sampling.problems()
    if problems:
        raise StrataError("; ".join(problems))
    if args.chat_template is not None and not args.chat:
        raise StrataError(
            f"--chat-template {args.chat_template} applies to chat prompts: add --chat"
        )
    prompts = read_prompts(args)
    check_device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = Path(args.config) if args.config else None
    opened = open_model(Path(args.path), config, args.overrides, dtype)
    model = opened.model.to(args.device)
    ids, stop_ids = _encode(args, opened, prompts)
    if any(not i for i in ids):
        raise StrataError("strata generate: a prompt encodes to no tokens; give it some text")
    element = torch.finfo(dtype).bits // 8
    check_length(
        opened.cfg.model,
        len(ids),
        max(len(i) for i in ids),
        args.max_new_tokens,
        element,
        free_bytes(args.device),
    )
    longest = max(len(i) for i in ids) + args.max_new_tokens
    print(f"model: {opened.what}", file=sys.stderr)
    if longest > opened.cfg.model.seq_len:
        print(
            f"note: {longest} tokens run past the {opened.cfg.model.seq_len} the model was "
            "trained on",
            file=sys.stderr,
        )
    stream = _Stream(opened.tokenizer) if args.stream else None
    if stream and not args.chat:
        print(prompts[0], end="", flush=True)
    result = generate(model, ids, args.max_new_tokens, sampling, stop_ids, stream)
    if stream:
        print()
    else:
        for prompt, new in zip(prompts, result.tokens):
            reply = opened.tokenizer.decode([t for t in new if t not in stop_ids])
            print(reply if args.chat else prompt + reply)
            print("-" * 40)
    rate = result.new_tokens / result.decode_s if result.decode_s > 0 else float("inf")
    print(
        f"{result.new_tokens} new tokens over {len(prompts)} prompt(s); prefill "
        f"{result.prefill_s:.3f} s, decoding {result.decode_s:.3f} s ({rate:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _encode(args: argparse.Namespace, opened, prompts: list[str]) -> tuple[list[list[int]], set]:
    """Each prompt's ids and the ids that end a generation: the prompt as it is, or with --chat as a
    user message rendered with the chat template (no special tokens added, as transformers'
    apply_chat_template tokenizes) and the template's end of turn among the stop ids."""
    if not args.chat:
        return [opened.tokenizer.encode(p) for p in prompts], set(opened.stop_ids)
    from strata.inference.chat import open_chat

    chat = open_chat(Path(args.path), opened, args.chat_template)
    turn = ", ".join(chat.end_of_turn) or "none found"
    print(f"chat template: {chat.template.source} (end of turn: {turn})", file=sys.stderr)
    ids = [opened.tokenizer.encode(chat.prompt(p), special=False) for p in prompts]
    return ids, set(chat.stop_ids)


class _Stream:
    """Prints one row's text as its tokens come: the whole decoded so far, less what was printed (a
    token may be part of a character, or change how the one before decodes)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def __call__(self, tokens: list[int | None]) -> None:
        if tokens[0] is None:
            return
        self.ids.append(tokens[0])
        text = self.tokenizer.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            print(text[len(self.shown) :], end="", flush=True)
            self.shown = text
