"""strata.data: the token data a run reads, and making it.

`tokens` (a prepared directory: meta.json, the memory-mapped train/val token files, their checks
against the config, the vocabulary a run will build), `mixture` (blended sources, as Megatron's
blended dataset), `loader` (the deterministic, resumable data-parallel batch loaders and the fixed
evaluation batches), `tokenize` (bytes, a `tokenizer.json` or model directory, a BPE trained on the
corpus), `prepare` (`strata data prepare`: txt, JSON Lines or Parquet read and tokenized by
worker processes, written streaming), `chat` (chat templates rendered as transformers renders them,
and the loss mask of a conversation), `sft` (`strata data prepare` for conversations: masked and
packed into windows that never cut one) and `packing` (those windows, best-fit decreasing).

It imports only the base, the package `strata`; the trainer, the inference and the launcher read
tokenizers, vocabularies and data directories from here.
"""

if __name__ != "strata.data":
    raise ImportError(f"import strata.data, not {__name__}")
