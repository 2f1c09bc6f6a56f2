"""The experiment schema: combined validation errors, overrides, round trips, docs, safe YAML."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from strata import config
from strata.config import (
    CO2Config,
    Config,
    ModelConfig,
    OptimConfig,
    ShardSpec,
    TrainConfig,
    ZeroConfig,
    opt,
)
from strata.config.schema.keys import plain
from strata.errors import ConfigError, StrataError
from strata.parallel.topology import LEVELS


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def header_count(err: ConfigError) -> int:
    m = re.match(r"invalid config \((\d+) problems?\):", str(err))
    assert m, f"no 'invalid config (N problems)' header in {str(err)!r}"
    return int(m.group(1))


def listed_problems(err: ConfigError) -> list[str]:
    return [line[4:] for line in str(err).splitlines()[1:] if line.startswith("  - ")]


def load_error(*args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config.load(*args, **kwargs)
    err = info.value
    # The header count, the listed lines and the problems attribute always agree.
    assert header_count(err) == len(err.problems) == len(listed_problems(err))
    for p in err.problems:
        assert f"  - {p}" in str(err)
    return err


# --- one combined error ---------------------------------------------------------------------


def test_every_problem_is_reported_in_one_error(tmp_path):
    path = write_yaml(
        tmp_path / "bad.yaml",
        """
trian:
  steps: 5
model:
  n_head: 4
  d_model: 130
  n_layers: true
train:
  precision: fp16
  eval_batches: many
log:
  progress: 1
optim:
  lr: -0.1
  warmup_steps: 500
