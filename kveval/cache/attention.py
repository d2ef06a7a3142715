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

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kveval.modeling.architectures import KVEVAL_ATTENTION, attention_kernel, taken_query_temperature
from kveval.tensors.block_probabilities import AttentionProbabilities

ATTENTION_NAME = KVEVAL_ATTENTION


def kveval_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """Exact attention over the cache's kept tokens (``query`` is ``[B, heads, q, head_dim]``)."""
    layer = kwargs.pop("kveval_layer", None)
    own_mask = kwargs.pop("kveval_mask", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if own_mask is not None:
        if own_mask.shape[1] > 1 and own_mask.shape[1] != query.shape[1]:
            own_mask = own_mask.repeat_interleave(query.shape[1] // own_mask.shape[1], dim=1)
        attention_mask = own_mask
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
        probabilities = partial(kernel.probabilities, module, scaling=scaling, kwargs=kwargs)
        layer.after_attention(query, key, AttentionProbabilities(probabilities, kernel.slot_step(module)))
    return output, None


def register_attention() -> None:
    """Make ``attn_implementation="kveval"`` available (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kveval_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
