"""Bad input anywhere — configs, overrides, data directories, checkpoints, metrics files, command-line
flags — is one clear message naming what is wrong and exit status 2, never a traceback; unusual but
valid input runs. Each case runs the `strata` command in this process (its parser and `main`); a few
run it as a user does, in a subprocess, to show nothing else reaches the terminal."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from strata.launch import torchrun

from conftest import run_cli, tiny_hf_llama
from worlds import REPO, strata

TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    """A launch that got past every check would start torchrun: record it instead."""
    started: list[torchrun.LaunchPlan] = []

    def fake_run_local(plan, *args, **kwargs):
        torchrun.check_plan(plan)
        started.append(plan)
        return 0

    monkeypatch.setattr(torchrun, "run_local", fake_run_local)
    return started


# --- building malformed inputs ------------------------------------------------------------------


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def token_dir(
    root: Path,
    train: np.ndarray | bytes | None = None,
    val: np.ndarray | bytes | None = None,
    meta: dict | str | bytes | None = None,
) -> Path:
    """A data directory: train.bin/val.bin (uint16 unless given as raw bytes) and meta.json (a dict is
    written as JSON; str or bytes as they are); None writes a good default, and the string "absent"
    for a file leaves it out."""
    d = root / "data"
    d.mkdir(parents=True, exist_ok=True)
    good = np.arange(2000, dtype=np.uint16) % 200
    for name, value in (("train.bin", train), ("val.bin", val)):
        if isinstance(value, str) and value == "absent":
            continue
        value = good if value is None else value
        write(
            d / name,
            value if isinstance(value, bytes) else np.asarray(value, dtype=np.uint16).tobytes(),
        )
    if meta != "absent":
        meta = {"dtype": "uint16", "vocab_size": 257, "tokenizer": "byte"} if meta is None else meta
        write(d / "meta.json", json.dumps(meta) if isinstance(meta, (dict, list)) else meta)
    return d


def config_file(root: Path, text: str | bytes) -> str:
    return str(write(root / "exp.yaml", text))


def show(*overrides: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["config", "show", TINY, *overrides]


def show_yaml(text: str | bytes, *extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["config", "show", config_file(tmp, text), *extra]


def launch(*args: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["launch", TINY, f"log.dir={tmp / 'runs'}", *args]


def launch_data(**parts) -> Callable[[Path], list[str]]:
    return lambda tmp: [
        "launch",
        TINY,
        f"data.path={token_dir(tmp, **parts)}",
        f"log.dir={tmp / 'runs'}",
        "model.seq_len=32",
        "--nproc",
        "1",
    ]


def not_a_checkpoint(action: str, *extra: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        write(tmp / "plain" / "notes.txt", "not a checkpoint")
        return ["ckpt", action, str(tmp / "plain"), *extra]

    return build


def launch_resume_plain(tmp: Path) -> list[str]:
    write(tmp / "plain" / "notes.txt", "not a checkpoint")
    return ["launch", TINY, f"log.dir={tmp / 'runs'}", "--resume", str(tmp / "plain")]


def launch_over_earlier_run(tmp: Path) -> list[str]:
    """A new launch whose checkpoint.dir holds a committed checkpoint of an earlier run."""
    write(tmp / "ck" / "step_00000002" / "COMMITTED", json.dumps({"step": 2}))
    return ["launch", TINY, f"log.dir={tmp / 'runs'}", f"checkpoint.dir={tmp / 'ck'}"]


def checkpoint_with_marker(marker: str | None) -> Callable[[Path], list[str]]:
    """A step directory whose commit marker is `marker` (None: no marker, an unfinished save)."""

    def build(tmp: Path) -> list[str]:
        step = tmp / "ckpts" / "step_00000002"
        write(step / "__0_0.distcp", b"\0" * 64)
        if marker is not None:
            write(step / "COMMITTED", marker)
        return ["ckpt", "inspect", str(step)]

    return build


def truncated_checkpoint(tmp: Path) -> Path:
    """A real two-step checkpoint whose first data file lost its second half."""
    from strata.checkpoint import store
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train as run

    from conftest import tiny_config

    cfg = tiny_config(
        token_dir(tmp), tmp / "runs", **{"train.steps": 2, "checkpoint.save_final": True}
    )
    run(cfg, start())
    ckpt = store.committed(cfg.checkpoint_dir())[-1]
    data = (ckpt / "__0_0.distcp").read_bytes()
    (ckpt / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    return ckpt


def good_checkpoint(tmp: Path) -> Path:
    """A real two-step checkpoint."""
    from strata.checkpoint import store
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train as run

    from conftest import tiny_config

    cfg = tiny_config(
        token_dir(tmp), tmp / "runs", **{"train.steps": 2, "checkpoint.save_final": True}
    )
    run(cfg, start())
    return store.committed(cfg.checkpoint_dir())[-1]


def symlink_loop_checkpoint(tmp: Path) -> Path:
    """A real checkpoint one of whose data files was replaced by a symbolic link to itself."""
    ckpt = good_checkpoint(tmp)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to("__0_0.distcp")
    return ckpt


def hf_model_contradicting_its_config(tmp: Path) -> Path:
    """A tiny Hugging Face Llama whose config.json says a narrower MLP than its weights hold."""
    tiny_hf_llama(tmp / "hf")
    config = json.loads((tmp / "hf" / "config.json").read_text())
    write(tmp / "hf" / "config.json", json.dumps({**config, "intermediate_size": 48}))
    return tmp / "hf"


class _CallsAFunction:
    """Pickles as a call of os.getpid (harmless were it ever run): what a malicious file does."""

    def __reduce__(self):
        import os

        return (os.getpid, ())


def malicious_deepspeed(tmp: Path) -> list[str]:
    """A DeepSpeed-shaped directory whose files are pickles that call a function when loaded."""
    import torch

    d = tmp / "ds"
    d.mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"param_shapes": _CallsAFunction()}, d / name)
    return ["ckpt", "import-deepspeed", str(d), str(tmp / "out"), "--config", TINY]


def lock_dir_in(directory: Path) -> Path:
    """A directory where `directory`'s lock file goes."""
    (directory / ".strata.lock").mkdir(parents=True)
    return directory / ".strata.lock"


