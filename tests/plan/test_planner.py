"""The planner's pure parts against independent references: parameter shapes against the modules
Strata builds (tensor parallel, pipeline stages, tied embeddings), ZeRO placements against the
shares ZeRO's definitions give, ring traffic against hand-derived byte counts, the search's
ordering on cases whose answer can be reasoned out, and the CLI's errors and warnings.
(Measured memory and step times: test_memory.py, test_timing.py.)"""

from __future__ import annotations

import functools

import pytest
import torch

from strata import config
from strata.lora import apply_lora, is_adapter
from strata.model import GPT
from strata.parallel.pipeline import split_stages
from strata.parallel.tensor import apply_tensor_parallel
from strata.parallel.zero import units_of
from strata.plan import traffic
from strata.plan.cluster import Cluster, Device, cpu_cluster, device_named, preset
from strata.plan.memory import estimate_memory, flat_groups, in_flight, layout_of
from strata.plan.search import search
from strata.plan.shapes import frozen_elements
from strata.plan.timing import estimate_time

from conftest import run_cli
from worlds import REPO, strata

VOCAB = 512


def load(*overrides: str, world: int) -> config.Config:
    return config.load(
        None,
        ["model.d_model=64", "model.n_heads=4", "model.n_layers=4", *overrides],
        world_size=world,
    )


