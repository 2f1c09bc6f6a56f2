"""Strata: train large transformers with composed parallelism, memory tiers and resharding checkpoints."""
from setuptools import setup

setup(
    name="strata",
    version="0.1.0",
    description="YAML-driven trainer for large transformer models (TP/PP/DP, ZeRO, offload, checkpoints)",
    python_requires=">=3.10",
    packages=["trainer", "parallel", "offload", "checkpoint", "launch"],
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
    ],
    extras_require={
        # deepspeed: tests/test_deepspeed_import.py has DeepSpeed write a ZeRO checkpoint (CPU, needs g++).
        # Install with torch pinned (pip install -c .ci/constraints.txt ...): it must not replace torch.
        "test": ["pytest>=7", "wandb", "megatron-core==0.16.1", "deepspeed==0.19.8"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["strata=launch.cli:main"]},
)
