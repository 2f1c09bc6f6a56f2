"""What operators watch a run with: TensorBoard scalars, profiler traces and memory snapshots, the
peak MFU is measured against, and a metrics.jsonl strict JSON parsers accept."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from strata import config
from strata.errors import ConfigError, StrataError
from strata.trainer.metrics import MetricsLogger, flat_scalars, mfu_peak, peak_tflops, read_metrics
from strata.trainer.profiling import StepProfiler

RECORDS = [
    {
        "loss": 5.5,
        "lr": 1e-4,
        "grad_norm": 2.0,
        "tokens_per_s": 1000.0,
        "tflops_per_rank": 3.0,
        "mfu": 0.25,
    },
    {
        "loss": 4.25,
        "lr": 2e-4,
        "grad_norm": 1.5,
        "wire_bytes_per_step": {"node": 64.0, "global": 8},
    },
]


def _logger(tmp_path, **kwargs) -> MetricsLogger:
    return MetricsLogger(
        tmp_path, total_steps=10, start_step=0, enabled=True, progress=False, **kwargs
    )


def _strict_json(line: str) -> dict:
    """json.loads as strict parsers (JavaScript's JSON.parse, jq, Go) read it: NaN/Infinity refused."""

    def refuse(token: str) -> None:
        raise ValueError(f"non-JSON constant {token}")

    return json.loads(line, parse_constant=refuse)


# --- TensorBoard ------------------------------------------------------------------------------


def test_tensorboard_scalars_equal_the_records(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = _logger(tmp_path, tensorboard=True)
    for step, record in enumerate(RECORDS, start=1):
        log.step(step, record)
    log.write({"step": 2, "eval_loss": 4.5})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    want = {
        (tag, step): value
        for step, r in enumerate(RECORDS, start=1)
        for tag, value in flat_scalars(r)
    }
    want[("eval_loss", 2)] = 4.5
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key  # stored as float32
    assert ("wire_bytes_per_step/node", 2) in got


def test_flat_scalars_joins_nested_keys_and_drops_axes_and_text():
    record = {
        "step": 3,
        "time": 1.0,
        "loss": 2.0,
        "skipped": "why",
        "ok": True,
        "offload": {"host": {"gb": 1}},
    }
    assert dict(flat_scalars(record)) == {"loss": 2.0, "offload/host/gb": 1.0}


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", None
    )  # import fails as if not installed
    with pytest.raises(StrataError, match=r"pip install strata-train\[tensorboard\]"):
        _logger(tmp_path, tensorboard=True)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_writes_on_rank_zero_only(tmp_path):
    MetricsLogger(tmp_path, 10, 0, enabled=False, progress=False, tensorboard=True).close()
    assert not (tmp_path / "tensorboard").exists()


# --- metrics.jsonl stays JSON -----------------------------------------------------------------


def test_non_finite_numbers_are_written_as_null(tmp_path):
    log = _logger(tmp_path)
    log.step(
        1, {"loss": float("nan"), "grad_norm": float("inf"), "offload": {"x": [1.0, float("-inf")]}}
    )
    log.step(2, {"loss": 3.0})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (_strict_json(line) for line in lines)
    assert (
        first["loss"] is None
        and first["grad_norm"] is None
        and first["offload"] == {"x": [1.0, None]}
    )
    assert second["loss"] == 3.0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_runs_nan_step_is_null_in_metrics_jsonl(small_data_dir, tmp_path, monkeypatch):
    """A real run whose step 2 has a NaN loss (skipped by train.nonfinite=skip): every line parses
    strictly, and the skipped step's loss is null."""
    from strata.parallel.runtime import start
    from strata.trainer import parallelize as parallelize_mod
    from strata.trainer.jobs import train as run

    from conftest import tiny_config

    real, calls = parallelize_mod.lm_loss, [0]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            calls[0] += 1
            if (calls[0] - 1) // 4 + 1 == 2:  # tiny_config: 4 micro-batches a step
                logits = logits * math.nan
        return real(logits, targets)

    monkeypatch.setattr(parallelize_mod, "lm_loss", loss)
    cfg = tiny_config(small_data_dir, tmp_path, **{"train.steps": 3, "log.interval": 1})
    run(cfg, start())
    records = [
        _strict_json(line) for line in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()
    ]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert losses[2] is None and losses[1] is not None and losses[3] is not None


# --- MFU peak ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("AMD Instinct MI250X", 191.5),
        ("AMD Instinct MI300X", 1307.4),
        ("NVIDIA GeForce RTX 3090", None),
        (None, None),
    ],
)
def test_peak_tflops_from_device_name(name, peak):
    assert peak_tflops(name, "bf16") == peak


def test_peak_tflops_unknown_for_fp32():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") is None


