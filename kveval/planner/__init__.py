"""KV-cache memory planning: model specs and presets, bytes per token, what fits on a GPU."""
