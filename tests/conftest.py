"""Shared test fixtures: a small prepared token directory, tiny configs, and an isolated cache."""

from __future__ import annotations

import os
import signal
import sysconfig
from pathlib import Path

import pytest
import torch

from strata import config
from strata.data.prepare import prepare

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A handful of real stdlib sources: enough tokens for tiny runs, prepared in well under a second.
SMALL_CORPUS = [
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "textwrap.py",
    "json/decoder.py",
    "json/encoder.py",
    "difflib.py",
    "shlex.py",
]


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    """Keep caches and torchrun's scratch files out of the user's home and /tmp root, and give every
    test the environment the session started with: the `strata` entry point, run in this process
    (`run_cli`), sets defaults in os.environ (THP_MEM_ALLOC_ENABLE, and OMP_WAIT_POLICY=PASSIVE when
    the cores look busy), which every later test's subprocesses would otherwise inherit. The stop
    signals' handlers are put back too: a trainer stopped by a signal in this process leaves that
    signal ignored on its way out, and an ignored signal is inherited by every process started after
    (a shell starts a background job with SIGINT ignored too: each test runs as in the foreground)."""
    before = dict(os.environ)
    handlers = {
        sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    }
    if (
        handlers[signal.SIGINT] == signal.SIG_IGN
    ):  # a suite started in the background (`pytest &`): as in the foreground
        signal.signal(signal.SIGINT, signal.default_int_handler)
    scratch = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("STRATA_CACHE", str(scratch / "strata-cache"))
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    for sig, handler in handlers.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is fastest and immune to CPU contention; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "small"
    prepare([STDLIB / f for f in SMALL_CORPUS], out, val_fraction=0.2, root=STDLIB)
    return out


def prepare_readme(out: Path, tokenizer: str) -> Path:
    """The README cut into 8 documents of 2000 characters, prepared with `strata data prepare
    --tokenizer TOKENIZER` (bpe:N trains one) into `out`, as a user prepares text."""
    from worlds import REPO, strata

    corpus = out.with_name(out.name + "-corpus")
    corpus.mkdir(parents=True)
    text = (REPO / "README.md").read_text()
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(text[i * 2000 : (i + 1) * 2000])
    prep = strata(
        "data",
        "prepare",
        str(corpus),
        "--out",
        str(out),
        "--tokenizer",
        tokenizer,
        "--workers",
        "1",
    )
    assert prep.returncode == 0, prep.stderr[-3000:]
    return out


def tiny_hf_llama(directory: Path) -> Path:
    """A tiny random Hugging Face Llama (vocabulary 64, width 32, one layer) saved to `directory`
    by transformers itself, offline; skips the test where transformers is missing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


def save_gqa_llama(directory: Path, vocab_size: int) -> Path:
    """A tiny random Llama (2 layers, grouped-query attention, untied) saved by transformers, seeded
    so that each test module gets the same weights."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


def hf_run_overrides(
    hf_dir: Path | str, data_dir: Path, run_root: Path, seq_len: int, **extra
) -> list[str]:
    """A short run from the Hugging Face directory `hf_dir`: only the keys its config.json leaves to the user."""
    base = {
        "model.init_from": hf_dir,
        "model.seq_len": seq_len,
        "data.path": data_dir,
        "log.dir": run_root,
        "log.name": "t",
        "log.progress": "false",
        "log.interval": 1,
        "train.steps": 4,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 2,
        "train.eval_interval": 0,
        "train.eval_batches": 2,
        "optim.warmup_steps": 2,
        "optim.lr": 1e-3,
        "checkpoint.save_final": "true",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def tiny_overrides(data_dir: Path, run_root: Path, **extra) -> list[str]:
    """Overrides for a model small enough that a step takes milliseconds."""
    base = {
        "data.path": str(data_dir),
        "log.dir": str(run_root),
        "log.progress": False,
        "log.name": "t",
        "model.n_layers": 2,
        "model.d_model": 32,
        "model.n_heads": 4,
        "model.seq_len": 32,
        "train.steps": 6,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 2,
        "train.eval_interval": 0,
        "train.eval_batches": 2,
        "optim.warmup_steps": 2,
        "optim.lr": 1e-2,
        "checkpoint.save_final": False,
    }
    base.update(extra)
    return [
        f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
        for k, v in base.items()
    ]


def tiny_config(
    data_dir: Path, run_root: Path, world_size: int | None = 1, **extra
) -> config.Config:
    return config.load(None, tiny_overrides(data_dir, run_root, **extra), world_size=world_size)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit status and everything printed by `strata ARGV`, run in this process (argparse's usage
    errors exit via SystemExit)."""
    from strata.launch.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture(scope="session")
def _netns():
    """Skip where network namespaces cannot be made (tests/cluster.py), unless STRATA_REQUIRE_NETNS=1
    (CI), where that is a failure."""
    from cluster import unavailable

    problem = unavailable()
    runs_unless(
        problem and f"network namespaces cannot be made here: {problem}", "STRATA_REQUIRE_NETNS"
    )


def runs_unless(problem: str | None, required_by: str) -> None:
    """Skip the test for `problem` (None: it runs), or fail it where the environment variable
    `required_by` is 1: CI sets it, so a missing capability there is an error, not a skip."""
    if not problem:
        return
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{required_by}=1 but {problem}")
    pytest.skip(problem)


netns = pytest.mark.usefixtures("_netns")  # marks a test that runs on the namespace cluster
