"""bench/gpu.py, the one command a lent GPU machine runs: its plan and its dry run, on the CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.py"


def _gpu_bench():
    spec = importlib.util.spec_from_file_location("strata_bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_every_row_has_commands_and_the_budgets_fit_eight_minutes():
    gpu = _gpu_bench()
    ctx = gpu.Ctx(python="python3", work="/tmp/w", data="/tmp/corpus", peak=800.0)
    plan = gpu.build_plan(ctx)
    assert [r["name"] for r in plan] == list(gpu.ROW_NAMES) == list(gpu.ROW_FUNCS)
    for row in plan:
        assert row["budget_s"] > 0
        assert row["command"] and all(isinstance(a, str) and a for a in row["command"])
        for cmd in row["inner"]:
            assert cmd and all(isinstance(a, str) and a for a in cmd), (row["name"], cmd)
    assert sum(r["budget_s"] for r in plan) <= 8 * 60 == gpu.TOTAL_BUDGET_S
    # the most important rows first: the peak, MFU and its peer, FP8 speed
    assert [r["name"] for r in plan][:5] == ["setup", "peak", "mfu", "peer", "fp8-speed"]


def test_the_compile_bench_names_it_uses_exist_and_fp8_overrides_the_preset():
    gpu = _gpu_bench()
    compile_bench = gpu.load_compile_bench()
    assert gpu.PRESET in compile_bench.PRESETS
    for variant in gpu.MFU_VARIANTS + gpu.FP8_VARIANTS + gpu.LOSS_VARIANTS:
        assert variant in compile_bench.VARIANTS
    ov = compile_bench.overrides(
        "1b", "compiled-fp8-rowwise", 5, Path("d"), None, "cuda", ["model.n_layers=4"]
    )
    assert "train.precision=fp8" in ov and "train.precision=bf16" not in ov
    assert (
        "train.fp8_recipe=rowwise" in ov
        and "model.n_layers=4" in ov
        and "model.n_layers=22" not in ov
    )


def test_only_and_skip_choose_rows_setup_and_needs_included():
    gpu = _gpu_bench()
    args = gpu.argparse.Namespace(only="mfu", skip=None)
    assert [r.name for r in gpu.select_rows(args)] == ["setup", "peak", "mfu"]
    args = gpu.argparse.Namespace(only=None, skip="gpu-tests,checkpoint")
    assert "gpu-tests" not in [r.name for r in gpu.select_rows(args)]
    with pytest.raises(SystemExit, match="unknown rows"):
        gpu.select_rows(gpu.argparse.Namespace(only="mfu,nope", skip=None))


def test_the_summary_reads_partial_results():
    gpu = _gpu_bench()
    rows = {
        "peak": {"data": {"bf16_tflops": 800.0, "fp8_tflops": 1400.0}},
        "mfu": {
            "data": {
                "variants": {
                    "compiled": {
                        "tokens_per_s": 50000.0,
                        "model_tflops": 380.0,
                        "first_step_s": 40.0,
                    }
                    | {"step_s": 0.3, "peak_mem_gib": 50.0},
                    "eager": {"error": "exit 1"},
                }
            }
        },
        "peer": {"data": {"result": {"tokens_per_s": 45000.0}}},
        "checkpoint": {"data": {"ratio": 60.0, "strata_stall_s": 0.05, "dcp_save_s": 3.0}},
    }
    table = {name: (value, met) for name, value, _, met in gpu.figures(rows)}
    assert table["1b compiled"][1] is True  # 380/800 = 47.5% >= 45%
    assert table["1b eager"] == ("failed", False)
    assert table["Strata compiled / peer"] == ("1.11x", True)
    assert table["checkpoint stall"][1] is True


def test_plan_only_dry_run_needs_no_wheels():
    proc = _dry_run("--no-wheels")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry run: OK" in proc.stdout and "bench/gpu.py" in proc.stdout


def test_dry_run_with_the_carried_wheels():
    if not any((ROOT / ".whl").glob("torchao-*.whl")):
        pytest.skip(
            "no .whl/ with the carried wheels here (python bench/gpu.py --fetch-wheels fills it)"
        )
    proc = _dry_run()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dry_run_names_a_missing_required_wheel(tmp_path):
    proc = _dry_run("--wheels", str(tmp_path))
    assert proc.returncode != 0
    assert "torchao" in proc.stdout and "PROBLEM" in proc.stdout
