"""Tensor parallelism (strata/parallel/tensor.py), with and without sequence parallelism, in real gloo
worlds of 2 and 4 processes (torch.multiprocessing) checked against the single-process model.

One world per size runs every case (process start-up dominates the cost); each rank writes what
it saw to a file: loss, its local gradient of every parameter with the parameter's placement,
the shapes that flowed between blocks, the bytes each collective moved. The tests, in this
process, rebuild the global gradients from the shards by placement and compare them with the
unsharded model's (fp32).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from strata.config import ModelConfig, MoEConfig
from strata.errors import ConfigError
from strata.model import RMSNorm, build_model, lm_loss
from strata.parallel import comm
from strata.parallel.tensor import VocabParallelLoss, apply_tensor_parallel, placement_of

from worlds import join_world, run_world

VOCAB = 128  # no other width of the tiny model equals it (d 32, ffn 96, q 32, kv 16)
BATCH, SEQ = 2, 16
MICRO_BATCHES = 2  # gradients are accumulated over two backward passes, as the trainer does
SEED = 7
WORLD_TIMEOUT_S = 180

QWEN = {"n_kv_heads": 2, "head_dim": 12, "qkv_bias": True, "qk_norm": True}

# name: (tp world size, model settings, sequence_parallel)
CASES = {
    "tp2": (2, {}, False),
    "tp2-sp": (2, {}, True),
    "tp2-gqa-tied": (2, {"n_kv_heads": 2, "tie_embeddings": True}, False),
    "tp2-gqa-tied-sp": (2, {"n_kv_heads": 2, "tie_embeddings": True}, True),
    "tp4": (4, {}, False),
    "tp4-sp": (4, {}, True),
    # Qwen-style attention: q/k/v biases split with their weights, per-head q/k norms replicated,
    # heads wider than d_model/n_heads (4·12 = 48 != 32)
    "tp2-qwen": (2, QWEN, False),
    "tp2-qwen-sp": (2, QWEN, True),
}


def model_config(**kw) -> ModelConfig:
    return ModelConfig(
        **{"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": SEQ, "vocab_size": VOCAB, **kw}
    )


def make_model(settings: dict):
    model = build_model(model_config(**settings), VOCAB, seed=SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    with (
        torch.no_grad()
    ):  # norm weights start at one, biases at zero; randomise them so their use is checked too
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen))
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED + 2)
    return [
        (
            torch.randint(VOCAB, (BATCH, SEQ), generator=gen),
            torch.randint(VOCAB, (BATCH, SEQ), generator=gen),
        )
        for _ in range(MICRO_BATCHES)
    ]


def saved_activation_bytes(step) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves for backward during step()."""
    seen: dict[tuple, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    return out, sum(seen.values())


# --- what each rank runs ------------------------------------------------------------------------


def _tp_case(rank: int, size: int, settings: dict, sp: bool) -> dict:
    model = make_model(settings)
    loss_fn = apply_tensor_parallel(model, dist.group.WORLD, rank, size, sequence_parallel=sp)
    shapes: dict[str, tuple] = {}
    widest: list[int] = []
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, a, i=i: shapes.__setitem__(f"layer{i}", tuple(a[0].shape))
        )
        for i, layer in enumerate(model.layers)
    ]
    hooks.append(
        model.norm.register_forward_pre_hook(
            lambda m, a: shapes.__setitem__("norm", tuple(a[0].shape))
        )
    )
    hooks.append(
        model.output.register_forward_hook(
            lambda m, a, out: shapes.__setitem__("logits", tuple(out.shape))
        )
    )
    hooks += [
        m.register_forward_hook(lambda m, a, out: widest.append(out.shape[-1]))
        for m in model.modules()
    ]

    losses, fwd_bytes, bwd_bytes, act_bytes = [], Counter(), Counter(), []
    for inputs, targets in batches():
        before = Counter(comm.bytes_moved)
        loss, saved = saved_activation_bytes(
            lambda: loss_fn(model(inputs), targets) / MICRO_BATCHES
        )
        mid = Counter(comm.bytes_moved)
        loss.backward()
        fwd_bytes += mid - before
        bwd_bytes += Counter(comm.bytes_moved) - mid
        losses.append(loss.item())
        act_bytes.append(saved)
    for h in hooks:
        h.remove()
    return {
        "loss": sum(losses),
        "grads": {name: (p.grad.clone(), placement_of(p)) for name, p in model.named_parameters()},
        "shapes": shapes,
        "widest": max(widest),
        "fwd_bytes": dict(fwd_bytes),
        "bwd_bytes": dict(bwd_bytes),
        "saved_bytes": act_bytes[0],
    }


