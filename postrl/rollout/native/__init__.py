"""The ``native`` rollout engine: a compact Qwen2/Llama/Qwen3 decoder with a slot KV cache,
continuous batching, shared-prompt prefill and counter-based (batch-invariant) sampling."""
