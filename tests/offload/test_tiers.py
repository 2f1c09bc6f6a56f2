"""Memory tiers in the trainer (offload.*, activations.*): every combination trains exactly as without offload
(fp32, ZeRO-3; losses, parameters and Adam moments bit for bit), the swap files are really
written and read, the host budget holds, bad swap paths fail at start-up, checkpoints taken with
offload resume anywhere, and a 2-rank world through `strata launch` matches one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.errors import ConfigError, StrataError
from strata.offload.files import SwapDir
from strata.offload.io_engine import IOEngine
from strata.offload.pool import HostPool
from strata.offload.swap import FileRegion, Mover
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer

from conftest import tiny_config
from worlds import (
    COMMON,
    REPO,
    TESTS,
    ZERO3,
    assert_same_params,
    final_params,
    launch_run,
    losses_from,
)

MODEL = {"model.n_layers": 3, "model.d_model": 64, **ZERO3}
SMALL_SLABS = {
    "offload.slab_mb": 0.0625,
    "offload.host_buffer_mb": 0.25,
}  # 4 slabs of 64 KiB: 2 streams' minimum


def train(cfg, steps: int = 4):
    """Losses of `steps` steps, then every parameter shard and Adam moment (in memory), and the tiers' counters."""
    trainer = Trainer(cfg, start())
    losses = [trainer.train_step()[0].item() for _ in range(steps)]
    with trainer.model.state_in_memory():
        shards = [g.shard.clone() for g in trainer.model.engine.groups]
        moments = [
            t.clone()
            for group in trainer.model.optimizer.param_groups
            for p in group["params"]
            for _, t in sorted(trainer.model.optimizer.state[p].items())
        ]
    held = trainer.model.engine.held_bytes()
    metrics = trainer.model.tiers.metrics() if trainer.model.tiers else {}
    files = (
        {k: f.path.stat().st_size for k, f in trainer.model.tiers.swap.files.items()}
        if trainer.model.tiers and trainer.model.tiers.swap
        else {}
    )
    if trainer.model.tiers:
        trainer.model.tiers.close()
    return losses, shards, moments, held, metrics, files


@pytest.fixture(scope="module")
def reference(small_data_dir, tmp_path_factory):
    return train(tiny_config(small_data_dir, tmp_path_factory.mktemp("ref"), **MODEL))


