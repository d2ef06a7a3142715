"""The ``config.layer_types`` entries kveval knows, by what their cache layer holds.

One vocabulary for the cache (:func:`kveval.modeling.architectures.cache_layer_plan`) and the
memory planner (:mod:`kveval.planner.model_specs`), which reads configs without loading torch.
"""

from __future__ import annotations

#: Per-token K/V only.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
#: Constant-size conv/recurrent states only (Mamba, gated delta rule, short convolutions).
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba"})
#: K/V and a state in one layer (Falcon-H1).
HYBRID_LAYER_TYPES = frozenset({"hybrid", "hybrid_sliding"})
#: Nothing (MLP-only layers, and layers that read another layer's K/V).
EMPTY_LAYER_TYPES = frozenset({"dummy", "moe", "mlp"})
#: A model's own cache layers whose parts kveval mirrors (:mod:`kveval.cache.native_layers`): DeepSeek V3.2 / GLM
#: MoE-DSA's indexed attention (MLA latent + RoPE key, and the DSA indexer's keys), DeepSeek V4's compressed sparse
#: attention (window, CSA entries, indexer entries, pending tokens and overlap) and heavily compressed attention
#: (window, HCA entries, pending tokens).
NATIVE_LAYER_TYPES = frozenset({"indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention"})
#: ``model_type`` values whose every attention layer is a native one (DeepSeek V4's sliding layers too: K=V, one
#: stored tensor), and the families that keep DSA indexer keys.
NATIVE_MODEL_TYPES = frozenset({"deepseek_v4", "deepseek_v32", "glm_moe_dsa"})
#: Per layer type of those models: the part its per-token store holds (V3.2's latent with its RoPE key, V4's
#: sliding window of K=V entries), and the part each compressed series of the model's own layer is kept as (by the
#: names of ``DeepseekV4HCACache.compressed_kv``). The DSA indexer's per-token keys (``indexed_attention``) are part
#: ``indexer`` too.
NATIVE_STORE_PARTS = {"indexed_attention": "latent", "sliding_attention": "window",
                      "compressed_sparse_attention": "window", "heavily_compressed_attention": "window"}
NATIVE_ENTRY_PARTS = {"heavily_compressed_attention": {"compressor": "hca"},
                      "compressed_sparse_attention": {"compressor": "csa", "indexer": "indexer"}}
#: The layers that hold per-token K/V, and every type known.
#: (The native types are known to the cache alone, not to these sets, which the memory planner reads: it sizes
#: them on its own terms.)
KV_LAYER_TYPES = ATTENTION_LAYER_TYPES | HYBRID_LAYER_TYPES
KNOWN_LAYER_TYPES = KV_LAYER_TYPES | STATE_LAYER_TYPES | EMPTY_LAYER_TYPES


def selection_slides(windows) -> bool:
    """Whether a selection policy acts on sliding-window layers, given the window of every layer holding K/V
    (``None``: full attention). Where some layer attends to every token (Gemma 2/3, gpt-oss, Cohere 2), selection
    acts on those layers alone: the sliding ones are bounded by their window already. Where every layer slides
    (Mistral-7B-v0.1, Phi-3-mini-4k), it selects among the ``window - 1`` tokens each layer holds, as a deployment
    compressing that model's cache does (:func:`selecting_layers`, which the cache and the memory planner ask)."""
    windows = list(windows)
    return bool(windows) and all(w is not None for w in windows)


def selecting_layers(windows, chunked) -> list[bool]:
    """Per layer holding K/V (its window, ``None`` for full attention, and whether that window is an attention
    chunk): whether a selection policy acts on it. Full layers always; sliding ones where every layer slides
    (:func:`selection_slides`); chunked ones never (a query sees its own chunk only)."""
    windows = list(windows)
    slides = selection_slides(windows)
    return [w is None or (slides and not c) for w, c in zip(windows, chunked)]


__all__ = ["ATTENTION_LAYER_TYPES", "EMPTY_LAYER_TYPES", "HYBRID_LAYER_TYPES", "KNOWN_LAYER_TYPES", "KV_LAYER_TYPES",
           "NATIVE_ENTRY_PARTS", "NATIVE_LAYER_TYPES", "NATIVE_MODEL_TYPES", "NATIVE_STORE_PARTS", "STATE_LAYER_TYPES", "selecting_layers", "selection_slides"]