""",
    )
    err = load_error(path, ["train.steps", "steps=5"])
    msg = str(err)
    expected = [
        "trian: unknown key; did you mean 'train'?",  # unknown group
        "model.n_head: unknown key; did you mean 'model.n_heads'?",  # unknown key
        "model.n_layers: expected int, got True",  # bool for int
        "train.precision: 'fp16' is not one of: fp32, bf16, fp8",  # choices
        "train.eval_batches: expected int, got 'many'",  # string for int
        "log.progress: expected bool, got 1",  # number for bool
        "optim.lr: -0.1 must be >= 0",  # out of range
        "model.n_heads=4 must divide model.d_model=130",  # cross-key
        "override 'train.steps': write it as group.key=value",  # no '='
        "override 'steps=5': write it as group.key=value",  # no dot
    ]
    for text in expected:
        assert text in msg, f"missing {text!r} in:\n{msg}"
    assert header_count(err) == len(expected) == 10
    assert msg.startswith("invalid config (10 problems):\n")
    assert (
        "warmup_steps" not in msg
    )  # a warm-up longer than the run is a start-up warning, not an error


def test_single_problem_header_is_singular():
    err = load_error(None, ["optim.lr=-1"])
    assert str(err).startswith("invalid config (1 problem):\n  - optim.lr: -1.0 must be >= 0")


@pytest.mark.parametrize(
    "raw_key, suggestion",
    [
        ("model.n_head", "model.n_heads"),
        ("model.nheads", "model.n_heads"),
        ("optim.lrr", "optim.lr"),
        ("train.step", "train.steps"),
        ("zero.params.shard_ovr", "zero.params.shard_over"),
    ],
)
def test_unknown_key_suggests_the_closest(raw_key, suggestion):
    err = load_error(None, [f"{raw_key}=1"])
    assert err.problems == [f"{raw_key}: unknown key; did you mean {suggestion!r}?"]


def test_unknown_group_suggests_the_closest(tmp_path):
    err = load_error(write_yaml(tmp_path / "x.yaml", "trian:\n  steps: 5\nmodle: {}\n"))
    assert "trian: unknown key; did you mean 'train'?" in err.problems
    assert "modle: unknown key; did you mean 'model'?" in err.problems
    assert header_count(err) == 2


def test_unknown_key_without_close_match_lists_valid_keys():
    err = load_error(None, ["train.zzzzzzzz=1"])
    (p,) = err.problems
    assert p.startswith("train.zzzzzzzz: unknown key; valid: ")
    assert "did you mean" not in p


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.steps=ten", "train.steps: expected int, got 'ten' (use a whole number)"),
        ("train.steps=true", "train.steps: expected int, got True (use a whole number)"),
        ("train.steps=3.5", "train.steps: expected int, got 3.5 (use a whole number)"),
        ("model.n_kv_heads=false", "model.n_kv_heads: expected int or null, got False"),
        ("log.progress=1", "log.progress: expected bool, got 1 (use true or false)"),
        ("model.tie_embeddings=0.0", "model.tie_embeddings: expected bool, got 0.0"),
        ("optim.lr=fast", "optim.lr: expected float, got 'fast' (use a number)"),
        ("optim.lr=true", "optim.lr: expected float, got True"),
        ("train.precision=16", "train.precision: expected str, got 16"),
    ],
)
def test_wrong_types_are_rejected(override, expected):
    err = load_error(None, [override])
    assert len(err.problems) == 1
    assert err.problems[0].startswith(expected), err.problems


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.lr=-0.001", "optim.lr: -0.001 must be >= 0"),
        ("optim.beta2=1.5", "optim.beta2: 1.5 must be <= 1"),
        ("model.rope_theta=0", "model.rope_theta: 0.0 must be > 0"),
        ("model.n_layers=0", "model.n_layers: 0 must be >= 1"),
        ("optim.lr=.nan", "optim.lr: nan must be finite"),
        ("optim.lr=.inf", "optim.lr: inf must be finite"),
        ("train.precision=fp16", "train.precision: 'fp16' is not one of: fp32, bf16, fp8"),
        ("optim.schedule=step", "optim.schedule: 'step' is not one of: cosine, linear, constant"),
        ("parallel.backend=mpi", "parallel.backend: 'mpi' is not one of: auto, gloo, nccl"),
        (
            "zero.optim.shard_over=rack",
            "zero.optim.shard_over: 'rack' is not one of: none, gcd, gpu, node, global",
        ),
        ("co2.outer_momentum=1", "co2.outer_momentum: 1.0 must be < 1"),
        ("co2.outer_every=0", "co2.outer_every: 0 must be >= 1"),
        ("zero.prefetch_blocks=-1", "zero.prefetch_blocks: -1 must be >= 0"),
    ],
)
def test_out_of_range_values_are_rejected(override, expected):
    err = load_error(None, [override])
    assert len(err.problems) == 1 and err.problems[0].startswith(expected), err.problems


def test_range_limits_are_inclusive_where_documented():
    cfg = config.load(
        None, ["optim.lr=0", "optim.beta1=1", "optim.min_lr_ratio=0", "optim.warmup_steps=0"]
    )
    assert (cfg.optim.lr, cfg.optim.beta1, cfg.optim.min_lr_ratio, cfg.optim.warmup_steps) == (
        0.0,
        1.0,
        0.0,
        0,
    )


@pytest.mark.parametrize(
    "overrides, world_size, expected",
    [
        (["model.d_model=130"], None, "model.n_heads=4 must divide model.d_model=130"),
        (["model.n_kv_heads=3"], None, "model.n_kv_heads=3 must divide model.n_heads=4"),
        (["model.d_model=12"], None, "head size d_model/n_heads=3 must be even for RoPE"),
        (
            ["train.micro_batch_size=5"],
            None,
            "train.micro_batch_size=5 must divide train.global_batch_size=16",
        ),
        (["parallel.dp=3"], 4, "parallel: tp·pp·dp = 1·1·3 = 3 but the world size is 4"),
        ([], 4, "train.global_batch_size=16 must be a multiple of train.micro_batch_size·dp = 8·4"),
        (
            ["train.global_batch_size=24"],
            2,
            "train.global_batch_size=24 must be a multiple of train.micro_batch_size·dp = 8·2",
        ),
    ],
)
def test_cross_key_constraints(overrides, world_size, expected):
    err = load_error(None, overrides, world_size=world_size)
    assert len(err.problems) == 1, err.problems
    assert err.problems[0].startswith(expected), err.problems


@pytest.mark.parametrize(
    "overrides, world_size, expected",
    [
        (["parallel.cp=3"], None, "model.seq_len=128 must be a multiple of 2·parallel.cp = 6"),
        (["parallel.cp=3"], 4, "world size 4 is not divisible by parallel.tp·pp·cp = 1·1·3 = 3"),
        (
            ["parallel.cp=2", "parallel.dp=3"],
            4,
            "parallel: tp·pp·cp·dp = 1·1·2·3 = 6 but the world size is 4",
        ),
        (
            ["parallel.cp=8", "parallel.cp_mode=alltoall"],
            None,
            "parallel.cp_mode=alltoall needs parallel.cp=8 to divide the 4 attention heads",
        ),
        (
            [
                "parallel.cp=2",
                "parallel.tp=4",
                "parallel.sequence_parallel=true",
                "model.seq_len=20",
            ],
            None,
            "parallel.sequence_parallel splits each context-parallel rank's 10 tokens over tp=4",
        ),
    ],
)
def test_context_parallel_errors_name_the_fix(overrides, world_size, expected):
    err = load_error(None, overrides, world_size=world_size)
    assert any(p.startswith(expected) for p in err.problems), err.problems


def test_lora_and_freeze_keys():
    cfg = config.load(
        None,
        [
            "model.lora.rank=8",
            "model.lora.alpha=16",
            "model.lora.target_modules=[all-linear]",
            "train.freeze=[embeddings, layers.0-1, norms]",
        ],
    )
    assert cfg.model.lora.enabled and cfg.model.lora.scale == 2.0
    assert cfg.train.freeze == ("embeddings", "layers.0-1", "norms")
    assert not config.load(None, []).model.lora.enabled


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["model.lora.target_modules=[qproj]"],
            "model.lora.target_modules: item 1 is 'qproj', which is not one of: q_proj, k_proj",
        ),
        (["model.lora.rank=-1"], "model.lora.rank: -1 must be >= 0"),
        (["model.lora.dropout=1"], "model.lora.dropout: 1.0 must be < 1"),
        (["model.lora.target_modules=[]"], "model.lora.target_modules: [] has 0 items"),
        (
            ["train.freeze=[layers.5-2]"],
            "train.freeze: 'layers.5-2' is a reversed layer range; give layers.FIRST-LAST",
        ),
        (["train.freeze=['']"], "train.freeze: an empty item names nothing"),
        (
            ["model.lora.rank=4", "train.precision=fp8", "train.compile=true"],
            "model.lora with train.precision=fp8",
        ),
    ],
)
def test_lora_and_freeze_errors_name_the_fix(overrides, expected):
    err = load_error(None, overrides)
    assert len(err.problems) == 1 and err.problems[0].startswith(expected), err.problems


def test_context_parallel_takes_its_ranks_out_of_data_parallel():
    cfg = config.load(
        None,
        ["parallel.cp=2", "parallel.tp=2", "train.global_batch_size=8", "train.micro_batch_size=2"],
    )
    assert cfg.dp_size(8) == 2 and cfg.grad_accum_steps(8) == 2  # 8 ranks: tp 2 · cp 2 · dp 2


def test_tensor_parallel_must_divide_heads():
    err = load_error(None, ["parallel.tp=3"])
    assert "parallel.tp=3 must divide model.n_heads=4" in err.problems
    # tp that divides the heads (and everything else) is a valid layout
    assert config.load(None, ["parallel.tp=2"]).parallel.tp == 2


def test_pipeline_layout_errors_name_the_fix():
    err = load_error(None, ["parallel.pp=2", "parallel.virtual_stages=2", "model.n_layers=6"])
    assert any(
        "pp·virtual_stages = 2·2 = 4 pipeline stages must divide model.n_layers=6" in p
        for p in err.problems
    )
    err = load_error(None, ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.schedule=1f1b"])
    assert any("schedule=1f1b runs one stage per rank" in p for p in err.problems)
    err = load_error(None, ["parallel.pp=2", "parallel.schedule=zbv_zero_bubble"])
    assert any("exactly two stages per rank" in p for p in err.problems)
    err = load_error(None, ["parallel.virtual_stages=2"])
    assert any("needs pipeline parallelism" in p for p in err.problems)
    # M = 16 / (8·1) = 2 micro-batches cannot fill 4 pipeline stages
    err = load_error(None, ["parallel.pp=4"], world_size=4)
    assert any("at least pp=4 micro-batches per step but gets 2" in p for p in err.problems)
    err = load_error(
        None,
        ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.schedule=dualpipev"],
        world_size=2,
    )
    assert any(
        "dualpipev needs at least as many micro-batches as stages (2·pp = 4) but gets 2" in p
        for p in err.problems
    )
    err = load_error(None, ["parallel.pp=2", "parallel.microbatches=4"], world_size=2)
    assert any("set train.micro_batch_size=4" in p for p in err.problems)
    err = load_error(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=33"])
    assert any("model.seq_len=33 must be a multiple of tp" in p for p in err.problems)
    cfg = config.load(
        None,
        ["parallel.pp=2", "parallel.virtual_stages=2", "train.micro_batch_size=4"],
        world_size=2,
    )
    assert cfg.grad_accum_steps(2) == 4 and cfg.parallel.schedule == "auto"


def test_world_size_not_divisible_by_model_parallel():
    err = load_error(None, ["parallel.pp=3", "model.n_layers=6"], world_size=4)
    assert any(
        p.startswith("world size 4 is not divisible by parallel.tp·pp = 1·3") for p in err.problems
    )


# an MoE model with room in its batch for every world size below
MOE = ["model.moe.num_experts=24", "train.global_batch_size=48", "train.micro_batch_size=1"]
HIERARCHICAL = [*MOE, "parallel.ep_dispatch=hierarchical"]
ONE_NODE = "ranks 0..3 lie on one node"
UNEVEN = "ranks 0..5 are cut by the nodes into pieces of [2, 4] ranks"


@pytest.mark.parametrize(
    "overrides, world_size, local, expected",
    [
        # the expert-parallel group inside one node: a set ranks_per_node decides without a world
        ([*HIERARCHICAL, "parallel.ep=4", "parallel.ranks_per_node=4"], None, None, ONE_NODE),
        ([*HIERARCHICAL, "parallel.ep=4", "parallel.ranks_per_node=4"], 8, None, ONE_NODE),
        ([*HIERARCHICAL, "parallel.ep=4"], 8, None, "world size 8), " + ONE_NODE),
        ([*HIERARCHICAL, "parallel.ep=4"], 8, 4, "LOCAL_WORLD_SIZE=4), " + ONE_NODE),
        # spanning nodes in pieces of different sizes
        ([*HIERARCHICAL, "parallel.ep=6", "parallel.ranks_per_node=4"], None, None, UNEVEN),
        ([*HIERARCHICAL, "parallel.ep=6", "parallel.ranks_per_node=4"], 12, None, UNEVEN),
        ([*HIERARCHICAL, "parallel.ep=6"], 12, 4, UNEVEN),
    ],
    ids=[
        "inside-no-world",
        "inside",
        "inside-one-node-world",
        "inside-launcher-node",
        "uneven-no-world",
        "uneven",
        "uneven-launcher-node",
    ],
)
def test_a_hierarchical_expert_dispatch_the_nodes_cannot_carry_is_refused(
    overrides, world_size, local, expected
):
    err = load_error(None, overrides, world_size=world_size, local_world_size=local)
    (problem,) = err.problems
    assert problem.startswith(
        "parallel.ep_dispatch=hierarchical needs each expert-parallel group of "
    )
    assert expected in problem and "use ep_dispatch=flat or auto" in problem, problem


@pytest.mark.parametrize(
    "overrides, world_size, local",
    [
        ([*HIERARCHICAL, "parallel.ep=8", "parallel.ranks_per_node=4"], None, None),
        ([*HIERARCHICAL, "parallel.ep=8", "parallel.ranks_per_node=4"], 8, None),
        ([*HIERARCHICAL, "parallel.ep=4"], 8, 2),  # the launcher's nodes of 2
        ([*HIERARCHICAL, "parallel.ep=4"], None, None),  # where nodes cut the world is not known
        ([*MOE, "parallel.ep=4", "parallel.ranks_per_node=4"], 8, None),  # auto: flat here
        (
            [*MOE, "parallel.ep=6", "parallel.ranks_per_node=4", "parallel.ep_dispatch=flat"],
            12,
            None,
        ),
    ],
    ids=["spans-no-world", "spans", "launcher-nodes", "no-world", "auto", "flat"],
)
def test_an_expert_dispatch_the_nodes_carry_passes(overrides, world_size, local):
    config.load(None, overrides, world_size=world_size, local_world_size=local)


def test_the_expert_dispatch_is_refused_with_the_other_layout_errors():
    err = load_error(
        None,
        [*HIERARCHICAL, "parallel.ep=4", "parallel.ranks_per_node=4", "train.global_batch_size=20"],
        world_size=8,
    )
    assert len(err.problems) == 2, err.problems
    assert ONE_NODE in err.problems[0]
    assert err.problems[1].startswith("train.global_batch_size=20 must be a multiple")


def test_tensor_parallel_must_divide_the_dense_layers_default_swiglu_width():
    """d_model=96 gives the default SwiGLU width 256, which tp=3 cannot split; an all-MoE model has
    no dense feed-forward to split."""
    dense = ["parallel.tp=3", "model.n_heads=6", "model.d_model=96", "model.pad_vocab_multiple=96"]
    err = load_error(None, dense)
    assert err.problems == [
        "parallel.tp=3 must divide the dense layers' SwiGLU width 256 (model.ffn_hidden null: "
        "2/3·4·d_model rounded up to a multiple of 32); set model.ffn_hidden to a multiple of tp"
    ]
    assert config.load(None, [*dense, "model.ffn_hidden=384"]).model.ffn_size == 384
    moe = ["model.moe.num_experts=3", "parallel.sequence_parallel=true", "model.seq_len=96"]
    assert config.load(None, [*dense, *moe]).model.ffn_size == 256


def test_valid_layouts_pass():
    cfg = config.load(None, [], world_size=2)
    assert cfg.dp_size(2) == 2 and cfg.grad_accum_steps(2) == 1
    cfg = config.load(None, ["parallel.dp=4", "train.global_batch_size=64"], world_size=4)
    assert cfg.dp_size(4) == 4 and cfg.grad_accum_steps(4) == 2
    cfg = config.load(None, ["model.n_kv_heads=2"], world_size=1)
    assert cfg.model.n_kv_heads == 2 and cfg.grad_accum_steps(1) == 2


def test_cross_check_naming_a_rejected_key_is_dropped():
    # train.micro_batch_size is rejected (keeps its default 8), so "8 must divide 12" would mislead.
    err = load_error(None, ["train.micro_batch_size=abc", "train.global_batch_size=12"])
    assert len(err.problems) == 1
    assert err.problems[0].startswith("train.micro_batch_size: expected int")


def test_warmup_longer_than_the_run_loads_with_a_warning():
    """A short trial of a long config (the shipped tiny.yaml with train.steps=4) is valid: the
    warm-up is cut short, which rank 0 prints as a warning at start-up."""
    cfg = config.load(None, ["optim.warmup_steps=301"])
    (warning,) = config.start_up_warnings(cfg)
    assert warning.startswith(
        "optim.warmup_steps=301 exceeds train.steps=300: the warm-up is cut short"
    )
    assert "lower optim.warmup_steps or train longer" in warning
    assert config.start_up_warnings(config.load(None, ["optim.warmup_steps=300"])) == []
    tiny = config.load(
        Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml", ["train.steps=4"]
    )
    assert [w.split(":")[0] for w in config.start_up_warnings(tiny)] == [
        "optim.warmup_steps=50 exceeds train.steps=4"
    ]


def test_cross_check_does_not_report_the_default_of_a_rejected_micro_batch():
    """A rejected train.micro_batch_size holds its default (8): no cross-check may report that 8,
    which the user never wrote (the batch-vs-dp message spells the key 'micro_batch_size' without
    its group, so the filter for rejected keys misses it)."""
    err = load_error(None, ["train.micro_batch_size=0", "train.global_batch_size=4"], world_size=4)
    assert err.problems[0] == "train.micro_batch_size: 0 must be >= 1"
    assert "8·4" not in str(err), str(err)
    assert len(err.problems) == 1, err.problems


# --- overrides and typed parsing --------------------------------------------------------------


def test_overrides_are_typed_and_beat_the_file(tmp_path):
    path = write_yaml(
        tmp_path / "exp.yaml",
        """
