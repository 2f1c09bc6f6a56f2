"""`strata plan`'s step-time model against published training throughputs: the weak-scaling table of
Megatron-LM on DGX A100 (Narayanan et al., SC'21, Table 1), the Frontier runs of Dash et al. (arXiv
2312.12705), Megatron-LM's H100 weak-scaling table and torchtitan's Llama 3.1 runs on H100. Each
published run is written as a Strata config (`strata.config.load` with overrides), a `Cluster` of
the machine it ran on and the `Engine` of the framework that ran it (what a config cannot say: which
collectives it overlaps, its attention and element-wise kernels, its selective recomputation);
`strata.plan.timing.estimate_time` predicts its step, and the table compares the predicted
throughput with the published one in the publication's own FLOP counting.

    python bench/plan_published.py              # the markdown table (pure arithmetic, under a second)
    python bench/plan_published.py --parts      # also each prediction's parts (seconds per step)

`tests/plan/test_timing_published.py` asserts, for every row marked `asserted` (all of them; the two
Frontier rows in its MISSES are expected to fail), that the prediction is within 25 % of the
published figure.

Sources (every figure below is copied from one of these; none is fitted)
------------------------------------------------------------------------
[M1] D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
     Megatron-LM", SC'21, arXiv 2104.04473, Table 1 (weak scaling, 1.7B ... 1T). Cross-checked
     against NVIDIA's own copy of the table, `images/cases_april2021.png` in NVIDIA/Megatron-LM
     (README until commit f2e5db402c, 2024-07-15): per row params (B), hidden size, layers,
     model-parallel size t·p, GPUs, batch size, achieved teraFLOP/s per GPU, % of peak, aggregate
     petaFLOP/s — all equal to the paper's. Three independent transcriptions of the paper's table
     (stored notes on GitHub) give the same numbers and the attention heads and the t/p split.
[M2] NVIDIA/Megatron-LM `examples/sc21/run_table_1.sh` (now examples/academic_paper_scripts/sc21/):
     the scripts that produced Table 1. Per row: TP, PP, micro-batch size (MBS 16, 16, 16, 8, 4, 2,
     2, 1, 1, 1 — not 1 in most rows), global batch, layers, hidden, heads, DDP implementation
     (torch for 1.7B-18B, Megatron's `local` for 39B-1T) and `--num-layers-per-virtual-pipeline-
     stage` (76B: 5, 145B: 5, 310B: 3, 530B: 1, i.e. V = 3, 2, 2, 3 interleaved chunks; 1T: not
     interleaved). Every row: full activation recomputation (`--recompute-method uniform`,
     older revision `--activations-checkpoint-method uniform`). `CONFIG.sh`: `--seq-length 2048`,
     `--fp16`, vocabulary from the GPT-2 BPE files; the paper and the README give vocab 51,200
     (a multiple of 128·8, so Megatron pads nothing).
[M3] The paper's FLOP count (eq. 3, sec. 5.1): F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per
     iteration — four passes over each transformer layer (forward, recomputed forward, backward =
     2 forwards) and three over the output layer. "Achieved teraFLOP/s per GPU" = F / (iteration
     time · GPUs), measured end to end (data loading, optimizer, logging included). Peak: A100
     312 TFLOP/s (16-bit). Hardware: DGX A100 (Selene), 8 × A100 80 GB per node, NVLink 3 /
     NVSwitch (600 GB/s bidirectional per GPU, so 300 GB/s = 2400 Gbit/s each way), 8 × 200 Gbit/s
     HDR InfiniBand per node (1600 Gbit/s one way per node).
[F1] S. Dash et al., "Optimizing Distributed Training on Frontier for Large Language Models",
     arXiv 2312.12705 (2023), abstract (stored copies: the paper's abstract as indexed, and notes
     on it): "For 22 Billion, 175 Billion, and 1 Trillion parameters, we achieved GPU throughputs
     of 38.38 %, 36.14 %, and 31.96 %, respectively. For the training of the 175 Billion parameter
     model and the 1 Trillion parameter model, we achieved 100 % weak scaling efficiency on 1024 and
     3072 MI250X GPUs" (the paper counts each GCD as a GPU: 8 per node, so 128 and 384 nodes);
     strong scaling 89 % and 87 %. The paper's body (its configuration table) is NOT in the stored
     material; the layouts below come from [F2].
[F2] The authors' own public launch scripts, github.com/sajal-vt/Megatron-DeepSpeed-ORNL (branch FA2:
     launch_gpt22b_bf16.slurm, launch_gpt175b_bf16.slurm, launch_gpt1T_bf16.slurm, ds_config_*.json;
     main: launch_gpt175b_tflops_149.slurm and its log gpt175b_megatron_16N_newcomm-405287.o):
       22B: 48 layers, h 6144, 48 heads, seq 2048, TP 1, PP 8, MBS 1, GBS 640 on 2 nodes (DP 2),
            ZeRO stage 0, flash-attention 2, activation checkpointing, fp16.
       175B: 96 layers, h 12288, 96 heads, seq 2048, TP 4, PP 16, MBS 1, ZeRO-1 (ds_config stage 1),
            flash attention, activation checkpointing, fp16; GBS 1280 on 16 nodes (DP 2) in the
            verification run, whose log reports 149-150 "TFLOPs" per GCD (Megatron-DeepSpeed's
            `throughput_calculator`: eq. 3 of [M3] with the factor 4 for checkpointing, divided by
            world size = GCDs) at 195 s per iteration.
       1T:  128 layers, h 25600, 200 heads, seq 2048, TP 4, PP 128, MBS 1, GBS 1024 on 128 nodes
            (DP 2), ZeRO-1, flash-attention 2, activation checkpointing, bf16.
     Vocabulary: GPT-2 BPE (50,257), which Megatron pads to a multiple of 128·TP (50,304 at TP 1,
     50,688 at TP 4). Whether the paper's own figures used exactly these settings cannot be
     checked here: its configuration table is not stored.
[F3] Hardware (figures as given for this bench; no stored copy of the OLCF user guide was read): 4
     MI250X = 8 GCDs per node; peak 191.5 TFLOP/s fp16/bf16 dense per GCD (383 per MI250X); the two GCDs of
     one MI250X are joined by Infinity Fabric at 200 GB/s (1600 Gbit/s) each way, GCDs of different
     GPUs by 50-100 GB/s links (400 Gbit/s taken, the single-link figure); 4 × 25 GB/s Slingshot-11
     NICs per node (800 Gbit/s one way per node).
[H1] NVIDIA/Megatron-LM README and `images/model_table.png` (commit f2e5db402c, 2024-07-15, "New
     scaling figures on H100 GPUs"): GPT models 1.7B-462B, vocab 131,072, seq 4096, with the DP,
     TP and PP comm overlaps on; per row heads, hidden, layers, TP, PP, DP (48), GPUs, batch,
     per-GPU teraFLOP/s, MFU (= per-GPU TFLOP/s / 989). Megatron-core's count
     (`num_floating_point_operations`) is the model's: 3 passes, no recomputation. What the
     overlaps imply, from Megatron-LM's own argument checks (megatron/training/arguments.py):
     `--tp-comm-overlap` needs `--sequence-parallel`; `--overlap-param-gather` needs the
     distributed optimizer (optimizer state sharded over DP) and `--overlap-grad-reduce`; PP
     communication overlap runs only with the interleaved schedule (set off otherwise); bf16 runs
     reduce gradients in fp32. Micro-batch size, recomputation, virtual stages and precision are
     NOT published: these rows use no recomputation, bf16, one layer per virtual stage (the only
     V > 1 the 119B's 23 and the 462B's 7 layers per stage allow), and MBS = a replica's whole
     batch of 4 at pp 1 (which fits: Megatron's 34·s·b·h/t activation bytes per layer) and 1 at
     pp > 1; each row's note says so.
[T1] pytorch/torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (torch 1963fc8, torchtitan
     9dec370, 2024-12): Llama 3.1 8B, 70B, 405B on Grand Teton hosts (8 H100 SXM with 96 GB HBM2e
     at a 500 W power limit, NVLink, 400 Gbit/s RDMA per GPU); tokens/s per GPU at the 90th
     iteration. Table 1: 8B on 8 GPUs, FSDP, local batch 2 (global 16), selective activation
     checkpointing: 5,762 (FSDP), 6,667 (+ torch.compile), 8,532 (+ Float8). Table 3: the same on
     128 GPUs (global 256): 5,605, 6,514, 8,380. Table 4: 70B on 256 GPUs, FSDP 32 × TP 8,
     compile + Float8, local batch 16 (global 512), full checkpointing: 829 (876 with async TP).
     Table 5: 405B on 512 GPUs, FSDP 8 × TP 8 × PP 8, compile + Float8 + async TP, local batch 32
     (global 256), full checkpointing: 100 (1F1B), 128 (interleaved 1F1B). The page: "the 1D
     Llama 3.1 8B model training on 8 or 128 H100 GPUs without Float8 achieves 33% to 39% MFU".
     Sequence length: torchtitan's llama3 training configs' 8192 (not on the page itself).
     From torchtitan's code of that time: its selective checkpointing ("op", the 8B configs')
     saves every matmul's output but every second one; its pipeline splits a replica's batch into
     as many micro-batches as there are stages; FSDP2 gathers bf16 parameters and reduces fp32
     gradients, and under torch's pipeline schedules gathers once per step and reduces after the
     last micro-batch.

What the Frontier percentages mean (the one figure here that is not certain)
-----------------------------------------------------------------------------
The abstract's "GPU throughput" percentages are taken, as the brief states, against the per-GCD peak
(191.5 TFLOP/s) in Megatron-DeepSpeed's counting (with the recomputed forward): 38.38 % → 73.5,
36.14 % → 69.2, 31.96 % → 61.2 TFLOP/s per GCD. The authors' own 16-node 175B log [F2] reports 149-150
TFLOP/s per GCD in that same counting, about twice 69.2 and 78 % of a GCD's peak (above what a GCD's
bf16 GEMMs sustain: 127-147 TFLOP/s measured, stas00/ml-engineering issue 76); 36.14 % of a whole
MI250X (383) would be 138. So either the
paper's percentages are per MI250X of per-GCD figures, or the 16-node log is not representative.
This bench keeps the per-GCD reading and says so in its table; the difference is a factor of two.

Conversions: comparing like with like
-------------------------------------
Strata's model is a Llama-style block (SwiGLU: three d×f matrices; RoPE, RMSNorm); the published
models are GPT (two d×4d matrices). `model.ffn_hidden` = 8d/3, rounded to a multiple of TP, gives the
same MLP FLOPs (3·d·8d/3 = 2·d·4d; the rounding changes them by < 0.01 %); with q = kv = d the
attention projections, scores and output layer are the same matmuls, so `strata.model.flops_per_token`
equals Megatron's model count 72·s·l·h²·(1 + s/(6h)) + 6·s·h·V per sequence. Biases, position
embeddings and norms are not matmuls and are counted by neither.

A published per-GPU rate X in counting F_pub (eq. 3 with 4 passes for [M1]/[F1], 3 passes for [H1])
fixes the published step time, t_pub = F_pub / (X · GPUs). The comparison is of step times:
predicted / published throughput = t_pub / t_pred, i.e. the prediction expressed in the publication's
counting, F_pub / (t_pred · GPUs), against X. The table also gives both MFUs (model FLOPs, no
recomputation, over the device's peak): published F_model / (t_pub · GPUs · peak) and the model's
`TimeEstimate.mfu`.

What a config cannot say: fp16 runs are modelled as bf16 (same peak); Megatron's `local` DDP (39B-1T)
reduced gradients after the last backward, hence `parallel.overlap_grad_reduce=false` on those rows;
Megatron 2021 had no sequence parallelism (`parallel.sequence_parallel=false`); flash attention
([F2]) is not a setting (the model counts causal attention's executed FLOPs either way). The rest
is the engine's (strata.plan.engines): Megatron's fused element-wise kernels, Megatron-core's
chunked TP overlap and parameter-gather overlap with bf16 gathers, torchtitan's async TP and its
selective checkpointing. The H100 rows' devices: DGX H100 at 700 W for Megatron-LM, Grand Teton's
H100s held to 500 W for torchtitan (`strata.plan.cluster.power_capped`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from strata import config as config_mod
from strata.config import Config
from strata.model import flops_per_token
from strata.plan.cluster import PRESETS, Cluster, preset
from strata.plan.engines import Engine
from strata.plan.timing import TimeEstimate, estimate_time

TOLERANCE = 0.25  # the test's bound on |predicted / published - 1|

# The frameworks, as far as a Strata config cannot say how they ran ([M2], [H1], [F2], [T1]):
# Megatron-LM of 2021 before flash attention, nothing of TP overlapped; Megatron-DeepSpeed on
# Frontier (flash attention, no TP overlap); Megatron-core on H100 with its TP, DP and PP overlaps
# on (--tp-comm-overlap, --overlap-grad-reduce, --overlap-param-gather); torchtitan's FSDP2, with
# or without async TP.
MEGATRON_2021 = Engine("megatron-lm 2021", attention="unfused", fused_elementwise=True)
MEGATRON_DEEPSPEED = Engine("megatron-deepspeed", fused_elementwise=True)
MEGATRON_CORE = Engine(
    "megatron-core",
    tp_comm_overlap=True,
    param_gather_overlap=True,
    param_bytes=2,
    fused_elementwise=True,
)
# FSDP2 gathers the bf16 parameter dtype, each layer's just before its forward with the next one's
# prefetched; the op-level selective checkpointing saves every matmul's output but every second
# one of a block's (wq wk wv wo w1 w3 w2: wk, wo, w3)
TITAN_SAC = ("wk", "wo", "w3")
TORCHTITAN = Engine(
    "torchtitan", param_gather_overlap=True, param_bytes=2, selective_recompute=TITAN_SAC
)
TORCHTITAN_ASYNC_TP = Engine(
    "torchtitan async TP",
    tp_comm_overlap=True,
    param_gather_overlap=True,
    param_bytes=2,
    selective_recompute=TITAN_SAC,
)


# The machines are the planner's own systems (strata.plan.cluster.PRESETS), whose figures
# are the ones the sources give: dgx-a100 [M3] (NVLink 3 300 GB/s per GPU each way, 8 × 200 Gbit/s
# HDR per node), dgx-h100 [H1] (NVLink 4 450 GB/s, 8 × 400 Gbit/s NDR), frontier [F3] (4 MI250X = 8
# GCDs; 200 GB/s GCD-GCD in a GPU, 50 GB/s between GPUs, 4 × 25 GB/s NICs).


@dataclass(frozen=True)
class Run:
    """One published training run: the model, the layout, the batch, and the figure reported."""

    name: str
    source: str
    system: str
    ranks: int  # GPUs on DGX, GCDs on Frontier
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int  # as Megatron padded it
    tp: int
    pp: int
    virtual: int
    micro: int
    batch: int
    recompute: bool
    published_tflops: float  # per rank, in the source's counting
    published_pct: float  # of peak, as the source prints it
    counted_passes: (
        int  # passes over each transformer layer in the source's count: 4 (recompute) or 3
    )
    overlap_grad_reduce: bool = True
    zero1: bool = False
    sequence_parallel: bool = False
    engine: Engine = MEGATRON_DEEPSPEED  # how the framework ran what a config cannot say
    asserted: bool = True
    note: str = ""


def _megatron_a100(
    name: str, layers: int, hidden: int, heads: int, tp: int, pp: int, v: int, mbs: int, gpus: int, batch: int,
    tflops: float, pct: float, ddp: str,
) -> Run:  # fmt: skip
    return Run(
        name=name,
        source="M1 T1",
        system="dgx-a100",
        ranks=gpus,
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=2048,
        vocab=51200,
        tp=tp,
        pp=pp,
        virtual=v,
        micro=mbs,
        batch=batch,
        recompute=True,
        published_tflops=tflops,
        published_pct=pct,
        counted_passes=4,
        overlap_grad_reduce=ddp == "torch",
        engine=MEGATRON_2021,
    )


# [M1] Table 1 with [M2]'s micro-batch sizes, DDP implementation and virtual stages.
MEGATRON_A100: list[Run] = [
    _megatron_a100("1.7B", 24, 2304, 24, 1, 1, 1, 16, 32, 512, 137, 44, "torch"),
    _megatron_a100("3.6B", 30, 3072, 32, 2, 1, 1, 16, 64, 512, 138, 44, "torch"),
    _megatron_a100("7.5B", 36, 4096, 32, 4, 1, 1, 16, 128, 512, 142, 46, "torch"),
    _megatron_a100("18.4B", 40, 6144, 48, 8, 1, 1, 8, 256, 1024, 135, 43, "torch"),
    _megatron_a100("39.1B", 48, 8192, 64, 8, 2, 1, 4, 512, 1536, 138, 44, "local"),
    _megatron_a100("76.1B", 60, 10240, 80, 8, 4, 3, 2, 1024, 1792, 140, 45, "local"),
    _megatron_a100("145.6B", 80, 12288, 96, 8, 8, 2, 2, 1536, 2304, 148, 47, "local"),
    _megatron_a100("310.1B", 96, 16384, 128, 8, 16, 2, 1, 1920, 2160, 155, 50, "local"),
    _megatron_a100("529.6B", 105, 20480, 128, 8, 35, 3, 1, 2520, 2520, 163, 52, "local"),
    _megatron_a100("1008B", 128, 25600, 160, 8, 64, 1, 1, 3072, 3072, 163, 52, "local"),
]

FRONTIER_PEAK = 191.5  # [F3] per GCD

# [F1] percentages, [F2] layouts. GCD counts: 175B and 1T as [F1] states them (1024, 3072), with the
# global batch grown with data parallelism as in weak scaling (per replica as in [F2]'s runs); 22B:
# [F2]'s 2-node run (the scale of the paper's 22B figure is not in the stored material).
FRONTIER: list[Run] = [
    Run(
        name="22B",
        source="F1 abs. / F2",
        system="frontier",
        ranks=16,
        layers=48,
        hidden=6144,
        heads=48,
        seq=2048,
        vocab=50304,
        tp=1,
        pp=8,
        virtual=1,
        micro=1,
        batch=640,
        recompute=True,
        published_tflops=0.3838 * FRONTIER_PEAK,
        published_pct=38.38,
        counted_passes=4,
        engine=MEGATRON_DEEPSPEED,
        note="GCD count of the paper's 22B figure unknown; [F2]'s 2 nodes",
    ),
    Run(
        name="175B",
        source="F1 abs. / F2",
        system="frontier",
        ranks=1024,
        layers=96,
        hidden=12288,
        heads=96,
        seq=2048,
        vocab=50688,
        tp=4,
        pp=16,
        virtual=1,
        micro=1,
        batch=640 * 16,
        recompute=True,
        published_tflops=0.3614 * FRONTIER_PEAK,
        published_pct=36.14,
        counted_passes=4,
        zero1=True,
        engine=MEGATRON_DEEPSPEED,
        note="global batch: [F2]'s 640 per replica × DP 16 (the paper's not stored)",
    ),
    Run(
        name="1T",
        source="F1 abs. / F2",
        system="frontier",
        ranks=3072,
        layers=128,
        hidden=25600,
        heads=200,
        seq=2048,
        vocab=50688,
        tp=4,
        pp=128,
        virtual=1,
        micro=1,
        batch=512 * 6,
        recompute=True,
        published_tflops=0.3196 * FRONTIER_PEAK,
        published_pct=31.96,
        counted_passes=4,
        zero1=True,
        engine=MEGATRON_DEEPSPEED,
        note="global batch: [F2]'s 512 per replica × DP 6 (the paper's not stored)",
    ),
]


def _megatron_h100(
    name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
    tflops: float, mfu: int,
) -> Run:  # fmt: skip
    # Not published ([H1]): at pp 1 a replica's sequences as one micro-batch (with SP and flash
    # attention Megatron's 34·s·b·h/t activation bytes per layer keep 4 sequences under 35 GB); at
    # pp > 1 one sequence, the interleaved schedule keeping about pp in flight. PP communication
    # overlap runs only interleaved: one layer per virtual stage, the only V > 1 that divides the
    # 119B's 23 and the 462B's 7 layers per stage.
    micro = batch // (gpus // (tp * pp)) if pp == 1 else 1
    virtual = layers // pp if pp > 1 else 1
    return Run(
        name=name,
        source="H1",
        system="dgx-h100",
        ranks=gpus,
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=4096,
        vocab=131072,
        tp=tp,
        pp=pp,
        virtual=virtual,
        micro=micro,
        batch=batch,
        recompute=False,
        published_tflops=tflops,
        published_pct=mfu,
        counted_passes=3,
        zero1=True,  # --overlap-param-gather runs only with the distributed optimizer
        sequence_parallel=tp > 1,  # --tp-comm-overlap runs only with sequence parallelism
        engine=MEGATRON_CORE,
        note=f"not published, assumed: MBS {micro}, V {virtual}, no recomputation, bf16",
    )


# [H1], transcribed from images/model_table.png.
MEGATRON_H100: list[Run] = [
    _megatron_h100("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 41),
    _megatron_h100("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 47),
    _megatron_h100("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 49),
    _megatron_h100("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 46),
    _megatron_h100("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 42),
    _megatron_h100("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 43),
    _megatron_h100("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 44),
    _megatron_h100("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 48),
    _megatron_h100("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 47),
]

RUNS: list[Run] = MEGATRON_A100 + FRONTIER + MEGATRON_H100


@dataclass(frozen=True)
class TokensRun:
    """A published run given as tokens/s per GPU (torchtitan's figure [T1]): the model and layout
    as Strata overrides, the GPUs, the published rate."""

    name: str
    source: str
    gpus: int
    overrides: tuple[str, ...]
    published_tps: float
    engine: Engine = TORCHTITAN
    asserted: bool = True
    note: str = ""


LLAMA31 = {
    "8B": ("model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.ffn_hidden=14336"),
    "70B": ("model.n_layers=80", "model.d_model=8192", "model.n_heads=64", "model.ffn_hidden=28672"),
    # 126 layers, which 8 stages of torchtitan's (uneven) pipeline split: 128 here, balanced
    "405B": ("model.n_layers=128", "model.d_model=16384", "model.n_heads=128", "model.ffn_hidden=53248"),
}  # fmt: skip
LLAMA31_COMMON = (
    "model.n_kv_heads=8",
    "model.vocab_size=128256",
    "model.seq_len=8192",
    "train.precision=bf16",
)
FSDP = ("zero.params.shard_over=global", "zero.grads.shard_over=global", "zero.optim.shard_over=global")  # fmt: skip


def _titan(
    name: str, model: str, gpus: int, layout: tuple[str, ...], tps: float,
    engine: Engine = TORCHTITAN, note: str = "", shard: tuple[str, ...] = FSDP,
) -> TokensRun:  # fmt: skip
    overrides = LLAMA31[model] + LLAMA31_COMMON + shard + layout
    return TokensRun(name, "T1", gpus, overrides, tps, engine=engine, note=note)


EIGHT_B = ("train.micro_batch_size=2", "activations.recompute=selective")
COMPILED = ("train.compile=true",)
FP8 = ("train.precision=fp8", "train.compile=true")
FP8_NOTE = "float8: the blocks' linear layers at the float8 rate, tensor-wise casts"
SEVENTY_B = (
    "parallel.tp=8",
    "parallel.sequence_parallel=true",
    "train.global_batch_size=512",
    "train.micro_batch_size=16",
    "activations.recompute=full",
) + FP8
# Under torch's pipeline schedules FSDP gathers a stage's parameters once per step and reduces its
# gradients once, after the last micro-batch: ZeRO-1's collectives (the memory is not modelled here)
PIPELINED_FSDP = ("zero.optim.shard_over=global",)
# torchtitan splits a replica's 32 sequences into as many micro-batches as the pipeline has stages
# (its default): 8 of 4 sequences under 1F1B, 16 of 2 with two stages per rank
FOUR_O_FIVE_B = (
    "parallel.tp=8",
    "parallel.pp=8",
    "parallel.sequence_parallel=true",
    "train.global_batch_size=256",
    "activations.recompute=full",
) + FP8
ON_8 = EIGHT_B + ("train.global_batch_size=16",)
ON_128 = EIGHT_B + ("train.global_batch_size=256",)
TORCHTITAN_H100: list[TokensRun] = [
    _titan("8B FSDP", "8B", 8, ON_8, 5762),
    _titan("8B FSDP+compile", "8B", 8, ON_8 + COMPILED, 6667),
    _titan("8B FSDP+compile+fp8", "8B", 8, ON_8 + FP8, 8532, note=FP8_NOTE),
    _titan("8B FSDP", "8B", 128, ON_128, 5605),
    _titan("8B FSDP+compile", "8B", 128, ON_128 + COMPILED, 6514),
    _titan("8B FSDP+compile+fp8", "8B", 128, ON_128 + FP8, 8380, note=FP8_NOTE),
    _titan("70B FSDP×TP8+compile+fp8", "70B", 256, SEVENTY_B, 829, note=FP8_NOTE),
    _titan(
        "70B FSDP×TP8+compile+fp8+async TP", "70B", 256, SEVENTY_B, 876, TORCHTITAN_ASYNC_TP,
        FP8_NOTE,
    ),
    _titan(
        "405B FSDP×TP8×PP8 1F1B+fp8+async TP", "405B", 512,
        FOUR_O_FIVE_B + ("train.micro_batch_size=4",), 100, TORCHTITAN_ASYNC_TP,
        f"{FP8_NOTE}; 128 layers for 126; 8 micro-batches of 4 (torchtitan's default)",
        PIPELINED_FSDP,
    ),
    _titan(
        "405B FSDP×TP8×PP8 interleaved+fp8+async TP", "405B", 512,
        FOUR_O_FIVE_B + ("parallel.virtual_stages=2", "train.micro_batch_size=2"), 128,
        TORCHTITAN_ASYNC_TP,
        f"{FP8_NOTE}; 128 layers for 126; V = 2 assumed (not on the page), so 16 micro-batches "
        "of 2 (torchtitan's default)",
        PIPELINED_FSDP,
    ),
]  # fmt: skip


@dataclass(frozen=True)
class TokensComparison:
    run: TokensRun
    estimate: TimeEstimate
    predicted_tps: float

    @property
    def ratio(self) -> float:
        """Predicted tokens/s / published tokens/s."""
        return self.predicted_tps / self.run.published_tps

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


def compare_tokens(run: TokensRun) -> TokensComparison:
    cfg = config_mod.load(overrides=list(run.overrides), world_size=run.gpus, local_world_size=8)
    est = estimate_time(cfg, preset("grand-teton", run.gpus // 8), cfg.model.vocab_size, run.engine)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    return TokensComparison(run, est, tokens / est.step_s / run.gpus)


def tokens_table(comparisons: list[TokensComparison]) -> str:
    rows = [
        "| model | source | GPUs | published tokens/s/GPU | predicted | predicted/published "
        "| within 25%? | predicted MFU |",
        "|" + " --- |" * 8,
    ]
    for c in comparisons:
        verdict = "yes" if c.within else "**no**"
        if not c.run.asserted:
            verdict = ("(yes)" if c.within else "(no)") + " indicative"
        rows.append(
            f"| {c.run.name} (h100 at 500 W) | {c.run.source} | {c.run.gpus} "
            f"| {c.run.published_tps:,.0f} | {c.predicted_tps:,.0f} | {c.ratio:.2f} | {verdict} "
            f"| {100 * c.estimate.mfu:.1f} % |"
        )
    notes = [f"- {c.run.name}, {c.run.gpus} GPUs: {c.run.note}" for c in comparisons if c.run.note]
    return "\n".join(rows) + ("\n\nNotes:\n" + "\n".join(notes) if notes else "")


def ffn_hidden(hidden: int, tp: int) -> int:
    """SwiGLU inner size whose three matrices do the FLOPs of GPT's two d×4d ones (8d/3), rounded
    to a multiple of the tensor-parallel degree."""
    return tp * round(8 * hidden / (3 * tp))


def overrides(run: Run) -> list[str]:
    """The run as `key=value` overrides of Strata's defaults."""
    values: dict[str, Any] = {
        "model.n_layers": run.layers,
        "model.d_model": run.hidden,
        "model.n_heads": run.heads,
        "model.seq_len": run.seq,
        "model.vocab_size": run.vocab,
        "model.ffn_hidden": ffn_hidden(run.hidden, run.tp),
        "train.global_batch_size": run.batch,
        "train.micro_batch_size": run.micro,
        "train.precision": "bf16",
        "parallel.tp": run.tp,
        "parallel.pp": run.pp,
        "parallel.virtual_stages": run.virtual,
        "parallel.sequence_parallel": run.sequence_parallel,
        "parallel.overlap_grad_reduce": run.overlap_grad_reduce,
        "parallel.ranks_per_gpu": PRESETS[run.system].get("ranks_per_gpu", 1),
        "activations.recompute": "full" if run.recompute else "none",
    }
    if run.zero1:  # DeepSpeed ZeRO stage 1: optimizer states over the whole data-parallel group
        values["zero.optim.shard_over"] = "global"
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def config_of(run: Run) -> Config:
    return config_mod.load(overrides=overrides(run), world_size=run.ranks)


def cluster_of(run: Run) -> Cluster:
    system = PRESETS[run.system]
    per_node = system["gpus_per_node"] * system.get("ranks_per_gpu", 1)
    if run.ranks % per_node:
        raise ValueError(f"{run.name}: {run.ranks} ranks do not fill {per_node}-rank nodes")
    return preset(run.system, run.ranks // per_node)


def megatron_flops(run: Run, passes: int) -> float:
    """FLOPs of one step in Megatron's count ([M3] eq. 3 with `passes` = 4; the model's with 3):
    `passes` over each layer's matmuls (24·s·h² + 4·s²·h per sequence and pass), three over the
    output layer (2·s·h·V per pass)."""
    b, s, h, n_layers, v = run.batch, run.seq, run.hidden, run.layers, run.vocab
    return passes * 24 * b * s * n_layers * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v


@dataclass(frozen=True)
class Comparison:
    run: Run
    estimate: TimeEstimate
    published_step_s: float
    predicted_tflops: float  # in the source's counting
    published_mfu: float
    predicted_mfu: float

    @property
    def ratio(self) -> float:
        """Predicted throughput / published throughput (= published step time / predicted)."""
        return self.published_step_s / self.estimate.step_s

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


def compare(run: Run) -> Comparison:
    cfg = config_of(run)
    est = estimate_time(cfg, cluster_of(run), run.vocab, run.engine)
    f_pub = megatron_flops(run, run.counted_passes)
    published_step = f_pub / (run.published_tflops * 1e12 * run.ranks)
    f_model = flops_per_token(cfg.model, run.vocab) * run.batch * run.seq
    peak = cluster_of(run).device.peak_tflops
    return Comparison(
        run=run,
        estimate=est,
        published_step_s=published_step,
        predicted_tflops=f_pub / est.step_s / run.ranks / 1e12,
        published_mfu=f_model / published_step / run.ranks / 1e12 / peak,
        predicted_mfu=est.mfu,
    )


def layout(run: Run) -> str:
    dp = run.ranks // (run.tp * run.pp)
    m = run.batch // (run.micro * dp)
    text = f"tp{run.tp} pp{run.pp}" + (f"×{run.virtual}" if run.virtual > 1 else "") + f" dp{dp}"
    text += f", mbs {run.micro}, m {m}" + (", zero-1" if run.zero1 else "")
    return text + (", recompute" if run.recompute else "")


def table(comparisons: list[Comparison], parts: bool = False) -> str:
    head = (
        "| model | source | ranks | layout | published TFLOP/s/rank (% peak) | predicted, same counting "
        "| predicted/published | within 25%? | MFU published → predicted |"
    )
    rows = [head, "|" + " --- |" * 9]
    for c in comparisons:
        r = c.run
        verdict = (
            ("yes" if c.within else "**no**")
            if r.asserted
            else ("(yes)" if c.within else "(no)") + " indicative"
        )
        rows.append(
            f"| {r.name} ({r.system}) | {r.source} | {r.ranks} | {layout(r)} | {r.published_tflops:.1f} "
            f"({r.published_pct:g} %) | {c.predicted_tflops:.1f} | {c.ratio:.2f} | {verdict} "
            f"| {100 * c.published_mfu:.1f} % → {100 * c.predicted_mfu:.1f} % |"
        )
    out = "\n".join(rows)
    if parts:
        lines = [
            "| model | system | step published s | step predicted s | parts (s) |",
            "|" + " --- |" * 5,
        ]
        for c in comparisons:
            p = ", ".join(f"{k} {v:.3g}" for k, v in c.estimate.parts.items() if v > 0)
            lines.append(
                f"| {c.run.name} | {c.run.system} | {c.published_step_s:.3g} | {c.estimate.step_s:.3g} | {p} |"
            )
        out += "\n\n" + "\n".join(lines)
    notes = [f"- {c.run.name} ({c.run.system}): {c.run.note}" for c in comparisons if c.run.note]
    return out + ("\n\nNotes:\n" + "\n".join(notes) if notes else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--parts", action="store_true", help="also print each prediction's parts")
    args = ap.parse_args(argv)
    comparisons = [compare(r) for r in RUNS]
    print(table(comparisons, args.parts))
    titan = [compare_tokens(r) for r in TORCHTITAN_H100]
    print("\n" + tokens_table(titan))
    asserted = [c for c in [*comparisons, *titan] if c.run.asserted]
    misses = [c for c in asserted if not c.within]
    print(
        f"\n{len(asserted) - len(misses)}/{len(asserted)} asserted rows within {TOLERANCE:.0%} of the published figure"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