def test_mfu_peak_on_cpu_only_when_configured():
    peak, note = mfu_peak(None, torch.device("cpu"), "bf16")
    assert peak is None and "log.peak_tflops" in note
    assert mfu_peak(100.0, torch.device("cpu"), "bf16")[0] == 100.0


def test_logger_adds_mfu_from_the_peak(tmp_path):
    log = _logger(tmp_path, peak_tflops=200.0)
    log.step(1, {"tflops_per_rank": 50.0})
    log.step(2, {"tflops_per_rank": 50.0, "mfu": 0.5})  # a figure the loop computed stays
    log.close()
    assert [r["mfu"] for r in read_metrics(tmp_path)] == [0.25, 0.5]


def test_no_mfu_without_a_peak(tmp_path):
    log = _logger(tmp_path)
    log.step(1, {"tflops_per_rank": 50.0})
    log.close()
    assert "mfu" not in read_metrics(tmp_path)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_mfu_peak_on_this_gpu():
    name = torch.cuda.get_device_name()
    peak, note = mfu_peak(None, torch.device("cuda"), "bf16")
    assert peak == peak_tflops(name, "bf16") and name in note


# --- profiling --------------------------------------------------------------------------------


def _work(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ x.T).sum(dim=0)


def _trace_names(path) -> set[str]:
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_profiler_traces_only_the_window(tmp_path):
    prof = StepProfiler(2, 3, tmp_path / "profile", rank=1, device=torch.device("cpu"))
    x = torch.randn(32, 32)
    for step in range(1, 6):
        with prof.step(step):
            _work(x)
        assert prof.trace_path.exists() == (step >= 3)
    prof.close()
    assert prof.trace_path == tmp_path / "profile" / "rank1.json"
    names = _trace_names(prof.trace_path)
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names
    assert "aten::mm" in names
    assert not prof.memory_path.exists()  # CPU: no CUDA memory snapshot


def test_profiler_off_writes_nothing(tmp_path):
    prof = StepProfiler.from_config(
        config.LogConfig(), tmp_path, rank=0, device=torch.device("cpu")
    )
    with prof.step(1):
        _work(torch.randn(4, 4))
    prof.close()
    assert not (tmp_path / "profile").exists()


def test_profiler_writes_the_trace_when_a_step_fails(tmp_path):
    prof = StepProfiler(1, 10, tmp_path, rank=0, device=torch.device("cpu"))
    with prof.step(1):
        _work(torch.randn(8, 8))
    with pytest.raises(ValueError, match="boom"), prof.step(2):
        raise ValueError("boom")
    assert "step 1" in _trace_names(prof.trace_path)


def test_profiled_trainer_run(small_data_dir, tmp_path):
    """A short run of the real Trainer, each step wrapped as the loop wraps it."""
    from strata.parallel.runtime import start
    from strata.trainer.loop import Trainer

    from conftest import tiny_config

    cfg = tiny_config(small_data_dir, tmp_path, **{"train.steps": 4, "log.profile_steps": [2, 3]})
    runtime = start()
    trainer = Trainer(cfg, runtime)
    prof = StepProfiler.from_config(cfg.log, cfg.run_dir(), runtime.rank, runtime.device)
    while trainer.step < cfg.train.steps:
        with prof.step(trainer.step + 1):
            loss, _ = trainer.train_step()
    prof.close()
    trainer.checkpoints.close()
    trainer.model.close()
    assert math.isfinite(loss.item())
    names = _trace_names(cfg.run_dir() / "profile" / "rank0.json")
    assert {"step 2", "step 3"} <= names and "step 4" not in names


def test_profile_steps_is_the_inclusive_window(tmp_path):
    log = config.from_dict({"log": {"profile_steps": [3, 5]}}).log
    assert log.profile_steps == (3, 5)
    prof = StepProfiler.from_config(log, tmp_path, rank=0, device=torch.device("cpu"))
    assert (prof.first, prof.last) == (3, 5)
    assert [s for s in range(1, 8) if prof.in_window(s)] == [3, 4, 5]
    one = StepProfiler.from_config(
        config.load(None, ["log.profile_steps=[2,2]"]).log, tmp_path, 0, torch.device("cpu")
    )
    assert [s for s in range(1, 5) if one.in_window(s)] == [2]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "log.profile_steps: expected list of int or null, got 0 (use a list, e.g. [a, b])"),
        (
            "2-4",
            "log.profile_steps: expected list of int or null, got '2-4' (use a list, e.g. [a, b])",
        ),
        ([3], "log.profile_steps: [3] has 1 item; give exactly 2"),
        ([1, 2, 3], "log.profile_steps: [1, 2, 3] has 3 items; give exactly 2"),
        (
            [5, 3],
            "log.profile_steps: [5, 3] is reversed; give [first, last] with first <= last, e.g. [3, 5]",
        ),
        ([1, "x"], "log.profile_steps: item 2 is 'x', not a whole number"),
        ([1.5, 2], "log.profile_steps: item 1 is 1.5, not a whole number"),
        ([0, 2], "log.profile_steps: item 1 is 0, which must be >= 1"),
    ],
)
def test_profile_steps_is_checked_with_one_message(value, message):
    with pytest.raises(ConfigError) as err:
        config.from_dict({"log": {"profile_steps": value}})
    assert err.value.problems == [message]


