"""The `strata` model of lm-evaluation-harness against lm-eval's own Hugging Face backend (`hf`) on
the Hugging Face export of the same checkpoint: the same tasks (multiple choice, generation until
stop strings, rolling perplexity; local YAMLs over local JSON lines) give the same scores and the
same per-request loglikelihoods and texts. Offline: the datasets are local files, the hub and
datasets are told so, and their caches are the test's."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from test_generate import bpe_data  # noqa: F401 (a fixture)

from strata.checkpoint import store
from strata.errors import CheckpointError, StrataError

from conftest import run_cli, tiny_overrides
from worlds import REPO, train_world

pytest.importorskip("lm_eval")  # the eval extra; CI installs it with the test extra

STEPS = 150  # enough for a model whose greedy text varies and whose choices differ in likelihood
TASKS = ["tiny_choice", "tiny_gen", "tiny_docs"]
MAX_NEW = 12  # tokens a generation request here may add
README = (REPO / "README.md").read_text()

CHOICES = [
    {
        "question": "Train GPT/Llama-style transformers from one YAML",
        "choices": [" experiment file", " of"],
        "answer": 0,
    },
    {
        "question": "The architecture map is",
        "choices": [" `docs/ARCHITECTURE.md`", " in the"],
        "answer": 1,
    },
    {
        "question": "Parallelism is described in",
        "choices": [" `docs/PARALLELISM.md`", " red wine", " the"],
        "answer": 2,
    },
    {"question": "data-parallel processes under", "choices": [" torchrun", " water"], "answer": 0},
    {
        "question": "",
        "choices": ["Strata", "Banana"],
        "answer": 0,
    },  # empty context: the prefix token before it
]
PROMPTS = [
    {"prompt": "Train GPT/Llama-style transformers from", "target": " one YAML experiment file"},
    {"prompt": "The architecture map is", "target": " in mo"},
    {
        "prompt": "checkpoints in torch.distributed.checkpoint's format that save in the background",
        "target": " and",
    },
    {"prompt": "Install and run the demo", "target": " (a"},
]
# Documents longer than the model's 32 positions: several rolling windows each.
DOCUMENTS = [{"text": README[i * 600 : (i + 1) * 600]} for i in range(3)]

TASK_YAML = {
    "tiny_choice": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "tiny_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n", "--"]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "tiny_docs": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
}


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """No network: the hub and datasets offline, their caches here (the environment for what imports
    them later; the flags they read on import, for what an earlier test imported)."""
    cache = tmp_path_factory.mktemp("hf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HOME", str(cache))
        mp.setenv("HF_DATASETS_CACHE", str(cache / "datasets"))
        flags = [
            ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
            ("datasets.config", "HF_HUB_OFFLINE"),
        ]
        for module, flag in [*flags, ("datasets.config", "HF_DATASETS_OFFLINE")]:
            if module in sys.modules:
                mp.setattr(sys.modules[module], flag, True)
        yield cache


@pytest.fixture(scope="module")
def tasks(offline, tmp_path_factory):
    """The three task YAMLs and their JSON-lines data, in one directory (lm-eval's --include_path)."""
    root = tmp_path_factory.mktemp("tasks")
    for name, rows in (("tiny_choice", CHOICES), ("tiny_gen", PROMPTS), ("tiny_docs", DOCUMENTS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / name}.jsonl\n"
            f"  cache_dir: {offline / 'datasets'}\ntest_split: test\n" + TASK_YAML[name]
        )
    return root


@pytest.fixture(scope="module")
def trained(bpe_data, tmp_path_factory):  # noqa: F811 (bpe_data is the imported fixture)
    """A tiny model trained in one process on BPE data, its experiment (file and overrides), and its
    Hugging Face export."""
    from strata.launch.cli import main

    root = tmp_path_factory.mktemp("run")
    experiment = root / "e.yaml"
    experiment.write_text("{}\n")
    overrides = tiny_overrides(
        bpe_data,
        root,
        **{
            "train.steps": STEPS,
            "train.micro_batch_size": 8,
            "optim.lr": 3e-2,
            "checkpoint.save_final": True,
        },
    )
    train_world([str(experiment), *overrides], 1, root)
    ckpt = store.step_dir(root / "t" / "checkpoints", STEPS)
    assert main(["ckpt", "export", str(ckpt), str(root / "hf"), "--format", "hf"]) == 0
    return ckpt, root / "hf", experiment, overrides


def as_json(results: dict) -> dict:
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(results, default=handle_non_serializable))


