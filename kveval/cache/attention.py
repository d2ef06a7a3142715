"""The ``kveval`` attention function, registered through transformers' ``AttentionInterface``.

With an ordinary cache it computes exactly the model's attention: transformers'
SDPA, or the model's own eager attention for variants SDPA cannot express
(softcapping, learned sinks; see :mod:`kveval.modeling.architectures`). With a
:class:`~kveval.cache.compressed.CompressedCache`, the cache layer puts itself and, when
the kept tokens no longer line up with the input columns, its own mask into the
attention kwargs during ``cache.update`` (the attention module passes that same
dict to this function). Attention then runs on the kept tokens under that mask,
and afterwards the layer may score and compress (see
:meth:`kveval.cache.layers.CompressedLayer.after_attention`), using the same kernel's
attention probabilities. A quantization policy may round the queries as an engine's Q.K product takes them
(:meth:`~kveval.policies.base.QuantizationPolicy.attended_query`: llama.cpp converts Q to the K cache's
``vec_dot_type``). No modeling code is copied or patched, with one exception: Llama 4 scales the queries
of its layers without RoPE by a position that counts a left-padded row's padding, so in the forwards kveval
drives it turns that scaling off and applies it here, per row
(:func:`kveval.modeling.architectures.row_query_temperatures`).
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

from kveval.modeling.architectures import KVEVAL_ATTENTION, attention_kernel, is_native, taken_query_temperature
from kveval.tensors.block_probabilities import AttentionProbabilities

ATTENTION_NAME = KVEVAL_ATTENTION


def kveval_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """Exact attention over the cache's kept tokens (``query`` is ``[B, heads, q, head_dim]``)."""
    layer = kwargs.pop("kveval_layer", None)
    own_mask = kwargs.pop("kveval_mask", None)
    attention_mask = _fold_sparse_indices(attention_mask, kwargs.pop("indices", None), query, key)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if own_mask is not None:
        if own_mask.shape[1] > 1 and own_mask.shape[1] != query.shape[1]:
            own_mask = own_mask.repeat_interleave(query.shape[1] // own_mask.shape[1], dim=1)
        attention_mask = own_mask
    if layer is not None:
        attention_mask = layer.hide_evicted(attention_mask, query, key)
    temperature = taken_query_temperature(module)
    if temperature is not None:  # Llama 4 without RoPE: each row's queries by its own positions, not the batch's
        if layer is None or layer.cache.input_positions is None:
            raise RuntimeError(f"{type(module).__name__}'s query temperature was taken over in a forward without "
                               "declared positions")
        query = temperature.apply(query, layer.cache.input_positions.to(query.device))
    quantization = layer.cache.policy.quantization if layer is not None else None
    if quantization is not None:  # an engine's Q.K may take Q in the K cache's type (llama.cpp)
        query = quantization.attended_query(query)
    kernel = attention_kernel(module, kwargs)
    output = kernel.attend(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if layer is not None:
        if layer.cache.observer is not None:  # KVzip's reconstruction forwards (kveval.cache.reconstruction)
            layer.cache.observer(layer, query, key, scaling)
        probabilities = partial(kernel.probabilities, module, scaling=scaling, kwargs=kwargs)
        layer.after_attention(query, key, AttentionProbabilities(probabilities, kernel.slot_step(module)))
    return output, None


def _fold_sparse_indices(attention_mask, indices, query, key):
    """DeepSeek V3.2 / GLM MoE-DSA: the indexer's top-k tokens per query (``indices``, ``[B, q, k]``), which the model
    folds into the mask itself only for its eager and SDPA attention and otherwise hands to the attention function:
    folded here exactly as the model folds them (every other key at the dtype's lowest value)."""
    if indices is None:
        return attention_mask
    batch, _, q_len, _ = query.shape
    unselected = (indices.new_ones((batch, q_len, key.shape[2]), dtype=torch.bool)
                  .scatter(-1, indices.long(), False).unsqueeze(1))
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~unselected
    return attention_mask.masked_fill(unselected, torch.finfo(query.dtype).min)


def kveval_mask(*args, config=None, **kwargs):
    """The model's mask for ``attn_implementation="kveval"``: SDPA's (boolean, or ``None`` where causal), and for the
    models whose own cache layers kveval mirrors (:mod:`kveval.cache.native_layers`) always the eager one, additive:
    their attention adds the compressor's block bias and the indexer's top-k to it, which needs a tensor of 0 / -inf
    (what the model's eager attention gets)."""
    if config is not None and is_native(config):
        return eager_mask(*args, config=config, **kwargs)
    return sdpa_mask(*args, config=config, **kwargs)


def register_attention() -> None:
    """Make ``attn_implementation="kveval"`` available (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kveval_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, kveval_mask)
