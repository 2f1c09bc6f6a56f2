"""A trained model in EleutherAI's lm-evaluation-harness (the `lm-eval` package, 0.4.13: the `eval`
extra, pip install -e '.[eval]'): the model `strata`, for loglikelihood (multiple choice),
loglikelihood_rolling (perplexity) and generate_until tasks, read by `source.open_model` from anything
it opens (a Strata checkpoint of any layout, a Hugging Face model directory, a DCP checkpoint with
config=CFG).

It follows lm-eval's Hugging Face backend (`hf`) step for step, so the scores on a checkpoint equal
that backend's on its Hugging Face export: lm-eval's `TemplateLM` splits each context and continuation
into tokens; requests run longest first in batches of `batch_size` (lm-eval's `Collator`, one pass
for the choices of a context that differ only in their last token); inputs longer than the model's
context lose their oldest tokens; a rolling loglikelihood is lm-eval's disjoint windows of
`max_length` tokens after the end-of-text token; generation is `generate.generate` (greedy unless the
task samples), a row ending at the model's stop ids or once its text holds one of the task's `until`
strings, cut before the first of them.

lm-eval finds a model by name only in its own registry, which its own models fill; version 0.4.13
reads no entry points, so `lm_eval --model strata` alone does not know the name. The model is
registered by importing this module (`lm_class`), and its command line is lm-eval's own behind it:

    python -m strata.inference.harness --model strata --model_args checkpoint=DIR --tasks hellaswag
    python -m strata.inference.harness run --model strata --model_args checkpoint=DIR,config=CFG \\
        --batch_size 8 --tasks my_task --include_path tasks/

(every option of `lm_eval` works). From Python, `run_tasks`; from the `strata` command,
`strata eval CFG --resume CKPT --tasks T1,T2`. lm-eval is imported here only, when first needed:
Strata works without the extra.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from strata.errors import StrataError
from strata.inference.generate import GREEDY, generate
from strata.inference.sampling import Sampling
from strata.inference.source import Tokenizer

LM_EVAL = "0.4.13"
INSTALL = f"pip install -e '.[eval]' from the checkout (lm-eval {LM_EVAL})"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
MAX_GEN_TOKS = 256  # lm-eval's default for a task that names none, as its Hugging Face backend's

# A request as TemplateLM hands it to _loglikelihood_tokens: the strings (None for a rolling
# window), the context's tokens and the continuation's.
Request = tuple[tuple[str, str] | None, list[int], list[int]]


def require_lm_eval() -> None:
    """Raise one StrataError, naming the extra to install, where lm-eval is missing."""
    try:
        import lm_eval  # type: ignore[import-not-found,import-untyped,unused-ignore]  # noqa: F401
    except ImportError as e:
        raise StrataError(
            f"evaluating on lm-evaluation-harness tasks needs lm-eval: {INSTALL}"
        ) from e


class _StopWatch:
    """A generation's per-step callback: each row's new tokens, a row done at a stop id or once its
    text holds one of the `until` strings; when every row is done, the generation ends."""

    def __init__(self, codec: Tokenizer, rows: int, stop_ids: set[int], until: list[str]):
        self.codec, self.stop_ids, self.until = codec, stop_ids, [u for u in until if u]
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.done = [False] * rows

    def __call__(self, step: list[int | None]) -> bool:
        for row, token in enumerate(step):
            if token is None or self.done[row]:
                continue
            self.tokens[row].append(token)
            if token in self.stop_ids or self._holds_stop(row):
                self.done[row] = True
        return all(self.done)

    def _holds_stop(self, row: int) -> bool:
        if not self.until:
            return False
        text = self.codec.decode(self.tokens[row])
        return any(u in text for u in self.until)


def _sampling(kwargs: dict[str, Any]) -> Sampling:
    """lm-eval's generation kwargs (normalised: do_sample, temperature) as a Sampling: greedy unless
    the task samples, then with its temperature, top_k and top_p (none named: every token) and seed."""
    temperature = float(kwargs.get("temperature") or 0.0)
    if not kwargs.get("do_sample") or temperature == 0.0:
        return GREEDY
    sampling = Sampling(
        temperature=temperature,
        top_k=int(kwargs.get("top_k") or 0),
        top_p=float(kwargs.get("top_p") or 1.0),
        seed=int(kwargs.get("seed") or 0),
    )
    problems = sampling.problems()
    if problems:
        raise StrataError("generation_kwargs: " + "; ".join(problems))
    return sampling


def _longest_first(request: Request) -> tuple[int, tuple[int, ...]]:
    """Collator's order for loglikelihood requests, as the Hugging Face backend's."""
    tokens = request[1] + request[2]
    return -len(tokens), tuple(tokens)


def _same_but_last(request: Request) -> list[int]:
    """Collator's group: requests whose tokens differ only in the last are scored by one pass."""
    return request[1] + request[2][:-1]


