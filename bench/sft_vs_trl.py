"""Supervised fine-tuning throughput, Strata against TRL's `SFTTrainer`: trained tokens/s (targets
that carry loss) and all tokens/s (positions computed, padding included), on the same model, the
same conversations, batch size, sequence length and optimizer, on the CPU in one process (or --dp
processes a side under torchrun: Strata's data parallelism against TRL's DDP, both over gloo).

    python bench/sft_vs_trl.py                          # full fine-tuning, ~3 min on 2 cores
    python bench/sft_vs_trl.py --lora 16                # LoRA rank 16 on all-linear vs PEFT
    python bench/sft_vs_trl.py --dp 2 --threads 1       # 2 processes (torchrun, gloo) a side
    python bench/sft_vs_trl.py --tiny                   # a smoke run: tiny model, 2 steps

Setup (bench/_sft_common.py; kept under --work and reused): a BPE tokenizer of 4096 ids saved by
transformers with LFM2.5's chat template (its `{% generation %}` markers give both sides the
same assistant spans), --n synthetic conversations with lognormal lengths, and a random Llama
(transformers' `LlamaForCausalLM`, fp32, untied) saved with `save_pretrained`. Strata's data is
`strata data prepare --seq-len S --loss-on assistant` of the JSON Lines file (windows of S
tokens, whole conversations, each attending only inside itself with restarted positions:
`data.document_mask`, `data.reset_positions`), its model `model.init_from` of the directory.

Both sides: B rows of at most S tokens a step, no accumulation, fp32, AdamW (torch's fused CPU
kernel on both: Strata's `optim.impl: auto`, TRL's `adamw_torch_fused`) at lr 2e-5 constant,
weight decay 0, betas (0.9, 0.999), gradient clipping at 1.0, torch's SDPA attention, --threads
threads. TRL runs with `assistant_only_loss=True`, `bf16=False` and `activation_checkpointing=False`
(TRL 1.16 defaults to bf16 and activation checkpointing; Strata to neither), in the batching
modes of --trl (each a side of its own):

- `padded`: TRL's default (`packing=False`): B conversations a step, padded to the longest;
- `grouped`: the same with `train_sampling_strategy="group_by_length"` (transformers'
  LengthGroupedSampler: each batch's conversations of similar lengths, less padding);
- `packed`: `packing=True` (best-fit decreasing, which turns padding-free on: B packed rows of up
  to S tokens flattened into one row, attention kept inside each conversation by transformers'
  packed-sequence mask from the restarted position_ids).

Each side runs in a fresh process: --warmup steps, then --steps timed steps (wall time from the
end of the last warm-up step to the end of the last step: data, forward, backward, clipping,
update, logging). The sides alternate over --rounds rounds (the first side of a round alternates
too); the figures are medians over the rounds, the headline the ratio of Strata's trained
tokens/s to the best TRL mode's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sft_common import (  # noqa: E402
    EOT,
    REPO,
    conversations,
    make_model,
    make_tokenizer,
    write_jsonl,
)

LR = 2e-5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/strata-sft-bench"))
    p.add_argument("--n", type=int, default=600, help="conversations")
    p.add_argument("--batch", type=int, default=4, help="rows per step (B)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--median", type=float, default=180.0, help="median conversation, in words")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on all-linear (0: full FT)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads per process")
    p.add_argument(
        "--dp", type=int, default=1, help="processes under torchrun (data parallel, gloo)"
    )
    p.add_argument(
        "--trl", default="padded,grouped,packed", help="TRL modes: padded, grouped, packed"
    )
    p.add_argument("--tiny", action="store_true", help="smoke run: tiny model, 2+1 steps, 1 round")
    p.add_argument("--profile", help="(strata worker) write a cProfile of the timed steps here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.n, args.seq_len, args.hidden, args.layers, args.heads = 40, 128, 64, 2, 2
        args.ffn, args.median, args.steps, args.warmup, args.rounds = 128, 40.0, 2, 1, 1
        if args.work == p.get_default("work"):
            args.work = Path("/tmp/strata-sft-bench-tiny")
    return args


def tag(args: argparse.Namespace) -> str:
    return f"n{args.n}-s{args.seq_len}-h{args.hidden}-l{args.layers}-m{args.median:g}"


def setup(args: argparse.Namespace) -> dict[str, Path]:
    """Tokenizer, model, conversations and Strata's prepared windows under --work (reused)."""
    work = args.work / tag(args)
    work.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(args.work / "tok")
    model = make_model(
        work / "model", 4096, args.hidden, args.layers, args.heads, args.kv_heads, args.ffn,
        args.seq_len,
    )  # fmt: skip
    src = work / "conversations.jsonl"
    if not src.exists():
        high = max(20, args.seq_len - 40)
        write_jsonl(src, conversations(args.n, 0, args.median, 0.7, 10, high))
    data = work / "strata-data"
    if not (data / "meta.json").exists():
        subprocess.run(
            [sys.executable, "-m", "strata.launch.cli", "data", "prepare", str(src),
             "--out", str(data), "--tokenizer", str(tok), "--seq-len", str(args.seq_len),
             "--loss-on", "assistant", "--eot-token", EOT, "--val-fraction", "0.02",
             "--workers", "1"],
            check=True, cwd=REPO, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return {"work": work, "tok": tok, "model": model, "src": src, "data": data}


def quiet() -> None:
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --- the sides, each in a process of its own ------------------------------------------------------


def strata_worker(args: argparse.Namespace, paths: dict[str, Path]) -> dict:
    import torch

    from strata import config
    from strata.parallel import runtime
    from strata.trainer.loop import Trainer

    total = args.warmup + args.steps
    overrides = [
        f"model.init_from={paths['model']}",
        f"model.seq_len={args.seq_len}",
        f"data.path={paths['data']}",
        "data.document_mask=true",
        "data.reset_positions=true",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch * args.dp}",
        f"train.steps={total}",
        "train.precision=fp32",
        f"train.threads={args.threads}",
        "train.eval_interval=0",
        f"optim.lr={LR}",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "optim.weight_decay=0.0",
        "optim.beta2=0.999",
        "optim.grad_clip=1.0",
        "checkpoint.save_final=false",
        "checkpoint.interval=0",
        "log.progress=false",
        f"log.dir={paths['work'] / 'runs'}",
        f"checkpoint.dir={paths['work'] / 'ckpt'}",
    ]
    if args.lora:
        overrides += [
            f"model.lora.rank={args.lora}",
            f"model.lora.alpha={2 * args.lora}",
            "model.lora.target_modules=[all-linear]",
        ]
    rt = runtime.start("gloo", 600)
    cfg = config.load(None, overrides, rt.world_size)
    trainer = Trainer(cfg, rt)
    trainer.init_weights()
    torch.set_num_threads(args.threads)
    counts: list[tuple[int, int]] = []
    next_step = trainer.loader.next_step

    def counted() -> list:
        batches = next_step()
        counts.append(
            (
                sum(b.inputs.numel() for b in batches),
                sum(
                    int(b.mask.sum()) if b.mask is not None else b.targets.numel() for b in batches
                ),
            )
        )
        return batches

    trainer.loader.next_step = counted  # type: ignore[method-assign]
    losses, ends, cpu = [], [], []
    profiler = None
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(total):
        if i == args.warmup and args.profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        loss, _ = trainer.train_step()
        losses.append(float(loss))
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    trainer.release_locks()
    trained = sum(p.numel() for p in trainer.model.params if p.requires_grad)
    out = result(args, counts, losses, [start, *ends], [cpu_start, *cpu], trained)
    return {**out, "world": rt.world_size}


