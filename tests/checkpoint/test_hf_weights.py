"""Hugging Face in and out, against transformers as the reference: tiny random Llama (GQA, untied) and
Qwen2 (q/k/v bias, tied) models built offline and saved with save_pretrained start a Strata run
(model.init_from) at transformers' own loss, train alike in one process and in tp2·pp2 and ZeRO-3
layouts, come back out with `strata ckpt export --format hf` as a directory transformers'
from_pretrained (and the run's BPE tokenizer's AutoTokenizer) loads, and survive an import → export
round trip bit for bit. Bad Hugging Face input is one clear error before training starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from strata import config
from strata.checkpoint import store
from strata.checkpoint.reader import Checkpoint
from strata.data.loader import BatchLoader
from strata.data.tokens import TokenDataset
from strata.model import build_model
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from conftest import hf_run_overrides, prepare_readme, run_cli
from worlds import strata, train_world

transformers = pytest.importorskip("transformers")

SEQ = 32


def _save(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random models in Hugging Face directories (fp32), by name."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    shape = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**shape, tie_word_embeddings=False, rope_theta=500000.0)
    )
    qwen2 = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**shape, tie_word_embeddings=True)
    )
    qwen3 = transformers.Qwen3ForCausalLM(  # q/k norms, and heads wider than hidden_size / heads
        transformers.Qwen3Config(**shape, head_dim=32, tie_word_embeddings=False)
    )
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(**shape, sliding_window=None)
    )
    models = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "mistral": mistral}
    return {name: _save(model, root / name) for name, model in models.items()}


FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def _overrides(hf_dir: Path, data_dir: Path, run_root: Path, **extra) -> list[str]:
    return hf_run_overrides(hf_dir, data_dir, run_root, SEQ, **extra)


def _experiment(tmp_path: Path) -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text("{}\n")
    return path


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _hf_loss(hf_dir: Path, cfg: config.Config) -> float:
    """transformers' loss on the first batch Strata's loader gives (mean over micro-batches)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, torch_dtype=torch.float32
    ).eval()
    loader = BatchLoader(
        TokenDataset(Path(cfg.data.path), "train", SEQ),
        cfg.train.seed,
        cfg.train.global_batch_size,
        2,
        0,
        1,
    )
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(b.inputs).logits.flatten(0, 1).float(), b.targets.flatten())
            for b in loader.next_step()
        ]
    return torch.stack(losses).mean().item()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_run_from_a_hugging_face_model_starts_at_transformers_loss(
    hf_dirs, small_data_dir, tmp_path, name
):
    cfg = config.load(
        None, _overrides(hf_dirs[name], small_data_dir, tmp_path, **{"train.steps": 1})
    )
    assert cfg.model.d_model == 64 and cfg.model.n_kv_heads == 2 and cfg.model.vocab_size == 320
    assert cfg.model.qkv_bias == (name == "qwen2") and cfg.model.tie_embeddings == (name == "qwen2")
    assert cfg.model.qk_norm == (name == "qwen3") and cfg.model.head_size == (
        32 if name == "qwen3" else 16
    )
    result = run(cfg, start())
    assert result.losses[1] == pytest.approx(_hf_loss(hf_dirs[name], cfg), abs=1e-5)


