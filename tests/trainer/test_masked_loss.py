"""The loss over masked targets (conversations' loss masks): a step's loss is the sum of the
per-token cross-entropy over the global batch's trained targets divided by their count, and its
gradient that quotient's, in every layout. The reference is one plain forward of the whole global
batch written with torch (F.cross_entropy with ignore_index, summed, over the count), against
Strata's evaluation loss, step loss and every rank's reduced gradient: gradient accumulation in
one process, dp 2, tp 2 with sequence parallelism, pp 2 and cp 2, on masks as uneven as
micro-batches without a trained target (a whole dp rank without one), one with a single trained
target (on one cp rank only) and one with over a hundred. Through `strata train` on
conversations prepared by `strata data prepare`, the logged training and evaluation losses are
those quotients at any dp size, and `strata eval` scores the trained targets (loss, count,
bytes); a batch without trained targets is refused; conversations without data.document_mask
are warned about; a mixture of conversations and plain text masks every row."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from strata import config
from strata.data.loader import BatchLoader, MixtureLoader, eval_windows
from strata.data.mixture import Mixture
from strata.data.tokens import Batch, TokenDataset, mask_file, read_meta
from strata.errors import DataError
from strata.model import IGNORE_INDEX, build_model, documents_of
from strata.parallel.context import positions
from strata.parallel.tensor import placement_of
from strata.trainer.hooks import StepHook

from conftest import tiny_overrides
from worlds import final_params, losses_from, run_world, train_run, worker_env

SEQ = 128
SETTINGS = {
    "model.seq_len": SEQ,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 2,
    "optim.grad_clip": 0,  # the gradients compared as reduced, unclipped
    "data.document_mask": True,
    "data.reset_positions": True,
}
WORDS = "the weather in paris is sunny cold warm what should i wear today a coat hello".split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """Conversations of very different lengths (replies of 1 to 40 words), prepared by `strata
    data prepare` for seq_len 128 with the built-in ChatML template and a small BPE."""
    root = tmp_path_factory.mktemp("chat")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    tok.train_from_iterator(
        [_text(rng, 20) for _ in range(200)],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    records = []
    for i in range(160):
        turns = [
            {"role": "user", "content": _text(rng, rng.randint(2, 10))},
            {"role": "assistant", "content": _text(rng, 1 if i % 4 == 0 else rng.randint(5, 40))},
        ]
        records.append({"messages": turns})
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from strata.launch.cli import main

    argv = ["data", "prepare", str(root / "chat.jsonl"), "--out", str(root / "data")]
    argv += ["--tokenizer", str(root / "tok"), "--chat-template", "chatml"]
    assert main([*argv, "--seq-len", str(SEQ), "--workers", "1", "--val-fraction", "0.2"]) == 0
    return root / "data"


@pytest.fixture(scope="module")
def uneven_dir(chat_dir, tmp_path_factory) -> Path:
    """`chat_dir` with the masks of the first step's global batch rewritten (its micro-batches of
    2 windows, in the order of the global batch): none trained, none trained, a single trained
    target in the last quarter of a row (on cp rank 0 of 2, so cp rank 1 holds none of that
    micro-batch's), and a whole row of 128 plus a random third of another."""
    out = tmp_path_factory.mktemp("uneven") / "data"
    shutil.copytree(chat_dir, out)
    data = TokenDataset(out, "train", SEQ)
    cfg = config.load(None, tiny_overrides(out, out.parent, **SETTINGS))
    micro = BatchLoader(data, cfg.train.seed, 8, 2).step_indices()
    mask = np.fromfile(out / mask_file("train"), np.uint8)
    rows = np.zeros((8, SEQ + 1), np.uint8)  # each window's mask; [1:] goes with its targets
    single = 3 * SEQ // 4 + 5
    assert single in positions(SEQ, 2, 0).tolist()
    rows[5, 1 + single] = 1
    rows[6, 1:] = 1
    rows[7, 1:] = np.random.default_rng(0).random(SEQ) < 1 / 3
    for row, window in zip(rows, [i for m in micro for i in m]):
        mask[window * (SEQ + 1) : (window + 1) * (SEQ + 1)] = row
    mask.tofile(out / mask_file("train"))
    return out


def _step_batch(data_dir: Path, cfg: config.Config) -> Batch:
    """The first step's global batch, in order: every rank's micro-batches laid end to end."""
    data = TokenDataset(data_dir, "train", SEQ)
    step = BatchLoader(data, cfg.train.seed, cfg.train.global_batch_size, 2).next_step()
    masks = [b.mask for b in step]
    assert all(m is not None for m in masks)
    return Batch(
        torch.cat([b.inputs for b in step]),
        torch.cat([b.targets for b in step]),
        torch.cat(masks),  # type: ignore[arg-type]
    )


def reference_loss(
    model: torch.nn.Module, data_dir: Path, batch: Batch
) -> tuple[torch.Tensor, int]:
    """Plain torch over the whole batch: each conversation attending inside itself with positions
    from its start, cross-entropy summed over the trained targets, divided by their count."""
    eot = read_meta(data_dir).raw["eot"]
    assert batch.mask is not None
    logits = model(batch.inputs, documents_of(batch.inputs, eot, True, True))
    targets = batch.targets.masked_fill(~batch.mask, -100)
    count = int(batch.mask.sum())
    total = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum"
    )
    return total / count, count


