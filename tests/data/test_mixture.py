"""Data mixtures (`data.sources`): Megatron's blending order, proportions, determinism, resuming
(also in another dp size) with nothing repeated or skipped per source, evaluation, the config
surface, and bad input as one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from strata import config
from strata.checkpoint import store
from strata.data.loader import BatchLoader, MixtureLoader, eval_batches, eval_windows
from strata.data.mixture import Mixture, blend, normalise, open_mixture
from strata.data.prepare import prepare
from strata.data.tokens import TokenDataset
from strata.errors import CheckpointError, ConfigError, DataError
from strata.parallel.runtime import start
from strata.trainer.jobs import train as run

from conftest import STDLIB, run_cli, tiny_overrides
from worlds import REPO, strata

L = 4  # sequence length of the indexed sources
OFFSET = 20000  # source j's token t is (j·OFFSET + t) mod VOCAB: a window's first token names it


def straightforward_blend(weights: list[float], size: int) -> list[int]:
    """The greedy rule as written, independently: sample i goes to the first source with the
    largest w_j·max(i, 1) − count_j, the weights normalised to shares."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = np.zeros(len(weights), dtype=np.int64)
    out = []
    for i in range(size):
        j = int(np.argmax(w * max(i, 1) - counts))  # argmax: the first of equal maxima
        out.append(j)
        counts[j] += 1
    return out


