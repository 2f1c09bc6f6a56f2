"""Pipeline-schedule benchmark: the bubble of torch's real schedules on synthetic, fixed-time stages.

A real gloo world of `--pp` processes (torch.multiprocessing spawn) runs one training step after
another through `torch.distributed.pipelining` schedules:

* `1F1B` (Schedule1F1B): one stage per rank (V=1);
* `Interleaved1F1B` (ScheduleInterleaved1F1B): V=2 stages per rank, looped map (rank r owns r, r+P);
* `InterleavedZeroBubble` (ScheduleInterleavedZeroBubble, ZB1P): same map, backward split into I and W;
* `ZBVZeroBubble` (ScheduleZBVZeroBubble): V=2, V-shaped map (rank r owns r and 2P-1-r), split backward.

Every stage is a `PipelineStage` around a synthetic module whose work is `time.sleep`, so the two
CPU cores of a small machine cannot distort it: per micro-batch a stage's forward sleeps t_f/V and
its backward t_b/V (interleaved chunks are 1/V of a rank's layers, so every schedule does the same
work per rank). The backward is two autograd nodes -- an input-gradient node (sleeps
(1-w)·t_b/V) and a weight-gradient node on the parameter's branch (sleeps w·t_b/V, w =
`--w-fraction`) -- so torch's `stage_backward_input` (autograd.grad w.r.t. the stage inputs)
runs only the first and `stage_backward_weight` (autograd.grad from the saved intermediates to the
parameters) runs only the second, exactly as in a real layer whose dW is deferred. A full backward
runs both. Tensors are tiny, so communication is negligible next to the sleeps. (torch runs no dI
on the first stage -- its input needs no gradient -- so there the whole backward moves into W.)

Each compute action the schedule runs (F, B, W) is timed around the stage's `forward_one_chunk`,
`backward_one_chunk` and `backward_weight_one_chunk` (B = the backward that produces the input
gradient: the full backward, or only dI when a W for the same stage and micro-batch follows).
After a warm-up step of each, `--steps` rounds run one step of every schedule, the order rotating
from round to round, so that load from other processes on a shared machine falls on all schedules
alike. Per schedule the median step is reported, and its per-rank timeline is written as a JSON
record (`--record-dir`; `strata plot schedule RECORD.json` draws it).

Definitions (the Megatron paper's, so measured and theoretical figures compare like with like):

* bubble = idle time / compute time per rank, averaged over ranks: (step - busy_r) / busy_r.
  Theory: (P-1)/M for 1F1B, (P-1)/(V·M) for interleaved 1F1B; for the zero-bubble schedules
  (P-1)(t_F + t_B - t_W)/(V·M·(t_F+t_B+t_W)) for ZB1P (interleaved here; (P-1)/(3·V·M) at equal
  times), and for ZB-V, which the paper calls zero, the pipeline fill that no schedule can hide:
  (P-1)·t_F/(V·M·(t_F+t_B+t_W)) (see theory_bubble).
* idle fraction = 1 - busy_r / step time = bubble / (1 + bubble); `--check` compares it with theory.
* replay = the step time of the recorded per-rank action order with the recorded durations and
  instant communication (a critical-path replay): the bubble torch's schedule itself implies,
  apart from any runtime overhead.

    python bench/pipeline_schedule.py                  # P=4, M=8, t_f=20 ms, t_b=40 ms (~20 s)
    python bench/pipeline_schedule.py --check          # exit 1 unless interleaved beats 1F1B and every
                                                       # idle fraction is within ±0.05 + 25 % of theory
    python bench/pipeline_schedule.py --record-dir runs/pp-schedule
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import pipelining

from strata.net import free_port
from strata.parallel import comm

WIDTH = 16  # elements per micro-batch row: tiny, so communication is negligible
ABS_TOL, REL_TOL = 0.05, 0.25


@dataclass(frozen=True)
class ScheduleSpec:
    cls: str  # class name in torch.distributed.pipelining
    virtual: int  # stages per rank (V)
    style: str  # stage-to-rank map: "loop" (r, r+P, ...) or "v" (r, 2P-1-r)
    split_backward: bool


SCHEDULES: dict[str, ScheduleSpec] = {
    "1F1B": ScheduleSpec("Schedule1F1B", 1, "loop", False),
    "Interleaved1F1B": ScheduleSpec("ScheduleInterleaved1F1B", 2, "loop", False),
    "InterleavedZeroBubble": ScheduleSpec("ScheduleInterleavedZeroBubble", 2, "loop", True),
    "ZBVZeroBubble": ScheduleSpec("ScheduleZBVZeroBubble", 2, "v", True),
}


def stages_of_rank(rank: int, pp: int, virtual: int, style: str) -> list[int]:
    """Global stage indices owned by `rank` (ascending)."""
    if style == "v":
        return sorted(rank if k % 2 == 0 else (k + 1) * pp - 1 - rank for k in range(virtual))
    return [k * pp + rank for k in range(virtual)]


def theory_bubble(
    name: str, pp: int, microbatches: int, t_f: float, t_bi: float, t_w: float
) -> float:
    """Bubble time / compute time per rank that theory gives for `name` (t_f, t_bi, t_w: forward,
    input-gradient and weight-gradient seconds per micro-batch and rank).

    1F1B and interleaved: (P-1)/(V·M) (Narayanan et al. 2021). Zero bubble (Qi et al. 2024): ZB-H1/ZB1P
    leaves (P-1)(t_F + t_B - t_W) per rank, 1/V of it with V interleaved chunks -- (P-1)/(3·V·M) at
    equal times; ZB-V's "zero" counts only the steady state: no schedule can hide the pipeline fill,
    the last rank waiting (P-1) chunk forwards, (P-1)·t_f/V, for its first input. That fill is a lower
    bound for every schedule, and the figure used for ZB-V."""
    spec, total = SCHEDULES[name], t_f + t_bi + t_w
    fill = (pp - 1) * t_f / (spec.virtual * microbatches * total)
    if not spec.split_backward:
        return (pp - 1) / (spec.virtual * microbatches)
    if spec.style == "v":
        return fill
    return max(fill, (pp - 1) * (t_f + t_bi - t_w) / (spec.virtual * microbatches * total))


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps `fwd_s` and whose backward sleeps `bwd_s`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        if fwd_s > 0:
            time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.bwd_s > 0:
            time.sleep(ctx.bwd_s)
        return grad.clone(), None, None


class SyntheticStage(nn.Module):
    """out = sleep_I(x) + sleep_W(weight): the input branch carries the forward time and the
    input-gradient time, the weight branch the weight-gradient time. torch's split backward finds
    the add as the intermediate joining the two, so dI and dW run disjoint sleeps."""

    def __init__(self, t_f: float, t_bi: float, t_w: float):
        super().__init__()
        self.t_f, self.t_bi, self.t_w = t_f, t_bi, t_w
        self.weight = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:  # first stage: its layers still pass activation gradients down
            x = x.detach().requires_grad_()
        return _Sleep.apply(x, self.t_f, self.t_bi) + _Sleep.apply(self.weight, 0.0, self.t_w)


class TimedStage(pipelining.PipelineStage):
    """A PipelineStage that logs (kind, stage, micro-batch, start, end) of every compute action."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.log: list[dict[str, Any]] = []

    def _timed(self, kind: str, mb: int, fn, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        out = fn(mb, *args, **kwargs)
        self.log.append(
            {
                "kind": kind,
                "stage": self.stage_index,
                "mb": mb,
                "start": start,
                "end": time.perf_counter(),
            }
        )
        return out

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        return self._timed("F", fwd_chunk_id, super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        return self._timed("B", bwd_chunk_id, super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        return self._timed("W", bwd_chunk_id, super().backward_weight_one_chunk, *args, **kwargs)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


class _Runner:
    """One schedule on this rank: its stages, its torch schedule object and its inputs."""

    def __init__(self, name: str, rank: int, cfg: dict[str, Any]):
        self.name, self.spec, self.rank, self.cfg = name, SCHEDULES[name], rank, cfg
        pp, m, v = cfg["pp"], cfg["microbatches"], self.spec.virtual
        n_stages = pp * v
        t_f, t_b = cfg["t_forward"] / v, cfg["t_backward"] / v
        t_w = t_b * cfg["w_fraction"] if self.spec.split_backward else 0.0
        own = stages_of_rank(rank, pp, v, self.spec.style)
        self.stages = [
            TimedStage(SyntheticStage(t_f, t_b - t_w, t_w), s, n_stages, torch.device("cpu"))
            for s in own
        ]
        cls = getattr(pipelining, self.spec.cls)
        self.schedule = cls(
            self.stages if v > 1 else self.stages[0], n_microbatches=m, loss_fn=_loss
        )
        x, target = torch.randn(m, WIDTH), torch.zeros(m, WIDTH)
        self.args = (x,) if 0 in own else ()
        self.target = target if n_stages - 1 in own else None

    def step(self) -> dict[str, Any] | None:
        """One timed step on every rank (collective); rank 0 gets the step's record."""
        for st in self.stages:
            st.log.clear()
        comm.barrier()
        t0 = time.perf_counter()
        self.schedule.step(*self.args, target=self.target)
        t1 = time.perf_counter()
        mine = {
            "start": t0,
            "end": t1,
            "actions": sorted((a for st in self.stages for a in st.log), key=lambda a: a["start"]),
        }
        everyone = comm.gather_objects(mine, dist.group.WORLD, dst=0)
        if self.rank != 0:
            return None
        pp, v = self.cfg["pp"], self.spec.virtual
        origin = min(r["start"] for r in everyone)  # perf_counter: one monotonic clock for the host
        return {
            "schedule": self.name,
            "torch_class": self.spec.cls,
            "pp": pp,
            "virtual_stages": v,
            "microbatches": self.cfg["microbatches"],
            "stage_map": {
                str(s): r for r in range(pp) for s in stages_of_rank(r, pp, v, self.spec.style)
            },
            "t_forward": self.cfg["t_forward"],
            "t_backward": self.cfg["t_backward"],
            "w_fraction": self.cfg["w_fraction"] if self.spec.split_backward else 0.0,
            "ranks": [
                [
                    {**a, "start": a["start"] - origin, "end": a["end"] - origin}
                    for a in r["actions"]
                ]
                for r in everyone
            ],
            "step_time": max(r["end"] for r in everyone) - origin,
        }


def _worker(rank: int, cfg: dict[str, Any], port: int, out_path: str) -> None:
    """One pipeline rank: warm up every schedule, then `steps` rounds of one step per schedule, the
    order rotating each round so that load from other processes falls on all schedules alike."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group(
        "gloo", rank=rank, world_size=cfg["pp"], timeout=datetime.timedelta(seconds=cfg["timeout"])
    )
    try:
        names = list(cfg["schedules"])
        runners = {name: _Runner(name, rank, cfg) for name in names}
        for name in names:
            for _ in range(cfg["warmup"]):
                runners[name].step()
        records: dict[str, list] = {name: [] for name in names}
        for i in range(cfg["steps"]):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                records[name].append(runners[name].step())
        if rank == 0:
            Path(out_path).write_text(json.dumps(records))
        comm.barrier()
    finally:
        dist.destroy_process_group()


def measure(cfg: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Run every schedule in cfg["schedules"] in one spawned gloo world of cfg["pp"] processes;
    returns, per schedule, one record per measured step."""
    with tempfile.TemporaryDirectory(prefix="strata-pp-bench-") as tmp:
        out = Path(tmp) / "records.json"
        mp.spawn(_worker, args=(cfg, free_port(), str(out)), nprocs=cfg["pp"], join=True)
        return json.loads(out.read_text())


def busy_times(record: dict[str, Any]) -> list[float]:
    """Seconds each rank spent inside compute actions during the recorded step."""
    return [sum(a["end"] - a["start"] for a in actions) for actions in record["ranks"]]


def idle_fractions(record: dict[str, Any]) -> list[float]:
    """1 - busy / step time, per rank."""
    return [1 - b / record["step_time"] for b in busy_times(record)]


def bubble(record: dict[str, Any], step_time: float | None = None) -> float:
    """Mean over ranks of idle / busy time (the Megatron definition of the bubble fraction)."""
    step = record["step_time"] if step_time is None else step_time
    return statistics.mean((step - b) / b for b in busy_times(record))


def replay_step_time(record: dict[str, Any]) -> float:
    """Step time of the recorded per-rank action order, each action taking its recorded duration,
    with instant communication. Dependencies: F(s,m) after F(s-1,m); B(s,m) after B(s+1,m) (the last
    stage: after its F); W(s,m) after B(s,m); each rank runs its actions in recorded order."""
    last = record["pp"] * record["virtual_stages"] - 1
    queues = [list(actions) for actions in record["ranks"]]
    free, done = [0.0] * len(queues), {}

    def deps(a: dict[str, Any]) -> list[tuple[str, int, int]]:
        s, m = a["stage"], a["mb"]
        if a["kind"] == "F":
            return [("F", s - 1, m)] if s > 0 else []
        if a["kind"] == "B":
            return [("F", s, m)] + ([("B", s + 1, m)] if s < last else [])
        return [("B", s, m)]

    while any(queues):
        progressed = False
        for r, q in enumerate(queues):
            while q and all(d in done for d in deps(q[0])):
                a = q.pop(0)
                start = max([free[r]] + [done[d] for d in deps(a)])
                free[r] = done[(a["kind"], a["stage"], a["mb"])] = start + a["end"] - a["start"]
                progressed = True
        if not progressed:
            raise RuntimeError(
                f"{record['schedule']}: recorded order deadlocks on {[q[0] for q in queues if q]}"
            )
    return max(free)


def summarize(
    records: list[dict[str, Any]], pp: int, m: int, t_f: float, t_b: float
) -> dict[str, Any]:
    """Figures of one schedule from its measured steps; `record` is the median step's record."""
    record = sorted(records, key=lambda r: r["step_time"])[len(records) // 2]
    replay = replay_step_time(record)
    record = {**record, "idle_fraction": idle_fractions(record), "replay_step_time": replay}
    w = record["w_fraction"]
    theory = theory_bubble(record["schedule"], pp, m, t_f, t_b * (1 - w), t_b * w)
    return {
        "schedule": record["schedule"],
        "V": record["virtual_stages"],
        "record": record,
        "step_time": record["step_time"],
        "step_times": [r["step_time"] for r in records],
        "idle": statistics.mean(record["idle_fraction"]),
        "bubble": bubble(record),
        "replay_bubble": bubble(record, replay),
        "theory": theory,
        "theory_idle": theory / (1 + theory),
    }


def within(measured: float, theory: float) -> bool:
    """The --check tolerance: ±ABS_TOL absolute plus REL_TOL of the theoretical value."""
    return abs(measured - theory) <= ABS_TOL + REL_TOL * theory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (processes), P")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step, M")
    p.add_argument(
        "--t-forward", type=float, default=0.02, help="forward seconds per micro-batch per rank"
    )
    p.add_argument(
        "--t-backward", type=float, default=0.04, help="backward seconds per micro-batch per rank"
    )
    p.add_argument(
        "--w-fraction",
        type=float,
        default=0.5,
        help="share of the backward that is weight-gradient work (deferred as W by zero-bubble "
        "schedules)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="measured rounds, one step of each schedule per round (the median step is reported)",
    )
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per schedule first")
    p.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        help=f"comma-separated subset of {', '.join(SCHEDULES)}",
    )
    p.add_argument(
        "--record-dir", type=Path, help="write the median step's timeline per schedule here (JSON)"
    )
    p.add_argument(
        "--timeout", type=int, default=60, help="process-group timeout (s): a hang fails fast"
    )
    p.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 unless interleaved beats 1F1B and each schedule's idle fraction is within "
        f"±{ABS_TOL} + {REL_TOL * 100:.0f}%% of theory",
    )  # argparse %-formats help
    args = p.parse_args(argv)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"--schedules: unknown {unknown}; valid: {', '.join(SCHEDULES)}")
    if args.pp < 2 or args.microbatches < 1 or args.steps < 1 or not 0 <= args.w_fraction <= 1:
        p.error("need --pp >= 2, --microbatches >= 1, --steps >= 1 and 0 <= --w-fraction <= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pp, m, t_f, t_b = args.pp, args.microbatches, args.t_forward, args.t_backward
    cfg = {
        "pp": pp,
        "microbatches": m,
        "t_forward": t_f,
        "t_backward": t_b,
        "w_fraction": args.w_fraction,
        "steps": args.steps,
        "warmup": args.warmup,
        "schedules": args.schedules,
        "timeout": args.timeout,
    }
    print(
        f"bench/pipeline_schedule: P={pp} ranks (gloo, spawn), M={m} micro-batches, per "
        "micro-batch and rank "
        f"t_f={t_f * 1e3:g} ms, t_b={t_b * 1e3:g} ms (W share {args.w_fraction:g} in zero-bubble "
        "schedules); "
        f"ideal compute M·(t_f+t_b) = {m * (t_f + t_b) * 1e3:.0f} ms; {args.warmup} warm-up "
        "step(s) each + "
        f"{args.steps} measured rounds; torch {torch.__version__}"
    )
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    results = {name: summarize(recs, pp, m, t_f, t_b) for name, recs in measure(cfg).items()}
    elapsed = time.perf_counter() - t0

    header = (
        f"{'schedule':<22} {'V':>2} {'step ms':>8} {'idle':>6} {'idle th':>7} {'bubble':>7} "
        f"{'theory':>7} {'replay':>7}"
    )
    print(f"\n{header}\n{'-' * len(header)}")
    for r in results.values():
        print(
            f"{r['schedule']:<22} {r['V']:>2} {r['step_time'] * 1e3:>8.1f} {r['idle']:>6.3f} "
            f"{r['theory_idle']:>7.3f} {r['bubble']:>7.3f} {r['theory']:>7.3f} "
            f"{r['replay_bubble']:>7.3f}"
        )
    print(
        "  step: median of the measured steps; idle: mean over ranks of 1 - busy/step (idle th = "
        "theory/(1+theory))\n"
        "  bubble: mean over ranks of idle/busy; theory: (P-1)/(V·M) for 1F1B and interleaved,\n"
        "  ZB1P (P-1)(t_F+t_B-t_W)/(V·M·(t_F+t_B+t_W)), ZBV the pipeline fill "
        "(P-1)·t_F/(V·M·(t_F+t_B+t_W)) "
        "(paper: 'zero')\n  replay: the bubble of torch's recorded action order with the recorded "
        "durations and "
        "instant communication"
    )

    failures = []
    if "1F1B" in results and "Interleaved1F1B" in results:
        v = SCHEDULES["Interleaved1F1B"].virtual
        ratio = results["Interleaved1F1B"]["step_time"] / results["1F1B"]["step_time"]
        rounds = [
            a / b
            for a, b in zip(results["Interleaved1F1B"]["step_times"], results["1F1B"]["step_times"])
        ]
        expect = (1 + (pp - 1) / (v * m)) / (1 + (pp - 1) / m)
        print(
            f"\ninterleaved/1F1B step-time ratio = {ratio:.3f} (theory {expect:.3f}; per round "
            f"{min(rounds):.3f}-{max(rounds):.3f}); throughput gain {1 / ratio - 1:+.1%} "
            f"(theory {1 / expect - 1:+.1%})"
        )
        if ratio >= 1:
            failures.append(f"interleaved is not faster than 1F1B (ratio {ratio:.3f})")
    for r in results.values():
        if not within(r["idle"], r["theory_idle"]):
            failures.append(
                f"{r['schedule']}: idle fraction {r['idle']:.3f} vs theory {r['theory_idle']:.3f}"
            )
    if args.record_dir:
        args.record_dir.mkdir(parents=True, exist_ok=True)
        for name, r in results.items():
            (args.record_dir / f"{name.lower()}.json").write_text(json.dumps(r["record"], indent=1))
        print(f"records: {args.record_dir}/{{{','.join(n.lower() for n in results)}}}.json")
    load_end, cpus = os.getloadavg()[0], os.cpu_count() or 1
    busy_note = (
        " (busy machine: wake-up delays inflate the bubbles)"
        if max(load_start, load_end) > cpus
        else ""
    )
    print(
        f"elapsed {elapsed:.1f} s; 1-min load average {load_start:.2f} -> {load_end:.2f} on "
        f"{cpus} CPUs{busy_note}"
    )
    if failures:
        print("outside the expected range:\n  " + "\n  ".join(failures))
    return 1 if args.check and failures else 0


if __name__ == "__main__":
    sys.exit(main())
