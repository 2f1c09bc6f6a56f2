"""The `strata` command end to end, in subprocesses as a user runs it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from strata.errors import ConfigError

from conftest import STDLIB, tiny_overrides
from worlds import REPO, strata


@pytest.mark.slow
def test_train_tiny_config_end_to_end(tmp_path):
    """The demo config (shortened) trains on the built-in corpus, prints the summary, writes its run
    directory, and `strata plot` turns the metrics into a PNG."""
    proc = strata(
        "train",
        "configs/tiny.yaml",
        "train.steps=40",
        "train.eval_interval=20",
        "optim.warmup_steps=5",
        "checkpoint.interval=0",
        "log.interval=1",
        f"log.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "done: step 40" in proc.stdout and "tokens/s" in proc.stdout
    # not a terminal: progress as one line per logged step, and each evaluation on the console
    assert "step 40/40  loss " in proc.stdout and "\r" not in proc.stderr
    assert (
        "step 20: eval loss " in proc.stdout
        and "(train.eval_batches × global_batch_size; 0 reads all of it)" in proc.stdout
    )
    run_dir = tmp_path / "tiny"
    summary = json.loads((run_dir / "summary.json").read_text())
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert summary["train_loss"] < first["loss"] - 1.0
    assert (run_dir / "checkpoints" / "step_00000040" / "COMMITTED").is_file()

    plot = strata("plot", str(run_dir))
    assert plot.returncode == 0, plot.stderr
    png = (run_dir / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bad_config_exits_nonzero_with_every_problem_and_no_traceback(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model:\n  n_head: 4\n  d_model: 100\n  n_heads: 8\noptim:\n  lr: -1\n")
    proc = strata("train", str(cfg), "train.stepz=3")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "invalid config (4 problems)" in proc.stderr
    assert "did you mean 'model.n_heads'" in proc.stderr
    assert "did you mean 'train.steps'" in proc.stderr
    assert "optim.lr: -1.0 must be >= 0.0" in proc.stderr
    assert "model.n_heads=8 must divide model.d_model=100" in proc.stderr


def test_world_size_checked_before_launch(tmp_path):
    proc = strata("launch", "configs/tiny.yaml", "parallel.dp=3", "--nproc", "2")
    assert proc.returncode == 2
    assert "tp·pp·dp = 1·1·3 = 3 but the world size is 2" in proc.stderr


def test_config_show_round_trips_and_explain(tmp_path):
    shown = strata("config", "show", "configs/tiny.yaml", "optim.lr=1e-4")
    assert shown.returncode == 0, shown.stderr
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(shown.stdout)
    again = strata("config", "show", str(resolved))
    assert again.stdout.replace("name: resolved", "name: tiny") == shown.stdout
    assert "lr: 0.0001" in shown.stdout
    explained = strata("config", "explain", "train.global_batch_size")
    assert "sequences per optimizer step" in explained.stdout and "default: 16" in explained.stdout


def test_data_prepare_from_files(tmp_path):
    proc = strata(
        "data", "prepare", str(STDLIB / "json"), "--glob", "*.py", "--out", str(tmp_path / "tok")
    )
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    n_files = len(list((STDLIB / "json").rglob("*.py")))
    total = (
        sum(p.stat().st_size for p in (STDLIB / "json").rglob("*.py")) + n_files
    )  # + one EOT per file
    assert meta["documents"] == n_files
    assert meta["train_tokens"] + meta["val_tokens"] == total
    assert (tmp_path / "tok" / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    missing = strata("data", "prepare", str(tmp_path / "nope"), "--out", str(tmp_path / "x"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def _fake_slurm_tools(bin_dir, log):
    """scontrol/srun/sbatch stand-ins that record how they were called."""
    bin_dir.mkdir()
    tools = {
        "scontrol": "echo node-a; echo node-b; echo node-c; echo node-d\n",
        # the job step (srun ... bash -c CMD) logged as the first node expands it, exec echoed
        "srun": (
            'if [ "${2:-}" = bash ] && [ "${3:-}" = -c ] && [ "${4#is_host=}" != "${4:-}" ]; then\n'
            '  set -- "$1" "$(SLURM_NODEID=0 bash -c "${4//exec /echo }")"\n'
            "fi\n"
            f'echo "srun $*" >> {log}\ncase "$*" in *hostname*) echo 127.0.0.1 ;; esac\n'
        ),
        "sbatch": f'echo "sbatch $*" >> {log}\necho "Submitted batch job 42"\n',
    }
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_is_valid_and_rendezvous_on_head_node(tmp_path):
    script = tmp_path / "job.sbatch"
    log = tmp_path / "calls.log"
    _fake_slurm_tools(tmp_path / "bin", log)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    proc = strata(
        "launch",
        "configs/tiny.yaml",
        "train.global_batch_size=256",
        "--slurm",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--script",
        str(script),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Submitted batch job 42" in proc.stdout
    assert f"sbatch {script}" in log.read_text()
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for needle in (
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "SLURM_JOB_NODELIST",
        "--rdzv-backend=c10d",
        "--nnodes=4",
        "--nproc-per-node=8",
    ):
        assert needle in text, needle

    # Execute the script against the stand-ins: srun must start torchrun with the head node's
    # address as the rendezvous endpoint and the job id as rendezvous id.
    log.write_text("")
    done = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            **os.environ,
            **env,
            "SLURM_JOB_NODELIST": "node-[a-d]",
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NUM_NODES": "4",
        },
    )
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert any("-w node-a" in c and "hostname" in c for c in calls)
    launch = next(c for c in calls if "torch.distributed.run" in c)
    assert "--rdzv-endpoint=127.0.0.1:29500" in launch and "--rdzv-id=42" in launch
    assert "launch.cli train" in launch and "train.global_batch_size=256" in launch


def test_slurm_script_with_snapshots_starts_an_agent_per_node(tmp_path):
    script = tmp_path / "job.sbatch"
    log = tmp_path / "calls.log"
    _fake_slurm_tools(tmp_path / "bin", log)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    proc = strata(
        "launch",
        "configs/tiny.yaml",
        "train.global_batch_size=256",
        "snapshot.every_steps=5",
        "--slurm",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--max-restarts",
        "3",
        "--script",
        str(script),
        "--no-submit",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert (
        "export STRATA_SNAPSHOT_SECRET=$(python" in text
        and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    )
    done = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            **os.environ,
            **env,
            "SLURM_JOB_NODELIST": "node-[a-d]",
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NUM_NODES": "4",
        },
    )
    assert done.returncode == 0, done.stderr
    node = next(c for c in log.read_text().splitlines() if "torch.distributed.run" in c)
    # srun runs, on every node, a shell that starts the agent on a private socket, then becomes torchrun
    assert node.startswith("srun --kill-on-bad-exit=1 bash -c ")
    inner = node.split("bash -c ", 1)[1]
    assert subprocess.run(["bash", "-n", "-c", inner]).returncode == 0
    assert "launch.snapshot_agent --socket" in inner and "--parent $$" in inner
    assert inner.index("STRATA_SNAPSHOT_SOCKET") < inner.index(
        "exec python -m torch.distributed.run"
    )
    assert "--max-restarts=3" in inner and "snapshot.every_steps=5" in inner


def test_slurm_without_sbatch_writes_script_and_says_where(tmp_path):
    script = tmp_path / "job.sbatch"
    env = {
        "PATH": os.path.dirname(sys.executable)
    }  # the interpreter's folder only: no Slurm client on it
    proc = strata(
        "launch",
        "configs/tiny.yaml",
        "train.global_batch_size=32",
        "--slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--script",
        str(script),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "sbatch not found" in proc.stdout and str(script) in proc.stdout
    assert script.is_file()


def test_shipped_configs_validate_and_docs_match_schema(tmp_path):
    """Every config in configs/ validates (one starting from a Hugging Face model, with a tiny one
    in its place); docs/CONFIG.md is the schema's current reference."""
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    import yaml

    from strata import config

    tiny = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,  # as many as the 70B LoRA's pipeline stages (pp 2 × 4 chunks)
        num_attention_heads=4,
    )
    transformers.LlamaForCausalLM(tiny).save_pretrained(tmp_path / "hf")
    for path in sorted(Path(REPO, "configs").glob("*.yaml")):
        named = (yaml.safe_load(path.read_text()).get("model") or {}).get("init_from")
        cfg = config.load(path, [f"model.init_from={tmp_path / 'hf'}"] if named else [])
        if named:
            assert cfg.model.d_model == 64 and cfg.model.vocab_size == 512, path
    # (config, world size it is written for, expected tp/pp/V/dp)
    for name, world, (tp, pp, v, dp) in [
        ("tiny.yaml", 2, (1, 1, 1, 2)),
        ("llama-1b.yaml", 32, (1, 1, 1, 32)),
        ("llama2-7b-3d.yaml", 32, (8, 4, 2, 1)),
        ("llama2-70b-3d.yaml", 128, (8, 8, 5, 2)),
        ("sft-llama3.1-8b.yaml", 8, (1, 1, 1, 8)),
        ("lora-llama3-70b.yaml", 4, (2, 2, 4, 1)),
    ]:
        named = (yaml.safe_load(Path(REPO, "configs", name).read_text())["model"]).get("init_from")
        hf = [f"model.init_from={tmp_path / 'hf'}"] if named else []
        cfg = config.load(Path(REPO, "configs", name), hf, world_size=world)
        par = cfg.parallel
        assert (par.tp, par.pp, par.virtual_stages, cfg.dp_size(world)) == (tp, pp, v, dp), name
        with pytest.raises(ConfigError):  # a world it does not fit is refused
            config.load(Path(REPO, "configs", name), hf, world_size=world + 1)
    assert Path(REPO, "docs/CONFIG.md").read_text() == config.reference_markdown()


