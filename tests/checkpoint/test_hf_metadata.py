"""A Hugging Face export keeps what the model it came from said: a Qwen2 with a long context and YaRN
scaling, bos/eos/pad ids, a sliding window, a tokenizer with a chat template and a generation config,
made with transformers offline, comes back from HF → Strata → HF (an import, and a fine-tuning run
on data its own tokenizer prepared) with an equal config.json, tokenizer config, chat template and
generation config, and the tokenizer and model behave as the original's. Where fields would be
lost (the source is gone) the export refuses, and --force says what it set instead."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from strata import config, hf
from strata.checkpoint import store
from strata.checkpoint.hf_metadata import hf_metadata

from conftest import hf_run_overrides, prepare_readme, run_cli
from worlds import REPO, strata

transformers = pytest.importorskip("transformers")

SEQ = 32
# The config.json fields beyond the model's shape an export must carry
FIELDS = (
    "max_position_embeddings",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "tie_word_embeddings",
    "model_type",
    "architectures",
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny Qwen2 directory with every field an export must keep, its tokenizer and generation config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("source")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([(REPO / "README.md").read_text()[:20000]], trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=32768,
        chat_template=TEMPLATE,
    ).save_pretrained(root)
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        use_sliding_window=True,
        sliding_window=4096,
        max_window_layers=1,
        tie_word_embeddings=True,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(root)
    transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=True, temperature=0.7, top_p=0.8
    ).save_pretrained(root)
    return root


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_kept(src: Path, out: Path) -> None:
    """config.json (every listed field, then the whole), the tokenizer's files, the generation config,
    the chat template's output and the model's logits: the source's."""
    want, got = _json(src / "config.json"), _json(out / "config.json")
    for key in FIELDS:
        assert key in want, key  # the source really has it
        assert got.get(key) == want[key], key
    assert got == want
    for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists():
            assert _json(out / name) == _json(src / name), name
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    ours, theirs = (
        transformers.AutoTokenizer.from_pretrained(out),
        transformers.AutoTokenizer.from_pretrained(src),
    )
    assert ours.apply_chat_template(CHAT, tokenize=False) == theirs.apply_chat_template(
        CHAT, tokenize=False
    )
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.model_max_length) == (
        "<s>",
        "</s>",
        "<pad>",
        32768,
    )
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.temperature, generation.top_p, generation.pad_token_id) == (0.7, 0.8, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.sliding_window == 4096 and model.config.layer_types == want["layer_types"]


@pytest.mark.slow  # an import, three exports and transformers' models
def test_an_import_exports_everything_its_source_said_and_refuses_once_it_is_gone(
    source, tmp_path, capsys
):
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    code, said = run_cli(
        ["ckpt", "import-hf", str(copy), str(tmp_path / "imported"), f"model.seq_len={SEQ}"], capsys
    )
    assert code == 0, said
    step0 = store.step_dir(tmp_path / "imported", 0)
    out = tmp_path / "out"
    code, said = run_cli(["ckpt", "export", str(step0), str(out), "--format", "hf"], capsys)
    assert code == 0, said
    assert "note:" not in said  # nothing was set from the run's config
    assert_kept(source, out)
    tokens = torch.randint(0, 300, (2, SEQ))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(source).eval()(tokens).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a run started from that checkpoint (model.init_from a Strata checkpoint) still finds the source
    cfg = config.from_yaml((step0 / "config.yaml").read_bytes())
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=str(step0)))
    computed = {**hf.hf_config(cfg.model, 320), "torch_dtype": "float32"}
    metadata = hf_metadata(cfg, computed)
    assert metadata.config == _json(source / "config.json") and not metadata.notes

    # the source gone: refused (its fields would be lost), unless forced, which says what it set
    shutil.rmtree(copy)
    code, said = run_cli(
        ["ckpt", "export", str(step0), str(tmp_path / "lost"), "--format", "hf"], capsys
    )
    assert code == 2 and str(copy) in said and "--force" in said and "Traceback" not in said
    assert not (tmp_path / "lost").exists()
    code, said = run_cli(
        ["ckpt", "export", str(step0), str(tmp_path / "lost"), "--format", "hf", "--force"], capsys
    )
    assert code == 0, said
    assert (
        "note: config.json from the run's config" in said and "note: no tokenizer exported" in said
    )
    lost = _json(tmp_path / "lost" / "config.json")
    assert "bos_token_id" not in lost and "pad_token_id" not in lost
    assert _json(tmp_path / "lost" / "generation_config.json") == {"_from_model_config": True}
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lost")


@pytest.mark.slow  # data prepare, a 4-step run and an export (CLI processes)
def test_a_fine_tuned_import_exports_everything_its_source_said(source, tmp_path):
    data = prepare_readme(tmp_path / "data", str(source))
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    trained = strata(
        "train", str(experiment), *hf_run_overrides(source, data, tmp_path / "runs", SEQ)
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    out = tmp_path / "out"
    ckpt = store.step_dir(tmp_path / "runs" / "t" / "checkpoints", 4)
    exported = strata("ckpt", "export", str(ckpt), str(out), "--format", "hf")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert_kept(source, out)
