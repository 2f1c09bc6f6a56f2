"""CO2 (parallel/co2.py) in real gloo worlds of 2 and 4 forked processes: synchronous CO2 with one
local step is data parallelism (checked against a single-process reference), the asynchronous
outer all-reduce overlaps the next round's steps (a simulated slow link makes it measurable), its
average reaches the anchor one round late while each replica keeps its own progress, shrunk by
the staleness gap penalty (checked against the deltas each rank reported), the momentum clip
really clips, and a checkpoint taken mid-round with a reduction in flight resumes exactly.

Each world runs all its cases once (process start-up dominates) and each rank saves what it saw.
"""

from __future__ import annotations

import io
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from strata.parallel import comm
from strata.parallel.co2 import CO2
from strata.parallel.topology import Layout, build_topology

from worlds import join_world, run_world

SEED = 3
BATCH = 4  # samples per rank per step
STEPS = 6
LR, MOMENTUM, WD = 0.1, 0.9, 0.01
DELAY_S = 0.6  # simulated inter-node time of the overlap case's outer all-reduce
WORLD_TIMEOUT_S = 60


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 1))


def global_batch(step: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED * 1000 + step)
    return torch.randn(replicas * BATCH, 8, generator=gen), torch.randn(
        replicas * BATCH, 1, generator=gen
    )


def local_grads(model: nn.Module, step: int, rank: int, replicas: int) -> None:
    x, y = global_batch(step, replicas)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()


def sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# --- what each rank runs ---------------------------------------------------------------------------


def _sync_case(rank: int, size: int, inner_group, outer_group) -> torch.Tensor:
    """Synchronous CO2, H = 1, α = 1, β = 0 around SGD; grads averaged over inner_group first."""
    model = make_model()
    opt = sgd(model)
    co2 = CO2(
        list(model.parameters()),
        outer_group,
        outer_every=1,
        outer_lr=1.0,
        outer_momentum=0.0,
        staleness_penalty=0.0,
        clip=None,
        overlap=False,
    )
    inner = 1 if inner_group is None else dist.get_world_size(inner_group)
    for step in range(STEPS):
        local_grads(model, step, rank, size)
        for p in model.parameters():
            comm.all_reduce(p.grad, inner_group, dim="dp")
            p.grad.div_(inner)
        opt.step()
        co2.after_local_step()
    return flat(model)


def _late_case(rank: int, size: int, group, penalty: float) -> dict:
    """Asynchronous CO2, H = 2: each round's local progress, and the anchor and the parameters
    after each round."""
    model = make_model()
    opt = sgd(model)
    co2 = CO2(
        list(model.parameters()),
        group,
        outer_every=2,
        outer_lr=1.0,
        outer_momentum=0.0,
        staleness_penalty=penalty,
        clip=None,
    )
    x0, deltas, anchors, after = flat(model), [], [], []
    for step in range(STEPS):
        local_grads(model, step, rank, size)
        opt.step()
        if (step + 1) % co2.every == 0:
            deltas.append(co2.start - flat(model))
        co2.after_local_step()
        if (step + 1) % co2.every == 0:
            anchors.append(co2.anchor.clone())
            after.append(flat(model))
    co2.finish()  # no reduction left in flight when the world is torn down
    return {"x0": x0, "deltas": deltas, "anchors": anchors, "after": after}


def _overlap_case(rank: int, size: int, overlap: bool) -> dict:
    """Round ends under a slow outer link: how long each takes and whether work is in flight."""
    group = dist.new_group(list(range(size)))
    comm.register_group(group, "inter-node")
    model = make_model()
    n_bytes = 4 * sum(p.numel() for p in model.parameters())
    comm.set_link_delay("inter-node", DELAY_S / (2 * (size - 1) / size * n_bytes))
    opt = sgd(model)
    co2 = CO2(list(model.parameters()), group, outer_every=3, overlap=overlap)
    out = {"round_s": [], "in_flight_after": [], "completed_after": [], "steps_in_flight": 0}
    try:
        for step in range(9):
            if co2.in_flight and not co2.pending[0].is_completed():
                out["steps_in_flight"] += 1
            local_grads(model, step, rank, size)
            opt.step()
            t = time.monotonic()
            co2.after_local_step()
            if (step + 1) % 3 == 0:
                out["round_s"].append(time.monotonic() - t)
                out["in_flight_after"].append(co2.in_flight)
                out["completed_after"].append(
                    co2.pending[0].is_completed() if co2.in_flight else None
                )
        co2.finish()
    finally:
        comm.set_link_delay("inter-node", 0)
    return out