def built_units(cfg: config.Config, pp_rank: int) -> list[int]:
    """Elements of each unit (embedding, blocks, head) of the modules Strata really builds for a
    rank: the model on the meta device, tensor-parallel slicing for tp rank 0, pipeline split."""
    par = cfg.parallel
    with torch.device("meta"):
        model = GPT(cfg.model, VOCAB)
        if par.tp > 1:
            apply_tensor_parallel(model, None, 0, par.tp, sequence_parallel=par.sequence_parallel)
        parts = (
            split_stages(model, pp_rank, par.pp, par.virtual_stages, par.schedule)
            if par.pp > 1
            else [model]
        )
    seen: set[int] = set()
    sizes = []
    for part in parts:
        for unit, modules in units_of(part):
            params = [p for m in modules for p in m.parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            if (
                unit == "head" and cfg.model.tie_embeddings and not hasattr(part, "tok_embeddings")
            ):  # the last stage's copy of a tied embedding has a group of its own
                copy = part.output.weight
                sizes.append(copy.numel())
                params = [p for p in params if p is not copy]
            sizes.append(sum(p.numel() for p in params))
    return sizes


@pytest.mark.parametrize(
    "overrides, world",
    [
        ((), 1),
        (("parallel.tp=2", "model.qkv_bias=true", "model.qk_norm=true", "model.n_kv_heads=2"), 2),
        (("parallel.pp=2", "parallel.virtual_stages=2", "train.micro_batch_size=2"), 2),
        (
            (
                "parallel.pp=2",
                "model.tie_embeddings=true",
                "parallel.tp=2",
                "train.micro_batch_size=4",
            ),
            4,
        ),
    ],
)
def test_flat_groups_hold_the_parameters_strata_builds(overrides, world):
    cfg = load(*overrides, "parallel.bucket_mb=1e-9", world=world)  # one group per unit, as built
    layout = layout_of(cfg, cpu_cluster(1, world))
    for pp_rank in range(cfg.parallel.pp):
        groups = flat_groups(cfg, layout, VOCAB, pp_rank)
        built = built_units(cfg, pp_rank)
        assert sum(g.elements for g in groups) == sum(built)
        assert sorted(g.elements for g in groups if g.elements) == sorted(n for n in built if n)


@pytest.mark.parametrize(
    "overrides, world",
    [
        (("parallel.ep=2",), 2),
        (
            (
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.ep=4",
                "model.moe.shared_expert_gate=true",
            ),
            4,
        ),
        (("parallel.pp=2", "train.micro_batch_size=2"), 2),
    ],
)
def test_moe_flat_groups_hold_each_domains_parameters(overrides, world):
    """Per ZeRO domain, the parameters of an MoE model (a dense first block, shared experts) as
    Strata builds and splits them: experts by ep, attention by tp, routers and shared experts whole."""
    moe = (
        "model.moe.num_experts=4",
        "model.moe.first_dense_layers=1",
        "model.moe.shared_experts=1",
    )
    cfg = load(*moe, *overrides, "parallel.bucket_mb=1e-9", world=world)
    par = cfg.parallel
    with torch.device("meta"):
        model = GPT(cfg.model, VOCAB)
        if par.tp > 1:
            apply_tensor_parallel(model, None, 0, par.tp, sequence_parallel=par.sequence_parallel)
    split = par.ep > 1 or par.tp > 1
    for pp_rank in range(par.pp):
        layers = range(pp_rank * 4 // par.pp, (pp_rank + 1) * 4 // par.pp)
        want: dict[str, int] = {}
        for name, p in model.named_parameters():
            if not name.startswith("layers.") or int(name.split(".")[1]) not in layers:
                continue
            n = p.numel()
            domain = ""
            if ".mlp.experts." in name and split:
                domain, n = "experts", n // par.ep
            elif (".mlp.router." in name or ".mlp.shared." in name) and par.tp > 1:
                domain = "routing"
            want[domain] = want.get(domain, 0) + n
        groups = [
            g
            for g in flat_groups(cfg, layout_of(cfg, cpu_cluster(1, world)), VOCAB, pp_rank)
            if g.layers
        ]
        got: dict[str, int] = {}
        for g in groups:
            got[g.domain] = got.get(g.domain, 0) + g.elements
        assert got == want


@pytest.mark.parametrize(
    "overrides, world",
    [
        ((), 1),
        (("parallel.tp=2", "parallel.sequence_parallel=true", "model.n_kv_heads=2"), 2),
        (("parallel.pp=2", "model.tie_embeddings=true", "train.micro_batch_size=2"), 2),
        (
            (
                "model.moe.num_experts=4",
                "model.moe.first_dense_layers=1",
                "model.moe.shared_experts=1",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
            ),
            2,
        ),
        (
            (
                "zero.params.shard_over=global",
                "zero.grads.shard_over=global",
                "zero.optim.shard_over=global",
                "train.micro_batch_size=4",
            ),
            2,
        ),
    ],
)
def test_lora_flat_groups_hold_the_adapters_and_the_rest_is_frozen(overrides, world):
    """With model.lora the groups are the adapters Strata builds (sharded as tensor parallelism
    shards them; an MoE layer's shared experts' in the routing domain) and the frozen elements the
    rest of the rank's parameters: under ZeRO-3 in frozen groups of their own, else in none."""
    lora = ("model.lora.rank=4", "model.lora.target_modules=[all-linear]")
    cfg = load(*lora, *overrides, "parallel.bucket_mb=1e-9", world=world)
    par = cfg.parallel
    with torch.device("meta"):
        model = GPT(cfg.model, VOCAB)
        apply_lora(model, cfg.model.lora)
        if par.tp > 1:
            apply_tensor_parallel(model, None, 0, par.tp, sequence_parallel=par.sequence_parallel)
        stages = (
            [split_stages(model, r, par.pp, 1, par.schedule) for r in range(par.pp)]
            if par.pp > 1
            else [[model]]
        )
    layout = layout_of(cfg, cpu_cluster(1, world))
    for pp_rank, parts in enumerate(stages):
        adapters: dict[str, int] = {}
        frozen, seen = 0, set()
        for part in parts:
            for name, p in part.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if not is_adapter(name):
                    frozen += p.numel()
                    continue
                domain = "routing" if ".mlp.shared." in name and par.tp > 1 else ""
                adapters[domain] = adapters.get(domain, 0) + p.numel()
        got: dict[str, int] = {}
        groups = flat_groups(cfg, layout, VOCAB, pp_rank)
        for g in groups:
            if not g.frozen:
                got[g.domain] = got.get(g.domain, 0) + g.elements
        assert got == adapters
        assert frozen_elements(cfg, VOCAB, pp_rank) == frozen
        in_groups = sum(g.elements for g in groups if g.frozen)
        assert in_groups == (frozen if cfg.zero.params.shard_over != "none" else 0)


def test_zero_placements_hold_the_shares_zero_defines():
    """dp 8 as 2 nodes × 2 GPUs × 2 GCDs; P = one fp32 copy of the (padded) parameters."""
    cluster = cpu_cluster(2, 4, ranks_per_gpu=2)
    schemes = {  # (params, grads, optim) levels -> held shares of P: params, grads, Adam moments
        ("none", "none", "none"): (1, 1, 2),
        ("none", "none", "global"): (1, 1 + 1 / 8, 2 / 8),
        ("none", "global", "global"): (1, 1 / 8, 2 / 8),
        ("global", "global", "global"): (1 / 8, 1 / 8, 2 / 8),
        ("gpu", "node", "global"): (1 / 2, 1 / 4 + 1 / 8, 2 / 8),
    }
    for (params, grads, optim), shares in schemes.items():
        cfg = load(
            f"zero.params.shard_over={params}",
            f"zero.grads.shard_over={grads}",
            f"zero.optim.shard_over={optim}",
            "parallel.ranks_per_gpu=2",
            "parallel.ranks_per_node=4",
            "train.micro_batch_size=2",
            world=8,
        )
        rank = estimate_memory(cfg, cluster, VOCAB).stage(0)
        p = sum(g.padded for g in flat_groups(cfg, layout_of(cfg, cluster), VOCAB, 0)) * 4
        got = [rank.kind(k, "device") / p for k in ("params", "grads", "optim")]
        assert got == pytest.approx(list(shares)), (params, grads, optim)


def test_pipeline_schedules_keep_the_micro_batches_megatron_counts():
    cluster = cpu_cluster(1, 4)
    one_f_one_b = load(
        "parallel.pp=4", "train.micro_batch_size=1", "train.global_batch_size=8", world=4
    )
    layout = layout_of(one_f_one_b, cluster)
    assert [in_flight(one_f_one_b, layout, r) for r in range(4)] == [4, 3, 2, 1]  # p − rank
    gpipe = config.replace(one_f_one_b, "parallel.schedule", "gpipe")
    assert in_flight(gpipe, layout, 0) == 8  # every micro-batch
    # interleaved, p=4, V=2, rank 0: warm-up (V−1)·p + 2(p−1) = 10 chunk passes, + the one running
    inter = load(
        "parallel.pp=4",
        "parallel.virtual_stages=2",
        "train.micro_batch_size=1",
        "train.global_batch_size=8",
        "model.n_layers=8",
        world=4,
    )
    assert in_flight(inter, layout, 0) == pytest.approx(11 / 2)


def test_ring_traffic_is_what_each_rank_sends():
    """Flat ZeRO-3 on 2 nodes × 2 ranks, one micro-batch: two gathers and a reduce-scatter over
    the ring 0→1→2→3→0, each sending 3/4 of the buffer per rank; edges 1→2 and 3→0 cross nodes."""
    cluster = Cluster(2, 2, device_named("h100"), inter_node_gbps=8.0, intra_node_gbps=8000.0)
    cfg = load(
        "zero.params.shard_over=global",
        "zero.grads.shard_over=global",
        "zero.optim.shard_over=global",
        "zero.hierarchical=false",
        "parallel.ranks_per_node=2",
        "train.micro_batch_size=4",
        "train.global_batch_size=16",
        world=4,
    )
    est = estimate_time(cfg, cluster, VOCAB)
    n = sum(g.padded for g in flat_groups(cfg, layout_of(cfg, cluster), VOCAB, 0)) * 4
    assert est.dp_bytes["inter-node"] == pytest.approx(3 * 0.75 * n / 2)
    assert est.dp_bytes["intra-node"] == pytest.approx(3 * 0.75 * n / 2)
    # node 0's link carries one edge (1→2) of each collective: 3/4 of the buffer at 1 GB/s
    one = traffic.reduce_scatter(cluster, layout_of(cfg, cluster), n, "none", "global", False)
    latency = 3 * cluster.latency_s["inter-node"]
    assert one.seconds == pytest.approx(0.75 * n / 1e9 + latency)


def test_a_slow_network_puts_the_pipeline_across_nodes():
    """Two nodes of two GPUs joined by a 10 Mbit/s link: data parallelism across it moves every
    gradient, a pipeline boundary only a micro-batch's activations, so the best layout splits the
    pipeline between the nodes and keeps tensor or data parallelism inside each (a stage's tp·dp
    ranks, which are consecutive, within one node)."""
    cluster = preset("dgx-a100", 2, gpus_per_node=2, inter_node_gbps=0.01)
    cfg = config.load(
        None,
        [
            "model.d_model=512",
            "model.n_heads=8",
            "model.n_layers=8",
            "train.micro_batch_size=1",
            "train.global_batch_size=16",
        ],
    )
    result = search(cfg, cluster, VOCAB, config.cross_problems)
    best = result.fitting[0].candidate
    assert best.pp >= 2 and 4 // best.pp <= 2, best
    dp_across = [p for p in result.fitting if p.candidate.pp == 1 and p.candidate.tp < 4]
    assert all(p.time.step_s > result.fitting[0].time.step_s * 5 for p in dp_across)


def test_context_parallelism_splits_activations_and_its_exchanges_are_counted():
    """cp ranks hold seq/cp tokens of activations each; the all-to-all sends (cp−1)/cp of q, k, v and
    the output each way, the ring K/V blocks cp−1 times and their gradients cp times; over a slow
    inter-node link the ring outlasts the blocks it hides behind, and a long sequence that fits no
    device whole is found split by `--search`."""
    long = ["model.d_model=1024", "model.n_heads=8", "model.n_layers=4", "model.seq_len=32768"]
    base = config.load(
        None, [*long, "train.micro_batch_size=1", "train.global_batch_size=2", "parallel.cp=1"]
    )
    cluster = preset("dgx-a100", 1, gpus_per_node=8)
    cfgs = {cp: config.replace(base, "parallel.cp", cp) for cp in (1, 4)}
    act = {
        cp: estimate_memory(c, cluster, VOCAB).stage(0).kind("activations", "device")
        for cp, c in cfgs.items()
    }
    assert act[4] == pytest.approx(act[1] / 4, rel=0.01)
    ring = estimate_time(config.replace(cfgs[4], "parallel.cp_mode", "ring"), cluster, VOCAB)
    a2a = estimate_time(config.replace(cfgs[4], "parallel.cp_mode", "alltoall"), cluster, VOCAB)
    tokens, d = 32768 / 4, 1024
    m = 2 // 2  # micro-batches per data-parallel replica: 2 sequences over dp = 8 / 4 = 2 replicas
    kv = tokens * 2 * d * 4  # one rank's K and V, fp32
    want_ring = 4 * m * ((4 - 1) * 2 * kv + 4 * kv)  # layers · (K/V fwd + bwd, their gradients)
    want_a2a = (
        4 * m * 2 * tokens * 4 * d * 4 * 3 / 4
    )  # layers · both ways · q, k, v, out · (cp-1)/cp
    assert sum(ring.link_bytes.values()) - sum(ring.dp_bytes.values()) == pytest.approx(
        want_ring, rel=1e-6
    )
    assert sum(a2a.link_bytes.values()) - sum(a2a.dp_bytes.values()) == pytest.approx(
        want_a2a, rel=1e-6
    )
    slow = preset("dgx-a100", 2, gpus_per_node=2, inter_node_gbps=0.01)
    assert (
        estimate_time(config.replace(cfgs[4], "parallel.cp_mode", "ring"), slow, VOCAB).parts["cp"]
        > 0
    )
    small = Device("small", 4.0, 312.0, 0.8, 2000.0)
    found = search(
        base, preset("dgx-a100", 1, gpus_per_node=4, device=small), VOCAB, config.cross_problems
    )
    assert found.fitting and all(
        p.candidate.cp > 1 or p.candidate.tp > 1 or p.candidate.pp > 1 for p in found.fitting
    )
    assert any(p.candidate.cp > 1 for p in found.fitting)


def test_the_search_rejects_a_family_by_memory_and_says_so():
    """A model whose fp32 state (16 bytes a parameter) exceeds one device unless it is split:
    tp=1 pp=1 without ZeRO cannot fit 1 GiB, and the rejection names memory."""
    cfg = config.load(
        None,
        [
            "model.d_model=1024",
            "model.n_heads=8",
            "model.n_layers=8",
            "train.micro_batch_size=1",
            "train.global_batch_size=2",
            "model.seq_len=256",
        ],
    )
    cluster = preset("dgx-a100", 1, gpus_per_node=2, device=Device("tiny", 1.0, 312.0, 0.8, 2000.0))
    result = search(cfg, cluster, VOCAB, config.cross_problems)
    assert result.fitting, "splitting over two devices should fit"
    assert all(p.memory.peak("device") <= 2**30 for p in result.fitting)
    assert any(
        p.candidate.zero != "none" or p.candidate.tp > 1 or p.candidate.pp > 1
        for p in result.fitting
    )
    single = estimate_memory(
        config.replace(cfg, "parallel.dp", 1), Cluster(1, 1, cluster.device), VOCAB
    )
    assert not single.fits() and "device memory" in single.problems()[0]


def test_plan_prints_memory_and_time_for_the_configs_layout():
    r = strata(
        "plan", "configs/llama2-7b-3d.yaml", "--nodes", "4", "--gpus-per-node", "8", "--gpu", "h100"
    )
    assert r.returncode == 0, r.stderr
    for word in ("activations", "params", "optim", "step", "MFU", "intra-node"):
        assert word in r.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nodes", "4", "--gpus-per-node", "8"], "needs the device"),
        (["--nodes", "4", "--gpus-per-node", "8", "--gpu", "v100"], "not a known device"),
        (["--nodes", "4", "--gpus-per-node", "8", "--tflops", "100"], "--gpu-mem-gb"),
        (
            ["--nodes", "4", "--gpus-per-node", "8", "--gpu", "h100", "--inter-node-gbps", "0"],
            "must be > 0",
        ),
        (["--nodes", "3", "--gpus-per-node", "8", "--gpu", "h100"], "not divisible"),
        (["--nodes", "2", "--calibrate"], "--inter-node-gbps"),
    ],
)
def test_plan_refuses_bad_input_with_one_clear_error(args, says, capsys):
    code, out = run_cli(
        ["plan", str(REPO / "configs" / "llama2-7b-3d.yaml"), *args], capsys
    )  # in this process
    assert code == 2, out
    assert says in out and "Traceback" not in out