def reference_step(data_dir: Path, overrides: list[str]) -> tuple[float, dict[str, torch.Tensor]]:
    """The first step's loss and gradient of each parameter, from one plain forward and
    backward of the whole global batch."""
    cfg = config.load(None, overrides)
    model = build_model(cfg.model, TokenDataset(data_dir, "train", SEQ).vocab_size, cfg.train.seed)
    loss, _ = reference_loss(model, data_dir, _step_batch(data_dir, cfg))
    loss.backward()
    return float(loss.detach()), {
        n: p.grad for n, p in model.named_parameters() if p.grad is not None
    }


class GradientCapture(StepHook):
    """At the veto, after the reduction and before the update: each of this rank's gradient
    pieces, with the same piece of the reference gradient (its slice after tp and pp)."""

    def __init__(self, model, want: dict[str, torch.Tensor]):
        self.model, self.want = model, want
        self.pieces: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def veto(self, step: int, loss: float, grad_norm: float) -> str | None:
        for g in self.model.engine.groups:
            for slot, piece, a, b in g.segments:
                name = slot.aliases[0]
                expected = placement_of(slot.param).local_slice(self.want[name]).flatten()[a:b]
                self.pieces.append((name, piece.grad.detach().clone(), expected))
        return None


def _first_step(overrides: list[str], want: dict[str, torch.Tensor], size: int) -> dict:
    """Strata's evaluation before the first step and that step, on this rank of a world of `size`:
    the evaluation loss, the step's loss and its gradient pieces."""
    from strata.parallel import runtime
    from strata.trainer.loop import Trainer

    cfg = config.load(None, overrides, world_size=size, local_world_size=size)
    rt = runtime.start("gloo", cfg.parallel.timeout_s)
    trainer = Trainer(cfg, rt, writes=[], saves=False)
    capture = GradientCapture(trainer.model, want)
    trainer.hooks.append(capture)
    evaluation = trainer.evaluate()
    loss, _ = trainer.train_step()
    trainer.model.close()
    return {"eval": evaluation.loss, "loss": float(loss), "pieces": capture.pieces}


def _step_rank(
    rank: int, size: int, port: int, out_dir: str, overrides: list[str], want: dict
) -> None:
    worker_env(rank, size, port)
    torch.set_num_threads(1)
    from strata.parallel import runtime

    result = _first_step(overrides, want, size)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    runtime.stop()


def assert_reference(results: list[dict], want: tuple[float, float], n_params: int) -> None:
    """Every rank's evaluation and step loss are the reference's (`want`) within 1e-6, and every
    gradient piece is the reference gradient's within 1e-5 of each entry or 1e-6 of the tensor's
    largest: fp32 sums in another order (measured: the losses within 5e-7; the gradients within
    1e-6 of the largest entry, except under tp, whose vocab-parallel cross-entropy computes the
    softmax over the shards as exp(x − max) / Σ exp rather than torch's fused log-softmax, and
    whose sharded matmuls sum in another order: within 9e-6)."""
    checked = set()
    for r, result in enumerate(results):
        assert result["eval"] == pytest.approx(want[0], rel=1e-6, abs=1e-6), r
        assert result["loss"] == pytest.approx(want[1], rel=1e-6, abs=1e-6), r
        for name, got, expected in result["pieces"]:
            atol = 1e-6 * float(expected.abs().max()) + 1e-9
            torch.testing.assert_close(
                got, expected, rtol=1e-5, atol=atol, msg=lambda m: f"rank {r}, {name}: {m}"
            )
            checked.add(name)
    assert len(checked) == n_params  # every parameter, on some rank


