"""LoRA (`model.lora`) and freezing (`train.freeze`) against PEFT, the independent reference: the
adapted model's logits and one optimizer step equal a PEFT model's holding the same adapter
values; a LoRA run from a Hugging Face model starts at transformers' loss, keeps its base weights
and holds gradients and optimizer state for the adapters only (measured against full fine-tuning);
it resumes bit-identically; its exports load in transformers and in PEFT with Strata's logits; and
parallel layouts train what one process does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from strata import config
from strata.checkpoint import store
from strata.checkpoint.hf_weights import open_adapter
from strata.checkpoint.reader import Checkpoint
from strata.errors import CheckpointError, ConfigError
from strata.hf.tensor_names import hf_sources, to_peft
from strata.lora import apply_lora, freeze, is_adapter, merge_adapters, trainable_names
from strata.model import GPT
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from conftest import hf_run_overrides, run_cli, save_gqa_llama, tiny_config
from worlds import COMMON, assert_same_params, final_params, losses_from, train_run, train_world

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ = 32
VOCAB = 320
LORA = {
    "model.lora.rank": 4,
    "model.lora.alpha": 8,
    "model.lora.target_modules": "[all-linear]",
}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, grouped-query attention) saved by transformers."""
    return save_gqa_llama(tmp_path_factory.mktemp("hf") / "llama", VOCAB)


def _lora_config(hf_dir: Path, data_dir: Path, run_root: Path, **extra) -> config.Config:
    return config.load(None, hf_run_overrides(hf_dir, data_dir, run_root, SEQ, **LORA, **extra))


