"""The layers of a :class:`~kveval.cache.compressed.CompressedCache`: per-sequence stores, masks, scoring and compression.

:class:`CompressedLayer` keeps, for every sequence of the batch separately, a
:class:`~kveval.cache.rows.RowState` (its token store plus each kept token's original position),
and a :class:`~kveval.tensors.batch_buffer.BatchBuffer` of the whole batch that
attention reads (updated in place, or by :mod:`kveval.cache.buffered_decode` alone in
decode steps that treat every row alike); it builds the mask attention must use once kept tokens no longer line up with
the input columns, accumulates the attention mass a selection policy asks for,
and compresses. :class:`CompressedHybridLayer` adds a linear-attention/Mamba
state kept by transformers' own code (Falcon-H1). See :mod:`kveval.cache.compressed` for
the life of a sequence.

The layer is three units and what joins them: row bookkeeping (:mod:`kveval.cache.layer_rows`), the batched decode
(:mod:`kveval.cache.layer_decode`) and scoring and compression (:mod:`kveval.cache.layer_compression`), each a mixin
that declares what it needs of the layer; here are the layer's state, ``update`` (a forward's tokens in, the K/V
attention reads out) and the masks.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

from kveval.cache.buffered_decode import BufferedDecode
from kveval.cache.layer_compression import LayerCompression, score_key, shared_by_group
from kveval.cache.layer_decode import LayerDecode
from kveval.cache.layer_masks import held_slots, positions_mask, visible_prefix
from kveval.cache.layer_rows import LayerRows
from kveval.cache.rows import RowState
from kveval.cache.shared_layers import SharedRead
from kveval.errors import UsageError
from kveval.tensors.batch_buffer import BatchBuffer


class CompressedLayer(LayerCompression, LayerDecode, LayerRows, CacheLayerMixin):
    """One layer of a :class:`CompressedCache`; stores each sequence of the batch separately."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int, sliding_window: int | None = None,
                 chunked: bool = False):
        super().__init__()
        self.cache, self.layer_idx, self.sliding_window = cache, layer_idx, sliding_window
        self.is_sliding = sliding_window is not None
        # Chunked attention (Llama 4): stored like a sliding layer (the model's own cache does so), but a
        # query sees only the tokens of its own chunk of ``sliding_window`` positions.
        self.chunked = chunked and self.is_sliding
        self.selection = cache.policy.selection if self.takes_selection else None
        self._rows: list[RowState] = []
        self.columns_seen = 0  # input columns processed, padding included (what DynamicLayer would report)
        self.contiguous = True  # every row holds every column: the model's own causal mask is exact
        self._query_positions: torch.Tensor | None = None
        self._slot_positions: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self.token_elements = 0  # K and V elements per token, all heads: what the model's own cache layer holds
        self._buffer: BatchBuffer | None = None  # what attention reads, kept in step with the rows
        # Decode steps done on the buffer alone (None: the rows do not allow it, or changed since the last check).
        self._decode: BufferedDecode | None = None
        self._buffer_only_step = False  # the current forward wrote the buffer alone (nothing to score)
        self._oldest_held = 0  # where a selection acts in a sliding window: the oldest position held (_window_clear)
        self._window_moving = False  # that window has reached what the selection kept: decode row by row
        #: Whether later layers read this one's K/V (:class:`~kveval.cache.shared_layers.ReadingLayer`), and what its
        #: attention read in the current forward, kept for them until the last has attended.
        self.read_by_others = layer_idx in cache.reused.values()
        self.shared_read: SharedRead | None = None

    @property
    def takes_selection(self) -> bool:
        """Whether a selection policy acts on this layer: a full-attention one, or a sliding one of a model whose
        every layer slides (:attr:`CompressedCache.selecting_layers`)."""
        return self.cache.selecting_layers.get(self.layer_idx, False)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs=None, **extra):
        """Store the new tokens and return the padded batch of kept K/V, ``[B, kv_heads, slots, head_dim]``.

        Also places the mask this layer's attention must use in ``kwargs`` (the
        attention module passes the same dict on to the attention function).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.cache.awaiting_reconstruction and self.cache.observer is None:
            raise UsageError(f"{self.cache.policy.spec}: a forward after the prefill, before KVzip's reconstruction "
                             f"pass; run it through kveval.runner.generation.generate (mode context)")
        if self.cache.evictions.pending and self.cache.evictions.holds(self._buffer):
            self.cache.evictions.flush()  # this layer runs again before the forward's last one did: evict first
        batch, _, q_len, _ = key_states.shape
        real = self.cache.input_real(batch, q_len, key_states.device)
        positions = self._new_positions(kwargs, real)
        counts, all_real = self.cache.input_counts(batch, q_len)
        if self._decode is None and self._buffer is not None and self._could_batch():
            # Rows changed since the last check (compression, an eviction): bring the buffer in step, then see
            # whether this step can be done for the batch at once.
            self._refresh_buffer()
            self._decode = self._batched_decode()
        if self._decode is not None and not self._decode.takes(counts):
            self.drop_decode()  # this step goes row by row; the next refresh checks the batch again
        if self._decode is not None and self._selects_in_window and not self._window_clear(kwargs, q_len):
            self._oldest_held = self._oldest_position()  # evictions may have dropped the oldest: read it again
            if not self._window_clear(kwargs, q_len):
                self.drop_decode()  # the window reaches what the selection kept: row by row from here on
                self._window_moving = True
        self._buffer_only_step = self._can_decode_on_buffer(kwargs, q_len)
        if self._buffer_only_step:
            # One batched write, no per-row work; the rows catch up when read, or when enough steps are pending.
            runs = self.cache.input_runs(batch, q_len)
            self._decode.append(self._buffer, key_states, value_states, positions, real, counts, runs,
                                self._positions_bound(kwargs, q_len))
            if self._decode.due:
                self._decode.catch_up(self._rows, self._buffer)
                self._share_dense_storage()
            elif self._buffer.grown:
                self._share_dense_storage()
        elif self._buffer is not None or not self._pack_first_tokens(self.rows, key_states, value_states, positions):
            self._append_row_by_row(key_states, value_states, positions, real, counts)
        self.columns_seen += q_len
        if not all_real:
            self.contiguous = False
        keys, values, slot_positions = self._buffer.views()
        if keys is None:  # a quantized layer held as codes: this step's K/V, dequantized into the shared scratch
            keys, values = self._decode.read(self.dtype, self.cache.scratch)
        self._query_positions = positions
        self._slot_positions = slot_positions
        # The mask of this forward's queries over the slots, which scoring reuses (None: the model's own causal mask).
        self._mask = None if self.contiguous else self._step_mask(positions, all_real)
        if kwargs is not None:
            kwargs["kveval_layer"] = self
            kwargs["kveval_mask"] = self._mask
        if self.read_by_others:
            self.shared_read = SharedRead(keys, values, self._mask)
        return keys, values

    def _new_positions(self, kwargs, real: torch.Tensor) -> torch.Tensor:
        """Original positions of the incoming tokens, ``[B, q]``: ``position_ids`` if the attention module gives
        them or the driver declared them (:meth:`_given_positions`), on this layer's device; else each row's count."""
        given = self._given_positions(kwargs, real.shape[1])
        if given is not None:  # declared positions sit on the model's first device, not on this layer's (device_map)
            return given.to(device=real.device, dtype=torch.long).expand(real.shape[0], -1)
        starts = torch.tensor([row.tokens_seen for row in self.rows], device=real.device)
        return starts[:, None] + real.long().cumsum(dim=1) - 1

    def _step_mask(self, query_positions: torch.Tensor, all_real: bool) -> torch.Tensor:
        """:meth:`allowed_mask` for this forward's queries, made from the rows' lengths alone where that is all it
        depends on: one real query per row (a decode step) in a layer without chunks, and without a window or with
        one that holds no more than the query sees (:meth:`_window_holds_all`). Every kept token then comes before
        the query, so the query sees exactly the slots that hold one. Where rows hold their
        tokens in their first ``lengths[b]`` slots, that is ``[B, 1, 1, width]``, the same for all heads (which SDPA
        reads with no copy per query head), and where every row fills the width one all-True tensor made once per
        shape; under per-head budgets, which leave padding before a head's tokens, the slots whose position is not
        padding's (``[B, heads, 1, width]``). The same mask as :meth:`allowed_mask`, which
        ``tests/test_buffered_decode.py`` checks for every policy family."""
        buffer = self._buffer
        if query_positions.shape[1] != 1 or not all_real or buffer is None or (self.is_sliding and not self._window_holds_all()):
            return self.allowed_mask(query_positions)
        if self.heads_apart:  # padding before a head's tokens: a slot is visible where it holds a token
            return held_slots(self._slot_positions)
        return visible_prefix(tuple(buffer.lengths), buffer.width, query_positions.device)

    def _window_holds_all(self) -> bool:
        """Whether this step's query sees every token its sliding layer holds: the step ran on the buffer alone with
        the window's eviction, so each row holds consecutive positions (checked when the batched decode starts, and
        each step's position follows the last) ending at the query's, and no row holds more than the window
        (:func:`~kveval.cache.decode_evictions._window_kept`). Not a chunked layer: its query sees its own chunk only."""
        eviction = self._decode.eviction if self._buffer_only_step else None
        return (not self.chunked and eviction is not None and eviction.trims_window
                and self._buffer.width <= self.sliding_window)

    def allowed_mask(self, query_positions: torch.Tensor) -> torch.Tensor:
        """Boolean ``[B, heads, q, slots]`` over the buffer's slots (:func:`~kveval.cache.layer_masks.positions_mask`).
        A layer without a selection (a sliding one beside full ones, any under a policy that selects nothing) keeps
        the same tokens in every head: a window trims all heads alike."""
        return positions_mask(self._slot_positions, query_positions, self.sliding_window, self.chunked,
                              heads_share=self.selection is None)


class CompressedHybridLayer(LinearAttentionLayer, CompressedLayer):
    """A layer with both a linear-attention/Mamba state and attention (Falcon-H1's parallel heads).

    The state is transformers' own ``LinearAttentionLayer`` code, kept exactly;
    the attention tokens are a :class:`CompressedLayer`, compressed by the policy.
    Mirrors transformers' ``LinearAttentionAndFullAttentionLayer``.
    """

    is_compileable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int, sliding_window: int | None = None, number_of_states: int = 1):
        CompressedLayer.__init__(self, cache, layer_idx, sliding_window)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # ``update`` passes K and V positionally; the state updates pass keywords only.
        if len(args) == 2 and not kwargs:
            CompressedLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        CompressedLayer.reset(self)


__all__ = ["CompressedHybridLayer", "CompressedLayer", "score_key", "shared_by_group"]
