"""The compressed KV cache behind transformers' ``Cache`` API: layers, batched decode, evictions, masks, the attention function and the exactness self-check."""
