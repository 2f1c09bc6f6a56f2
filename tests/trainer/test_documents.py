"""Packed documents (`data.document_mask`, `data.reset_positions`): a sequence holding several documents
attends only inside each, with rotary positions restarting at each, so its per-token losses are those
of each document run on its own; trained through `strata train` with the sequence split over
context-parallel ranks (all-to-all or ring attention) or the layers over interleaved pipeline stages,
the run equals one process's (training and evaluation losses, final weights); and data without a
recorded end-of-document token is one clear error at start-up."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from strata.config import ModelConfig
from strata.data.prepare import prepare
from strata.model import build_model, documents_of

from conftest import run_cli, tiny_overrides
from worlds import final_params, losses_from, train_run

EOT = 7
CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, seq_len=24, vocab_size=16)


def packed() -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Two sequences of 24 tokens, each several documents ending with EOT (the last one cut off by
    the window), and every document's (start, end) span in the first."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(8, 16, (2, CFG.seq_len + 1), generator=g)
    for row, ends in ((0, (4, 5, 12, 19)), (1, (9, 17))):
        tokens[row, list(ends)] = EOT
    spans, start = [], 0
    for end in (4, 5, 12, 19, CFG.seq_len - 1):
        spans.append((start, end + 1))
        start = end + 1
    return tokens, spans


def token_losses(model, tokens: torch.Tensor, documents=None) -> torch.Tensor:
    logits = model(tokens[:, :-1], documents) if documents is not None else model(tokens[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")


def test_a_packed_sequence_scores_each_document_as_if_alone():
    model = build_model(CFG, 16, seed=0).eval()
    tokens, spans = packed()
    with torch.no_grad():
        got = token_losses(model, tokens, documents_of(tokens[:, :-1], EOT, True, True))[0]
        for start, end in spans:
            alone = token_losses(model, tokens[:1, start : end + 1])[
                0
            ]  # the document, and the next token as target
            torch.testing.assert_close(got[start:end], alone, rtol=1e-5, atol=1e-6)
        total = sum(token_losses(model, tokens[:1, s : e + 1])[0].sum() for s, e in spans)
        torch.testing.assert_close(got.sum(), total, rtol=1e-5, atol=1e-5)


def test_the_mask_and_the_positions_each_change_what_plain_attention_computes():
    model = build_model(CFG, 16, seed=0).eval()
    tokens, spans = packed()
    x = tokens[:, :-1]
    with torch.no_grad():
        plain = model(x)
        masked = model(x, documents_of(x, EOT, True, False))
        moved = model(x, documents_of(x, EOT, False, True))
    first = spans[0][1]
    torch.testing.assert_close(
        masked[0, :first], plain[0, :first]
    )  # the first document sees nothing else anyway
    assert (masked[0, first:] - plain[0, first:]).abs().max() > 1e-3
    # rotary attention sees relative positions: restarting them moves only what crosses a boundary
    torch.testing.assert_close(moved[0, :first], plain[0, :first])
    assert (moved[0, first:] - plain[0, first:]).abs().max() > 1e-5


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A prepared byte-level corpus of many short documents: a 32-token window holds several."""
    src = tmp_path_factory.mktemp("docs-src")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "pi", "rho", "x", "omega"]
    for i in range(400):
        (src / f"d{i:03d}.txt").write_text(
            " ".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
        )
    out = tmp_path_factory.mktemp("docs") / "prepared"
    prepare(sorted(src.iterdir()), out, val_fraction=0.2, root=src)
    return out


SETTINGS = {
    "log.interval": 1,
    "checkpoint.save_final": True,
    "train.eval_interval": 3,
    "data.document_mask": True,
    "data.reset_positions": True,
}
LAYOUTS = {
    "cp2-alltoall": {"parallel.cp": 2, "parallel.cp_mode": "alltoall"},
    "cp2-ring": {"parallel.cp": 2, "parallel.cp_mode": "ring"},
    "pp2-interleaved": {"parallel.pp": 2, "parallel.virtual_stages": 2, "model.n_layers": 4},
    "pp2-zbv": {
        "parallel.pp": 2,
        "parallel.virtual_stages": 2,
        "parallel.schedule": "zbv_zero_bubble",
        "model.n_layers": 4,
    },
    "cp2-ring-pp2": {
        "parallel.cp": 2,
        "parallel.cp_mode": "ring",
        "parallel.pp": 2,
        "model.n_layers": 4,
    },
}


def eval_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


@pytest.fixture(scope="module")
def one_process(short_documents, tmp_path_factory):
    """One process's run on packed documents, for each model depth the layouts use."""
    runs = {}
    for layers in (2, 4):
        root = tmp_path_factory.mktemp(f"one{layers}")
        train_run(short_documents, root, 1, **SETTINGS, **{"model.n_layers": layers})
        runs[layers] = root / "t"
    return runs


@pytest.mark.slow  # worlds of 2 and 4 processes
@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_on_packed_documents_split_over_ranks_matches_one_process(
    short_documents, one_process, tmp_path, layout
):
    meta = json.loads((short_documents / "meta.json").read_text())
    assert meta["eot"] == 256 and meta["documents"] >= 300
    settings = {**SETTINGS, **LAYOUTS[layout]}
    train_run(
        short_documents,
        tmp_path,
        settings.get("parallel.cp", 1) * settings.get("parallel.pp", 1),
        **settings,
    )
    ref = one_process[settings.get("model.n_layers", 2)]
    losses, ref_losses = losses_from(tmp_path / "t"), losses_from(ref)
    assert losses.keys() == ref_losses.keys()
    for step, loss in ref_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    evals, ref_evals = eval_losses(tmp_path / "t"), eval_losses(ref)
    assert ref_evals and evals.keys() == ref_evals.keys()
    for step, loss in ref_evals.items():
        assert evals[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    params, ref_params = (
        final_params(tmp_path / "t" / "checkpoints"),
        final_params(ref / "checkpoints"),
    )
    for key, want in ref_params.items():
        torch.testing.assert_close(params[key], want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_document_masks_change_the_run(short_documents, one_process, tmp_path):
    train_run(short_documents, tmp_path, 1, **{"log.interval": 1})
    plain, masked = losses_from(tmp_path / "t"), losses_from(one_process[2])
    assert any(abs(plain[s] - masked[s]) > 1e-4 for s in plain if s > 1)


def test_data_without_a_recorded_end_of_document_token_is_refused(small_data_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for f in small_data_dir.iterdir():
        (data / f.name).write_bytes(f.read_bytes())
    meta = json.loads((data / "meta.json").read_text())
    del meta["eot"]
    (data / "meta.json").write_text(json.dumps(meta))
    experiment = tmp_path / "e.yaml"
    experiment.write_text("{}\n")
    overrides = tiny_overrides(data, tmp_path, **{"data.document_mask": True})
    code, out = run_cli(["train", str(experiment), *overrides], capsys)
    assert code == 2 and 'need the end-of-document token id as "eot" in meta.json' in out, out
