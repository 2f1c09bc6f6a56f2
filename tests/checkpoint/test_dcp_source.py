"""Checkpoints that torch.distributed.checkpoint wrote alone: a 2-process FSDP2 job (Strata's plain GPT
sharded with fully_shard, a torch AdamW) saves with `dcp.save({"model": get_model_state_dict(...),
"optimizer": get_optimizer_state_dict(...)})`. Strata resumes from that directory in one process with
exactly the FSDP2 run's weights and Adam moments (DCP's own dcp_to_torch_save is the reference), and
trains on alike in one process and in tp2. A directory whose tensors match no parameter is one clear
error listing them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint

from conftest import tiny_overrides
from worlds import strata, torchrun, train_world

pytestmark = pytest.mark.slow  # torchrun worlds (FSDP2, then Strata)

MODEL = {
    "model.n_layers": 2,
    "model.d_model": 32,
    "model.n_heads": 4,
    "model.seq_len": 32,
    "model.vocab_size": 320,
}

FSDP2_JOB = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from strata import config
    from strata.model import build_model

    dist.init_process_group("gloo")
    cfg = config.load(None, sys.argv[2:])
    model = build_model(cfg.model, cfg.model.vocab_size, seed=1)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(dist.get_rank())
    for _ in range(3):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=sys.argv[1])
    dist.barrier()  # a rank tearing gloo down while its peer still uses it aborts the peer
    dist.destroy_process_group()
    """
)


def _model_overrides() -> list[str]:
    return [f"{k}={v}" for k, v in MODEL.items()]


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    """The FSDP2 job's DCP directory, and its whole state as DCP itself reads it back."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    script = tmp / "job.py"
    script.write_text(FSDP2_JOB)
    ckpt = tmp / "dcp"
    proc = torchrun(str(script), str(ckpt), *_model_overrides())
    assert proc.returncode == 0, proc.stderr[-4000:]
    dcp_to_torch_save(ckpt, tmp / "whole.pt")
    return ckpt, torch.load(tmp / "whole.pt", weights_only=False)  # written just now by DCP itself


def test_strata_resumes_an_fsdp2_checkpoint_with_its_weights_and_adam_state(
    fsdp2_checkpoint, tmp_path
):
    ckpt, whole = fsdp2_checkpoint
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    out = tmp_path / "rewritten"
    proc = strata(
        "train", str(experiment), *_model_overrides(), "--resume", str(ckpt), "--save-to", str(out)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = Checkpoint(store.step_dir(out, 0)).tensors("")
    for name, value in whole["model"].items():
        assert torch.equal(got[f"model.{name}"], value), name
    for name, state in whole["optimizer"]["state"].items():
        for kind, value in state.items():
            assert torch.equal(got[f"optim.state.{name}.{kind}"].to(value.dtype), value), (
                f"{name}.{kind}"
            )


def test_training_on_from_an_fsdp2_checkpoint_in_tp2_matches_one_process(
    fsdp2_checkpoint, small_data_dir, tmp_path
):
    ckpt, _ = fsdp2_checkpoint
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    settings = {**MODEL, "train.steps": 3, "log.interval": 1}
    one = strata(
        "train",
        str(experiment),
        *tiny_overrides(small_data_dir, tmp_path / "one", **settings),
        "--resume",
        str(ckpt),
    )
    assert one.returncode == 0, one.stderr[-4000:]
    assert (
        "a checkpoint DCP wrote alone: Adam state taken from the checkpoint"
        in one.stdout + one.stderr
    )
    tp2 = [
        str(experiment),
        *tiny_overrides(small_data_dir, tmp_path / "tp2", **settings, **{"parallel.tp": 2}),
    ]
    train_world([*tp2, "--resume", str(ckpt)], 2, tmp_path / "tp2")
    import json

    def losses(root: Path) -> dict[int, float]:
        lines = (root / "t" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

    want, got = losses(tmp_path / "one"), losses(tmp_path / "tp2")
    assert want.keys() == got.keys() == {1, 2, 3}
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


def test_a_dcp_checkpoint_of_another_model_is_one_error_listing_its_keys(tmp_path):
    import torch.distributed.checkpoint as dcp

    foreign = tmp_path / "foreign"
    dcp.save(
        {"model": {"encoder.weight": torch.zeros(4, 4), "decoder.bias": torch.zeros(4)}},
        checkpoint_id=foreign,
        no_dist=True,
    )
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    proc = strata(
        "train",
        str(experiment),
        *_model_overrides(),
        "--resume",
        str(foreign),
        "--save-to",
        str(tmp_path / "o"),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert (
        "tensors that match no parameter of this model: model.decoder.bias, model.encoder.weight"
        in proc.stderr
    )
    assert "no weights for tok_embeddings.weight" in proc.stderr
