"""Every single-GPU figure of docs/BENCHMARKS.md in one prepared command, for a lent H100/H200.

The rows, in order of importance, each a subprocess with its own time budget (the budgets add up to
8 minutes; a row may also use what the rows before it left unused). A row that fails or runs out of
time is recorded as failed, with the tail of its output, and the next row runs:

  setup       carried wheels into /tmp/site (on PYTHONPATH for every row), `pip install -e .` unless
              `import strata` works, the built-in corpus; torch, GPU, capability, what imports
  peak        the measured bf16 matmul peak (bench/compile.py's), and an fp8 one (torch._scaled_mm,
              e4m3, tensorwise scales) on capability >= 8.9
  mfu         bench/compile.py's 1b preset (configs/llama-1b.yaml's shape, bf16, 8 x 2048 tokens):
              eager, compiled, compiled-selective; MFU against the measured bf16 peak (goal >= 45%)
  peer        plain PyTorch on the same model (strata.model.GPT), batch and precision: FSDP2 (a world
              of one, NCCL, bf16 params, fp32 reduce), each block compiled (torchtitan's regional
              compile), fused AdamW; Strata compiled / peer tokens/s (goal >= 1.0). torchtitan itself
              is only probed: the packages it needs (torchdata, datasets, tyro, ...) are not there
  fp8-speed   the 1b preset, compiled-fp8 (tensorwise) and compiled-fp8-rowwise against compiled bf16
              (goal >= 1.25x)
  fp8-loss    200 steps, same data and seed, the 1b preset cut to 4 layers and seq 1024 (to fit the
              time): compiled fp8 against compiled bf16, final loss (mean of the last 10 steps) within 1%
  fp8-resume  `strata train` on a small model: fp8 saves a checkpoint, bf16 resumes it, and the reverse
  gpu-tests   `pytest -m gpu tests -x`: the tests that need a GPU
  checkpoint  bench/checkpoint_vs_dcp.py --device cuda --rounds 2: Strata's save stall against dcp.save
              (goal: 50x below)
  moe         bench/moe_layer.py, bf16, a Qwen3-30B-A3B-shaped layer (d_model 2048, 64 experts of 768,
              top 8, 16384 tokens): the experts' grouped matmul against the per-expert loop, and the
              layer's step against transformers' Qwen3MoeSparseMoeBlock (goal <= 1.0)
  generate    bench/generate.py, bf16, a 16-layer d_model 2048 Llama: greedy decoding of 8 and of 1
              prompt(s), 128 new tokens each, tokens/s against transformers' generate (goal >= 1.0)

Results go to --out (default $OUT if set, else bench/gpu-results/): results.json, results.md (the
table) and log.txt (every row's whole output), rewritten after each row, and the table is printed.

The device command (a later session; `.whl/` filled here first with --fetch-wheels):

    run(command="PYTHONUNBUFFERED=1 python3 bench/gpu.py", carry=[".whl"], timeout_s=590)

Here, on the CPU, before it:

    python bench/gpu.py --fetch-wheels     # torchao, crc32c, pyeclib, torchtitan wheels into .whl/
    python bench/gpu.py --dry-run          # every row's commands, compile.py's names, the wheels'
                                           # requirements against the lent image, the 64 MiB limit
    python bench/gpu.py --only peak,mfu    # some rows (setup always runs); --skip ROW[,ROW]
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEVICE_COMMAND = (
    'run(command="PYTHONUNBUFFERED=1 python3 bench/gpu.py", carry=[".whl"], timeout_s=590)'
)
TOTAL_BUDGET_S = 480  # the rows' budgets add up to this: 8 minutes of a 15-minute lease
TRAVEL_LIMIT = 64 * 2**20  # what one device call may carry
MARK = "GPU-BENCH "  # a row's result lines on its stdout: JSON objects, merged in order

GOALS = {"mfu": 0.45, "peer": 1.0, "fp8_speed": 1.25, "fp8_loss": 0.01, "checkpoint": 50.0}


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    required: bool
    why: str


WHEELS = (
    Wheel("torchao", "0.18.0", True, "FP8 training (train.precision=fp8: torchao float8 linears)"),
    Wheel(
        "crc32c",
        "2.7.1",
        True,
        "Strata's install_requires (checkpoint CRCs), not in the lent image",
    ),
    Wheel(
        "pyeclib",
        "1.8.0",
        True,
        "Strata's install_requires (erasure-coded snapshots), not in the lent image",
    ),
    Wheel(
        "torchtitan",
        "0.3.0",
        False,
        "the peer, if it imports there (unlikely: its own needs are not in the image)",
    ),
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
MORE_PLATFORMS = (
    "manylinux_2_24_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)

# The lent machines' image ('cuda'): /work/.library/device/KINDS.md, "Python packages already there"
# (read 2026-11-17), and the versions its "pip list" row gives. Python 3.12.3, x86-64 Linux.
IMAGE_PYTHON = "3.12.3"
IMAGE_PACKAGES = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
    pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
    sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
    tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
    treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
    xarray xxhash yarl zipp""".split()
)
IMAGE_VERSIONS = {
    "accelerate": "1.15.0",
    "botorch": "0.18.1",
    "cupy-cuda13x": "14.2.0",
    "gpytorch": "1.15.2",
    "huggingface-hub": "1.33.0",
    "jax": "0.11.2",
    "jaxlib": "0.11.2",
    "jaxtyping": "0.3.11",
    "numpy": "2.5.2",
    "numpyro": "0.21.0",
    "onnx": "1.23.1",
    "onnxruntime": "1.30.0",
    "onnxscript": "0.7.2",
    "pytorch-lightning": "2.6.6",
    "safetensors": "0.8.0",
    "sentence-transformers": "6.0.1",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "torch-geometric": "2.8.0.post1",
    "torchaudio": "2.11.0",
    "torchdiffeq": "0.2.5",
    "torchmetrics": "1.9.0",
    "torchvision": "0.26.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}

# --- what the rows run -------------------------------------------------------------------------

PRESET = "1b"  # bench/compile.py's: configs/llama-1b.yaml's model, bf16, 8 x 2048 tokens a step
MFU_VARIANTS = ("eager", "compiled", "compiled-selective")
FP8_VARIANTS = ("compiled-fp8", "compiled-fp8-rowwise")
LOSS_VARIANTS = ("compiled", "compiled-fp8")
LOSS_SHAPE = (
    "model.n_layers=4",
    "model.seq_len=1024",
)  # the 1b preset's width, fewer layers, shorter
LOSS_TAIL = 10  # final loss: the mean of the last this-many steps
RESUME_MODEL = {
    "model.n_layers": 2,
    "model.d_model": 1024,
    "model.n_heads": 16,
    "model.n_kv_heads": 4,
    "model.ffn_hidden": 2816,
    "model.seq_len": 512,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 8,
    "train.eval_interval": 0,
    "train.eval_batches": 1,
    "optim.lr": 3e-4,
    "optim.warmup_steps": 2,
    "log.interval": 1,
    "log.progress": False,
}
RESUME_SAVE_STEPS, RESUME_MORE_STEPS = 6, 3
RESUME_CHAINS = (("fp8", "bf16"), ("bf16", "fp8"))
PRECISION = {
    "fp8": {"train.precision": "fp8", "train.fp8_recipe": "tensorwise", "train.compile": True},
    "bf16": {"train.precision": "bf16", "train.compile": False},
}
CHECKPOINT_ARGS = ("--device", "cuda", "--rounds", "2", "--d-model", "1024", "--layers", "8")
CARRIED_IMPORTS = ("strata", "torchao", "crc32c", "pyeclib", "torchtitan")


@dataclass
class Ctx:
    """What a row's commands depend on: settings, and what earlier rows found."""

    python: str = sys.executable
    wheels: str = str(ROOT / ".whl")
    site: str = "/tmp/site"
    work: str = ""  # this run's scratch directory
    data: str | None = None  # the built-in corpus (setup prepares it)
    peak: float | None = None  # bf16 TFLOP/s (the peak row)
    steps: int = 10
    warmup: int = 3
    loss_steps: int = 200
    results: dict = field(default_factory=dict)

    def wheel_files(self) -> list[Path]:
        return sorted(Path(self.wheels).glob("*.whl"))


def compile_cmd(
    ctx: Ctx, variant: str, steps: int, warmup: int, extra: tuple[str, ...] = ()
) -> list[str]:
    """bench/compile.py's worker for one variant of the 1b preset (prints `RESULT {json}`)."""
    cmd = [
        ctx.python,
        str(BENCH / "compile.py"),
        "--worker",
        "--variant",
        variant,
        "--preset",
        PRESET,
    ]
    cmd += [
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--data",
        ctx.data or "<corpus>",
        "--device",
        "cuda",
    ]
    if ctx.peak:
        cmd += ["--peak", f"{ctx.peak:.1f}"]
    for item in extra:
        cmd += ["--set", item]
    return cmd


def peer_cmd(ctx: Ctx) -> list[str]:
    return [
        ctx.python,
        str(Path(__file__).resolve()),
        "--peer-worker",
        "--preset",
        PRESET,
        "--device",
        "cuda",
    ] + [
        "--steps",
        str(ctx.steps),
        "--warmup",
        str(ctx.warmup),
    ]


def kv(values: dict[str, Any]) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def resume_overrides(ctx: Ctx, first: str, second: str) -> tuple[list[str], list[str], Path]:
    """The saving run's and the resuming run's overrides (on configs/tiny.yaml), and the chain's dir."""
    chain = Path(ctx.work or "<work>") / f"resume-{first}-{second}"
    save = {
        **RESUME_MODEL,
        **PRECISION[first],
        "train.steps": RESUME_SAVE_STEPS,
        "checkpoint.interval": RESUME_SAVE_STEPS,
        "checkpoint.save_final": False,
        "checkpoint.dir": chain / "ckpt",
        "log.dir": chain,
        "log.name": "save",
    }
    resume = {
        **RESUME_MODEL,
        **PRECISION[second],
        "train.steps": RESUME_SAVE_STEPS + RESUME_MORE_STEPS,
        "checkpoint.interval": 0,
        "checkpoint.save_final": False,
        "checkpoint.dir": chain / "ckpt-resumed",
        "log.dir": chain,
        "log.name": "resume",
    }
    return kv(save), kv(resume), chain


def resume_cmds(ctx: Ctx, first: str, second: str) -> list[list[str]]:
    save, resume, chain = resume_overrides(ctx, first, second)
    train = [ctx.python, "-m", "strata.launch.cli", "train", str(ROOT / "configs" / "tiny.yaml")]
    return [train + save, train + resume + ["--resume", str(chain / "ckpt")]]


def pip_wheels_cmd(ctx: Ctx) -> list[str]:
    return [
        ctx.python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
    ] + [
        "--upgrade",
        "--target",
        ctx.site,
        *map(str, ctx.wheel_files() or [Path(ctx.wheels) / "*.whl"]),
    ]


def pip_strata_cmd(ctx: Ctx) -> list[str]:
    return [
        ctx.python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-e",
        ".",
    ]


CORPUS = "from strata.data.prepare import ensure_default_corpus; print('CORPUS', ensure_default_corpus(None, 0.05))"
PROBE = r"""import importlib, json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        out["gpu"] = torch.cuda.get_device_name()
        out["capability"] = list(torch.cuda.get_device_capability())
        out["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
except Exception as e:
    out["torch_error"] = repr(e)[:300]
mods = {}
for name in sys.argv[1:]:
    try:
        m = importlib.import_module(name)
        mods[name] = str(getattr(m, "__version__", "imported"))
    except BaseException as e:
        mods[name] = "not importable: " + (str(e).splitlines() or [repr(e)])[0][:300]
out["imports"] = mods
print("PROBE " + json.dumps(out))
"""
# torchtitan's trainer and Llama model: what running it as the peer would import first
TITAN_PROBE = "import torchtitan, torchtitan.train, torchtitan.models.llama3; print('TITAN', torchtitan.__file__)"


def pytest_cmd(ctx: Ctx) -> list[str]:
    return [
        ctx.python,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "tests",
        "-x",
        "-p",
        "no:cacheprovider",
        "--timeout=120",
    ]


MOE_ARGS = (
    "--device",
    "cuda",
    "--dtype",
    "bf16",
    "--d-model",
    "2048",
    "--ffn",
    "768",
    "--experts-n",
    "64",
)
MOE_ARGS += ("--top-k", "8", "--tokens", "16384", "--reps", "10")


def moe_cmd(ctx: Ctx) -> list[str]:
    return [ctx.python, str(BENCH / "moe_layer.py"), *MOE_ARGS]


GENERATE_ARGS = (
    "--device",
    "cuda",
    "--dtype",
    "bf16",
    "--layers",
    "16",
    "--d-model",
    "2048",
    "--heads",
    "16",
)
GENERATE_ARGS += (
    "--kv-heads",
    "8",
    "--vocab",
    "32000",
    "--new",
    "128",
    "--batches",
    "8,1",
    "--reps",
    "2",
)


def generate_cmd(ctx: Ctx) -> list[str]:
    out = Path(ctx.work or "<work>") / "generate.json"
    return [ctx.python, str(BENCH / "generate.py"), *GENERATE_ARGS, "--out", str(out)]


def checkpoint_cmd(ctx: Ctx) -> list[str]:
    out = Path(ctx.work or "<work>") / "checkpoint.json"
    return [ctx.python, str(BENCH / "checkpoint_vs_dcp.py"), *CHECKPOINT_ARGS, "--out", str(out)]


@dataclass(frozen=True)
class Row:
    name: str
    budget_s: int
    what: str
    commands: Callable[[Ctx], list[list[str]]]  # what the row runs (the dry run builds them all)
    needs: tuple[str, ...] = ()


ROWS = (
    Row(
        "setup",
        30,
        "carried wheels, strata installed, the corpus; torch, GPU, what imports",
        lambda c: [
            pip_wheels_cmd(c),
            pip_strata_cmd(c),
            [c.python, "-c", CORPUS],
            [c.python, "-c", PROBE],
        ],
    ),
    Row("peak", 15, "bf16 and fp8 matmul peaks (8192^3, fastest half of 20)", lambda c: []),
    Row(
        "mfu",
        110,
        f"{PRESET} preset, {' / '.join(MFU_VARIANTS)}: tokens/s, MFU against the measured bf16 peak",
        lambda c: [compile_cmd(c, v, c.steps, c.warmup) for v in MFU_VARIANTS],
        needs=("peak",),
    ),
    Row(
        "peer",
        50,
        "plain PyTorch: FSDP2 (world of one) + per-block torch.compile + fused AdamW, same model and batch",
        lambda c: [[c.python, "-c", TITAN_PROBE], peer_cmd(c)],
    ),
    Row(
        "fp8-speed",
        90,
        f"{PRESET} preset, {' / '.join(FP8_VARIANTS)} against compiled bf16",
        lambda c: [compile_cmd(c, v, c.steps, c.warmup) for v in FP8_VARIANTS],
    ),
    Row(
        "fp8-loss",
        50,
        f"{{steps}} steps, 1b width, {', '.join(LOSS_SHAPE)}: fp8 final loss against bf16 (both compiled, at once)",
        lambda c: [compile_cmd(c, v, c.loss_steps, 3, LOSS_SHAPE) for v in LOSS_VARIANTS],
    ),
    Row(
        "fp8-resume",
        45,
        "strata train: fp8 saves, bf16 resumes; bf16 saves, fp8 resumes (both chains at once)",
        lambda c: [cmd for first, second in RESUME_CHAINS for cmd in resume_cmds(c, first, second)],
    ),
    Row("gpu-tests", 25, "pytest -m gpu tests -x", lambda c: [pytest_cmd(c)]),
    Row(
        "checkpoint",
        25,
        "checkpoint_vs_dcp.py on the GPU: Strata's save stall against dcp.save",
        lambda c: [checkpoint_cmd(c)],
    ),
    Row(
        "moe",
        20,
        "moe_layer.py on the GPU: grouped matmul against the per-expert loop",
        lambda c: [moe_cmd(c)],
    ),
    Row(
        "generate",
        20,
        "generate.py on the GPU, bf16: decoding tokens/s against transformers' generate",
        lambda c: [generate_cmd(c)],
    ),
)
ROW_NAMES = tuple(r.name for r in ROWS)


def row_cmd(ctx: Ctx, row: Row, state: Path) -> list[str]:
    return [ctx.python, str(Path(__file__).resolve()), "--row", row.name, "--state", str(state)]


def build_plan(ctx: Ctx, rows: tuple[Row, ...] = ROWS) -> list[dict]:
    """Each row with its budget, its own command and the commands it runs inside."""
    state = Path(ctx.work or "<work>") / "state.json"
    return [
        {
            "name": r.name,
            "budget_s": r.budget_s,
            "command": row_cmd(ctx, r, state),
            "inner": r.commands(ctx),
        }
        for r in rows
    ]


def load_compile_bench() -> Any:
    """bench/compile.py as a module (its presets, variants, overrides and matmul peak)."""
    spec = importlib.util.spec_from_file_location("strata_bench_compile", BENCH / "compile.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def child_env(ctx: Ctx) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if ctx.wheel_files():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ctx.site, env.get("PYTHONPATH", "")) if p)
    return env


# --- inside a row (a child process) ---------------------------------------------------------------


def emit(data: dict) -> None:
    print(MARK + json.dumps(data), flush=True)


def stream(cmd: list[str], env: dict[str, str], prefix: str = "") -> tuple[int, list[str]]:
    """Run cmd (in this row's process group, which the parent kills at the row's deadline), relaying
    its output line by line; return its exit status and its lines."""
    print(f"{prefix}$ {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
    return proc.wait(), lines


def tail(lines: list[str], n: int = 2500) -> str:
    return "".join(lines)[-n:]


def tagged(lines: list[str], tag: str) -> dict | None:
    found = [line[len(tag) :] for line in lines if line.startswith(tag)]
    return json.loads(found[-1]) if found else None


def in_parallel(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run the jobs in threads (each starts its own processes) and return their results by name."""
    out: dict[str, Any] = {}

    def go(name: str, job: Callable[[], Any]) -> None:
        try:
            out[name] = job()
        except Exception as exc:  # recorded, not raised: the other job goes on
            out[name] = exc

    threads = [threading.Thread(target=go, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def corpus(ctx: Ctx) -> str:
    if not ctx.data:
        from strata.data.prepare import ensure_default_corpus

        ctx.data = str(ensure_default_corpus(None, 0.05))
    return ctx.data


def run_compile_variant(ctx: Ctx, env: dict, cmd: list[str], variant: str) -> dict:
    rc, lines = stream(cmd, env, f"[{variant}] ")
    result = tagged(lines, "RESULT ")
    if rc or result is None:
        return {"error": f"exit {rc}", "tail": tail(lines)}
    if ctx.peak:
        result["mfu"] = result["model_tflops"] / ctx.peak
    return result


def row_setup(ctx: Ctx) -> bool:
    env = child_env(ctx)
    wheels = ctx.wheel_files()
    ok = True
    if wheels:
        rc, lines = stream(pip_wheels_cmd(ctx), env)
        emit({"wheels": [w.name for w in wheels], "wheels_installed": rc == 0, "site": ctx.site})
        ok &= rc == 0
    else:
        emit(
            {
                "wheels": [],
                "note": f"no wheels in {ctx.wheels}: nothing carried (FP8 rows need torchao)",
            }
        )
    if strata_imports(ctx, env):
        emit({"strata_installed": "already importable"})
    else:
        rc, lines = stream(pip_strata_cmd(ctx), env)
        how = "editable install"
        if rc or not strata_imports(
            ctx, env
        ):  # no editable install: a plain one into the carried site
            rc, lines = stream(pip_strata_cmd(ctx)[:-2] + ["--target", ctx.site, "."], env)
            how = f"installed into {ctx.site}"
        if not strata_imports(ctx, env):
            root = {
                **env,
                "PYTHONPATH": os.pathsep.join(
                    p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p
                ),
            }
            if strata_imports(ctx, root):  # strata/ at the root of the tree: importable from there
                emit({"pythonpath_root": True})
                env, how = (
                    root,
                    f"not installed (exit {rc}); the repository root on PYTHONPATH instead",
                )
            else:
                how, ok = f"failed (exit {rc}): strata does not import", False
        emit({"strata_installed": how})
    rc, lines = stream([ctx.python, "-c", CORPUS], env)
    data = next(
        (line.split(None, 1)[1].strip() for line in lines if line.startswith("CORPUS ")), None
    )
    emit({"data": data})
    ok &= data is not None
    rc, lines = stream([ctx.python, "-c", PROBE, *CARRIED_IMPORTS], env)
    probe = tagged(lines, "PROBE ")
    emit({"probe": probe or {"error": tail(lines)}})
    return ok and bool(probe and probe.get("cuda"))


def strata_imports(ctx: Ctx, env: dict[str, str]) -> bool:
    """Whether strata and its layers import from outside the tree (as bench scripts import them)."""
    check = "import strata.config, strata.trainer, strata.launch, strata.checkpoint"
    return (
        subprocess.run([ctx.python, "-c", check], env=env, cwd="/", capture_output=True).returncode
        == 0
    )


def fp8_matmul_peak_tflops() -> float:
    """e4m3 8192^3 torch._scaled_mm (tensorwise scales, bf16 out, fast accumulation), timed as
    bench/compile.py's bf16 peak: the mean of the fastest half of 20 products."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = (
        torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    )  # column-major, as _scaled_mm wants
    one = torch.tensor(1.0, device="cuda")

    def mm() -> Any:
        return torch._scaled_mm(
            a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True
        )

    for _ in range(5):
        mm()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        mm()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.fmean(sorted(times)[:10]) / 1e12


def row_peak(ctx: Ctx) -> bool:
    import torch

    if not torch.cuda.is_available():
        emit({"error": "torch sees no GPU"})
        return False
    emit(
        {
            "gpu": torch.cuda.get_device_name(),
            "bf16_tflops": load_compile_bench().matmul_peak_tflops(),
        }
    )
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        emit({"fp8_tflops": None, "fp8_note": f"capability {capability}: no fp8 tensor cores"})
        return True
    try:
        emit({"fp8_tflops": fp8_matmul_peak_tflops()})
    except Exception as exc:  # torch._scaled_mm's signature has moved between releases
        emit({"fp8_tflops": None, "fp8_error": repr(exc)[:500]})
        return False
    return True


def run_variants(ctx: Ctx, variants: tuple[str, ...]) -> bool:
    env, ok = child_env(ctx), True
    corpus(ctx)
    for v in variants:
        result = run_compile_variant(ctx, env, compile_cmd(ctx, v, ctx.steps, ctx.warmup), v)
        emit({"variants": {v: result}})
        ok &= "error" not in result
    return ok


def row_mfu(ctx: Ctx) -> bool:
    return run_variants(ctx, MFU_VARIANTS)


def row_fp8_speed(ctx: Ctx) -> bool:
    return run_variants(ctx, FP8_VARIANTS)


def row_peer(ctx: Ctx) -> bool:
    env = child_env(ctx)
    probe = subprocess.run(
        [ctx.python, "-c", TITAN_PROBE], env=env, cwd=ROOT, capture_output=True, text=True
    )
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1][:300]
        titan = f"not run: torchtitan does not import here ({last}); the plain FSDP2 peer stands in"
    else:
        titan = (
            "importable, not run: its trainer wants its own TOML job config, tokenizer and dataset; "
            "the plain FSDP2 peer below does what its llama3 recipe does on one GPU"
        )
    emit({"torchtitan": titan})
    rc, lines = stream(peer_cmd(ctx), env, "[peer] ")
    result = tagged(lines, "RESULT ")
    if rc or result is None:
        emit({"error": f"exit {rc}", "tail": tail(lines)})
        return False
    emit({"result": result})
    return True


def row_fp8_loss(ctx: Ctx) -> bool:
    env = child_env(ctx)
    corpus(ctx)
    jobs = {
        v: (
            lambda v=v: run_compile_variant(
                ctx, env, compile_cmd(ctx, v, ctx.loss_steps, 3, LOSS_SHAPE), v
            )
        )
        for v in LOSS_VARIANTS
    }
    ok = True
    for v, result in in_parallel(jobs).items():
        if isinstance(result, Exception):
            result = {"error": repr(result)}
        if "losses" in result:
            result["final_loss"] = statistics.fmean(result["losses"][-LOSS_TAIL:])
        emit({"variants": {v: {k: result[k] for k in result if k != "step_times_s"}}})
        ok &= "final_loss" in result
    return ok


def read_losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    losses = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if (
                "loss" in record
                and isinstance(record.get("step"), int)
                and record["loss"] is not None
            ):
                losses[record["step"]] = record["loss"]
    return losses


def row_fp8_resume(ctx: Ctx) -> bool:
    env = child_env(ctx)

    def chain(first: str, second: str) -> dict:
        save, resume = resume_cmds(ctx, first, second)
        name = f"{first}->{second}"
        out: dict = {}
        rc, lines = stream(save, env, f"[{name} save] ")
        out["save_exit"] = rc
        if rc:
            return {**out, "tail": tail(lines)}
        rc, lines = stream(resume, env, f"[{name} resume] ")
        out["resume_exit"] = rc
        out["resumed_from_seen"] = any("resumed from" in line for line in lines)
        directory = resume_overrides(ctx, first, second)[2]
        saved, resumed = read_losses(directory / "save"), read_losses(directory / "resume")
        out["saved_last_loss"] = saved.get(RESUME_SAVE_STEPS)
        out["resumed_losses"] = [resumed[s] for s in sorted(resumed) if s > RESUME_SAVE_STEPS]
        out["resumed_first_step"] = min((s for s in resumed if s > RESUME_SAVE_STEPS), default=None)
        if rc:
            out["tail"] = tail(lines)
        return out

    ok = True
    for name, result in in_parallel(
        {f"{a}->{b}": (lambda a=a, b=b: chain(a, b)) for a, b in RESUME_CHAINS}
    ).items():
        if isinstance(result, Exception):
            result = {"error": repr(result)}
        result["ran"] = (
            result.get("save_exit") == 0
            and result.get("resume_exit") == 0
            and result.get("resumed_first_step") == RESUME_SAVE_STEPS + 1
        )
        emit({"chains": {name: result}})
        ok &= result["ran"]
    return ok


def row_gpu_tests(ctx: Ctx) -> bool:
    rc, lines = stream(pytest_cmd(ctx), child_env(ctx))
    summary = next(
        (
            line
            for line in reversed(lines)
            if re.search(r"\d+ (passed|failed|error|deselected)", line)
        ),
        "",
    )
    counts = {
        k: int(n)
        for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary)
    }
    emit({"exit": rc, "summary": summary.strip(" =\n"), **counts})
    if rc:
        emit({"tail": tail(lines)})
    return rc == 0


def row_checkpoint(ctx: Ctx) -> bool:
    cmd = checkpoint_cmd(ctx)
    rc, lines = stream(cmd, child_env(ctx))
    out = Path(cmd[-1])
    if rc or not out.is_file():
        emit({"error": f"exit {rc}", "tail": tail(lines)})
        return False
    f = json.loads(out.read_text())
    med = statistics.median
    emit(
        {
            "params": f["params"],
            "checkpoint_gib": f["checkpoint_bytes"] / 2**30,
            "strata_stall_s": med(f["strata_stall_s"]),
            "dcp_save_s": med(f["dcp_save_s"]),
            "dcp_async_stall_s": med(f["dcp_async_stall_s"]),
            "copy_floor_s": f["copy_floor_s"],
            "strata_save_s": med(f["strata_save_s"]),
            "ratio": med(f["dcp_save_s"]) / med(f["strata_stall_s"]),
            "raw": f,
        }
    )
    return True


def row_moe(ctx: Ctx) -> bool:
    return _result_row(moe_cmd(ctx), ctx)


def row_generate(ctx: Ctx) -> bool:
    return _result_row(generate_cmd(ctx), ctx)


def _result_row(cmd: list[str], ctx: Ctx) -> bool:
    """A row whose benchmark prints its figures as one RESULT line."""
    rc, lines = stream(cmd, child_env(ctx))
    result = tagged(lines, "RESULT ")
    if rc or result is None:
        emit({"error": f"exit {rc}", "tail": tail(lines)})
        return False
    emit(result)
    return True


ROW_FUNCS: dict[str, Callable[[Ctx], bool]] = {
    "setup": row_setup,
    "peak": row_peak,
    "mfu": row_mfu,
    "peer": row_peer,
    "fp8-speed": row_fp8_speed,
    "fp8-loss": row_fp8_loss,
    "fp8-resume": row_fp8_resume,
    "gpu-tests": row_gpu_tests,
    "checkpoint": row_checkpoint,
    "moe": row_moe,
    "generate": row_generate,
}


def row_main(args: argparse.Namespace) -> int:
    ctx = Ctx(**json.loads(Path(args.state).read_text()))
    return 0 if ROW_FUNCS[args.row](ctx) else 1


# --- the peer: plain PyTorch, FSDP2 + regional compile -----------------------------------------


def peer_worker(args: argparse.Namespace) -> int:
    """The same GPT, batch and precision as compile.py's preset, trained the torchtitan way on one
    GPU: each block torch.compile'd (fullgraph) and fully_shard'ed, then the root; FSDP2 mixed
    precision (bf16 params, fp32 reduce); fused AdamW; grad-norm clipping. Random tokens (the speed
    does not depend on them). Prints `RESULT {json}` timed as compile.py times Strata."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from strata import config as config_mod
    from strata.config import padded_vocab_size
    from strata.model import GPT, flops_per_token, lm_loss, set_rope_buffers

    cb = load_compile_bench()
    ov = cb.overrides(args.preset, "compiled", args.steps, Path("."), None, args.device)
    cfg = config_mod.load(None, [o for o in ov if not o.startswith("data.path=")], world_size=1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    extra = {"device_id": device} if cuda else {}
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1, **extra
    )
    torch.manual_seed(cfg.train.seed)
    start = time.perf_counter()
    vocab = padded_vocab_size(cfg.model, 256)
    with device:
        model = GPT(cfg.model, vocab)
    set_rope_buffers(model, cfg.model, device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, cfg.model.init_std)
    bf16 = cfg.train.precision == "bf16"
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else None
    )
    if not args.no_compile:  # torchtitan's apply_compile: each block on its own, fullgraph
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, torch.compile(block, fullgraph=True))
    shard = {"mp_policy": mp} if mp else {}
    for block in model.layers:  # one rank: nothing to gain by freeing gathered params after forward
        fully_shard(block, reshard_after_forward=False, **shard)
    fully_shard(model, reshard_after_forward=False, **shard)
    o = cfg.optim
    adam = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    fused = cuda

    def adamw() -> Any:
        return torch.optim.AdamW(
            model.parameters(), **adam, **({"fused": True} if fused else {"foreach": True})
        )

    opt = adamw()
    build_s = time.perf_counter() - start
    micro, accum = (
        cfg.train.micro_batch_size,
        cfg.train.global_batch_size // cfg.train.micro_batch_size,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [
        torch.randint(0, 256, (micro, cfg.model.seq_len + 1), device=device, generator=gen)
        for _ in range(4)
    ]
    times, losses = [], []
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for i in range(accum):
            tokens = batches[(step * accum + i) % len(batches)]
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:]) / accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        try:
            opt.step()
        except RuntimeError as exc:  # should fused AdamW refuse FSDP2's DTensors: foreach, recorded
            if not fused or step:
                raise
            print(f"fused AdamW failed ({exc}); foreach instead", flush=True)
            fused = False
            opt = adamw()
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))  # a host sync, as compile.py's
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[args.warmup :])
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
    flops = flops_per_token(cfg.model, vocab) * tokens_per_step / step_s
    result = {
        "variant": "peer: FSDP2 + per-block compile"
        + ("" if not args.no_compile else " (not compiled)"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "step_s": step_s,
        "first_step_s": times[0],
        "step_times_s": times,
        "tokens_per_s": tokens_per_step / step_s,
        "model_tflops": flops / 1e12,
        "losses": losses,
        "build_s": build_s,
        "fused_adamw": fused,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
    }
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


# --- the parent: rows in turn, each with its deadline ----------------------------------------------


def merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v


def run_row(cmd: list[str], env: dict, timeout: float, log: Any) -> dict:
    """Run one row in its own process group; kill the group at the deadline. Its result lines are
    merged into the row's data (so a row cut short keeps what it had measured)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    data: dict = {}
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()
            if line.startswith(MARK):
                try:
                    merge(data, json.loads(line[len(MARK) :]))
                except json.JSONDecodeError:
                    pass
                print("   " + line[len(MARK) :].strip()[:300], flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=10)
    elapsed = time.monotonic() - start
    status = "timeout" if timed_out else ("ok" if proc.returncode == 0 else "failed")
    row = {"status": status, "exit": proc.returncode, "elapsed_s": round(elapsed, 1), "data": data}
    if status != "ok":
        row["tail"] = "".join(lines)[-4000:]
    return row


def fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def figures(rows: dict) -> list[tuple[str, str, str, bool | None]]:
    """(figure, value, goal, met) for the summary table, from whatever the rows measured."""
    out: list[tuple[str, str, str, bool | None]] = []

    def data(name: str) -> dict:
        return rows.get(name, {}).get("data", {})

    setup = data("setup").get("probe") or {}
    if setup:
        gpu = f"{setup.get('gpu', '?')} (capability {setup.get('capability')}), torch {setup.get('torch')}"
        out.append(("device", gpu, "", None))
        imports = setup.get("imports", {})
        out.append(
            ("carried imports", ", ".join(f"{k} {v}" for k, v in imports.items())[:400], "", None)
        )
    peak = data("peak")
    bf16, fp8 = peak.get("bf16_tflops"), peak.get("fp8_tflops")
    if bf16:
        out.append(("bf16 matmul peak", f"{bf16:.0f} TFLOP/s", "", None))
    if fp8:
        out.append(
            (
                "fp8 matmul peak (tensorwise, fast accum)",
                f"{fp8:.0f} TFLOP/s ({fp8 / bf16:.2f}x bf16)",
                "",
                None,
            )
        )
    mfu = data("mfu").get("variants", {})
    for v in MFU_VARIANTS:
        r = mfu.get(v)
        if r and "tokens_per_s" in r:
            m = r["model_tflops"] / bf16 if bf16 else None
            goal = f">= {GOALS['mfu']:.0%}" if v.startswith("compiled") else ""
            met = (m >= GOALS["mfu"]) if (m is not None and goal) else None
            compile_s = r["first_step_s"] - r["step_s"]
            value = f"MFU {fmt(m, '.1%')}, {r['tokens_per_s']:,.0f} tokens/s, first step {r['first_step_s']:.0f} s"
            out.append(
                (
                    f"{PRESET} {v}",
                    value + f" ({compile_s:+.0f}), {r['peak_mem_gib']:.0f} GiB",
                    goal,
                    met,
                )
            )
        elif r:
            out.append((f"{PRESET} {v}", "failed", "", False))
    peer = data("peer").get("result")
    if peer:
        out.append(("peer (FSDP2 + compile)", f"{peer['tokens_per_s']:,.0f} tokens/s", "", None))
        for v in ("compiled", "compiled-selective"):
            r = mfu.get(v)
            if r and "tokens_per_s" in r:
                ratio = r["tokens_per_s"] / peer["tokens_per_s"]
                goal = (
                    f">= {GOALS['peer']:.1f}" if v == "compiled" else "(recomputes; peer does not)"
                )
                out.append(
                    (
                        f"Strata {v} / peer",
                        f"{ratio:.2f}x",
                        goal,
                        ratio >= GOALS["peer"] if v == "compiled" else None,
                    )
                )
    if data("peer").get("torchtitan"):
        out.append(("torchtitan", data("peer")["torchtitan"][:200], "", None))
    fp8v = data("fp8-speed").get("variants", {})
    base = mfu.get("compiled", {}).get("tokens_per_s")
    for v in FP8_VARIANTS:
        r = fp8v.get(v)
        if r and "tokens_per_s" in r and base:
            ratio = r["tokens_per_s"] / base
            out.append(
                (
                    f"{v} / compiled bf16",
                    f"{ratio:.2f}x",
                    f">= {GOALS['fp8_speed']}x",
                    ratio >= GOALS["fp8_speed"],
                )
            )
        elif r:
            out.append(
                (
                    f"{v} / compiled bf16",
                    "failed" if "error" in r else "no bf16 baseline",
                    "",
                    False,
                )
            )
    loss = data("fp8-loss").get("variants", {})
    a, b = (
        loss.get("compiled", {}).get("final_loss"),
        loss.get("compiled-fp8", {}).get("final_loss"),
    )
    if a and b:
        rel = abs(b - a) / abs(a)
        value = f"fp8 {b:.4f} vs bf16 {a:.4f}: {rel:.2%}"
        out.append(
            (
                "fp8 final loss (200 steps, 4 layers, seq 1024)",
                value,
                f"<= {GOALS['fp8_loss']:.0%}",
                rel <= 0.01,
            )
        )
    elif loss:
        out.append(("fp8 final loss", "failed", f"<= {GOALS['fp8_loss']:.0%}", False))
    for name, c in data("fp8-resume").get("chains", {}).items():
        first = (c.get("resumed_losses") or [None])[0]
        value = f"saved at step {RESUME_SAVE_STEPS} loss {fmt(c.get('saved_last_loss'), '.4f')}, resumed step "
        value += f"{c.get('resumed_first_step')} loss {fmt(first, '.4f')}"
        out.append(
            (f"resume {name}", value if c.get("ran") else "failed", "both run", bool(c.get("ran")))
        )
    tests = data("gpu-tests")
    if tests:
        value = tests.get("summary") or f"exit {tests.get('exit')}"
        out.append(("GPU tests", value, "none fail", tests.get("exit") == 0))
    ck = data("checkpoint")
    if ck.get("ratio"):
        value = f"Strata stall {ck['strata_stall_s']:.3f} s, dcp.save {ck['dcp_save_s']:.2f} s: {ck['ratio']:.0f}x"
        out.append(
            (
                "checkpoint stall",
                value,
                f">= {GOALS['checkpoint']:.0f}x",
                ck["ratio"] >= GOALS["checkpoint"],
            )
        )
    moe = data("moe")
    if moe.get("ratio"):
        value = f"grouped / loop {moe['grouped_over_loop']:.2f}; layer step Strata / transformers {moe['ratio']:.2f}"
        out.append(("MoE layer (bf16)", value, "<= 1.0", moe["ratio"] <= 1.0))
    gen = data("generate")
    if gen.get("ratio"):
        value = f"Strata {gen['tokens_per_s']:.0f} tokens/s (batch {gen['batch']}), {gen['ratio']:.2f}x transformers"
        out.append(("generation (bf16)", value, ">= 1.0", gen["ratio"] >= 1.0))
    return out


def markdown(results: dict) -> str:
    lines = [
        f"bench/gpu.py, {results['started']}",
        "",
        "| row | status | seconds (budget) |",
        "|---|---|---|",
    ]
    for name, r in results["rows"].items():
        lines.append(f"| {name} | {r['status']} | {r.get('elapsed_s', 0):.0f} ({r['budget_s']}) |")
    lines += ["", "| figure | value | goal | met |", "|---|---|---|---|"]
    for fig, value, goal, met in figures(results["rows"]):
        mark = "" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {fig} | {value.replace('|', '/')} | {goal} | {mark} |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))