def test_a_layout_that_does_not_fit_exits_1_naming_the_tier():
    r = strata(
        "plan",
        "configs/llama2-7b-3d.yaml",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.virtual_stages=1",
        "parallel.schedule=auto",
        "train.micro_batch_size=1",
        "--nodes",
        "32",
        "--gpus-per-node",
        "8",
        "--gpu",
        "a100-40gb",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "does not fit" in r.stdout and "device memory" in r.stdout


def test_config_show_and_launch_warn_when_a_rank_will_not_fit(tmp_path):
    """6.7B parameters at 16 bytes each on this machine's memory: the planner says so before start."""
    big = [
        "model.d_model=4096",
        "model.n_layers=32",
        "model.n_heads=32",
        "model.vocab_size=32000",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
    ]
    r = strata("config", "show", "configs/tiny.yaml", *big, "--world-size", "2")
    assert (
        r.returncode == 0
        and "warning: predicted memory per rank" in r.stderr
        and "strata plan" in r.stderr
    )
    r = strata(
        "launch",
        "configs/tiny.yaml",
        *big,
        f"log.dir={tmp_path}",
        "--slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--no-submit",
    )
    assert r.returncode == 0 and "warning: predicted memory per rank" in r.stderr
    small = strata("config", "show", "configs/tiny.yaml", "--world-size", "2")
    assert small.returncode == 0 and "warning" not in small.stderr


@pytest.mark.slow
def test_calibration_measures_the_rate_this_machine_runs_the_model_at(tmp_path, monkeypatch):
    """The calibrated rate (two ranks computing at once on this machine) against this process's
    own timing of the same model's forward and backward, FLOPs counted as the model's matmuls.
    The measurement writes nothing: no run directory, no checkpoint directory (where it would
    remove the saves in progress of a live run of the same name)."""
    import tempfile
    import time

    from strata.model import lm_loss
    from strata.trainer.calibrate import calibrate_local, executed_flops

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its run would be
    cfg = load("train.micro_batch_size=4", "train.global_batch_size=8", world=2)
    cal = calibrate_local(cfg, VOCAB, ranks=2, seconds=1.0)
    # multiprocessing's own temporary directories (pymp-*) aside
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("pymp-")] == []
    assert cal.intra_node_gbps > 0 and 0 < cal.latency_s < 0.1 and cal.adam_gparams_s > 0
    torch.set_num_threads(1)
    model = GPT(cfg.model, VOCAB)
    model.init_weights(0)
    tokens = torch.randint(0, VOCAB, (4, cfg.model.seq_len))
    lm_loss(model(tokens), tokens).backward()
    start = time.perf_counter()
    for _ in range(3):
        lm_loss(model(tokens), tokens).backward()
    own = executed_flops(cfg, VOCAB, tokens.numel()) / ((time.perf_counter() - start) / 3) / 1e12
    assert 0.3 < cal.device.peak_tflops / own < 3, (cal.device.peak_tflops, own)