PLAN = ["plan", TINY, "--nodes", "1", "--gpus-per-node", "1"]


def metrics(content: str | bytes) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        write(tmp / "run" / "metrics.jsonl", content)
        return ["plot", str(tmp / "run")]

    return build


LONG = "x" * 300
GOOD_LINE = json.dumps({"step": 1, "loss": 5.0, "tokens_per_s": 100.0})


@dataclass(frozen=True)
class Case:
    name: str
    argv: Callable[[Path], list[str]]
    needles: tuple[str, ...]  # each must appear in the output: what names the offending input
    slow: bool = False  # builds a real checkpoint or model first (seconds)


# an MoE model whose experts are dispatched in two hops (parallel.ep_dispatch)
HIERARCHICAL = ("model.moe.num_experts=12", "parallel.ep_dispatch=hierarchical")

CASES = [
    # --- config files: YAML syntax and structure
    Case("yaml-unclosed-flow", show_yaml("train: [1\n"), ("not valid YAML",)),
    Case("yaml-bad-indent", show_yaml("train:\n  steps: 5\n seed: 3\n"), ("not valid YAML",)),
    Case("yaml-tab-indent", show_yaml("train:\n\tsteps: 5\n"), ("not valid YAML",)),
    Case("yaml-top-level-list", show_yaml("- a\n- b\n"), ("top level must be a mapping", "list")),
    Case(
        "yaml-top-level-string", show_yaml("just words\n"), ("top level must be a mapping", "str")
    ),
    Case("yaml-group-is-a-number", show_yaml("train: 5\n"), ("train: must be a mapping",)),
    Case(
        "yaml-python-tag",
        show_yaml("train:\n  steps: !!python/object/apply:os.system [ls]\n"),
        ("not valid YAML",),
    ),
    Case("yaml-undefined-alias", show_yaml("train:\n  steps: *n\n"), ("not valid YAML", "'n'")),
    Case(
        "yaml-missing-file",
        lambda tmp: ["config", "show", str(tmp / "nope.yaml")],
        ("nope.yaml", "does not exist"),
    ),
    Case("yaml-directory", lambda tmp: ["config", "show", str(tmp)], ("is a directory",)),
    # --- duplicate keys: an error naming the key and the line
    Case(
        "dup-group",
        show_yaml("train:\n  steps: 5\ntrain:\n  seed: 3\n"),
        ("duplicate key 'train'", "line 3"),
    ),
    Case(
        "dup-key",
        show_yaml("train:\n  steps: 5\n  steps: 6\n"),
        ("duplicate key 'steps'", "line 3", "line 2"),
    ),
    Case("dup-flow", show_yaml("train: {steps: 5, steps: 6}\n"), ("duplicate key 'steps'",)),
    Case(
        "dup-nested",
        show_yaml("zero:\n  params:\n    shard_over: node\n    shard_over: gpu\n"),
        ("'shard_over'",),
    ),
    # --- encodings
    Case(
        "non-utf8-latin1", show_yaml(b"log:\n  name: caf\xe9\n"), ("exp.yaml", "not UTF-8", "0xe9")
    ),
    Case(
        "non-utf8-utf16",
        show_yaml("train:\n  steps: 5\n".encode("utf-16")),
        ("exp.yaml", "not UTF-8"),
    ),
    Case("non-utf8-binary", show_yaml(b"\x89PNG\r\n\x1a\n\x00\x00"), ("exp.yaml", "not UTF-8")),
    # --- types
    Case("type-steps-word", show_yaml("train:\n  steps: five\n"), ("train.steps", "whole number")),
    Case("type-steps-float", show_yaml("train:\n  steps: 1.5\n"), ("train.steps", "whole number")),
    Case("type-steps-bool", show_yaml("train:\n  steps: true\n"), ("train.steps",)),
    Case("type-lr-word", show_yaml("optim:\n  lr: fast\n"), ("optim.lr", "number")),
    Case(
        "type-bool-string",
        show_yaml("log:\n  progress: sometimes\n"),
        ("log.progress", "true or false"),
    ),
    Case(
        "type-value-is-mapping",
        show_yaml("model:\n  n_layers: {a: 1}\n"),
        ("model.n_layers", "mapping"),
    ),
    Case("type-name-list", show_yaml("log:\n  name: [a, b]\n"), ("log.name", "string")),
    Case("type-date", show_yaml("train:\n  steps: 2024-01-01\n"), ("train.steps",)),
    # --- ranges and overflow
    Case("range-steps-zero", show_yaml("train:\n  steps: 0\n"), ("train.steps", ">= 1")),
    Case("range-lr-negative", show_yaml("optim:\n  lr: -0.1\n"), ("optim.lr", ">= 0")),
    Case("range-eps-zero", show_yaml("optim:\n  eps: 0\n"), ("optim.eps", "> 0")),
    Case("range-beta1-negative", show_yaml("optim:\n  beta1: -0.1\n"), ("optim.beta1",)),
    Case("range-beta2-above-one", show_yaml("optim:\n  beta2: 1.5\n"), ("optim.beta2", "<= 1")),
    Case("range-min-lr-ratio", show_yaml("optim:\n  min_lr_ratio: 2\n"), ("optim.min_lr_ratio",)),
    Case("range-lr-nan", show_yaml("optim:\n  lr: .nan\n"), ("optim.lr", "finite")),
    Case("range-lr-inf", show_yaml("optim:\n  lr: .inf\n"), ("optim.lr", "finite")),
    Case(
        "range-lr-overflows-to-inf", show_yaml("optim:\n  lr: 1.0e+400\n"), ("optim.lr", "finite")
    ),
    Case("range-choice", show_yaml("train:\n  precision: fp16\n"), ("train.precision", "fp32")),
    Case("overflow-steps", show_yaml(f"train:\n  steps: {10**30}\n"), ("train.steps", "64-bit")),
    Case("overflow-seed", show_yaml(f"train:\n  seed: {2**64}\n"), ("train.seed", "64-bit")),
    Case("overflow-float-from-int", show(f"optim.lr={10**400}"), ("optim.lr", "too large")),
    Case(
        "overflow-int-digits", show(f"model.d_model={'9' * 5000}"), ("model.d_model", "4300 digits")
    ),
    Case(
        "yaml-impossible-date",
        show_yaml("train:\n  seed: 2024-13-45\n"),
        ("exp.yaml", "month must be in 1..12"),
    ),
    Case("range-seed-negative", show_yaml("train:\n  seed: -5\n"), ("train.seed", ">= 0")),
    # --- list keys: log.profile_steps is [first, last]
    Case(
        "list-profile-steps-number",
        show_yaml("log:\n  profile_steps: 3\n"),
        ("log.profile_steps", "list of int"),
    ),
    Case(
        "list-profile-steps-string",
        show("log.profile_steps=3-5"),
        ("log.profile_steps", "list of int", "'3-5'"),
    ),
    Case(
        "list-profile-steps-one-item",
        show("log.profile_steps=[3]"),
        ("log.profile_steps", "1 item", "exactly 2"),
    ),
    Case(
        "list-profile-steps-three-items",
        show("log.profile_steps=[1,2,3]"),
        ("log.profile_steps", "exactly 2"),
    ),
    Case(
        "list-profile-steps-reversed",
        show("log.profile_steps=[5,3]"),
        ("log.profile_steps", "reversed", "[3, 5]"),
    ),
    Case(
        "list-profile-steps-word",
        show_yaml("log:\n  profile_steps: [1, x]\n"),
        ("item 2 is 'x'", "whole number"),
    ),
    Case(
        "list-profile-steps-float",
        show("log.profile_steps=[1,2.5]"),
        ("log.profile_steps", "item 2 is 2.5"),
    ),
    Case(
        "list-profile-steps-zero",
        show("log.profile_steps=[0,2]"),
        ("log.profile_steps", "item 1 is 0", ">= 1"),
    ),
    Case(
        "list-profile-steps-unclosed",
        show("log.profile_steps=[3,5"),
        ("log.profile_steps=[3,5", "not valid YAML"),
    ),
    Case(
        "list-profile-start-removed",
        show("log.profile_start=2"),
        ("log.profile_start", "log.profile_steps"),
    ),
    # --- names no file system takes
    Case(
        "path-log-name-300", show_yaml(f"log:\n  name: {LONG}\n"), ("log.name", "300 bytes", "255")
    ),
    Case("path-log-name-bytes", show(f"log.name={'é' * 200}"), ("log.name", "400 bytes")),
    Case(
        "path-ckpt-dir-component", show(f"checkpoint.dir=runs/{LONG}/ck"), ("checkpoint.dir", "255")
    ),
    Case("path-log-dir-nul", show_yaml('log:\n  dir: "runs\\0x"\n'), ("log.dir", "NUL")),
    # --- unknown keys
    Case("unknown-group", show_yaml("trian:\n  steps: 5\n"), ("trian", "did you mean")),
    Case("unknown-key", show_yaml("train:\n  stpes: 5\n"), ("train.stpes", "train.steps")),
    Case("unknown-override-group", show("nope.x=1"), ("nope", "unknown key")),
    # --- cross-key checks, and against the world size
    Case("cross-heads", show_yaml("model:\n  d_model: 100\n  n_heads: 3\n"), ("model.n_heads",)),
    Case(
        "cross-batch",
        show_yaml("train:\n  global_batch_size: 10\n  micro_batch_size: 4\n"),
        ("micro_batch_size",),
    ),
    Case(
        "cross-pp-layers",
        show_yaml("model:\n  n_layers: 3\nparallel:\n  pp: 2\n"),
        ("model.n_layers=3",),
    ),
    Case(
        "cross-vocab-tp",
        show_yaml("model:\n  vocab_size: 257\nparallel:\n  tp: 2\n"),
        ("model.vocab_size=257",),
    ),
    Case("cross-world-size", show("parallel.tp=2", "--world-size", "3"), ("world size 3",)),
    # --- overrides: malformed key=value
    Case("override-no-equals", show("train.steps"), ("'train.steps'", "group.key=value")),
    Case("override-no-key", show("=5"), ("'=5'", "group.key=value")),
    Case("override-group-only", show("train=5"), ("'train=5'",)),
    Case("override-empty-part", show("train..steps=1"), ("'train..steps=1'",)),
    Case("override-leading-dot", show(".steps=1"), ("'.steps=1'",)),
    Case("override-bad-yaml", show("train.steps=[1"), ("train.steps=[1", "not valid YAML")),
    Case(
        "override-dup-key", show("train.steps={a: 1, a: 2}"), ("train.steps", "duplicate key 'a'")
    ),
    Case("override-alias", show("train.steps=*a"), ("train.steps", "alias")),
    Case(
        "override-python-tag",
        show("train.steps=!!python/name:os.system"),
        ("train.steps", "not valid YAML"),
    ),
    Case("override-below-a-value", show("train.steps.x=1"), ("train.steps is not a mapping",)),
    Case("override-1e30", show("train.steps=1e30"), ("train.steps", "whole number")),
    Case("override-float-1e30", show("train.steps=1.0e+30"), ("train.steps", "whole number")),
    Case("override-huge-int", show(f"train.steps={10**25}"), ("train.steps", "64-bit")),
    Case("override-eps-zero", show("optim.eps=0"), ("optim.eps",)),
    Case("override-lr-negative", show("optim.lr=-1e-3"), ("optim.lr",)),
    Case(
        "override-choice", show("zero.params.shard_over=planet"), ("zero.params.shard_over", "node")
    ),
    # --- launch flags and pre-launch checks (torchrun never starts)
    Case("launch-nproc-zero", launch("--nproc", "0"), ("--nproc", ">= 1")),
    Case("launch-nproc-negative", launch("--nproc", "-2", "--nnodes", "-1"), ("--nproc",)),
    Case("launch-nproc-word", launch("--nproc", "two"), ("--nproc", "whole number")),
    Case("launch-nnodes-zero", launch("--nnodes", "0"), ("--nnodes", ">= 1")),
    Case("launch-max-restarts", launch("--max-restarts", "-1"), ("--max-restarts",)),
    Case("launch-join-timeout", launch("--join-timeout", "0"), ("--join-timeout",)),
    Case(
        "launch-endpoint-port",
        launch("--rdzv-endpoint", "node1:http"),
        ("--rdzv-endpoint", "HOST:PORT"),
    ),
    Case(
        "launch-endpoint-range",
        launch("--rdzv-endpoint", "node1:70000"),
        ("--rdzv-endpoint", "65535"),
    ),
    Case(
        "launch-slurm-nodes", launch("--slurm", "--nodes", "0", "--no-submit"), ("--nodes", ">= 1")
    ),
    Case(
        "launch-slurm-gpus",
        launch("--slurm", "--gpus-per-node", "-8", "--no-submit"),
        ("--gpus-per-node",),
    ),
    Case(
        "launch-slurm-script-name",
        launch("--slurm", "--gpus-per-node", "1", "--script", f"{LONG}/job.sbatch", "--no-submit"),
        ("strata launch --slurm", "File name too long"),
    ),
    Case("launch-world-size", launch("parallel.tp=4", "--nproc", "2"), ("world size 2",)),
    # --- the experts' layout, refused with the other layout errors before any worker starts
    Case(
        "launch-ep-dispatch-one-node",
        launch(*HIERARCHICAL, "parallel.ep=2", "--nproc", "2"),
        ("parallel.ep_dispatch=hierarchical", "LOCAL_WORLD_SIZE=2", "ranks 0..1 lie on one node"),
    ),
    Case(
        "launch-ep-dispatch-uneven",
        launch(*HIERARCHICAL, "parallel.ep=3", "parallel.ranks_per_node=2", "--nproc", "6"),
        ("parallel.ep_dispatch=hierarchical", "pieces of [1, 2] ranks", "train.global_batch_size"),
    ),
    Case(
        "config-ep-dispatch-world",
        show(*HIERARCHICAL, "parallel.ep=4", "--world-size", "4"),
        ("ranks 0..3 lie on one node", "(null, no launcher: the world size 4)"),
    ),
    Case(
        "config-ep-dispatch-no-world",
        show(*HIERARCHICAL, "parallel.ep=6", "parallel.ranks_per_node=4"),
        ("parallel.ep_dispatch=hierarchical", "pieces of [2, 4] ranks", "multiple of 4"),
    ),
    Case("launch-bad-config", launch("train.steps=0", "--nproc", "2"), ("train.steps",)),
    Case("launch-beta-one", launch("optim.beta1=1.0"), ("optim.beta1", "beta < 1")),
    Case("launch-long-name", launch(f"log.name={LONG}"), ("log.name", "255")),
    Case("launch-resume-not-ckpt", launch_resume_plain, ("plain", "no committed checkpoint")),
    Case("launch-eval-no-resume", launch("--eval", "--nproc", "2"), ("--eval", "--resume CKPT")),
    Case("launch-data-no-eval", launch("--data", "d", "--resume", "r"), ("--data", "add --eval")),
    Case(
        "launch-over-earlier-run",
        launch_over_earlier_run,
        ("step_00000002", "checkpoint.overwrite=true"),
    ),
    Case("config-world-size-zero", show("--world-size", "0"), ("--world-size", ">= 1")),
    Case("store-port-range", lambda tmp: ["store", "--port", "70000"], ("--port", "65535")),
    Case("store-port-negative", lambda tmp: ["store", "--port", "-1"], ("--port",)),
    Case(
        "data-prepare-val-fraction",
        lambda tmp: ["data", "prepare", str(tmp), "--out", str(tmp / "o"), "--val-fraction", "1.5"],
        ("--val-fraction",),
    ),
    Case(
        "data-prepare-missing-input",
        lambda tmp: ["data", "prepare", str(tmp / "absent.txt"), "--out", str(tmp / "o")],
        ("absent.txt", "does not exist"),
    ),
    Case(
        "data-prepare-out-name-too-long",
        lambda tmp: [
            "data",
            "prepare",
            str(write(tmp / "in.txt", "hello")),
            "--out",
            str(tmp / LONG),
        ],
        ("data prepare", "File name too long"),
    ),
    # --- data that names nothing, weights that overflow, numbers without end
    Case("data-sources-empty", show("data.sources=[]"), ("data.sources", "empty list")),
    Case(
        "data-weights-overflow",
        show("data.sources=[{path: a, weight: 1e308}, {path: b, weight: 1e308}]"),
        ("data.sources", "overflows"),
    ),
    Case(
        "plan-memory-infinite",
        lambda tmp: [*PLAN, "--gpu-mem-gb", "inf", "--tflops", "1"],
        ("--gpu-mem-gb", "finite"),
    ),
    Case(
        "plan-link-infinite",
        lambda tmp: [*PLAN, "--gpu", "h100", "--inter-node-gbps", "inf"],
        ("--inter-node-gbps",),
    ),
    # --- a model that cannot be allocated: refused before any allocation, naming the sizes
    Case(
        "model-too-large",
        lambda tmp: [
            "train",
            TINY,
            "model.d_model=262144",
            "model.n_layers=64",
            f"log.dir={tmp / 'runs'}",
        ],
        ("parameters on this rank need", "GiB", "parallel.tp"),
    ),
    # --- checkpoints: a symbolic link loop, an unwritable OUT, weights contradicting config.json
    Case(
        "resume-symlink-loop",
        lambda tmp: [
            "train",
            TINY,
            f"log.dir={tmp / 'again'}",
            "--resume",
            str(symlink_loop_checkpoint(tmp)),
        ],
        ("symbolic link loop",),
        slow=True,
    ),
    Case(
        "export-unwritable-out",
        lambda tmp: ["ckpt", "export", str(good_checkpoint(tmp)), "/proc/strata-export"],
        ("cannot write or read /proc/strata-export",),
        slow=True,
    ),
    Case(
        "import-hf-shapes-contradict-config",
        lambda tmp: [
            "ckpt",
            "import-hf",
            str(hf_model_contradicting_its_config(tmp)),
            str(tmp / "out"),
        ],
        ("contradict its config.json", "gate_proj", "(48, 32)"),
        slow=True,
    ),
    # --- data directories (checked before torchrun starts)
    Case("data-no-meta", launch_data(meta="absent"), ("meta.json", "strata data prepare")),
    Case("data-meta-not-json", launch_data(meta="{dtype: uint16"), ("meta.json", "not valid JSON")),
    Case("data-meta-empty", launch_data(meta=""), ("meta.json", "not valid JSON")),
    Case(
        "data-meta-not-utf8",
        launch_data(meta=b'{"dtype": "uint16\xff"}'),
        ("meta.json", "not valid JSON"),
    ),
    Case("data-meta-list", launch_data(meta=[1, 2]), ("meta.json", "JSON object")),
    Case("data-meta-no-vocab", launch_data(meta={"dtype": "uint16"}), ("meta.json", "vocab_size")),
    Case(
        "data-meta-vocab-str",
        launch_data(meta={"dtype": "uint16", "vocab_size": "257"}),
        ("vocab_size='257'",),
    ),
    Case(
        "data-meta-vocab-bool",
        launch_data(meta={"dtype": "uint16", "vocab_size": True}),
        ("vocab_size=True",),
    ),
    Case(
        "data-meta-vocab-zero",
        launch_data(meta={"dtype": "uint16", "vocab_size": 0}),
        ("vocab_size", ">= 1"),
    ),
    Case(
        "data-meta-dtype",
        launch_data(meta={"dtype": "float32", "vocab_size": 257}),
        ("dtype='float32'",),
    ),
    Case("data-train-empty", launch_data(train=b""), ("train.bin", "too few")),
    Case(
        "data-train-truncated",
        launch_data(train=b"\x01\x00" * 500 + b"\x01"),
        ("train.bin", "1001 bytes"),
    ),
    Case("data-val-missing", launch_data(val="absent"), ("val.bin",)),
    Case(
        # meta.json records the largest id (as `strata data prepare` writes it): refused before
        # any worker starts, without reading the tokens
        "data-vocab-below-ids",
        launch_data(meta={"dtype": "uint16", "vocab_size": 100, "max_id": 199}),
        ("token id 199", "max_id", "vocab_size=100"),
    ),
    Case(
        "data-vocab-below-val-ids",
        launch_data(
            val=np.full(100, 300), meta={"dtype": "uint16", "vocab_size": 257, "max_id": 300}
        ),
        ("token id 300", "vocab_size=257"),
    ),
    # --- checkpoints
    Case(
        "ckpt-inspect-plain-dir", not_a_checkpoint("inspect"), ("plain", "no committed checkpoint")
    ),
    Case("ckpt-verify-plain-dir", not_a_checkpoint("verify"), ("plain", "no committed checkpoint")),
    Case("ckpt-export-plain-dir", not_a_checkpoint("export", "out.safetensors"), ("plain",)),
    Case(
        "ckpt-inspect-extra-args",
        not_a_checkpoint("inspect", "extra"),
        ("takes one directory", "extra"),
    ),
    Case("ckpt-unfinished-save", checkpoint_with_marker(None), ("step_00000002", "did not finish")),
    Case(
        "ckpt-truncated-marker",
        checkpoint_with_marker('{"step": 2, "fil'),
        ("COMMITTED", "unreadable"),
    ),
    Case(
        "ckpt-export-truncated-data",
        lambda tmp: ["ckpt", "export", str(truncated_checkpoint(tmp)), str(tmp / "w.safetensors")],
        ("__0_0.distcp", "truncated"),
    ),
    Case(
        "train-resume-truncated-data",
        lambda tmp: (
            [
                "train",
                TINY,
                f"data.path={token_dir(tmp)}",
                f"log.dir={tmp / 'again'}",
                "model.seq_len=32",
            ]
            + [
                "model.n_layers=2",
                "model.d_model=32",
                "train.global_batch_size=8",
                "train.micro_batch_size=2",
            ]
            + ["--resume", str(truncated_checkpoint(tmp))]
        ),
        ("__0_0.distcp", "truncated"),
    ),
    Case(
        "moe-capacity-factor-overflows",
        lambda tmp: [
            "train",
            TINY,
            f"log.dir={tmp / 'runs'}",
            "model.moe.num_experts=4",
            "model.moe.capacity_factor=1e300",
        ],
        ("model.moe.capacity_factor", "1e+300", "<= 1000000.0"),
    ),
    # --- strata generate: refused before a model is opened or memory allocated
    *[
        Case(
            f"generate-temperature-{value}",
            lambda tmp, value=value: [
                "generate",
                str(tmp),
                "--prompt",
                "x",
                "--temperature",
                value,
            ],
            (f"--temperature {value}",),
        )
        for value in ("nan", "inf", "-1")
    ],
    Case(
        "generate-device-tpu",
        lambda tmp: ["generate", str(tmp), "--prompt", "x", "--device", "tpu"],
        ("--device tpu", "usable: cpu"),
    ),
    Case(
        "generate-device-bad-cuda-index",
        lambda tmp: ["generate", str(tmp), "--prompt", "x", "--device", "cuda:99"],
        ("--device cuda:99", "usable: cpu"),
    ),
    Case(
        "generate-max-new-tokens-beyond-memory",
        lambda tmp: [
            "generate",
            str(good_checkpoint(tmp)),
            "--prompt",
            "x",
            "--max-new-tokens",
            "1000000000000",
        ],
        ("--max-new-tokens 1000000000000", "GiB free", "new tokens fit"),
        slow=True,
    ),
    Case(
        "generate-chat-on-text-data",
        lambda tmp: ["generate", str(good_checkpoint(tmp)), "--chat", "--prompt", "x"],
        ("has no chat template", "holds text, not conversations", "--chat-template"),
        slow=True,
    ),
    Case(
        "generate-chat-template-without-chat",
        lambda tmp: ["generate", str(tmp), "--prompt", "x", "--chat-template", "chatml"],
        ("--chat-template chatml", "add --chat"),
    ),
    Case(
        "import-deepspeed-malicious-pickle",
        malicious_deepspeed,
        ("mp_rank_00_model_states.pt", "not a DeepSpeed checkpoint torch can load safely"),
    ),
    # --- lock files (.strata.lock) that cannot be taken: before anything is written
    Case(
        "train-log-dir-under-proc",
        lambda tmp: ["train", TINY, "log.dir=/proc/strata-runs"],
        ("/proc/strata-runs/tiny/.strata.lock", "cannot be used"),
    ),
    Case(
        "train-checkpoint-dir-under-sys",
        lambda tmp: ["train", TINY, f"log.dir={tmp / 'runs'}", "checkpoint.dir=/sys/strata-ck"],
        ("/sys/strata-ck/.strata.lock", "cannot be used"),
    ),
    Case(
        "train-lock-is-a-directory",
        lambda tmp: ["train", TINY, f"log.dir={lock_dir_in(tmp / 'runs' / 'tiny').parent.parent}"],
        (".strata.lock", "it is a directory"),
    ),
    Case(
        "launch-log-dir-under-proc",
        lambda tmp: ["launch", TINY, "log.dir=/proc/strata-runs", "--nproc", "1"],
        ("/proc/strata-runs/tiny/.strata.lock", "kernel interface"),
    ),
    Case(
        "launch-checkpoint-dir-under-sys",
        launch("checkpoint.dir=/sys/strata-ck", "--nproc", "1"),
        ("/sys/strata-ck/.strata.lock", "kernel interface"),
    ),
    Case(
        "launch-lock-is-a-directory",
        lambda tmp: [
            "launch",
            TINY,
            f"log.dir={tmp / 'runs'}",
            f"checkpoint.dir={lock_dir_in(tmp / 'ck').parent}",
        ],
        (".strata.lock", "it is a directory"),
    ),
    Case(
        "reshard-out-under-proc",
        lambda tmp: [
            "ckpt",
            "reshard",
            str(good_checkpoint(tmp)),
            "/proc/strata-ck",
            "--to",
            "dp=1",
        ],
        ("/proc/strata-ck/.strata.lock", "cannot be used"),
        slow=True,
    ),
    # --- metrics and schedule records for `strata plot`
    Case("plot-no-metrics", lambda tmp: ["plot", str(tmp)], ("metrics.jsonl", "no metrics")),
    Case(
        "plot-damaged-middle-line",
        metrics(f'{{"step": 1, "lo\n{GOOD_LINE}\n'),
        ("metrics.jsonl line 1",),
    ),
    Case("plot-not-utf8", metrics(b"\xff\xfe{}\n"), ("metrics.jsonl", "UTF-8")),
    Case(
        "plot-out-missing-dir",
        lambda tmp: [*metrics(GOOD_LINE + "\n")(tmp), "--out", str(tmp / "absent" / "c.png")],
        ("strata plot", "absent"),
    ),
    Case(
        "plot-schedule-not-json",
        lambda tmp: ["plot", "schedule", str(write(tmp / "r.json", "{"))],
        ("r.json",),
    ),
]