def select_rows(args: argparse.Namespace) -> tuple[Row, ...]:
    def names(text: str | None) -> set[str]:
        chosen = {n for n in (text or "").split(",") if n}
        unknown = chosen - set(ROW_NAMES)
        if unknown:
            raise SystemExit(f"unknown rows {sorted(unknown)}; rows: {', '.join(ROW_NAMES)}")
        return chosen

    only, skip = names(args.only), names(args.skip)
    if only:
        only |= {"setup"} | {n for r in ROWS if r.name in only for n in r.needs}
    return tuple(r for r in ROWS if (not only or r.name in only) and r.name not in skip)


def orchestrate(args: argparse.Namespace) -> int:
    rows = select_rows(args)
    out = Path(args.out or os.environ.get("OUT") or BENCH / "gpu-results")
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(
        wheels=str(Path(args.wheels).resolve()),
        site=args.site,
        work=tempfile.mkdtemp(prefix="gpu-bench-"),
        steps=args.steps,
        warmup=args.warmup,
        loss_steps=args.loss_steps,
    )
    env = child_env(ctx)
    results: dict = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "budget_scale": args.budget_scale,
        "rows": {},
    }
    print(
        f"bench/gpu.py: {len(rows)} rows, {sum(r.budget_s for r in rows) * args.budget_scale:.0f} s of budgets"
    )
    t0, planned, failed = time.monotonic(), 0.0, 0
    with open(out / "log.txt", "w") as log:
        for row in rows:
            planned += row.budget_s * args.budget_scale
            timeout = planned - (time.monotonic() - t0)  # its budget and what the rows before left
            ctx.results = {k: v.get("data", {}) for k, v in results["rows"].items()}
            ctx.data = ctx.results.get("setup", {}).get("data") or ctx.data
            ctx.peak = ctx.results.get("peak", {}).get("bf16_tflops") or ctx.peak
            state = Path(ctx.work) / "state.json"
            state.write_text(json.dumps(asdict(ctx)))
            what = row.what.format(steps=ctx.loss_steps)
            print(f"== {row.name}: {what} (budget {row.budget_s} s, up to {timeout:.0f} s)")
            log.write(f"\n===== {row.name} =====\n")
            if timeout < 10:
                result = {"status": "skipped", "elapsed_s": 0.0, "data": {}, "tail": "no time left"}
            else:
                result = run_row(row_cmd(ctx, row, state), env, timeout, log)
            result["budget_s"] = row.budget_s
            results["rows"][row.name] = result
            if result["data"].get(
                "pythonpath_root"
            ):  # setup could not install strata, but it imports so
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p
                )
            failed += result["status"] != "ok"
            total = time.monotonic() - t0
            print(
                f"== {row.name}: {result['status']} in {result['elapsed_s']:.0f} s (total {total:.0f} s)"
            )
            if result["status"] != "ok":
                print("   " + "\n   ".join(result.get("tail", "").splitlines()[-15:]))
            write_results(out, results)
    results["total_s"] = round(time.monotonic() - t0, 1)
    write_results(out, results)
    print("\n" + markdown(results))
    print(
        f"written: {out / 'results.json'}, {out / 'results.md'}, {out / 'log.txt'}; {failed} rows not ok"
    )
    return 1 if failed else 0


