"""`strata generate` and the decoding under it, against references that do not share its code:

- the model's own forward pass without a cache, one prompt at a time (batched, padded, cached
  decoding must give every row the same tokens);
- transformers' logits warpers (temperature, top-k, top-p) for the sampling filter;
- transformers' `generate` (greedy) on the Hugging Face export of a run trained with tp = 2, for the
  same prompts, token for token; and on a Hugging Face directory read directly.
"""

from __future__ import annotations

import json

import pytest
import torch

from strata.checkpoint import store
from strata.config import ModelConfig
from strata.inference.generate import generate
from strata.inference.sampling import Sampling, filtered_scores, next_tokens
from strata.model import build_model

from conftest import prepare_readme, run_cli, tiny_overrides
from worlds import strata, train_world

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, seq_len=32, vocab_size=64)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [10, 11, 12, 13]]


def uncached_greedy(model, prompt: list[int], n: int) -> list[int]:
    x, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(x)[0, -1].argmax()))
            x = torch.cat([x, torch.tensor([[out[-1]]])], 1)
    return out


def test_batched_cached_greedy_decoding_gives_each_prompt_its_own_tokens():
    model = build_model(CFG, 64, seed=0).eval()
    got = generate(model, PROMPTS, 12).tokens
    assert got == [uncached_greedy(model, p, 12) for p in PROMPTS]


def test_bf16_decoding_runs_in_bf16_and_agrees_with_the_uncached_model():
    # a GPU decodes in bf16: the cache, the masks and the sampling must take the model's dtype
    model = build_model(CFG, 64, seed=0).eval().to(torch.bfloat16)
    got = generate(model, PROMPTS, 6).tokens
    assert [len(t) for t in got] == [6, 6, 6] and all(0 <= t < 64 for row in got for t in row)
    assert got[0][0] == uncached_greedy(model, PROMPTS[0], 1)[0]  # the longest prompt: no padding


def test_decoding_past_the_trained_context_extends_the_rotary_tables():
    model = build_model(CFG, 64, seed=0).eval()
    got = generate(model, [PROMPTS[0]], 40).tokens[0]  # 7 + 40 tokens > seq_len 32
    assert len(got) == 40 and model.rope_cos.shape[0] == 47


def test_a_stop_id_ends_its_row_only():
    model = build_model(CFG, 64, seed=0).eval()
    free = generate(model, PROMPTS, 10).tokens
    stop = free[1][3]
    stopped = generate(model, PROMPTS, 10, stop_ids={stop}).tokens
    for row, tokens in zip(free, stopped):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert tokens == row[:cut]


def test_sampling_is_one_output_per_seed():
    model = build_model(CFG, 64, seed=0).eval()
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=5)
    first = generate(model, PROMPTS, 16, sampling).tokens
    assert generate(model, PROMPTS, 16, sampling).tokens == first
    other = generate(
        model, PROMPTS, 16, Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=6)
    ).tokens
    assert other != first
    assert first != generate(model, PROMPTS, 16).tokens  # not greedy


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)]
)
def test_the_sampling_filter_is_transformers_warpers(temperature, top_k, top_p):
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    warpers = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    want = warpers(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    got = filtered_scores(logits, Sampling(temperature, top_k, top_p))
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()])
    draws = torch.stack(
        [
            next_tokens(
                logits, Sampling(temperature, top_k, top_p), torch.Generator().manual_seed(i)
            )
            for i in range(50)
        ]
    )
    assert not want.isinf().gather(1, draws.T).any()  # never a token the filter removed


# --- from a trained run and a Hugging Face directory, through the command -------------------------


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    return prepare_readme(tmp_path_factory.mktemp("data") / "bpe", "bpe:300")


