"""One torchrun worker of bench/zero_vs_deepspeed.py: trains the Strata config it is given for
`train.steps` steps with one of two engines and measures every rank the same way.

    --side deepspeed   DeepSpeed ZeRO-3 (zero.Init, stage3_param_persistence_threshold 0, torch
                       AdamW with Strata's weight-decay groups and lr_at schedule, Strata's
                       initial values set through GatheredParameters, Strata's BatchLoader)
    --side strata      Strata's own strata.trainer.loop.Trainer, one `train_step()` per step (ZeRO-3 when
                       the config's `zero.*` keys say so)

Each step is timed on every rank (wall clock around the whole step: data, forward/backward, the
optimizer step and the dp-averaged loss); psutil's RSS is sampled after every step and reported
above a baseline taken right after the process group is up and the engine's modules are imported,
before the model exists. The kernel's high-water mark (VmHWM) is reset right after that baseline
and again after the build, so the record also has the exact peak of the build and of the steps
(`hwm_*`; where /proc/self/clear_refs is refused, the lifetime ru_maxrss stands in, flagged by
`hwm_reset: false`). Bytes the process moved to and from storage (/proc/self/io, all threads,
O_DIRECT and libaio included) are recorded around the build and around the steps. Rank 0 writes
one JSON with every rank's figures to --out.

The config's `offload.*` keys select offload for both sides (bench/offload_vs_deepspeed.py):
Strata reads them itself; the DeepSpeed side maps them onto ZeRO-Infinity's `offload_param` /
`offload_optimizer` / `aio` sections (`deepspeed_config`), tuned with the `--ds-*` options. After
the steps, rank 0 records the bytes under `offload.nvme_path` (all ranks' swap files).

    python -m torch.distributed.run --nproc-per-node 2 bench/_zero_worker.py --side deepspeed \
        --out ds.json configs/tiny.yaml model.d_model=256 train.steps=10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from strata import config as config_mod
from strata.data.loader import BatchLoader
from strata.data.tokens import TokenDataset
from strata.model import GPT, count_params, initial_value, lm_loss, set_rope_buffers
from strata.parallel.runtime import proc_status_bytes, reset_peak_rss
from strata.trainer.lr_schedule import lr_at
from strata.trainer.parallelize import build_optimizer


def rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """The process's lifetime RSS high-water mark (catches peaks inside a step), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def hwm() -> int:
    """The RSS high-water mark since the last `reset_peak_rss()` (VmHWM), else the lifetime ru_maxrss."""
    try:
        return proc_status_bytes("VmHWM")
    except (OSError, KeyError):
        return peak_rss()


def io_bytes() -> dict[str, int]:
    """Bytes this process (all its threads) caused to be read from / written to storage."""
    try:
        fields = dict(
            line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if line
        )
        return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}
    except (OSError, KeyError, ValueError):
        return {}


def delta(after: dict, before: dict) -> dict:
    return {
        k: after[k] - before[k] for k in after if k in before and isinstance(after[k], (int, float))
    }


def dir_bytes(path: str | Path | None) -> dict[str, int] | None:
    """Apparent size, allocated size and number of the files under `path` (None: no path)."""
    if not path or not Path(path).is_dir():
        return None
    size = blocks = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except OSError:  # removed while walking
                continue
            size, blocks, files = size + st.st_size, blocks + st.st_blocks * 512, files + 1
    return {"bytes": size, "allocated": blocks, "files": files}


# --- DeepSpeed ZeRO-3 ---------------------------------------------------------------------------


def largest_param_numel(cfg: config_mod.Config, vocab_size: int) -> int:
    """The model's largest parameter, in elements (built on the meta device: no memory)."""
    with torch.device("meta"):
        return max(p.numel() for p in GPT(cfg.model, vocab_size).parameters())


