"""strata.inference: using a trained model in one process. `source` opens one (a Strata checkpoint
of any layout, a Hugging Face directory, a DCP checkpoint) with its tokenizer; `sampling` picks the
next token (greedy, temperature, top-k, top-p, seeded); `generate` continues a batch of prompts
with a key/value cache (`strata.kv_cache`). The `strata generate` command drives them."""
