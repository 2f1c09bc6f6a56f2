"""The training loop's evaluation: the same first eval_batches × global_batch_size sequences of the
validation split at every evaluation and every world size; with train.eval_batches 0 every sequence
of the split once, whatever the layout, `strata eval`'s too; the hang watchdog watching both. The
reference is a plain pass of the saved model over every validation window, or one process for the
parallel layouts."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from strata import config
from strata.data.loader import eval_batches, eval_windows
from strata.data.tokens import Batch, TokenDataset
from strata.model import build_model, lm_loss
from strata.net import free_port
from strata.parallel import watchdog

from conftest import tiny_overrides
from worlds import _train_rank, final_params, run_world, strata, train_run, worker_env


class Windows:
    """A split of `n` windows whose batch is the window indices."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def batch(self, idx: list[int]) -> Batch:
        t = torch.tensor(idx)
        return Batch(t, t)


@pytest.mark.parametrize("n, micro, dp", [(23, 2, 1), (23, 3, 2), (23, 2, 4), (5, 4, 4), (8, 2, 2)])
def test_the_whole_split_is_every_window_once_over_the_ranks(n, micro, dp):
    seen = [
        int(i)
        for r in range(dp)
        for batch in eval_batches(Windows(n), n, micro, r, dp)
        for i in batch.inputs
    ]
    assert sorted(seen) == list(range(n))
    for r in range(dp):
        assert all(0 < len(b) <= micro for b in eval_batches(Windows(n), n, micro, r, dp))


def test_the_default_reads_the_same_first_windows_at_every_dp_size():
    # 3 global batches of 8: the first 24 windows, whether 1, 2 or 4 ranks read them
    windows = eval_windows(100, 3, 8)
    for dp in (1, 2, 4):
        read = [
            b.inputs.tolist() for r in range(dp) for b in eval_batches(Windows(100), 24, 2, r, dp)
        ]
        assert sorted(i for batch in read for i in batch) == list(range(windows))
    first = [b.inputs.tolist() for b in eval_batches(Windows(100), windows, 2, 1, 2)]
    assert first[:3] == [[2, 3], [6, 7], [10, 11]] and len(first) == 6


def test_an_evaluation_arms_the_hang_watchdog_as_a_step_does():
    # `strata eval` takes no step: its evaluation micro-batches are what arm the watchdog
    store = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    dog = watchdog.Watchdog(store, "eval", 0, 1, hang_after_s=0.2)
    dog.check()
    time.sleep(0.3)
    assert dog.check() is None  # start-up: not armed yet
    watchdog.batch_done()
    dog.check()
    time.sleep(0.3)
    verdict = dog.check()
    assert (
        verdict is not None and "is busy outside any collective" in json.loads(verdict)["message"]
    )


def eval_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


SEQ = 40  # the split then has a number of windows the ranks' micro-batches do not divide
SETTINGS = {
    "train.eval_batches": 0,
    "train.eval_interval": 3,
    "train.eval_at_start": True,
    "checkpoint.save_final": True,
    "model.n_layers": 4,
    "model.seq_len": SEQ,
}


