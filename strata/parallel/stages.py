"""Which layers each pipeline stage runs and which stages each pipeline rank holds: the pure
arithmetic of pipeline parallelism, apart from the schedules that run it (`parallel.pipeline`,
which loads torch's pipelining) so that planning a layout loads none of that.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.config.vocabulary import V_SHAPED_SCHEDULES


def schedule_name(requested: str, virtual_stages: int) -> str:
    """The pipeline schedule to run: `requested`, or for "auto" 1F1B with one stage per rank and
    interleaved 1F1B with virtual stages."""
    if requested != "auto":
        return requested
    return "1f1b" if virtual_stages == 1 else "interleaved_1f1b"


def stage_indices(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The global stage indices this pipeline rank runs, in execution order."""
    if schedule in V_SHAPED_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages)]


@dataclass(frozen=True)
class StagePlan:
    """Stage `index` of `num_stages` runs layers [first_layer, first_layer + n_layers)."""

    index: int
    num_stages: int
    first_layer: int
    n_layers: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.n_layers)


def plan_stages(n_layers: int, num_stages: int, indices: list[int]) -> list[StagePlan]:
    """Equal layer counts per stage (config validation guarantees divisibility)."""
    per = n_layers // num_stages
    return [StagePlan(i, num_stages, i * per, per) for i in indices]