@pytest.fixture(scope="module")
def both(trained, tasks):
    """lm-eval's results (with every request's sample) from `strata` on the checkpoint and from `hf`
    on its export: the same tasks and local task index, in batches of 8 and 3 requests."""
    from lm_eval import simple_evaluate

    from strata.inference.harness import run_tasks, task_manager

    ckpt, hf_dir, _, _ = trained
    ours = run_tasks(ckpt, TASKS, include_path=tasks, log_samples=True)  # batches of 8
    theirs = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
        tasks=TASKS,
        batch_size=3,
        log_samples=True,
        task_manager=task_manager(tasks, TASKS),
    )
    return ours, as_json(theirs)


def assert_close_values(got, want, where: str = "") -> None:
    """Equal structures; numbers to 1e-5 relative (loglikelihoods from two implementations), the rest exactly."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_close_values(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_values(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), where
    else:
        assert got == want, where


def test_scores_equal_the_hugging_face_backend_on_the_export(both):
    ours, theirs = both
    for task in TASKS:
        assert_close_values(ours["results"][task], theirs["results"][task], task)
    choices = [r[0][0] for s in ours["samples"]["tiny_choice"] for r in s["resps"]]
    assert (
        len(choices) == 11 and len({round(c, 3) for c in choices}) == 11
    )  # every choice scored, none alike
    assert 1 < ours["results"]["tiny_docs"]["byte_perplexity,none"] < math.inf
    assert ours["config"]["model"] == "strata" and theirs["config"]["model"] == "hf"


def test_every_requests_loglikelihood_and_text_equal_the_hugging_face_backends(both):
    ours, theirs = both
    for task in TASKS:
        mine, hf = ours["samples"][task], theirs["samples"][task]
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in hf] and len(mine) > 2
        for a, b in zip(mine, hf):
            assert a["arguments"] == b["arguments"], task
            assert_close_values(a["resps"], b["resps"], f"{task}[{a['doc_id']}]")
            assert_close_values(a["filtered_resps"], b["filtered_resps"], f"{task}[{a['doc_id']}]")
    texts = [s["resps"][0][0] for s in ours["samples"]["tiny_gen"]]
    assert any(texts) and len(set(texts)) > 1  # real text, not one string for every prompt
    rolling = [s["resps"][0][0] for s in ours["samples"]["tiny_docs"]]
    assert all(r < 0 and math.isfinite(r) for r in rolling)


@pytest.fixture(scope="module")
def models(trained, offline):
    """The two lm-eval models themselves, for requests made here."""
    from lm_eval.models.huggingface import HFLM

    from strata.inference.harness import lm_class

    ckpt, hf_dir, _, _ = trained
    return lm_class()(checkpoint=str(ckpt), batch_size=4), HFLM(
        pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=4
    )


def generations(lm, until: list[str], prompts: list[dict] = PROMPTS) -> list[str]:
    """lm's greedy texts for `prompts`, up to MAX_NEW tokens each, in one batch."""
    from lm_eval.api.instance import Instance

    kwargs = {"until": until, "max_gen_toks": MAX_NEW, "do_sample": False}
    requests = [
        Instance("generate_until", {}, (p["prompt"], dict(kwargs)), i, ("t", i, 1))
        for i, p in enumerate(prompts)
    ]
    return lm.generate_until(requests, disable_tqdm=True)


