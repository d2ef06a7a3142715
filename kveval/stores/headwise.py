"""A token store whose KV heads hold different numbers of tokens (head-adaptive budgets: AdaKV, DuoAttention).

:class:`HeadwiseStore` keeps one inner store per KV head, each built by the
cache's own store factory (so quantization stacks: each head's tokens are
quantized exactly as a ``[1, T, D]`` store would quantize them). Attention
gets a left-padded ``[H, slots, D]`` view, ``slots`` being the longest head;
the cache layer marks the padding slots of every head with an invisible
position, so the per-head mask hides them. Memory is really saved: a head's
inner store holds only its own tokens, and :attr:`nbytes` counts those alone.

Index convention: :meth:`select` and :meth:`select_heads` take slot indices
in the padded layout :meth:`keys_values` shows (a head's real tokens are its
last ``head_lengths[h]`` slots); they must never name a padding slot.
"""

from __future__ import annotations

from typing import Callable

import torch

from kveval.stores.base import BatchFamily, TokenStore
from kveval.tensors.batch_buffer import PAD_POSITION


class HeadwiseStore(TokenStore):
    """One inner :class:`TokenStore` per KV head, created on the first append by ``make_store()``."""

    batch_family = BatchFamily.PER_HEAD
    ragged_heads = True

    def __init__(self, make_store: Callable[[], TokenStore]):
        self.make_store = make_store
        self.heads: list[TokenStore] = []

    @property
    def head_lengths(self) -> list[int]:
        """Tokens held by each KV head."""
        return [inner.length for inner in self.heads]

    @property
    def length(self) -> int:
        """Slots of the padded view: the longest head's token count."""
        return max(self.head_lengths, default=0)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not self.heads:
            self.heads = [self.make_store() for _ in range(keys.shape[0])]
        for h, inner in enumerate(self.heads):
            inner.append(keys[h:h + 1], values[h:h + 1])

    def seal(self) -> None:
        for inner in self.heads:
            inner.seal()

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[H, slots, D]`` keys and values, each head's tokens right-aligned after zero padding."""
        parts = [inner.keys_values() for inner in self.heads]
        slots = self.length
        if all(k.shape[1] == slots for k, _ in parts):
            return torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])
        keys = parts[0][0].new_zeros(len(parts), slots, parts[0][0].shape[-1])
        values = parts[0][1].new_zeros(len(parts), slots, parts[0][1].shape[-1])
        for h, (k, v) in enumerate(parts):
            n = k.shape[1]
            if n:
                keys[h, slots - n:], values[h, slots - n:] = k[0], v[0]
        return keys, values

    def select(self, index: torch.Tensor) -> None:
        self.select_heads(list(index))

    def load(self, keys: torch.Tensor, values: torch.Tensor, lengths: list[int]) -> None:
        """Hold exactly, in head ``h``, the last ``lengths[h]`` slots of ``keys[h]``/``values[h]`` (``[H, slots, D]``,
        the padded layout :meth:`keys_values` shows); every head's inner store must be dense (it has ``load``)."""
        slots = keys.shape[1]
        for h, (inner, n) in enumerate(zip(self.heads, lengths)):
            inner.load(keys[h:h + 1, slots - n:], values[h:h + 1, slots - n:])

    def holds_dense(self) -> bool:
        return all(inner.holds_dense() for inner in self.heads)

    def load_buffer_row(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Each head holds its real (last) slots: those whose position is not the padding's."""
        self.load(keys, values, (positions != PAD_POSITION).sum(dim=1).tolist())

    def kept_tokens(self) -> int:
        if not self.heads:
            return self.length
        lengths = self.head_lengths
        return round(sum(lengths) / len(lengths))

    def select_heads(self, index: list[torch.Tensor]) -> None:
        """Keep, in head ``h``, the slots ``index[h]`` (increasing; the heads' counts may differ)."""
        slots = self.length
        for inner, n, kept in zip(self.heads, self.head_lengths, index):
            inner.select((kept - (slots - n)).unsqueeze(0))

    @property
    def nbytes(self) -> int:
        return sum(inner.nbytes for inner in self.heads)


__all__ = ["HeadwiseStore"]