VARIANTS = {
    "params-nvme": {"offload.params.device": "nvme"},
    "params-cpu": {"offload.params.device": "cpu"},
    "optim-nvme-subgroups": {"offload.optim.device": "nvme", **SMALL_SLABS},
    "optim-cpu": {"offload.optim.device": "cpu"},
    "optim-cpu-updated-on-device-path": {
        "offload.optim.device": "cpu",
        "offload.optim.update_on": "gpu",
    },
    "all-nvme-minimum-budget": {
        "offload.params.device": "nvme",
        "offload.optim.device": "nvme",
        **SMALL_SLABS,
    },
    "all-nvme-buffered-io": {
        "offload.params.device": "nvme",
        "offload.optim.device": "nvme",
        "offload.direct_io": False,
    },
    "activations-nvme": {"activations.offload": "nvme", "activations.min_bytes": 4096},
    "activations-nvme-bounded-inflight": {
        "activations.offload": "nvme",
        "activations.min_bytes": 4096,
        "activations.max_inflight_mb": 0.1,
    },
    "activations-cpu-recompute": {
        "activations.offload": "cpu",
        "activations.recompute": "full",
        "activations.min_bytes": 4096,
    },
    "everything-nvme-minimum-budget": {
        "offload.params.device": "nvme",
        "offload.optim.device": "nvme",
        "activations.offload": "nvme",
        "activations.min_bytes": 4096,
        **SMALL_SLABS,
        "offload.host_buffer_mb": 0.375,
    },  # 3 streams' minimum
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_offload_trains_exactly_as_without(small_data_dir, tmp_path, reference, name):
    settings = {**MODEL, **VARIANTS[name], "offload.nvme_path": str(tmp_path / "swap")}
    losses, shards, moments, held, metrics, files = train(
        tiny_config(small_data_dir, tmp_path, **settings)
    )
    ref_losses, ref_shards, ref_moments, ref_held, _, _ = reference
    if torch.cuda.is_available():  # a GPU run: CPU and GPU fused AdamW differ in the last bits
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(shards, ref_shards, rtol=1e-3, atol=1e-5)
        return
    assert losses == ref_losses
    assert len(shards) == len(ref_shards) and all(
        torch.equal(a, b) for a, b in zip(shards, ref_shards)
    )
    assert len(moments) == len(ref_moments) and all(
        torch.equal(a, b) for a, b in zip(moments, ref_moments)
    )
    if VARIANTS[name].get("offload.params.device") == "nvme":
        assert held["params"] < ref_held["params"]  # shards dropped after the step
    if (
        VARIANTS[name].get("offload.params.device") == "cpu"
    ):  # on a CPU the shards are in host memory already
        assert held["params"] == ref_held["params"]
    if "offload.optim.device" in VARIANTS[name]:
        assert held["optim"] == 0 < ref_held["optim"]
    if "nvme" in VARIANTS[name].values():
        assert metrics["io_write_bytes"] > 0 and metrics["io_read_bytes"] > 0
        assert files and all(size > 0 for size in files.values())
        if (
            "offload.optim.device" in VARIANTS[name]
        ):  # two moments of every parameter element, 4-KiB aligned
            n_elems = sum(s.numel() for s in ref_shards)
            assert 2 * 4 * n_elems <= files["optim"] < 2 * 4 * n_elems + 2 * 4096 * 64
        if "offload.params.device" in VARIANTS[name]:
            assert sum(4 * s.numel() for s in ref_shards) <= files["params"]
    if VARIANTS[name].get("activations.offload") == "nvme":
        acts = metrics["activations"]
        assert acts["deduplicated"] > 0 and acts["bytes_offloaded"] > 0 and acts["reads"] > 0
        assert (
            files["activations"] >= acts["bytes_offloaded"] / 4
        )  # one step's worth (of 4) at a time
    if "offload.host_buffer_mb" in VARIANTS[name]:
        assert 0 < metrics["pool_peak_bytes"] <= VARIANTS[name]["offload.host_buffer_mb"] * 2**20


def test_mover_round_trips_through_slabs_files_and_host_tensors(tmp_path):
    """Tensors of odd sizes go to swap-file regions through 2 slabs of 64 KiB (several chunks in
    flight, the budget never exceeded) and to host tensors, and come back exactly."""
    swap = SwapDir(tmp_path / "swap", 0)
    f = swap.file("params")
    sizes = [
        1,
        1025,
        70_000,
        300_000,
    ]  # fp32 elements: under a page, a page and a bit, several slabs
    regions = [FileRegion(f, f.region(4 * n), 4 * n) for n in sizes]
    swap.preallocate({})
    pool = HostPool(2 * 65536, 65536, 0, {"params": 2})
    io = IOEngine(threads=2, chunk_bytes=65536)
    mover = Mover(pool, io, "params")
    src = [torch.randn(n) for n in sizes]
    for transfer in [mover.write(t, r) for t, r in zip(src, regions)]:
        transfer.wait()
    back = [torch.empty(n) for n in sizes]
    for transfer in [mover.read(t, r) for t, r in zip(back, regions)]:
        transfer.wait()
    assert all(torch.equal(a, b) for a, b in zip(src, back))
    assert io.bytes_written == io.bytes_read == sum(-(-4 * n // 4096) * 4096 for n in sizes)
    assert pool.peak_staging_bytes == 2 * 65536
    host = torch.empty(1025)
    mover.write(src[1], host).wait()
    again = torch.zeros(1025)
    mover.read(again, host).wait()
    assert torch.equal(host, src[1]) and torch.equal(again, src[1])
    with pytest.raises(ValueError, match="do not fit"):
        mover.write(torch.zeros(2), regions[0]).wait()
    mover.close()
    io.close()
    swap.close()
    assert not swap.path.exists()


def test_offload_swap_traffic_is_zero_infinity_s(small_data_dir, tmp_path):
    """Keeping no shard, each is read once per forward and once per backward of every micro-batch
    (4 here) and once for the update, and written once after it. Keeping the 2 used last saves
    the reads at the turns; the losses stay the same."""
    reads, losses = {}, {}
    for keep in (0, 2):
        settings = {
            **MODEL,
            "offload.params.device": "nvme",
            "offload.nvme_path": str(tmp_path / f"swap{keep}"),
            "offload.params.keep_groups": keep,
        }
        cfg = tiny_config(small_data_dir, tmp_path / str(keep), **settings)
        trainer = Trainer(cfg, start())
        groups = trainer.model.engine.groups
        shard_bytes = sum(
            -(-4 * g.shard.numel() // 4096) * 4096 for g in groups
        )  # O_DIRECT pads to 4 KiB
        written0 = trainer.model.tiers.io.bytes_written
        assert written0 == shard_bytes  # the initial move
        losses[keep] = [trainer.train_step()[0].item() for _ in range(2)]
        reads[keep] = trainer.model.tiers.io.bytes_read
        assert (
            trainer.model.tiers.io.bytes_written - written0 == 2 * shard_bytes
        )  # one write-back per step
        if keep == 0:
            micro = cfg.grad_accum_steps(1)
            assert reads[0] == 2 * (2 * micro + 1) * shard_bytes
        else:  # resident now: the 2 shards the update used last, and nothing else
            assert sum(g.shard.untyped_storage().nbytes() > 0 for g in groups) == 2
        trainer.model.tiers.close()
    assert losses[2] == losses[0]
    assert reads[2] < 0.8 * reads[0]


def _aligned_bytes(group) -> int:
    return -(-4 * group.shard.numel() // 4096) * 4096


@pytest.mark.parametrize("budget", ["auto", "two-groups"])
def test_resident_shards_are_never_reread_nor_written_back(
    small_data_dir, tmp_path, reference, budget
):
    """`offload.params.resident_mb`: the shards the budget holds stay in memory once read and are
    never written home; a set budget takes them from the start (the initial move skips them), null
    sizes it from the free memory after the first step. Either way the run trains bit for bit as
    without offload, and the other shards still make their swap traffic."""
    settings = {
        **MODEL,
        "offload.params.device": "nvme",
        "offload.nvme_path": str(tmp_path / "swap"),
    }
    sizes = None
    if budget == "two-groups":  # exactly the first two groups in the update's order
        probe = Trainer(tiny_config(small_data_dir, tmp_path / "probe", **settings), start())
        sizes = [4 * g.shard.numel() for g in probe.model.engine.groups]
        probe.model.tiers.close()
        settings["offload.params.resident_mb"] = (sizes[0] + sizes[1]) / 2**20
    else:
        settings["offload.params.resident_mb"] = None
    trainer = Trainer(tiny_config(small_data_dir, tmp_path, **settings), start())
    tier, io, groups = (
        trainer.model.tiers.param_tier,
        trainer.model.tiers.io,
        trainer.model.engine.groups,
    )
    initial = io.bytes_written
    per_step = []
    for _ in range(4):
        r, w = io.bytes_read, io.bytes_written
        trainer.train_step()
        per_step.append((io.bytes_read - r, io.bytes_written - w))
    resident = [g for g in groups if g.name in tier.resident]
    others = [g for g in groups if g.name not in tier.resident]
    assert all(g.shard.untyped_storage().nbytes() > 0 for g in resident)
    if budget == "two-groups":
        assert [g.name for g in resident] == [g.name for g in groups[:2]]  # nothing else fits
        assert initial == sum(_aligned_bytes(g) for g in others)  # resident shards never went home
        assert all(
            w == sum(_aligned_bytes(g) for g in others) for _, w in per_step
        )  # the others: once a step
        assert all(0 < r for r, _ in per_step)
    else:
        assert initial == sum(
            _aligned_bytes(g) for g in groups
        )  # unknown at start: every shard went home
        assert len(resident) == len(
            groups
        )  # this small model fits the free memory of any test machine
        assert (
            per_step[0][1] == initial
        )  # the first step writes every changed shard back, as without a budget
        assert (
            per_step[1][1] == 0 and per_step[1][0] < per_step[0][0]
        )  # the shards not kept are read once more
        assert per_step[2] == per_step[3] == (0, 0)  # then nothing moves
    with trainer.model.state_in_memory():
        shards = [g.shard.clone() for g in groups]
    trainer.model.tiers.close()
    ref_shards = reference[1]
    if torch.cuda.is_available():
        torch.testing.assert_close(shards, ref_shards, rtol=1e-3, atol=1e-5)
    else:
        assert all(torch.equal(a, b) for a, b in zip(shards, ref_shards))


@pytest.mark.slow  # four runs of the trainer: 4-6 s on 2 cores
def test_offloaded_checkpoint_resumes_with_and_without_offload(small_data_dir, tmp_path):
    """A run offloading everything to NVMe saves at step 3; resumed without offload and with it,
    both finish steps 4-6 on the uninterrupted run's losses and parameters."""
    extra = {
        **MODEL,
        **COMMON,
        "train.steps": 6,
        "checkpoint.interval": 3,
        "checkpoint.keep_last": 0,
    }
    offload = {
        "offload.params.device": "nvme",
        "offload.optim.device": "nvme",
        "offload.nvme_path": str(tmp_path / "swap"),
        **SMALL_SLABS,
    }
    full_cfg = tiny_config(small_data_dir, tmp_path / "full", **extra, **offload)
    full = run(full_cfg, start())
    saved = store.step_dir(full_cfg.checkpoint_dir(), 3)
    plain_ref = run(tiny_config(small_data_dir, tmp_path / "plain", **extra), start())
    assert full.losses == plain_ref.losses
    for name, settings in {"plain": {}, "offloaded": offload}.items():
        cfg = tiny_config(small_data_dir, tmp_path / name / "resumed", **extra, **settings)
        resumed = run(cfg, start(), resume=saved)
        assert resumed.losses == {s: full.losses[s] for s in (4, 5, 6)}, name
        a = Checkpoint(store.step_dir(full_cfg.checkpoint_dir(), 6)).tensors("")
        b = Checkpoint(store.step_dir(cfg.checkpoint_dir(), 6)).tensors("")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_swap_dir_problems_fail_at_start_up(small_data_dir, tmp_path):
    settings = {**MODEL, "offload.params.device": "nvme"}
    with pytest.raises(StrataError, match=r"offload.nvme_path /sys/.*cannot create"):
        Trainer(
            tiny_config(
                small_data_dir, tmp_path, **settings, **{"offload.nvme_path": "/sys/strata-swap"}
            ),
            start(),
        )
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(StrataError, match="offload.nvme_path"):
        Trainer(
            tiny_config(
                small_data_dir, tmp_path, **settings, **{"offload.nvme_path": str(a_file / "sub")}
            ),
            start(),
        )


@pytest.mark.slow  # a fresh interpreter builds a trainer: ~6 s on 2 cores
def test_full_disk_fails_at_start_up_naming_the_key(small_data_dir, tmp_path):
    """RLIMIT_FSIZE makes the file system 'full' for this process: preallocation fails with EFBIG
    before the first step, naming the config key and the bytes needed (root ignores chmod, so a
    read-only directory cannot be simulated with permissions)."""
    settings = dict(
        MODEL, **{"offload.optim.device": "nvme", "offload.nvme_path": str(tmp_path / "swap")}
    )
    script = f"""
import resource, signal, sys
sys.path.insert(0, {str(TESTS)!r})  # conftest
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from conftest import tiny_config
from strata.parallel.runtime import start
from strata.trainer.loop import Trainer
from pathlib import Path
cfg = tiny_config(Path({str(small_data_dir)!r}), Path({str(tmp_path)!r}), **{settings!r})
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    Trainer(cfg, start())
except Exception as e:
    print(type(e).__name__, e)
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert "SwapIOError" in out.stdout, out.stdout + out.stderr
    assert "offload.optim.device" in out.stdout and "EFBIG" in out.stdout and "MiB" in out.stdout


@pytest.mark.parametrize(
    "settings, problem",
    [
        ({"offload.params.device": "nvme"}, "need.* offload.nvme_path"),
        (
            {
                "offload.params.device": "cpu",
                "zero.params.shard_over": "none",
                "zero.grads.shard_over": "none",
            },
            "set zero.params.shard_over",
        ),
        (
            {
                "offload.optim.device": "cpu",
                "zero.optim.shard_over": "none",
                "zero.params.shard_over": "none",
                "zero.grads.shard_over": "none",
            },
            "set zero.optim.shard_over",
        ),
        ({"offload.optim.device": "cpu", "optim.impl": "foreach"}, "optim.impl=auto or fused"),
        ({"offload.slab_mb": 0.001}, "multiple of 4 KiB"),
        ({"offload.host_buffer_mb": 4, "offload.params.device": "cpu"}, "at least 8"),
        (
            {
                "offload.host_buffer_mb": 8,
                "offload.params.device": "nvme",
                "offload.optim.device": "cpu",
                "activations.offload": "nvme",
                "offload.nvme_path": "/tmp",
            },
            "6 slabs .* 3 offload streams .* at least 24",
        ),
    ],
)
def test_offload_config_errors_say_what_to_set(small_data_dir, tmp_path, settings, problem):
    with pytest.raises(ConfigError, match=problem):
        tiny_config(small_data_dir, tmp_path, **{**MODEL, **settings})


@pytest.mark.slow  # a 2-process `strata launch` world
def test_offload_dp2_through_launch_matches_one_process(small_data_dir, tmp_path):
    """ZeRO-3 over 2 ranks with parameters, optimizer states and activations on NVMe: the losses and final
    parameters of the 1-process run without offload; the metrics report the swap traffic."""
    shared = {**COMMON, "train.micro_batch_size": 2}
    reference_cfg = tiny_config(small_data_dir, tmp_path / "ref", **shared)
    reference = run(reference_cfg, start())
    offload = {
        **ZERO3,
        "offload.params.device": "nvme",
        "offload.optim.device": "nvme",
        "activations.offload": "nvme",
        "activations.min_bytes": 4096,
        "offload.nvme_path": str(tmp_path / "swap"),
        **SMALL_SLABS,
        "offload.host_buffer_mb": 0.375,
    }
    launch_run(small_data_dir, tmp_path / "par", 2, **shared, **offload)
    losses = losses_from(tmp_path / "par" / "t")
    assert sorted(losses) == sorted(reference.losses)
    for step, loss in reference.losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert_same_params(
        final_params(tmp_path / "par" / "t" / "checkpoints"),
        final_params(reference_cfg.checkpoint_dir()),
    )
    summary = json.loads((tmp_path / "par" / "t" / "summary.json").read_text())
    assert summary["offload"]["io_read_bytes"] > 0 and summary["offload"]["io_write_bytes"] > 0
    assert not list((tmp_path / "swap").glob("strata-*/*"))  # swap files removed at the end


@pytest.mark.slow  # a 2-process `strata launch` world
def test_activation_policy_under_interleaved_pipeline_through_launch(small_data_dir, tmp_path):
    """pp2 with 2 virtual stages (interleaved 1F1B: micro-batches of two stages in flight per rank),
    every block recomputed and the saved block inputs offloaded to NVMe: the 1-process losses."""
    shared = {"model.n_layers": 4, "log.interval": 1}
    reference = run(tiny_config(small_data_dir, tmp_path / "ref", **shared), start())
    launch_run(
        small_data_dir,
        tmp_path / "par",
        2,
        **shared,
        **{
            "parallel.pp": 2,
            "parallel.virtual_stages": 2,
            "activations.offload": "nvme",
            "activations.min_bytes": 4096,
            "activations.recompute": "full",
            "offload.nvme_path": str(tmp_path / "swap"),
        },
    )
    losses = losses_from(tmp_path / "par" / "t")
    assert sorted(losses) == sorted(reference.losses)
    for step, loss in reference.losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
