"""The loss-spike guard never skips an update of, nor stops, a healthy run: the README's CPU demo
(`configs/tiny.yaml` at three seeds: its full 500 steps at its own seed, 1234, in
tests/meta/test_readme.py, which checks them too, and 150 steps for seeds 1 and 2), the MoE demo
(`configs/moe-tiny.yaml`, 150 steps for three seeds) and the README's fine-tune of a Hugging Face
model (`model.init_from`, the README's 50 steps and a 200-step run past the guard's warm-up, three
seeds). `configs/finetune-hf.yaml` needs a 1B model and an NVMe swap file: not a CPU run."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from strata import config

from worlds import REPO, strata


def _no_spikes(cfg_path: Path | None, tmp_path: Path, runs: dict[str, list[str]]) -> None:
    """`strata train` of each of `runs` (name: its overrides) at once, each in a process of its own
    on one thread (these tiny models gain little from a second one; two runs on 2 cores finish in
    about the time of one): each ends at its last step with no update skipped."""
    if cfg_path is None:  # the defaults with the overrides
        cfg_path = tmp_path / "experiment.yaml"
        cfg_path.write_text("{}\n")
    common = ["log.progress=false", "train.threads=1", f"log.dir={tmp_path}"]
    argv = {
        name: ["train", str(cfg_path), *over, *common, f"log.name={name}"]
        for name, over in runs.items()
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        done = dict(
            zip(argv, pool.map(lambda a: strata(*a, env={"OMP_NUM_THREADS": "1"}), argv.values()))
        )
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
        cfg = config.load(str(cfg_path), [*runs[name], *common])
        records = [
            json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        assert max(r.get("step", 0) for r in records) == cfg.train.steps, name
        skipped = [r for r in records if "skipped" in r or "skipped_steps" in r]
        assert skipped == [], (name, skipped)


@pytest.mark.slow  # 150 steps each, the seeds at once: ~45 s (tiny), ~70 s (moe-tiny) on 2 cores
@pytest.mark.parametrize(
    "name, seeds",
    [
        # the demo's own 500 steps (seed 1234) run in tests/meta/test_readme.py, which checks
        # they skip no update either
        ("tiny", [1, 2]),
        ("moe-tiny", [1234, 1, 2]),
    ],
)
def test_the_demos_train_without_a_skipped_update(name, seeds, tmp_path):
    # evaluation has no part in the guard: one batch, at the end only
    settings = ["train.steps=150", "checkpoint.interval=0", "train.eval_interval=0"]
    runs = {f"seed{s}": [f"train.seed={s}", *settings, "train.eval_batches=1"] for s in seeds}
    _no_spikes(REPO / "configs" / f"{name}.yaml", tmp_path, runs)


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


@pytest.mark.slow  # 50 steps: ~20 s; 200 steps: ~1 min on 2 cores; the seeds at once
@pytest.mark.parametrize("steps", [50, 200])
def test_the_readme_fine_tune_trains_without_a_skipped_update(readme_fine_tune, steps, tmp_path):
    model, data = readme_fine_tune
    overrides = [
        f"model.init_from={model}",
        "model.seq_len=128",
        f"data.path={data}",
        f"train.steps={steps}",
    ]
    runs = {f"seed{s}": [*overrides, f"train.seed={s}"] for s in (1234, 1, 2)}
    _no_spikes(None, tmp_path, runs)
