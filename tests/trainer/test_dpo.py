"""Direct Preference Optimization (train.objective: dpo) against TRL 1.16's DPOTrainer and a plain
torch implementation, on preference pairs prepared by `strata data prepare` (whose preparation
tests/data/test_preference_pairs.py checks against TRL's tokenization). On a tiny random Llama
imported from transformers, with PEFT LoRA adapters that are not zero (so policy and reference
differ), the first step's loss and TRL's rewards/chosen, rewards/rejected, rewards/accuracies and
rewards/margins equal DPOTrainer's on the same pairs (the reference: the adapters off), for the
sigmoid and the ipo loss; the step's gradient of every adapter equals a plain torch
implementation's (each sequence alone, no packing), in one process with gradient accumulation and
in worlds of 2: dp (with ZeRO-2, with recomputed blocks), tp (the vocab-parallel
log-probabilities; with sequence parallelism), pp (the reference carried to the last stage in the
targets) and cp (completion sums over the shards), whose evaluations (the mean pair loss of the
validation pairs) are one process's. A second step keeps the first reference (the adapters off,
or for full fine-tuning the starting weights: against plain torch and TRL's ref_model), also
across a resume; full fine-tuning under dp, tp and pp logs what one process does. Training logs
TRL's metrics; what DPO does not run with is refused by name."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strata import config
from strata.data.loader import BatchLoader
from strata.data.tokens import TokenDataset, read_meta
from strata.errors import ConfigError, DataError
from strata.hf.tensor_names import to_peft
from strata.parallel.tensor import placement_of
from strata.trainer.hooks import StepHook

from conftest import hf_run_overrides, save_gqa_llama
from preference_pairs import SEQ, pair_records, prepare_pairs, save_tokenizer, unpack
from worlds import run_world, train_world, worker_env

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")

LORA = {
    "model.lora.rank": 4,
    "model.lora.alpha": 8,
    "model.lora.target_modules": "[all-linear]",
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def pairs_dir(tok_dir, tmp_path_factory) -> Path:
    return prepare_pairs(pair_records(24, 0), tmp_path_factory.mktemp("pairs"), tok_dir)


# --- training ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_llama(tok_dir, tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, grouped-query attention) with the data's vocabulary."""
    return save_gqa_llama(
        tmp_path_factory.mktemp("hf") / "llama",
        len(transformers.AutoTokenizer.from_pretrained(tok_dir)),
    )