@pytest.mark.slow  # worlds of 4 and 2 processes running `strata train`
@pytest.mark.parametrize(
    ("name", "nproc", "layout"),
    [
        ("llama", 4, {"parallel.tp": 2, "parallel.pp": 2, "parallel.virtual_stages": 2}),
        ("qwen3", 4, {"parallel.tp": 2, "parallel.pp": 2, "parallel.sequence_parallel": True}),
        (
            "llama",
            2,
            {
                "zero.params.shard_over": "global",
                "zero.grads.shard_over": "global",
                "zero.optim.shard_over": "global",
            },
        ),
        ("qwen2", 2, {"zero.optim.shard_over": "global", "offload.optim.device": "cpu"}),
    ],
    ids=[
        "llama-tp2-pp2-v2",
        "qwen3-tp2-pp2-sp",
        "llama-zero3-dp2",
        "qwen2-dp2-optim-offload",
    ],
)
def test_training_from_a_hugging_face_model_in_parallel_matches_one_process(
    hf_dirs, small_data_dir, tmp_path, name, nproc, layout
):
    experiment = str(_experiment(tmp_path))
    train_world(
        [experiment, *_overrides(hf_dirs[name], small_data_dir, tmp_path / "one")],
        1,
        tmp_path / "one",
    )
    par = [experiment, *_overrides(hf_dirs[name], small_data_dir, tmp_path / "par", **layout)]
    train_world(par, nproc, tmp_path / "par")
    want, got = _losses(tmp_path / "one" / "t"), _losses(tmp_path / "par" / "t")
    assert got.keys() == want.keys() == {1, 2, 3, 4}
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    ref = Checkpoint(store.step_dir(tmp_path / "one" / "t" / "checkpoints", 4)).tensors("model.")
    out = Checkpoint(store.step_dir(tmp_path / "par" / "t" / "checkpoints", 4)).tensors("model.")
    for key, value in ref.items():
        torch.testing.assert_close(
            out[key], value, rtol=1e-4, atol=5e-5, msg=lambda m: f"{key}: {m}"
        )


@pytest.mark.slow  # prepares data with a trained BPE, trains, exports, loads in transformers
def test_an_exported_run_loads_in_transformers_with_its_tokenizer(hf_dirs, tmp_path):
    data = prepare_readme(tmp_path / "data", "bpe:300")
    trained = strata(
        "train", str(_experiment(tmp_path)), *_overrides(hf_dirs["llama"], data, tmp_path / "runs")
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    ckpt = store.step_dir(tmp_path / "runs" / "t" / "checkpoints", 4)
    out = tmp_path / "exported"
    exported = strata("ckpt", "export", str(ckpt), str(out), "--format", "hf")
    assert exported.returncode == 0, exported.stderr[-3000:]

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    cfg = config.from_dict(yaml.safe_load((ckpt / "config.yaml").read_text()))
    ours = build_model(cfg.model, 320, seed=0)
    ours.load_state_dict(Checkpoint(ckpt).tensors("model."))
    tokens = torch.randint(0, 300, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, ours.eval()(tokens), rtol=0, atol=1e-5)

    from tokenizers import Tokenizer

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    sample = "Strata trains transformers on many machines."
    assert (
        hf_tok(sample)["input_ids"]
        == Tokenizer.from_file(str(data / "tokenizer.json")).encode(sample).ids
    )
    meta = json.loads((data / "meta.json").read_text())
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == meta["eot"]


@pytest.mark.slow  # an import and an export, run as the `strata` command in this process
@pytest.mark.parametrize("name", FAMILIES)
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
    transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out"
    )  # loads: no missing or unexpected keys


def test_an_export_in_several_shards_loads_in_transformers(hf_dirs, tmp_path, monkeypatch):
    from strata.checkpoint import export, hf_weights
    from strata.config import dump

    cfg = config.load(None, [f"model.init_from={hf_dirs['llama']}", f"model.seq_len={SEQ}"])
    step0 = hf_weights.import_hf(hf_dirs["llama"], tmp_path / "imported", dump(cfg), cfg.model)
    monkeypatch.setattr(export, "SHARD_BYTES", 100_000)  # a few tensors a shard
    export.export(step0, tmp_path / "out", "hf", read_config=config.from_yaml)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["llama"])
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