def _batch_size(value: int | str) -> int:
    try:
        size = int(value)
    except ValueError:
        raise StrataError(
            f"batch_size={value!r}: give a whole number of requests a pass (no auto)"
        ) from None
    if size < 1:
        raise StrataError(f"batch_size={size}: must be >= 1")
    return size


def _device(name: str | None) -> torch.device:
    """`name`, or where none is named the first GPU if there is one, else the CPU; lm-eval's command
    line names cuda:0 by default, so a GPU named on a machine without one means the CPU too."""
    if name is None or (name.startswith("cuda") and not torch.cuda.is_available()):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class _Scoring:
    """What the `strata` model of lm-eval does; `lm_class` puts it before lm-eval's TemplateLM.

    model_args: checkpoint (required), config (a YAML experiment: needed for a DCP checkpoint),
    overrides (key=value amendments of the config, separated by spaces), dtype (float32 or bfloat16),
    max_length (default the model's seq_len), max_gen_toks (default 256) and prefix_token_id (default
    the end-of-text id); lm-eval passes its own batch_size and device (`_device`)."""

    cache_hook: Any  # set by lm-eval's LM.__init__

    def __init__(
        self,
        checkpoint: str | Path | None = None,
        config: str | Path | None = None,
        overrides: str | list[str] | None = None,
        dtype: str = "float32",
        device: str | None = None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = MAX_GEN_TOKS,
        prefix_token_id: int | None = None,
        max_batch_size: int
        | None = None,  # lm-eval passes it to every model; no automatic batch size here
        **unknown: Any,
    ):
        super().__init__()
        if unknown:
            raise StrataError(
                f"model_args {', '.join(sorted(unknown))}: not arguments of the strata model; it "
                "takes checkpoint, config, overrides, dtype, device, batch_size, max_length, "
                "max_gen_toks, prefix_token_id"
            )
        from strata.inference.source import extend_positions, open_model

        if checkpoint is None:
            raise StrataError(
                "the strata model reads a checkpoint: give checkpoint=DIR in model_args"
            )
        if str(dtype) not in DTYPES:
            raise StrataError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        if isinstance(overrides, str):
            overrides = overrides.split()
        opened = open_model(
            Path(str(checkpoint)),
            Path(str(config)) if config else None,
            overrides,
            DTYPES[str(dtype)],
        )
        self.what, self.stop_ids = opened.what, opened.stop_ids
        self._device = _device(device)
        self.model = opened.model.to(self._device)
        self.codec = opened.tokenizer
        self.batch_size = _batch_size(batch_size)
        self._max_length = int(max_length) if max_length else opened.cfg.model.seq_len
        extend_positions(self.model, self._max_length)  # a max_length past the trained context
        self._max_gen_toks = int(max_gen_toks)
        self._prefix = None if prefix_token_id is None else int(prefix_token_id)

    # --- what TemplateLM asks of a model ----------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        """The end-of-text id: the model's stop id (the smallest, where its directory names several)."""
        if not self.stop_ids:
            raise StrataError(
                f"{self.what}: its tokenizer names no end-of-text token; give prefix_token_id=ID "
                "in model_args"
            )
        return min(self.stop_ids)

    @property
    def prefix_token_id(self) -> int:
        """The id put before a context that has no tokens of its own: prefix_token_id from
        model_args, else the end-of-text id."""
        return self.eot_token_id if self._prefix is None else self._prefix

    @property
    def max_length(self) -> int:
        """The longest context a request is cut to: max_length from model_args, else the model's
        seq_len."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        """The most tokens a generate-until request adds when its task names no limit."""
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        """Where the model runs: model_args' device, else the first GPU if there is one, else the
        CPU."""
        return self._device

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """The tokens of `string`, the tokenizer's special tokens added unless told not to or the
        string starts with the prefix token's text already (as the Hugging Face backend)."""
        special = (
            add_special_tokens
            if add_special_tokens is not None
            else not self._starts_with_prefix(string)
        )
        return self.codec.encode(string, special)

    def _starts_with_prefix(self, string: str) -> bool:
        if not self.stop_ids and self._prefix is None:
            return False
        prefix = self.codec.decode([self.prefix_token_id], skip_special=False)
        return bool(prefix) and string.startswith(prefix)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `tokens`, special tokens left out unless `skip_special_tokens` is False."""
        return self.codec.decode(tokens, skip_special_tokens)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records of the model in its results: where it came from and its parameter
        count."""
        return {
            "model_source": self.what,
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
        }

    # --- loglikelihood ------------------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        """Each continuation's log-probability after its context, and whether it is the greedy one."""
        from lm_eval.models.utils import Collator  # type: ignore[import-not-found,import-untyped,unused-ignore]

        for strings, _, continuation in requests:
            if not continuation:
                # lm-eval's hf model asserts the same: an empty answer would score as correct
                raise StrataError(
                    f"lm-eval request {strings}: the continuation encodes to no tokens, so there "
                    "is nothing to score; lm-eval's hf model refuses it too (check the task's "
                    "answers)"
                )
        order = Collator(
            requests, sort_fn=_longest_first, group_by="contexts", group_fn=_same_but_last
        )
        results: list[tuple[float, bool]] = []
        for chunk in order.get_batched(n=self.batch_size):
            for (strings, context, continuation), scores in zip(
                chunk, self._continuation_logprobs(chunk)
            ):
                shared = order.get_cache(
                    req_str=strings,
                    cxt_toks=context,
                    cont_toks=continuation,
                    logits=scores.unsqueeze(0),
                )
                for key, tokens, logprobs in shared:
                    answer = _answer(logprobs[0], tokens)
                    results.append(answer)
                    if key is not None:  # a rolling window: scored per document by the caller
                        self.cache_hook.add_partial("loglikelihood", key, answer)
        return order.get_original(results)

    def _continuation_logprobs(self, chunk: list[Request]) -> list[torch.Tensor]:
        """One pass over a batch (right-padded; the oldest tokens dropped past max_length): each
        request's log-probabilities (continuation, vocab) at its continuation's positions."""
        inputs = [
            (context + continuation)[-(self.max_length + 1) :][:-1]
            for _, context, continuation in chunk
        ]
        batch = torch.zeros(len(inputs), max(len(i) for i in inputs), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            batch[row, : len(tokens)] = torch.tensor(tokens)
        with torch.inference_mode():
            logits = self.model(batch.to(self._device))
            scored = [row[len(i) - len(r[2]) : len(i)] for row, i, r in zip(logits, inputs, chunk)]
            return [F.log_softmax(row.float(), dim=-1).cpu() for row in scored]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood: the sum over lm-eval's disjoint windows of max_length tokens,
        the first after the prefix token."""
        from lm_eval.utils import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
            get_rolling_token_windows,
            make_disjoint_window,
        )

        windows: list[Request] = []
        owners: list[int] = []
        for index, (text,) in enumerate(r.args for r in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in rolling:
                windows.append((None, *make_disjoint_window(window)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(
            owners, self._loglikelihood_tokens(windows, disable_tqdm=True)
        ):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation -----------------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, batched by equal generation kwargs, longest context first."""
        from lm_eval.models.utils import Collator  # type: ignore[import-not-found,import-untyped,unused-ignore]

        order = Collator(
            [r.args for r in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        texts: list[str] = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts = [context for context, _ in chunk]
            for (context, kwargs), text in zip(chunk, self._generate_batch(contexts, chunk[0][1])):
                texts.append(text)
                self.cache_hook.add_partial("generate_until", (context, kwargs), text)
        return order.get_original(texts)

    def _generate_batch(self, contexts: list[str], gen_kwargs: dict[str, Any]) -> list[str]:
        """Continue contexts that share `gen_kwargs`: each cut to leave room for max_gen_toks new
        tokens, the text cut before the first `until` string (the end-of-text token's text among them)."""
        from lm_eval.models.utils import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )

        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        eos = self.codec.decode([self.eot_token_id], skip_special=False) if self.stop_ids else None
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        budget = int(kwargs.pop("max_gen_toks"))
        room = self.max_length - budget
        if room <= 0:
            raise StrataError(
                f"max_gen_toks {budget} leaves no room for a context in the model's "
                f"{self.max_length} positions: give the task fewer (generation_kwargs: "
                "max_gen_toks) or the model a larger max_length"
            )
        prompts = [self.tok_encode(c)[-room:] or [self.prefix_token_id] for c in contexts]
        watch = _StopWatch(self.codec, len(prompts), self.stop_ids, until)
        generate(self.model, prompts, budget, _sampling(kwargs), self.stop_ids, watch)
        return [postprocess_generated_text(self.tok_decode(t), until, None) for t in watch.tokens]


def _answer(logprobs: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
    """(the continuation's log-probability, whether every token of it is the most likely one) from
    the log-probabilities (positions, vocab) ending at its last token."""
    scored = logprobs[-len(continuation) :]
    wanted = torch.tensor(continuation).unsqueeze(1)
    greedy = bool((scored.argmax(dim=-1) == wanted.squeeze(1)).all())
    return float(scored.gather(1, wanted).sum()), greedy


def lm_class() -> type:
    """lm-eval's model class for Strata models, registered as `strata` (lm-eval's own models too)."""
    require_lm_eval()
    return _registered()


@functools.cache
def _registered() -> type:
    # get_model fills the registry with lm-eval's own models only while it is empty: fill it first.
    import lm_eval.models  # type: ignore[import-not-found,import-untyped,unused-ignore]  # noqa: F401
    from lm_eval.api.model import TemplateLM  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from lm_eval.api.registry import register_model  # type: ignore[import-not-found,import-untyped,unused-ignore]

    class StrataLM(_Scoring, TemplateLM):
        """A Strata model (`source.open_model`) scored and sampled for lm-eval's tasks."""

    StrataLM.__qualname__ = "StrataLM"
    return register_model("strata")(StrataLM)


def run_tasks(
    checkpoint: Path,
    tasks: list[str],
    *,
    config_path: Path | None = None,
    overrides: list[str] | None = None,
    include_path: Path | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    dtype: str = "float32",
    device: str | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
) -> dict[str, Any]:
    """lm-eval's evaluation of the model at `checkpoint` on `tasks` (names of lm-eval's tasks, or of
    the task YAMLs under `include_path`), on `device` (default the first GPU if there is one, else the
    CPU): its results dict as JSON values (with each request's sample when `log_samples`)."""
    lm_class()
    from lm_eval import simple_evaluate  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from lm_eval.utils import handle_non_serializable  # type: ignore[import-not-found,import-untyped,unused-ignore]

    manager = task_manager(include_path, tasks)
    model_args: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "dtype": dtype,
        "overrides": list(overrides or []),
    }
    if config_path is not None:
        model_args["config"] = str(config_path)
    results = simple_evaluate(
        model="strata",
        model_args=model_args,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        device=device,
        limit=limit,
        log_samples=log_samples,
        task_manager=manager,
        bootstrap_iters=bootstrap_iters,
    )
    return json.loads(json.dumps(results, default=handle_non_serializable))


def task_manager(include_path: Path | None, tasks: list[str]) -> Any:
    """lm-eval's TaskManager for `tasks`: over the YAMLs under `include_path` alone when they hold
    every one (indexing lm-eval's own thousands takes seconds), else over lm-eval's too. A task
    neither knows is a StrataError naming the closest names."""
    import difflib

    from lm_eval.tasks import TaskManager  # type: ignore[import-not-found,import-untyped,unused-ignore]

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise StrataError(f"--include-path {include_path}: not a directory of task YAML files")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known and not Path(name).is_file() and not set("*?[") & set(name):
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise StrataError(
                f"task {name!r}: lm-eval knows no such task{hint} (`lm_eval ls tasks` lists them; "
                "local task YAMLs come with --include-path DIR)"
            )
    return manager


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's own table of `results` (and of its groups, when there are any)."""
    from lm_eval.utils import make_table  # type: ignore[import-not-found,import-untyped,unused-ignore]

    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def main() -> None:
    """lm-eval's command line with the `strata` model registered; a StrataError (a missing lm-eval, a
    bad model_arg or checkpoint) is one message and exit status 2, as the `strata` command's."""
    try:
        lm_class()
        from lm_eval.__main__ import cli_evaluate  # type: ignore[import-not-found,import-untyped,unused-ignore]

        cli_evaluate()
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