@pytest.fixture(scope="module")
def trained(bpe_data, tmp_path_factory):
    """A tiny run trained with tp = 2 on BPE data (6 steps, final checkpoint) and its export."""
    root = tmp_path_factory.mktemp("run")
    experiment = root / "e.yaml"
    experiment.write_text("{}\n")
    overrides = tiny_overrides(
        bpe_data, root, **{"parallel.tp": 2, "checkpoint.save_final": True, "optim.lr": 3e-2}
    )
    train_world([str(experiment), *overrides], 2, root)
    ckpt = store.step_dir(root / "t" / "checkpoints", 6)
    exported = strata("ckpt", "export", str(ckpt), str(root / "hf"), "--format", "hf")
    assert exported.returncode == 0, exported.stderr[-3000:]
    return ckpt, root / "hf"


TEXTS = ["Strata trains", "A run", "The checkpoint format records each tensor"]


def transformers_greedy(hf_dir, texts: list[str], n: int) -> list[list[int]]:
    """transformers' generate, one prompt at a time (no padding), greedy, the new tokens."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    out = []
    for text in texts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(
                ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids)
            )
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.slow  # prepares BPE data, trains in a 2-process world, exports
def test_greedy_from_a_checkpoint_equals_transformers_generate_on_its_export(trained):
    from strata.inference.source import open_model

    ckpt, hf_dir = trained
    opened = open_model(ckpt)
    ids = [opened.tokenizer.encode(t) for t in TEXTS]
    got = generate(opened.model, ids, 20, stop_ids=opened.stop_ids).tokens
    want = transformers_greedy(hf_dir, TEXTS, 20)
    for mine, theirs in zip(got, want):
        assert mine == theirs[: len(mine)] and (
            len(mine) == len(theirs) or mine[-1] in opened.stop_ids
        )


@pytest.mark.slow
def test_strata_generate_reads_a_checkpoint_and_a_hugging_face_directory_alike(trained, capsys):
    ckpt, hf_dir = trained
    outputs = []
    for source in (ckpt.parent, hf_dir):  # the run's checkpoint root (its newest step), the export
        code, out = run_cli(
            [
                "generate",
                str(source),
                "--prompt",
                TEXTS[0],
                "--prompt",
                TEXTS[1],
                "--max-new-tokens",
                "12",
            ],
            capsys,
        )
        assert code == 0, out
        outputs.append(out)
    assert outputs[0].split("model:")[0] == outputs[1].split("model:")[0] or _texts(
        outputs[0]
    ) == _texts(outputs[1])
    assert TEXTS[0] in outputs[0] and TEXTS[1] in outputs[0]


def _texts(out: str) -> list[str]:
    return [
        block.strip() for block in out.split("-" * 40) if block.strip() and "model:" not in block
    ]


@pytest.mark.slow
def test_streamed_and_sampled_output_is_the_seeds(trained, capsys):
    ckpt, _ = trained
    runs = []
    for _ in range(2):
        code, out = run_cli(
            [
                "generate",
                str(ckpt),
                "--prompt",
                TEXTS[2],
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--seed",
                "3",
                "--stream",
                "--max-new-tokens",
                "16",
            ],
            capsys,
        )
        assert code == 0, out
        runs.append(out.split("\n")[0])
    assert runs[0] == runs[1] and runs[0].startswith(TEXTS[2])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--temperature", "-1", "--prompt", "x"], "--temperature -1.0: must be >= 0"),
        (["--top-p", "0", "--prompt", "x"], "--top-p 0.0: must be in (0, 1]"),
        ([], "no prompt"),
        (["--prompt", "a", "--prompt", "b", "--stream"], "--stream prints one prompt's tokens"),
    ],
)
def test_bad_generate_input_is_one_clear_error(tmp_path, capsys, args, expected):
    code, out = run_cli(["generate", str(tmp_path), *args], capsys)
    assert code == 2 and expected in out, out


def test_a_path_that_is_no_model_is_one_clear_error(tmp_path, capsys):
    code, out = run_cli(["generate", str(tmp_path / "nothing"), "--prompt", "x"], capsys)
    assert code == 2 and "no such file or directory" in out, out
    code, out = run_cli(["generate", str(tmp_path), "--prompt", "x"], capsys)
    assert code == 2 and "no committed checkpoint there" in out, out


def test_the_prompts_file_takes_lines_and_json_lines(tmp_path):
    from strata.launch.commands.generate import read_prompts

    lines, jsonl = tmp_path / "p.txt", tmp_path / "p.jsonl"
    lines.write_text("first prompt\n\nsecond\n")
    jsonl.write_text(json.dumps({"prompt": "a\nb"}) + "\n")
    ns = type("A", (), {"prompt": ["x"], "prompts": str(lines), "stream": False})
    assert read_prompts(ns) == ["x", "first prompt", "second"]
    ns.prompts = str(jsonl)
    assert read_prompts(ns) == ["x", "a\nb"]


def test_strata_generate_reads_a_checkpoint_dcp_wrote_alone_with_its_config(tmp_path, capsys):
    """A plain `dcp.save` of a model's state_dict (the model's own names) and the experiment's config:
    the command's greedy tokens are those of the saved model in memory."""
    import torch.distributed.checkpoint as dcp

    from strata import config
    from strata.data.tokenize import ByteTokenizer

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(
        "model: {n_layers: 2, d_model: 32, n_heads: 4, n_kv_heads: 2, seq_len: 32, vocab_size: 264}\n"
    )
    cfg = config.load(cfg_file)
    model = build_model(cfg.model, 264, seed=3).eval()
    dcp.save(
        {k: v.clone() for k, v in model.state_dict().items()}, checkpoint_id=str(tmp_path / "dcp")
    )
    prompt = "def f("
    want = generate(model, [list(prompt.encode())], 10, stop_ids={ByteTokenizer.eot}).tokens[0]
    code, out = run_cli(
        [
            "generate",
            str(tmp_path / "dcp"),
            "--config",
            str(cfg_file),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "10",
        ],
        capsys,
    )
    assert code == 0, out
    assert prompt + ByteTokenizer().decode(want) + "\n" + "-" * 40 in out, out
    code, out = run_cli(["generate", str(tmp_path / "dcp"), "--prompt", prompt], capsys)
    assert code == 2 and "give the experiment's config with --config CFG" in out, out


