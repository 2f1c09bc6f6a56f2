"""Parallel layouts in real gloo worlds, each rank running `strata train` with torchrun's worker
environment (`worlds.train_run`), each checked against the 1-process run with the same global
batch after 6 optimizer steps: every step's loss, and every parameter of the final checkpoint
(saved in the global layout)."""

from __future__ import annotations

import json

import pytest

from strata.checkpoint import store
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from conftest import tiny_config
from worlds import COMMON, ZERO3, assert_same_params, final_params, losses_from, train_run

pytestmark = pytest.mark.slow  # each case is a world of 2-8 processes

# Layouts whose step-3 checkpoint is also resumed by one process (a different layout) for steps 4–6.
RESUMED_ELSEWHERE = {
    "tp2-pp2-sp-tied",
    "pp2-zbv-tied",
    "zero3-dp2-accumulate",
    "zero3-pp2-v2-dp2-tied",
}

# name: (processes, parallel settings, model/batch settings shared with the reference)
LAYOUTS = {
    "dp2-accumulate": (2, {}, {"train.micro_batch_size": 2}),
    "dp2-two-nodes": (2, {"parallel.ranks_per_node": 1}, {"train.micro_batch_size": 4}),
    "tp2-gqa-tied": (2, {"parallel.tp": 2}, {"model.n_kv_heads": 2, "model.tie_embeddings": True}),
    "tp2-dp2": (4, {"parallel.tp": 2}, {}),
    "pp2-v2": (2, {"parallel.pp": 2, "parallel.virtual_stages": 2}, {"model.n_layers": 4}),
    "pp4-v2": (4, {"parallel.pp": 4, "parallel.virtual_stages": 2}, {"model.n_layers": 8}),
    "pp2-gpipe-tied": (
        2,
        {"parallel.pp": 2, "parallel.schedule": "gpipe"},
        {"model.tie_embeddings": True},
    ),
    "pp2-zbv-tied": (
        2,
        {"parallel.pp": 2, "parallel.virtual_stages": 2, "parallel.schedule": "zbv_zero_bubble"},
        {"model.n_layers": 4, "model.tie_embeddings": True},
    ),
    "pp2-v2-looped-bfs": (
        2,
        {"parallel.pp": 2, "parallel.virtual_stages": 2, "parallel.schedule": "looped_bfs"},
        {"model.n_layers": 4},
    ),
    "pp2-v2-zero-bubble": (
        2,
        {
            "parallel.pp": 2,
            "parallel.virtual_stages": 2,
            "parallel.schedule": "interleaved_zero_bubble",
        },
        {"model.n_layers": 4},
    ),
    "pp2-dualpipev": (
        2,
        {"parallel.pp": 2, "parallel.virtual_stages": 2, "parallel.schedule": "dualpipev"},
        {"model.n_layers": 4},
    ),
    "tp2-pp2-sp-tied": (
        4,
        {"parallel.tp": 2, "parallel.pp": 2, "parallel.sequence_parallel": True},
        {"model.tie_embeddings": True},
    ),
    "pp2-dp2": (4, {"parallel.pp": 2}, {}),
    "tp2-pp2-dp2": (8, {"parallel.tp": 2, "parallel.pp": 2}, {}),
    # the ZeRO engine (tests/parallel/test_zero.py checks its schemes one by one on 8 ranks)
    "zero1-dp2": (2, {"zero.optim.shard_over": "global"}, {"train.micro_batch_size": 4}),
    "zero3-dp2-accumulate": (2, ZERO3, {"train.micro_batch_size": 2}),
    "hpz-dp4-two-nodes": (
        4,
        {**ZERO3, "zero.secondary_params.shard_over": "node", "parallel.ranks_per_node": 2},
        {"train.micro_batch_size": 1},
    ),
    "zero3-pp2-v2-dp2-tied": (
        4,
        {**ZERO3, "parallel.pp": 2, "parallel.virtual_stages": 2, "zero.prefetch_blocks": 2},
        {"model.n_layers": 4, "model.tie_embeddings": True},
    ),
    "zero3-tp2-pp2-dp2": (
        8,
        {**ZERO3, "parallel.tp": 2, "parallel.pp": 2, "parallel.sequence_parallel": True},
        {},
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layout_matches_single_process(small_data_dir, tmp_path, name):
    nproc, parallel, shared = LAYOUTS[name]
    reference_cfg = tiny_config(small_data_dir, tmp_path / "ref", **COMMON, **shared)
    reference = run(reference_cfg, start())

    output = train_run(small_data_dir, tmp_path / "par", nproc, **COMMON, **shared, **parallel)
    tp, pp = parallel.get("parallel.tp", 1), parallel.get("parallel.pp", 1)
    assert f"world {nproc} (tp {tp}, pp {pp}, dp {nproc // (tp * pp)})" in output

    par_losses = losses_from(tmp_path / "par" / "t")
    assert sorted(par_losses) == sorted(reference.losses)
    for step, loss in reference.losses.items():
        assert par_losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    ref_params = final_params(reference_cfg.checkpoint_dir())
    assert_same_params(final_params(tmp_path / "par" / "t" / "checkpoints"), ref_params)

    if name in RESUMED_ELSEWHERE:  # the global-layout checkpoint of step 3 continues on 1 process
        resumed_cfg = tiny_config(small_data_dir, tmp_path / "resumed", **COMMON, **shared)
        resumed = run(
            resumed_cfg, start(), resume=store.step_dir(tmp_path / "par" / "t" / "checkpoints", 3)
        )
        assert sorted(resumed.losses) == [4, 5, 6]
        for step, loss in resumed.losses.items():
            assert loss == pytest.approx(reference.losses[step], rel=1e-5, abs=1e-6), step
        assert_same_params(final_params(resumed_cfg.checkpoint_dir()), ref_params)

    if tp == 1 and pp == 1 and not any(key.startswith("zero.") for key in parallel):
        # The bucketed all-reduce moved every gradient once per step (fp32), plus one scalar loss per
        # step and, per evaluation (steps 3 and 6), its loss sum and sequence count (two float64).
        n_params = sum(t.numel() for t in ref_params.values())
        summary = json.loads((tmp_path / "par" / "t" / "summary.json").read_text())
        payload = 6 * (4 * n_params + 4) + 2 * 16
        assert summary["comm_bytes"]["dp/all_reduce"] == payload
        # On the wire a 2-rank ring all-reduce sends 2·(n−1)/n = 1× the payload, over the link the
        # dp group spans: one node by default (torchrun's LOCAL_WORLD_SIZE = 2), two nodes when
        # the topology says one rank per node.
        link = "inter-node" if parallel.get("parallel.ranks_per_node") == 1 else "intra-node"
        assert summary["wire_bytes"] == {link: payload}