def test_accumulated_micro_batches_give_the_global_sum_over_the_count(uneven_dir, tmp_path):
    overrides = tiny_overrides(uneven_dir, tmp_path, **SETTINGS)
    loss, want = reference_step(uneven_dir, overrides)
    cfg = config.load(None, overrides)
    batch = _step_batch(uneven_dir, cfg)
    assert batch.mask is not None
    per_micro = batch.mask.view(4, -1).sum(1).tolist()
    assert per_micro[:3] == [0, 0, 1] and per_micro[3] > 128  # as uneven as the fixture says
    assert cfg.grad_accum_steps(1) == 4
    losses = (_eval_reference(uneven_dir, overrides), loss)
    assert_reference([_first_step(overrides, want, 1)], losses, len(want))


LAYOUTS = {
    "dp2": {},  # dp rank 0 holds the two micro-batches without a trained target
    "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "pp2": {"parallel.pp": 2},
    "cp2": {"parallel.cp": 2},
    # ZeRO-3 with the parameters and optimizer state in host memory
    "zero3-offload": {
        "zero.params.shard_over": "global",
        "zero.grads.shard_over": "global",
        "zero.optim.shard_over": "global",
        "offload.params.device": "cpu",
        "offload.optim.device": "cpu",
    },
}


@pytest.mark.slow  # a world of 2 processes each
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_the_global_sum_over_the_count(uneven_dir, tmp_path, layout):
    overrides = tiny_overrides(uneven_dir, tmp_path, **SETTINGS, **LAYOUTS[layout])
    plain = tiny_overrides(uneven_dir, tmp_path, **SETTINGS)
    loss, want = reference_step(uneven_dir, plain)
    results = run_world(_step_rank, 2, tmp_path, overrides, want)
    assert_reference(results, (_eval_reference(uneven_dir, plain), loss), len(want))


def _eval_reference(
    data_dir: Path, overrides: list[str], params: dict | None = None, windows: int | None = None
) -> float:
    """The loss over the trained targets of the validation windows an evaluation reads (or the
    first `windows`), of the untrained model or one holding `params`."""
    cfg = config.load(None, overrides)
    val = TokenDataset(data_dir, "val", SEQ)
    model = build_model(cfg.model, val.vocab_size, cfg.train.seed)
    if params is not None:
        model.load_state_dict(params)
    if windows is None:
        windows = eval_windows(len(val), cfg.train.eval_batches, cfg.train.global_batch_size)
    with torch.no_grad():
        return float(reference_loss(model, data_dir, val.batch(range(windows)))[0])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


RUN = {
    **SETTINGS,
    "train.steps": 2,
    "log.interval": 1,
    "train.eval_at_start": True,
    "checkpoint.save_final": True,
}