@pytest.fixture(scope="module")
def adapter_dir(hf_llama, tmp_path_factory) -> Path:
    """PEFT adapters on every linear layer, B drawn non-zero: the policy is not the reference."""
    base = transformers.LlamaForCausalLM.from_pretrained(hf_llama, dtype=torch.float32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    directory = tmp_path_factory.mktemp("adapter") / "lora"
    model.save_pretrained(directory)
    return directory


def _overrides(hf_llama, adapter_dir, data_dir, run_root, **extra) -> list[str]:
    settings = {
        **LORA,
        "model.lora.init_from": adapter_dir,
        "train.objective": "dpo",
        "data.document_mask": "true",
        "data.reset_positions": "true",
        "optim.grad_clip": 0,  # the gradients compared as reduced, unclipped
        "train.steps": 1,
        **extra,
    }
    return hf_run_overrides(hf_llama, data_dir, run_root, SEQ, **settings)


def step_pairs(data_dir: Path, cfg: config.Config, step: int = 1) -> list[tuple]:
    """The pairs of a step's global batch: ((chosen ids, trained), (rejected ...)), each side's
    tokens alone (without its end-of-document token) and which of them are trained."""
    eot = read_meta(data_dir).raw["eot"]
    data = TokenDataset(data_dir, "train", SEQ)
    loader = BatchLoader(data, cfg.train.seed, cfg.train.global_batch_size, 2)
    for _ in range(step):
        batches = loader.next_step()
    sides = []
    for batch in batches:
        assert batch.mask is not None
        for inputs, targets, mask in zip(batch.inputs, batch.targets, batch.mask):
            window = torch.cat([inputs, targets[-1:]])
            trained = torch.cat([torch.zeros(1, dtype=torch.bool), mask])
            ends = (window == eot).nonzero().flatten().tolist()
            start = 0
            for end in ends:
                if end > start:
                    sides.append((window[start:end], trained[start:end]))
                start = end + 1
    return list(zip(sides[::2], sides[1::2]))


def _peft(hf_llama: Path, adapter_dir: Path):
    base = transformers.LlamaForCausalLM.from_pretrained(hf_llama, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)


def _sequence_logp(model, ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[None]).logits[0].float()
    logp = F.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
    return (logp * trained[1:]).sum()


def torch_reference(hf_llama, adapter_dir, pairs, beta: float, loss_type: str) -> tuple:
    """Plain torch on transformers' PEFT model, each sequence alone: the mean DPO loss, TRL's
    reward metrics, and the gradient of every adapter weight by PEFT's name."""
    return dpo_reference(_peft(hf_llama, adapter_dir), None, pairs, beta, loss_type)


def dpo_reference(model, ref_model, pairs, beta: float, loss_type: str) -> tuple:
    """`torch_reference` of a policy and a reference model (None: the policy's adapters off)."""
    losses, chosen, rejected = [], [], []
    for (c, c_mask), (r, r_mask) in pairs:
        logp = torch.stack([_sequence_logp(model, c, c_mask), _sequence_logp(model, r, r_mask)])
        with torch.no_grad():
            with model.disable_adapter() if ref_model is None else contextlib.nullcontext():
                frozen = model if ref_model is None else ref_model
                ref = torch.stack(
                    [_sequence_logp(frozen, c, c_mask), _sequence_logp(frozen, r, r_mask)]
                )
        ratio = logp - ref
        if loss_type == "ipo":
            n = torch.stack([c_mask.sum(), r_mask.sum()]).float()
            losses.append((ratio[0] / n[0] - ratio[1] / n[1] - 1 / (2 * beta)) ** 2)
        else:
            losses.append(-F.logsigmoid(beta * (ratio[0] - ratio[1])))
        chosen.append(float(beta * ratio[0].detach()))
        rejected.append(float(beta * ratio[1].detach()))
    loss = torch.stack(losses).mean()
    loss.backward()
    c, r = np.array(chosen), np.array(rejected)
    metrics = {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/accuracies": (c > r).mean(),
        "rewards/margins": (c - r).mean(),
    }
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            peft_name = name.replace(".default", "")
            grads[peft_name] = p.grad
    return float(loss.detach()), metrics, grads


def trl_reference(hf_llama, adapter_dir, tok_dir, pairs, beta, loss_type, tmp_path) -> tuple:
    """TRL's DPOTrainer on the same pairs, as one batch (the reference: the adapters off): its
    loss and its logged reward metrics."""
    return trl_dpo(_peft(hf_llama, adapter_dir), None, tok_dir, pairs, beta, loss_type, tmp_path)


def trl_dpo(model, ref_model, tok_dir, pairs, beta, loss_type, tmp_path) -> tuple:
    """`trl_reference` of a policy and a reference model (None: the PEFT policy's adapters off)."""
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=beta,
        loss_type=[loss_type],
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_length=None,
        per_device_train_batch_size=len(pairs),
    )
    examples = []
    for (c, c_mask), (r, r_mask) in pairs:
        start = int(c_mask.float().argmax())
        assert start == int(r_mask.float().argmax()) and torch.equal(c[:start], r[:start])
        examples.append(
            {
                "prompt_ids": c[:start].tolist(),
                "chosen_ids": c[start:].tolist(),
                "rejected_ids": r[start:].tolist(),
            }
        )
    dataset = Dataset.from_list(pair_records(2, 9))
    trainer = trl.DPOTrainer(
        model=model, ref_model=ref_model, args=args, train_dataset=dataset, processing_class=tok
    )
    if ref_model is None:
        # Handed a PEFT model, TRL keeps its adapter's first values as the reference ("ref"); its
        # reference for adapters it adds itself (peft_config) is the base model, as Strata's is:
        # drop the copy so that the reference is the adapters off.
        trainer.model.delete_adapter("ref")
        assert "ref" not in trainer.model.peft_config and trainer.model.active_adapter == "default"
    batch = trainer.data_collator(examples)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    logged = trainer._metrics["train"]
    metrics = {
        k: logged[k][-1]
        for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    }
    return float(loss.detach()), metrics