def test_the_old_profile_keys_are_gone():
    for old in ("profile_start", "profile_count"):
        with pytest.raises(ConfigError, match=f"log.{old}: unknown key"):
            config.from_dict({"log": {old: 2}})


class _FakeObserverHook:
    """Stands in for torch._C._cuda_attach_out_of_memory_observer (absent from CPU builds)."""

    def __init__(self) -> None:
        self.observers: list = []

    def __call__(self, observer) -> None:
        self.observers.append(observer)


@pytest.fixture
def oom_hook(monkeypatch):
    from strata.trainer import profiling

    hook = _FakeObserverHook()
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", hook, raising=False)
    monkeypatch.setattr(profiling, "_oom_observer_attached", False)
    monkeypatch.setattr(profiling, "_oom_target", None)
    return hook


def test_cpu_profiler_attaches_no_out_of_memory_observer(tmp_path, oom_hook):
    log = config.from_dict({"log": {"profile_steps": [1, 2]}}).log
    prof = StepProfiler.from_config(log, tmp_path, rank=0, device=torch.device("cpu"))
    assert not prof.oom_observer and oom_hook.observers == []
    prof.dump_oom_snapshot(from_observer=True)  # CPU: nothing to snapshot
    assert not prof.oom_path.exists() and not prof.oom_observed


def test_cuda_out_of_memory_observer_snapshots_for_the_newest_profiler(
    tmp_path, oom_hook, monkeypatch
):
    """The wiring, on CPU: one observer per process, writing the newest CUDA profiler's oom_path."""
    dumped: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dumped.append)
    first = StepProfiler(None, None, tmp_path / "a", rank=0, device=torch.device("cuda"))
    second = StepProfiler(None, None, tmp_path / "b", rank=3, device=torch.device("cuda"))
    assert first.oom_observer and second.oom_observer and len(oom_hook.observers) == 1
    oom_hook.observers[0](0, 1 << 40, 1 << 30, 0)
    assert dumped == [str(tmp_path / "b" / "rank3_oom.pickle")] and second.oom_observed
    with pytest.raises(torch.cuda.OutOfMemoryError), second.step(1):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    assert len(dumped) == 1, "the observer's snapshot (taken before unwinding) is not overwritten"
    assert not second.oom_observed
    with pytest.raises(torch.cuda.OutOfMemoryError), second.step(2):
        raise torch.cuda.OutOfMemoryError(
            "CUDA out of memory"
        )  # no observer call: snapshot as it leaves
    assert len(dumped) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_profile_and_memory_snapshot(tmp_path):
    prof = StepProfiler(1, 2, tmp_path, rank=0, device=torch.device("cuda"))
    x = torch.randn(256, 256, device="cuda")
    for step in (1, 2):
        with prof.step(step):
            _work(x)
    assert prof.trace_path.exists() and prof.memory_path.stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_out_of_memory_leaves_a_snapshot(tmp_path):
    prof = StepProfiler(None, None, tmp_path, rank=0, device=torch.device("cuda"))
    with pytest.raises(torch.cuda.OutOfMemoryError), prof.step(1):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # a petabyte
    assert prof.oom_path.stat().st_size > 0


# --- the console ------------------------------------------------------------------------------


def test_progress_is_a_bar_on_a_terminal_and_a_line_per_logged_step_in_a_log(tmp_path, capsys):
    on_terminal = MetricsLogger(tmp_path / "a", 10, 0, enabled=True, progress=True, terminal=True)
    assert on_terminal.bar is not None
    on_terminal.close()
    capsys.readouterr()
    in_a_log = MetricsLogger(tmp_path / "b", 10, 0, enabled=True, progress=True, terminal=False)
    assert in_a_log.bar is None
    in_a_log.step(1, {})  # a step that is not logged prints nothing
    for step, record in enumerate(RECORDS, start=2):
        in_a_log.step(step, record)
    in_a_log.close()
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        "step 2/10  loss 5.5000  1,000 tokens/s",
        "step 3/10  loss 4.2500  0 tokens/s",
    ]
    assert "\r" not in out.err + out.out  # no bar redraws in a log file