def test_train_and_eval_on_prepared_conversations_score_the_trained_targets(chat_dir, tmp_path):
    from strata.parallel.runtime import start
    from strata.trainer.jobs import evaluate_checkpoint, train

    overrides = tiny_overrides(chat_dir, tmp_path, **RUN)
    loss, want = reference_step(chat_dir, overrides)
    norm = torch.cat([g.flatten() for g in want.values()]).norm()
    train(config.load(None, overrides), start())
    records = _records(tmp_path / "t")
    step1 = next(r for r in records if r.get("step") == 1 and "loss" in r)
    assert step1["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-6)
    assert step1["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    at_start = next(r for r in records if "eval_loss" in r)
    assert at_start["step"] == 0
    assert at_start["eval_loss"] == pytest.approx(_eval_reference(chat_dir, overrides), abs=1e-6)

    # `strata eval` of the final checkpoint: the whole split, its trained targets and their bytes
    ckpt = tmp_path / "t" / "checkpoints"
    cfg = config.load(None, overrides)
    split = evaluate_checkpoint(cfg, start(), ckpt, [chat_dir])["splits"][str(chat_dir)]
    val = TokenDataset(chat_dir, "val", SEQ)
    whole = _eval_reference(chat_dir, overrides, final_params(ckpt, 2), len(val))
    assert split["loss"] == pytest.approx(whole, rel=1e-6, abs=1e-6)
    rows = [(val.window(i)[1:], val.loss_mask(i)[1:]) for i in range(len(val))]
    assert split["tokens"] == sum(int(trained.sum()) for _, trained in rows)
    tok, eot = Tokenizer.from_file(str(chat_dir / "tokenizer.json")), read_meta(chat_dir).raw["eot"]
    spelt = [tok.decode([int(t) for t in ids[trained] if t != eot]) for ids, trained in rows]
    assert split["bytes"] == sum(len(text.encode()) for text in spelt) > 0  # ASCII: additive


@pytest.mark.slow  # a world of 2 and one process
def test_a_dp2_run_on_prepared_conversations_logs_what_one_process_does(chat_dir, tmp_path):
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train

    settings = {**RUN, "train.steps": 3, "train.eval_interval": 3}
    train(config.load(None, tiny_overrides(chat_dir, tmp_path / "one", **settings)), start())
    train_run(chat_dir, tmp_path / "dp2", 2, **settings)
    one, two = _records(tmp_path / "one" / "t"), _records(tmp_path / "dp2" / "t")
    assert losses_from(tmp_path / "dp2" / "t").keys() == {1, 2, 3}
    for key in ("loss", "eval_loss"):
        a = {r["step"]: r[key] for r in one if key in r}
        b = {r["step"]: r[key] for r in two if key in r}
        assert a.keys() == b.keys() and a
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (key, step)


def test_a_global_batch_without_a_trained_target_is_refused(chat_dir, tmp_path):
    from strata.parallel.runtime import start
    from strata.trainer.loop import Trainer

    data = tmp_path / "data"
    shutil.copytree(chat_dir, data)
    np.zeros((data / mask_file("train")).stat().st_size, np.uint8).tofile(data / mask_file("train"))
    np.zeros((data / mask_file("val")).stat().st_size, np.uint8).tofile(data / mask_file("val"))
    trainer = Trainer(config.load(None, tiny_overrides(data, tmp_path, **SETTINGS)), start())
    with pytest.raises(DataError, match="no trained target"):
        trainer.evaluate()
    with pytest.raises(DataError, match="no trained target"):
        trainer.train_step()


def test_conversations_without_the_document_mask_are_warned_about(chat_dir, tmp_path):
    from strata.trainer.datasets import document_mask_warning, open_data

    plain = {**SETTINGS, "data.document_mask": False}
    cfg = config.load(None, tiny_overrides(chat_dir, tmp_path, **plain))
    warning = document_mask_warning(cfg, open_data(cfg, 0))
    assert warning is not None and "data.document_mask=true" in warning
    cfg = config.load(None, tiny_overrides(chat_dir, tmp_path, **SETTINGS))
    assert document_mask_warning(cfg, open_data(cfg, 0)) is None
    assert IGNORE_INDEX == -100  # the index the reference's cross-entropy ignores


def test_a_mixture_with_conversations_gives_every_row_a_mask(chat_dir, tmp_path):
    """A plain source blended with conversations: its rows have every target trained, so every
    step of the run takes the masked path on every rank."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 300}))
    (np.arange(4 * SEQ + 1) % 300).astype(np.uint16).tofile(plain / "train.bin")
    chat = TokenDataset(chat_dir, "train", SEQ)
    mix = Mixture([chat, TokenDataset(plain, "train", SEQ)], [1, 1], ["chat", "plain"], ["a", "b"])
    assert mix.has_mask and not mix.datasets[1].has_mask
    batch = mix.rows([(0, 3), (1, 2)])
    assert batch.mask is not None and batch.mask[1].all()
    assert torch.equal(batch.mask[0], torch.from_numpy(chat.loss_mask(3)[1:]))
    for step in MixtureLoader(mix, 0, 4, 2).next_step():
        assert step.mask is not None and step.mask.shape == step.targets.shape
