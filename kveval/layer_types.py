"""The ``config.layer_types`` entries kveval knows, by what their cache layer holds.

One vocabulary for the cache (:func:`kveval.architectures.cache_layer_plan`) and the
memory planner (:mod:`kveval.model_specs`), which reads configs without loading torch.
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
#: The layers that hold per-token K/V, and every type known.
KV_LAYER_TYPES = ATTENTION_LAYER_TYPES | HYBRID_LAYER_TYPES
KNOWN_LAYER_TYPES = KV_LAYER_TYPES | STATE_LAYER_TYPES | EMPTY_LAYER_TYPES

__all__ = ["ATTENTION_LAYER_TYPES", "EMPTY_LAYER_TYPES", "HYBRID_LAYER_TYPES", "KNOWN_LAYER_TYPES", "KV_LAYER_TYPES",
           "STATE_LAYER_TYPES"]
