"""The ``kveval`` attention function, registered through transformers' ``AttentionInterface``.

With an ordinary cache it is exactly transformers' SDPA attention. With a
:class:`~kveval.cache.CompressedCache`, the cache layer puts itself and, when
the kept tokens no longer line up with the input columns, its own mask into the
attention kwargs during ``cache.update`` (the attention module passes that same
dict to this function). Attention then runs on the kept tokens under that mask,
and afterwards the layer may score and compress (see
:meth:`kveval.cache.CompressedLayer.after_attention`). No modeling code is
copied or patched.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION_NAME = "kveval"


def kveval_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """SDPA attention over the cache's kept tokens (``query`` is ``[B, heads, q, head_dim]``)."""
    layer = kwargs.pop("kveval_layer", None)
    own_mask = kwargs.pop("kveval_mask", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if own_mask is not None:
        if own_mask.shape[1] > 1 and own_mask.shape[1] != query.shape[1]:
            own_mask = own_mask.repeat_interleave(query.shape[1] // own_mask.shape[1], dim=1)
        attention_mask = own_mask
    output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if layer is not None:
        layer.after_attention(query, key, scaling)
    return output, None


def register_attention() -> None:
    """Make ``attn_implementation="kveval"`` available (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kveval_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
