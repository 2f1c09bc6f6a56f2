"""What a run reports: a progress bar on rank 0, metrics.jsonl in the run directory, and optional
wandb (offline by default; it can never block training)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO

from tqdm import tqdm


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
    ):
        self.enabled = enabled
        self.bar = None
        self.wandb = None
        self.file: IO[str] | None = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if progress:
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
                    loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):,.0f}", refresh=False
                )
        if record:
            self.write({"step": step, **record})

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        assert self.file is not None, "write after close"
        self.file.write(json.dumps({"time": time.time(), **record}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step"))

    def print(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(project: str, run_dir: Path, config: dict | None):
    """wandb in offline mode unless the user set WANDB_MODE; a short init timeout so a bad network
    or key cannot stall the run (training continues without wandb, with a warning)."""
    try:
        import wandb
    except ImportError:
        print("log.wandb is true but wandb is not installed (pip install wandb); continuing without it")
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
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