class GradientCapture(StepHook):
    """At the veto, after the reduction and before the update: each of this rank's gradient
    pieces, with the same piece of the reference gradient (its slice after tp)."""

    def __init__(self, model, want: dict[str, torch.Tensor]):
        self.model, self.want = model, want
        self.pieces: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def veto(self, step: int, loss: float, grad_norm: float) -> str | None:
        if not self.want:
            return None
        for g in self.model.engine.groups:
            for slot, piece, a, b in g.segments:
                name = slot.aliases[0]
                want = self.want[to_peft(name)]
                expected = placement_of(slot.param).local_slice(want).flatten()[a:b]
                self.pieces.append((name, piece.grad.detach().clone(), expected))
        return None


def _first_step(overrides: list[str], want: dict, size: int) -> dict:
    """Strata's evaluation and first step on this rank of a world of `size`."""
    from strata.parallel import runtime
    from strata.trainer.loop import Trainer

    cfg = config.load(None, overrides, world_size=size, local_world_size=size)
    rt = runtime.start("gloo", cfg.parallel.timeout_s)
    trainer = Trainer(cfg, rt, writes=[], saves=False)
    trainer.init_weights()  # model.init_from, and model.lora.init_from's adapters
    capture = GradientCapture(trainer.model, want)
    trainer.hooks.append(capture)
    evaluation = trainer.evaluate()
    loss, _ = trainer.train_step()
    assert trainer.model.objective is not None
    record = trainer.model.objective.record()
    trainer.model.close()
    return {
        "eval": evaluation.loss,
        "loss": float(loss),
        "record": record,
        "pieces": capture.pieces,
    }


def _step_rank(rank: int, size: int, port: int, out_dir: str, overrides: list, want: dict) -> None:
    worker_env(rank, size, port)
    torch.set_num_threads(1)
    from strata.parallel import runtime

    result = _first_step(overrides, want, size)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    runtime.stop()


def assert_reference(results: list[dict], loss: float, metrics: dict, n_params: int) -> None:
    checked = set()
    for r, result in enumerate(results):
        assert result["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), r
        for key, value in metrics.items():
            assert result["record"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (r, key)
        for name, got, expected in result["pieces"]:
            atol = 1e-5 * float(expected.abs().max()) + 1e-9
            torch.testing.assert_close(
                got, expected, rtol=1e-4, atol=atol, msg=lambda m: f"rank {r}, {name}: {m}"
            )
            checked.add(name)
    assert len(checked) == n_params  # every adapter weight, on some rank


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_the_first_step_is_trls_and_plain_torchs(
    hf_llama, adapter_dir, tok_dir, pairs_dir, tmp_path, loss_type
):
    beta = 0.1 if loss_type == "sigmoid" else 0.5
    extra = {"train.dpo.beta": beta, "train.dpo.loss_type": loss_type}
    overrides = _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path, **extra)
    cfg = config.load(None, overrides)
    assert cfg.grad_accum_steps(1) == 4  # micro-batches of 2 windows
    pairs = step_pairs(pairs_dir, cfg)
    assert len(pairs) > 8
    loss, metrics, grads = torch_reference(hf_llama, adapter_dir, pairs, beta, loss_type)
    assert 0 < metrics["rewards/accuracies"] < 1 and metrics["rewards/chosen"] != 0
    trl_loss, trl_metrics = trl_reference(
        hf_llama, adapter_dir, tok_dir, pairs, beta, loss_type, tmp_path
    )
    assert trl_loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
    for key, value in trl_metrics.items():
        assert value == pytest.approx(metrics[key], rel=1e-5, abs=1e-5), key
    result = _first_step(overrides, grads, 1)
    assert_reference([result], trl_loss, trl_metrics, len(grads))


LAYOUTS = {
    "dp2": {},
    "tp2": {"parallel.tp": 2},
    "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
    "dp2-zero2": {"zero.grads.shard_over": "global", "zero.optim.shard_over": "global"},
    "cp2": {"parallel.cp": 2},
    "pp2": {"parallel.pp": 2},
    "dp2-recompute": {"activations.recompute": "full"},
}


@pytest.mark.slow  # a world of 2 processes
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_one_process_step(hf_llama, adapter_dir, pairs_dir, tmp_path, layout):
    overrides = _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path, **LAYOUTS[layout])
    pairs = step_pairs(pairs_dir, config.load(None, overrides))
    loss, metrics, grads = torch_reference(hf_llama, adapter_dir, pairs, 0.1, "sigmoid")
    results = run_world(_step_rank, 2, tmp_path, overrides, grads)
    assert_reference(results, loss, metrics, len(grads))
    # the evaluation (the mean pair loss over the validation pairs) is the same on every rank
    one = _first_step(_overrides(hf_llama, adapter_dir, pairs_dir, tmp_path / "one"), grads, 1)
    for result in results:
        assert result["eval"] == pytest.approx(one["eval"], rel=1e-5, abs=1e-6)