@pytest.mark.slow  # trains a tiny byte-level run (3 steps) and exports it
def test_a_byte_level_run_exports_a_tokenizer_that_transformers_and_strata_generate_read(
    small_data_dir, tmp_path, capsys
):
    from strata.inference.source import open_model
    from strata.parallel.runtime import start
    from strata.trainer.jobs import train

    from conftest import tiny_config

    transformers = pytest.importorskip("transformers")
    cfg = tiny_config(small_data_dir, tmp_path, **{"train.steps": 3, "checkpoint.save_final": True})
    train(cfg, start())
    ckpt = store.committed(cfg.checkpoint_dir())[-1]
    hf_dir = tmp_path / "hf"
    code, said = run_cli(["ckpt", "export", str(ckpt), str(hf_dir), "--format", "hf"], capsys)
    assert code == 0, said
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = "def héllo(wörld):\n\treturn '🙂'  "
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))  # a byte a token, nothing added
    assert tok.decode(list(text.encode("utf-8")) + [256], skip_special_tokens=True) == text
    assert (
        tok.eos_token_id == 256 == json.loads((hf_dir / "config.json").read_text())["eos_token_id"]
    )
    # strata's greedy decoding of the checkpoint is transformers' of the export
    opened = open_model(ckpt)
    got = generate(opened.model, [opened.tokenizer.encode(t) for t in TEXTS], 12).tokens
    assert got == transformers_greedy(hf_dir, TEXTS, 12)
    outputs = []
    for source in (ckpt, hf_dir):
        code, out = run_cli(
            ["generate", str(source), "--prompt", "def ", "--max-new-tokens", "8"], capsys
        )
        assert code == 0, out
        outputs.append(_texts(out))
    assert outputs[0] == outputs[1]