def test_the_table_is_large_and_names_are_unique():
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES]
)
def test_bad_input_is_one_message_and_exit_2(case, tmp_path, capsys, _no_torchrun):
    code, out = run_cli(case.argv(tmp_path), capsys)
    assert code == 2, out
    assert "Traceback" not in out
    assert "weights_only=False" not in out  # never advise loading a file that can run code
    assert "error" in out
    for needle in case.needles:
        assert needle in out, f"{needle!r} not in:\n{out}"
    assert not _no_torchrun, "torchrun would have started"


# --- unusual but valid input runs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",  # an empty experiment: every default
        "# only a comment\n",
        "\ufefftrain:\n  steps: 7\n",  # a UTF-8 byte-order mark
        "log:\n  name: café-練習\n",  # non-ASCII names
        f"log:\n  name: {'n' * 255}\n",  # the longest name a file system takes
        "train: {steps: 7, seed: 0}\noptim: {beta1: 0.0, beta2: 0.999999, lr: 0}\n",
    ],
    ids=["empty", "comment", "bom", "non-ascii", "name-255", "edge-values"],
)
def test_unusual_configs_load(text, tmp_path, capsys):
    code, out = run_cli(["config", "show", config_file(tmp_path, text)], capsys)
    assert code == 0, out


def test_the_same_key_in_different_groups_is_not_a_duplicate(tmp_path, capsys):
    text = "zero:\n  params: {shard_over: none}\n  grads: {shard_over: none}\ncheckpoint: {dir: a}\nlog: {dir: b}\n"
    code, out = run_cli(["config", "show", config_file(tmp_path, text)], capsys)
    assert code == 0, out