def test_until_strings_end_generation_and_are_cut_off_as_the_hugging_face_backend_does(models):
    ours, hf = models
    free = generations(hf, [])
    assert generations(ours, []) == free
    # a stop string from the first half of one of the Hugging Face backend's own texts, where it first occurs
    row, at = next(
        (i, k)
        for i, t in enumerate(free)
        for k in range(1, len(t) // 2)
        if t.find(t[k : k + 2]) == k
    )
    stop = free[row][at : at + 2]
    cut = generations(hf, [stop, "§"])
    assert cut[row] == free[row][:at] and any(c != f for c, f in zip(cut, free))
    assert generations(ours, [stop, "§"]) == cut
    # the generation ends once every row holds a stop string: fewer passes than MAX_NEW tokens need
    passes: list[int] = []
    hook = ours.model.register_forward_hook(lambda *_: passes.append(1))
    try:
        assert generations(ours, [stop], [PROMPTS[row]]) == [cut[row]]
    finally:
        hook.remove()
    assert 0 < len(passes) < MAX_NEW


def test_loglikelihoods_of_requests_equal_the_hugging_face_backends(models):
    from lm_eval.api.instance import Instance

    ours, hf = models
    pairs = [
        ("Strata trains", " large models"),
        ("", "The checkpoint format"),
        ("A run ", "of steps"),
    ]
    requests = [Instance("loglikelihood", {}, pair, i, ("t", i, 1)) for i, pair in enumerate(pairs)]
    got, want = (
        ours.loglikelihood(requests, disable_tqdm=True),
        hf.loglikelihood(requests, disable_tqdm=True),
    )
    for (g, greedy), (w, their_greedy) in zip(got, want):
        assert g == pytest.approx(w, rel=1e-5) and greedy == their_greedy
    assert ours.eot_token_id == hf.eot_token_id and ours.prefix_token_id == hf.prefix_token_id
    assert ours.max_length == hf.max_length == 32


def test_a_continuation_of_no_tokens_is_refused_as_the_hugging_face_backend_does():
    import tokenizers
    import transformers
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from strata.inference.harness import lm_class
    from strata.inference.source import Tokenizer

    words = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]")
    )
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    config = transformers.LlamaConfig(
        vocab_size=3, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2,
    )  # fmt: skip
    hf = HFLM(
        pretrained=transformers.LlamaForCausalLM(config).eval(),
        tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="[UNK]"),
        batch_size=1,
        device="cpu",
    )
    ours = object.__new__(lm_class())  # the refusal comes before any model or checkpoint
    ours.codec, ours.stop_ids, ours._prefix, ours.batch_size = Tokenizer(None), {0}, None, 1
    request = [Instance("loglikelihood", {}, ("a b", ""), 0, ("t", 0, 1))]
    with pytest.raises(AssertionError):
        hf.loglikelihood(request, disable_tqdm=True)
    with pytest.raises(StrataError, match="continuation encodes to no tokens"):
        ours.loglikelihood(request, disable_tqdm=True)


def test_strata_eval_tasks_writes_the_harness_results_and_a_metrics_record(
    both, trained, tasks, tmp_path, capsys
):
    ours, _ = both
    ckpt, _, experiment, overrides = trained
    out = tmp_path / "tasks.json"
    code, printed = run_cli(
        ["eval", str(experiment), "--resume", str(ckpt.parent), "--tasks", "tiny_choice,tiny_docs"]
        + ["--tasks", "tiny_gen", "--include-path", str(tasks), "--out", str(out), *overrides],
        capsys,
    )
    assert code == 0, printed
    written = json.loads(out.read_text())
    assert written["step"] == STEPS and written["checkpoint"] == str(ckpt.parent)
    assert written["results"] == ours["results"]
    assert "|tiny_choice|" in printed.replace(" ", "") and f"wrote {out}" in printed
    run_dir = ckpt.parents[1]
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == STEPS and record["eval"] == ours["results"]