RESUME_STEPS, RESUME_AT = (
    9,
    5,
)  # H = 2: rounds end at 2, 4, 6, 8; step 5 is mid-round with round 2's delta in flight


def _resume_co2(model: nn.Module, group) -> CO2:
    return CO2(
        list(model.parameters()),
        group,
        outer_every=2,
        outer_lr=0.8,
        outer_momentum=0.5,
        staleness_penalty=0.5,
        clip=0.05,
    )


def _train(model, opt, co2, rank, size, steps) -> None:
    for step in steps:
        local_grads(model, step, rank, size)
        opt.step()
        co2.after_local_step()


def _resume_case(rank: int, size: int, group) -> dict:
    """The same run three ways: uninterrupted; saving a checkpoint at RESUME_AT and going on;
    restoring that checkpoint into a fresh model, optimizer and CO2 and going on. Parameters
    after the last step and after finish() (which also exchanges the partial last round)."""
    out = {}
    model = make_model()
    opt, co2 = sgd(model), _resume_co2(model, group)
    _train(model, opt, co2, rank, size, range(RESUME_STEPS))
    out["plain"] = flat(model)
    co2.finish()
    out["plain-final"] = flat(model)

    model = make_model()
    opt, co2 = sgd(model), _resume_co2(model, group)
    _train(model, opt, co2, rank, size, range(RESUME_AT))
    out["in_flight_at_save"] = co2.in_flight
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "co2": co2.state_dict()}, buf)
    _train(model, opt, co2, rank, size, range(RESUME_AT, RESUME_STEPS))
    out["saved-and-went-on"] = flat(model)
    co2.finish()

    torch.manual_seed(SEED + 1)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 1))  # other initial values
    opt, co2 = sgd(model), _resume_co2(model, group)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    co2.load_state_dict(ckpt["co2"])
    out["pending_restored"] = co2.in_flight
    _train(model, opt, co2, rank, size, range(RESUME_AT, RESUME_STEPS))
    out["resumed"] = flat(model)
    co2.finish()
    out["resumed-final"] = flat(model)
    out["clip_scale"] = co2.last_clip_scale
    return out


def _worker(rank: int, size: int, port: int, out_dir: str) -> None:
    join_world(rank, size, port, timeout_s=WORLD_TIMEOUT_S)
    try:
        res: dict = {}
        if size == 4:  # two nodes of two ranks: dp inside a node, CO2 across nodes
            topo = build_topology(Layout(dp=4, ranks_per_node=2), rank)
            res["sync"] = _sync_case(
                rank,
                size,
                topo.level_group("node", within_dp=True),
                topo.level_group("node", replica=True),
            )
        else:
            res["sync"] = _sync_case(rank, size, None, dist.group.WORLD)
            res["late"] = _late_case(rank, size, dist.group.WORLD, penalty=0.0)
            res["late-penalty"] = _late_case(rank, size, dist.group.WORLD, penalty=0.5)
            res["overlap-async"] = _overlap_case(rank, size, overlap=True)
            res["overlap-sync"] = _overlap_case(rank, size, overlap=False)
            res["resume"] = _resume_case(rank, size, dist.group.WORLD)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, list[dict]]:
    return {
        size: run_world(
            _worker,
            size,
            tmp_path_factory.mktemp(f"co2-{size}"),
            timeout_s=WORLD_TIMEOUT_S,
            start_method="fork",
        )
        for size in (2, 4)
    }


# --- the tests -----------------------------------------------------------------------------------------


def dp_reference(replicas: int) -> torch.Tensor:
    """Synchronous data parallelism in one process: SGD on the gradient of the mean loss over
    every replica's batch (equal shards, so the mean of the replicas' gradients)."""
    model = make_model()
    opt = sgd(model)
    for step in range(STEPS):
        x, y = global_batch(step, replicas)
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return flat(model)


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
@pytest.mark.parametrize("size", [2, 4])
def test_synchronous_one_step_co2_is_data_parallel(worlds, size):
    ref = dp_reference(size)
    assert not torch.equal(ref, flat(make_model()))  # training moved the parameters
    for r in worlds[size]:
        torch.testing.assert_close(r["sync"], ref, rtol=1e-5, atol=1e-6)


