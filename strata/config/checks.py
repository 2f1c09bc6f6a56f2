"""The checks between keys: what each key's own type and range let through but the keys together
(or the world size) do not allow. `load` runs them after building a config and reports every
problem at once; `cross_problems` runs them on a config built with `replace` (the planner's).
`check_trainable` refuses what a valid config may hold but training cannot run with, and
`start_up_warnings` names what is legal but probably unintended.

The order of the problems is the order of the checks below, and part of what a user sees.
"""

from __future__ import annotations

import math

from strata.config.schema import (
    Config,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)
from strata.config.schema.keys import get
from strata.config.vocabulary import (
    LEVELS,
    OFFLOAD_STREAM_KEYS,
    SINGLE_STAGE_SCHEDULES,
    SLABS_PER_STREAM,
    SPLIT_BACKWARD_SCHEDULES,
    V_SHAPED_SCHEDULES,
    bpe_problem,
    coarseness,
    expert_layout_problems,
    experts_split_problem,
    ffn_split_problem,
    freeze_pattern_problem,
    heads_split_problem,
    layout_problems,
    lora_target_kinds,
    moe_tensor_parallel_problem,
    offload_devices,
    pool_streams,
    sequence_split_problem,
    vocab_split_problem,
)
from strata.errors import ConfigError


