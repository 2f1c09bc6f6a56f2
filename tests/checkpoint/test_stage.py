"""What saves keep from one call to the next (the pieces of the training state, the views their
copy goes through, the staging plan) must never make a checkpoint or a snapshot hold stale bytes:
each is compared with the same state staged from scratch (`copy_pieces`, `model_pieces` +
`optimizer_pieces`) after values change in place, tensors are replaced or rebound, optimizer state
appears or is loaded, and the pieces change shape (a new plan)."""

from __future__ import annotations

import time

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.agent_protocol import agent_stats
from strata.checkpoint.manager import CheckpointManager
from strata.checkpoint.pieces import (
    FixedState,
    Piece,
    StateContents,
    _range_pieces,
    model_pieces,
    optimizer_entries,
    optimizer_pieces,
    whole_piece,
)
from strata.checkpoint.reader import Checkpoint
from strata.checkpoint.stage import (
    CHECK_GRAIN,
    StageCheck,
    copy_pieces,
    descriptors,
    image_views,
    plan_staging,
    stage,
)
from strata.checkpoint.write_plan import Descriptor
from strata.parallel.flat import Box
from strata.parallel.runtime import start
from strata.parallel.tensor import Placement
from strata.trainer.loop import Trainer

from conftest import tiny_config
from worlds import start_agents


def _flat_pieces(flat: torch.Tensor, key: str, shape: tuple[int, ...], start: int) -> list[Piece]:
    """Boxes of the range [start, start + flat.numel()) of a `shape` tensor (as ZeRO shards give)."""
    return _range_pieces(key, Placement(shape), shape, start, flat)


def state(seed: int) -> list[Piece]:
    g = torch.Generator().manual_seed(seed)
    out = _flat_pieces(
        torch.randn(12, generator=g), "model.w", (6, 7), 0
    )  # a whole row and a partial one
    out += _flat_pieces(
        torch.randn(30, generator=g), "model.w", (6, 7), 12
    )  # the rest: partial, whole rows
    out.append(whole_piece("model.b", torch.randn(9, generator=g)))
    out.append(Piece("optim.state.w.step", (), Box((), ()), torch.tensor(float(seed)).view(())))
    out.append(whole_piece("rng", torch.randint(0, 255, (40,), dtype=torch.uint8, generator=g)))
    return out


class Staged:
    """One plan's image, staged through the cached views, beside a reference staged from scratch."""

    def __init__(self, pieces: list[Piece]):
        self.plan = plan_staging([descriptors(pieces)], 0)
        self.image = torch.zeros(self.plan.nbytes, dtype=torch.uint8)
        self.views = image_views(self.image, self.plan.items)

    def stage(self, pieces: list[Piece], check_finite: bool = False) -> bool:
        return self.check(pieces, check_finite).finite

    def check(self, pieces: list[Piece], check_finite: bool = True, prefix: str = "") -> StageCheck:
        assert self.plan.sources.take(pieces)
        bounded = [bool(prefix) and it.key.startswith(prefix) for it in self.plan.items]
        return stage(self.views, self.plan.sources, check_finite, bounded)

    def reference(self, pieces: list[Piece]) -> torch.Tensor:
        out = torch.zeros_like(self.image)
        copy_pieces(out, self.plan.items, pieces)
        return out


def test_cached_views_follow_values_replaced_and_rebound_tensors():
    pieces = state(1)
    staged = Staged(pieces)
    staged.stage(pieces)
    assert torch.equal(staged.image, staged.reference(pieces))

    for p in pieces:  # in place, as every optimizer step does: the same views see the new values
        p.tensor.add_(1) if p.tensor.is_floating_point() else p.tensor.bitwise_xor_(0x5A)
    staged.stage(pieces)
    assert torch.equal(staged.image, staged.reference(pieces))

    fresh = state(
        2
    )  # new tensors (and Piece objects) with the same boxes: a resume's new optimizer state
    staged.stage(fresh)
    assert torch.equal(staged.image, staged.reference(fresh))

    fresh[-2].tensor.data = torch.tensor(-3.0).view(())  # the same Piece and tensor object, rebound
    fresh[0].tensor.data = torch.full_like(fresh[0].tensor, 7.0)
    staged.stage(fresh)
    assert torch.equal(staged.image, staged.reference(fresh))


