"""Row bookkeeping of a :class:`~kveval.cache.layers.CompressedLayer`: its rows, the batch buffer attention reads, and
what changes them row by row.

:class:`LayerRows` holds every sequence's :class:`~kveval.cache.rows.RowState` and the layer's
:class:`~kveval.tensors.batch_buffer.BatchBuffer`, keeps the two in step (each row from the first slot its store
changed; dense rows hold views of the buffer), appends a forward's tokens row by row (or packs a prefill's for the
batch at once), and applies what a selection or a sliding window keeps (:meth:`LayerRows._select`, the window
trims). The batched decode (:mod:`kveval.cache.layer_decode`) writes the buffer alone and the rows catch up here.
"""

from __future__ import annotations

import torch

from kveval.cache.buffered_decode import BufferedDecode
from kveval.cache.rows import RowState, seal_rows
from kveval.stores.base import BatchFamily
from kveval.stores.headwise import HeadwiseStore
from kveval.tensors.batch_buffer import PAD_POSITION, BatchBuffer, slot_range, uploaded


class LayerRows:
    """The rows of a cache layer and the buffer attention reads (a mixin of :class:`~kveval.cache.layers.CompressedLayer`).

    Needs of the layer: the attributes annotated below, set by its ``__init__``. The batched decode whose pending
    steps the rows catch up with (``_decode``) is started by :class:`~kveval.cache.layer_decode.LayerDecode`.
    """

    cache: "CompressedCache"
    layer_idx: int
    sliding_window: "int | None"
    is_sliding: bool
    selection: object  # SelectionPolicy or None
    _rows: list[RowState]
    _buffer: "BatchBuffer | None"
    _decode: "BufferedDecode | None"
    columns_seen: int
    contiguous: bool
    token_elements: int

    @property
    def rows(self) -> list[RowState]:
        """Every sequence's :class:`RowState`, caught up with the decode steps done on the buffer alone."""
        self._catch_up()
        return self._rows

    @rows.setter
    def rows(self, rows: list[RowState]) -> None:
        self._rows, self._buffer, self._decode = rows, None, None

    def _catch_up(self) -> None:
        """Rows catch up with the decode steps done on the buffer alone (if any are pending)."""
        if self.cache.evictions.pending:  # read mid-forward: every deferred eviction first
            self.cache.evictions.flush()
        if self._decode is not None and self._decode.pending:
            self._decode.catch_up(self._rows, self._buffer)
            self._share_dense_storage()

    def drop_decode(self) -> None:
        """Stop decoding on the buffer alone (the rows first catch up); the next step's refresh checks again."""
        self._catch_up()
        self._decode = None

    def drop_buffer(self) -> None:
        """Free the batch buffer (the rows first catch up); the next forward rebuilds it from the rows."""
        self.rows = self.rows

    def _refresh_buffer(self) -> None:
        """Bring the buffer in step with the rows: each row from the first slot its store changed."""
        rows = self._rows
        if self._buffer is not None and not self._buffer.holds_values:  # it held codes' positions only: rebuild
            self._buffer = None
        self._give_back_room()
        if self._buffer is None:
            keys, values = next(((k, v) for k, v in (r.store.keys_values() for r in rows) if k is not None), (None, None))
            if keys is None:
                return
            self._buffer = BatchBuffer(len(rows), keys.shape[0], keys.shape[-1], values.shape[-1], keys.dtype, keys.device)
        buffer = self._buffer
        for b, row in enumerate(rows):
            n = row.store.length
            start = min(row.store.changed_from(), buffer.lengths[b], n)
            if start < n or n != buffer.lengths[b]:
                keys, values = row.store.keys_values_from(start)
                buffer.write_row(b, start, keys, values, row.positions[:, start:])
            row.store.mark_read()
        self._share_dense_storage()

    def _give_back_room(self) -> None:
        """Free the buffer once the rows hold far fewer tokens than its room (compressed, evicted), for one that
        fits them (:meth:`_refresh_buffer`)."""
        if self._buffer is not None and self._rows and self._buffer.oversized(max(r.store.length for r in self._rows)):
            self._buffer = None

    def _share_dense_storage(self) -> None:
        """Dense rows whose ``kv_dtype`` is the compute dtype hold views of the buffer: the cache is held once."""
        buffer = self._buffer
        if buffer is None or not buffer.holds_values or buffer.keys.dtype != self.cache.kv_dtype:
            return
        for b, row in enumerate(self._rows):
            row.store.share_batch_row(buffer.keys, buffer.values, b, buffer.grown)
        buffer.grown = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        heads = key_states.shape[1]
        self.token_elements = heads * key_states.shape[-1] + value_states.shape[1] * value_states.shape[-1]
        no_positions = torch.empty(heads, 0, dtype=torch.long, device=self.device)  # shared: never written in place
        self.rows = [RowState(self.new_store(key_states.dtype), no_positions) for _ in range(key_states.shape[0])]
        self.is_initialized = True

    @property
    def heads_apart(self) -> bool:
        """Whether the selection budgets KV heads apart: rows then hold per-head stores, and in the batch buffer each
        head's tokens end at its row's last slot, padding before them."""
        return self.selection is not None and self.selection.per_head_budgets

    def new_store(self, dtype: torch.dtype):
        """An empty store for one sequence: one inner store per KV head when the selection budgets heads apart."""
        if self.heads_apart:
            cache, layer_idx = self.cache, self.layer_idx
            return HeadwiseStore(lambda: cache.new_store(layer_idx, dtype))
        return self.cache.new_store(self.layer_idx, dtype)

    def _append_row_by_row(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, real: torch.Tensor,
                           counts: list[int]) -> None:
        """Each row's store appends its real tokens (sliding rows first drop what the new tokens' window leaves
        out; compressed rows seal), then the buffer is brought in step from the first slot each row changed."""
        rows, sealing = self.rows, []
        if self.is_sliding and any(row.positions.shape[1] for row in rows):
            # Each row's first new position (padding never the least), None where it has no new token.
            firsts = positions.masked_fill(~real, torch.iinfo(positions.dtype).max).amin(dim=1)
            self._trim_rows_to_window(rows, [firsts[b] if n else None for b, n in enumerate(counts)])
        for b, row in enumerate(rows):
            if counts[b]:
                row.take(keys[b], values[b], positions[b], self.cache.real_columns(b))
                if row.compressed:
                    sealing.append(row)
        seal_rows(sealing)
        self._refresh_buffer()

    def _pack_first_tokens(self, rows: list[RowState], keys: torch.Tensor, values: torch.Tensor,
                           positions: torch.Tensor) -> bool:
        """A layer's first tokens (the prefill), for the whole batch at once, where every row is an empty dense
        store and holds contiguous input columns (:meth:`BatchBuffer.packed`): its stores hold views of the packed
        tokens, or of the buffer when ``kv_dtype`` is the compute dtype. Whether it did; else the rows append one
        by one."""
        if any(row.store.batch_family is not BatchFamily.DENSE or row.store.length or row.positions.shape[1] or row.compressed
               for row in rows):
            return False
        runs = self.cache.input_runs(len(rows), keys.shape[2])
        if runs is None or all(start == stop for start, stop in runs):
            return False
        buffer, stored_keys, stored_values, held = BatchBuffer.packed(keys, values, positions, runs, self.cache.kv_dtype)
        for b, (row, n) in enumerate(zip(rows, buffer.lengths)):
            if n:  # a row of padding alone holds nothing, as when it appends nothing
                row.store.hold(stored_keys[b, :, :n], stored_values[b, :, :n])
                row.positions, row.tokens_seen = held[b, :, :n], row.tokens_seen + n
        self._buffer = buffer
        self._share_dense_storage()
        return True

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.columns_seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.rows, self.columns_seen, self.contiguous, self.is_initialized = [], 0, True, False
        self._oldest_held, self._window_moving = 0, False

    def _select(self, row: RowState, index: "torch.Tensor | list[torch.Tensor]") -> None:
        """Keep slots ``index`` of ``row``: ``[H, T']``, or one index tensor per head (per-head budgets)."""
        if isinstance(index, list):
            if len({i.numel() for i in index}) > 1:
                self._select_heads(row, index)
                return
            index = torch.stack(index)
        n = row.store.length
        if index.shape[-1] == n and bool((index == torch.arange(n, device=index.device)).all()):
            return  # every token kept (DuoAttention's retrieval heads): the model's own mask stays exact
        self._decode = None
        row.keep(index)
        self.contiguous = False

    def _select_heads(self, row: RowState, index: list[torch.Tensor]) -> None:
        """Heads keep different numbers of tokens: each its own (:meth:`RowState.keep_heads`)."""
        self._decode = None
        row.keep_heads(index)
        self.contiguous = False

    def _trim_to_window(self, row: RowState, first_new_position: int | None) -> None:
        """Sliding layers: drop tokens no upcoming query can see (the model's own window)."""
        index = None if first_new_position is None else row.window_index(self.sliding_window, first_new_position)
        if index is not None:
            self._select(row, index)

    def _trim_rows_to_window(self, rows: list[RowState], firsts: "list[torch.Tensor | None] | None") -> None:
        """:meth:`_trim_to_window` for every row, with one device read for the layer rather than up to four per row.

        ``firsts[b]``: row ``b``'s first new position (a 0-dim tensor), or ``None`` where no token comes; ``firsts``
        ``None``: the position after each row's last (the prefill's end). A row's tokens at positions past
        ``first - window`` stay. Where a row holds its tokens in ascending positions (as every driver of kveval
        appends them), those are its last slots, and how many is all the host needs; the read brings each row's
        count and whether its positions ascend, and a row whose positions do not is trimmed alone, as before."""
        held = [b for b, row in enumerate(rows) if row.positions.shape[1] and (firsts is None or firsts[b] is not None)]
        if not held:
            return
        if self.selection is not None:  # a selecting sliding layer: heads may hold different positions
            for b in held:
                row = rows[b]
                real = row.positions[row.positions != PAD_POSITION]
                if real.numel():
                    self._trim_selected_to_window(row, int(real.max()) + 1 if firsts is None else int(firsts[b]))
            return
        lengths = tuple(rows[b].positions.shape[1] for b in held)
        device = rows[held[0]].positions.device
        padded = torch.nn.utils.rnn.pad_sequence([rows[b].positions[0] for b in held], batch_first=True,
                                                 padding_value=-1)  # every head holds the same positions
        inside = slot_range(max(lengths), device) < uploaded(lengths, device)[:, None]
        if firsts is None:
            ends = padded.amax(dim=1) + 1  # padding slots (-1) are never the largest
        else:
            ends = torch.stack([firsts[b] for b in held]).to(device)
        visible = (padded > (ends - self.sliding_window)[:, None]) & inside
        ascending = ((padded[:, 1:] > padded[:, :-1]) | ~inside[:, 1:]).all(dim=1)
        counts, ordered = torch.stack([visible.sum(dim=1), ascending.long()]).tolist()
        for b, n, count, in_order, end in zip(held, lengths, counts, ordered, ends):
            row = rows[b]
            if not in_order:
                self._trim_to_window(row, int(end))
            elif count < n:  # its last ``count`` slots, in every head
                self._decode = None
                row.keep_last(count)
                self.contiguous = False

    def _trim_selected_to_window(self, row: RowState, end: int) -> None:
        """A sliding layer's trim where a selection chose each KV head's tokens apart (every layer of the model
        slides: :attr:`takes_selection`), for the next query at position ``end``. Heads with stores of their own
        (per-head budgets) each drop what leaves their window. Heads sharing one store hold as many tokens each:
        they keep as many as the head with the most still inside the window, each its newest, and a head's older
        ones stay held but masked (:meth:`allowed_mask` reads the window), as a dense per-layer cache of the
        deployment would hold them."""
        if row.store.ragged_heads:
            self._trim_to_window(row, end)
            return
        positions = row.positions
        keep = int((positions > end - self.sliding_window).sum(dim=1).max())
        if keep < positions.shape[1]:
            self._select(row, positions.topk(keep, dim=1).indices.sort(dim=1).values)

    def nominal_tokens(self, row: RowState) -> int:
        # A sliding layer of the model's own cache holds the last window - 1 tokens between forwards.
        return row.tokens_seen if not self.is_sliding else min(row.tokens_seen, self.sliding_window - 1)


__all__ = ["LayerRows"]
