"""The planner's tables as text: one layout's memory by kind and tier and its step time by part,
a search's ranking, and the one-line warning `strata launch` and `strata config show` print."""

from __future__ import annotations

import functools
import re

from strata.config.schema import Config
from strata.plan.cluster import LINKS, Cluster
from strata.plan.memory import (
    KINDS,
    TIERS,
    MemoryEstimate,
    gib,
    layout_of,
    micro_batches,
    zero_levels,
)
from strata.plan.search import Candidate, SearchResult
from strata.plan.timing import TimeEstimate


def layout_line(cfg: Config, cluster: Cluster) -> str:
    """One line describing the layout the planner models: tp, pp, virtual stages, dp, micro-batches,
    ZeRO levels, offload and activation settings."""
    par, lv, layout = cfg.parallel, zero_levels(cfg), layout_of(cfg, cluster)
    dp, m = layout.data_parallel, micro_batches(cfg, layout)
    zero = (
        "off"
        if lv["params"] == lv["grads"] == lv["optim"] == "none"
        else (
            f"params@{lv['params']} grads@{lv['grads']} optim@{lv['optim']}"
            + (f" secondary@{lv['secondary']}" if lv["secondary"] != "none" else "")
        )
    )
    context = f" cp={par.cp}" if par.cp > 1 else ""
    return (
        f"tp={par.tp} pp={par.pp} V={par.virtual_stages}{context} dp={dp}; micro-batch "
        f"{cfg.train.micro_batch_size} × {m}; zero {zero}; offload "
        f"params={cfg.offload.params.device} optim={cfg.offload.optim.device}; activations "
        f"recompute={cfg.activations.recompute} offload={cfg.activations.offload}; precision "
        f"{cfg.train.precision}"
    )


def memory_table(memory: MemoryEstimate) -> list[str]:
    """The memory estimate as table lines: GiB per kind and tier on the fullest pipeline stage, the
    budgets, and each stage's device total when there are several."""
    worst = memory.worst("device")
    lines = [
        f"memory per rank, GiB (pipeline stage {worst.pp_rank}, the fullest)",
        f"  {'kind':<12}" + "".join(f"{t:>10}" for t in TIERS),
    ]
    for kind in KINDS:
        row = [worst.kind(kind, t) for t in TIERS]
        if any(row):
            lines.append(f"  {kind:<12}" + "".join(f"{v / 2**30:>10.3f}" for v in row))
    lines.append(f"  {'total':<12}" + "".join(f"{worst.total(t) / 2**30:>10.3f}" for t in TIERS))
    lines.append(
        f"  {'budget':<12}{memory.device_budget / 2**30:>10.3f}{memory.host_budget_per_rank / 2**30:>10.3f}"
    )
    if len(memory.stages) > 1:
        lines.append(
            "  device total by stage: "
            + ", ".join(f"{r.pp_rank}: {gib(r.total('device'))}" for r in memory.stages)
        )
    return lines


def time_table(est: TimeEstimate, tokens_per_step: int) -> list[str]:
    """The step-time estimate as table lines: each part's seconds, the step with tokens/s, TFLOP/s and
    MFU, and the bytes each link level carries."""
    lines = ["step time, s"]
    for part, seconds in est.parts.items():
        if seconds:
            lines.append(f"  {part:<12}{seconds:>10.4f}")
    lines.append(
        f"  {'step':<12}{est.step_s:>10.4f}   {est.tokens_per_s(tokens_per_step):,.0f} tokens/s, "
        f"{est.tflops_per_gpu:.1f} model TFLOP/s per rank, MFU {est.mfu:.1%}"
    )
    lines.append(
        "bytes per rank per step: "
        + ", ".join(f"{k} {est.link_bytes[k] / 2**30:.3f} GiB" for k in LINKS if est.link_bytes[k])
    )
    return lines


def search_table(result: SearchResult, cluster: Cluster, top: int, cfg: Config) -> list[str]:
    """The search's result as table lines: the `top` fitting layouts fastest first, each with the
    `key=value` overrides that select it from `cfg` (the config the search started from), then the
    layout families none of whose layouts fit, as one line per reason (how many families, and one
    of them as the example)."""
    best = result.fitting[:top]
    if not best:
        lines = [f"{len(result.fitting)} of {result.considered} layouts fit."]
    else:
        lines = [f"{len(result.fitting)} of {result.considered} layouts fit; fastest first:"]
        lines.append(
            f"  {'#':>3}  {'step s':>9}  {'MFU':>6}  {'device GiB':>10}  {'host GiB':>9}  layout"
        )
    for i, p in enumerate(best, 1):
        lines.append(
            f"  {i:>3}  {p.time.step_s:>9.4f}  {p.time.mfu:>6.1%}  "
            f"{p.memory.peak('device') / 2**30:>10.2f}  "
            f"{p.memory.peak('host') / 2**30:>9.2f}  {p.candidate.describe()}"
        )
    if best:
        lines.append("overrides that select each (after the config and its own overrides):")
        lines += [f"  {i:>3}  {layout_overrides(cfg, p.candidate)}" for i, p in enumerate(best, 1)]
    if result.rejected:
        groups: dict[str, list[tuple[tuple[int, int, int, int, int], str]]] = {}
        for family, why in result.rejected.items():
            # one line per kind of reason: every memory rejection, and each check's message
            # whatever its numbers
            kind = "memory" if why.startswith("memory:") else re.sub(r"\d+", "N", why)
            groups.setdefault(kind, []).append((family, why))
        lines.append(
            f"{len(result.rejected)} families (tp, pp, V, ep, cp) with no layout that fits, by "
            "reason:"
        )
        for same in sorted(groups.values(), key=len, reverse=True):
            (tp, pp, v, ep, cp), why = same[0]
            example = f"tp={tp} pp={pp} V={v}{f' ep={ep}' if ep > 1 else ''}"
            example += f" cp={cp}" if cp > 1 else ""
            lines.append(
                f"  {len(same):>3} × {why.split(':')[0]}, e.g. {example}: {why.split(': ', 1)[-1]}"
            )
    return lines


def layout_overrides(cfg: Config, candidate: Candidate) -> str:
    """The `key=value` overrides (YAML values, as `strata launch` and `strata plan` take them)
    that turn `cfg` into `candidate`'s layout: those of its keys whose value `cfg` does not already
    have."""
    changed = []
    for key, value in candidate.overrides().items():
        current = functools.reduce(getattr, key.split("."), cfg)
        if current != value:
            changed.append(f"{key}={_yaml_scalar(value)}")
    return " ".join(changed) or "(none: the config's own layout)"


def _yaml_scalar(value: object) -> str:
    """`value` as a YAML scalar on a command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
