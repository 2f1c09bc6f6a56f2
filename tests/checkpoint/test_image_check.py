"""The writer's checks of a staged image (`strata.checkpoint.image_check`) against torch's own
`isfinite` and `abs().max()`, for each dtype it reads; and a background save whose image fails them:
refused by its writer before it writes a byte, discarded on every rank (one rank's image failing is
enough), reported once, and the checkpoints committed before it kept."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from strata.checkpoint import image_check, store
from strata.checkpoint.image_check import Span
from strata.checkpoint.manager import CheckpointManager, MagnitudeBound
from strata.checkpoint.pieces import FixedState, StateContents, whole_piece
from strata.parallel import comm

from worlds import join_world, run_world

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def image_of(tensors: list[torch.Tensor]) -> tuple[memoryview, list[tuple[int, int, str]]]:
    """The tensors' bytes back to back, and each one's (offset, numel, dtype name)."""
    blobs, where, pos = [], [], 0
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        blobs.append(raw)
        where.append((pos, t.numel(), str(t.dtype).removeprefix("torch.")))
        pos += raw.numel()
    return memoryview(torch.cat(blobs).numpy().tobytes()), where


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_verdict_is_torchs_for_every_dtype_the_writer_reads(dtype, monkeypatch):
    monkeypatch.setattr(image_check, "CHUNK", 1000)  # several chunks per tensor
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(2500, generator=g) * 3).to(dtype)
    moments = (torch.randn(3100, generator=g) * 50).to(dtype)
    for case in ("clean", "large", "nan", "inf", "-inf in the unbounded"):
        w, m = weights.clone(), moments.clone()
        if case == "large":
            w[2400] = -60000.0 if dtype == torch.float16 else -1e9
        elif case == "nan":
            w[2499] = math.nan
        elif case == "inf":
            w[0] = math.inf
        elif case == "-inf in the unbounded":
            m[3099] = -math.inf
        image, (wat, mat) = image_of([w, m])
        spans = [Span(*wat, bounded=True), Span(*mat, bounded=False)]
        verdict = image_check.check(image, spans)
        finite = bool(torch.isfinite(w).all() and torch.isfinite(m).all())
        assert verdict.finite == finite, case
        assert verdict.largest == (float(w.float().abs().max()) if finite else 0.0), case


def test_float32_moments_whose_sum_overflows_are_finite():
    huge = torch.full((3000,), 3e38)
    image, (at,) = image_of([huge])
    assert image_check.check(image, [Span(*at, bounded=False)]).finite
    assert image_check.Verdict(True, 5.0).passes(4.0) is False
    assert image_check.Verdict(True, 5.0).passes(0.0) is True  # 0: no limit


def contents(step: int, weight: float, moment: float) -> FixedState:
    pieces = [
        whole_piece("model.w", torch.full((64, 48), weight)),
        whole_piece("optim.state.w.exp_avg", torch.full((64, 48), moment)),
    ]
    return FixedState(StateContents(pieces, {"trainer": {"step": step}}, {}, {"world": 1}))


def test_a_background_save_that_fails_the_writers_checks_is_discarded_and_reported(tmp_path):
    mgr = CheckpointManager(tmp_path, 0, 1, async_save=True, config_yaml="model: {}\n")
    bound = MagnitudeBound("model.", 100.0)
    try:
        assert mgr.save(1, contents(1, 1.0, 1.0), finite_only=True, bound=bound)
        mgr.wait()
        assert mgr.take_refused() is None
        # staged and returned at once: the writer refuses it
        assert mgr.save(2, contents(2, 1.0, math.nan), finite_only=True, bound=bound)
        mgr.wait()
        step, verdict = mgr.take_refused()
        assert step == 2 and not verdict.finite
        assert mgr.take_refused() is None  # reported once
        assert mgr.save(3, contents(3, -500.0, 1.0), finite_only=True, bound=bound)
        mgr.wait()
        assert mgr.take_refused() == (3, image_check.Verdict(True, 500.0))
        assert mgr.save(4, contents(4, 500.0, 1.0), finite_only=True)  # no bound: saved
        mgr.wait()
    finally:
        mgr.close()
    assert [store.marker(p)["step"] for p in store.committed(tmp_path)] == [1, 4]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and "lock" not in p.name]


def _one_rank_refuses(rank: int, size: int, port: int, out_dir: str) -> None:
    """Both ranks save their own half; at step 2 only rank 1's half holds a NaN."""
    join_world(rank, size, port)
    root = Path(out_dir) / "ckpts"
    mgr = CheckpointManager(
        root, rank, size, async_save=True, group=comm.new_gloo_group(), config_yaml="model: {}\n"
    )
    refused = []
    try:
        for step in (1, 2, 3):
            bad = math.nan if step == 2 and rank == 1 else 1.0
            t = torch.full((32, 8), bad)
            piece = whole_piece("model.w", t)
            piece = type(piece)(
                piece.key, (64, 8), type(piece.box)((32 * rank, 0), (32, 8)), piece.tensor
            )
            state = FixedState(
                StateContents([piece], {"trainer": {"step": step}}, {}, {"world": 2})
            )
            assert mgr.save(step, state, finite_only=True)
            mgr.wait()
            refused.append(mgr.take_refused())
    finally:
        mgr.close()
    torch.save(refused, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow  # a 2-process world with writer processes
def test_one_ranks_refused_image_discards_the_save_on_every_rank(tmp_path):
    ranks = run_world(_one_rank_refuses, 2, tmp_path)
    for refused in ranks:
        assert refused[0] is None and refused[2] is None
        assert refused[1] == (2, image_check.Verdict(False, 0.0))  # rank 0's image was fine
    root = tmp_path / "ckpts"
    assert [store.marker(p)["step"] for p in store.committed(root)] == [1, 3]
    assert not store.partial_dir(root, 2).exists()
