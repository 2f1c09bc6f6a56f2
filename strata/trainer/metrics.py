"""What a run reports: a progress bar on rank 0, metrics.jsonl in the run directory, optional
TensorBoard scalars and optional wandb (offline by default; it can never block training), the
throughput of the steps logged at once (`Interval`), and the peak TFLOP/s that MFU is measured
against."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from tqdm import tqdm

from strata.errors import StrataError
from strata.parallel import comm

# Dense (no structured sparsity) bf16/fp16 tensor-core peaks per device torch sees, in TFLOP/s, from
# the vendors' datasheets: NVIDIA H100 and H200 (SXM 989.4, PCIe 756, NVL 835; the datasheets quote
# twice these "with sparsity"), NVIDIA A100 (312, SXM and PCIe alike), AMD Instinct MI300X (1307.4)
# and MI250X (383 per module, which holds two GCDs that each appear as one device: 191.5 each).
# Matched in order against the upper-cased name torch.cuda.get_device_name() gives, most specific
# first ("NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA GH200 480GB" carries an H100-class GPU).
_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("A100", 312.0),
    ("MI300X", 1307.4),
    ("MI250X", 191.5),
)
# fp8 runs: MFU against the bf16 peak, as torchtitan counts
_TENSOR_CORE_PRECISIONS = ("bf16", "fp16", "fp8")


class MetricsLogger:
    """Rank-0 sink for step metrics. Other ranks get a logger whose methods do nothing."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        enabled: bool,
        progress: bool,
        wandb_project: str | None = None,
        config: dict | None = None,
        tensorboard: bool = False,
        peak_tflops: float | None = None,
        terminal: bool | None = None,
    ):
        """`peak_tflops` (see `mfu_peak`) adds `mfu` to records that carry `tflops_per_rank` but no `mfu`.
        `progress` is a bar on a terminal (`terminal`: whether stderr is one, asked when None); in a log
        file (a Slurm job's, a redirect) a bar's redraws are noise, so each logged step is one line."""
        self.enabled = enabled
        self.bar = None
        self.total_steps = total_steps
        self.lines = False  # progress as one line per logged step
        self.wandb = None
        self.tensorboard: Any = None
        self.peak_tflops = peak_tflops
        self.file: IO[str] | None = None
        self.set_aside: Path | None = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:  # first: a missing package must stop the run before anything is written
            self.tensorboard = _start_tensorboard(run_dir / "tensorboard")
        self.set_aside = (
            _set_aside_earlier_log(run_dir / "metrics.jsonl") if start_step == 0 else None
        )
        self.file = open(run_dir / "metrics.jsonl", "a")
        on_terminal = sys.stderr.isatty() if terminal is None else terminal
        self.lines = progress and not on_terminal
        if progress and on_terminal:
            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                desc=run_dir.name,
                mininterval=0.5,
            )
        if wandb_project:
            self.wandb = _start_wandb(wandb_project, run_dir, config)

    def step(self, step: int, record: dict) -> None:
        """Advance the bar; `record` (if non-empty) goes to the JSONL file and wandb."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if "loss" in record:
                self.bar.set_postfix(
                    loss=f"{record['loss']:.4f}",
                    tok_s=f"{record.get('tokens_per_s', 0):,.0f}",
                    refresh=False,
                )
        elif self.lines and "loss" in record:
            loss = record["loss"]
            shown = f"{loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else str(loss)
            print(
                f"step {step}/{self.total_steps}  loss {shown}  "
                f"{record.get('tokens_per_s', 0):,.0f} tokens/s",
                flush=True,
            )
        if record:
            self.write({"step": step, **record})

    def write(self, record: dict) -> None:
        """One line of metrics.jsonl, and the record's numbers to TensorBoard and wandb. A non-finite
        number (a skipped step's NaN loss) is written as null: JSON has no NaN, and strict parsers
        reject the `NaN` json.dumps would write."""
        if not self.enabled:
            return
        assert self.file is not None, "write after close"
        if self.peak_tflops and "tflops_per_rank" in record and "mfu" not in record:
            record = {**record, "mfu": record["tflops_per_rank"] / self.peak_tflops}
        self.file.write(
            json.dumps(_json_safe({"time": time.time(), **record}), allow_nan=False) + "\n"
        )
        self.file.flush()
        scalars = dict(flat_scalars(record))
        step = record.get("step")
        if self.tensorboard is not None and isinstance(step, int):
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, global_step=step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def print(self, text: str) -> None:
        """Show `text` on rank 0's console, above the progress bar when there is one."""
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        """Close the progress bar, metrics.jsonl and the TensorBoard and wandb writers."""
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


class Interval:
    """The steps logged at once (every log.interval): how many, since when, and the bytes each link
    level carried since, for their throughput."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, world_size: int) -> None:
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.world_size = world_size
        self.links = Counter(comm.bytes_by_link)
        self.restart()

    def restart(self) -> None:
        """The next interval's clock and step count start now."""
        self.start, self.steps = time.perf_counter(), 0

    def measure(self) -> dict:
        """The interval's tokens/s, TFLOP/s per rank, step time and bytes per step on each link
        level; the bytes count afresh from here."""
        seconds = time.perf_counter() - self.start
        moved = Counter(comm.bytes_by_link) - self.links
        self.links = Counter(comm.bytes_by_link)
        tokens_per_s = self.steps * self.tokens_per_step / max(seconds, 1e-9)
        return {
            "tokens_per_s": tokens_per_s,
            "tflops_per_rank": tokens_per_s * self.flops_per_token / 1e12 / self.world_size,
            "step_time_s": seconds / self.steps,
            "wire_bytes_per_step": {link: n / self.steps for link, n in sorted(moved.items())},
        }


def flat_scalars(record: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numbers of a metrics record as (tag, value), nested dicts joined with '/'
    (`wire_bytes_per_step/node`): the scalar view TensorBoard and wandb plot. `step` and `time` are
    the axes, not figures; booleans and text are left out."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flat_scalars(value, tag + "/")
        elif (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and tag not in ("step", "time")
        ):
            yield tag, float(value)


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float (in dicts and lists too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _start_tensorboard(log_dir: Path) -> Any:
    """torch's SummaryWriter, which needs the optional `tensorboard` package: asked for and
    missing, the run stops with how to install it (rather than training for hours without it)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise StrataError(
            f"log.tensorboard is true but the tensorboard package is not installed ({e}); "
            "install it with: pip install strata-train[tensorboard] (or set log.tensorboard=false)"
        ) from e
    return SummaryWriter(log_dir=str(log_dir))


def _set_aside_earlier_log(path: Path) -> Path | None:
    """A run starting at step 0 writes a metrics.jsonl of its own: an earlier run's (one replaced with
    checkpoint.overwrite, or one that saved no checkpoint) is renamed beside it, kept, rather than
    mixed into the new run's curves. Returns its new name."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    target = path.with_name(f"metrics-{stamp}.jsonl")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"metrics-{stamp}-{n}.jsonl")
    path.rename(target)
    return target


def peak_tflops(device: str | None, precision: str) -> float | None:
    """The dense peak TFLOP/s of the device named `device` (torch.cuda.get_device_name()) at
    `precision`, or None when not known: a CPU (None), a GPU not in the table, or fp32 (whose
    matmuls run at the TF32 or plain-FP32 rate depending on torch's settings, so no one figure is right)."""
    if device is None or precision not in _TENSOR_CORE_PRECISIONS:
        return None
    name = device.upper()
    return next((peak for part, peak in _BF16_PEAKS if part in name), None)


def mfu_peak(
    configured: float | None, device: torch.device, precision: str
) -> tuple[float | None, str]:
    """The peak MFU is measured against, and a line for the log saying where it came from (or why
    there is no MFU): `log.peak_tflops` when set, else the table's figure for this GPU."""
    if configured:
        return configured, f"mfu: against log.peak_tflops={configured:g} TFLOP/s per device"
    if device.type != "cuda":
        return None, f"mfu: not reported on {device.type} (set log.peak_tflops to report it)"
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops(name, precision)
    if peak is None:
        return (
            None,
            f"mfu: no known {precision} peak for {name!r}; not reported (set log.peak_tflops to "
            "report it)",
        )
    kind = "bf16" if precision == "fp8" else precision
    return (
        peak,
        f"mfu: against {peak:g} TFLOP/s, the dense {kind} peak of {name!r} (log.peak_tflops "
        "overrides)",
    )


def _start_wandb(project: str, run_dir: Path, config: dict | None):
    """wandb in offline mode unless the user set WANDB_MODE; a short init timeout so a bad network
    or key cannot stall the run (training continues without wandb, with a warning)."""
    try:
        import wandb
    except ImportError:
        print(
            "log.wandb is true but wandb is not installed (pip install wandb); continuing "
            "without it"
        )
        return None
    os.environ.setdefault("WANDB_MODE", "offline")
    try:
        return wandb.init(
            project=project,
            name=run_dir.name,
            dir=str(run_dir),
            config=config,
            settings=wandb.Settings(init_timeout=30),
        )
    except Exception as e:  # wandb raises many types; none of them may stop training
        print(f"wandb init failed ({e}); continuing without it")
        return None


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl (none without one), blank lines skipped: what the logger
    wrote, read back whole (`strata plot` reads through `plots.read_metrics`, which also
    tolerates a cut-off last line)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