def penalized(gap: torch.Tensor, penalty: float) -> torch.Tensor:
    return gap / (1 + penalty * gap.abs() / (gap.norm() / gap.numel() ** 0.5)) if penalty else gap


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
@pytest.mark.parametrize("case", ["late", "late-penalty"])
def test_round_average_reaches_parameters_one_round_late(worlds, case):
    ranks = [r[case] for r in worlds[2]]
    penalty = 0.5 if case == "late-penalty" else 0.0
    rounds = len(ranks[0]["after"])
    avg = [torch.stack([r["deltas"][k] for r in ranks]).mean(0) for k in range(rounds)]
    assert not torch.allclose(
        ranks[0]["deltas"][0], ranks[1]["deltas"][0]
    )  # replicas saw different data
    # The anchor: round k's average enters it at the end of round k+1, not before.
    expected = [ranks[0]["x0"]]  # after round 0: nothing applied yet
    for k in range(rounds - 1):
        expected.append(expected[-1] - avg[k])  # after round k+1: round k's average
    for r in ranks:
        for k in range(rounds):
            torch.testing.assert_close(r["anchors"][k], expected[k], rtol=1e-6, atol=1e-7)
    # Each replica continues from the anchor plus its own, penalised, not-yet-averaged progress.
    for r in ranks:
        for k in range(rounds):
            torch.testing.assert_close(
                r["after"][k],
                expected[k] + penalized(-r["deltas"][k], penalty),
                rtol=1e-6,
                atol=1e-7,
            )
    # So after round 0 a replica's parameters hold none of the other replica's progress.
    torch.testing.assert_close(
        ranks[0]["after"][0], ranks[0]["x0"] + penalized(-ranks[0]["deltas"][0], penalty)
    )
    if penalty:
        gap = -ranks[0]["deltas"][1]
        assert not torch.allclose(penalized(gap, penalty), gap, rtol=1e-3, atol=1e-6)


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
def test_async_reduction_overlaps_local_steps(worlds):
    for r in worlds[2]:
        a, s = r["overlap-async"], r["overlap-sync"]
        # Starting the exchange returns at once, with the reduction still in flight...
        assert a["in_flight_after"] == [True, True, True]
        assert a["completed_after"][0] is False
        assert a["round_s"][0] < DELAY_S / 3
        # ...and the next round's local steps run while it is in flight.
        assert a["steps_in_flight"] >= 2
        # The synchronous mode waits the whole simulated link time at every round end.
        assert all(t >= DELAY_S * 0.95 for t in s["round_s"]), s["round_s"]
        assert s["in_flight_after"] == [False, False, False] and s["steps_in_flight"] == 0


def _clip_run(
    clip: float | None, delta: torch.Tensor, beta: float = 0.0, rounds: int = 1
) -> list[torch.Tensor]:
    """Single replica (no group), synchronous, H = 1: each round the local step moves the
    parameters by -delta; the anchor after each round."""
    p = nn.Parameter(torch.zeros_like(delta))
    co2 = CO2([p], None, outer_every=1, outer_lr=1.0, outer_momentum=beta, clip=clip, overlap=False)
    out = []
    for _ in range(rounds):
        with torch.no_grad():
            p.sub_(delta)
        co2.after_local_step()
        out.append(p.detach().clone())
    return out


def test_momentum_clip_changes_the_update_only_above_the_threshold():
    delta = torch.tensor([3.0, -4.0])  # norm 5
    unclipped = _clip_run(None, delta)[0]
    torch.testing.assert_close(unclipped, -delta)
    torch.testing.assert_close(
        _clip_run(10.0, delta)[0], unclipped
    )  # below the threshold: untouched
    clipped = _clip_run(2.0, delta)[0]
    torch.testing.assert_close(clipped, -delta * 2.0 / 5.0)  # above: the step has norm exactly 2
    assert clipped.norm().item() == pytest.approx(2.0)
    # The stored momentum is the clipped one: next round m = 0.5·(clipped m) + delta, clipped again.
    two = _clip_run(
        100.0 / 9, delta, beta=0.5, rounds=2
    )  # 2nd m = 0.5·delta + delta, norm 7.5 < 11.1
    torch.testing.assert_close(two[1], -delta - 1.5 * delta)
    two = _clip_run(2.0, delta, beta=0.5, rounds=2)
    m1 = delta * 2.0 / 5.0
    m2 = 0.5 * m1 + delta
    m2 = m2 * 2.0 / m2.norm()
    torch.testing.assert_close(two[1], -m1 - m2)


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
def test_resume_mid_round_with_a_reduction_in_flight_is_exact(worlds):
    for r in (w["resume"] for w in worlds[2]):
        assert r["in_flight_at_save"] and r["pending_restored"]
        assert r["clip_scale"] < 1.0  # the clip was active, so its state matters too
        torch.testing.assert_close(
            r["saved-and-went-on"], r["plain"], rtol=0, atol=0
        )  # saving changes nothing
        torch.testing.assert_close(r["resumed"], r["plain"], rtol=0, atol=0)
        torch.testing.assert_close(r["resumed-final"], r["plain-final"], rtol=0, atol=0)
    a, b = (w["resume"] for w in worlds[2])
    assert not torch.equal(a["plain"], b["plain"])  # mid-round, replicas differ...
    torch.testing.assert_close(
        a["plain-final"], b["plain-final"], rtol=0, atol=0
    )  # ...finish() agrees them


