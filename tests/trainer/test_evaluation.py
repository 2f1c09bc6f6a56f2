"""The training loop's evaluation: by default the same first eval_batches × micro_batch_size × dp
sequences of the validation split at every evaluation; with train.eval_batches 0 every sequence of
the split once, whatever the layout. The reference is a plain pass of the saved model over every
validation window, and one process for the parallel layouts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from strata import config
from strata.data.loader import eval_batches
from strata.data.tokens import TokenDataset
from strata.model import build_model, lm_loss

from conftest import tiny_overrides
from worlds import REPO, _train_rank, final_params, run_world, strata, train_run, train_world


class Windows:
    """A split of `n` windows whose batch is the window indices."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def batch(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(idx)
        return t, t


@pytest.mark.parametrize("n, micro, dp", [(23, 2, 1), (23, 3, 2), (23, 2, 4), (5, 4, 4), (8, 2, 2)])
def test_the_whole_split_is_every_window_once_over_the_ranks(n, micro, dp):
    seen = [
        int(i)
        for r in range(dp)
        for inputs, _ in eval_batches(Windows(n), 0, micro, r, dp)
        for i in inputs
    ]
    assert sorted(seen) == list(range(n))
    for r in range(dp):
        assert all(0 < len(b[0]) <= micro for b in eval_batches(Windows(n), 0, micro, r, dp))


def test_the_default_reads_the_same_first_windows_every_time():
    first = [b[0].tolist() for b in eval_batches(Windows(100), 3, 2, 1, 2)]
    assert first == [[2, 3], [6, 7], [10, 11]]
    assert first == [b[0].tolist() for b in eval_batches(Windows(100), 3, 2, 1, 2)]


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
            float(lm_loss(model(x), y)) for x, y in (val.batch([i]) for i in range(len(val)))
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


@pytest.mark.slow  # a 1-process run and a world of 2
def test_whole_split_evaluation_under_expert_parallelism_does_not_hang(small_data_dir, tmp_path):
    # a split whose end leaves the second replica one micro-batch short: without padding its
    # experts' all-to-all would wait for a peer that never comes
    micro, dp = 8, 2
    seq = next(
        s for s in range(64, 129, 8) if 0 < len(TokenDataset(small_data_dir, "val", s)) % 16 <= 8
    )
    experiment = REPO / "configs" / "moe-tiny.yaml"
    settings = [
        f"data.path={small_data_dir}",
        f"model.seq_len={seq}",
        "train.steps=2",
        "train.eval_batches=0",
        "train.eval_at_start=true",
        f"train.micro_batch_size={micro}",
        "checkpoint.interval=0",
        "checkpoint.save_final=false",
        "log.progress=false",
        "log.name=t",
    ]
    runs = {}
    for name, nproc, extra in (("one", 1, []), ("ep2", dp, ["parallel.ep=2"])):
        root = tmp_path / name
        train_world([str(experiment), *settings, f"log.dir={root}", *extra], nproc, root)
        runs[name] = eval_losses(root / "t")
    assert runs["one"].keys() == runs["ep2"].keys() == {0, 2}
    for step, loss in runs["one"].items():
        assert runs["ep2"][step] == pytest.approx(loss, rel=1e-5), step
