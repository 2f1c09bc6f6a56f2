"""Strata: train large transformers with composed parallelism, memory tiers and resharding checkpoints.

The folder `strata/` is the package `strata` with all its subpackages; the top-level folders `parallel`,
`offload`, `checkpoint`, `trainer` and `launch` are symbolic links into it (the repository's layout), and
nothing is packaged through them. Build settings are in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    name="strata-train",
    version="0.2.0",
    description="YAML-driven trainer for large transformer models (TP/PP/DP, ZeRO, offload, checkpoints)",
    python_requires=">=3.10",
    packages=find_packages(include=["strata", "strata.*"]),
    package_data={"strata": ["py.typed"]},
    # torch is pinned by the installer (CPU build on CI: `pip install torch==2.13.0` first);
    # a range that the pinned build satisfies keeps pip from fetching a CUDA build.
    install_requires=[
        "torch>=2.6",
        "numpy>=1.24",
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "safetensors>=0.4",
        "crc32c>=2.3",
        "pyeclib==1.8.0",  # its wheel bundles ISA-L, which checkpoint/erasure.py calls for Reed–Solomon coding
        "tokenizers>=0.19",  # strata data prepare: Hugging Face tokenizers and BPE training
        "pyarrow>=14",  # strata data prepare: .parquet inputs
        "jinja2>=3.1.6",  # strata data prepare: chat templates (sandboxed, as transformers runs them)
    ],
    extras_require={
        # deepspeed: tests/checkpoint/test_deepspeed_import.py has DeepSpeed write a ZeRO checkpoint (CPU, needs g++).
        # Install with torch pinned (pip install -c .ci/constraints.txt ...): it must not replace torch.
        # tensorboard: tests/trainer/test_observability.py reads the event files log.tensorboard writes.
        "test": [
            "pytest>=7",
            "pytest-timeout>=2.3",
            "wandb",
            "tensorboard",
            "megatron-core==0.16.1",
            "deepspeed==0.19.8",
            "transformers>=4.56",  # the reference for Hugging Face import and export (tiny models built offline)
            "peft==0.21.2",  # tests/trainer/test_lora.py: the LoRA reference (logits, a step, exports, import)
            "trl==1.16.0",  # tests/trainer/test_dpo.py: the DPO reference (DPOTrainer's loss and rewards)
            "torchao==0.18.0",  # tests/trainer/test_float8.py: float8 training, emulated on CPU
            # tests/inference/test_harness.py: the strata model of lm-eval against lm-eval's own hf backend
            "lm-eval==0.4.13",
            "accelerate>=1.0",
        ],
        # dev: the tools .ci/check and .ci/package_check run (lint, types, import layers, an editor's import
        # resolution, sdist/wheel build), pinned.
        "dev": [
            "ruff==0.17.6",
            "mypy==2.4.1",
            "import-linter==2.17",
            "build==1.6.1",
            "pyright==1.1.414",
        ],
        "wandb": ["wandb"],
        "fp8": [
            "torchao==0.18.0"
        ],  # train.precision=fp8: torchao's float8 training (torch >= 2.11)
        "tensorboard": ["tensorboard"],  # log.tensorboard
        # strata eval --tasks and python -m strata.inference.harness: lm-evaluation-harness tasks;
        # accelerate for lm-eval's own Hugging Face backend (`--model hf`), the reference on an exported model.
        "eval": ["lm-eval==0.4.13", "accelerate>=1.0"],
    },
    entry_points={"console_scripts": ["strata=strata.launch.cli:main"]},
)
