"""DeepSeek's per-token records (:mod:`kveval.tensors.ds_records`) as token stores: the cache's store part and the
parts of a model's own cache layer, every token coded on arrival as the engine writes it.

:class:`RecordStore` is an :class:`~kveval.stores.engine.EngineStore` whose coding of K and V is picked by what it is
handed: an MLA latent with its RoPE key beside it (V3.2: K the latent, V the RoPE key) or K=V entries (V4's window:
values of width 0). :class:`RecordSequence` holds one row of a part of keys alone (V4's compressed entries, an
indexer's keys) with the interface of :class:`~kveval.stores.quantized.QuantizedSequence`.
"""

from __future__ import annotations

from typing import Callable

import torch

from kveval.stores.quantized import KeysOnlySequence
from kveval.stores.engine import EngineCodec, EngineStore
from kveval.tensors.ds_records import Empty


class RecordStore(EngineStore):
    """An engine store whose codec is ``codec_for(key_dim, value_dim)``, chosen when the first tokens arrive."""

    def __init__(self, codec_for: Callable[[int, int], EngineCodec], compute_dtype: torch.dtype | None = None):
        super().__init__(None, compute_dtype)
        self.codec_for = codec_for

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.codec is None:
            self.codec = self.codec_for(keys.shape[-1], values.shape[-1])
        super().append(keys, values)


class RecordSequence(KeysOnlySequence):
    """One row of a part of keys alone (``[1, n, width]`` each time), each entry one record of ``codec``, coded as it
    arrives (nothing waits for :meth:`seal`)."""

    def __init__(self, codec):
        super().__init__(EngineStore(EngineCodec(codec, Empty()), None))


__all__ = ["RecordSequence", "RecordStore"]