# --- bad input: one clear error, exit 2, before training ----------------------------------------


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _shard(src: Path, dst: Path) -> Path:
    """The model in two shards with an index, as save_pretrained writes big models."""
    _copy_model(src, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[: len(names) // 2]}
    half["model-00002-of-00002.safetensors"] = names[len(names) // 2 :]
    weight_map = {}
    for file, keys in half.items():
        save_file({k: tensors[k] for k in keys}, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return dst


def _edit_config(directory: Path, **changes) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return directory


BAD = {
    "missing shard": (
        lambda src, dst: (_shard(src, dst), (dst / "model-00002-of-00002.safetensors").unlink()),
        "lists shards that are not there: model-00002-of-00002.safetensors",
    ),
    "unsupported architecture": (
        lambda src, dst: _edit_config(_copy_model(src, dst), model_type="gpt_neox"),
        "model_type",
    ),
    "config and weights disagree": (
        lambda src, dst: _edit_config(_copy_model(src, dst), intermediate_size=128),
        "shape mismatches",
    ),
    "no weights": (
        lambda src, dst: (_copy_model(src, dst), (dst / "model.safetensors").unlink()),
        "no model.safetensors or model.safetensors.index.json",
    ),
    "tied config, a head of its own": (  # llama's lm_head is not its embedding
        lambda src, dst: _edit_config(_copy_model(src, dst), tie_word_embeddings=True),
        "holds an lm_head.weight that differs from model.embed_tokens.weight",
    ),
}


def test_a_tied_config_loads_a_saved_head_equal_to_the_embedding_and_refuses_another(
    hf_dirs, tmp_path, capsys
):
    """transformers unties (and warns) when a tied config's files hold a different head; Strata refuses
    it, naming both fixes, on import as on training; a head equal to the embedding (a .bin-era save
    that wrote both names) loads as tied."""
    from strata.checkpoint import hf_weights

    from conftest import run_cli

    equal = _copy_model(hf_dirs["qwen2"], tmp_path / "equal")
    tensors = load_file(equal / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, equal / "model.safetensors", metadata={"format": "pt"})
    cfg = config.load(None, [f"model.init_from={equal}", f"model.seq_len={SEQ}"])
    ckpt = hf_weights.open_weights(equal, cfg.model)
    assert torch.equal(
        ckpt.tensors("model.")["output.weight"], tensors["model.embed_tokens.weight"]
    )
    ckpt.close()
    other = _edit_config(
        _copy_model(hf_dirs["llama"], tmp_path / "other"), tie_word_embeddings=True
    )
    code, out = run_cli(
        ["ckpt", "import-hf", str(other), str(tmp_path / "imported"), f"model.seq_len={SEQ}"],
        capsys,
    )
    assert (
        code == 2
        and "holds an lm_head.weight that differs" in out
        and "tie_word_embeddings: false" in out
    ), out
    assert not (tmp_path / "imported").exists()


@pytest.mark.slow  # each case a fresh `strata train` interpreter: 4-6 s on 2 cores
@pytest.mark.parametrize("case", list(BAD))
def test_bad_hugging_face_input_is_one_clear_error(hf_dirs, small_data_dir, tmp_path, case):
    make, message = BAD[case]
    bad = tmp_path / "model"
    make(hf_dirs["llama"], bad)
    proc = strata(
        "train", str(_experiment(tmp_path)), *_overrides(bad, small_data_dir, tmp_path / "runs")
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs" / "t" / "checkpoints").exists() or not store.committed(
        tmp_path / "runs" / "t" / "checkpoints"
    )


def test_a_sharded_model_loads_like_the_single_file(hf_dirs, small_data_dir, tmp_path):
    sharded = _shard(hf_dirs["llama"], tmp_path / "sharded")
    cfg = config.load(None, _overrides(sharded, small_data_dir, tmp_path, **{"train.steps": 1}))
    assert run(cfg, start()).losses[1] == pytest.approx(_hf_loss(hf_dirs["llama"], cfg), abs=1e-5)


def _torchtitan_names(
    hf_state: dict[str, torch.Tensor], cfg: config.Config, new: bool
) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama's weights as torchtitan's Llama holds them: its names (0.3's
    `attention.qkv_linear.wq`/`lm_head`, or the older `attention.wq`/`output`) and its RoPE's q/k row
    order, by the reverse permutation torchtitan's own Llama3StateDictAdapter.from_hf applies."""
    m = cfg.model

    def reverse_permute(
        w: torch.Tensor, heads: int
    ) -> torch.Tensor:  # torchtitan's, verbatim in effect
        return (
            w.view(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
        )

    qkv = "attention.qkv_linear" if new else "attention"
    names = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight" if new else "output.weight",
    }
    out = {}
    for key, value in hf_state.items():
        if key in names:
            out[names[key]] = value
            continue
        layer, rest = key.split(".")[2], ".".join(key.split(".")[3:])
        if rest == "self_attn.q_proj.weight":
            value = reverse_permute(value, m.n_heads)
        elif rest == "self_attn.k_proj.weight":
            value = reverse_permute(value, m.kv_heads)
        local = {
            "self_attn.q_proj.weight": f"{qkv}.wq.weight",
            "self_attn.k_proj.weight": f"{qkv}.wk.weight",
            "self_attn.v_proj.weight": f"{qkv}.wv.weight",
            "self_attn.o_proj.weight": "attention.wo.weight",
            "mlp.gate_proj.weight": "feed_forward.w1.weight",
            "mlp.up_proj.weight": "feed_forward.w3.weight",
            "mlp.down_proj.weight": "feed_forward.w2.weight",
            "input_layernorm.weight": "attention_norm.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
        }[rest]
        out[f"layers.{layer}.{local}"] = value
    return out


@pytest.mark.parametrize(
    ("new", "prefix"), [(True, ""), (False, "model.")], ids=["torchtitan-0.3", "older-prefixed"]
)
def test_a_torchtitan_dcp_checkpoint_starts_a_run_at_transformers_loss(
    hf_dirs, small_data_dir, tmp_path, new, prefix
):
    import torch.distributed.checkpoint as dcp

    derived = config.load(None, [f"model.init_from={hf_dirs['llama']}", f"model.seq_len={SEQ}"])
    titan = _torchtitan_names(load_file(hf_dirs["llama"] / "model.safetensors"), derived, new)
    state = {"model": titan} if prefix else titan
    dcp.save(state, checkpoint_id=tmp_path / "titan", no_dist=True)
    model_keys = {
        k: v
        for k, v in config.to_dict(derived)["model"].items()
        if k not in ("init_from", "moe", "lora")
    }
    overrides = _overrides(
        tmp_path / "titan", small_data_dir, tmp_path / "runs", **{"train.steps": 1}
    )
    overrides += [
        f"model.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
        for k, v in model_keys.items()
    ]
    cfg = config.load(None, overrides)
    assert run(cfg, start()).losses[1] == pytest.approx(_hf_loss(hf_dirs["llama"], cfg), abs=1e-5)


def test_verify_holds_an_imported_checkpoints_weights_against_its_config(hf_dirs, tmp_path, capsys):
    """`strata ckpt verify` checks what an import checks: every model tensor has the shape the saved
    config.yaml's model gives it."""
    from strata.checkpoint import hf_weights
    from strata.config import dump

    from conftest import run_cli

    cfg = config.load(None, [f"model.init_from={hf_dirs['llama']}", f"model.seq_len={SEQ}"])
    good = hf_weights.import_hf(hf_dirs["llama"], tmp_path / "good", dump(cfg), cfg.model)
    code, out = run_cli(["ckpt", "verify", str(good)], capsys)
    assert code == 0 and ": ok" in out, out
    raw = yaml.safe_load(dump(cfg))
    raw["model"]["ffn_hidden"] = 128  # the weights are 96 wide
    bad = hf_weights.import_hf(hf_dirs["llama"], tmp_path / "bad", yaml.safe_dump(raw), cfg.model)
    code, out = run_cli(["ckpt", "verify", str(bad)], capsys)
    assert code == 1 and "DAMAGED" in out, out
    assert (
        "the weights contradict config.yaml: model.layers.0.mlp.w1.weight is (96, 64), config.yaml's model "
        in out
    )
    assert "makes it (128, 64)" in out
