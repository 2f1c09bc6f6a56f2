"""Pictures: a run's loss and throughput curves (from its metrics.jsonl), and the per-rank timeline of
one recorded pipeline step (a schedule record written by bench/pipeline_schedule.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from strata.errors import StrataError

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl (none if it has none). A cut-off last line (the run was
    stopped mid-write) is left out with a note; a damaged line before it is a StrataError naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(
            f"strata plot: cannot read {path} as UTF-8 text ({e}); pass a run directory"
        ) from e
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    records = []
    for n, line in numbered:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif (n, line) == numbered[-1]:
            print(
                f"strata plot: {path} line {n} is cut off (the run stopped mid-write); plotting "
                "the rest",
                file=sys.stderr,
            )
        else:
            raise StrataError(
                f"strata plot: {path} line {n} is not a JSON record: {line[:60]!r}; fix or delete "
                "that line"
            )
    return records


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write a PNG with train/eval loss and tokens/s against step; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if _numbers(r, "step", "loss")]
    evals = [r for r in records if _numbers(r, "step", "eval_loss")]
    if not train and not evals:
        raise StrataError(
            f"strata plot: no metrics in {Path(run_dir) / 'metrics.jsonl'}; pass a run directory "
            "written by `strata train` (e.g. runs/tiny)"
        )
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval"
        )
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_tput.plot([r["step"] for r in train], [r.get("tokens_per_s", 0) for r in train])
    ax_tput.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _numbers(record: dict[str, Any], *keys: str) -> bool:
    """Whether every key of `record` holds a number (a record without them is not plotted)."""
    return all(
        isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)
        for k in keys
    )


SCHEDULE_COLORS = {
    "F": ("#1f5fa8", "#7fb0e6"),
    "B": ("#2e8b3a", "#93d69b"),
    "W": ("#c0701a", "#f2b877"),
}


class _Schedule(NamedTuple):
    """One recorded pipeline step: the record, and what the timeline reads of it."""

    record: dict[str, Any]
    ranks: int
    step_time: float  # seconds
    pp: int
    actions: list[tuple[int, str, int, int, float, float]]  # (rank, kind, stage, mb, start, end)


def _read_schedule(record_path: Path) -> _Schedule:
    """The schedule record at `record_path`; a StrataError naming the file where it is not one or
    has an action kind other than F, B and W."""
    try:
        record = json.loads(record_path.read_text())
        ranks, step_time, pp = record["ranks"], float(record["step_time"]), int(record["pp"])
        actions = [
            (r, a["kind"], int(a["stage"]), int(a["mb"]), float(a["start"]), float(a["end"]))
            for r, rank_actions in enumerate(ranks)
            for a in rank_actions
        ]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StrataError(
            f"strata plot schedule: {record_path} is not a schedule record ({e!r}); pass a JSON "
            "file written by `python bench/pipeline_schedule.py --record-dir DIR`"
        ) from e
    unknown = sorted({kind for _, kind, *_ in actions} - set(SCHEDULE_COLORS))
    if unknown:
        raise StrataError(
            f"strata plot schedule: {record_path} has action kinds {unknown}; valid: F, B, W"
        )
    return _Schedule(record, len(ranks), step_time, pp, actions)


def _draw_actions(ax: Axes, schedule: _Schedule) -> None:
    """One box per action in its rank's row, coloured by kind (darker for a rank's first chunk,
    stage < pp), labelled stage.micro-batch where it is wide enough to hold the label."""
    pp, step_time = schedule.pp, schedule.step_time
    for rank, kind, stage, mb, start, end in schedule.actions:
        color = SCHEDULE_COLORS[kind][0 if stage < pp else 1]
        ax.broken_barh(
            [(start * 1e3, (end - start) * 1e3)],
            (rank - 0.4, 0.8),
            facecolors=color,
            edgecolors="black",
            linewidth=0.4,
        )
        if end - start > 0.012 * step_time:  # label boxes wide enough to hold it
            ax.text(
                (start + end) / 2 * 1e3,
                rank,
                f"{stage}.{mb}",
                ha="center",
                va="center",
                fontsize=6,
                color="white" if stage < pp else "black",
                clip_on=True,
            )


def _schedule_legend(ax: Axes, ranks: int) -> None:
    """The F/B/W legend, below the axes."""
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color=SCHEDULE_COLORS[k][0], label=label)
            for k, label in (
                ("F", "F forward"),
                ("B", "B backward (dI, or full)"),
                ("W", "W weight grad"),
            )
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if ranks < 4 else -0.12),
        ncol=3,
        fontsize=8,
    )


def plot_schedule(record_path: Path, out: Path | None = None) -> Path:
    """Write a per-rank timeline PNG of one recorded pipeline step (a JSON record written by
    bench/pipeline_schedule.py: {"schedule", "pp", "virtual_stages", "microbatches", "ranks":
    [[{"kind", "stage", "mb", "start", "end"}, ...] per rank], "step_time"}); returns its path.
    One row per rank; F/B/W boxes labelled stage.micro-batch, darker for a rank's first chunk
    (stage < pp) and lighter for later chunks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record_path = Path(record_path)
    schedule = _read_schedule(record_path)
    record, ranks, step_time = schedule.record, schedule.ranks, schedule.step_time
    fig, ax = plt.subplots(figsize=(14, 0.7 * ranks + 1.6))
    _draw_actions(ax, schedule)
    for rank, idle in enumerate(record.get("idle_fraction", [])):
        ax.text(step_time * 1e3, rank, f" idle {idle:.0%}", ha="left", va="center", fontsize=8)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, step_time * 1e3 * 1.07)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_xlabel("time in step (ms)   —   box label: stage.micro-batch")
    _schedule_legend(ax, ranks)
    ax.set_title(
        f"{record.get('schedule', '?')}: P={schedule.pp}, V={record.get('virtual_stages', '?')}, "
        f"M={record.get('microbatches', '?')}, step {step_time * 1e3:.0f} ms"
    )
    fig.tight_layout()
    out = Path(out) if out else record_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