def indexed_source(root: Path, j: int, n: int, n_val: int = 7, vocab: int = 60000) -> Path:
    """A prepared-looking directory whose train window k starts with token j·OFFSET + k·L."""
    d = root / f"src{j}"
    d.mkdir(parents=True, exist_ok=True)
    (np.arange(n * L + 1) + j * OFFSET).astype(np.uint16).tofile(d / "train.bin")
    (np.arange(n_val * L + 1) + j * OFFSET + 10000).astype(np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(
        json.dumps({"dtype": "uint16", "vocab_size": vocab, "tokenizer": "byte"})
    )
    return d


def mixture(root: Path, sizes: list[int], weights: list[float], split: str = "train") -> Mixture:
    dirs = [indexed_source(root, j, n) for j, n in enumerate(sizes)]
    data = config.load(
        None, [f"data.sources={[{'path': str(d), 'weight': w} for d, w in zip(dirs, weights)]}"]
    ).data
    train, val = open_mixture(data, L)
    return train if split == "train" else val


def decode(inputs) -> list[tuple[int, int]]:
    """(source, sample) of each row of a batch of indexed windows."""
    first = inputs[:, 0].tolist()
    return [(t // OFFSET, (t % OFFSET) // L) for t in first]


def stream(loaders: list[MixtureLoader], steps: int) -> list[tuple[int, int]]:
    """The global (source, sample) stream of `steps` steps, ranks' slices in rank order."""
    out = []
    for _ in range(steps):
        for loader in loaders:
            out += [pair for micro in loader.step_indices() for pair in micro]
    return out


def per_source(pairs: list[tuple[int, int]], j: int) -> list[int]:
    return [i for s, i in pairs if s == j]


# --- the blend ----------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [[1, 3], [0.2, 0.5, 0.3], [1, 1], [5, 1, 1, 2], [1.0]])
def test_blend_is_the_greedy_rule(weights):
    sources, positions, counts = blend(normalise(weights), 300)
    assert sources == straightforward_blend(weights, 300)
    assert positions == [sources[:i].count(j) for i, j in enumerate(sources)]  # its count before it
    assert counts == [sources.count(j) for j in range(len(weights))]


def test_blend_is_megatrons():
    """The same sequence as megatron-core's compiled build_blending_indices (the peer)."""
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    for weights in ([1, 3], [0.2, 0.5, 0.3], [7, 1, 1, 1, 3]):
        size = 5000
        index = np.zeros(size, dtype=np.int16)
        sample = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(
            index, sample, np.asarray(normalise(weights)), len(weights), size, False
        )
        sources, positions, _ = blend(normalise(weights), size)
        assert sources == index.tolist() and positions == sample.tolist()


def test_blend_continues_from_any_point():
    shares = normalise([2, 1, 4])
    whole, _, _ = blend(shares, 1000)
    _, _, counts = blend(shares, 377)
    rest, _, _ = blend(shares, 623, 377, counts)
    assert whole == whole[:377] + rest


def test_proportions_over_many_steps(tmp_path):
    mix = mixture(tmp_path, [500, 700], [1, 3])
    loader = MixtureLoader(mix, seed=3, global_batch=16, micro_batch=4)
    pairs = stream([loader], 10000 // 16)
    assert len(pairs) == 10000
    share = sum(1 for s, _ in pairs if s == 0) / len(pairs)
    assert abs(share - 0.25) < 0.005
    # and at every step boundary each source is within two samples of its share
    sources, _, _ = blend(normalise([1, 3]), 10000)
    for end in range(16, 10001, 16):
        assert abs(sources[:end].count(0) - end / 4) <= 2


# --- the loader ---------------------------------------------------------------------------------


def test_each_source_in_its_own_seeded_epoch_order(tmp_path):
    n = [30, 50]
    mix = mixture(tmp_path, n, [1, 1])
    loader = MixtureLoader(mix, seed=5, global_batch=8, micro_batch=2)
    pairs = stream([loader], 30)  # 240 samples: 4 epochs of source 0, 2.4 of source 1
    for j in range(2):
        got = per_source(pairs, j)
        for e in range(len(got) // n[j]):
            epoch = got[e * n[j] : (e + 1) * n[j]]
            assert epoch == np.random.default_rng([5, e]).permutation(n[j]).tolist()
    again = MixtureLoader(mix, seed=5, global_batch=8, micro_batch=2)
    assert stream([again], 30) == pairs  # deterministic
    other = MixtureLoader(mix, seed=6, global_batch=8, micro_batch=2)
    assert stream([other], 30) != pairs


def test_one_source_reads_what_data_path_reads(tmp_path):
    mix = mixture(tmp_path, [37], [2.5])
    single = BatchLoader(TokenDataset(tmp_path / "src0", "train", L), 4, 8, 2)
    loader = MixtureLoader(mix, 4, 8, 2)
    for _ in range(12):
        assert [i for m in single.step_indices() for i in m] == [
            i for m in loader.step_indices() for _, i in m
        ]


def test_batches_hold_the_blended_windows(tmp_path):
    mix = mixture(tmp_path, [20, 30, 25], [1, 2, 1])
    a = MixtureLoader(mix, 2, 12, 3, dp_rank=1, dp_size=2)
    b = MixtureLoader(mix, 2, 12, 3, dp_rank=1, dp_size=2)
    for _ in range(5):
        indices = a.step_indices()
        batches = b.next_step()
        assert [decode(batch.inputs) for batch in batches] == indices
        for batch in batches:
            assert batch.mask is None and (batch.targets[:, :-1] == batch.inputs[:, 1:]).all()


@pytest.mark.parametrize("k", [0, 3, 7, 11])
def test_resume_continues_every_source_exactly(tmp_path, k):
    mix = mixture(tmp_path, [23, 41], [1, 3])
    straight = stream([MixtureLoader(mix, 9, 8, 2)], 20)
    first = MixtureLoader(mix, 9, 8, 2)
    before = stream([first], k)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    assert state["source_samples"] == [
        per_source(before, 0).__len__(),
        per_source(before, 1).__len__(),
    ]
    resumed = MixtureLoader(mix, 9, 8, 2)
    resumed.load_state_dict(state)
    after = stream([resumed], 20 - k)
    assert before + after == straight
    for j in range(2):
        assert per_source(before, j) + per_source(after, j) == per_source(straight, j)


@pytest.mark.parametrize("dp_before, dp_after", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_resume_in_another_dp_size_repeats_and_skips_nothing(tmp_path, dp_before, dp_after):
    gb, mb = 8, 2
    mix = mixture(tmp_path, [19, 33, 27], [2, 3, 1])
    expected = stream([MixtureLoader(mix, 4, gb, mb)], 15)
    before = [MixtureLoader(mix, 4, gb, mb, dp_rank=r, dp_size=dp_before) for r in range(dp_before)]
    got = stream(before, 6)
    states = [loader.state_dict() for loader in before]
    assert all(s == states[0] for s in states)  # the position is global: every rank saves the same
    after = [MixtureLoader(mix, 4, gb, mb, dp_rank=r, dp_size=dp_after) for r in range(dp_after)]
    for loader in after:
        loader.load_state_dict(states[0])
    got += stream(after, 9)
    assert got == expected
    for j in range(3):
        assert per_source(got, j) == per_source(expected, j)


def test_consumed_samples_alone_determines_every_source(tmp_path):
    """The counts saved beside consumed_samples are what replaying the blend to it gives; a state
    with consumed_samples only (imported) resumes to the same place."""
    mix = mixture(tmp_path, [19, 33], [1, 4])
    loader = MixtureLoader(mix, 1, 10, 5)
    stream([loader], 13)
    replayed = MixtureLoader(mix, 1, 10, 5)
    replayed.consumed_samples = 130
    assert replayed.source_samples == loader.source_samples
    imported = MixtureLoader(mix, 1, 10, 5)
    imported.load_state_dict({"consumed_samples": 130})
    assert stream([imported], 4) == stream([loader], 4)
    loader.consumed_samples = 20  # backwards too
    fresh = MixtureLoader(mix, 1, 10, 5)
    stream([fresh], 2)
    assert loader.source_samples == fresh.source_samples


def test_resume_with_other_sources_or_weights_is_refused(tmp_path):
    mix = mixture(tmp_path / "a", [19, 33], [1, 3])
    loader = MixtureLoader(mix, 1, 8, 2)
    stream([loader], 3)
    state = loader.state_dict()
    MixtureLoader(mixture(tmp_path / "a", [19, 33], [2, 6]), 1, 8, 2).load_state_dict(
        state
    )  # same shares
    MixtureLoader(mixture(tmp_path / "moved", [19, 33], [1, 3]), 1, 8, 2).load_state_dict(
        state
    )  # moved
    for other in (
        mixture(tmp_path / "b", [19, 33], [1, 2]),  # weights
        mixture(tmp_path / "c", [19, 34], [1, 3]),  # a source's size
        mixture(tmp_path / "d", [19, 33, 5], [1, 3, 1]),  # one more
    ):
        with pytest.raises(DataError) as e:
            MixtureLoader(other, 1, 8, 2).load_state_dict(state)
        assert str(tmp_path / "a" / "src0") in str(e.value) and str(other.names[0]) in str(e.value)
    with pytest.raises(DataError, match="seed"):
        MixtureLoader(mix, 2, 8, 2).load_state_dict(state)
    with pytest.raises(DataError, match="damaged"):
        MixtureLoader(mix, 1, 8, 2).load_state_dict({**state, "source_samples": [24, 0]})
    with pytest.raises(DataError, match="one dataset"):
        MixtureLoader(mix, 1, 8, 2).load_state_dict(
            {"consumed_samples": 8, "seed": 1, "n_samples": 19}
        )
    with pytest.raises(DataError, match="mixture of 2 sources"):
        BatchLoader(mix.datasets[0], 1, 8, 2).load_state_dict(state)


def test_evaluation_blends_the_val_splits_by_weight(tmp_path):
    """The first windows of each val split in order, blended by the weights; a source wraps on its
    own, the blend at the splits' total (7 + 7 windows here)."""
    val = mixture(tmp_path, [20, 30], [1, 3], split="val")
    assert eval_windows(len(val), 3, 4) == 12
    pairs = [p for b in eval_batches(val, 12, 4, 0, 1) for p in decode(b.inputs)]
    sources, positions, _ = blend(normalise([1, 3]), 12)
    assert [s for s, _ in pairs] == sources
    assert [i - 2500 for _, i in pairs] == [
        p % 7 for p in positions
    ]  # val window k starts at 10000 + k·L
    assert max(positions) >= 7  # source 1 wrapped
    two = [p for r in range(2) for b in eval_batches(val, 12, 2, r, 2) for p in decode(b.inputs)]
    assert sorted(two) == sorted(pairs)  # ranks partition the same samples
    again = [p for b in eval_batches(val, 12, 4, 0, 1) for p in decode(b.inputs)]
    assert again == pairs


# --- config and bad input -----------------------------------------------------------------------


def test_config_round_trips_the_sources(tmp_path):
    cfg = config.load(None, ["data.sources=[{path: a, weight: 1}, {path: b, weight: 3}]"])
    assert [(s.path, s.weight) for s in cfg.data.sources] == [("a", 1.0), ("b", 3.0)]
    (tmp_path / "c.yaml").write_text(config.dump(cfg))
    assert config.load(tmp_path / "c.yaml").data == cfg.data
    yaml_list = "data:\n  sources:\n    - path: a\n    - path: b\n      weight: 0.5\n"
    (tmp_path / "d.yaml").write_text(yaml_list)
    assert [s.weight for s in config.load(tmp_path / "d.yaml").data.sources] == [1.0, 0.5]
    assert config.load(None).data.sources is None
    assert config.load(None, ["data.sources=null"]).data.sources is None
    assert "data.sources[i].weight" in config.reference_markdown()


@pytest.mark.parametrize(
    "override, message",
    [
        ("[{path: a}, {path: b, weight: 0}]", "data.sources[1].weight: 0.0 must be > 0"),
        ("[{path: a, weight: -1}]", "data.sources[0].weight: -1.0 must be > 0"),
        ("[{path: a}, {weight: 2}]", "data.sources[1].path: missing"),
        ("[{path: a, wieght: 2}]", "data.sources[0].wieght: unknown key; valid: path, weight"),
        ("[{path: a}, {path: a}]", "data.sources[1].path='a' is also data.sources[0]"),
        ("a", "data.sources: expected a list of mappings"),
        ("[a]", "data.sources[0]: expected a mapping"),
    ],
)
def test_bad_sources_are_config_errors(override, message):
    with pytest.raises(ConfigError) as e:
        config.load(None, [f"data.sources={override}"])
    assert message in str(e.value)


def _train(tmp_path: Path, capsys, *overrides: str) -> tuple[int, str]:
    argv = [
        "train",
        str(REPO / "configs/tiny.yaml"),
        *tiny_overrides(None, tmp_path / "runs", **{"data.path": None}),
        *overrides,
    ]
    return run_cli(argv, capsys)


@pytest.fixture(scope="module")
def byte_sources(tmp_path_factory) -> list[Path]:
    """Two byte-level sources of different stdlib files (the same tokenizer)."""
    root = tmp_path_factory.mktemp("sources")
    files = [
        ["argparse.py", "textwrap.py", "shlex.py"],
        ["dataclasses.py", "difflib.py", "json/decoder.py"],
    ]
    for j, names in enumerate(files):
        prepare([STDLIB / f for f in names], root / f"s{j}", val_fraction=0.34, root=STDLIB)
    return [root / "s0", root / "s1"]


def sources_override(paths: list[Path], weights: list[float]) -> str:
    items = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(paths, weights))
    return f"data.sources=[{items}]"


@pytest.mark.parametrize(
    "case",
    ["vocabulary", "weight-zero", "weight-negative", "missing-path", "path-and-sources"],
)
def test_bad_input_exits_2_with_one_message(tmp_path, capsys, byte_sources, case):
    if case == "vocabulary":
        other = indexed_source(tmp_path, 0, 200, vocab=60000)
        args = [sources_override([byte_sources[0], other], [1, 1])]
        want = [
            "another vocabulary",
            str(byte_sources[0]),
            str(other),
            "vocab_size=257",
            "vocab_size=60000",
        ]
    elif case == "weight-zero":
        args, want = (
            [sources_override(byte_sources, [1, 0])],
            ["data.sources[1].weight: 0.0 must be > 0"],
        )
    elif case == "weight-negative":
        args, want = (
            [sources_override(byte_sources, [-1, 1])],
            ["data.sources[0].weight: -1.0 must be > 0"],
        )
    elif case == "missing-path":
        args = [sources_override([byte_sources[0], tmp_path / "absent"], [1, 1])]
        want = [f"data.sources[1].path={str(tmp_path / 'absent')!r}: no meta.json there"]
    else:
        args = [sources_override(byte_sources, [1, 1]), f"data.path={byte_sources[0]}"]
        want = ["data.path=", "data.sources (of 2) are both set"]
    code, out = _train(tmp_path, capsys, *args)
    assert code == 2, out
    assert "Traceback" not in out
    for w in want:
        assert w in out


# --- training on a mixture ----------------------------------------------------------------------


def test_training_on_a_mixture_resumes_bit_for_bit_and_logs_the_counts(
    tmp_path, byte_sources, one_thread
):
    extra = {
        "train.steps": 6,
        "checkpoint.interval": 3,
        "checkpoint.keep_last": 0,
        "log.interval": 1,
    }
    over = tiny_overrides(None, tmp_path / "full", **{**extra, "data.path": None})
    over.append(sources_override(byte_sources, [1, 3]))
    full_cfg = config.load(None, over, world_size=1)
    full = run(full_cfg, start())
    records = [
        json.loads(x) for x in (tmp_path / "full" / "t" / "metrics.jsonl").read_text().splitlines()
    ]
    counts = [r["data"]["source_samples"] for r in records if "data" in r]
    assert counts[-1] == {str(byte_sources[0]): 12, str(byte_sources[1]): 36}  # 6 steps of 8, 1:3

    resumed_cfg = config.load(
        None, [x.replace(str(tmp_path / "full"), str(tmp_path / "res")) for x in over], 1
    )
    resumed = run(resumed_cfg, start(), resume=store.step_dir(full_cfg.checkpoint_dir(), 3))
    assert sorted(resumed.losses) == [4, 5, 6]
    assert all(resumed.losses[s] == full.losses[s] for s in resumed.losses)

    swapped = config.load(
        None,
        [*over[:-1], sources_override(byte_sources, [3, 1]), f"log.dir={tmp_path / 'sw'}"],
        world_size=1,
    )
    with pytest.raises(CheckpointError, match="cannot resume the data position"):
        run(swapped, start(), resume=store.step_dir(full_cfg.checkpoint_dir(), 3))


@pytest.mark.slow
def test_a_two_process_mixture_resumes_in_one_process(tmp_path, byte_sources):
    """`strata launch --nproc 2` (dp=2) for 6 steps checkpointing at 3, then `strata train` in one
    process from step 3: steps 4..6 read exactly the samples the two-process run read (the same
    losses, up to the dp reduction's summation order)."""
    extra = {
        "train.steps": 6,
        "checkpoint.interval": 3,
        "checkpoint.keep_last": 0,
        "log.interval": 1,
    }
    over = tiny_overrides(None, tmp_path / "two", **{**extra, "data.path": None})
    over.append(sources_override(byte_sources, [1, 3]))
    done = strata("launch", str(REPO / "configs/tiny.yaml"), "--nproc", "2", *over, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    ckpt = tmp_path / "two" / "t" / "checkpoints"
    one = [x.replace(str(tmp_path / "two"), str(tmp_path / "one")) for x in over]
    done = strata(
        "train",
        str(REPO / "configs/tiny.yaml"),
        *one,
        "--resume",
        str(store.step_dir(ckpt, 3)),
        cwd=tmp_path,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]

    def logged(run_dir: Path) -> dict[int, dict]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}

    two, one_proc = logged(tmp_path / "two" / "t"), logged(tmp_path / "one" / "t")
    assert sorted(one_proc) == [4, 5, 6]
    for step in (4, 5, 6):
        assert one_proc[step]["data"] == two[step]["data"]
        assert one_proc[step]["loss"] == pytest.approx(two[step]["loss"], rel=1e-4)
