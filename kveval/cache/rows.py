"""One sequence's state in one layer of a :class:`~kveval.cache.compressed.CompressedCache`: its token store, the original
position of every kept token, and the scores a selection policy accumulates for it.

:class:`RowState` is what :mod:`kveval.cache.layers` compresses row by row and what
:mod:`kveval.cache.buffered_decode` brings up to date after batched decode steps; :func:`seal_rows` seals rows'
stores together once told their tokens' positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.stores.base import TokenStore, seal_together
from kveval.tensors.batch_buffer import PAD_POSITION as _PAD_POSITION


def _left_pad(rows: list[torch.Tensor], slots: int, fill) -> torch.Tensor:
    """``[len(rows), slots]``: each 1-D row right-aligned, ``fill`` before it."""
    out = rows[0].new_full((len(rows), slots), fill)
    for h, r in enumerate(rows):
        if r.numel():
            out[h, slots - r.numel():] = r
    return out


@dataclass
class RowState:
    """One sequence in one layer: its store, the original position of every kept token, and policy scores."""

    store: TokenStore
    positions: torch.Tensor  # [kv_heads, tokens], int64
    attention: torch.Tensor | None = None  # [kv_heads, tokens], accumulated as the policy asks
    tokens_seen: int = 0  # real tokens ever appended (the uncompressed length)
    compressed: bool = False
    scores: dict | None = None  # deferred prefill only: {score_key: [kv_heads, tokens]} for every policy it serves
    #: The prefill's queries as attention read them (after RoPE), ``[query_heads, tokens, head_dim]``, for a policy
    #: whose ``attention`` is ``"queries"`` (Expected Attention); dropped once the row is compressed.
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None  # [queries], their positions

    def take(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, columns: "slice | torch.Tensor") -> None:
        """Append the tokens in ``columns`` of one row's ``keys``/``values`` (``[H, q, D]``) at ``positions`` (``[q]``).

        ``columns``: a slice (no device sync), or a boolean mask. The store gets tensors of its own, as a boolean
        index gives, except a :class:`~kveval.stores.base.DenseStore`, which makes its own contiguous copy in its
        ``kv_dtype`` where the view is not one already, and is otherwise pointed at the layer's batch buffer within
        the same update: no store keeps the whole batch's tensor alive (:attr:`~kveval.stores.base.TokenStore.copies_on_append`)."""
        keys, values = keys[:, columns], values[:, columns]
        if isinstance(columns, slice) and not self.store.copies_on_append:
            keys, values = (x.clone(memory_format=torch.contiguous_format) for x in (keys, values))
        self.store.append(keys, values)
        self.took(positions[columns])

    def took(self, positions: torch.Tensor) -> None:
        """The store appended tokens at original ``positions`` (``[n]``): every head's positions extend by them."""
        self.positions = torch.cat([self.positions, positions.unsqueeze(0).expand(self.positions.shape[0], -1)], dim=1)
        self.tokens_seen += positions.shape[0]

    def place_positions(self) -> None:
        """Before sealing (:func:`seal_rows`): the store is told every held token's original position, which only the
        cache knows (sliding trims, shared prefills), for a store that encodes by position (kvquant's pre-RoPE
        keys: :meth:`~kveval.stores.base.TokenStore.place_positions`)."""
        self.store.place_positions(self.positions)

    def keep(self, index: torch.Tensor) -> None:
        """Keep slots ``index`` (``[H, T']``) of the store and of everything held per slot."""
        self.store.select(index)
        self._keep_held(index)

    def _keep_held(self, index: torch.Tensor) -> None:
        """What is held per slot beside the store keeps slots ``index`` (``[H, T']``)."""
        self.positions = self.positions.gather(1, index)
        if self.attention is not None:
            self.attention = self.attention.gather(1, index)
        if self.scores:
            self.scores = {key: scores.gather(1, index) for key, scores in self.scores.items()}

    def keep_last(self, count: int) -> None:
        """Keep each head's last ``count`` slots (a sliding window's trim): :meth:`keep` of them, the store's part
        without reading the device (:meth:`~kveval.stores.base.TokenStore.keep_last`)."""
        n = self.positions.shape[1]
        index = torch.arange(n - count, n, device=self.positions.device).expand(self.positions.shape[0], -1)
        self.store.keep_last(index)
        self._keep_held(index)

    def keep_heads(self, index: list[torch.Tensor]) -> None:
        """Keep slots ``index[h]`` of each head ``h``, heads keeping different numbers of tokens (per-head budgets,
        a store whose :attr:`~kveval.stores.base.TokenStore.ragged_heads`): what is held per slot is left-padded,
        padding slots at the padding position (invisible) with no attention or score."""
        self.store.select_heads(index)
        slots = max(i.numel() for i in index)
        self.positions = _left_pad([p[i] for p, i in zip(self.positions, index)], slots, _PAD_POSITION)
        if self.attention is not None:
            self.attention = _left_pad([a[i] for a, i in zip(self.attention, index)], slots, 0)
        if self.scores:
            self.scores = {key: _left_pad([t[i] for t, i in zip(scores, index)], slots, 0)
                           for key, scores in self.scores.items()}

    def window_index(self, window: int, first_new_position: int) -> "torch.Tensor | list[torch.Tensor] | None":
        """The slots a sliding layer of ``window`` positions keeps for a query at ``first_new_position`` (the
        model's own window), ``[H, T']``, or one index per head where heads hold different tokens (per-head
        budgets: :attr:`~kveval.stores.base.TokenStore.ragged_heads`); ``None`` when it keeps them all."""
        if self.store.ragged_heads:
            held = self.positions != _PAD_POSITION
            visible = (self.positions > first_new_position - window) & held
            if bool((visible == held).all()):
                return None
            return [v.nonzero().squeeze(1) for v in visible]
        visible = self.positions[0] > first_new_position - window
        if bool(visible.all()):
            return None
        return visible.nonzero().squeeze(1).unsqueeze(0).expand(self.positions.shape[0], -1)

    @property
    def padding(self) -> torch.Tensor | None:
        """``[kv_heads, slots]``: True on the padding slots of heads holding fewer tokens (per-head budgets), else ``None``."""
        if not self.store.ragged_heads:
            return None
        padding = self.positions == _PAD_POSITION
        return padding if bool(padding.any()) else None

    def kept_tokens(self) -> int:
        """Tokens held per KV head (rounded mean over heads when per-head budgets differ)."""
        return self.store.kept_tokens()

    def index_bytes(self) -> int:
        """Bookkeeping bytes: the original position (and any score) of every real token; padding slots not counted."""
        padding = self.padding
        real = self.positions.numel() - (0 if padding is None else int(padding.sum()))
        total = real * self.positions.element_size()
        if self.attention is not None:
            total += real * self.attention.element_size()
        return total


def seal_rows(rows: list[RowState]) -> None:
    """Seal every row's store, once told its tokens' positions (:meth:`RowState.place_positions`); the stores of one
    class together (:func:`~kveval.stores.base.seal_together`: one encoding for the batch where a store's encoding is
    per token)."""
    for row in rows:
        row.place_positions()
    seal_together([row.store for row in rows])


__all__ = ["RowState", "seal_rows"]