def deepspeed_config(
    cfg: config_mod.Config,
    world: int,
    largest_param: int | None = None,
    sub_group_size: int | None = None,
    param_buffers: int = 5,
    optim_buffers: int = 12,
) -> dict:
    """DeepSpeed's config for Strata's: ZeRO-3, and ZeRO-Infinity offload where the config's
    `offload.params.device` / `offload.optim.device` say cpu or nvme (swap files under
    `offload.nvme_path`; aio requests of `offload.slab_mb` on `offload.io_threads` threads, as
    Strata's engine). `largest_param` (elements) sizes the parameter swap buffers, which must hold
    the largest parameter; `sub_group_size` (elements) is ZeRO-3's optimizer sub-group, the unit
    its optimizer swapper reads, steps and writes (DeepSpeed's default 1e9: the whole model), each
    of its `optim_buffers` pinned buffers that large: with pipeline_read/write a sub-group's reads
    and the previous one's writes are in flight together, and DeepSpeed's default 4 buffers (one
    per Adam state) and 8 run out ("PipelinedOptimizerSwapper ran out of swap buffers") once there is
    more than one sub-group; 12 worked here (a sub-group takes 4: parameter, 2 moments, gradient)."""
    ds = {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps(world),
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_bucket_size": int(25 * 2**20 / 4),  # elements
            "stage3_prefetch_bucket_size": int(5e7),
            # the default (1e5 elements) would leave every parameter of a small model whole
            "stage3_param_persistence_threshold": 0,
        },
        "zero_force_ds_cpu_optimizer": False,  # a torch optimizer, no cpu_adam build
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    off, zero = cfg.offload, ds["zero_optimization"]
    if sub_group_size:
        zero["sub_group_size"] = int(sub_group_size)
    if off.params.device != "none":
        if largest_param is None:
            raise ValueError(
                "offload_param needs largest_param: its swap buffers must hold the largest parameter"
            )
        zero["offload_param"] = {
            "device": off.params.device,
            "nvme_path": off.nvme_path,
            "pin_memory": True,
            "buffer_count": param_buffers,
            "buffer_size": int(largest_param),
        }
    if off.optim.device != "none":
        zero["offload_optimizer"] = {
            "device": off.optim.device,
            "nvme_path": off.nvme_path,
            "pin_memory": True,
            "pipeline_read": True,
            "pipeline_write": True,
            "buffer_count": optim_buffers,
        }
    if "nvme" in (off.params.device, off.optim.device):
        ds["aio"] = {
            "block_size": int(off.slab_mb * 2**20),
            "queue_depth": 8,
            "intra_op_parallelism": off.io_threads,
            "single_submit": False,
            "overlap_events": True,
        }
    return ds