def test_state_dict_refuses_other_parameters():
    co2 = CO2([nn.Parameter(torch.zeros(3))], None, outer_every=2)
    with pytest.raises(ValueError, match="3 parameter elements"):
        CO2([nn.Parameter(torch.zeros(4))], None, outer_every=2).load_state_dict(co2.state_dict())


def test_clip_zero_means_no_clip():
    delta = torch.tensor([3.0, -4.0])
    torch.testing.assert_close(_clip_run(0.0, delta)[0], _clip_run(None, delta)[0])
    with pytest.raises(ValueError):
        CO2([nn.Parameter(torch.zeros(2))], None, outer_every=1, clip=-1.0)


def test_finish_keeps_the_partial_last_round():
    """One replica, H = 3, 4 steps: finish() puts the 4th step's progress into the final anchor."""
    p = nn.Parameter(torch.zeros(2))
    co2 = CO2([p], None, outer_every=3)
    for _ in range(4):
        with torch.no_grad():
            p.sub_(1.0)
        co2.after_local_step()
    co2.finish()
    torch.testing.assert_close(p.detach(), torch.full((2,), -4.0))
    torch.testing.assert_close(co2.anchor, torch.full((2,), -4.0))
    co2.finish()  # a second call changes nothing
    torch.testing.assert_close(p.detach(), torch.full((2,), -4.0))


# --- CO2 switched on from the config, in the trainer ----------------------------------------------

TWO_NODES = {
    "parallel.ranks_per_node": 2,
    "co2.enabled": True,
    "log.interval": 1,
    "checkpoint.interval": 3,
    "checkpoint.save_final": True,
}
ZERO_NODE = {
    "zero.params.shard_over": "node",
    "zero.grads.shard_over": "node",
    "zero.optim.shard_over": "node",
}


def _train_world(small_data_dir, run_root, *extra: str, **settings):
    from worlds import final_params, losses_from, train_run

    train_run(small_data_dir, run_root, 4, *extra, **settings)
    return losses_from(run_root / "t"), final_params(run_root / "t" / "checkpoints")


@pytest.fixture(scope="module")
def co2_run(small_data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("co2-trainer")
    return root, _train_world(small_data_dir, root / "plain", **TWO_NODES)


@pytest.mark.slow  # worlds of 4 processes running `strata train`
def test_trainer_co2_over_zero_chunks_matches_co2_over_whole_replicas(
    small_data_dir, tmp_path, co2_run
):
    """Each rank running CO2 on its node-level ZeRO chunk is the same algorithm, element by element."""
    _, (losses, params) = co2_run
    zero_losses, zero_params = _train_world(small_data_dir, tmp_path, **TWO_NODES, **ZERO_NODE)
    assert zero_losses == pytest.approx(losses, rel=1e-5)
    for name, want in params.items():
        torch.testing.assert_close(zero_params[name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # worlds of 4 processes running `strata train`
def test_trainer_co2_resume_continues_as_the_saving_run(small_data_dir, tmp_path, co2_run):
    """The step-3 checkpoint (mid-round: H = 2) closes the round; a resume from it, here through the
    ZeRO engine, lands on the saving run's steps 4–6 and final weights."""
    root, (losses, params) = co2_run
    resumed, resumed_params = _train_world(
        small_data_dir,
        tmp_path,
        "--resume",
        str(root / "plain" / "t" / "checkpoints" / "step_00000003"),
        **TWO_NODES,
        **{"zero.optim.shard_over": "node"},
    )
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(losses[step], rel=1e-5), step
    for name, want in params.items():
        torch.testing.assert_close(resumed_params[name], want, rtol=1e-5, atol=1e-6)
