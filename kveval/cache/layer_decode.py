"""Batched decode of a :class:`~kveval.cache.layers.CompressedLayer`: when a decode step may write the batch buffer alone.

:class:`LayerDecode` decides, after each refresh of the rows, whether the layer's next decode steps can be done for
the whole batch at once by a :class:`~kveval.cache.buffered_decode.BufferedDecode` (which the rows' stores allow,
asked through :meth:`~kveval.cache.buffered_decode.BufferedDecode.for_rows`), and whether a given forward may be one
of them (positions known, a sliding window that trims nothing a selection kept).
"""

from __future__ import annotations

import torch

from kveval.cache.buffered_decode import BufferedDecode
from kveval.cache.rows import RowState
from kveval.tensors.batch_buffer import BatchBuffer


class LayerDecode:
    """Whether and how a cache layer decodes on its buffer alone (a mixin of :class:`~kveval.cache.layers.CompressedLayer`).

    Needs of the layer: the attributes annotated below, and of :class:`~kveval.cache.layer_rows.LayerRows`
    ``_refresh_buffer`` and ``_give_back_room``.
    """

    cache: "CompressedCache"
    layer_idx: int
    sliding_window: "int | None"
    is_sliding: bool
    selection: object  # SelectionPolicy or None
    device: torch.device
    _rows: list[RowState]
    _buffer: "BatchBuffer | None"
    _decode: "BufferedDecode | None"
    _oldest_held: int
    _window_moving: bool

    def _could_batch(self) -> bool:
        """The static part of :meth:`_batched_decode` (no loop over rows): store type, selection, window."""
        return (self._buffer is not None and not self.cache.defer_compression and bool(self._rows)
                and not self._window_moving
                and BufferedDecode.could_serve(self._rows[0].store, self.selection, self._decode_window))

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

    def _oldest_position(self) -> int:
        """The oldest position any row holds, or will hold (a row holding nothing appends next at its count of
        tokens), read from the buffer in one transfer (padding slots sit at :data:`PAD_POSITION`)."""
        empty = [row.tokens_seen for row in self._rows if not row.store.length]
        return min([int(self._buffer.positions.amin())] + empty)

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


__all__ = ["LayerDecode"]