@pytest.mark.slow  # a 1-process run and a world of 4
def test_whole_split_evaluation_is_a_plain_pass_over_every_window_in_any_layout(
    small_data_dir, tmp_path
):
    out = train_run(small_data_dir, tmp_path / "one", 1, **SETTINGS)
    one = eval_losses(tmp_path / "one" / "t")
    cfg = config.load(
        None,
        [
            f"data.path={small_data_dir}",
            "model.n_layers=4",
            "model.d_model=32",
            "model.n_heads=4",
            f"model.seq_len={SEQ}",
        ],
    )
    val = TokenDataset(small_data_dir, "val", SEQ)
    params = final_params(tmp_path / "one" / "t" / "checkpoints")
    model = build_model(cfg.model, params["tok_embeddings.weight"].shape[0], seed=0).eval()
    model.load_state_dict(params)
    with torch.no_grad():
        per_window = [
            float(lm_loss(model(b.inputs), b.targets))
            for b in (val.batch([i]) for i in range(len(val)))
        ]
    assert one[6] == pytest.approx(sum(per_window) / len(per_window), rel=1e-5)
    # the baseline before the first step: an untrained model's loss is that of guessing among its outputs
    vocab = params["tok_embeddings.weight"].shape[0]
    assert sorted(one) == [0, 3, 6] and abs(one[0] - math.log(vocab)) < 0.05 < one[0] - one[6]
    assert f"on all {len(val)} sequences of the validation split" in out
    assert (
        len(val) % 4
    )  # the split's end leaves the last micro-batch short (and a replica without one)
    train_run(small_data_dir, tmp_path / "dp2-pp2", 4, **SETTINGS, **{"parallel.pp": 2})
    got = eval_losses(tmp_path / "dp2-pp2" / "t")
    assert got.keys() == one.keys()
    for step, loss in one.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step

    # `strata eval` on the run's checkpoint, in one process and as `strata launch --eval` of a tp2·dp2
    # world: the same numbers
    ckpt = tmp_path / "one" / "t" / "checkpoints"
    experiment = tmp_path / "one" / "e.yaml"
    experiment.write_text("{}\n")
    common = [
        "--resume",
        str(ckpt),
        "--data",
        str(small_data_dir),
        *tiny_overrides(small_data_dir, tmp_path / "ev"),
    ]
    common += ["model.n_layers=4", f"model.seq_len={SEQ}"]
    (tmp_path / "ranks-one").mkdir()
    codes = run_world(
        _train_rank,
        1,
        tmp_path / "ranks-one",
        ["eval", str(experiment), *common, "--out", str(tmp_path / "eval-one.json")],
        exit_codes=True,
    )
    assert codes == [0], (tmp_path / "ranks-one" / "rank0.out").read_text()[-3000:]
    launched = strata(
        "launch",
        str(experiment),
        *common,
        "parallel.tp=2",
        "--nproc",
        "4",
        "--eval",
        "--out",
        str(tmp_path / "eval-tp2-dp2.json"),
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "loss" in launched.stdout and "bits/byte" in launched.stdout  # rank 0's table
    for name in ("one", "tp2-dp2"):
        split = json.loads((tmp_path / f"eval-{name}.json").read_text())["splits"][
            str(small_data_dir)
        ]
        assert split["loss"] == pytest.approx(one[6], rel=1e-5), name
        assert split["sequences"] == len(val) and split["tokens"] == len(val) * SEQ
        # byte-level data: a byte a token, none for an end-of-document token
        spelt = sum(int((val.window(i)[1:] < 256).sum()) for i in range(len(val)))
        assert split["bytes"] == spelt
        assert split["bits_per_byte"] == pytest.approx(
            split["loss"] * split["tokens"] / math.log(2) / spelt
        )
        assert split["perplexity"] == pytest.approx(math.exp(split["loss"]))
    record = json.loads((tmp_path / "ev" / "t" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 6 and record["eval"][str(small_data_dir)]["loss"] == pytest.approx(
        one[6], rel=1e-5
    )


# --- every layout, every world size: the same sequences and loss -----------------------------------

# 713 validation windows: micro-batches of 4 leave the last one short, and a replica one short
LAYOUT_SEQ = 40
LAYOUT_SETTINGS = {
    "model.seq_len": LAYOUT_SEQ,
    "train.global_batch_size": 16,
    "train.micro_batch_size": 4,
    "train.eval_batches": 2,
    "train.steps": 3,
    "checkpoint.save_final": True,
    "parallel.timeout_s": 60,
    "parallel.hang_timeout_s": 10,
}
MOE = {
    "model.moe.num_experts": 4,
    "model.moe.top_k": 2,
    "model.moe.expert_ffn": 32,
}
LAYOUTS = {  # name: (ranks, overrides, the MoE model)
    "dp2": (2, [], False),
    "dp4": (4, [], False),
    "tp2-dp2": (4, ["parallel.tp=2"], False),
    "pp2-dp2": (4, ["parallel.pp=2"], False),
    "cp2-dp2": (4, ["parallel.cp=2"], False),  # dp counts the cp ranks: two replicas of two
    "ep2": (2, ["parallel.ep=2"], True),
}


def _evaluate_rank(
    rank: int,
    size: int,
    port: int,
    out_dir: str,
    overrides: list[str],
    ckpt: str,
    data: str,
    stall: bool = False,
) -> None:
    """One rank of a world that evaluates checkpoint `ckpt` as `strata eval` does (every sequence of
    `data`'s validation split: `jobs.evaluate_checkpoint`, under the hang watchdog) and as the
    training loop does (`Trainer.evaluate`: train.eval_batches global batches); with `stall`, rank
    1 stops in its fourth evaluation micro-batch."""
    from strata.parallel import runtime
    from strata.trainer.jobs import evaluate_checkpoint
    from strata.trainer.loop import Trainer
    from strata.trainer.parallelize import ParallelModel

    worker_env(rank, size, port)
    torch.set_num_threads(1)
    if stall and rank == 1:
        real, calls = ParallelModel.eval_loss, itertools.count()

        def eval_loss(self, batch):
            if next(calls) == 3:
                time.sleep(600)
            return real(self, batch)

        ParallelModel.eval_loss = eval_loss  # type: ignore[method-assign]
    cfg = config.load(None, overrides, world_size=size, local_world_size=size)
    rt = runtime.start("gloo", cfg.parallel.timeout_s)
    split = evaluate_checkpoint(cfg, rt, Path(ckpt), [Path(data)])["splits"][data]
    trainer = Trainer(cfg, rt, writes=[], saves=False)
    trainer.resume(Path(ckpt))
    batched = trainer.evaluate()
    result = {
        "whole": (split["loss"], split["sequences"]),
        "batched": (batched.loss, batched.sequences, batched.whole),
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    runtime.stop()


def _overrides(data_dir: Path, root: Path, moe: bool) -> list[str]:
    return tiny_overrides(data_dir, root, **LAYOUT_SETTINGS, **(MOE if moe else {}))


@pytest.fixture(scope="module")
def references(small_data_dir, tmp_path_factory) -> dict[bool, tuple[Path, dict]]:
    """For the dense and the MoE model: a checkpoint trained in one process, and one process's
    evaluations of it."""
    found = {}
    for moe in (False, True):
        root = tmp_path_factory.mktemp("moe" if moe else "dense")
        train_run(small_data_dir, root, 1, **LAYOUT_SETTINGS, **(MOE if moe else {}))
        ckpt = root / "t" / "checkpoints"
        (root / "one").mkdir()
        [one] = run_world(
            _evaluate_rank,
            1,
            root / "one",
            _overrides(small_data_dir, root / "ev", moe),
            str(ckpt),
            str(small_data_dir),
        )
        found[moe] = (ckpt, one)
    return found


@pytest.mark.slow  # a world of 2 or 4 ranks each (and, once, the references' training)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_evaluation_reads_the_same_sequences_in_every_layout_and_world_size(
    small_data_dir, tmp_path, references, layout
):
    ranks, extra, moe = LAYOUTS[layout]
    ckpt, one = references[moe]
    split = len(TokenDataset(small_data_dir, "val", LAYOUT_SEQ))
    micro_batches = -(-split // 4)
    assert split % 4 and micro_batches % 2  # a short last micro-batch, and a replica one short
    assert one["whole"][1] == split
    assert one["batched"][1:] == (2 * 16, False)  # eval_batches × global_batch_size, not × dp
    got = run_world(
        _evaluate_rank,
        ranks,
        tmp_path,
        [*_overrides(small_data_dir, tmp_path / "ev", moe), *extra],
        str(ckpt),
        str(small_data_dir),
        timeout_s=240,
        late="an evaluation hung",
    )
    for rank, result in enumerate(got):  # every rank reports the world's figures
        assert result["whole"][1] == split and result["batched"][1:] == one["batched"][1:], rank
        # data parallelism alone changes only which rank reads which micro-batch: the fp64 sums
        # agree to rounding; the other layouts compute in another order
        close = {"abs": 1e-6} if layout.startswith("dp") else {"rel": 1e-5}
        assert result["whole"][0] == pytest.approx(one["whole"][0], **close), rank
        assert result["batched"][0] == pytest.approx(one["batched"][0], **close), rank


@pytest.mark.slow  # a world of 2 that hangs on purpose until the watchdog ends it
def test_the_hang_watchdog_ends_a_strata_eval_that_hangs(small_data_dir, tmp_path, references):
    # `strata eval` takes no step, yet its watchdog must judge: rank 1 stops in an evaluation
    # micro-batch while rank 0 waits for it in the final all-reduce
    ckpt, _ = references[False]
    codes = run_world(
        _evaluate_rank,
        2,
        tmp_path,
        [*_overrides(small_data_dir, tmp_path / "ev", False), "parallel.hang_timeout_s=2"],
        str(ckpt),
        str(small_data_dir),
        True,
        timeout_s=45,
        exit_codes=True,
        late="the watchdog did not see the evaluation hang",
    )
    assert codes == [watchdog.HANG_EXIT] * 2, codes