def trl_worker(args: argparse.Namespace, paths: dict[str, Path], mode: str) -> dict:
    import datasets
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    counts: list[tuple[int, int]] = []
    losses: list[float] = []
    ends: list[float] = []
    cpu: list[float] = []

    class Counting(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
            counts.append(
                (inputs["input_ids"].numel(), int((inputs["labels"][:, 1:] != -100).sum()))
            )
            loss = super().training_step(model, inputs, num_items_in_batch)
            losses.append(float(loss))
            return loss

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):  # type: ignore[no-untyped-def]
            ends.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_step_end(self, *a, **k):  # type: ignore[no-untyped-def]
            ends.append(time.perf_counter())
            cpu.append(time.process_time())

    cfg = SFTConfig(
        output_dir=str(paths["work"] / f"trl-{mode}"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_length=args.seq_len,
        packing=mode == "packed",
        train_sampling_strategy="group_by_length" if mode == "grouped" else "random",
        assistant_only_loss=True,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        bf16=False,
        activation_checkpointing=False,
        max_steps=total,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        paths["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, target_modules="all-linear",
            task_type="CAUSAL_LM",
        )  # fmt: skip
    records = [json.loads(line) for line in paths["src"].read_text().splitlines()]
    trainer = Counting(
        model=model,
        args=cfg,
        train_dataset=Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(paths["tok"]),
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    torch.set_num_threads(args.threads)
    trainer.train()
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    out = result(args, counts, losses, ends, cpu, trained)
    return {**out, "world": trainer.args.world_size}


def result(
    args: argparse.Namespace, counts: list[tuple[int, int]], losses: list[float],
    ends: list[float], cpu: list[float], trained_params: int,
) -> dict:  # fmt: skip
    """Figures of the timed steps (after the warm-up ones); `ends` and `cpu` are the wall clock and
    the process's CPU time at the start and at the end of every step."""
    w = args.warmup
    seconds = ends[-1] - ends[w]
    cpu_seconds = cpu[-1] - cpu[w]
    timed = counts[w:]
    tokens, trained = sum(c[0] for c in timed), sum(c[1] for c in timed)
    return {
        "steps": len(timed),
        "seconds": seconds,
        "step_s": seconds / max(1, len(timed)),
        "tokens": tokens,
        "trained": trained,
        "tokens_per_s": tokens / seconds,
        "trained_per_s": trained / seconds,
        "trained_per_cpu_s": trained / cpu_seconds,
        "losses": losses,
        "trained_params": trained_params,
    }


# --- the driver -----------------------------------------------------------------------------------


def run_side(argv: list[str], side: str, dp: int) -> dict:
    """One side in a fresh process (dp > 1: dp processes under torchrun, whose tokens are summed
    over the ranks and whose time is the slowest rank's)."""
    script = [str(Path(__file__).resolve()), *argv, "--worker", side]
    if dp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={dp}", *script]  # fmt: skip
    else:
        cmd = [sys.executable, *script]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or len(lines) < dp:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"bench/sft_vs_trl: the {side} side failed ({proc.returncode})")
    ranks = [json.loads(x[len("RESULT ") :]) for x in lines[-dp:]]
    if any(r["world"] != dp for r in ranks):
        raise SystemExit(f"bench/sft_vs_trl: the {side} side ran in worlds of {ranks[0]['world']}")
    out = dict(ranks[0])
    out["seconds"] = max(r["seconds"] for r in ranks)
    out["step_s"] = out["seconds"] / out["steps"]
    cpu = sum(r["trained"] / r["trained_per_cpu_s"] for r in ranks)
    for key in ("tokens", "trained"):
        out[key] = sum(r[key] for r in ranks)
    out["tokens_per_s"] = out["tokens"] / out["seconds"]
    out["trained_per_s"] = out["trained"] / out["seconds"]
    out["trained_per_cpu_s"] = out["trained"] / cpu
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    quiet()
    paths = setup(args)
    if args.worker:
        if args.worker == "strata":
            out = strata_worker(args, paths)
        else:
            out = trl_worker(args, paths, args.worker.removeprefix("trl-"))
        print("RESULT " + json.dumps(out), flush=True)
        return 0

    import torch

    meta = json.loads((paths["data"] / "meta.json").read_text())
    trained_in_windows = meta.get("chat", {}).get("trained_tokens", {}).get("train", "?")
    sides = ["strata"] + [f"trl-{m}" for m in args.trl.split(",") if m]
    load = os.getloadavg()[0]
    print(
        f"bench/sft_vs_trl: Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} kv), ffn {args.ffn}, vocab 4096, "
        f"{'LoRA rank ' + str(args.lora) + ' all-linear' if args.lora else 'full fine-tuning'}; "
        f"B {args.batch} x S {args.seq_len} per process, {args.dp} process(es) of "
        f"{args.threads} threads, fp32, "
        f"torch {torch.__version__}"
    )
    print(
        f"  {args.n} conversations ({trained_in_windows} trained "
        f"tokens in Strata's windows); {args.warmup} warm-up + {args.steps} timed steps per side, "
        f"{args.rounds} rounds; load average {load:.2f}"
    )
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            out = run_side([a for a in argv if a != "--profile"], side, args.dp)
            runs[side].append(out)
            print(
                f"  round {r + 1} {side:12s} {out['step_s'] * 1e3:8.1f} ms/step "
                f"{out['trained_per_s']:9.0f} trained tok/s {out['tokens_per_s']:9.0f} tok/s "
                f"{out['trained_per_cpu_s']:9.0f} trained tok/CPU-s "
                f"(loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f})",
                flush=True,
            )

    def med(side: str, key: str) -> float:
        return statistics.median(o[key] for o in runs[side])

    print()
    print("| side | trained params | step (median) | trained tokens/s | all tokens/s | "
          "trained share | **strata / side (trained tok/s)** | trained tok/CPU-s | "
          "strata / side (CPU) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    cpu_base = med("strata", "trained_per_cpu_s")
    base = med("strata", "trained_per_s")
    for side in sides:
        share = sum(o["trained"] for o in runs[side]) / sum(o["tokens"] for o in runs[side])
        print(
            f"| {side} | {runs[side][0]['trained_params']:,} | {med(side, 'step_s') * 1e3:.1f} ms "
            f"| {med(side, 'trained_per_s'):,.0f} | {med(side, 'tokens_per_s'):,.0f} | "
            f"{share:.3f} | **{base / med(side, 'trained_per_s'):.2f}x** | "
            f"{med(side, 'trained_per_cpu_s'):,.0f} | "
            f"{cpu_base / med(side, 'trained_per_cpu_s'):.2f}x |"
        )
    best = max(sides[1:], key=lambda s: med(s, "trained_per_s")) if len(sides) > 1 else None
    if best:
        print(
            f"\nratio strata/trl (trained tokens/s, against the best TRL mode, {best}): "
            f"{base / med(best, 'trained_per_s'):.2f}x; load average now "
            f"{os.getloadavg()[0]:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
