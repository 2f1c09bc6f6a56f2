"""One torchrun worker of bench/zero_vs_deepspeed.py: trains the Strata config it is given for
`train.steps` steps with one of two engines and measures every rank the same way.

    --side deepspeed   DeepSpeed ZeRO-3 (zero.Init, stage3_param_persistence_threshold 0, torch
                       AdamW with Strata's weight-decay groups and lr_at schedule, Strata's
                       initial values set through GatheredParameters, Strata's BatchLoader)
    --side strata      Strata's own trainer.loop.Trainer, one `train_step()` per step (ZeRO-3 when
                       the config's `zero.*` keys say so)

Each step is timed on every rank (wall clock around the whole step: data, forward/backward, the
optimizer step and the dp-averaged loss); psutil's RSS is sampled after every step and reported
above a baseline taken right after the process group is up and the engine's modules are imported,
before the model exists. Rank 0 writes one JSON with every rank's figures to --out.

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

from trainer import config as config_mod
from trainer.data import BatchLoader, TokenDataset
from trainer.loop import build_optimizer, lr_at
from trainer.model import GPT, count_params, initial_value, lm_loss, padded_vocab_size, set_rope_buffers


def rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """The process's lifetime RSS high-water mark (catches peaks inside a step), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- DeepSpeed ZeRO-3 ---------------------------------------------------------------------------

def deepspeed_config(cfg: config_mod.Config, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps(world),
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": int(25 * 2**20 / 4),  # elements
                              "stage3_prefetch_bucket_size": int(5e7),
                              # the default (1e5 elements) would leave every parameter of a small model whole
                              "stage3_param_persistence_threshold": 0},
        "zero_force_ds_cpu_optimizer": False,  # a torch optimizer, no cpu_adam build
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedSide:
    def __init__(self, cfg: config_mod.Config, data_dir: Path):
        import deepspeed
        self.deepspeed = deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cfg, self.data_dir = cfg, data_dir

    def build(self) -> None:
        cfg, deepspeed = self.cfg, self.deepspeed
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        train_set = TokenDataset(self.data_dir, "train", cfg.model.seq_len)
        ds = deepspeed_config(cfg, self.world)
        # Built partitioned. No dtype argument: DeepSpeed 0.19.8 ignores it where the accelerator has
        # no fp16 (CPU) and builds bf16 parameters; with none, the config (no fp16/bf16 section) says fp32.
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = GPT(cfg.model, padded_vocab_size(cfg.model, train_set.vocab_size))
        wrong = {str(p.ds_tensor.dtype) for p in model.parameters()} - {"torch.float32"}
        assert not wrong, f"DeepSpeed built {wrong} parameters; this bench compares fp32"
        set_rope_buffers(model, cfg.model, torch.device("cpu"))  # exact tables (zero.Init casts tensors it creates)
        for name, p in model.named_parameters():  # Strata's initial values, one whole parameter at a time
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if self.rank == 0:
                    p.data.copy_(initial_value(cfg.model, name, tuple(p.ds_shape), cfg.train.seed))
        # Strata's AdamW and weight-decay groups; a partitioned parameter's own shape is empty, its
        # ds_shape is the real one.
        params = list(model.parameters())
        self.opt = build_optimizer(params, cfg.optim, torch.device("cpu"), shape_of=lambda p: tuple(p.ds_shape))
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.opt, config=ds)
        self.loader = BatchLoader(train_set, cfg.train.seed, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                  self.rank, self.world)
        self.step_index = 0
        self.n_params = sum(int(p.ds_numel) for p in params)

    def train_step(self) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step_index, self.cfg.optim, self.cfg.train.steps)
        micro_batches = self.loader.next_step()
        loss_sum = torch.zeros(())
        for x, y in micro_batches:
            loss = lm_loss(self.engine(x), y)
            self.engine.backward(loss)  # DeepSpeed divides by the accumulation steps itself
            self.engine.step()          # steps the optimizer only at the accumulation boundary
            loss_sum += loss.detach()
        loss_sum /= len(micro_batches) * self.world
        dist.all_reduce(loss_sum)
        self.step_index += 1
        return loss_sum.item()

    def held(self) -> dict:
        """Bytes this rank holds after the run, measured like Strata's `held_bytes`: parameter
        partitions, the partitioned gradient buffer, optimizer state."""
        from parallel.zero import optimizer_state_bytes, storage_bytes
        zero = self.engine.optimizer
        return {"params": storage_bytes([p.ds_tensor for p in self.engine.module.parameters()]),
                "grads": storage_bytes([getattr(zero, "grad_partitions_flat_buffer", None)]),
                "optim": optimizer_state_bytes(self.opt)}

    def label(self) -> str:
        return f"deepspeed {self.deepspeed.__version__} ZeRO-3"


# --- Strata -------------------------------------------------------------------------------------

class StrataSide:
    def __init__(self, cfg: config_mod.Config, data_dir: Path):
        from parallel import runtime
        self.rt = runtime.start(cfg.parallel.backend, cfg.parallel.timeout_s)
        self.rank, self.world = self.rt.rank, self.rt.world_size
        self.cfg = cfg

    def build(self) -> None:
        from trainer.loop import Trainer
        self.trainer = Trainer(self.cfg, self.rt)
        self.n_params = count_params(self.cfg.model, self.trainer.vocab_size)

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
        return (f"strata ZeRO (params {zero.params.shard_over}, grads {zero.grads.shard_over}, "
                f"optim {zero.optim.shard_over})")


# --- the measured run ---------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=("deepspeed", "strata"), required=True)
    ap.add_argument("--out", type=Path, required=True, help="JSON written by rank 0")
    ap.add_argument("config", help="Strata YAML config")
    ap.add_argument("overrides", nargs="*", help="key=value overrides (data.path must be set)")
    ap.add_argument("--stop-after", type=int, help="train only this many of the config's steps (same LR schedule)")
    ap.add_argument("--save-dir", type=Path, help="deepspeed: engine.save_checkpoint(DIR) after the last step "
                                                   "(tests/test_deepspeed_import.py reads it)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = config_mod.load(args.config, args.overrides, world_size=world)
    data_dir = Path(cfg.data.path)

    side = (DeepSpeedSide if args.side == "deepspeed" else StrataSide)(cfg, data_dir)
    baseline = rss()
    t0 = time.perf_counter()
    side.build()
    dist.barrier()
    init_s = time.perf_counter() - t0
    after_init = rss()

    step_s, rss_after_step, losses = [], [], []
    for _ in range(args.stop_after or cfg.train.steps):
        t = time.perf_counter()
        losses.append(side.train_step())
        step_s.append(time.perf_counter() - t)
        rss_after_step.append(rss())
    record = {"rank": side.rank, "step_s": step_s, "rss_baseline": baseline, "rss_after_init": after_init,
              "rss_after_step": rss_after_step, "peak_rss_lifetime": peak_rss(), "losses": losses,
              "init_s": init_s, "held": side.held(), "threads": torch.get_num_threads()}
    if args.save_dir is not None and args.side == "deepspeed":
        side.engine.save_checkpoint(str(args.save_dir))
    records = [None] * side.world
    dist.all_gather_object(records, record)
    if side.rank == 0:
        args.out.write_text(json.dumps({"side": args.side, "label": side.label(), "world": side.world,
                                        "n_params": side.n_params, "torch": torch.__version__,
                                        "ranks": records}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