# --- here, on the CPU: fetching the wheels, the dry run ---------------------------------------------


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_fields(path: Path) -> tuple[str, str, str, str, str]:
    """(name, version, python tag, abi tag, platform tag) from a wheel's file name."""
    parts = path.name[: -len(".whl")].split("-")
    return normalize(parts[0]), parts[1], parts[-3], parts[-2], parts[-1]


def wheel_fits_image(path: Path) -> bool:
    """Whether the wheel installs on CPython 3.12, x86-64 Linux."""
    _, _, py, abi, plat = wheel_fields(path)
    platform_ok = any(
        p == "any" or (("linux" in p) and p.endswith("x86_64")) for p in plat.split(".")
    )
    pys = py.split(".")
    python_ok = any(p in ("py3", "cp312", "py312") for p in pys) or (
        abi == "abi3" and any(re.fullmatch(r"cp3(\d+)", p) and int(p[3:]) <= 12 for p in pys)
    )
    return platform_ok and python_ok


def requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(z.read(meta).decode("utf-8", "replace"))
    return headers.get_all("Requires-Dist") or []


def image_marker_env() -> dict[str, str]:
    return {
        "python_version": IMAGE_PYTHON.rsplit(".", 1)[0],
        "python_full_version": IMAGE_PYTHON,
        "implementation_name": "cpython",
        "implementation_version": IMAGE_PYTHON,
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def where_met(requirement: str, carried: dict[str, str]) -> tuple[str | None, str]:
    """(None, why) if the requirement is met on the lent machine with the carried wheels, or not
    needed there; else (its name, why not)."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate(image_marker_env()):
        return None, "not needed (marker)"
    name = normalize(req.name)
    for source, version in (("carried", carried.get(name)), ("image", IMAGE_VERSIONS.get(name))):
        if version is not None:
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                return name, f"{requirement}: {source} has {version}"
            return None, f"{source} {version}"
    if name in IMAGE_PACKAGES:
        return None, "image (version not recorded)"
    if name.replace("-", "_") in sys.stdlib_module_names:
        return None, "standard library"
    return name, f"{requirement}: neither carried nor in the image"


def install_requires() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return []


def travel_bytes(wheels: Path) -> tuple[int, int]:
    """(bytes of the working tree that travels, bytes of the carried wheels)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    tree = 0
    for name in listed:
        path = ROOT / os.fsdecode(name)
        if name and os.path.lexists(path):
            tree += os.lstat(path).st_size
    carried = (
        sum(p.stat().st_size for p in wheels.rglob("*") if p.is_file()) if wheels.is_dir() else 0
    )
    return tree, carried


def check_configs(ctx: Ctx, problems: list[str]) -> int:
    """Every Strata config the rows build, through strata.config (the schema and every check)."""
    from strata import config as config_mod

    cb = load_compile_bench()
    sets: list[tuple[Path | None, list[str], str]] = []
    for variants, steps, extra in (
        (MFU_VARIANTS, ctx.steps, ()),
        (FP8_VARIANTS, ctx.steps, ()),
        (LOSS_VARIANTS, ctx.loss_steps, LOSS_SHAPE),
    ):
        for v in variants:
            ov = cb.overrides(PRESET, v, steps, Path("/nonexistent/corpus"), 800.0, "cuda", extra)
            sets.append((None, ov, f"compile.py {PRESET}/{v}"))
    for first, second in RESUME_CHAINS:
        save, resume, _ = resume_overrides(ctx, first, second)
        sets += [
            (ROOT / "configs" / "tiny.yaml", save, f"{first} save"),
            (ROOT / "configs" / "tiny.yaml", resume, ""),
        ]
    for path, ov, label in sets:
        try:
            config_mod.load(path, ov, world_size=1)
        except Exception as exc:  # ConfigError lists every problem
            problems.append(f"config of {label or 'a resume'}: {str(exc).strip()[:600]}")
    return len(sets)


def dry_run(args: argparse.Namespace) -> int:
    """Check the plan, the names it uses, the carried wheels and the size that travels, on the CPU."""
    problems: list[str] = []
    notes: list[str] = []
    ctx = Ctx(python="python3", wheels=str(Path(args.wheels).resolve()), work="/tmp/gpu-bench-XXXX")
    ctx.data, ctx.peak = "<corpus>", 800.0
    plan = build_plan(ctx, select_rows(args))
    total = sum(r["budget_s"] for r in plan)
    print(f"plan: {len(plan)} rows, {total} s of budgets (limit {TOTAL_BUDGET_S} s)")
    for r in plan:
        print(f"  {r['name']:<11} {r['budget_s']:>4} s  {shlex.join(r['command'])}")
        for cmd in r["inner"]:
            shown = shlex.join(cmd).replace("\n", "; ")
            print(f"      {shown[:220]}{'...' if len(shown) > 220 else ''}")
        bad = [
            c
            for c in [r["command"], *r["inner"]]
            if not c or not all(isinstance(a, str) and a for a in c)
        ]
        if bad or r["budget_s"] <= 0 or r["name"] not in ROW_FUNCS:
            problems.append(f"row {r['name']}: a command, its budget or its function is missing")
    if total > TOTAL_BUDGET_S:
        problems.append(f"the budgets add up to {total} s, over {TOTAL_BUDGET_S} s")

    cb = load_compile_bench()
    named = set(MFU_VARIANTS + FP8_VARIANTS + LOSS_VARIANTS)
    missing = sorted(v for v in named if v not in cb.VARIANTS) + (
        [PRESET] if PRESET not in cb.PRESETS else []
    )
    if missing:
        problems.append(f"bench/compile.py lacks {missing}")
    else:
        ov = cb.overrides(PRESET, "compiled-fp8", 1, Path("."), None, "cuda")
        if "train.precision=fp8" not in ov:
            problems.append(
                "bench/compile.py: the fp8 variant's train.precision does not override the preset's"
            )
        print(
            f"compile.py: preset {PRESET} and variants {', '.join(sorted(named))} exist; fp8 overrides the preset"
        )
    try:
        try:
            import strata.config  # noqa: F401
        except ImportError:
            sys.path.append(str(ROOT))  # strata/ at the root of the tree, not installed
        n = check_configs(ctx, problems)
        print(f"strata.config: the {n} configs the rows build load")
    except ImportError as exc:
        notes.append(f"strata.config not importable here ({exc}): configs not checked")

    if not args.no_wheels:
        wheels_dir = Path(args.wheels)
        files = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
        carried = {}
        for f in files:
            name, version, *_ = wheel_fields(f)
            if name in carried:
                problems.append(f"two versions of {name} in {wheels_dir}: the install would stop")
            carried[name] = version
        print(f"wheels in {wheels_dir}: " + (", ".join(f.name for f in files) or "none"))
        for w in WHEELS:
            have = carried.get(normalize(w.name))
            kind = "required" if w.required else "optional"
            if have is None:
                (problems if w.required else notes).append(
                    f"{kind} wheel {w.name}=={w.version} missing from {wheels_dir} ({w.why}); "
                    "python bench/gpu.py --fetch-wheels"
                )
            elif have != w.version:
                notes.append(f"{w.name}: {have} carried, {w.version} expected")
        for f in files:
            name = wheel_fields(f)[0]
            required = next((w.required for w in WHEELS if normalize(w.name) == name), True)
            if not wheel_fits_image(f):
                (problems if required else notes).append(
                    f"{f.name}: not for CPython 3.12 on x86-64 Linux"
                )
            unmet = [why for req in requires(f) for miss, why in [where_met(req, carried)] if miss]
            if unmet and required:
                problems.append(f"{f.name} needs what the lent machine lacks: " + "; ".join(unmet))
            elif unmet:
                notes.append(f"{f.name} (optional) will not import: it needs " + "; ".join(unmet))
            else:
                print(f"  {f.name}: every requirement met ({len(requires(f))} listed)")
        unmet = [
            why for req in install_requires() for miss, why in [where_met(req, carried)] if miss
        ]
        if unmet:
            problems.append("strata's install_requires not met there: " + "; ".join(unmet))
        else:
            print("  strata's install_requires: all met by the image and the carried wheels")

    tree, carried_bytes = travel_bytes(Path(args.wheels))
    mib = (tree + carried_bytes) / 2**20
    print(
        f"travels: {tree / 2**20:.1f} MiB of working tree + {carried_bytes / 2**20:.1f} MiB of wheels = {mib:.1f} MiB"
    )
    if tree + carried_bytes > TRAVEL_LIMIT:
        problems.append(f"{mib:.1f} MiB would travel, over the 64 MiB limit")
    for n in notes:
        print(f"note: {n}")
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"device command: {DEVICE_COMMAND}")
    print("dry run: " + ("OK" if not problems else f"{len(problems)} problems"))
    return 1 if problems else 0