def _loss_case(rank: int, size: int) -> dict:
    """VocabParallelLoss alone on a shard of random, large-magnitude full logits."""
    gen = torch.Generator().manual_seed(SEED + 3)
    logits = 30 * torch.randn(BATCH, SEQ, VOCAB, generator=gen)
    targets = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
    shard = logits.chunk(size, dim=-1)[rank].clone().requires_grad_()
    loss = VocabParallelLoss(dist.group.WORLD, rank)(shard, targets)
    loss.backward()
    return {"loss": loss.item(), "grad": shard.grad}


def _worker(rank: int, size: int, port: int, out_dir: str, cases: list[str]) -> None:
    join_world(rank, size, port)
    try:
        results = {name: _tp_case(rank, size, CASES[name][1], CASES[name][2]) for name in cases}
        results["loss-only"] = _loss_case(rank, size)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, list[dict]]:
    """Per world size, every rank's results (one world per size for all its cases)."""
    out = {}
    for size in sorted({c[0] for c in CASES.values()}):
        out_dir = tmp_path_factory.mktemp(f"tp{size}")
        out[size] = run_world(
            _worker,
            size,
            out_dir,
            [n for n, c in CASES.items() if c[0] == size],
            timeout_s=WORLD_TIMEOUT_S,
        )
    return out


def reference(settings: dict) -> dict:
    """The unsharded model's accumulated loss and gradients on the same micro-batches."""
    model, total = make_model(settings), 0.0
    for inputs, targets in batches():
        loss = lm_loss(model(inputs), targets) / MICRO_BATCHES
        loss.backward()
        total += loss.item()
    return {"loss": total, "grads": {n: p.grad for n, p in model.named_parameters()}}