def _get(cfg, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


@pytest.mark.slow
def test_search_prints_each_layouts_overrides_and_one_line_per_rejection_reason():
    """configs/llama2-7b-3d.yaml --search on 8 H100s (24 layers, so that some pipeline depths do
    not divide them): each ranked layout comes with the overrides that select it (loading the
    config with them gives that layout), and the families that do not fit are counted by reason,
    one example each, not listed one a line."""
    from strata.plan.report import search_table

    own = ["model.n_layers=24"]
    cfg = config.load(REPO / "configs" / "llama2-7b-3d.yaml", own)
    cluster = Cluster(1, 8, device_named("h100"))
    result = search(cfg, cluster, 32000, config.cross_problems)
    lines = search_table(result, cluster, 3, cfg)
    at = lines.index("overrides that select each (after the config and its own overrides):")
    for i, line in enumerate(lines[at + 1 : at + 4]):
        number, *overrides = line.split()
        assert int(number) == i + 1
        chosen = config.load(REPO / "configs" / "llama2-7b-3d.yaml", own + overrides)
        planned = result.fitting[i]
        for key in planned.candidate.overrides():
            assert _get(chosen, key) == _get(planned.cfg, key), key
    summary = lines[at + 4 :]
    assert len(result.rejected) > len(summary) - 1 >= 1
    assert summary[0].startswith(f"{len(result.rejected)} families")
    assert sum(int(line.split("×")[0]) for line in summary[1:]) == len(result.rejected)
    assert all(", e.g. tp=" in line for line in summary[1:])


def test_search_where_nothing_fits_says_why_in_one_line():
    r = strata(
        "plan",
        "configs/llama2-7b-3d.yaml",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--gpu-mem-gb",
        "4",
        "--tflops",
        "100",
        "--search",
    )
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == "0 of 540 layouts fit."
    assert lines[2] == "6 families (tp, pp, V, ep, cp) with no layout that fits, by reason:"
    assert lines[3].startswith("    6 × memory, e.g. tp=1 pp=1 V=1: even its leanest variant")
    assert len(lines) == 4 and "overrides" not in r.stdout