@pytest.mark.slow  # an unknown task name indexes lm-eval's own tasks for the closest names (13 s)
def test_a_missing_checkpoint_or_task_is_one_clear_error(trained, tasks, tmp_path, capsys):
    from strata.inference.harness import run_tasks

    with pytest.raises(CheckpointError, match="no such file or directory"):
        run_tasks(tmp_path / "nothing", ["tiny_choice"], include_path=tasks)
    with pytest.raises(
        StrataError,
        match="task 'tiny_choise': lm-eval knows no such task; did you mean tiny_choice",
    ):
        run_tasks(trained[0], ["tiny_choise"], include_path=tasks)
    _, _, experiment, overrides = trained
    code, out = run_cli(
        ["eval", str(experiment), "--resume", str(tmp_path / "nothing"), "--tasks", "tiny_choice"]
        + ["--include-path", str(tasks), *overrides],
        capsys,
    )
    assert code == 2 and "no such file or directory" in out, out


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--limit", "3"],
            "--include-path, --limit and --num-fewshot go with lm-eval tasks: give --tasks",
        ),
        (["--tasks", "x", "--data", "d"], "--data is the held-out evaluation's"),
        (
            ["--tasks", "x", "--include-path", "/no/such/dir"],
            "--include-path /no/such/dir: not a directory",
        ),
    ],
)
def test_bad_task_arguments_are_one_clear_error(tmp_path, capsys, args, expected):
    (tmp_path / "e.yaml").write_text("{}\n")
    code, out = run_cli(
        ["eval", str(tmp_path / "e.yaml"), "--resume", str(tmp_path), *args], capsys
    )
    assert code == 2 and expected in out, out


def test_bad_model_arguments_are_one_clear_error(tmp_path):
    from strata.inference.harness import lm_class

    with pytest.raises(
        StrataError, match="model_args pretrained: not arguments of the strata model"
    ):
        lm_class()(checkpoint=str(tmp_path), pretrained="gpt2")
    with pytest.raises(StrataError, match="dtype='float8': expected one of float32"):
        lm_class()(checkpoint=str(tmp_path), dtype="float8")
    with pytest.raises(StrataError, match="give checkpoint=DIR in model_args"):
        lm_class()(batch_size=2)


def test_without_lm_eval_the_error_names_the_extra(monkeypatch, tmp_path, capsys):
    from strata.inference.harness import run_tasks

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(StrataError, match=r"needs lm-eval: pip install -e '\.\[eval\]'"):
        run_tasks(tmp_path, ["x"])
    code, out = run_cli(
        ["eval", str(tmp_path / "e.yaml"), "--resume", str(tmp_path), "--tasks", "x"], capsys
    )
    assert code == 2 and "pip install -e '.[eval]'" in out, out
    from strata.inference.harness import (
        main,
    )  # lm-eval's command line: the same message, exit status 2

    monkeypatch.setattr(sys, "argv", ["harness", "--model", "strata", "--tasks", "x"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2 and "pip install -e '.[eval]'" in capsys.readouterr().err


@pytest.mark.slow  # lm-eval's command line indexes its own tasks (13 s)
def test_the_lm_eval_command_line_finds_the_strata_model(
    trained, tasks, tmp_path, monkeypatch, capsys
):
    """`python -m strata.inference.harness` is lm-eval's command line with `strata` registered."""
    from strata.inference import harness

    ckpt = trained[0]
    argv = [
        "--model",
        "strata",
        "--model_args",
        f"checkpoint={ckpt}",
        "--batch_size",
        "2",
        "--tasks",
        "tiny_choice",
    ]
    monkeypatch.setattr(
        sys, "argv", ["harness", *argv, "--include_path", str(tasks), "--limit", "2"]
    )
    harness.main()
    printed = capsys.readouterr().out
    assert "strata (" in printed and "|tiny_choice|" in printed.replace(" ", ""), printed


def test_the_model_runs_in_bfloat16(models, trained):
    from lm_eval.api.instance import Instance

    from strata.inference.harness import lm_class

    ours, _ = models
    half = lm_class()(checkpoint=str(trained[0]), dtype="bf16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    request = [Instance("loglikelihood", {}, ("Strata trains", " large models"), 0, ("t", 0, 1))]
    (got, _), (want, _) = (
        half.loglikelihood(request, disable_tqdm=True)[0],
        ours.loglikelihood(request)[0],
    )
    assert got == pytest.approx(want, rel=0.05)