def assemble(ranks: list[dict], name: str) -> dict[str, torch.Tensor]:
    """Global gradients from the ranks' local ones, by each parameter's placement. Replicated
    parameters must have the same gradient on every rank."""
    out = {}
    for key, (grad, placement) in ranks[0][name]["grads"].items():
        local = [r[name]["grads"][key] for r in ranks]
        if placement.shard_dim is not None:  # rank i holds shard i of the same global tensor
            assert [pl for _, pl in local] == [
                dataclasses.replace(placement, shard_index=i) for i in range(len(ranks))
            ], key
        if placement.shard_dim is None:
            assert all(pl == placement for _, pl in local), key
            for g, _ in local[1:]:
                torch.testing.assert_close(
                    g, grad, rtol=0, atol=0, msg=lambda m: f"{key} differs across ranks: {m}"
                )
            out[key] = grad
        else:
            out[key] = torch.cat([g for g, _ in local], dim=placement.shard_dim)
            assert tuple(out[key].shape) == placement.global_shape, key
    return out


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_match_single_process(worlds, name):
    size, settings, sp = CASES[name]
    ranks, ref = worlds[size], reference(settings)
    for r in ranks:
        assert r[name]["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-6)
    grads = assemble(ranks, name)
    assert grads.keys() == ref["grads"].keys()
    for key, g in ref["grads"].items():
        torch.testing.assert_close(
            grads[key], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {key}: {m}"
        )


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
@pytest.mark.parametrize("name", list(CASES))
def test_no_rank_materialises_full_vocab_logits(worlds, name):
    size = CASES[name][0]
    for r in worlds[size]:
        assert r[name]["shapes"]["logits"] == (BATCH, SEQ, VOCAB // size)
        assert r[name]["widest"] < VOCAB  # no module's output anywhere is vocabulary-wide


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
@pytest.mark.parametrize("name", list(CASES))
def test_sequence_parallel_shards_activations_between_blocks(worlds, name):
    size, settings, sp = CASES[name]
    seq = SEQ // size if sp else SEQ
    for r in worlds[size]:
        shapes = r[name]["shapes"]
        assert [shapes[f"layer{i}"] for i in range(2)] == [(BATCH, seq, 32)] * 2
        assert shapes["norm"] == (BATCH, seq, 32)
    if sp:  # and autograd keeps less for backward than plain tp does (norm inputs, residuals)
        plain = name.removesuffix("-sp")
        assert worlds[size][0][name]["saved_bytes"] < worlds[size][0][plain]["saved_bytes"]


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
@pytest.mark.parametrize("name", list(CASES))
def test_collectives_per_step(worlds, name):
    """Bytes by collective in the step's forwards and backwards (fp32, per rank). Plain tp
    all-reduces the embedding and each row-parallel output forward, and backward the input
    gradient of each tensor-parallel region once: after attn_norm (shared by wq/wk/wv), after
    mlp_norm (shared by w1/w3), and before the output layer. With sp: one reduce-scatter /
    all-gather pair instead of each all-reduce, and the norm weights' gradients all-reduced. The
    per-head q/k norms' gradients are all-reduced in every case (each rank sees only its heads)."""
    size, settings, sp = CASES[name]
    layers, d, tokens = 2, 32, BATCH * SEQ
    qk_norms = (
        MICRO_BATCHES * layers * 2 * 4 * settings["head_dim"] if settings.get("qk_norm") else 0
    )
    act = MICRO_BATCHES * 4 * tokens * d  # one full (batch, seq, d) fp32 activation per micro-batch
    loss = MICRO_BATCHES * 3 * 4 * tokens  # vocab-parallel CE: max, target logit, sum of exp
    for r in worlds[size]:
        fwd, bwd = r[name]["fwd_bytes"], r[name]["bwd_bytes"]
        if sp:
            assert fwd == {
                ("tp", "reduce_scatter"): (2 * layers + 1) * act,
                ("tp", "all_gather"): (2 * layers + 1) * act // size,
                ("tp", "all_reduce"): loss,
            }
            assert bwd == {
                ("tp", "reduce_scatter"): (2 * layers + 1) * act,
                ("tp", "all_gather"): (2 * layers + 1) * act // size,
                ("tp", "all_reduce"): MICRO_BATCHES * (2 * layers + 1) * 4 * d + qk_norms,
            }
        else:
            assert fwd == {("tp", "all_reduce"): (2 * layers + 1) * act + loss}
            assert bwd == {("tp", "all_reduce"): (2 * layers + 1) * act + qk_norms}


@pytest.mark.slow  # the `worlds` fixture: 2- and 4-process gloo worlds
@pytest.mark.parametrize("size", [2, 4])
def test_vocab_parallel_loss_equals_cross_entropy(worlds, size):
    gen = torch.Generator().manual_seed(SEED + 3)
    logits = (30 * torch.randn(BATCH, SEQ, VOCAB, generator=gen)).requires_grad_()
    targets = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    expected.backward()
    ranks = [r["loss-only"] for r in worlds[size]]
    for r in ranks:
        assert r["loss"] == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(
        torch.cat([r["grad"] for r in ranks], dim=-1), logits.grad, rtol=1e-5, atol=1e-7
    )


def test_sequence_parallel_rejects_indivisible_sequence():
    model = build_model(model_config(seq_len=15), VOCAB, seed=SEED)
    with pytest.raises(ConfigError, match="seq_len=15"):
        apply_tensor_parallel(model, None, 0, 2, sequence_parallel=True)


def test_tensor_parallel_refuses_with_the_configs_own_rules():
    """The layers state no divisibility rule of their own: they refuse what the config's checks
    refuse (`strata.config.vocabulary`), every problem at once, in the config's words."""
    model = build_model(model_config(n_heads=4, ffn_hidden=100), VOCAB, seed=SEED)
    with pytest.raises(ConfigError) as err:
        apply_tensor_parallel(model, None, 0, 3)
    assert err.value.problems == [
        "parallel.tp=3 must divide model.n_heads=4",
        "parallel.tp=3 must divide model.ffn_hidden=100",
        "parallel.tp=3 must divide model.vocab_size=128",
    ]
    moe = build_model(
        model_config(moe=MoEConfig(num_experts=4, top_k=2, expert_ffn=8)), VOCAB, seed=SEED
    )
    with pytest.raises(
        ConfigError, match=r"MoE layers with parallel.tp=2 need .*sequence_parallel"
    ):
        apply_tensor_parallel(moe, None, 0, 2)
