"""strata.inference: using a trained model in one process. `source` opens one (a Strata checkpoint
of any layout, a Hugging Face directory, a DCP checkpoint) with its tokenizer; `sampling` picks the
next token (greedy, temperature, top-k, top-p, seeded); `generate` continues a batch of prompts
with a key/value cache (`strata.kv_cache`); `chat` renders prompts as user messages with the chat
template and finds where the assistant's turn ends; `harness` scores it on lm-evaluation-harness tasks. The
`strata generate` and `strata eval --tasks` commands drive them."""