def cross_problems(
    cfg: Config, world_size: int | None = None, local_world_size: int | None = None
) -> list[str]:
    """What is wrong between the keys of an already built config (and against `world_size`, of which
    a launcher runs `local_world_size` per node: what parallel.ranks_per_node null stands for): the
    checks `load` runs after each key's own, for configs made with `replace` (the planner's)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    return [
        *_value_checks(cfg),
        *_data_checks(cfg.data),
        *_model_checks(m),
        *_lora_checks(cfg),
        *_dpo_checks(cfg),
        *_split_checks(m, par),
        *_switch_checks(par, tr),
        *_schedule_checks(par),
        *_zero_checks(cfg, world_size),
        *_offload_checks(cfg),
        *_snapshot_checks(cfg),
        *_tp_size_checks(m, par),
        *_context_checks(cfg),
        *_moe_checks(cfg, world_size, local_world_size),
        *_batch_checks(cfg, world_size, local_world_size),
        *_spike_checks(tr),
    ]


def check_trainable(cfg: Config) -> None:
    """Refuse what a valid config may hold but training cannot run with (torch's AdamW refuses a beta
    of 1.0, which the schema's inclusive range lets through): `strata train` and `strata launch`
    call this before starting, so it fails as a ConfigError rather than in torch."""
    p = [
        f"optim.{name}: {value!r} cannot train: torch's AdamW needs 0 <= beta < 1; use e.g. 0.999"
        for name, value in (("beta1", cfg.optim.beta1), ("beta2", cfg.optim.beta2))
        if value >= 1.0
    ]
    if p:
        raise ConfigError(p)


def start_up_warnings(cfg: Config) -> list[str]:
    """What is legal but probably not what the user meant, for rank 0 to print at start-up (a short
    trial run of a shipped config must still train, so these are not errors)."""
    w: list[str] = []
    if cfg.optim.warmup_steps > cfg.train.steps:
        w.append(
            f"optim.warmup_steps={cfg.optim.warmup_steps} exceeds train.steps={cfg.train.steps}: "
            f"the warm-up is cut short to the {cfg.train.steps} steps (the learning rate reaches "
            "optim.lr at the last step and never decays); lower optim.warmup_steps or train longer"
        )
    lora, moe = cfg.model.lora, cfg.model.moe
    feed_forward = {"gate_proj", "up_proj", "down_proj"} & set(
        lora_target_kinds(lora.target_modules)
    )
    if lora.enabled and moe.enabled and feed_forward:
        w.append(
            f"model.lora.target_modules names {', '.join(sorted(feed_forward))}: in the MoE layers "
            "only the shared experts get adapters, the routed experts none yet (they stay frozen); "
            "the dense layers' feed-forward gets them as named"
        )
    default_fraction = DataConfig().val_fraction
    if (cfg.data.path or cfg.data.sources) and cfg.data.val_fraction != default_fraction:
        w.append(
            f"data.val_fraction={cfg.data.val_fraction:g} applies to the built-in corpus only: "
            "this run's data "
            "was split when it was prepared (`strata data prepare --val-fraction`), so it has no "
            "effect here"
        )
    return w


PATH_KEYS = (
    "model.init_from",
    "model.lora.init_from",
    "data.path",
    "data.cache_dir",
    "offload.nvme_path",
    "checkpoint.dir",
    "log.dir",
    "log.name",
)
NAME_MAX = 255  # bytes in one path component on Linux file systems


def path_problem(key: str, value: str) -> str | None:
    """Why the path (or path component) `value` of `key` cannot name a file, or None."""
    if "\0" in value:
        return f"{key}: {value!r} contains a NUL character, which no path may hold; remove it"
    long = next(
        (c for c in value.split("/") if len(c.encode("utf-8", "surrogateescape")) > NAME_MAX), None
    )
    if long is not None:
        return (
            f"{key}: the path component {long[:40]!r}... is "
            f"{len(long.encode('utf-8', 'surrogateescape'))} bytes; "
            f"file systems allow {NAME_MAX}, so use a shorter name"
        )
    return None


def _value_checks(cfg: Config) -> list[str]:
    """Values the schema's ranges let through but the run would fail on later: paths no file system
    takes, a seed the data order cannot use (negative)."""
    p = [
        problem
        for key in PATH_KEYS
        if isinstance(value := get(cfg, key), str) and (problem := path_problem(key, value))
    ]
    if cfg.train.seed < 0:
        p.append(f"train.seed: {cfg.train.seed} must be >= 0 (it seeds the data order)")
    steps = cfg.log.profile_steps
    if steps is not None and len(steps) == 2 and steps[0] > steps[1]:
        p.append(
            f"log.profile_steps: {list(steps)} is reversed; give [first, last] with first <= last, "
            f"e.g. [{steps[1]}, {steps[0]}]"
        )
    return p


def _spike_checks(tr: TrainConfig) -> list[str]:
    """The spike guard judges once its window holds train.spike_min_steps steps: a smaller window
    never does, and the guard would be off without a word."""
    if tr.spike_sigma and tr.spike_window < tr.spike_min_steps:
        return [
            f"train.spike_window: {tr.spike_window} is smaller than train.spike_min_steps="
            f"{tr.spike_min_steps}, so the spike guard would never judge a step; make the window "
            f"at least {tr.spike_min_steps} (or train.spike_sigma: 0 to turn the guard off)"
        ]
    return []


def _data_checks(d: DataConfig) -> list[str]:
    """data.path or data.sources, not both; the sources' paths; data.tokenizer's form (what it
    names, and the sources' vocabularies, are checked against the data at start-up)."""
    p: list[str] = []
    if d.path is not None and d.sources:
        p.append(
            f"data.path={d.path!r} and data.sources (of {len(d.sources)}) are both set: give one, "
            "data.path for one prepared directory or data.sources for a mixture of several"
        )
    weights = [source.weight for source in d.sources or ()]
    # fsum raises on overflow; a plain sum gives inf
    if weights and not math.isfinite(sum(weights)):
        p.append(
            "data.sources: the weights' sum overflows "
            f"({', '.join(f'{w:g}' for w in weights[:4])}): give weights "
            "of a sensible scale, e.g. the shares in percent"
        )
    first: dict[str, int] = {}
    for i, source in enumerate(d.sources or ()):
        key = f"data.sources[{i}].path"
        if not source.path.strip():
            p.append(f"{key}: empty; give the directory made by `strata data prepare`")
        elif source.path in first:
            p.append(
                f"{key}={source.path!r} is also data.sources[{first[source.path]}]: give each "
                "directory once (with the sum of the weights)"
            )
        else:
            first[source.path] = i
            problem = path_problem(key, source.path)
            if problem:
                p.append(problem)
    t = d.tokenizer
    if t is None or t == "bytes":
        return p
    if not t.strip():
        return [
            *p,
            "data.tokenizer: empty; give bytes, bpe:N, a tokenizer.json path, or null (the data's)",
        ]
    if (problem := bpe_problem(t)) is not None:
        return [*p, f"data.{problem}"]
    if d.path is None and not d.sources:
        p.append(
            f"data.tokenizer={t!r} needs data.path or data.sources (the built-in corpus is "
            "byte-level): prepare "
            f"the data with `strata data prepare ... --tokenizer {t}` and set data.path to it"
        )
    return p


def _model_checks(m: ModelConfig) -> list[str]:
    """The attention heads' shapes and the RoPE scaling's frequency bounds."""
    p: list[str] = []
    if m.head_dim is None and m.d_model % m.n_heads:
        p.append(
            f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} (or set "
            "model.head_dim)"
        )
    kv = m.kv_heads
    if m.n_heads % kv:
        p.append(f"model.n_kv_heads={kv} must divide model.n_heads={m.n_heads}")
    elif m.head_dim is not None and m.head_dim % 2:
        p.append(f"model.head_dim={m.head_dim} must be even for RoPE")
    elif m.head_dim is None and not m.d_model % m.n_heads and m.head_size % 2:
        p.append(
            f"head size d_model/n_heads={m.head_size} must be even for RoPE (or set an even "
            "model.head_dim)"
        )
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        p.append(
            f"model.rope_high_freq_factor={m.rope_high_freq_factor:g} must exceed "
            f"model.rope_low_freq_factor={m.rope_low_freq_factor:g} (llama3 RoPE scaling "
            "interpolates between them)"
        )
    if m.rope_scaling == "dynamic" and m.head_size <= 2:
        p.append(
            f"dynamic RoPE scaling needs a head size above 2 (it is {m.head_size}): set a "
            "larger model.head_dim"
        )
    if m.rope_scaling == "yarn" and m.rope_beta_fast <= m.rope_beta_slow:
        p.append(
            f"model.rope_beta_fast={m.rope_beta_fast:g} must exceed "
            f"model.rope_beta_slow={m.rope_beta_slow:g} (yarn RoPE scaling ramps between them)"
        )
    return p


def _lora_checks(cfg: Config) -> list[str]:
    """train.freeze's items; what adapters (model.lora) do not run with yet."""
    p = [problem for item in cfg.train.freeze if (problem := freeze_pattern_problem(item))]
    lora = cfg.model.lora
    if lora.init_from is not None and not (lora.enabled and cfg.model.init_from):
        p.append(
            "model.lora.init_from loads adapters onto a base model: set model.lora.rank (and the "
            "adapter's alpha and target_modules) and model.init_from (the base model)"
        )
    if cfg.model.lora.enabled and cfg.train.precision == "fp8":
        p.append(
            "model.lora with train.precision=fp8: float8 training replaces the linear layers the "
            "adapters sit on; use train.precision=bf16 (the frozen base weights gain nothing from "
            "float8's master weights), or model.lora.rank: 0"
        )
    return p


def _dpo_checks(cfg: Config) -> list[str]:
    """What train.objective=dpo does not run with: the layouts and features it has not been made
    to work with."""
    if cfg.train.objective != "dpo":
        return []
    p = []
    par = cfg.parallel
    refused = [
        (
            par.pp > 1 and par.cp > 1,
            f"parallel.pp={par.pp} with parallel.cp={par.cp}",
            "one of them",
        ),
        (
            cfg.zero.params.shard_over != "none",
            f"zero.params.shard_over={cfg.zero.params.shard_over} (ZeRO-3)",
            "zero.params.shard_over=none (ZeRO-1/2 work)",
        ),
        (cfg.model.moe.enabled, "model.moe", "a dense model"),
        (cfg.co2.enabled, "co2.enabled", "co2.enabled=false"),
        (cfg.data.sources is not None, "data.sources (a mixture)", "one data.path of pairs"),
    ]
    p += [
        f"train.objective=dpo does not run with {what} yet; use {fix}"
        for bad, what, fix in refused
        if bad
    ]
    if not cfg.data.document_mask:
        p.append(
            "train.objective=dpo needs data.document_mask=true: a pair's rejected completion must "
            "not attend to its chosen one packed before it in the window"
        )
    return p


def _split_checks(m: ModelConfig, par: ParallelConfig) -> list[str]:
    """The heads split over tp ranks, the layers over pipeline stages."""
    p: list[str] = []
    if heads := heads_split_problem(m, par.tp):
        p.append(heads)
    stages = par.pp * par.virtual_stages
    if m.n_layers % stages:
        p.append(
            f"parallel.pp·virtual_stages = {par.pp}·{par.virtual_stages} = {stages} pipeline "
            "stages must divide "
            f"model.n_layers={m.n_layers} (stages are balanced by layers)"
        )
    return p


def _switch_checks(par: ParallelConfig, tr: TrainConfig) -> list[str]:
    """The hang watchdog against the collective timeout; float8 against compilation."""
    p: list[str] = []
    if par.hang_timeout_s is not None and par.hang_timeout_s >= par.timeout_s:
        p.append(
            f"parallel.hang_timeout_s={par.hang_timeout_s:g} must be below "
            f"parallel.timeout_s={par.timeout_s} (the collective timeout would end the job first, "
            "without naming the stuck rank); lower it, or 0 for off"
        )
    if tr.precision == "fp8" and not tr.compile and not tr.fp8_emulate:
        p.append(
            "train.precision=fp8 needs train.compile=true: uncompiled, float8's casts and scaling "
            "run as separate kernels and the step is slower than bf16 (torchao and torchtitan "
            "require compilation too)"
        )
    return p


def _tp_size_checks(m: ModelConfig, par: ParallelConfig) -> list[str]:
    """The sizes split over tp ranks: the sequence (sequence parallel), the SwiGLU width, the vocabulary."""
    problems = [
        sequence_split_problem(m.seq_len, par.tp, par.sequence_parallel),
        ffn_split_problem(m, par.tp),
        vocab_split_problem(m, par.tp),
    ]
    return [p for p in problems if p]


def _context_checks(cfg: Config) -> list[str]:
    """Context parallelism against the sequence and the heads."""
    m, par = cfg.model, cfg.parallel
    p: list[str] = []
    if par.cp == 1:
        return p
    if m.seq_len % (2 * par.cp):
        p.append(
            f"model.seq_len={m.seq_len} must be a multiple of 2·parallel.cp = {2 * par.cp} (each "
            "sequence is cut into 2·cp chunks, two per context-parallel rank)"
        )
    elif par.sequence_parallel and par.tp > 1 and (m.seq_len // par.cp) % par.tp:
        p.append(
            f"parallel.sequence_parallel splits each context-parallel rank's {m.seq_len // par.cp} "
            f"tokens over tp={par.tp} ranks: model.seq_len/cp must be a multiple of tp"
        )
    heads = m.n_heads // par.tp if m.n_heads % par.tp == 0 else m.n_heads
    if par.cp_mode == "alltoall" and heads % par.cp:
        p.append(
            f"parallel.cp_mode=alltoall needs parallel.cp={par.cp} to divide the {heads} attention "
            "heads of a tensor-parallel rank (model.n_heads/tp); use cp_mode=ring (or auto)"
        )
    return p


def _moe_checks(cfg: Config, world_size: int | None, local_world_size: int | None) -> list[str]:
    """The MoE layers' shape, and expert parallelism against it and the layout."""
    m, par, moe = cfg.model, cfg.parallel, cfg.model.moe
    p: list[str] = []
    if moe.enabled:
        if moe.top_k > moe.num_experts:
            p.append(f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={moe.num_experts}")
        if moe.first_dense_layers >= m.n_layers:
            p.append(
                f"model.moe.first_dense_layers={moe.first_dense_layers} leaves no MoE layer of "
                "model.n_layers="
                f"{m.n_layers}; lower it, or set model.moe.num_experts=0 for a dense model"
            )
        p += _route_group_checks(moe)
        if tensor := moe_tensor_parallel_problem(par.tp, par.sequence_parallel):
            p.append(tensor)
    if par.ep > 1:
        if not moe.enabled:
            p.append(
                f"parallel.ep={par.ep} needs an MoE model (model.moe.num_experts > 0); set "
                "parallel.ep=1"
            )
        elif split := experts_split_problem(moe.num_experts, par.ep):
            p.append(split)
        if cfg.co2.enabled:
            p.append(
                "parallel.ep > 1 with co2.enabled: CO2's outer update needs every parameter "
                "replicated over dp"
            )
        if world_size is None or not layout_problems(par, world_size, local_world_size):
            p += expert_layout_problems(par, world_size, local_world_size)
    return p


def _route_group_checks(moe: MoEConfig) -> list[str]:
    """Group-limited (node-limited) routing against the experts and top_k."""
    p: list[str] = []
    groups, limit = moe.route_groups, moe.route_group_limit
    if moe.num_experts % groups:
        p.append(
            f"model.moe.route_groups={groups} must divide model.moe.num_experts={moe.num_experts}"
        )
    elif limit > groups:
        p.append(f"model.moe.route_group_limit={limit} exceeds model.moe.route_groups={groups}")
    elif groups > 1 and moe.top_k > limit * (moe.num_experts // groups):
        p.append(
            f"model.moe.top_k={moe.top_k} exceeds the {limit * (moe.num_experts // groups)} "
            "experts of "
            f"route_group_limit={limit} groups of {moe.num_experts // groups}; raise "
            "route_group_limit"
        )
    return p


def _batch_checks(
    cfg: Config, world_size: int | None, local_world_size: int | None = None
) -> list[str]:
    """Batch sizes against each other and, with a world size, the layout and the micro-batches it gives."""
    par, tr = cfg.parallel, cfg.train
    p: list[str] = []
    if tr.global_batch_size % tr.micro_batch_size:
        p.append(
            f"train.micro_batch_size={tr.micro_batch_size} must divide "
            f"train.global_batch_size={tr.global_batch_size}"
        )
    if world_size is not None:
        layout_issues = layout_problems(par, world_size, local_world_size)
        p += layout_issues
        if not layout_issues:
            dp = cfg.dp_size(world_size)
            if tr.global_batch_size % (tr.micro_batch_size * dp):
                p.append(
                    f"train.global_batch_size={tr.global_batch_size} must be a multiple of "
                    f"train.micro_batch_size·dp = {tr.micro_batch_size}·{dp}"
                )
            else:
                p += _microbatch_checks(cfg, cfg.grad_accum_steps(world_size), dp)
    return p


def _schedule_checks(par: ParallelConfig) -> list[str]:
    p: list[str] = []
    v, name = par.virtual_stages, par.schedule
    if v > 1 and par.pp == 1:
        p.append(
            f"parallel.virtual_stages={v} needs pipeline parallelism: set parallel.pp > 1 or "
            "virtual_stages=1"
        )
    if name in SINGLE_STAGE_SCHEDULES and v > 1:
        p.append(
            f"parallel.schedule={name} runs one stage per rank but virtual_stages={v}; use "
            "interleaved_1f1b, looped_bfs or interleaved_zero_bubble, or set virtual_stages=1"
        )
    if name in V_SHAPED_SCHEDULES and v != 2:
        p.append(
            f"parallel.schedule={name} needs exactly two stages per rank: set "
            "parallel.virtual_stages=2"
        )
    return p


def _offload_checks(cfg: Config) -> list[str]:
    """Memory tiers hang off the ZeRO engine's flat groups; what the first version supports."""
    p: list[str] = []
    off, z = cfg.offload, cfg.zero
    slab = off.slab_mb * 2**20
    devices = offload_devices(cfg)
    needed = SLABS_PER_STREAM * len(pool_streams(devices))
    if slab % 4096:
        p.append(
            f"offload.slab_mb={off.slab_mb:g} is not a multiple of 4 KiB (O_DIRECT "
            "transfers); use e.g. 4"
        )
    elif needed and off.host_buffer_mb * 2**20 < needed * slab:
        p.append(
            f"offload.host_buffer_mb={off.host_buffer_mb:g} holds fewer than the {needed} slabs of "
            f"offload.slab_mb={off.slab_mb:g} that {needed // SLABS_PER_STREAM} offload streams "
            f"need ({SLABS_PER_STREAM} each); set it to at least {needed * off.slab_mb:g}"
        )
    nvme = [OFFLOAD_STREAM_KEYS[s] for s, d in devices.items() if d == "nvme"]
    if nvme and not off.nvme_path:
        p.append(
            f"{' and '.join(nvme)}=nvme need{'s' if len(nvme) == 1 else ''} offload.nvme_path: a "
            "directory on a local SSD for the swap files"
        )
    if off.params.device != "none":
        if coarseness(z.params.shard_over) <= coarseness("none"):
            p.append(
                f"offload.params.device={off.params.device} offloads ZeRO-3 parameter shards: set "
                "zero.params.shard_over (global also works on one rank)"
            )
        elif z.params.shard_over != z.optim.shard_over:
            p.append(
                f"offload.params.device={off.params.device} needs zero.optim.shard_over = "
                f"zero.params.shard_over (now {z.optim.shard_over} vs {z.params.shard_over}): each "
                "rank steps exactly the shard it swaps"
            )
    if off.optim.device != "none" and coarseness(z.optim.shard_over) <= coarseness("none"):
        p.append(
            f"offload.optim.device={off.optim.device} offloads the ZeRO optimizer partition: set "
            "zero.optim.shard_over (global also works on one rank)"
        )
    if off.enabled and cfg.optim.impl == "foreach":
        p.append(
            "offload steps sub-groups with torch's fused AdamW kernel (6.5x faster on CPU than "
            "foreach): set optim.impl=auto or fused"
        )
    if off.enabled and cfg.co2.enabled:
        p.append(
            "co2.enabled with offload: CO2's outer update walks every optimizer chunk at once, "
            "which offload keeps on disk or host; turn one of them off"
        )
    return p


def _zero_checks(cfg: Config, world_size: int | None) -> list[str]:
    """ZeRO levels nest (parameters and gradients inside the optimizer shard, hpZ inside the
    parameters); CO2 needs whole nodes as replicas."""
    p: list[str] = []
    z, par = cfg.zero, cfg.parallel
    level = {
        name: getattr(z, name).shard_over
        for name in ("params", "grads", "optim", "secondary_params")
    }
    for name in ("params", "grads"):
        if coarseness(level[name]) > coarseness(level["optim"]):
            what = {"params": "parameters", "grads": "gradients"}[name]
            p.append(
                f"zero.{name}.shard_over={level[name]} is coarser than "
                f"zero.optim.shard_over={level['optim']}: a rank steps only the optimizer state "
                f"inside the {what} it holds; set zero.optim.shard_over={level[name]} or "
                f"zero.{name}.shard_over={level['optim']}"
            )
    sec = level["secondary_params"]
    if sec != "none" and coarseness(sec) >= coarseness(level["params"]):
        finer = [
            lv for lv in LEVELS if coarseness("none") < coarseness(lv) < coarseness(level["params"])
        ]
        p.append(
            f"zero.secondary_params.shard_over={sec} must be finer than "
            f"zero.params.shard_over={level['params']} "
            "(hpZ is a less partitioned second copy); use "
            f"{' or '.join([*finer, 'none (hpZ off)'])}"
        )
    sharded = [
        f"zero.{name}.shard_over={level[name]}"
        for name in ("params", "grads", "optim")
        if coarseness(level[name]) > coarseness("none")
    ]
    if sharded and par.pp > 1 and par.schedule in SPLIT_BACKWARD_SCHEDULES:
        p.append(
            f"parallel.schedule={par.schedule} with {' and '.join(sharded)}: split-backward "
            "schedules set weight gradients directly in a later pass, past the hooks through which "
            "the ZeRO engine collects gradients; use parallel.schedule=interleaved_1f1b (or "
            "1f1b/gpipe/looped_bfs), or no zero block"
        )
    if cfg.co2.enabled:
        for name, lv in level.items():
            if coarseness(lv) > coarseness("node"):
                p.append(
                    "co2.enabled needs nodes to be independent replicas but "
                    f"zero.{name}.shard_over={lv} "
                    "partitions across nodes; set it to node or finer, or co2.enabled=false"
                )
        for key in ("clip", "staleness_penalty"):
            if getattr(cfg.co2, key) > 0 and par.tp * par.pp > 1:
                p.append(
                    f"co2.{key}={getattr(cfg.co2, key)} with parallel.tp={par.tp}, pp={par.pp}: "
                    "its norm is taken "
                    "over one model replica's data-parallel pieces only, not yet across "
                    "tensor/pipeline shards "
                    f"(copies of replicated weights would drift apart); set co2.{key}=0 or use "
                    "tp=pp=1"
                )
        # null: the launcher decides, so the node count is unknown here
        per_node = par.ranks_per_node
        if (
            world_size is not None
            and per_node is not None
            and world_size % per_node == 0
            and world_size // per_node < 2
        ):
            p.append(
                f"co2.enabled needs at least 2 nodes but world size {world_size} / "
                "parallel.ranks_per_node="
                f"{per_node} = {world_size // per_node}; run on more nodes, lower "
                "parallel.ranks_per_node, or "
                "set co2.enabled=false"
            )
    return p


def _microbatch_checks(cfg: Config, derived: int, dp: int) -> list[str]:
    """`derived` = global_batch_size / (micro_batch_size·dp): the micro-batches one replica runs."""
    par, tr = cfg.parallel, cfg.train
    p: list[str] = []
    if par.microbatches is not None and par.microbatches != derived:
        mbs = tr.global_batch_size / (par.microbatches * dp)
        fix = (
            f"set train.micro_batch_size={int(mbs)}"
            if mbs == int(mbs) and mbs >= 1
            else "change global_batch_size"
        )
        p.append(
            f"parallel.microbatches={par.microbatches} disagrees with "
            "global_batch_size/(micro_batch_size·dp) = "
            f"{derived}; {fix} or leave parallel.microbatches null"
        )
        return p
    if par.pp > 1 and par.schedule == "dualpipev" and derived < 2 * par.pp:
        p.append(
            "parallel.schedule=dualpipev needs at least as many micro-batches as stages (2·pp = "
            f"{2 * par.pp}) "
            f"but gets {derived}; lower train.micro_batch_size or raise train.global_batch_size"
        )
    elif par.pp > 1 and derived < par.pp:
        p.append(
            f"pipeline needs at least pp={par.pp} micro-batches per step but gets {derived} "
            "(global_batch_size/"
            f"(micro_batch_size·dp)); lower train.micro_batch_size or raise train.global_batch_size"
        )
    elif par.pp > 1 and par.virtual_stages > 1 and derived % max(1, derived // par.pp):
        p.append(
            f"interleaved schedules run micro-batches in rounds of about pp={par.pp}: {derived} "
            f"micro-batches must be a multiple of {derived // par.pp}; use a multiple of pp"
        )
    return p


def _snapshot_checks(cfg: Config) -> list[str]:
    """Snapshots copy the state as the checkpoint layer sees it; two features change that state."""
    if not cfg.snapshot.every_steps:
        return []
    p = []
    if cfg.co2.enabled:
        p.append(
            "snapshot.every_steps with co2.enabled: a snapshot would have to close CO2's round (as "
            "a checkpoint does), which changes the training; use checkpoint.interval, or set "
            "co2.enabled=false"
        )
    if cfg.offload.enabled:
        p.append(
            "snapshot.every_steps with offload.params.device or offload.optim.device: every "
            "snapshot would read the offloaded state back into memory; use checkpoint.interval, or "
            "set both devices to none"
        )
    return p
