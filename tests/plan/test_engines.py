"""The step-time model's device and engine physics, each against an independent derivation: chunked
tensor-parallel overlap hides all but the first chunk while GEMMs last, a parameter gather moved
into the next forward hides behind it, a power cap slows compute by the cube root of the power,
float8 speeds only devices with float8 matmuls, small GEMMs run further below peak than large ones
(their operands move through memory), eager element-wise work costs more than compiled, and
torchtitan's selective checkpointing recomputes exactly its every-second matmul.

Pure functions: no worlds, no GPU.
"""

from __future__ import annotations

import pytest

from strata import config
from strata.plan.cluster import Cluster, device_named, power_capped, preset
from strata.plan.engines import STRATA, Engine
from strata.plan.timing import estimate_time

VOCAB = 128256
LLAMA_8B = (
    "model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8",
    "model.ffn_hidden=14336", "model.vocab_size=128256", "model.seq_len=8192",
    "train.precision=bf16",
)  # fmt: skip


def load(*overrides: str, world: int) -> config.Config:
    """Llama 3 8B at 8k tokens, two micro-batches of 2 per data-parallel rank unless overridden."""
    batch = ("train.micro_batch_size=2", f"train.global_batch_size={4 * world}")
    return config.load(None, [*LLAMA_8B, *batch, *overrides], world_size=world, local_world_size=8)


def test_tp_overlap_hides_all_but_the_first_chunk_while_gemms_last() -> None:
    """TP 8 over one node's NVLink: Strata's trainer waits on every collective; chunked, a
    collective's first 1/8 still shows and the rest hides behind GEMMs that outlast it."""
    cfg = load("parallel.tp=8", "parallel.sequence_parallel=true", world=8)
    cluster = preset("dgx-h100", 1)
    whole = estimate_time(cfg, cluster, VOCAB).parts["tp"]
    chunked = estimate_time(cfg, cluster, VOCAB, Engine("x", tp_comm_overlap=True)).parts["tp"]
    assert whole > 0
    assert chunked == pytest.approx(whole / 8, rel=1e-9)


def test_param_gather_overlap_hides_the_rebuild_behind_the_next_forward() -> None:
    """ZeRO-1 over 4 nodes: the gather after the update is exposed in Strata's trainer; moved into
    the next step's first forward, only what outlasts that forward shows, so the step shortens
    and by no more than the whole gather."""
    cfg = load("zero.optim.shard_over=global", world=32)
    cluster = preset("dgx-h100", 4)
    plain = estimate_time(cfg, cluster, VOCAB, Engine("x"))
    hidden = estimate_time(cfg, cluster, VOCAB, Engine("x", param_gather_overlap=True))
    assert hidden.parts["dp"] < plain.parts["dp"]
    assert hidden.step_s == pytest.approx(
        plain.step_s - (plain.parts["dp"] - hidden.parts["dp"]), rel=1e-12
    )


def test_power_cap_slows_compute_by_the_cube_root_of_the_power() -> None:
    h100 = device_named("h100")
    capped = power_capped(h100, 500.0)
    scale = (500 / 700) ** (1 / 3)
    assert capped.matmul_efficiency == pytest.approx(h100.matmul_efficiency * scale)
    assert capped.attention_efficiency == pytest.approx(h100.attention_efficiency * scale)
    assert (capped.peak_tflops, capped.mem_bw_gbs) == (h100.peak_tflops, h100.mem_bw_gbs)
    assert power_capped(h100, 800.0) is h100
    assert device_named("h100-500w") == capped


@pytest.mark.parametrize(("gpu", "faster"), [("h100", True), ("a100-80gb", False)])
def test_float8_speeds_only_devices_with_float8_matmuls(gpu: str, faster: bool) -> None:
    cluster = Cluster(1, 8, device_named(gpu))
    bf16 = estimate_time(load("train.compile=true", world=8), cluster, VOCAB).step_s
    fp8 = estimate_time(load("train.compile=true", "train.precision=fp8", world=8), cluster, VOCAB)
    if faster:  # the blocks' matmuls at twice the rate, less the casts: between 1x and 2x
        assert 1.0 < bf16 / fp8.step_s < 2.0
    else:
        assert fp8.step_s == pytest.approx(bf16, rel=1e-12)


def test_small_layers_run_further_below_peak_than_large_ones() -> None:
    """One rank, no communication, short sequences (attention a few % of the FLOPs): the model-FLOP
    rate rises with the hidden size, since per token a layer's memory traffic (GEMM operands,
    element-wise work) grows as d and its FLOPs as d², and stays below the matmul efficiency."""
    cluster = Cluster(1, 1, device_named("h100"))
    mfu = []
    for d in (1024, 4096):
        cfg = config.load(
            None,
            [f"model.d_model={d}", f"model.n_heads={d // 128}", "model.n_layers=4",
             "model.seq_len=512", "train.compile=true", "train.global_batch_size=8",
             "train.micro_batch_size=8"],
            world_size=1,
        )  # fmt: skip
        mfu.append(estimate_time(cfg, cluster, 32000).mfu)
    assert mfu[0] < mfu[1] < device_named("h100").matmul_efficiency


def test_eager_element_wise_work_costs_more_than_compiled() -> None:
    cluster = Cluster(1, 8, device_named("h100"))
    eager = estimate_time(load(world=8), cluster, VOCAB)
    compiled = estimate_time(load("train.compile=true", world=8), cluster, VOCAB)
    assert eager.parts["compute"] > compiled.parts["compute"]
    fused = estimate_time(load(world=8), cluster, VOCAB, Engine("x", fused_elementwise=True))
    assert fused.parts["compute"] == pytest.approx(compiled.parts["compute"], rel=1e-12)


def test_torchtitans_selective_checkpointing_recomputes_every_second_matmul() -> None:
    """wq wk wv wo w1 w3 w2: the second, fourth and sixth (wk, wo, w3) run again in backward,
    2·d·kv + 2·q·d + 2·d·f FLOPs per token per layer; Strata's own selective recomputes none."""
    m = load(world=8).model
    titan = Engine("x", selective_recompute=("wk", "wo", "w3"))
    d, kv, f = 4096, 8 * 128, 14336
    assert titan.recomputed_flops(m, 1, 0) == 2 * (d * kv + d * d + d * f)
    assert titan.recomputed_flops(m, 4, 0) == 2 * (d * kv + d * d + d * f) / 4
    assert STRATA.recomputed_flops(m, 1, 0) == 0
    cluster = Cluster(1, 8, device_named("h100"))
    cfg = load("activations.recompute=selective", world=8)
    ours = estimate_time(cfg, cluster, VOCAB).parts["compute"]
    extra = estimate_time(cfg, cluster, VOCAB, titan).parts["compute"] - ours
    tokens = cfg.train.global_batch_size * 8192 // 8  # a rank's tokens per step
    rate = cluster.device.rate_tflops("bf16") * 1e12
    assert extra == pytest.approx(tokens * 32 * titan.recomputed_flops(m, 1, 0) / rate, rel=1e-9)