def _adapted(cfg: config.Config, hf_dir: Path) -> GPT:
    """Strata's GPT with the Hugging Face weights and adapters (B drawn non-zero, so they count)."""
    model = GPT(cfg.model, VOCAB)
    apply_lora(model, cfg.model.lora)
    model.init_weights(cfg.train.seed)
    weights = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf_state, state = weights.state_dict(), model.state_dict()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, hf_name in hf_sources(cfg.model).items():
            state[name].copy_(hf_state[hf_name])
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _peft_model(hf_dir: Path, model: GPT, cfg: config.Config):
    """PEFT's LoRA model on transformers' Llama with the same adapter values as `model`."""
    lora = cfg.model.lora
    base = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ref = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=0.0,
            target_modules="all-linear",
        ),
    )
    values = {to_peft(n): p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    result = peft.set_peft_model_state_dict(ref, values)
    assert not result.unexpected_keys
    return ref


def test_adapters_compute_and_train_as_peft(hf_llama, small_data_dir, tmp_path, one_thread):
    cfg = _lora_config(hf_llama, small_data_dir, tmp_path)
    model = _adapted(cfg, hf_llama)
    ref = _peft_model(hf_llama, model, cfg)
    trainable = trainable_names(model, cfg)
    freeze([model], trainable)
    # the same layers adapted: PEFT's all-linear is every linear but the output layer
    peft_trainable = {
        n.replace(".default", "") for n, p in ref.named_parameters() if p.requires_grad
    }
    assert {to_peft(n) for n in trainable} == peft_trainable
    assert len(trainable) == 2 * 7 * cfg.model.n_layers

    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.testing.assert_close(model(x), ref(x).logits, rtol=0, atol=1e-5)

    # one SGD step on the same batch: the adapters move alike, the base weights get no gradient
    for net, logits in ((model, lambda: model(x)), (ref, lambda: ref(x).logits)):
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
        F.cross_entropy(logits().float().flatten(0, 1), y.flatten()).backward()
        opt.step()
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))
    assert all(p.grad is not None for n, p in model.named_parameters() if is_adapter(n))
    after = peft.get_peft_model_state_dict(ref)
    for name, p in model.named_parameters():
        if is_adapter(name):
            torch.testing.assert_close(p, after[to_peft(name)], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(model(x), ref(x).logits, rtol=0, atol=1e-5)

    # merged into the weights (an export's), the plain model computes the same
    merged = ref.merge_and_unload()
    merge_adapters(model)
    assert not any(is_adapter(n) for n, _ in model.named_parameters())
    torch.testing.assert_close(model(x), merged(x).logits, rtol=0, atol=1e-5)


def test_freeze_items_name_parameters(small_data_dir, tmp_path):
    cfg = tiny_config(
        small_data_dir, tmp_path, **{"train.freeze": "[embeddings, layers.0-0.attn, norms]"}
    )
    model = GPT(cfg.model, 320)
    trains = trainable_names(model, cfg)
    assert "tok_embeddings.weight" not in trains and "norm.weight" not in trains
    assert "layers.0.attn.wq.weight" not in trains and "layers.0.mlp.w1.weight" in trains
    assert "layers.1.attn_norm.weight" not in trains and "layers.1.attn.wq.weight" in trains
    nothing = tiny_config(small_data_dir, tmp_path, **{"train.freeze": "[layers.7]"})
    with pytest.raises(ConfigError, match=r"'layers.7' names no parameter"):
        trainable_names(model, nothing)
    everything = tiny_config(small_data_dir, tmp_path, **{"train.freeze": "['*']"})
    with pytest.raises(ConfigError, match="freezes every parameter"):
        trainable_names(model, everything)


def test_frozen_parameters_keep_their_values_and_resume(small_data_dir, tmp_path, capsys):
    """train.freeze without adapters: what it names keeps its initial values, with no optimizer
    state, while the rest trains; a resume from the middle is bit-identical."""
    settings = {
        "train.freeze": "[embeddings, layers.0, norms]",
        "train.steps": 4,
        "checkpoint.interval": 2,
        "checkpoint.save_final": True,
    }
    cfg = tiny_config(small_data_dir, tmp_path / "whole", **settings)
    whole = run(cfg, start())
    banner = next(line for line in capsys.readouterr().out.splitlines() if "parameters" in line)
    assert " parameters (" in banner and "M trained), world 1" in banner, banner
    middle = Checkpoint(store.step_dir(cfg.checkpoint_dir(), 2))
    final = Checkpoint(store.step_dir(cfg.checkpoint_dir(), 4))
    before, after = middle.tensors("model."), final.tensors("model.")
    frozen = {
        n
        for n in after
        if n == "tok_embeddings.weight" or n.startswith("layers.0.") or n.endswith("norm.weight")
    }
    assert "layers.1.attn.wq.weight" not in frozen and len(frozen) > 3
    for name, value in after.items():
        assert torch.equal(value, before[name]) == (name in frozen), name
    trained = {k.rsplit(".", 1)[0] for k in final.shapes("optim.state.")}
    assert trained == set(after) - frozen

    resumed_cfg = tiny_config(small_data_dir, tmp_path / "resumed", **settings)
    resumed = run(resumed_cfg, start(), resume=store.step_dir(cfg.checkpoint_dir(), 2))
    assert {s: resumed.losses[s] for s in (3, 4)} == {s: whole.losses[s] for s in (3, 4)}


def test_a_pipeline_whose_first_stage_is_all_frozen_is_refused(small_data_dir, tmp_path):
    from strata.trainer.parallelize import _refuse_frozen_first_stage

    cfg = tiny_config(
        small_data_dir,
        tmp_path,
        world_size=2,
        **{"parallel.pp": 2, "train.freeze": "[embeddings, layers.0]"},
    )
    with pytest.raises(ConfigError, match="freezes all of the first pipeline stage"):
        _refuse_frozen_first_stage(cfg, {"layers.1.attn.wq.weight"})
    _refuse_frozen_first_stage(cfg, {"layers.0.mlp.w1.weight"})


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow  # two runs (LoRA, full fine-tuning): ~8 s on 2 cores
def test_a_lora_run_trains_only_its_adapters(hf_llama, small_data_dir, tmp_path):
    """From a Hugging Face model: step 1's loss is the base model's (B starts at zero), the base
    weights come out unchanged, and gradients and optimizer state are the adapters' alone: the
    measured bytes against a full fine-tuning run of the same model."""
    lora_cfg = _lora_config(hf_llama, small_data_dir, tmp_path / "lora")
    full_cfg = config.load(None, hf_run_overrides(hf_llama, small_data_dir, tmp_path / "full", SEQ))
    lora, full = run(lora_cfg, start()), run(full_cfg, start())
    assert lora.losses[1] == full.losses[1]  # bit-identical: the adapters add exactly zero
    assert lora.losses[4] != full.losses[4]

    final = Checkpoint(store.step_dir(lora_cfg.checkpoint_dir(), 4))
    weights = final.tensors("model.")
    base = transformers.LlamaForCausalLM.from_pretrained(hf_llama, dtype=torch.float32)
    hf_state = base.state_dict()
    for name, hf_name in hf_sources(lora_cfg.model).items():
        assert torch.equal(weights[name], hf_state[hf_name]), name
    adapters = [n for n in weights if is_adapter(n)]
    assert adapters and all(weights[n].abs().sum() > 0 for n in adapters)
    saved_state = {k.rsplit(".", 1)[0] for k in final.shapes("optim.state.")}
    assert saved_state == set(adapters)

    adapter_numel = sum(weights[n].numel() for n in adapters)
    total_numel = sum(t.numel() for t in weights.values())
    held_lora, held_full = (
        _summary(lora_cfg.run_dir())["held_bytes"],
        _summary(full_cfg.run_dir())["held_bytes"],
    )
    # AdamW's two fp32 moments, and an fp32 gradient, per trained element
    assert held_lora["optim"] == 2 * 4 * adapter_numel
    assert held_full["optim"] == 2 * 4 * (total_numel - adapter_numel)
    assert held_lora["grads"] == 4 * adapter_numel
    assert held_lora["params"] == 4 * total_numel == held_full["params"] + 4 * adapter_numel
    print(
        f"optimizer state: LoRA {held_lora['optim']} B, full fine-tuning {held_full['optim']} B "
        f"({held_full['optim'] / held_lora['optim']:.1f}x)"
    )


@pytest.mark.slow  # two runs: ~8-17 s on 2 cores
def test_a_lora_run_resumes_bit_identically(hf_llama, small_data_dir, tmp_path):
    settings = {"checkpoint.interval": 2, "model.lora.dropout": 0.1}
    whole = _lora_config(hf_llama, small_data_dir, tmp_path / "whole", **settings)
    reference = run(whole, start())
    resumed_cfg = _lora_config(hf_llama, small_data_dir, tmp_path / "resumed", **settings)
    resumed = run(resumed_cfg, start(), resume=store.step_dir(whole.checkpoint_dir(), 2))
    assert sorted(resumed.losses) == [3, 4]
    for step, loss in resumed.losses.items():
        assert loss == reference.losses[step], step
    got = Checkpoint(store.step_dir(resumed_cfg.checkpoint_dir(), 4)).tensors("model.")
    want = Checkpoint(store.step_dir(whole.checkpoint_dir(), 4)).tensors("model.")
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.slow  # two runs
def test_recomputed_blocks_draw_the_same_adapter_dropout(hf_llama, small_data_dir, tmp_path):
    """activations.recompute=full runs each block's forward again in backward: the adapters'
    dropout masks must be the ones of the first forward, so the run trains what it does without."""
    settings = {"model.lora.dropout": 0.2}
    plain = run(_lora_config(hf_llama, small_data_dir, tmp_path / "plain", **settings), start())
    recomputed_cfg = _lora_config(
        hf_llama,
        small_data_dir,
        tmp_path / "recomputed",
        **settings,
        **{"activations.recompute": "full"},
    )
    recomputed = run(recomputed_cfg, start())
    assert recomputed.losses == plain.losses
    # and equal seeds give equal runs, dropout included
    again = run(_lora_config(hf_llama, small_data_dir, tmp_path / "again", **settings), start())
    assert again.losses == plain.losses


@pytest.mark.slow  # two runs of `strata ckpt export` in this process, transformers and PEFT loading
def test_exports_load_in_transformers_and_peft(hf_llama, small_data_dir, tmp_path, capsys):
    cfg = _lora_config(hf_llama, small_data_dir, tmp_path / "run")
    run(cfg, start())
    step = store.step_dir(cfg.checkpoint_dir(), 4)
    code, out = run_cli(
        ["ckpt", "export", str(step), str(tmp_path / "adapter"), "--format", "peft"], capsys
    )
    assert code == 0, out
    code, out = run_cli(
        ["ckpt", "export", str(step), str(tmp_path / "merged"), "--format", "hf"], capsys
    )
    assert code == 0, out
    code, out = run_cli(["ckpt", "verify", str(step)], capsys)  # holds adapters against config.yaml
    assert code == 0, out

    from strata.inference.source import open_model

    strata_model = open_model(step).model  # the adapters merged into their weights
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = strata_model(tokens)
        base = transformers.LlamaForCausalLM.from_pretrained(hf_llama, dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(adapted(tokens).logits, want, rtol=0, atol=1e-5)
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "merged", dtype=torch.float32
        ).eval()
        torch.testing.assert_close(merged(tokens).logits, want, rtol=0, atol=1e-5)


def _first_batch_loss(model, cfg: config.Config) -> float:
    """A transformers model's loss on the first step's batch Strata's loader gives."""
    from strata.data.loader import BatchLoader
    from strata.data.tokens import TokenDataset

    loader = BatchLoader(
        TokenDataset(Path(cfg.data.path), "train", SEQ),
        cfg.train.seed,
        cfg.train.global_batch_size,
        cfg.train.micro_batch_size,
        0,
        1,
    )
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(b.inputs).logits.flatten(0, 1).float(), b.targets.flatten())
            for b in loader.next_step()
        ]
    return torch.stack(losses).mean().item()