def test_a_valid_launch_reaches_torchrun_and_data_at_the_vocabulary_edge_passes(
    tmp_path, capsys, _no_torchrun
):
    """ids up to vocab_size - 1 are fine; so is a vocabulary too large for the dtype to hold an id
    beyond (no scan needed)."""
    d = token_dir(tmp_path, meta={"dtype": "uint16", "vocab_size": 200})
    argv = [
        "launch",
        TINY,
        f"data.path={d}",
        f"log.dir={tmp_path}",
        "model.seq_len=32",
        "--nproc",
        "2",
    ]
    code, out = run_cli(argv, capsys)
    assert code == 0, out
    assert [p.nproc_per_node for p in _no_torchrun] == [2]
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 70000}))
    assert run_cli(argv, capsys)[0] == 0


def test_a_hierarchical_dispatch_across_nodes_launches(tmp_path, capsys, _no_torchrun):
    """The node size the dispatch is checked against is the launcher's: 2 processes on each of 2
    nodes put an expert-parallel group of 4 on both (while one node of 4 would hold it whole)."""
    argv = [
        *launch(*HIERARCHICAL, "parallel.ep=4", "train.micro_batch_size=4")(tmp_path),
        "--nproc",
        "2",
    ]
    code, out = run_cli([*argv, "--nnodes", "2", "--rdzv-endpoint", "node1:29400"], capsys)
    assert code == 0, out
    assert [(p.nproc_per_node, p.nnodes) for p in _no_torchrun] == [(2, 2)]
    code, out = run_cli([*argv[:-1], "4"], capsys)
    assert code == 2 and "ranks 0..3 lie on one node" in out


