"""Resuming in another parallel layout: a run saves at step 3 under one (tp, pp, virtual stages,
dp, ZeRO) layout and continues from that checkpoint under another; its steps 4–6 must have the
1-process run's losses and end on its weights — the data loader going on at the same sample (no
sample repeated or skipped when dp changes), optimizer states included."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from strata import config
from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.model import GPT
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from conftest import tiny_config
from worlds import assert_same_params, final_params, losses_from, train_run

pytestmark = pytest.mark.slow  # each case saves in one world and resumes in another

SHARED = {
    "model.n_layers": 4,
    "log.interval": 1,
    "checkpoint.interval": 3,
    "checkpoint.save_final": True,
}
ZERO3 = {f"zero.{k}.shard_over": "global" for k in ("params", "grads", "optim")}
ONE = (1, {})
CASES = {  # name: (saved by (processes, settings), resumed by (processes, settings))
    "tp2-pp2-dp2-to-one-process": ((8, {"parallel.tp": 2, "parallel.pp": 2}), ONE),
    "one-process-to-tp2-pp2": (ONE, (4, {"parallel.tp": 2, "parallel.pp": 2})),
    "dp2-zero3-to-dp4-zero1": ((2, ZERO3), (4, {"zero.optim.shard_over": "global"})),
    "pp2-v2-to-pp4": (
        (2, {"parallel.pp": 2, "parallel.virtual_stages": 2}),
        (4, {"parallel.pp": 4}),
    ),
}


def train(small_data_dir, root, nproc: int, settings: dict, resume=None) -> dict[int, float]:
    if nproc == 1:
        return run(
            tiny_config(small_data_dir, root, **SHARED, **settings), start(), resume=resume
        ).losses
    train_run(
        small_data_dir,
        root,
        nproc,
        *(["--resume", str(resume)] if resume else []),
        **SHARED,
        **settings,
    )
    return losses_from(root / "t")


@pytest.fixture(scope="module")
def reference(small_data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    losses = train(small_data_dir, root, *ONE)
    step3 = Checkpoint(store.step_dir(root / "t" / "checkpoints", 3)).tensors("model.")
    return losses, final_params(root / "t" / "checkpoints"), step3


def weights_by_dcp_alone(ckpt_dir) -> dict[str, torch.Tensor]:
    """A plain GPT's state_dict filled by torch.distributed.checkpoint.load (no Strata code reads)."""
    cfg = config.load(ckpt_dir / "config.yaml")
    vocab = json.loads((ckpt_dir / "index.json").read_text())["tensors"][
        "model.tok_embeddings.weight"
    ]["shape"][0]
    model = GPT(cfg.model, vocab)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt_dir))
    model.load_state_dict(state["model"])
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(CASES))
def test_resume_in_another_layout_continues_the_run(small_data_dir, tmp_path, reference, name):
    """Also: the saved checkpoint (each rank wrote its own boxes) is read by torch.distributed.checkpoint
    alone into a plain model, with the 1-process run's weights."""
    (src_n, src), (dst_n, dst) = CASES[name]
    want_losses, want_params, reference_step3 = reference
    train(small_data_dir, tmp_path / "saved", src_n, src)
    step3 = store.step_dir(tmp_path / "saved" / "t" / "checkpoints", 3)
    assert_same_params(weights_by_dcp_alone(step3), reference_step3)
    resumed = train(small_data_dir, tmp_path / "resumed", dst_n, dst, resume=step3)
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(want_losses[step], rel=1e-5, abs=1e-6), step
    assert_same_params(final_params(tmp_path / "resumed" / "t" / "checkpoints"), want_params)


def test_offline_reshard_rewrites_every_tensor_exactly_one_file_per_target_rank(
    small_data_dir, tmp_path
):
    """`strata ckpt reshard DIR OUT --to tp=2,pp=2` (4 processes started by the command): the same
    parameters and optimizer states, bit for bit, now saved by the four ranks of the new layout."""
    from worlds import strata

    train(small_data_dir, tmp_path / "src", 1, {"train.steps": 3})
    src = store.step_dir(tmp_path / "src" / "t" / "checkpoints", 3)
    proc = strata("ckpt", "reshard", str(src), str(tmp_path / "out"), "--to", "tp=2,pp=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = store.step_dir(tmp_path / "out", 3)
    assert sorted(p.name for p in out.glob("__*_0.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert json.loads((out / "index.json").read_text())["layout"]["tp"] == 2
    before, after = Checkpoint(src).tensors(""), Checkpoint(out).tensors("")
    state = [k for k in before if not k.startswith("rng.")]
    assert state and all(torch.equal(before[k], after[k]) for k in state)
    assert "wrote" in proc.stdout