def deepspeed_cpu_adam(opt: torch.optim.Optimizer):
    """DeepSpeedCPUAdam (AdamW mode) over `opt`'s parameter groups and hyperparameters (the
    cpu_adam op: a JIT build on first use, about 44 s on 2 cores)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = [
        {k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
        for g in opt.param_groups
    ]
    d = opt.defaults
    return DeepSpeedCPUAdam(
        groups,
        lr=d["lr"],
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        adamw_mode=True,
    )


class DeepSpeedSide:
    def __init__(self, cfg: config_mod.Config, data_dir: Path, args: argparse.Namespace):
        import deepspeed

        self.deepspeed = deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cfg, self.data_dir, self.args = cfg, data_dir, args
        self.offload = {
            k: v
            for k, v in (("params", cfg.offload.params.device), ("optim", cfg.offload.optim.device))
            if v != "none"
        }

    def build(self) -> None:
        cfg, deepspeed = self.cfg, self.deepspeed
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        train_set = TokenDataset(self.data_dir, "train", cfg.model.seq_len)
        largest = largest_param_numel(
            cfg, config_mod.padded_vocab_size(cfg.model, train_set.vocab_size)
        )
        ds = self.ds_config = deepspeed_config(
            cfg,
            self.world,
            largest,
            self.args.ds_sub_group_size,
            self.args.ds_param_buffers,
            self.args.ds_optim_buffers,
        )
        # Built partitioned. No dtype argument: DeepSpeed 0.19.8 ignores it where the accelerator has
        # no fp16 (CPU) and builds bf16 parameters; with none, the config (no fp16/bf16 section) says fp32.
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = GPT(cfg.model, config_mod.padded_vocab_size(cfg.model, train_set.vocab_size))
        # A partition swapped out to NVMe holds a placeholder (a half scalar); its swapper's dtype is the real one.
        wrong = {
            str(
                p.nvme_swapper.dtype
                if getattr(p.ds_tensor, "final_location", None) == "nvme"
                else p.ds_tensor.dtype
            )
            for p in model.parameters()
        } - {"torch.float32"}
        assert not wrong, f"DeepSpeed built {wrong} parameters; this bench compares fp32"
        set_rope_buffers(
            model, cfg.model, torch.device("cpu")
        )  # exact tables (zero.Init casts tensors it creates)
        for (
            name,
            p,
        ) in model.named_parameters():  # Strata's initial values, one whole parameter at a time
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if self.rank == 0:
                    p.data.copy_(initial_value(cfg.model, name, tuple(p.ds_shape), cfg.train.seed))
        # Strata's AdamW and weight-decay groups; a partitioned parameter's own shape is empty, its
        # ds_shape is the real one.
        params = list(model.parameters())
        self.opt = build_optimizer(
            params, cfg.optim, torch.device("cpu"), shape_of=lambda p: tuple(p.ds_shape)
        )
        if self.args.ds_optimizer == "cpu_adam":
            self.opt = deepspeed_cpu_adam(self.opt)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.opt, config=ds)
        self.loader = BatchLoader(
            train_set,
            cfg.train.seed,
            cfg.train.global_batch_size,
            cfg.train.micro_batch_size,
            self.rank,
            self.world,
        )
        self.step_index = 0
        self.n_params = sum(int(p.ds_numel) for p in params)

    def train_step(self) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step_index, self.cfg.optim, self.cfg.train.steps)
        micro_batches = self.loader.next_step()
        loss_sum = torch.zeros(())
        for batch in micro_batches:
            loss = lm_loss(self.engine(batch.inputs), batch.targets)
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            self.engine.step()  # steps the optimizer only at the accumulation boundary
            loss_sum += loss.detach()
        loss_sum /= len(micro_batches) * self.world
        dist.all_reduce(loss_sum)
        self.step_index += 1
        return loss_sum.item()

    def held(self) -> dict:
        """Bytes this rank holds after the run, measured like Strata's `held_bytes`: parameter
        partitions, the partitioned gradient buffer, optimizer state."""
        from strata.parallel.flat_group import storage_bytes
        from strata.parallel.zero import optimizer_state_bytes

        zero = self.engine.optimizer
        return {
            "params": storage_bytes([p.ds_tensor for p in self.engine.module.parameters()]),
            "grads": storage_bytes([getattr(zero, "grad_partitions_flat_buffer", None)]),
            "optim": optimizer_state_bytes(self.opt),
        }

    def label(self) -> str:
        label = f"deepspeed {self.deepspeed.__version__} ZeRO-3"
        if self.offload:
            label += " offload " + ", ".join(f"{k} {v}" for k, v in self.offload.items())
            label += f" ({type(self.opt).__name__}"
            if "sub_group_size" in self.ds_config["zero_optimization"]:
                label += (
                    f", sub_group_size {self.ds_config['zero_optimization']['sub_group_size']:.0e}"
                )
            label += ")"
        return label

    def offload_metrics(self) -> dict:
        return {}

    def info(self) -> dict:
        """What was run: the DeepSpeed config and the optimizer class DeepSpeed stepped."""
        inner = getattr(self.engine.optimizer, "optimizer", None)
        return {
            "deepspeed_config": self.ds_config,
            "optimizer": type(self.opt).__name__,
            "engine_optimizer": type(self.engine.optimizer).__name__,
            "inner_optimizer": type(inner).__name__ if inner is not None else None,
        }


# --- Strata -------------------------------------------------------------------------------------


class StrataSide:
    def __init__(self, cfg: config_mod.Config, data_dir: Path, args: argparse.Namespace):
        from strata.parallel import runtime

        self.rt = runtime.start(cfg.parallel.backend, cfg.parallel.timeout_s)
        self.rank, self.world = self.rt.rank, self.rt.world_size
        self.cfg, self.args = cfg, args
        self.offload = {
            k: v
            for k, v in (("params", cfg.offload.params.device), ("optim", cfg.offload.optim.device))
            if v != "none"
        }

    def build(self) -> None:
        from strata.trainer.loop import Trainer

        self.trainer = Trainer(self.cfg, self.rt)
        self.n_params = count_params(self.cfg.model, self.trainer.model.vocab_size)
        if self.offload and self.tiers() is None and not self.args.allow_inactive_offload:
            raise SystemExit(
                f"strata: offload {self.offload} is configured but the trainer built no offload tiers; "
                "--allow-inactive-offload runs it anyway, as plain ZeRO-3"
            )

    def tiers(self):
        """The trainer's memory tiers (strata/offload/tiers.py), None without offload."""
        return self.trainer.model.tiers

    def offload_metrics(self) -> dict:
        """The tiers' counters (io_read_bytes, io_write_bytes, host_peak_bytes, ...), {} without them."""
        metrics = getattr(self.tiers(), "metrics", None)
        if metrics is None:
            return {}
        out = metrics() if callable(metrics) else metrics
        return json.loads(json.dumps(dict(out), default=str))  # what JSON can carry

    def train_step(self) -> float:
        loss, _ = self.trainer.train_step()
        return loss.item()

    def held(self) -> dict:
        """The trainer's own measurement after its last step (parameters, gradients, optimizer state)."""
        return dict(self.trainer.held_bytes)

    def label(self) -> str:
        zero = self.cfg.zero
        if not zero.enabled:
            return "strata plain DP"
        label = (
            f"strata ZeRO (params {zero.params.shard_over}, grads {zero.grads.shard_over}, "
            f"optim {zero.optim.shard_over})"
        )
        if self.offload:
            off = self.cfg.offload
            label += (
                " offload "
                + ", ".join(f"{k} {v}" for k, v in self.offload.items())
                + f" (host_buffer_mb {off.host_buffer_mb:g}, slab_mb {off.slab_mb:g})"
            )
            if self.tiers() is None:
                label += " NOT ACTIVE: no tiers in this tree"
        return label

    def info(self) -> dict:
        return {
            "offload_active": self.tiers() is not None,
            "optimizer": type(self.trainer.model.optimizer).__name__,
        }

    def close(self) -> None:
        """The trainer's (or else its tiers') own clean-up, where this tree has one: swap files, I/O threads."""
        close = getattr(self.trainer, "close", None) or getattr(self.tiers(), "close", None)
        if close is not None:
            close()