def test_launch_over_an_earlier_run_starts_when_told_how(tmp_path, capsys, _no_torchrun):
    """The earlier run's checkpoints are fine to launch over with checkpoint.overwrite, or to resume."""
    argv = launch_over_earlier_run(tmp_path)
    assert run_cli([*argv, "checkpoint.overwrite=true"], capsys)[0] == 0
    assert run_cli([*argv, "--resume", str(tmp_path / "ck")], capsys)[0] == 0
    assert len(_no_torchrun) == 2


def test_beta_of_one_is_a_valid_config_but_not_trainable(capsys):
    """The schema's range for the betas is inclusive (`config show` accepts 1.0); training refuses it
    up front, since torch's AdamW would."""
    assert run_cli(["config", "show", TINY, "optim.beta2=1"], capsys)[0] == 0
    code, out = run_cli(["train", TINY, "optim.beta2=1"], capsys)
    assert code == 2 and "optim.beta2" in out and "Traceback" not in out


def test_plot_skips_a_cut_off_last_line(tmp_path, capsys):
    lines = [
        json.dumps({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1000.0}) for s in range(1, 6)
    ]
    write(tmp_path / "metrics.jsonl", "\n".join(lines) + '\n{"step": 6, "loss": 4.')
    code, out = run_cli(["plot", str(tmp_path)], capsys)
    assert code == 0, out
    assert "line 6 is cut off" in out
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


