"""Cache layers that store nothing and read an earlier layer's K/V: a structure that acts across layers
(:meth:`~kveval.policies.base.StructurePolicy.reused_layers`: ``share``).

:class:`SharedRead` is what a source layer's attention read in one forward (its stored K/V plus the forward's tokens,
the mask it ran under), kept by the source (:class:`~kveval.cache.layers.CompressedLayer`) until its last reader has
attended; :class:`ReadingLayer` hands it to its own attention in place of the K/V the model computed for it, which
are discarded. A reading layer holds no rows, so it holds 0 bytes, and a selection never scores its attention: the
source's tokens are chosen by the source's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin


@dataclass
class SharedRead:
    """The K/V (``[B, kv_heads, slots, dim]``) a source layer's attention read in this forward, and its own mask
    (``None``: the model's causal mask)."""

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None

    def detached(self) -> "SharedRead":
        """A copy the source's compression after its attention (a prefill's selection, a decode eviction, the
        buffer it refreshes in place) cannot change."""
        return SharedRead(self.keys.clone(), self.values.clone(), None if self.mask is None else self.mask.clone())


class ReadingLayer(CacheLayerMixin):
    """Layer ``layer_idx`` of a :class:`~kveval.cache.compressed.CompressedCache`, reading layer ``source``'s K/V."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int, source: int, last_reader: bool):
        super().__init__()
        self.cache, self.layer_idx, self.source_idx, self.last_reader = cache, layer_idx, source, last_reader

    @property
    def source(self):
        """The layer whose K/V this one reads (looked up, so that a forked or derived cache's layer reads its own)."""
        return self.cache.layers[self.source_idx]

    @property
    def is_sliding(self) -> bool:
        return self.source.is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs=None, **extra):
        """The source's K/V as its attention read them in this forward; ``key_states``/``value_states`` (this layer's
        own projections) are discarded."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        read = self.source.shared_read
        if read is None:
            raise RuntimeError(f"layer {self.layer_idx} reads layer {self.source_idx}'s K/V before that layer attended "
                               f"in this forward")
        if kwargs is not None:
            kwargs["kveval_layer"] = self
            kwargs["kveval_mask"] = read.mask
        return read.keys, read.values

    def hide_evicted(self, attention_mask, query: torch.Tensor, key: torch.Tensor):
        """As the source hides what it no longer holds."""
        return self.source.hide_evicted(attention_mask, query, key)

    def after_attention(self, query, keys, probabilities) -> None:
        """Nothing to score or compress (the deferred decode budgets are kept after the last storing layer's
        attention, :attr:`CompressedCache.last_attention_layer`); the last reader of a source lets its read go."""
        if self.last_reader:
            self.source.shared_read = None

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.source.get_mask_sizes(query_length, *args)

    def get_seq_length(self) -> int:
        return self.source.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False


__all__ = ["ReadingLayer", "SharedRead"]
