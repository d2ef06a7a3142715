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
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

from kveval.cache.buffered_decode import BufferedDecode
from kveval.cache.decode_evictions import BudgetEviction
from kveval.cache.layer_masks import held_slots, positions_mask, visible_prefix
from kveval.cache.rows import RowState, seal_rows
from kveval.errors import UsageError
from kveval.stores.base import DenseStore
from kveval.stores.headwise import HeadwiseStore
from kveval.tensors.batch_buffer import PAD_POSITION, BatchBuffer, slot_range, uploaded
from kveval.tensors.block_probabilities import AttentionProbabilities, attention_mass
from kveval.tensors.scoring_state import ScoringState


def score_key(selection) -> tuple | None:
    """Which attention mass ``selection`` scores with: ``(kind, window)``, or ``None`` when it needs none.

    Policies with equal keys read the same scores (SnapKV and PyramidKV at one
    window, every H2O, every TOVA), so a shared prefill computes each key once.
    """
    needs = "none" if selection is None else selection.attention
    if needs == "none":
        return None
    return needs, (selection.window if needs == "window" else None)


def shared_by_group(scores: torch.Tensor, store) -> torch.Tensor:
    """``scores`` (``[kv_heads, n]``) averaged over each group of heads that keeps one set of tokens
    (a store's ``head_groups``: kveval.stores.latent's groups of KV heads), so every head of a group picks the same ones."""
    group = getattr(store, "head_groups", 1)
    if group == 1:
        return scores
    return scores.reshape(-1, group, scores.shape[1]).mean(dim=1).repeat_interleave(group, dim=0)


