"""The `train:` and `optim:` groups: batch sizes, steps, precision and evaluation; AdamW and its
learning-rate schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.config.schema.fields import nested, opt
from strata.config.vocabulary import PRECISIONS


@dataclass(frozen=True)
class DpoConfig:
    """Direct Preference Optimization (with train.objective=dpo), as TRL's DPOTrainer computes it."""

    beta: float = opt(
        0.1,
        "how far the policy may move from the reference: the rewards are beta x (the policy's "
        "minus the reference's log-probability of a completion), TRL's beta",
        min=0.0,
        min_exclusive=True,
    )
    loss_type: str = opt(
        "sigmoid",
        "sigmoid: -log sigmoid(beta x the chosen minus the rejected log-ratio), DPO's loss; ipo: "
        "(the chosen minus the rejected log-ratio, each averaged over its completion's tokens, "
        "minus 1/(2 beta)) squared, as TRL's ipo",
        choices=("sigmoid", "ipo"),
    )


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation loop: batch sizes, steps, precision, evaluation."""

    steps: int = opt(300, "optimizer steps to train for", min=1)
    objective: str = opt(
        "lm",
        "what a step minimises: lm, the next-token cross-entropy (over the trained targets of "
        "conversations); dpo, Direct Preference Optimization on preference pairs prepared by "
        "`strata data prepare` (train.dpo; docs/FINETUNING.md)",
        choices=("lm", "dpo"),
    )
    dpo: DpoConfig = nested(DpoConfig)
    global_batch_size: int = opt(
        16, "sequences per optimizer step, over all data-parallel ranks", min=1
    )
    micro_batch_size: int = opt(
        8, "sequences per forward/backward on one rank; accumulation = global/(micro·dp)", min=1
    )
    seed: int = opt(1234, "seed for init and data order (runs with equal seeds are identical)")
    precision: str = opt(
        "fp32",
        "compute precision: fp32; bf16 autocast; or fp8: the transformer blocks' linear layers in "
        "float8 (torchao's float8 training, scaled per train.fp8_recipe) and bf16 autocast "
        "elsewhere. Weights and optimizer state stay fp32 in every mode, so a checkpoint resumes "
        "under any precision",
        choices=PRECISIONS,
    )
    fp8_recipe: str = opt(
        "tensorwise",
        "with precision=fp8, how float8 scales are chosen: tensorwise (one scale per tensor, the "
        "fastest) or rowwise (one per row, more accurate; torchao's recipes)",
        choices=("tensorwise", "rowwise"),
    )
    fp8_emulate: bool = opt(
        False,
        "with precision=fp8, run float8's casts and scaling with the matmuls in higher precision "
        "(torchao's "
        "emulation): fp8 numerics on any device, CPUs included, for tests; slow, never for training",
    )
    eval_interval: int = opt(
        100, "evaluate every N steps and at the end (0: only at the end)", min=0
    )
    eval_at_start: bool = opt(
        False,
        "also evaluate before the first step (step 0) of a run that starts from scratch, "
        "as a baseline",
    )
    eval_batches: int = opt(
        8,
        "validation global batches per evaluation (as Megatron's eval_iters): every evaluation "
        "reads the same first eval_batches × global_batch_size sequences of the validation split, "
        "at any world size (all of it, each sequence once, where the split is shorter), split "
        "over the data-parallel ranks in micro-batches (0: every sequence of the split, once)",
        min=0,
    )
    threads: int | None = opt(
        None, "torch intra-op CPU threads (null: torch's default; torchrun sets 1)", min=1
    )
    nonfinite: str = opt(
        "skip",
        "a step whose loss or gradient norm is NaN/inf: skip (no update, gradients dropped; it "
        "still counts as a step of the lr schedule and of the data) or stop (end the run with an "
        "error); no checkpoint of non-finite state is ever saved",
        choices=("skip", "stop"),
    )
    max_nonfinite_steps: int = opt(
        5,
        "with nonfinite=skip: end the run with an error once this many steps in a row were not "
        "finite",
        min=1,
    )
    spike_sigma: float = opt(
        6.0,
        "loss-spike guard: a step whose loss exceeds the median of the last train.spike_window "
        "judged steps by this many robust deviations (1.4826 x their median absolute deviation, at "
        "least 1% of the median) updates nothing, and neither does one whose gradient norm exceeds "
        "train.spike_grad_ratio x its median; the guard watches once optim.warmup_steps have ended "
        "and judges once train.spike_min_steps steps after them are known; its state is "
        "checkpointed (docs/OPERATIONS.md). 0: off",
        min=0.0,
    )
    spike_window: int = opt(
        128,
        "judged steps (spikes included) the spike guard's medians cover: a lasting level shift "
        "stops being a spike once it fills half of them",
        min=2,
    )
    spike_min_steps: int = opt(
        20,
        "steps after optim.warmup_steps the spike guard watches before it judges (at most "
        "train.spike_window)",
        min=2,
    )
    spike_grad_ratio: float = opt(
        10.0,
        "spike guard: a gradient norm above this many times the median of the window's is a spike "
        "(clipping already bounds an update, and fine-tuning's norm rises for a while; 0: the "
        "gradient norm is not judged)",
        min=0.0,
    )
    max_spike_steps: int = opt(
        10,
        "end the run with an error, saving nothing, once this many steps in a row were spikes: the "
        "run diverged (resume its newest checkpoint with a lower optim.lr)",
        min=1,
    )
    freeze: tuple[str, ...] = opt(
        (),
        "parameters that do not train (no gradient, no optimizer state), by Strata's parameter "
        "names: embeddings, output, norms (every RMSNorm weight), a name or the module above it "
        "(layers.3, layers.3.attn, tok_embeddings.weight), a range of blocks (layers.0-7, "
        "layers.0-7.mlp: first to last, inclusive) or a glob of either (layers.*.attn_norm.weight, "
        "layers.*.attn); with "
        "model.lora every base weight is frozen already, and an item here freezes adapters too",
    )
    compile: bool = opt(
        False,
        "compile each transformer block with torch.compile (regional compilation: every block "
        "shares one "
        "compiled graph, so compile time is one block's; hooks, collectives and the loss stay "
        "eager); the "
        "first step pays the compile time",
    )

    @property
    def bf16_compute(self) -> bool:
        """Whether activations are bf16 (autocast): under bf16, and around fp8's float8 matmuls."""
        return self.precision in ("bf16", "fp8")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = opt(3e-3, "peak learning rate", min=0.0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr", min=0.0, max=1.0)
    warmup_steps: int = opt(
        30,
        "linear warmup steps from 0 to lr (more than train.steps: warm up over all steps, "
        "with a warning)",
        min=0,
    )
    schedule: str = opt("cosine", "decay after warmup", choices=("cosine", "linear", "constant"))
    weight_decay: float = opt(0.1, "decoupled weight decay (matrices only; not norms)", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0, min_exclusive=True)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: off)", min=0.0)
    impl: str = opt(
        "auto",
        "AdamW kernel: fused, foreach, or auto (fused where available)",
        choices=("auto", "fused", "foreach"),
    )