def fetch_wheels(args: argparse.Namespace) -> int:
    """Download the wheels to carry (CPython 3.12, manylinux x86-64) into --wheels, one version each."""
    dest = Path(args.wheels)
    dest.mkdir(parents=True, exist_ok=True)
    failed = []
    for w in WHEELS:
        for old in dest.glob("*.whl"):
            name, version, *_ = wheel_fields(old)
            if name == normalize(w.name) and version != w.version:
                old.unlink()
        base = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
        ]
        base += ["--implementation", "cp", "-d", str(dest), f"{w.name}=={w.version}"]
        for platforms in (PLATFORMS, PLATFORMS + MORE_PLATFORMS):
            cmd = base + [a for p in platforms for a in ("--platform", p)]
            print("$ " + shlex.join(cmd), flush=True)
            if subprocess.run(cmd).returncode == 0:
                break
        else:
            failed.append(w.name)
    print(f"wheels in {dest}: " + ", ".join(p.name for p in sorted(dest.glob("*.whl"))))
    if failed:
        print(f"could not fetch: {', '.join(failed)}")
    return 1 if any(w.required and w.name in failed for w in WHEELS) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", help="where results go (default: $OUT if set, else bench/gpu-results/)"
    )
    ap.add_argument(
        "--only", help="rows to run, comma-separated (setup, and what they need, run too)"
    )
    ap.add_argument("--skip", help="rows to leave out, comma-separated")
    ap.add_argument(
        "--dry-run", action="store_true", help="check the plan, the wheels and the size here (CPU)"
    )
    ap.add_argument("--no-wheels", action="store_true", help="with --dry-run: check the plan only")
    ap.add_argument(
        "--fetch-wheels", action="store_true", help="download the wheels to carry into --wheels"
    )
    ap.add_argument(
        "--wheels", default=str(ROOT / ".whl"), help="the carried wheels (default: .whl/)"
    )
    ap.add_argument("--site", default="/tmp/site", help="where the carried wheels are installed")
    ap.add_argument("--steps", type=int, default=10, help="steps per speed variant")
    ap.add_argument("--warmup", type=int, default=3, help="of those, left out of the median")
    ap.add_argument("--loss-steps", type=int, default=200, help="steps of the fp8-loss runs")
    ap.add_argument(
        "--budget-scale",
        type=float,
        default=1.0,
        help="multiply every row's budget (a rerun of some)",
    )
    ap.add_argument("--row", choices=ROW_NAMES, help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default=PRESET, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--no-compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        return row_main(args)
    if args.peer_worker:
        return peer_worker(args)
    if args.fetch_wheels:
        return fetch_wheels(args)
    if args.dry_run:
        return dry_run(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