def test_the_evaluation_is_the_mean_pair_loss_of_the_validation_pairs(
    hf_llama, adapter_dir, pairs_dir, tmp_path
):
    overrides = _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path)
    val = unpack(pairs_dir, "val")
    assert val
    pairs = [
        tuple((torch.from_numpy(ids), torch.from_numpy(mask.astype(bool))) for ids, mask in pair)
        for pair in val
    ]
    loss, _, _ = torch_reference(hf_llama, adapter_dir, pairs, 0.1, "sigmoid")
    assert _first_step(overrides, {}, 1)["eval"] == pytest.approx(loss, rel=1e-5, abs=1e-6)


def test_a_dpo_run_logs_trls_metrics(hf_llama, adapter_dir, pairs_dir, tmp_path, capsys):
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train

    overrides = _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path, **{"train.steps": 2})
    pairs = step_pairs(pairs_dir, config.load(None, overrides))
    loss, metrics, _ = torch_reference(hf_llama, adapter_dir, pairs, 0.1, "sigmoid")
    train(config.load(None, overrides), start())
    lines = (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    step1 = next(r for r in records if r.get("step") == 1 and "loss" in r)
    assert step1["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    for key, value in metrics.items():
        assert step1[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    assert {"logps/chosen", "logps/rejected"} <= step1.keys()
    step2 = next(r for r in records if r.get("step") == 2 and "loss" in r)
    assert step2["rewards/margins"] != step1["rewards/margins"]  # the adapters moved
    final = next(r for r in records if "eval_loss" in r)
    assert f"eval DPO loss {final['eval_loss']:.4f} over 1 pairs" in capsys.readouterr().out


def test_what_dpo_does_not_run_with_is_refused(hf_llama, adapter_dir, pairs_dir, tmp_path):
    def problems(**extra) -> str:
        with pytest.raises(ConfigError) as e:
            config.load(None, _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path, **extra))
        return str(e.value)

    assert "parallel.pp=2 with parallel.cp=2" in problems(**{"parallel.pp": 2, "parallel.cp": 2})
    assert "ZeRO-3" in problems(**{"zero.params.shard_over": "global"})
    assert "data.document_mask=true" in problems(**{"data.document_mask": "false"})
    from strata.parallel.runtime import start
    from strata.trainer.jobs import evaluate_checkpoint

    cfg = config.load(None, _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path))
    with pytest.raises(ConfigError, match="strata eval scores the next-token loss"):
        evaluate_checkpoint(cfg, start(), tmp_path, [])


def test_pairs_train_with_dpo_only(hf_llama, adapter_dir, pairs_dir, small_data_dir, tmp_path):
    from strata.parallel.runtime import start
    from strata.trainer.loop import Trainer

    lm = _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path, **{"train.objective": "lm"})
    with pytest.raises(DataError, match="set train.objective=dpo"):
        Trainer(config.load(None, lm), start(), writes=[], saves=False)
    dpo = _overrides(hf_llama, adapter_dir, small_data_dir, tmp_path)
    with pytest.raises(DataError, match="holds none"):
        Trainer(config.load(None, dpo), start(), writes=[], saves=False)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_second_step_keeps_the_first_reference(
    hf_llama, adapter_dir, tok_dir, pairs_dir, tmp_path, lora
):
    """After an update the reference is still the model the run started from: the adapters off,
    or (full fine-tuning) model.init_from's weights. Step 2's loss and rewards from the step-1
    checkpoint's weights as the policy equal plain torch's and TRL's (its ref_model)."""
    from strata.hf.tensor_names import hf_sources
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train

    from worlds import final_params

    extra: dict = {"train.steps": 2, "checkpoint.interval": 1}
    if not lora:
        extra.update({"model.lora.rank": 0, "model.lora.init_from": "null"})
    overrides = _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path, **extra)
    cfg = config.load(None, overrides)
    train(cfg, start())
    records = [
        json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()
    ]
    step2 = next(r for r in records if r.get("step") == 2 and "loss" in r)
    after = final_params(tmp_path / "t" / "checkpoints", 1)
    after = {k.removeprefix("model."): v for k, v in after.items()}
    if lora:
        policy, ref_model = _peft(hf_llama, adapter_dir), None
        values = {to_peft(n): v for n, v in after.items() if ".lora_" in n}
        assert not peft.set_peft_model_state_dict(policy, values).unexpected_keys
    else:
        policy = transformers.LlamaForCausalLM.from_pretrained(hf_llama, dtype=torch.float32)
        ref_model = transformers.LlamaForCausalLM.from_pretrained(hf_llama, dtype=torch.float32)
        state = {hf: after[name] for name, hf in hf_sources(cfg.model).items()}
        policy.load_state_dict(state)
        assert not torch.equal(policy.lm_head.weight, ref_model.lm_head.weight)  # it trained
    pairs = step_pairs(pairs_dir, cfg, step=2)
    loss, metrics, _ = dpo_reference(policy, ref_model, pairs, 0.1, "sigmoid")
    assert metrics["rewards/margins"] != 0
    assert step2["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    for key, value in metrics.items():
        assert step2[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    if not lora:  # TRL's full fine-tuning: a frozen copy of the model it started from
        trl_loss, trl_metrics = trl_dpo(policy, ref_model, tok_dir, pairs, 0.1, "sigmoid", tmp_path)
        assert trl_loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
        for key, value in trl_metrics.items():
            assert value == pytest.approx(metrics[key], rel=1e-5, abs=1e-5), key


@pytest.mark.slow  # `strata train` in one process and in a world of 2
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_full_fine_tuning_in_parallel_logs_what_one_process_does(
    hf_llama, adapter_dir, pairs_dir, tmp_path, layout
):
    """Without adapters each rank keeps its slice of the starting weights as the reference: three
    steps' losses and rewards are one process's."""
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("{}\n")
    full = {"model.lora.rank": 0, "model.lora.init_from": "null", "train.steps": 3}

    def overrides(root: Path, **extra) -> list[str]:
        settings = {**full, **extra}
        return [str(experiment), *_overrides(hf_llama, adapter_dir, pairs_dir, root, **settings)]

    train_world(overrides(tmp_path / "one"), 1, tmp_path / "one")
    train_world(overrides(tmp_path / "par", **LAYOUTS[layout]), 2, tmp_path / "par")
    logged = []
    for root in (tmp_path / "one", tmp_path / "par"):
        lines = (root / "t" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        logged.append({r["step"]: r for r in records if "loss" in r and "step" in r})
    one, par = logged
    assert sorted(one) == sorted(par) == [1, 2, 3]
    assert one[3]["rewards/margins"] != 0  # the policy left the reference
    for step in one:
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert par[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-5), (step, key)


def test_a_resumed_full_fine_tuning_run_keeps_its_first_reference(
    hf_llama, adapter_dir, pairs_dir, tmp_path
):
    """A full fine-tuning run resumed from its step-2 checkpoint rebuilds the reference from
    model.init_from, not from the weights it resumes: its step 3 is the uninterrupted run's."""
    from strata.checkpoint import store
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train

    full = {"model.lora.rank": 0, "model.lora.init_from": "null", "train.steps": 3}
    whole = _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path / "whole", **full)
    train(config.load(None, [*whole, "checkpoint.interval=1"]), start())
    resumed = _overrides(hf_llama, adapter_dir, pairs_dir, tmp_path / "resumed", **full)
    step2 = store.step_dir(tmp_path / "whole" / "t" / "checkpoints", 2)
    train(config.load(None, resumed), start(), resume=step2)
    logged = []
    for root in (tmp_path / "whole", tmp_path / "resumed"):
        lines = (root / "t" / "metrics.jsonl").read_text().splitlines()
        logged.append({r["step"]: r for r in map(json.loads, lines) if "loss" in r and "step" in r})
    want, got = logged
    assert sorted(got) == [3] and abs(want[3]["rewards/margins"]) > 1e-4
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert got[3][key] == pytest.approx(want[3][key], rel=1e-5, abs=1e-6), key