# --- as a user runs it: a subprocess, so nothing but the message reaches the terminal ------------


def test_in_a_subprocess_bad_input_is_one_message_and_exit_2(tmp_path):
    """Each on a path that a traceback once took: duplicate keys, a non-UTF-8 file, a zero process
    count, a data directory whose ids exceed its vocabulary (under launch: before torchrun starts)."""
    dup = config_file(tmp_path, "train:\n  steps: 5\n  steps: 6\n")
    latin1 = str(write(tmp_path / "latin1.yaml", b"log:\n  name: caf\xe9\n"))
    data = token_dir(tmp_path, meta={"dtype": "uint16", "vocab_size": 100, "max_id": 199})
    runs = [
        (["config", "show", dup], "duplicate key 'steps'"),
        (["train", latin1], "not UTF-8"),
        (["launch", TINY, "--nproc", "0"], "--nproc"),
        (
            ["launch", TINY, f"data.path={data}", f"log.dir={tmp_path}", "model.seq_len=32"],
            "vocab_size=100",
        ),
    ]
    for argv, needle in runs:
        proc = strata(*argv, cwd=tmp_path, env={"PYTHONPATH": ""}, timeout=120)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert needle in proc.stderr, (argv, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr
        assert "error:" in proc.stderr and not proc.stdout, (argv, proc.stdout)