model:
  d_model: 64
  n_kv_heads: 2
train:
  steps: 100
  seed: 7
optim:
  lr: 3e-4
  eps: "1e-6"
  warmup_steps: 10
log:
  progress: true
""",
    )
    cfg = config.load(path)
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(
        cfg.optim.lr, float
    )  # 3e-4 is a YAML string
    assert cfg.optim.eps == pytest.approx(1e-6) and isinstance(cfg.optim.eps, float)
    assert cfg.train.steps == 100 and cfg.model.n_kv_heads == 2 and cfg.log.progress is True

    cfg = config.load(
        path,
        [
            "train.steps=50",
            "optim.lr=1e-2",
            "log.progress=false",
            "model.n_kv_heads=null",
            "train.threads=3",
            "optim.grad_clip=2",
            "data.path=/some/where",
            "log.name=",
        ],
    )
    assert cfg.train.steps == 50 and type(cfg.train.steps) is int
    assert cfg.optim.lr == pytest.approx(0.01) and isinstance(cfg.optim.lr, float)
    assert cfg.log.progress is False
    assert cfg.model.n_kv_heads is None
    assert cfg.train.threads == 3
    assert cfg.optim.grad_clip == 2.0 and isinstance(
        cfg.optim.grad_clip, float
    )  # int widens to float
    assert cfg.data.path == "/some/where"
    # values of the file that were not overridden survive
    assert cfg.model.d_model == 64 and cfg.train.seed == 7 and cfg.optim.warmup_steps == 10
    assert cfg.optim.eps == pytest.approx(1e-6)
    # keys in neither keep their defaults
    assert (
        cfg.model.n_layers == ModelConfig().n_layers
        and cfg.train.precision == TrainConfig().precision
    )
    # an empty override value is null, and a null name falls back to the file's stem
    assert cfg.log.name == "exp"


def test_later_override_wins_and_spaces_around_key_are_ignored():
    cfg = config.load(None, ["train.steps=100", " train.steps =200"])
    assert cfg.train.steps == 200


def test_override_into_a_non_mapping_group_is_reported(tmp_path):
    path = write_yaml(tmp_path / "x.yaml", "train: 5\n")
    err = load_error(path, ["train.steps=3"])
    assert any("override 'train.steps=3': train is not a mapping" in p for p in err.problems), (
        err.problems
    )


def test_override_value_that_is_not_valid_yaml_is_a_config_error():
    """`log.name=[oops` cannot be parsed as a YAML value; it must be reported like every other bad
    input (a ConfigError listing it), not escape as a raw yaml exception."""
    try:
        config.load(None, ["log.name=[oops", "optim.lr=-1"])
    except ConfigError as e:
        assert any("log.name" in p for p in e.problems), e.problems
        assert any(p.startswith("optim.lr:") for p in e.problems), e.problems
    except Exception as e:  # noqa: BLE001 - the bug: a yaml.YAMLError escapes
        pytest.fail(
            f"malformed override value raised {type(e).__name__} instead of ConfigError: {e}"
        )
    else:
        pytest.fail("malformed override value was accepted")


# --- round trips and defaults -----------------------------------------------------------------


def test_default_config_equals_load_of_nothing():
    assert config.load(None) == Config()
    assert config.load(None, []) == Config()
    assert config.from_dict({}) == Config()


def test_dump_of_defaults_round_trips_through_a_file(tmp_path):
    text = config.dump(Config())
    raw = yaml.safe_load(text)
    assert list(raw) == list(config.GROUPS)
    path = tmp_path / "defaults.yaml"
    path.write_text(text)
    loaded = config.load(path)
    # log.name is null in the defaults, so it becomes the file's stem; everything else is equal.
    assert loaded.log.name == "defaults"
    assert loaded == config.replace(Config(), "log.name", "defaults")


def test_dump_of_a_custom_config_round_trips(tmp_path):
    cfg = config.load(
        None,
        [
            "model.n_kv_heads=2",
            "model.norm_eps=1e-6",
            "optim.lr=3e-4",
            "optim.eps=1e-10",
            "train.precision=bf16",
            "data.path=/data/tokens",
            "log.name=my run",
            "log.peak_tflops=312.5",
            "checkpoint.keep_last=0",
            "parallel.bucket_mb=0.5",
            "model.tie_embeddings=true",
            "optim.schedule=linear",
        ],
    )
    path = tmp_path / "resolved.yaml"
    path.write_text(config.dump(cfg))
    again = config.load(path)
    assert again == cfg
    assert again.optim.lr == 3e-4 and again.model.norm_eps == 1e-6 and again.optim.eps == 1e-10
    assert config.from_dict(config.to_dict(cfg)) == cfg


def test_replace_changes_one_key_only():
    cfg = config.replace(Config(), "optim.lr", 0.5)
    assert cfg.optim.lr == 0.5
    assert dataclasses.replace(cfg.optim, lr=OptimConfig().lr) == OptimConfig()
    assert cfg.model == ModelConfig() and Config().optim.lr == OptimConfig().lr


# --- docs and explain -------------------------------------------------------------------------


def _field(key: str) -> dataclasses.Field:
    """The dataclass field of a dotted key, found by walking the classes (not through config's walker)."""
    cls, f = Config, None
    for name in key.split("."):
        f = {f.metadata.get("key") or f.name: f for f in dataclasses.fields(cls)}[name]
        cls = typing.get_type_hints(cls)[f.name]
    return f


def _leaves(cls: type, prefix: str) -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name, hint = f.metadata.get("key") or f.name, hints[f.name]
        out += (
            _leaves(hint, f"{prefix}.{name}")
            if dataclasses.is_dataclass(hint)
            else [f"{prefix}.{name}"]
        )
    return out


def test_a_key_named_by_a_python_keyword_reads_writes_and_overrides_under_its_yaml_name(tmp_path):
    """checkpoint.async (the field is async_save: `async` is a keyword)."""
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  async: true\n")
    cfg = config.load(path)
    assert cfg.checkpoint.async_save is True
    assert "async: true" in config.dump(cfg) and "async_save" not in config.dump(cfg)
    assert config.load(path, ["checkpoint.async=false"]).checkpoint.async_save is False
    with pytest.raises(ConfigError, match="checkpoint.async_save"):
        config.load(path, ["checkpoint.async_save=true"])


def test_every_key_has_a_doc():
    keys = config.all_keys()
    expected = [key for g, cls in config.GROUPS.items() for key in _leaves(cls, g)]
    assert keys == expected and len(keys) == len(set(keys)) > 30
    assert (
        "zero.params.shard_over" in keys and "zero.params" not in keys and "co2.outer_every" in keys
    )
    assert max(k.count(".") for k in keys) <= 2  # nesting depth <= 3
    for key in keys:
        doc = _field(key).metadata.get("doc")
        assert isinstance(doc, str) and doc.strip(), f"{key} has no doc"
    for f in dataclasses.fields(Config):
        assert f.metadata.get("doc"), f"group {f.name} has no doc"
    for f in dataclasses.fields(ZeroConfig):
        assert f.metadata.get("doc"), f"zero.{f.name} has no doc"


def test_explain_key_mentions_doc_type_and_default():
    text = config.explain("optim.lr")
    assert text.startswith("optim.lr: ")
    assert _field("optim.lr").metadata["doc"] in text
    assert "type: float" in text
    assert f"default: {OptimConfig().lr!r}" in text

    text = config.explain("train.precision")
    assert "type: str" in text and "default: 'fp32'" in text and "choices: fp32, bf16" in text
    assert "type: int or null" in config.explain("model.n_kv_heads")
    assert "default: None" in config.explain("model.n_kv_heads")


def test_explain_every_key_and_group():
    for key in config.all_keys():
        text = config.explain(key)
        assert _field(key).metadata["doc"] in text
        # a list key's default (a tuple, as frozen configs hold it) is shown as YAML writes it
        assert f"default: {plain(_field(key).default)!r}" in text
    for group, cls in config.GROUPS.items():
        text = config.explain(group)
        assert text.startswith(f"{group}: {cls.__doc__}")
        for key in _leaves(cls, group):
            assert f"{key} = {plain(_field(key).default)!r}" in text


def test_explain_nested_key_and_groups():
    text = config.explain("zero.params.shard_over")
    assert text.startswith("zero.params.shard_over: ")
    assert (
        "type: str" in text
        and "default: 'none'" in text
        and "choices: none, gcd, gpu, node, global" in text
    )
    text = config.explain("zero")
    assert text.startswith(f"zero: {ZeroConfig.__doc__}")
    assert "\n  zero.params: where parameters are partitioned" in text
    assert "\n    zero.params.shard_over = 'none'  # " in text
    assert "\n  zero.prefetch_blocks = 1  # " in text
    text = config.explain("zero.secondary_params")
    assert text.startswith("zero.secondary_params: hpZ (ZeRO++)")
    assert "zero.secondary_params.shard_over = 'none'" in text
    with pytest.raises(ConfigError) as info:
        config.explain("zero.params.shard_ovr")
    assert "did you mean 'zero.params.shard_over'" in str(info.value)


@pytest.mark.parametrize(
    "key, suggestion",
    [("optim.lrr", "optim.lr"), ("model.n_head", "model.n_heads"), ("trian", "train")],
)
def test_explain_unknown_key_suggests(key, suggestion):
    with pytest.raises(ConfigError) as info:
        config.explain(key)
    assert isinstance(info.value, StrataError)
    assert f"did you mean {suggestion!r}" in str(info.value)


def test_explain_key_with_misspelt_group_suggests_the_full_key():
    """`strata config explain trian.steps` should point at 'train.steps', as the same typo in a
    YAML file points at 'train'; it lists the group names instead."""
    with pytest.raises(ConfigError) as info:
        config.explain("trian.steps")
    assert "did you mean 'train.steps'" in str(info.value), str(info.value)


# --- YAML handling ----------------------------------------------------------------------------


def test_python_object_tags_are_rejected_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    path = write_yaml(
        tmp_path / "evil.yaml",
        f'log:\n  name: !!python/object/apply:os.system ["touch {marker}"]\n',
    )
    err = load_error(path)
    assert not marker.exists(), "the YAML file ran a command"
    assert any(str(path) in p for p in err.problems)

    path2 = write_yaml(
        tmp_path / "evil2.yaml", f'!!python/object/apply:os.system ["touch {marker}"]\n'
    )
    load_error(path2)
    assert not marker.exists()


def test_override_values_are_parsed_safely(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(Exception):
        config.load(None, [f'log.name=!!python/object/apply:os.system ["touch {marker}"]'])
    assert not marker.exists()


def test_missing_file_and_non_mapping_file_are_config_errors(tmp_path):
    err = load_error(tmp_path / "nope.yaml")
    assert "does not exist" in err.problems[0] and "nope.yaml" in err.problems[0]
    err = load_error(write_yaml(tmp_path / "list.yaml", "- 1\n- 2\n"))
    assert "top level must be a mapping" in err.problems[0]
    err = load_error(write_yaml(tmp_path / "grp.yaml", "model: 3\n"))
    assert err.problems == ["model: must be a mapping of keys, got int 3"]


def test_empty_file_and_empty_group_give_defaults(tmp_path):
    cfg = config.load(write_yaml(tmp_path / "empty.yaml", ""))
    assert cfg == config.replace(Config(), "log.name", "empty")
    cfg = config.load(write_yaml(tmp_path / "g.yaml", "model:\ntrain: {}\n"))
    assert cfg == config.replace(Config(), "log.name", "g")


# --- log.name ---------------------------------------------------------------------------------


def test_log_name_defaults_to_config_stem(tmp_path):
    path = write_yaml(tmp_path / "my_experiment.v2.yaml", "train:\n  steps: 40\n")
    cfg = config.load(path)
    assert cfg.log.name == Path(path).stem == "my_experiment.v2"
    assert cfg.run_name() == "my_experiment.v2"
    assert cfg.run_dir() == Path(cfg.log.dir) / "my_experiment.v2"
    assert cfg.checkpoint_dir() == cfg.run_dir() / "checkpoints"

    named = write_yaml(tmp_path / "other.yaml", "log:\n  name: explicit\n")
    assert config.load(named).log.name == "explicit"
    assert config.load(named, ["log.name=cli"]).log.name == "cli"
    assert config.load(None).log.name is None and config.load(None).run_name() == "run"


def test_field_type_hints_are_supported_by_the_loader():
    """Every key's type is one the loader can coerce (so no key is unsettable)."""
    for key in config.all_keys():
        parent, _, _ = key.rpartition(".")
        cls = type(_value(Config(), parent))
        name = _field(key).name
        default = getattr(cls(), name)
        ok, value, why = config._coerce(default, typing.get_type_hints(cls)[name])
        assert ok and value == default, f"{key}: {why}"


def _value(obj, key: str):
    for name in key.split("."):
        obj = getattr(obj, name)
    return obj


# --- nested groups: zero and co2 ---------------------------------------------------------------


def test_shard_levels_are_the_topology_levels():
    assert _field("zero.params.shard_over").metadata["choices"] == LEVELS
    assert ZeroConfig().params == ShardSpec() and ShardSpec().shard_over == "none"
    assert not ZeroConfig().enabled and not Config().co2.enabled


def test_nested_key_from_the_command_line():
    cfg = config.load(
        None,
        [
            "zero.optim.shard_over=global",
            "zero.grads.shard_over=node",
            "zero.prefetch_blocks=2",
            "co2.outer_momentum=0.9",
            "co2.outer_lr=1",
        ],
    )
    assert cfg.zero.optim == ShardSpec("global") and cfg.zero.grads.shard_over == "node"
    assert cfg.zero.params.shard_over == "none" and cfg.zero.prefetch_blocks == 2
    assert (
        cfg.co2.outer_momentum == 0.9
        and cfg.co2.outer_lr == 1.0
        and isinstance(cfg.co2.outer_lr, float)
    )
    assert cfg.zero.enabled


def test_nested_group_in_yaml_and_overrides_on_top(tmp_path):
    path = write_yaml(
        tmp_path / "z.yaml",
        """
zero:
  params: {shard_over: global}
  grads:
    shard_over: global
  optim: {shard_over: global}
  secondary_params:
  bucket_mb: 8
co2: {outer_every: 2}
""",
    )
    cfg = config.load(path)
    assert (cfg.zero.params, cfg.zero.grads, cfg.zero.optim) == (ShardSpec("global"),) * 3
    assert cfg.zero.secondary_params == ShardSpec() and cfg.zero.bucket_mb == 8.0
    assert cfg.co2 == CO2Config(outer_every=2)
    cfg = config.load(path, ["zero.secondary_params.shard_over=node", "zero.grads.shard_over=node"])
    assert cfg.zero.secondary_params.shard_over == "node" and cfg.zero.grads.shard_over == "node"
    assert cfg.zero.params.shard_over == "global"  # untouched siblings survive


def test_unknown_nested_key_names_the_full_key():
    err = load_error(None, ["zero.param.shard_over=global"])
    assert err.problems == ["zero.param: unknown key; did you mean 'zero.params'?"]
    (p,) = load_error(None, ["zero.params.zzzzzzzz=1"]).problems
    assert p == "zero.params.zzzzzzzz: unknown key; valid: zero.params.shard_over"


def test_scalar_intermediate_is_an_error(tmp_path):
    # the schema says zero.params is a group and optim.lr a value
    err = load_error(None, ["zero.params=global"])
    assert err.problems == ["zero.params: must be a mapping of keys, got str 'global'"]
    err = load_error(None, ["optim.lr.x=1"])
    assert err.problems == [
        "optim.lr: expected float, got the mapping {'x': 1} (optim.lr is one value, not a group of keys)"
    ]
    # an earlier value in the way of a deeper override
    err = load_error(
        write_yaml(tmp_path / "s.yaml", "zero:\n  params: global\n"),
        ["zero.params.shard_over=node"],
    )
    assert (
        "override 'zero.params.shard_over=node': zero.params is not a mapping (it is 'global'), so it has no "
        "keys to set" in err.problems
    )
    err = load_error(None, ["zero..shard_over=node"])
    assert err.problems[0].startswith(
        "override 'zero..shard_over=node': write it as group.key=value"
    )


def test_replace_nested_key():
    cfg = config.replace(Config(), "zero.optim.shard_over", "global")
    assert cfg.zero.optim.shard_over == "global"
    assert cfg.zero.params == cfg.zero.grads == ShardSpec() and cfg.model == ModelConfig()
    assert Config().zero.optim.shard_over == "none"
    assert (
        config.replace(Config(), "zero.params", ShardSpec("node")).zero.params.shard_over == "node"
    )


def test_nested_groups_round_trip_through_dump_and_load(tmp_path):
    cfg = config.load(
        None,
        [
            "zero.params.shard_over=node",
            "zero.grads.shard_over=node",
            "zero.optim.shard_over=node",
            "zero.secondary_params.shard_over=gpu",
            "zero.hierarchical=false",
            "zero.bucket_mb=2.5",
            "co2.enabled=true",
            "co2.clip=1",
            "co2.overlap=false",
            "co2.staleness_penalty=0.5",
        ],
    )
    raw = config.to_dict(cfg)
    assert raw["zero"]["params"] == {"shard_over": "node"} and raw["co2"]["clip"] == 1.0
    assert "enabled" not in raw["zero"]  # a property, not a key
    path = tmp_path / "resolved.yaml"
    path.write_text(config.dump(cfg))
    assert config.load(path) == config.replace(cfg, "log.name", "resolved")
    assert config.from_dict(raw) == cfg


@pytest.mark.parametrize(
    "overrides, world_size, key",
    [
        # ZeRO levels nest: parameters and gradients inside the optimizer shard
        (
            ["zero.params.shard_over=global", "zero.optim.shard_over=node"],
            None,
            "zero.params.shard_over=global",
        ),
        (
            ["zero.grads.shard_over=node", "zero.optim.shard_over=gpu"],
            None,
            "zero.grads.shard_over=node",
        ),
        (["zero.grads.shard_over=gpu"], None, "zero.grads.shard_over=gpu"),
        # hpZ strictly finer than the primary parameters
        (
            [
                "zero.params.shard_over=node",
                "zero.optim.shard_over=node",
                "zero.secondary_params.shard_over=node",
            ],
            None,
            "zero.secondary_params.shard_over=node",
        ),
        (["zero.secondary_params.shard_over=gpu"], None, "zero.secondary_params.shard_over=gpu"),
        # split-backward schedules with ZeRO-2/3
        (
            [
                "zero.grads.shard_over=global",
                "zero.optim.shard_over=global",
                "parallel.pp=2",
                "parallel.schedule=interleaved_zero_bubble",
            ],
            None,
            "parallel.schedule=interleaved_zero_bubble",
        ),
        (
            [
                "zero.params.shard_over=node",
                "zero.optim.shard_over=node",
                "parallel.pp=2",
                "parallel.virtual_stages=2",
                "parallel.schedule=dualpipev",
            ],
            None,
            "parallel.schedule=dualpipev",
        ),
        # CO2: nodes are independent replicas, and there are at least two of them
        (
            ["co2.enabled=true", "zero.optim.shard_over=global"],
            None,
            "zero.optim.shard_over=global",
        ),
        (["co2.enabled=true", "parallel.ranks_per_node=2"], 2, "parallel.ranks_per_node=2"),
        (["co2.enabled=true", "co2.clip=1", "parallel.tp=2"], None, "co2.clip=1.0"),
        (
            ["co2.enabled=true", "co2.staleness_penalty=0.5", "parallel.pp=2"],
            None,
            "co2.staleness_penalty=0.5",
        ),
        # ZeRO-1 too: the split-backward schedules set weight gradients past the engine's hooks
        (
            [
                "zero.optim.shard_over=global",
                "parallel.pp=2",
                "parallel.schedule=interleaved_zero_bubble",
            ],
            None,
            "parallel.schedule=interleaved_zero_bubble",
        ),
        # snapshots copy the state the checkpoint layer sees: not with CO2's open round or tiered state
        (["snapshot.every_steps=1", "co2.enabled=true"], None, "co2.enabled"),
        (
            ["snapshot.every_steps=1", "offload.optim.device=cpu", "zero.optim.shard_over=global"],
            None,
            "offload.optim.device",
        ),
    ],
)
def test_zero_and_co2_cross_checks(overrides, world_size, key):
    err = load_error(None, overrides, world_size=world_size)
    assert len(err.problems) == 1, err.problems
    assert key in err.problems[0], err.problems
    assert "; " in err.problems[0] and (" set " in err.problems[0] or " use " in err.problems[0]), (
        err.problems
    )


def test_cross_check_messages_name_the_fix():
    (p,) = load_error(
        None, ["zero.params.shard_over=global", "zero.optim.shard_over=node"]
    ).problems
    assert p.endswith("set zero.optim.shard_over=global or zero.params.shard_over=node")
    (p,) = load_error(
        None,
        [
            "zero.params.shard_over=global",
            "zero.optim.shard_over=global",
            "zero.secondary_params.shard_over=global",
        ],
    ).problems
    assert p.endswith("use gpu or node or none (hpZ off)")
    (p,) = load_error(
        None,
        [
            "zero.grads.shard_over=global",
            "zero.optim.shard_over=global",
            "parallel.pp=2",
            "parallel.schedule=interleaved_zero_bubble",
        ],
    ).problems
    assert "zero.grads.shard_over=global" in p and "parallel.schedule=interleaved_1f1b" in p
    (p,) = load_error(
        None, ["co2.enabled=true", "parallel.ranks_per_node=2"], world_size=2
    ).problems
    assert (
        "co2.enabled needs at least 2 nodes" in p
        and "world size 2 / parallel.ranks_per_node=2 = 1" in p
    )


@pytest.mark.parametrize(
    "overrides, world_size",
    [
        (["zero.optim.shard_over=global"], None),  # ZeRO-1
        ([f"zero.{s}.shard_over=global" for s in ("params", "grads", "optim")], None),  # ZeRO-3
        (
            [f"zero.{s}.shard_over=global" for s in ("params", "grads", "optim")]
            + ["zero.secondary_params.shard_over=node"],
            None,
        ),  # hpZ
        (
            [
                "zero.params.shard_over=gpu",
                "zero.grads.shard_over=node",
                "zero.optim.shard_over=global",
            ],
            None,
        ),  # 3 levels
        (["zero.params.shard_over=gcd", "zero.optim.shard_over=none"], None),  # gcd = none
        (
            [
                "zero.grads.shard_over=node",
                "zero.optim.shard_over=node",
                "parallel.schedule=interleaved_zero_bubble",
            ],
            None,
        ),  # no pipeline: unused
        (
            [
                "co2.enabled=true",
                "zero.optim.shard_over=node",
                "zero.grads.shard_over=node",
                "parallel.ranks_per_node=2",
                "train.global_batch_size=32",
            ],
            4,
        ),  # 2 nodes of 2
        (["co2.enabled=true"], 2),  # node size unknown
    ],
)
def test_zero_and_co2_valid_settings_pass(overrides, world_size):
    config.load(None, overrides, world_size=world_size)


def test_cross_check_naming_a_rejected_nested_key_is_dropped():
    # zero.optim.shard_over is rejected (keeps none), so "params coarser than optim=none" would mislead
    err = load_error(None, ["zero.params.shard_over=global", "zero.optim.shard_over=rack"])
    assert len(err.problems) == 1 and err.problems[0].startswith("zero.optim.shard_over: 'rack'"), (
        err.problems
    )


# --- list keys ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Lists:
    """A group of list keys the shipped schema does not have (yet): floats, strings, length bounds."""

    weights: tuple[float, ...] = opt((1.0,), "at least one weight", min=0.0, min_items=1)
    names: tuple[str, ...] | None = opt(None, "at most two names", max_items=2)


def _build_lists(values: dict) -> tuple[_Lists, list[str]]:
    problems: list[str] = []
    built = config._build_group("g", _Lists, values, problems)
    return built, problems


def test_a_list_key_reads_from_yaml_and_from_an_override_as_a_tuple(tmp_path):
    block = write_yaml(tmp_path / "block.yaml", "log:\n  profile_steps:\n    - 4\n    - 6\n")
    flow = write_yaml(tmp_path / "flow.yaml", "log:\n  profile_steps: [4, 6]\n")
    assert config.load(block).log.profile_steps == config.load(flow).log.profile_steps == (4, 6)
    assert config.load(None, ["log.profile_steps=[3,5]"]).log.profile_steps == (3, 5)
    assert config.load(None, ["log.profile_steps = [ 3, 5 ]"]).log.profile_steps == (3, 5)
    assert config.load(flow, ["log.profile_steps=null"]).log.profile_steps is None
    assert config.from_dict({"log": {"profile_steps": (7, 7)}}).log.profile_steps == (7, 7)
    cfg = config.load(flow)
    assert hash(cfg) == hash(config.load(flow))  # frozen and hashable: the list is a tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.log.profile_steps = (1, 2)  # type: ignore[misc]


def test_a_list_key_round_trips_through_dump_to_dict_and_a_checkpoint_style_file(tmp_path):
    cfg = config.load(None, ["log.profile_steps=[3,5]", "log.name=listed"])
    plain = config.to_dict(cfg)
    assert plain["log"]["profile_steps"] == [3, 5] and type(plain["log"]["profile_steps"]) is list
    assert config.from_dict(plain) == cfg
    text = config.dump(cfg)
    assert yaml.safe_load(text)["log"]["profile_steps"] == [3, 5]
    assert "!!python" not in text
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert config.load(path) == cfg
    assert config.load(path, ["train.steps=7"]).log.profile_steps == (3, 5)


def test_a_list_key_survives_the_config_yaml_a_checkpoint_saves(small_data_dir, tmp_path):
    """The resolved config every checkpoint commits as config.yaml loads back into the same config."""
    from strata.checkpoint import store
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train as run

    from conftest import tiny_config

    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        **{"train.steps": 1, "checkpoint.save_final": True, "log.profile_steps": [1, 1]},
    )
    run(cfg, start())
    saved = store.committed(cfg.checkpoint_dir())[-1] / "config.yaml"
    assert yaml.safe_load(saved.read_text())["log"]["profile_steps"] == [1, 1]
    assert config.load(saved) == cfg


def test_list_keys_show_their_type_and_default():
    assert "type: list of int or null" in config.explain("log.profile_steps")
    assert "default: None" in config.explain("log.profile_steps")
    row = next(
        line for line in config.reference_markdown().splitlines() if "`log.profile_steps`" in line
    )
    assert row.startswith("| `log.profile_steps` | list of int or null | `null` | [first, last]: ")
    assert config._type_name(tuple[float, ...]) == "list of float"
    assert config._type_name(tuple[str, ...] | None) == "list of str or null"


def test_list_items_are_coerced_and_checked_one_by_one():
    built, problems = _build_lists({"weights": [1, "2.5", 0.5], "names": ["a", "b"]})
    assert problems == [] and built == _Lists(weights=(1.0, 2.5, 0.5), names=("a", "b"))
    assert all(type(w) is float for w in built.weights)
    cases = {
        "weights": [
            ([], "g.weights: [] has 0 items; give at least 1"),
            ([1.0, -1.0], "g.weights: item 2 is -1.0, which must be >= 0.0"),
            ([1.0, "heavy"], "g.weights: item 2 is 'heavy', not a number"),
            ([1.0, True], "g.weights: item 2 is True, not a number"),
            (1.0, "g.weights: expected list of float, got 1.0 (use a list, e.g. [a, b])"),
            ([float("nan")], "g.weights: item 1 is nan, which must be finite"),
            (None, "g.weights: expected list of float, got None (use a list, e.g. [a, b])"),
        ],
        "names": [
            (["a", "b", "c"], "g.names: ['a', 'b', 'c'] has 3 items; give at most 2"),
            (["a", 3], "g.names: item 2 is 3, not a string"),
            ({"a": 1}, "g.names: expected list of str or null, got the mapping {'a': 1}"),
        ],
    }
    for key, rows in cases.items():
        for value, message in rows:
            built, problems = _build_lists({key: value})
            assert len(problems) == 1 and problems[0].startswith(message), (value, problems)
            assert built == _Lists()  # a rejected key keeps its default


def test_every_problem_of_a_list_key_is_reported_with_the_others():
    err = load_error(None, ["log.profile_steps=[0, x]", "train.steps=0"])
    assert err.problems == [
        "log.profile_steps: item 2 is 'x', not a whole number",
        "train.steps: 0 must be >= 1",
    ]
