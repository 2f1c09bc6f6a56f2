"""`strata ckpt reshard DIR OUT --to tp=2,pp=2,dp=2`: rewrite a checkpoint for another parallel layout,
offline. It starts the target world on this machine (torchrun, gloo) and each rank loads its part
through the same load-time resharding a resumed job uses, then saves it: the result holds one file
per target rank, so a job of that layout reads its state with one sequential read per rank.

Any checkpoint already loads into any layout (`strata train --resume`); this is for moving it once,
ahead of a job, instead of resharding at every start. It needs the run's data (the config's
`data.path`), whose size the data position is checked against.
"""

from __future__ import annotations

from pathlib import Path

from strata import config
from strata.checkpoint import integrity, store
from strata.errors import CheckpointError, StrataError
from strata.launch import torchrun
from strata.runlock import locked

TARGET_KEYS = {
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "dp": "parallel.dp",
    "vs": "parallel.virtual_stages",
}


def parse_target(spec: str) -> dict[str, int]:
    """`tp=2,pp=2,dp=2[,vs=2]` as {key: size}."""
    out = {}
    for part in filter(None, spec.split(",")):
        key, eq, value = part.partition("=")
        if (
            key.strip() not in TARGET_KEYS
            or not eq
            or not value.strip().isdigit()
            or int(value) < 1
        ):
            raise StrataError(
                f"--to {spec!r}: {part!r} is not one of {', '.join(k + '=N' for k in TARGET_KEYS)} "
                "with N a positive whole number"
            )
        out[key.strip()] = int(value)
    for key in ("tp", "pp", "dp"):
        out.setdefault(key, 1)
    return out


def reshard(src: Path, out: Path, spec: str, overrides: list[str], overwrite: bool = False) -> int:
    """Rewrite the checkpoint `src` (a step dir, or a checkpoints dir: its latest) under `out`
    (a checkpoints directory) in the layout `spec`; returns the launcher's exit code. This process
    holds `out`'s lock while the workers write; an `out` holding committed checkpoints is refused
    unless `overwrite`, and nothing in it is pruned (the workers save with keep_last 0)."""
    ckpt = store.resolve(src)
    target = parse_target(spec)
    world = target["tp"] * target["pp"] * target["dp"]
    settings = [f"{TARGET_KEYS[k]}={v}" for k, v in target.items()]
    settings += [
        "checkpoint.async=false",
        "checkpoint.keep_last=0",
        "log.progress=false",
        "log.wandb=false",
    ]
    settings += overrides
    # a layout that does not fit fails here, clearly
    config.load(ckpt / "config.yaml", settings, world_size=world)
    record = store.marker(ckpt)
    # before any worker starts
    _, damage = integrity.checkpoint_problems(ckpt, record, checksums=False)
    if damage:
        raise CheckpointError(
            f"{ckpt} is damaged, nothing was resharded:\n  " + "\n  ".join(damage)
        )
    step = record.get("step")
    with locked([(Path(out), "checkpoint directory")]):
        refusal = store.output_refusal(
            Path(out), step if isinstance(step, int) else None, overwrite, "strata ckpt reshard"
        )
        if refusal is not None:
            raise refusal
        worker = torchrun.WorkerCommand(
            str(ckpt / "config.yaml"), tuple(settings), str(ckpt), ("--save-to", str(out))
        )
        code = torchrun.run_local(torchrun.LaunchPlan(nproc_per_node=world), worker)
    if code == 0:
        print(
            f"wrote {store.committed(out)[-1]} for tp {target['tp']}, pp {target['pp']}, dp "
            f"{target['dp']}"
        )
    return code