class CompressedLayer(CacheLayerMixin):
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

    @property
    def takes_selection(self) -> bool:
        """Whether a selection policy acts on this layer: a full-attention one, or a sliding one of a model whose
        every layer slides (:attr:`CompressedCache.selecting_layers`)."""
        return self.cache.selecting_layers.get(self.layer_idx, False)

    # --- the rows, and the buffer attention reads ---------------------------------------------
    @property
    def rows(self) -> list[RowState]:
        """Every sequence's :class:`RowState`, caught up with the decode steps done on the buffer alone."""
        self._catch_up()
        return self._rows

    def _catch_up(self) -> None:
        """Rows catch up with the decode steps done on the buffer alone (if any are pending)."""
        if self.cache.evictions.pending:  # read mid-forward: every deferred eviction first
            self.cache.evictions.flush()
        if self._decode is not None and self._decode.pending:
            self._decode.catch_up(self._rows, self._buffer)
            self._share_dense_storage()

    @rows.setter
    def rows(self, rows: list[RowState]) -> None:
        self._rows, self._buffer, self._decode = rows, None, None

    def drop_decode(self) -> None:
        """Stop decoding on the buffer alone (the rows first catch up); the next step's refresh checks again."""
        self._catch_up()
        self._decode = None

    def drop_buffer(self) -> None:
        """Free the batch buffer (the rows first catch up); the next forward rebuilds it from the rows."""
        self.rows = self.rows

    def _can_decode_on_buffer(self, kwargs, q_len: int) -> bool:
        """Whether this forward may write the buffer alone (see :meth:`_batched_decode`): positions must be given,
        by the attention module or declared to the cache (:meth:`CompressedCache.set_input_mask`)."""
        return self._decode is not None and kwargs is not None and self._given_positions(kwargs, q_len) is not None

    def _given_positions(self, kwargs, q_len: int) -> torch.Tensor | None:
        """The forward's ``position_ids``: the attention module's, else those declared to the cache for ``q_len``
        input columns."""
        given = None if kwargs is None else kwargs.get("position_ids")
        declared = self.cache.input_positions
        if given is None and declared is not None and declared.shape[-1] == q_len:
            return declared
        return given

    def _batched_decode(self) -> "BufferedDecode | None":
        """The batched decode the rows allow (:meth:`BufferedDecode.for_rows`): compressed rows, dense or plainly
        quantized, with selection done at the prefill or scored by attention (H2O, TOVA), or dense rows that
        evict while decoding (a decode budget whose scores take a batch, a sliding window). Checked after each
        refresh; any change to a row (:meth:`_select`, :meth:`compress_rows`) clears it until the next refresh."""
        if not self._could_batch() or not all(row.compressed for row in self._rows):
            return None
        cache = self.cache
        decode = BufferedDecode.for_rows(self._rows, cache.kv_dtype, self.selection, self._decode_window,
                                         self.layer_idx, cache.num_layers, cache.model,
                                         codes=cache.decodes_from_codes(self.device),
                                         seeds=[cache.seed_for(b) for b in range(len(self._rows))])
        if decode is not None:
            decode.start(self._rows, self._buffer)
            if self._selects_in_window:
                self._oldest_held = self._oldest_position()
        return decode

    def _oldest_position(self) -> int:
        """The oldest position any row holds, or will hold (a row holding nothing appends next at its count of
        tokens), read from the buffer in one transfer (padding slots sit at :data:`PAD_POSITION`)."""
        empty = [row.tokens_seen for row in self._rows if not row.store.length]
        return min([int(self._buffer.positions.amin())] + empty)

    def _could_batch(self) -> bool:
        """The static part of :meth:`_batched_decode` (no loop over rows): store type, selection, window."""
        return (self._buffer is not None and not self.cache.defer_compression and bool(self._rows)
                and not self._window_moving
                and BufferedDecode.could_serve(self._rows[0].store, self.selection, self._decode_window))

    @property
    def _selects_in_window(self) -> bool:
        """A sliding layer that a selection acts on (every layer of the model slides: :attr:`takes_selection`)."""
        return self.is_sliding and self.selection is not None

    @property
    def _decode_window(self) -> int | None:
        """The window the batched decode keeps: none where a selection acts in it. Its kept tokens leave gaps a
        window's eviction does not take; the batch decodes as a full layer's while the window trims nothing
        (:meth:`_window_clear`), then row by row, trimming by position."""
        return None if self._selects_in_window else self.sliding_window

    def _window_clear(self, kwargs, q_len: int) -> bool:
        """Whether this forward's window trims nothing the rows hold, in a layer where a selection acts in it: every
        held position is past the window of a query after the last new one (known on the host: the oldest held
        position, read when the batched decode started, against :meth:`_positions_bound`)."""
        bound = self._positions_bound(kwargs, q_len)
        return bound is not None and self._oldest_held > bound - self.sliding_window

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

    def _settle_compressed_rows(self) -> None:
        """Bring the buffer in step with the rows the prefill just compressed, now rather than at the next forward
        (the question's): until then every layer would hold its prefill K/V beside the rows' compressed copy, or
        codes, of them (on a GPU, in the decode's peak memory). Where the batch decodes on the buffer, the next
        forward finds the refresh and the batched decode it would have started with done here, on the same rows
        (a buffer that fits them; held as codes, no dequantized K/V); elsewhere an oversized buffer is freed, and
        the next forward's row-by-row append builds one that fits."""
        if self._could_batch():
            self._refresh_buffer()
            self._decode = self._batched_decode()
        else:
            self._give_back_room()

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
            store = row.store
            if type(store) is DenseStore and store.keys is not None and (buffer.grown or store.keys.data_ptr() != buffer.keys[b].data_ptr()):
                n = store.length  # the buffer's row is the store's tokens, then any not yet caught up
                store.keys, store.values = buffer.keys[b, :, :n], buffer.values[b, :, :n]
        buffer.grown = False

    # --- transformers CacheLayerMixin interface -------------------------------------------------
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
        return keys, values

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
        if any(type(row.store) is not DenseStore or row.store.length or row.positions.shape[1] or row.compressed
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

    # --- positions and masks --------------------------------------------------------------------
    def _positions_bound(self, kwargs, q_len: int) -> int | None:
        """A number above every position this layer holds once this forward's ``q_len`` columns are in, known on
        the host, where the positions are kveval's own: counted per row, or declared by its driver (the
        ``position_ids`` it gives the model, which count each row's tokens). A row's position is below its count
        of tokens, which is at most the columns seen, padding included. ``None`` where the attention module gives
        positions of its own making."""
        given = None if kwargs is None else kwargs.get("position_ids")
        if given is not None and given is not self.cache.input_positions:
            return None
        return self.columns_seen + q_len

    def _new_positions(self, kwargs, real: torch.Tensor) -> torch.Tensor:
        """Original positions of the incoming tokens, ``[B, q]``: ``position_ids`` if the attention module gives
        them or the driver declared them (:meth:`_given_positions`), on this layer's device; else each row's count."""
        given = self._given_positions(kwargs, real.shape[1])
        if given is not None:  # declared positions sit on the model's first device, not on this layer's (device_map)
            return given.to(device=real.device, dtype=torch.long).expand(real.shape[0], -1)
        starts = torch.tensor([row.tokens_seen for row in self.rows], device=real.device)
        return starts[:, None] + real.long().cumsum(dim=1) - 1

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
        if isinstance(row.store, HeadwiseStore):
            self._trim_to_window(row, end)
            return
        positions = row.positions
        keep = int((positions > end - self.sliding_window).sum(dim=1).max())
        if keep < positions.shape[1]:
            self._select(row, positions.topk(keep, dim=1).indices.sort(dim=1).values)

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
        return (not self.chunked and isinstance(eviction, BudgetEviction) and eviction.trims_window
                and self._buffer.width <= self.sliding_window)

    def allowed_mask(self, query_positions: torch.Tensor) -> torch.Tensor:
        """Boolean ``[B, heads, q, slots]`` over the buffer's slots (:func:`~kveval.cache.layer_masks.positions_mask`).
        A layer without a selection (a sliding one beside full ones, any under a policy that selects nothing) keeps
        the same tokens in every head: a window trims all heads alike."""
        return positions_mask(self._slot_positions, query_positions, self.sliding_window, self.chunked,
                              heads_share=self.selection is None)

    # --- scoring and compression ----------------------------------------------------------------
    def hide_evicted(self, attention_mask, query: torch.Tensor, key: torch.Tensor):
        """The mask attention runs under, given the one it was handed (the model's, or the layer's own): a layer that
        hands the model slots it no longer holds (DeepSeek V4's evicted entries, kept at their numbers: see
        :class:`~kveval.cache.native_layers.HcaLayer`) hides them here. Default: unchanged."""
        return attention_mask

    def after_attention(self, query: torch.Tensor, keys: torch.Tensor, probabilities: AttentionProbabilities) -> None:
        """Called by the attention function once this layer's output is computed.

        ``probabilities(query, keys, allowed)`` gives the model's own attention
        probabilities ``[B, query_heads, q, slots]`` (softcapped, sink-diluted, ...)
        under a boolean mask; selection policies score with them. Decode budgets that
        may wait (:class:`~kveval.cache.decode_evictions.DeferredEvictions`) are kept once the
        forward's last attention layer has run.
        """
        self._score_and_compress(query, keys, probabilities)
        if self.layer_idx == self.cache.last_attention_layer and self.cache.evictions.pending:
            self.cache.evictions.flush()

    def _score_and_compress(self, query: torch.Tensor, keys: torch.Tensor,
                            probabilities: AttentionProbabilities) -> None:
        if self._buffer_only_step:  # the batch at once (see _batched_decode): scores, then any budget
            decode = self._decode
            mass = None if decode.accumulates is None else self._mass(query, keys, probabilities, score_key(self.selection))
            if decode.after_attention(self._buffer, mass, self.cache.evictions):
                self.contiguous = False  # tokens were dropped: the model's own mask no longer lines up
            return
        policy = self.selection
        needs = policy.attention if policy is not None else "none"
        if self.cache.defer_compression:
            # One prefill for many policies: keep every score they need, compress nothing (derived later).
            for key in (self.cache.score_keys if self.takes_selection else []):
                self._observe(query, keys, probabilities, key)
        elif needs != "none" and (not all(r.compressed for r in self.rows)
                                  or (needs in ("all", "last", "queries") and policy.decode_budget is not None)):
            # Compressed rows are scored again only under a decode budget: without one nothing ranks them again.
            self._observe(query, keys, probabilities, score_key(policy))
        if self.is_sliding:  # like the model's own sliding layer: keep only what the next query can still see
            self._trim_rows_to_window(self.rows, None)
        if self.cache.defer_compression:
            return
        rows = self.rows
        fresh = [b for b, row in enumerate(rows) if not row.compressed]
        evicted = []
        if policy is not None and policy.decode_budget is not None:
            # A row this forward gave no token (its sequence ended) keeps its cache, as alone (spared_rows).
            given = self.cache.input_counts(len(rows), query.shape[2])[0]
            for row, count in zip(rows, given):
                if row.compressed and count and row.store.length > policy.decode_limit:
                    self._evict_to(row, policy.decode_budget, protect_last=1)
                    evicted.append(row)
        seal_rows(evicted)
        if fresh:
            self.compress_rows([rows[b] for b in fresh], [self.cache.protected(b) for b in fresh])
            self._settle_compressed_rows()

    def _observe(self, query, keys, probabilities: AttentionProbabilities, key: tuple) -> None:
        """Accumulate, per row, the attention mass each kept token received from the queries ``key`` names.

        ``key`` is a :func:`score_key`. The mass goes to ``row.attention``; in a
        deferred prefill, to ``row.scores[key]`` (and to ``row.attention`` too
        when it is the cache's own policy's key).

        The mass is averaged over the query heads that read each stored head:
        the GQA group of a KV head, or every head for a store with one shared
        head (MLA's latent), whose tokens are then kept or dropped for all heads at once.
        """
        needs = key[0]
        if needs == "queries":  # the queries themselves, per row: its real columns (a prefill's)
            real = self.cache.input_real(query.shape[0], query.shape[2], query.device)
            recent = self.selection.kept_queries if self.selection is not None else None
            for b, row in enumerate(self.rows):
                queries, positions = query[b][:, real[b]], self._query_positions[b][real[b]]
                if recent is not None:  # a window of the most recent queries, this forward's appended
                    if row.queries is not None:
                        queries = torch.cat([row.queries, queries], dim=1)
                        positions = torch.cat([row.query_positions, positions])
                    queries, positions = queries[:, -recent:], positions[-recent:]
                row.queries, row.query_positions = queries, positions
            return
        mass = self._mass(query, keys, probabilities, key)
        deferred, own = self.cache.defer_compression, score_key(self.selection)
        for b, row in enumerate(self.rows):
            n = row.store.length
            row_mass = mass[b, :, :n]  # the buffer holds row b's tokens in its first n slots
            before = (row.scores or {}).get(key) if deferred else row.attention
            if needs == "all" and before is not None:
                row_mass = torch.nn.functional.pad(before, (0, n - before.shape[1])) + row_mass
            if deferred:
                row.scores = {**(row.scores or {}), key: row_mass}
            if not deferred or key == own:
                row.attention = row_mass

    def _mass(self, query, keys, probabilities: AttentionProbabilities, key: tuple) -> torch.Tensor:
        """``[B, stored heads, slots]``: the attention mass each slot received from this forward's queries that
        ``key`` names, summed over them, averaged over the query heads reading each stored head (0 on padding)."""
        needs, window = key
        q_len = query.shape[2]
        real = self.cache.input_real(query.shape[0], q_len, query.device)
        all_real = self.cache.input_counts(query.shape[0], q_len)[1]
        if needs == "window":
            first = max(0, q_len - window)
        elif needs == "last":
            first = q_len - 1
        else:
            first = 0

        def allowed(start: int, stop: int) -> torch.Tensor:
            if start == 0 and stop == q_len and self._mask is not None:
                return self._mask
            return self.allowed_mask(self._query_positions[:, start:stop])

        return attention_mass(probabilities, query, keys, real, all_real, first, self._slot_positions.shape[1], allowed)

    def scoring_state(self, row: RowState, seed: int, reads_keys: bool = True, reads_values: bool = False) -> ScoringState:
        """What a policy scores ``row`` on; its keys only where the policy may read them (``reads_keys``: else
        ``None``, and the row's keys and values are not copied to the compute dtype for nothing), its values only
        where it declares it reads them (``reads_values``)."""
        keys, values = row.store.keys_values() if reads_keys or reads_values else (None, None)
        padding = row.padding
        positions = row.positions if padding is None else row.positions.masked_fill(padding, -1)
        return ScoringState(keys=keys if reads_keys else None, positions=positions, attention=row.attention,
                            layer_idx=self.layer_idx, num_layers=self.cache.num_layers, seed=seed,
                            model=self.cache.model, values=values if reads_values else None, queries=row.queries,
                            query_positions=row.query_positions)

    def _scores(self, row: RowState, policy) -> tuple[torch.Tensor, ScoringState]:
        """The policy's scores of ``row`` (``-inf`` on padding slots, a fresh tensor) and the state they came from."""
        # Policies whose scores stack across layers read positions and attention alone (never keys).
        state = self.scoring_state(row, self.cache.seed_for(self.rows.index(row)), not policy.scores_stack_layers,
                                   policy.reads_values)
        scores = policy.scores(state).clone()
        scores = shared_by_group(scores, row.store)
        padding = row.padding
        if padding is not None:
            scores[padding] = float("-inf")
        return scores, state

    def compress_rows(self, rows: list[RowState], protect_last: list[int], policy=None) -> None:
        """Prefill compression of ``rows``: each keeps the selection's budget of context tokens (its last
        ``protect_last[i]`` tokens always), then their stores seal together (:func:`seal_rows`)."""
        policy = policy or self.selection
        if policy is not None:
            for row, protect in zip(rows, protect_last):
                self._keep_budget(row, protect, policy)
        seal_rows(rows)
        rescored = policy is not None and policy.decode_budget is not None
        for row in rows:
            row.compressed = True
            if not (rescored and policy.kept_queries is not None):  # else the recent queries score the decode budget
                row.queries = row.query_positions = None
            if not rescored and not self.cache.defer_compression:
                row.attention = None  # no decode budget: these scores rank nothing again
        self._decode = None

    def _keep_budget(self, row: RowState, protect_last: int, policy) -> None:
        """Keep ``policy``'s budget of ``row``'s context tokens, and its last ``protect_last`` tokens."""
        n = row.store.length
        candidates = n - min(protect_last, n)
        keep = policy.keep_count(candidates, self.layer_idx, self.cache.num_layers)
        if keep < candidates or ((policy.thresholded or policy.reconstructs) and candidates):
            scores, state = self._scores(row, policy)
            chosen = policy.choose(scores[:, :candidates], keep, state)
            protected = torch.arange(candidates, n, device=scores.device)
            if isinstance(chosen, list):
                chosen = [torch.cat([c, protected]) for c in chosen]
            else:
                chosen = torch.cat([chosen, protected.expand(chosen.shape[0], -1)], dim=1)
            self._select(row, chosen)

    def _evict_to(self, row: RowState, budget: int, protect_last: int) -> None:
        """Decode phase: keep the ``budget`` best-scored tokens (the newest ``protect_last`` always), ranked stably as
        the batched decode ranks them (:func:`~kveval.tensors.ranking.best_first`); the caller seals."""
        n = row.store.length
        scores, state = self._scores(row, self.selection)
        scores[:, n - protect_last:] = float("inf")
        self._select(row, self.selection.choose(scores, budget, state, stable=True))

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

    # --- measurement ----------------------------------------------------------------------------
    def nominal_tokens(self, row: RowState) -> int:
        # A sliding layer of the model's own cache holds the last window - 1 tokens between forwards.
        return row.tokens_seen if not self.is_sliding else min(row.tokens_seen, self.sliding_window - 1)


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


__all__ = ["CompressedHybridLayer", "CompressedLayer", "score_key"]
