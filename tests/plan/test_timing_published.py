"""The step-time model against published training throughputs (bench/plan_published.py): for every
published run the bench asserts — Megatron-LM's A100 weak-scaling table (SC'21, Table 1), the
Frontier runs of Dash et al., Megatron-LM's H100 weak-scaling table and torchtitan's Llama 3.1 runs
on H100 — the predicted throughput is within 25 % of the published one, compared in the
publication's own FLOP counting. The reference is the publication, an independent source; the
inputs are the publications' configurations and their frameworks' documented behaviour; the one
fitted figure is the H100's matmul efficiency (strata.plan.cluster). Also checks the bench's own
arithmetic: the transcribed figures agree with the percentages printed beside them, the SwiGLU
stand-in does the GPT model's FLOPs, each layout is one Megatron could run, and the MFU
`strata plan` prints for Strata's own trainer on H100 stays within what published H100 runs reach.

Pure functions: no worlds, no GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from strata.model import flops_per_token


def _load_bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "plan_published.py"
    spec = importlib.util.spec_from_file_location("plan_published", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_published"] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
ASSERTED = [r for r in bench.RUNS if r.asserted]
PEAKS = {"dgx-a100": 312.0, "dgx-h100": 989.0, "frontier": 191.5}


def _id(run) -> str:
    return f"{run.system}-{run.name}"


# Where the model misses, recorded rather than tuned away: the Frontier paper's body (its
# configuration table) is not available here, its 22B run's GCD count is unknown, and its authors'
# own 175B log reports about twice the rate the abstract's percentage gives per GCD, so these two
# figures are uncertain by a factor of two; the model predicts about 1.35x and 1.3x the
# abstract's rate.
MISSES = {"frontier-22B", "frontier-175B"}


def _marked(run) -> object:
    if _id(run) in MISSES:
        return pytest.param(
            run,
            marks=pytest.mark.xfail(strict=True, reason="published figure uncertain; see MISSES"),
        )
    return run


@pytest.mark.parametrize("run", [_marked(r) for r in ASSERTED], ids=_id)
def test_prediction_within_25_percent_of_published(run) -> None:
    c = bench.compare(run)
    assert abs(c.ratio - 1) <= bench.TOLERANCE, (
        f"{run.name} on {run.system}: predicted {c.predicted_tflops:.1f} TFLOP/s per rank against the published "
        f"{run.published_tflops:.1f} (ratio {c.ratio:.2f}); predicted step {c.estimate.step_s:.3g} s, published "
        f"{c.published_step_s:.3g} s; parts {', '.join(f'{k} {v:.3g}' for k, v in c.estimate.parts.items() if v)}"
    )


@pytest.mark.parametrize(
    "run",
    [r for r in bench.TORCHTITAN_H100 if r.asserted],
    ids=lambda r: f"h100-{r.name}-{r.gpus}".replace(" ", "_"),
)
def test_h100_prediction_within_25_percent_of_torchtitan(run) -> None:
    """torchtitan's Llama 3.1 8B, 70B and 405B on 8 to 512 H100s at 500 W (tokens/s per GPU;
    FSDP, TP with and without async TP, PP 1F1B and interleaved; eager, compiled, float8)."""
    c = bench.compare_tokens(run)
    assert abs(c.ratio - 1) <= bench.TOLERANCE, (
        f"{run.name} on {run.gpus} H100s: predicted {c.predicted_tps:,.0f} tokens/s per GPU "
        f"against the published {run.published_tps:,.0f} (ratio {c.ratio:.2f}); parts "
        f"{', '.join(f'{k} {v:.3g}' for k, v in c.estimate.parts.items() if v)}"
    )


@pytest.mark.parametrize("overrides", [(), ("train.compile=true",)], ids=["eager", "compiled"])
def test_strata_mfu_on_h100_stays_within_published_h100_runs(overrides) -> None:
    """What `strata plan --gpu h100` prints for Llama 3 8B at 8k tokens, FSDP on 4 × 8 H100s, as
    Strata's trainer runs it: within what published bf16 H100 training reaches (torchtitan's
    33-39 % at 500 W up to Megatron-LM's 49.5 %), not the 70 % a GEMM-only efficiency gave."""
    from strata import config as config_mod
    from strata.plan.cluster import Cluster, device_named
    from strata.plan.timing import estimate_time

    cfg = config_mod.load(
        overrides=[*bench.LLAMA31["8B"], *bench.LLAMA31_COMMON, *bench.FSDP,
                   "train.micro_batch_size=2", "train.global_batch_size=64", *overrides],
        world_size=32,
        local_world_size=8,
    )  # fmt: skip
    est = estimate_time(cfg, Cluster(4, 8, device_named("h100")), cfg.model.vocab_size)
    assert 0.35 <= est.mfu <= 0.495


@pytest.mark.parametrize("run", bench.RUNS, ids=_id)
def test_transcribed_rate_matches_printed_percentage(run) -> None:
    """The per-rank rate and the percentage of peak the source prints beside it agree (the sources
    round the percentage to a whole number, Frontier's to 0.01 %)."""
    pct = 100 * run.published_tflops / PEAKS[run.system]
    assert abs(pct - run.published_pct) <= 0.5 + 1e-9


@pytest.mark.parametrize("run", bench.RUNS, ids=_id)
def test_swiglu_stand_in_does_the_gpt_models_flops(run) -> None:
    """ffn_hidden = 8d/3 makes Strata's count equal Megatron's model count (3 passes) to 0.01 %."""
    cfg = bench.config_of(run)
    ours = flops_per_token(cfg.model, run.vocab) * run.batch * run.seq
    assert ours == pytest.approx(bench.megatron_flops(run, 3), rel=1e-4)


@pytest.mark.parametrize("run", bench.RUNS, ids=_id)
def test_layout_is_one_megatron_runs(run) -> None:
    dp, rest = divmod(run.ranks, run.tp * run.pp)
    assert rest == 0 and dp >= 1
    m, rest = divmod(run.batch, run.micro * dp)
    assert rest == 0 and m >= 1
    assert run.layers % (run.pp * run.virtual) == 0
    if run.virtual > 1:  # Megatron's interleaved schedule runs micro-batches in groups of pp
        assert m % run.pp == 0
    cluster = bench.cluster_of(run)
    assert cluster.world_size == run.ranks


def test_recompute_counting_is_megatrons_equation_3() -> None:
    """Eq. 3 of the SC'21 paper, 96·B·s·l·h²·(1 + s/6h + V/16lh), checked on its 1T row: 502 PFLOP/s
    aggregate at 163 TFLOP/s per GPU on 3072 GPUs."""
    run = next(r for r in bench.MEGATRON_A100 if r.name == "1008B")
    b, s, n_layers, h, v = run.batch, run.seq, run.layers, run.hidden, run.vocab
    eq3 = 96 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))
    assert bench.megatron_flops(run, 4) == pytest.approx(eq3, rel=1e-12)
    assert run.published_tflops * run.ranks / 1000 == pytest.approx(502.0, rel=0.01)