def test_a_peft_adapter_continues_training(hf_llama, small_data_dir, tmp_path):
    """model.lora.init_from: PEFT's own save_pretrained, loaded onto the base: the first step's loss
    is PEFT's on that batch, and with lr 0 the adapters stay the file's, bit for bit."""
    cfg = _lora_config(
        hf_llama,
        small_data_dir,
        tmp_path,
        **{"model.lora.init_from": tmp_path / "adapter", "optim.lr": 0.0, "train.steps": 1},
    )
    model = _adapted(cfg, hf_llama)
    ref = _peft_model(hf_llama, model, cfg).eval()
    ref.save_pretrained(tmp_path / "adapter")
    result = run(cfg, start())
    assert result.losses[1] == pytest.approx(_first_batch_loss(ref, cfg), abs=1e-5)
    saved = Checkpoint(store.step_dir(cfg.checkpoint_dir(), 1)).tensors("model.")
    state = peft.get_peft_model_state_dict(ref)
    for name, value in saved.items():
        if is_adapter(name):
            assert torch.equal(value, state[to_peft(name)]), name

    with pytest.raises(CheckpointError, match=r"lora_alpha: 8\.0 \(this run: 4\.0\)"):
        open_adapter(tmp_path / "adapter", cfg.model.lora.rank, 4.0)


