"""Mixture-of-Experts models in and out of Hugging Face, against transformers: tiny random Qwen3-MoE
(q/k norms, top-k renormalised or not) and Mixtral models saved with save_pretrained (one tensor per
expert) start a Strata run (model.init_from) whose logits and first loss are transformers' own,
survive `strata ckpt import-hf` → `strata ckpt export --format hf` bit for bit, and a trained MoE
run exports to a directory whose transformers model computes Strata's logits. The MoE families
Strata does not build are refused naming what is missing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from strata import config
from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.errors import ConfigError
from strata.model import build_model
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run
from strata.trainer.loop import Trainer

from conftest import hf_run_overrides, run_cli
from worlds import strata

transformers = pytest.importorskip("transformers")

SEQ = 32
SHAPE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-moe")
    torch.manual_seed(0)
    moe = {"num_experts_per_tok": 2}
    models = {
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **SHAPE, **moe, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True
            )
        ),
        "qwen3_moe-unnormalised": transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **SHAPE, **moe, num_experts=4, moe_intermediate_size=32, norm_topk_prob=False
            )
        ),
        "mixtral": transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**SHAPE, **moe, num_local_experts=4)
        ),
    }
    out = {}
    for name, model in models.items():
        with (
            torch.no_grad()
        ):  # transformers zero-initialises some routers: random ones route for real
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.1)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


FAMILIES = ["qwen3_moe", "qwen3_moe-unnormalised", "mixtral"]


def overrides(hf_dir: Path | str, data_dir: Path, run_root: Path, **extra) -> list[str]:
    """One short step of 4 sequences from `hf_dir`."""
    small = {
        "train.steps": 1,
        "train.global_batch_size": 4,
        "train.eval_batches": 1,
        "optim.warmup_steps": 1,
    }
    return hf_run_overrides(hf_dir, data_dir, run_root, SEQ, **{**small, **extra})


def hf_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_run_from_a_hugging_face_moe_computes_transformers_logits_and_loss(
    hf_dirs, small_data_dir, tmp_path, name
):
    cfg = config.load(None, overrides(hf_dirs[name], small_data_dir, tmp_path))
    moe = cfg.model.moe
    assert moe.num_experts == (8 if name == "qwen3_moe" else 4) and moe.top_k == 2
    assert moe.norm_topk == (
        name != "qwen3_moe-unnormalised"
    ) and cfg.model.qk_norm == name.startswith("qwen3")
    assert moe.expert_ffn == (32 if name.startswith("qwen3") else 96)
    trainer = Trainer(cfg, start())
    trainer.init_weights()
    reference = hf_model(hf_dirs[name])
    position = trainer.loader.state_dict()
    micro = trainer.loader.next_step()
    trainer.loader.load_state_dict(position)  # the step below trains on these micro-batches
    with torch.no_grad():
        for batch in micro:
            torch.testing.assert_close(
                trainer.model.parts[0](batch.inputs),
                reference(batch.inputs).logits,
                rtol=0,
                atol=1e-5,
            )
        want = torch.stack(
            [
                torch.nn.functional.cross_entropy(
                    reference(b.inputs).logits.flatten(0, 1), b.targets.flatten()
                )
                for b in micro
            ]
        ).mean()
    loss, _ = trainer.train_step()
    assert float(loss) == pytest.approx(float(want), abs=1e-5)


@pytest.mark.slow  # an import and an export, run as the `strata` command in this process
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_import_then_export_is_bit_exact(hf_dirs, tmp_path, name, capsys):
    code, said = run_cli(
        [
            "ckpt",
            "import-hf",
            str(hf_dirs[name]),
            str(tmp_path / "imported"),
            f"model.seq_len={SEQ}",
        ],
        capsys,
    )
    assert code == 0, said
    step0 = store.step_dir(tmp_path / "imported", 0)
    assert Checkpoint(step0).shapes("model.")["layers.1.mlp.experts.w1"][0] == (
        8 if name == "qwen3_moe" else 4
    )
    code, said = run_cli(
        ["ckpt", "export", str(step0), str(tmp_path / "out"), "--format", "hf"], capsys
    )
    assert code == 0, said
    want, got = (
        load_file(hf_dirs[name] / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    config_json = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_json["model_type"] == name
    hf_model(tmp_path / "out")  # loads: no missing or unexpected keys


@pytest.mark.slow  # trains, then exports through the CLI
def test_a_trained_moe_run_exports_to_transformers_with_its_logits(small_data_dir, tmp_path):
    """A Strata MoE (Qwen3-MoE layout: q/k norms, softmax top-k) trained from scratch exports to a
    directory transformers loads, computing the same logits."""
    settings = {
        "model.n_layers": 2,
        "model.d_model": 32,
        "model.n_heads": 4,
        "model.qk_norm": True,
        "model.moe.num_experts": 4,
        "model.moe.expert_ffn": 16,
        "model.moe.aux_loss_coef": 0.01,
        "model.vocab_size": 320,
    }
    cfg = config.load(
        None, overrides("null", small_data_dir, tmp_path, **{"train.steps": 2, **settings})
    )
    run(cfg, start())
    step = store.step_dir(tmp_path / "t" / "checkpoints", 2)
    exported = strata("ckpt", "export", str(step), str(tmp_path / "out"), "--format", "hf")
    assert exported.returncode == 0, exported.stderr[-3000:]
    reference = hf_model(tmp_path / "out")
    model = build_model(cfg.model, 320, seed=0)
    model.load_state_dict(Checkpoint(step).tensors("model."))
    tokens = torch.randint(0, 320, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "deepseek_v3"}, "multi-head latent attention"),
        ({"model_type": "gpt_oss"}, "attention sinks"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]: dense layers among the MoE ones"),
    ],
)
def test_moe_families_strata_lacks_are_refused_by_name(hf_dirs, tmp_path, changes, message):
    directory = tmp_path / "model"
    directory.mkdir()
    for f in hf_dirs["qwen3_moe"].iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    cfg_path = directory / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **changes}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load(None, [f"model.init_from={directory}", f"model.seq_len={SEQ}"])