# --- the measured run ---------------------------------------------------------------------------


def barrier() -> None:
    """A barrier over the world; none needed in a world of one (Strata starts no process group then)."""
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=("deepspeed", "strata"), required=True)
    ap.add_argument("--out", type=Path, required=True, help="JSON written by rank 0")
    ap.add_argument("config", help="Strata YAML config")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (data.path must be set)")
    ap.add_argument(
        "--stop-after",
        type=int,
        help="train only this many of the config's steps (same LR schedule)",
    )
    ap.add_argument(
        "--save-dir",
        type=Path,
        help="deepspeed: engine.save_checkpoint(DIR) after the last step "
        "(tests/checkpoint/test_deepspeed_import.py reads it)",
    )
    ap.add_argument(
        "--ds-optimizer",
        choices=("torch", "cpu_adam"),
        default="torch",
        help="deepspeed: Strata's torch AdamW (zero_force_ds_cpu_optimizer false) or DeepSpeedCPUAdam",
    )
    ap.add_argument(
        "--ds-sub-group-size",
        type=float,
        default=None,
        help="deepspeed: zero_optimization.sub_group_size in elements (default: DeepSpeed's, 1e9)",
    )
    ap.add_argument(
        "--ds-param-buffers", type=int, default=5, help="deepspeed: offload_param.buffer_count"
    )
    ap.add_argument(
        "--ds-optim-buffers", type=int, default=12, help="deepspeed: offload_optimizer.buffer_count"
    )
    ap.add_argument(
        "--allow-inactive-offload",
        action="store_true",
        help="strata: run even when offload is configured but the trainer has no offload tiers",
    )
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = config_mod.load(args.config, args.overrides, world_size=world)
    data_dir = Path(cfg.data.path)

    side = (DeepSpeedSide if args.side == "deepspeed" else StrataSide)(cfg, data_dir, args)
    baseline = rss()
    hwm_reset = reset_peak_rss()
    hwm_start, io0 = hwm(), io_bytes()
    t0 = time.perf_counter()
    side.build()
    barrier()
    init_s = time.perf_counter() - t0
    after_init, hwm_init, io1 = rss(), hwm(), io_bytes()
    swap_after_init = dir_bytes(cfg.offload.nvme_path) if side.rank == 0 else None
    metrics_after_init = side.offload_metrics()
    hwm_reset &= reset_peak_rss()

    step_s, rss_after_step, losses = [], [], []
    for _ in range(args.stop_after or cfg.train.steps):
        t = time.perf_counter()
        losses.append(side.train_step())
        step_s.append(time.perf_counter() - t)
        rss_after_step.append(rss())
    hwm_steps, io2 = hwm(), io_bytes()
    metrics = side.offload_metrics()
    record = {
        "rank": side.rank,
        "step_s": step_s,
        "rss_baseline": baseline,
        "rss_after_init": after_init,
        "rss_after_step": rss_after_step,
        "peak_rss_lifetime": peak_rss(),
        "losses": losses,
        "init_s": init_s,
        "held": side.held(),
        "threads": torch.get_num_threads(),
        # VmHWM: the peak of the build and of the steps, each since a reset (hwm_reset: false ->
        # both are the lifetime ru_maxrss and only their max means anything)
        "hwm_reset": hwm_reset,
        "hwm_start": hwm_start,
        "hwm_init": hwm_init,
        "hwm_steps": hwm_steps,
        "io_init": delta(io1, io0),
        "io_steps": delta(io2, io1),
        "offload_metrics_after_init": metrics_after_init,
        "offload_metrics": metrics,
        "offload_metrics_steps": delta(metrics, metrics_after_init),
    }
    if args.save_dir is not None and args.side == "deepspeed":
        side.engine.save_checkpoint(str(args.save_dir))
    records = [None] * side.world
    if dist.is_initialized():
        dist.all_gather_object(records, record)
    else:
        records = [record]
    barrier()  # every rank's steps are done: its swap files are as large as they get
    if side.rank == 0:
        args.out.write_text(
            json.dumps(
                {
                    "side": args.side,
                    "label": side.label(),
                    "world": side.world,
                    "n_params": side.n_params,
                    "torch": torch.__version__,
                    "swap_after_init": swap_after_init,
                    "swap_after_steps": dir_bytes(cfg.offload.nvme_path),
                    "info": side.info(),
                    "ranks": records,
                }
            )
        )
    barrier()
    if hasattr(side, "close"):
        side.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