ZERO3 = {
    "zero.params.shard_over": "global",
    "zero.grads.shard_over": "global",
    "zero.optim.shard_over": "global",
}


@pytest.mark.slow  # worlds of 2 and 4 processes running `strata train`
@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, {"parallel.tp": 2}),
        (2, {"parallel.tp": 2, "parallel.sequence_parallel": True}),
        (2, ZERO3),
        (4, {**ZERO3, "parallel.pp": 2, "zero.prefetch_blocks": 2}),
        (2, {"parallel.pp": 2}),
        (2, {"parallel.cp": 2}),
        (2, {"zero.optim.shard_over": "global", "offload.optim.device": "cpu"}),
        (2, {**ZERO3, "offload.params.device": "cpu", "offload.optim.device": "cpu"}),
        (
            4,
            {**ZERO3, "zero.secondary_params.shard_over": "node", "parallel.ranks_per_node": 2},
        ),
    ],
    ids=[
        "tp2",
        "tp2-sp",
        "zero3-dp2",
        "zero3-pp2-dp2",
        "pp2",
        "cp2",
        "dp2-optim-offload",
        "zero3-dp2-params-offload",
        "hpz-dp4-two-nodes",
    ],
)
def test_lora_in_parallel_matches_one_process(hf_llama, small_data_dir, tmp_path, nproc, layout):
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")

    def overrides(root: Path, **extra) -> list[str]:
        return [
            str(experiment),
            *hf_run_overrides(
                hf_llama, small_data_dir, root, SEQ, **LORA, **{"checkpoint.interval": 2}, **extra
            ),
        ]

    train_world(overrides(tmp_path / "one"), 1, tmp_path / "one")
    output = train_world(overrides(tmp_path / "par", **layout), nproc, tmp_path / "par")
    assert f"M trained), world {nproc} " in output
    want = Checkpoint(store.step_dir(tmp_path / "one" / "t" / "checkpoints", 4))
    got = Checkpoint(store.step_dir(tmp_path / "par" / "t" / "checkpoints", 4))
    assert set(got.shapes("optim.state.")) == set(want.shapes("optim.state."))
    ref, out = want.tensors("model."), got.tensors("model.")
    assert out.keys() == ref.keys()
    for key, value in ref.items():
        if is_adapter(key):
            torch.testing.assert_close(out[key], value, rtol=1e-4, atol=5e-5, msg=key)
        else:  # frozen: loaded, never changed
            assert torch.equal(out[key], value), key
    if "parallel.tp" in layout:  # the tp checkpoint of step 2 continues in one process
        resumed = tmp_path / "resumed"
        train_world(
            [
                *overrides(resumed),
                "--resume",
                str(store.step_dir(tmp_path / "par" / "t" / "checkpoints", 2)),
            ],
            1,
            resumed,
        )
        got_losses, want_losses = losses_from(resumed / "t"), losses_from(tmp_path / "one" / "t")
        assert sorted(got_losses) == [3, 4]
        for step, loss in got_losses.items():
            assert loss == pytest.approx(want_losses[step], rel=1e-5, abs=1e-6), step


@pytest.mark.slow  # a world of 2 processes running `strata train`
def test_lora_on_an_moe_model_under_expert_parallelism_matches_one_process(
    small_data_dir, tmp_path
):
    """Adapters on attention and the shared experts (the routed experts frozen), ep 2."""
    shared = {
        **COMMON,
        "model.moe.num_experts": 4,
        "model.moe.shared_experts": 1,
        "model.lora.rank": 4,
        "model.lora.target_modules": "[all-linear]",
    }
    reference_cfg = tiny_config(small_data_dir, tmp_path / "ref", **shared)
    reference = run(reference_cfg, start())
    train_run(small_data_dir, tmp_path / "par", 2, **shared, **{"parallel.ep": 2})
    par_losses = losses_from(tmp_path / "par" / "t")
    assert sorted(par_losses) == sorted(reference.losses)
    for step, loss in reference.losses.items():
        assert par_losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    want = final_params(reference_cfg.checkpoint_dir())
    assert any(".mlp.shared.w1.lora_A." in n for n in want)
    assert_same_params(final_params(tmp_path / "par" / "t" / "checkpoints"), want)
