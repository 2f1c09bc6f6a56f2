"""bench/pipeline_schedule.py end to end: a real 4-process gloo world runs torch's 1F1B, interleaved
1F1B and zero-bubble schedules on sleep-timed synthetic stages; the tests read the per-rank
timelines it records and check them against the pipeline's rules and the 1F1B bubble formula,
then render one with `strata plot schedule`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from worlds import REPO, strata

pytestmark = pytest.mark.slow  # one 4-process gloo world runs every schedule (module fixture)

# M = 4 keeps the run short and the interleaving gain large next to scheduling noise on a busy machine:
# interleaving saves (P-1)(t_f+t_b)(1-1/V) whatever M is, while its extra actions and hops grow with M.
P, M = 4, 4
NAMES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


def run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("pp-bench")
    proc = run(
        "bench/pipeline_schedule.py",
        "--pp",
        str(P),
        "--microbatches",
        str(M),
        "--t-forward",
        "0.03",
        "--t-backward",
        "0.06",
        "--steps",
        "3",
        "--timeout",
        "60",
        "--record-dir",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interleaved/1F1B step-time ratio" in proc.stdout
    return {name: json.loads((out / f"{name.lower()}.json").read_text()) for name in NAMES}


def busy(actions: list[dict]) -> float:
    return sum(a["end"] - a["start"] for a in actions)


@pytest.mark.parametrize("name", NAMES)
def test_each_stage_and_microbatch_runs_forward_and_backward_once_on_its_owner(records, name):
    rec = records[name]
    assert (rec["pp"], rec["microbatches"], len(rec["ranks"])) == (P, M, P)
    n_stages = P * rec["virtual_stages"]
    everything = Counter((s, m) for s in range(n_stages) for m in range(M))
    owner: dict[int, int] = {}
    for rank, actions in enumerate(rec["ranks"]):
        for a in actions:
            assert owner.setdefault(a["stage"], rank) == rank, (
                f"stage {a['stage']} runs on two ranks"
            )
    assert sorted(owner) == list(range(n_stages))
    assert Counter(owner.values()) == {r: rec["virtual_stages"] for r in range(P)}
    if name == "ZBVZeroBubble":  # the V-shaped map: rank r owns stages r and 2P-1-r
        assert all(owner[r] == owner[2 * P - 1 - r] == r for r in range(P))
    for kind in ("F", "B"):
        assert (
            Counter(
                (a["stage"], a["mb"]) for acts in rec["ranks"] for a in acts if a["kind"] == kind
            )
            == everything
        )
    weights = Counter(
        (a["stage"], a["mb"]) for acts in rec["ranks"] for a in acts if a["kind"] == "W"
    )
    # zero-bubble schedules split every backward into B (input grad) and a later W (weight grad)
    assert weights == (everything if "ZeroBubble" in name else Counter())


@pytest.mark.parametrize("name", NAMES)
def test_timeline_is_sequential_per_rank_and_respects_data_dependencies(records, name):
    rec = records[name]
    last = P * rec["virtual_stages"] - 1
    for actions in rec["ranks"]:
        ordered = sorted(actions, key=lambda a: a["start"])
        assert all(0 <= a["start"] <= a["end"] <= rec["step_time"] for a in ordered)
        assert all(a["end"] <= b["start"] for a, b in zip(ordered, ordered[1:])), (
            "overlapping actions on one rank"
        )
    at = {(a["kind"], a["stage"], a["mb"]): a for acts in rec["ranks"] for a in acts}
    for (kind, s, m), a in at.items():
        before = {
            "F": [("F", s - 1, m)] if s > 0 else [],
            "B": [("F", s, m)] + ([("B", s + 1, m)] if s < last else []),
            "W": [("B", s, m)],
        }[kind]
        assert all(at[d]["end"] <= a["start"] for d in before), (
            f"{kind}{s}.{m} started before {before} ended"
        )
    # the zero-communication replay of the same order and durations is a lower bound of the real step
    assert rec["replay_step_time"] <= rec["step_time"] + 1e-6


def test_1f1b_idle_fraction_matches_theory(records):
    rec = records["1F1B"]
    bubble = (P - 1) / M  # Megatron: bubble time / compute time
    theory_idle = bubble / (1 + bubble)  # idle / step = (P-1) / (M+P-1)
    idle = [1 - busy(actions) / rec["step_time"] for actions in rec["ranks"]]
    mean_idle = sum(idle) / P
    assert abs(mean_idle - theory_idle) <= 0.05 + 0.25 * theory_idle, (idle, theory_idle)
    assert rec["idle_fraction"] == pytest.approx(idle)


def test_interleaved_step_is_faster_than_1f1b(records):
    assert records["Interleaved1F1B"]["step_time"] < records["1F1B"]["step_time"]


def test_plot_schedule_writes_png_and_plain_plot_still_takes_a_run_dir(records, tmp_path):
    record = tmp_path / "zbv.json"
    record.write_text(json.dumps(records["ZBVZeroBubble"]))
    png = tmp_path / "timeline.png"
    proc = strata("plot", "schedule", str(record), "--out", str(png))
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    bad = tmp_path / "bad.json"
    bad.write_text('{"schedule": "x"}')
    proc = strata("plot", "schedule", str(bad))
    assert (
        proc.returncode == 2
        and "not a schedule record" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    proc = strata("plot", str(tmp_path / "no-such-run"))  # the run-curves form
    assert proc.returncode == 2 and "no metrics" in proc.stderr