def test_a_non_contiguous_piece_is_read_again_at_every_save():
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    pieces = [Piece("model.t", (4, 3), Box((0, 0), (4, 3)), base.t())]
    staged = Staged(pieces)
    staged.stage(pieces)
    base.mul_(-1)
    staged.stage(pieces)
    assert torch.equal(staged.image, staged.reference(pieces))
    it = staged.plan.items[0]
    data = staged.image[it.data_offset : it.data_offset + it.box.numel * 4].view(torch.float32)
    assert torch.equal(data.view(4, 3), -torch.arange(12, dtype=torch.float32).view(3, 4).t())


def test_pieces_that_no_longer_fit_the_plan_are_refused():
    pieces = state(1)
    staged = Staged(pieces)
    staged.stage(pieces)
    wider = state(1)
    wider[-3] = whole_piece("model.b", torch.randn(10))  # another shape
    assert not staged.plan.sources.take(wider)
    retyped = state(1)
    retyped[-3] = whole_piece("model.b", torch.randn(9, dtype=torch.float64))
    assert not staged.plan.sources.take(retyped)
    same_object = state(1)
    staged.stage(same_object)
    same_object[-3].tensor.data = torch.zeros(9, dtype=torch.float64)  # rebound to another dtype
    assert not staged.plan.sources.take(same_object)
    assert not staged.plan.sources.take(state(1)[:-1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finiteness_check_finds_any_non_finite_element_and_still_copies(bad):
    n = 2 * CHECK_GRAIN + 5  # several grains: the bad element in the last one
    pieces = [whole_piece("model.big", torch.randn(n)), *state(3)]
    staged = Staged(pieces)
    assert staged.stage(pieces, check_finite=True)
    pieces[0].tensor[-1] = bad
    assert not staged.stage(pieces, check_finite=True)
    assert torch.equal(staged.image, staged.reference(pieces))
    pieces[0].tensor[-1] = 0.0
    pieces[2].tensor[0] = bad  # a small piece after the big one
    assert not staged.stage(pieces, check_finite=True)
    assert staged.stage(pieces, check_finite=False)  # no check asked: nothing is judged


def test_the_largest_magnitude_is_measured_over_the_bounded_items_only():
    n = 2 * CHECK_GRAIN + 5
    big = torch.randn(n)
    pieces = [whole_piece("model.big", big), whole_piece("optim.m", torch.randn(n)), *state(3)]
    staged = Staged(pieces)
    model_items = [
        p.tensor for p in pieces if p.key.startswith("model.") and p.tensor.is_floating_point()
    ]
    expected = max(float(t.abs().max()) for t in model_items)
    assert staged.check(pieces, prefix="model.") == StageCheck(True, expected)
    big[-1] = -1e9  # in the last grain, negative
    assert staged.check(pieces, prefix="model.") == StageCheck(True, 1e9)
    pieces[1].tensor[0] = 5e9  # not bounded: not measured
    assert staged.check(pieces, prefix="model.").largest == 1e9
    assert staged.check(pieces, prefix="optim.").largest == 5e9
    assert staged.check(pieces, check_finite=False, prefix="model.") == StageCheck()
    big[3] = float("nan")  # not finite: no magnitude
    assert staged.check(pieces, prefix="model.") == StageCheck(False, 0.0)
    assert torch.equal(staged.image, staged.reference(pieces))


def test_finite_values_whose_sum_overflows_are_finite():
    huge = torch.full((2 * CHECK_GRAIN,), 3e38)  # every grain's float32 sum is inf
    pieces = [whole_piece("model.huge", huge), *state(3)]
    staged = Staged(pieces)
    assert staged.stage(pieces, check_finite=True)
    huge[-1] = float("nan")
    assert not staged.stage(pieces, check_finite=True)


def _uncached(trainer: Trainer) -> list[Piece]:
    m = trainer.model
    return model_pieces(m.engine, m.canonical) + optimizer_pieces(
        m.optimizer, optimizer_entries(m.engine, m.canonical)
    )


def _assert_same_pieces(cached: list[Piece], reference: list[Piece]) -> None:
    assert [Descriptor(p.key, p.global_shape, str(p.dtype), p.box) for p in cached] == [
        Descriptor(p.key, p.global_shape, str(p.dtype), p.box) for p in reference
    ]
    for a, b in zip(cached, reference):
        assert torch.equal(a.tensor, b.tensor), a.key
        assert a.tensor.data_ptr() == b.tensor.data_ptr(), (
            a.key
        )  # views of the live state, not copies


def test_cached_pieces_follow_the_state_through_steps_resumes_and_replaced_tensors(
    small_data_dir, tmp_path
):
    cfg = tiny_config(small_data_dir, tmp_path, **{"checkpoint.keep_last": 0})
    trainer = Trainer(cfg, start())
    pieces = trainer.state.contents(0).pieces[:-1]  # the RNG state is a new piece at every call
    assert not any(
        p.key.startswith("optim.") for p in pieces
    )  # no optimizer state before the first step
    _assert_same_pieces(pieces, _uncached(trainer))
    trainer.train_step()  # the optimizer state appears
    _assert_same_pieces(trainer.state.contents(1).pieces[:-1], _uncached(trainer))
    assert trainer.save()
    trainer.train_step()
    _assert_same_pieces(trainer.state.contents(2).pieces[:-1], _uncached(trainer))

    trainer.resume(store.step_dir(cfg.checkpoint_dir(), 1))  # new optimizer state tensors
    _assert_same_pieces(trainer.state.contents(1).pieces[:-1], _uncached(trainer))
    opt = trainer.model.optimizer
    param = next(p for p in opt.state if opt.state[p])
    opt.state[param]["exp_avg"] = (
        opt.state[param]["exp_avg"].clone() + 1
    )  # replaced by another tensor
    opt.state[param]["exp_avg_sq"].data = opt.state[param]["exp_avg_sq"].clone()  # rebound
    _assert_same_pieces(trainer.state.contents(1).pieces[:-1], _uncached(trainer))
    opt.state[param]["step"] = 3  # not a tensor: refused, as before any cache
    with pytest.raises(TypeError, match="checkpoints hold tensors"):
        trainer.state.contents(1)
    trainer.checkpoints.close()


@pytest.mark.slow  # a trainer with an asynchronous writer process: ~6 s
def test_saves_after_steps_and_a_resume_hold_the_live_state(small_data_dir, tmp_path):
    """Save, train, save; resume the first and train the same step again: its save must equal the
    second bit for bit (a cache still viewing the optimizer state from before the resume would
    save the old moments)."""
    cfg = tiny_config(
        small_data_dir, tmp_path, **{"checkpoint.keep_last": 0, "checkpoint.async": True}
    )
    trainer = Trainer(cfg, start())
    trainer.train_step()
    assert trainer.save()
    trainer.train_step()
    assert trainer.save()
    trainer.checkpoints.wait()
    root = cfg.checkpoint_dir()
    second = Checkpoint(store.step_dir(root, 2)).tensors("")
    live = {
        p.key: p.tensor.clone()
        for p in trainer.state.contents(2).pieces
        if not p.key.startswith("rng")
    }
    assert all(
        torch.equal(second[k], v) for k, v in live.items()
    )  # whole tensors in a world of one

    trainer.resume(store.step_dir(root, 1))
    trainer.train_step()
    assert trainer.step == 2
    store.discard_partial(store.step_dir(root, 2))  # saved again below
    assert trainer.save()
    trainer.checkpoints.close()
    again = Checkpoint(store.step_dir(root, 2)).tensors("")
    assert again.keys() == second.keys() and all(torch.equal(again[k], second[k]) for k in second)


def _fixed(pieces: list[Piece], step: int) -> FixedState:
    return FixedState(StateContents(pieces, {"trainer": {"step": step}}, {}, {"world": 1}))


@pytest.mark.parametrize(
    "async_save", [False, pytest.param(True, marks=pytest.mark.slow)]
)  # writer processes
def test_a_plan_change_between_saves_gets_a_new_image_and_the_old_plan_comes_back(
    tmp_path, async_save
):
    mgr = CheckpointManager(tmp_path, 0, 1, async_save=async_save, config_yaml="model: {}\n")
    states = {
        1: state(1),
        2: [whole_piece("model.w", torch.randn(4, 4)), whole_piece("model.c", torch.randn(3))],
    }
    states[3] = state(1)
    for p in states[3]:  # the first plan again, other values
        p.tensor.copy_(torch.full_like(p.tensor, 3))
    for step, pieces in states.items():
        assert mgr.save(step, _fixed(pieces, step))
        mgr.wait()
    mgr.close()
    for step, pieces in states.items():
        got = Checkpoint(store.step_dir(tmp_path, step)).tensors("")
        want: dict[str, torch.Tensor] = {}
        for p in pieces:
            t = want.setdefault(p.key, torch.zeros(p.global_shape, dtype=p.dtype))
            t[p.box.index()] = p.tensor
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), step


def test_a_non_finite_state_is_refused_before_anything_is_written(tmp_path):
    mgr = CheckpointManager(tmp_path, 0, 1, config_yaml="model: {}\n")
    pieces = state(1)
    assert mgr.save(1, _fixed(pieces, 1), finite_only=True)
    mgr.wait()
    pieces[0].tensor[0] = float("nan")
    assert not mgr.save(2, _fixed(pieces, 2), finite_only=True)
    assert mgr.save(3, _fixed(pieces, 3))  # not asked to check: saved as it is
    mgr.close()
    assert [p.name for p in store.committed(tmp_path)] == ["step_00000001", "step_00000003"]


# --- snapshots: the same caches, through a real agent -----------------------------------------


@pytest.fixture
def agent(tmp_path):
    directory = tmp_path / "sockets"
    directory.mkdir(mode=0o700)
    path = str(directory / "agent.sock")
    [proc] = start_agents([path], "ab" * 32)
    yield path
    proc.kill()
    proc.wait()


def _restored(manager, step: int) -> tuple[int, dict[str, torch.Tensor]]:
    """What a restart would restore, once the agent has placed (checksummed) snapshot `step`."""
    deadline = time.monotonic() + 20
    while agent_stats(manager.path)["placed_step"] < step:
        assert time.monotonic() < deadline, f"step {step} was not placed"
        time.sleep(0.01)
    found = manager.recover()
    assert found.checkpoint is not None, found.message
    return found.checkpoint.step, found.checkpoint.tensors("")


def _whole(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    want: dict[str, torch.Tensor] = {}
    for p in pieces:
        t = want.setdefault(p.key, torch.zeros(p.global_shape, dtype=p.dtype))
        t[p.box.index()] = p.tensor
    return want


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_snapshots_hold_the_live_state_through_changes_and_a_new_plan(agent):
    from strata.checkpoint.snapshot import SnapshotManager
    from strata.config import SnapshotConfig

    manager = SnapshotManager(
        SnapshotConfig(every_steps=1, m=0), 0, 1, None, env={"STRATA_SNAPSHOT_SOCKET": agent}
    )
    try:
        pieces = state(1)
        assert manager.save(1, _fixed(pieces, 1))
        step, got = _restored(manager, 1)
        assert step == 1 and _equal(got, _whole(pieces))
        for p in pieces:
            p.tensor.add_(2) if p.tensor.is_floating_point() else p.tensor.bitwise_xor_(0x33)
        assert manager.save(2, _fixed(pieces, 2))
        step, got = _restored(manager, 2)
        assert step == 2 and _equal(got, _whole(pieces))

        pieces = state(5)  # new tensors, same plan
        assert manager.save(3, _fixed(pieces, 3))
        step, got = _restored(manager, 3)
        assert step == 3 and _equal(got, _whole(pieces))

        other = [whole_piece("model.w", torch.randn(4, 4)), whole_piece("model.c", torch.randn(3))]
        assert not manager.save(
            4, _fixed(other, 4)
        )  # another plan: this one is skipped, the next plans
        step, got = _restored(manager, 3)
        assert step == 3 and _equal(got, _whole(pieces))
        assert manager.save(5, _fixed(other, 5))
        step, got = _restored(manager, 5)
        assert step == 5 and _equal(got, _whole(other))
        assert manager.stats()["skipped"] == 1
    finally:
        manager.close()


def test_snapshot_views_are_not_shared_between_slots(agent):
    """Each leased slot has its own views: a save into a slot mapped after the plan was made must
    not go through another slot's views."""
    from strata.checkpoint.snapshot import SnapshotManager
    from strata.config import SnapshotConfig

    manager = SnapshotManager(
        SnapshotConfig(every_steps=1, m=0), 0, 1, None, env={"STRATA_SNAPSHOT_SOCKET": agent}
    )
    try:
        pieces = state(1)
        for step in range(1, 6):  # 3 slots rotate (2 kept, 1 written)
            for p in pieces:
                if p.tensor.is_floating_point():
                    p.tensor.fill_(step)
            assert manager.save(step, _fixed(pieces, step))
            got_step, got = _restored(manager, step)
            assert got_step == step and _equal(got, _whole(pieces)), step
        assert len(manager._slots) == 3
    finally:
        manager.close()


def test_closing_commits_the_snapshot_in_flight(agent, tmp_path):
    from strata.checkpoint.snapshot import SnapshotManager
    from strata.config import SnapshotConfig

    cfg = SnapshotConfig(every_steps=1, m=0)
    env = {"STRATA_SNAPSHOT_SOCKET": agent}
    manager = SnapshotManager(cfg, 0, 1, None, env=env)
    pieces = state(7)
    assert manager.save(9, _fixed(pieces, 9))
    manager.close()
    again = SnapshotManager(cfg, 0, 1, None, env=env)
    try:
        step, got = _restored(again, 9)
        assert step == 9 and _equal(got, _whole(pieces))
    finally:
        again.close()


# --- on a GPU: device-to-host staging into the pinned image, finiteness on the device ---------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_gpu
def test_device_pieces_stage_into_a_pinned_image_as_host_copies_would():
    from strata.parallel.runtime import pin_host, unpin_host

    host = state(4)
    pieces = [Piece(p.key, p.global_shape, p.box, p.tensor.cuda()) for p in host[:-1]] + host[
        -1:
    ]  # RNG stays
    staged = Staged(pieces)
    pinned = pin_host(staged.image)
    try:
        assert staged.stage(pieces, check_finite=True)
        assert torch.equal(staged.image, staged.reference(host))
        for p in pieces[:-1]:
            p.tensor.mul_(3)  # on the device, in the training stream: the copy must wait for it
        assert staged.stage(pieces, check_finite=True)
        assert torch.equal(
            staged.image,
            staged.reference([Piece(p.key, p.global_shape, p.box, p.tensor.cpu()) for p in pieces]),
        )
        pieces[1].tensor[0] = float("inf")
        assert not staged.stage(pieces, check_finite=True)
    finally:
        if pinned:
            unpin_host(staged.image)


@pytest.mark.gpu
@needs_gpu
def test_a_gpu_run_saves_and_resumes_its_state_exactly(small_data_dir, tmp_path):
    cfg = tiny_config(
        small_data_dir, tmp_path, **{"checkpoint.keep_last": 0, "checkpoint.async": True}
    )
    trainer = Trainer(cfg, start())
    assert trainer.rt.device.type == "cuda"
    trainer.train_step()
    assert trainer.save()
    saved = {
        p.key: p.tensor.cpu()
        for p in trainer.state.contents(1).pieces
        if not p.key.startswith("rng")
    }
    trainer.train_step()
    trainer.checkpoints.wait()
    trainer.resume(store.step_dir(cfg.checkpoint_dir(), 1))
    now = {
        p.key: p.tensor.cpu()
        for p in trainer.state.contents(1).pieces
        if not p.key.startswith("rng")
    }
    trainer.checkpoints.close()
    assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved)
