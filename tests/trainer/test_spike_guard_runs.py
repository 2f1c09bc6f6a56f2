"""The loss-spike guard never skips an update of, nor stops, a healthy run: the README's CPU demo
(`configs/tiny.yaml` at three seeds: its full 500 steps at its own seed, 1234, in
tests/meta/test_readme.py, which checks them too, and 150 steps for seeds 1 and 2), the MoE demo
(`configs/moe-tiny.yaml`, 150 steps for three seeds) and the README's fine-tune of a Hugging Face
model (`model.init_from`, the README's 50 steps and a 200-step run past the guard's warm-up, three
seeds). `configs/finetune-hf.yaml` needs a 1B model and an NVMe swap file: not a CPU run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from strata import config
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from worlds import REPO


def _no_spikes(cfg_path: Path | None, tmp_path: Path, overrides: list[str]) -> None:
    cfg = config.load(
        str(cfg_path) if cfg_path else None,
        [*overrides, f"log.dir={tmp_path}", "log.name=r", "log.progress=false"],
        world_size=1,
    )
    result = run(cfg, start())  # a stop would raise
    assert result.final_step == cfg.train.steps
    records = [json.loads(x) for x in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if "skipped" in r or "skipped_steps" in r]
    assert skipped == [], skipped


@pytest.mark.slow  # 150 steps: ~35 s on 2 cores (tiny), ~40 s (moe-tiny)
@pytest.mark.parametrize(
    "name, seed, steps",
    [
        # the demo's own 500 steps (seed 1234) run in tests/meta/test_readme.py, which checks
        # they skip no update either
        ("tiny", 1, 150),
        ("tiny", 2, 150),
        ("moe-tiny", 1234, 150),
        ("moe-tiny", 1, 150),
        ("moe-tiny", 2, 150),
    ],
)
def test_the_demos_train_without_a_skipped_update(name, seed, steps, tmp_path):
    _no_spikes(
        REPO / "configs" / f"{name}.yaml",
        tmp_path,
        # evaluation has no part in the guard: one batch, at the end only
        [
            f"train.seed={seed}",
            f"train.steps={steps}",
            "checkpoint.interval=0",
            "train.eval_interval=0",
            "train.eval_batches=1",
        ],
    )


@pytest.fixture(scope="module")
def readme_fine_tune(tmp_path_factory) -> tuple[Path, Path]:
    """The README's tiny Llama and its data: the trainer's sources, a 500-token BPE."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("ft")
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "tiny")
    data = root / "code"
    argv = ["data", "prepare", str(REPO / "strata" / "trainer"), "--glob", "*.py"]
    from strata.launch.cli import main

    assert main([*argv, "--tokenizer", "bpe:500", "--out", str(data)]) == 0
    return root / "tiny", data


@pytest.mark.slow  # 50 steps: ~20 s; 200 steps: ~1 min on 2 cores
@pytest.mark.parametrize("seed", [1234, 1, 2])
@pytest.mark.parametrize("steps", [50, 200])
def test_the_readme_fine_tune_trains_without_a_skipped_update(
    readme_fine_tune, seed, steps, tmp_path
):
    model, data = readme_fine_tune
    overrides = [
        f"model.init_from={model}",
        "model.seq_len=128",
        f"data.path={data}",
        f"train.steps={steps}",
        f"train.seed={seed}",
    ]
    _no_spikes(None, tmp_path, overrides)