def test_launch_env_makes_restarts_work_and_multi_node_snapshots_need_one_secret(monkeypatch):
    from strata.errors import StrataError
    from strata.launch.torchrun import LaunchPlan, launch_env, torchrun_args

    monkeypatch.delenv("STRATA_SNAPSHOT_SECRET", raising=False)
    env = launch_env(LaunchPlan(2, snapshots=True))
    assert (
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        and len(bytes.fromhex(env["STRATA_SNAPSHOT_SECRET"])) == 32
    )
    with pytest.raises(StrataError, match="export STRATA_SNAPSHOT_SECRET="):
        launch_env(LaunchPlan(2, nnodes=2, snapshots=True))
    args = torchrun_args(
        LaunchPlan(
            2, nnodes=2, rdzv_endpoint="h:1", external_store=True, join_timeout_s=30, max_restarts=3
        )
    )
    conf = args[args.index("--rdzv-conf") + 1]
    assert (
        "is_host=false" in conf
        and "join_timeout=30" in conf
        and args[args.index("--max-restarts") + 1] == "3"
    )


def test_several_workers_on_a_node_get_one_thread_each_unless_the_user_says_otherwise(monkeypatch):
    """torchrun's OMP_NUM_THREADS default, already in the environment torchrun starts with (the fork
    server, started before torchrun sets it, imports torch with the workers' value)."""
    from strata.launch.torchrun import LaunchPlan, launch_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch_env(LaunchPlan(2))["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in launch_env(LaunchPlan(1))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch_env(LaunchPlan(2))["OMP_NUM_THREADS"] == "3"


LAUNCH_WITHOUT_TORCHRUN = """
import sys
from strata.launch import cli, torchrun
seen = []
torchrun.run_local = lambda *args: seen.append(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
assert cli.main(["launch", *sys.argv[1:]]) is None
print(seen[0])
"""


def test_strata_launch_checks_the_job_without_importing_torch(small_data_dir, tmp_path):
    """Everything `strata launch` does before starting torchrun (the config, the data, earlier
    checkpoints, the planner's memory warning) runs without torch, whose import takes seconds that
    every job's start would pay once more."""
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    argv = [
        str(experiment),
        *tiny_overrides(
            small_data_dir,
            tmp_path,
            **{f"zero.{s}.shard_over": "global" for s in ("params", "grads", "optim")},
        ),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH_WITHOUT_TORCHRUN, *argv, "--nproc", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_options_and_overrides_come_in_any_order():
    """A command's options and key=value overrides mix freely after its positional arguments."""
    from strata.launch.cli import parse_args

    def parsed(*argv):
        args = vars(parse_args(list(argv)))
        return {k: v for k, v in args.items() if k != "func"}

    orders = [
        ("launch", "c.yaml", "--nproc", "2", "train.steps=5", "optim.lr=1"),
        ("launch", "c.yaml", "train.steps=5", "--nproc", "2", "optim.lr=1"),
        ("launch", "--nproc", "2", "c.yaml", "train.steps=5", "optim.lr=1"),
        ("launch", "c.yaml", "train.steps=5", "optim.lr=1", "--nproc=2"),
    ]
    launches = [parsed(*o) for o in orders]
    assert all(a == launches[0] for a in launches)
    assert launches[0]["nproc"] == 2 and launches[0]["overrides"] == ["train.steps=5", "optim.lr=1"]

    trains = [
        parsed("train", "c.yaml", "train.steps=5", "--resume", "ck"),
        parsed("train", "c.yaml", "--resume", "ck", "train.steps=5"),
        parsed("train", "--resume", "ck", "c.yaml", "train.steps=5"),
    ]
    assert all(t == trains[0] for t in trains) and trains[0]["resume"] == "ck"
    assert trains[0]["overrides"] == ["train.steps=5"] and trains[0]["command"] == "train"

    # an option's value may itself hold '=' (--to); the overrides keep their order, later wins
    reshards = [
        parsed("ckpt", "reshard", "in", "out", "--to", "tp=2,pp=1,dp=1", "zero.level=1", "a.b=2"),
        parsed("ckpt", "reshard", "in", "out", "zero.level=1", "--to", "tp=2,pp=1,dp=1", "a.b=2"),
        parsed("ckpt", "reshard", "--to", "tp=2,pp=1,dp=1", "in", "out", "zero.level=1", "a.b=2"),
    ]
    assert all(r == reshards[0] for r in reshards)
    assert (reshards[0]["to"], reshards[0]["out"], reshards[0]["overrides"]) == (
        "tp=2,pp=1,dp=1",
        "out",
        ["zero.level=1", "a.b=2"],
    )


def test_config_show_takes_overrides_before_or_after_options():
    shown = [
        strata(
            "config",
            "show",
            "configs/tiny.yaml",
            "optim.lr=1e-4",
            "train.global_batch_size=32",
            "--world-size",
            "2",
        ),
        strata(
            "config",
            "show",
            "configs/tiny.yaml",
            "optim.lr=1e-4",
            "--world-size",
            "2",
            "train.global_batch_size=32",
        ),
        strata(
            "config",
            "show",
            "--world-size",
            "2",
            "configs/tiny.yaml",
            "optim.lr=1e-4",
            "train.global_batch_size=32",
        ),
    ]
    assert [p.returncode for p in shown] == [0, 0, 0], shown[0].stderr
    assert shown[0].stdout == shown[1].stdout == shown[2].stdout
    assert "lr: 0.0001" in shown[0].stdout and "global_batch_size: 32" in shown[0].stdout
    # the world size after an override still takes part in the check
    bad = strata("config", "show", "configs/tiny.yaml", "parallel.dp=3", "--world-size", "2")
    assert (
        bad.returncode == 2
        and "but the world size is 2" in bad.stderr
        and "Traceback" not in bad.stderr
    )


def test_version():
    import strata as package

    proc = strata("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"strata {package.__version__}"


def _commands():
    from strata.launch import cli

    return cli._parsers()[1]


def test_every_command_shows_examples_that_parse_and_the_exit_codes(capsys):
    """--help on `strata` and on each command shows examples (each one a command line that parses),
    and the top-level help says what the exit codes mean."""
    import shlex

    from strata.launch.cli import main, parse_args

    for argv in (["--help"], *([name, "--help"] for name in _commands())):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "examples:\n  strata " in text, argv
        examples = text.split("examples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
        for line in examples:
            words = shlex.split(line, comments=True)
            assert words[0] == "strata" and parse_args(words[1:]).command == words[1], line
        if argv == ["--help"]:
            top = text
    codes = top.split("exit codes:", 1)[1]
    assert "0      done" in codes and "2      user error" in codes and "no traceback" in codes
    assert (
        "1 e.g. when `strata ckpt verify` or `inspect` finds damage" in codes
        and "crashed worker" in codes
    )
    assert "75     stopped by a signal" in codes and "128+N" in codes


@pytest.mark.parametrize(
    "argv",
    [[], ["nope"], ["--nope"]]
    + [
        [name, "--no-such-option"]
        for name in (
            "train",
            "launch",
            "store",
            "config",
            "plan",
            "data",
            "ckpt",
            "eval",
            "generate",
            "plot",
        )
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    from strata.launch.cli import main

    assert set(_commands()) == {
        "train",
        "launch",
        "store",
        "config",
        "plan",
        "data",
        "ckpt",
        "eval",
        "generate",
        "plot",
    }
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "usage: strata" in err and "error:" in err


def test_usage_error_in_a_subprocess_has_no_traceback():
    for argv in (
        ["launch", "configs/tiny.yaml", "--nproc", "two"],
        ["config", "show"],
        ["ckpt", "frobnicate", "x"],
        ["ckpt", "verify", "a", "b"],
    ):
        proc = strata(*argv)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (argv, proc.stderr)
        assert "error:" in proc.stderr


def test_ckpt_out_before_overrides(tmp_path, capsys):
    from strata.launch.cli import main

    assert main(["ckpt", "reshard", str(tmp_path), "zero.level=1", "--to", "tp=2,pp=1,dp=1"]) == 2
    assert "OUT comes before the overrides" in capsys.readouterr().err


THP = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGES_AFTER_A_COMMAND = """
import contextlib, io, os, sys
from strata.launch import cli
with contextlib.redirect_stdout(io.StringIO()):
    cli.main(["config", "show", "configs/tiny.yaml"])
import torch
t = torch.ones(64 * 2**20 // 4)
print(os.environ["THP_MEM_ALLOC_ENABLE"], next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup")
      if line.startswith("AnonHugePages")))
"""


@pytest.mark.skipif(
    not os.path.isfile(THP) or "[never]" in open(THP).read(),
    reason="the kernel has transparent huge pages off",
)
@pytest.mark.slow  # two fresh interpreters import torch and allocate: ~6 s on 2 cores
def test_the_strata_command_puts_torchs_large_host_allocations_on_huge_pages():
    """The `strata` entry point sets torch's THP switch before torch is imported (torch reads it once,
    at its first allocation), so a 64 MiB tensor made after a command sits on huge pages; a value the
    user set is kept."""
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    for user_value, want_flag in ((None, "1"), ("0", "0")):
        env = clean if user_value is None else {**clean, "THP_MEM_ALLOC_ENABLE": user_value}
        proc = subprocess.run(
            [sys.executable, "-c", HUGE_PAGES_AFTER_A_COMMAND],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        flag, huge_kib = proc.stdout.split()
        assert flag == want_flag
        assert (int(huge_kib) > 0) == (want_flag == "1"), proc.stdout


def test_config_show_and_explain_have_their_own_help_and_explain_alone_lists_the_groups(capsys):
    from strata.config.schema import GROUPS
    from strata.launch.cli import main

    for action, usage in (
        ("show", "usage: strata config show CFG [key=value ...] [--world-size N]\n"),
        ("explain", "usage: strata config explain [KEY | GROUP]\n"),
    ):
        with pytest.raises(SystemExit) as done:
            main(["config", action, "--help"])
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(usage)
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    parent = capsys.readouterr().out
    assert "    show " in parent and "    explain " in parent

    assert main(["config", "explain"]) == 0
    listed = capsys.readouterr().out
    assert all(f"\n  {group} " in listed for group in GROUPS), listed
    assert "strata config explain GROUP" in listed and "strata config explain KEY" in listed
    assert max(map(len, listed.splitlines())) <= 100


def test_config_show_still_says_what_is_missing(capsys):
    from strata.launch.cli import main

    with pytest.raises(SystemExit) as done:
        main(["config", "show"])
    assert done.value.code == 2
    assert "required: CFG" in capsys.readouterr().err


@pytest.mark.parametrize(
    "key,suggestion",
    [
        ("optim.learning_rate", "optim.lr"),
        ("learning_rate", "optim.lr"),
        ("optim.warmup", "optim.warmup_steps"),
        ("train.max_steps", "train.steps"),
        ("model.hidden_size", "model.d_model"),
        ("model.n_head", "model.n_heads"),
    ],
)
def test_explain_suggests_the_key_another_frameworks_name_means(key, suggestion, capsys):
    from strata.launch.cli import main

    assert main(["config", "explain", key]) == 2
    assert f"did you mean {suggestion!r}?" in capsys.readouterr().err


def test_every_subcommand_has_its_own_help_with_examples_that_parse(capsys):
    """`strata config show --help`, `strata ckpt inspect --help`, `strata data prepare --help`,
    `strata plot schedule --help`, ...: each its own usage and examples, not its command's."""
    import shlex

    from strata.launch import cli

    words = cli._parsers()[2]
    assert {c: set(w) for c, w in words.items()} == {
        "config": {"show", "explain"},
        "ckpt": {"inspect", "verify", "reshard", "export", "import-deepspeed", "import-hf"},
        "data": {"prepare"},
        "plot": {"schedule"},
    }
    for command, parsers in words.items():
        for word in parsers:
            with pytest.raises(SystemExit) as done:
                cli.main([command, word, "--help"])
            assert done.value.code == 0
            text = capsys.readouterr().out
            forms = [
                line.split("strata ", 1)[1]
                for line in text.split("\n\n", 1)[0].splitlines()
                if line.startswith(("usage: strata ", "       strata "))
            ]
            assert forms and all(f.startswith(f"{command} {word} ") for f in forms), text
            examples = text.split("examples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
            for line in examples:
                argv = shlex.split(line, comments=True)[1:]
                if argv[:2] == [command, word]:
                    assert cli.parse_args(argv).action == word, line


def test_a_subcommands_word_may_follow_options_but_not_another_positional(tmp_path, capsys):
    from strata.launch.cli import main, parse_args

    assert parse_args(["config", "--world-size", "2", "show", "c.yaml"]).world_size == 2
    assert parse_args(["ckpt", "--format", "hf", "export", "a", "b"]).format == "hf"
    assert parse_args(["plot", "--out", "x.png", "schedule", "r.json"]).record == "r.json"
    # `strata plot RUN_DIR schedule` is a run directory and a stray word, as before
    assert main(["plot", str(tmp_path), "schedule"]) == 2
    assert "unexpected second argument 'schedule'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["plot", "schedule"])
    assert done.value.code == 2
    assert "strata plot schedule: error: the following arguments are required: RECORD.json" in (
        capsys.readouterr().err
    )


def test_help_texts_name_step_directories_with_8_digits_and_an_installable_eval_extra(capsys):
    import re

    from strata.launch import cli

    _, commands, words = cli._parsers()
    argvs = [[c, "--help"] for c in commands] + [[c, w, "--help"] for c in words for w in words[c]]
    for argv in argvs:
        with pytest.raises(SystemExit):
            cli.main(argv)
        text = capsys.readouterr().out
        assert all(len(d) == 8 for d in re.findall(r"step_(\d+)", text)), (argv, text)
        assert "strata-train[eval]" not in text, argv
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    assert "pip install -e '.[eval]'" in capsys.readouterr().out
