"""One of K or V of one quantized layer, for a whole batch, held as codes: dequantized only when read.

:class:`CodedRows` is the batched counterpart of
:class:`~kveval.stores.quantized.QuantizedSequence` for rows whose every slot is alive
(no eviction inside units): batched decode keeps the layer's codes here and
dequantizes the layer into a scratch tensor at each step (:meth:`CodedRows.read`),
so only one layer's dequantized K/V exist at a time instead of a second,
dequantized copy of the whole cache.

Layout
------
``B`` rows of ``H`` KV heads and head width ``D``; a *unit* is one token
(``axis="token"``) or one group of ``group`` tokens (``axis="channel"``), as in
:mod:`kveval.tensors.quantization`.

* Sealed units: one :class:`~kveval.tensors.quantization.QuantizedBlock` whose heads
  dimension is ``B * H`` (row-major: head ``h`` of row ``b`` is ``b * H + h``)
  and whose unit dimension is a *capacity*, grown by an eighth (at least 64
  tokens' worth of units) when a seal needs more, so held codes are copied
  rarely (amortised constant per token). Row ``b``'s units are its first
  ``units[b]``; later units are padding, never read as tokens.
* Tail: ``[B, H, tail capacity, D]`` in ``kv_dtype``, row ``b``'s full-precision
  tokens in slots ``[starts[b], starts[b] + tails[b])``. New tokens go after them and sealing advances
  ``starts[b]``, so no step moves held tokens and the rows' stores can hold views of their tails; when a row's
  tail reaches the end of the room, every tail moves back to slot 0 (or into a larger tensor) at once and
  :attr:`~CodedRows.grown` is set, so views are taken again.

Row ``b`` holds ``units[b] * unit + tails[b]`` tokens: its sealed tokens, then its tail,
in order, exactly as its ``QuantizedSequence`` would after the same appends and seals.
Every token is encoded once, from ``kv_dtype``, by :func:`kveval.stores.quantized.encode`; the
encodings used (per-group min/max or absolute max, elementwise scaling and
rounding) do not depend on which other tokens or rows are encoded alongside, so a
batched seal writes the codes the row's own sequence would write, bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kveval.errors import UsageError
from kveval.stores.quantized import QuantizedSequence, encode
from kveval.tensors.batch_buffer import run_targets, slot_range, slot_rows, take_slots, uploaded
from kveval.tensors.quantization import FP8_FORMATS, QuantizedBlock, dequantize_into

_MIN_GROWTH_TOKENS = 64  # capacity grows by at least this many tokens' worth (of units, of tail slots)


def _grown_capacity(needed: int, per_unit: int) -> int:
    """Capacity (in units of ``per_unit`` tokens) for ``needed`` units: an eighth more, at least 64 tokens' worth."""
    return needed + max(-(-_MIN_GROWTH_TOKENS // per_unit), needed // 8)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as stored bytes where no kernel handles its dtype on every device (FP8 index writes on a CPU)."""
    return t.view(torch.uint8) if t.dtype in FP8_FORMATS.values() else t


def _with_capacity(t: torch.Tensor, dim: int, capacity: int, held: int) -> torch.Tensor:
    """A zero tensor like ``t`` with ``capacity`` along ``dim``, holding ``t``'s first ``held`` entries there."""
    shape = list(t.shape)
    shape[dim] = capacity
    new = t.new_zeros(shape)
    _bytes(new).narrow(dim, 0, held).copy_(_bytes(t).narrow(dim, 0, held))
    return new


def _block_tensors(block: QuantizedBlock) -> list[torch.Tensor]:
    """The tensors a block stores, each ``[heads, units, ...]``."""
    return [t for t in (block.data, block.scale, block.zero) if t is not None]


class CodedRows:
    """One of K or V of one layer, for ``batch`` left-aligned rows: sealed units as codes plus a ``kv_dtype`` tail.

    Parameters
    ----------
    quant : kveval.tensors.quantization.TensorQuant
        The encoding (bits, axis, group, symmetric, fp8).
    residual : int
        Tokens each row keeps in full precision (the residual window), as in
        :class:`~kveval.stores.quantized.QuantizedSequence`.
    kv_dtype : torch.dtype
        Dtype of the tail (the cache dtype).
    batch, heads, dim : int
        Rows, KV heads per row and head width ``D``.
    device
        Device of every tensor held.
    """

    def __init__(self, quant, residual: int, kv_dtype: torch.dtype, batch: int, heads: int, dim: int, device=None):
        self.quant, self.residual, self.kv_dtype = quant, residual, kv_dtype
        self.batch, self.heads, self.dim = batch, heads, dim
        self.unit = 1 if quant.axis == "token" else quant.group
        self.block: QuantizedBlock | None = None  # B*H heads, capacity units; allocated at the first seal
        self.tail = torch.zeros(batch, heads, 0, dim, dtype=kv_dtype, device=device)
        self.units = [0] * batch  # sealed units of each row
        self.tails = [0] * batch  # tail slots of each row
        self.starts = [0] * batch  # first tail slot of each row
        self.grown = False  # set when the block or tail moved (views of the old tensors no longer alias them)

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_sequences(cls, sequences: list[QuantizedSequence], heads: int | None = None, dim: int | None = None,
                       device=None) -> "CodedRows":
        """The rows ``sequences`` hold (one per row, every slot alive, the same encoding and residual), copied in.

        ``heads``, ``dim`` and ``device`` are read from the first row holding anything; give them when no row does.
        """
        first = sequences[0]
        for s in sequences:
            if s.alive is not None or s.tail_alive is not None:
                raise UsageError("CodedRows holds rows with every slot alive; this row has evicted slots")
            if s.quant != first.quant or s.residual != first.residual:
                raise UsageError("CodedRows rows must share one encoding and residual window")
        held = next((s for s in sequences if s.block is not None or s.tail is not None), None)
        if held is not None:
            shape = held.block.shape if held.block is not None else held.tail.shape
            heads, dim = shape[0], shape[2]
            device = held.block.scale.device if held.block is not None else held.tail.device
        if heads is None or dim is None:
            raise UsageError("CodedRows.from_sequences: no row holds a token; pass heads= and dim=")
        tails = [s.tail for s in sequences if s.tail is not None]
        kv_dtype = first.kv_dtype or (tails[0].dtype if tails else None)
        if kv_dtype is None:
            raise UsageError("CodedRows.from_sequences: the rows name no kv_dtype and hold no tail to read it from")
        rows = cls(first.quant, first.residual, kv_dtype, len(sequences), heads, dim, device)
        units = [0 if s.block is None else s.block.units for s in sequences]
        rows._make_tail_room([s.tail_slots for s in sequences])
        blocks = [s.block for s in sequences if s.block is not None]
        if blocks:
            rows._allocate(blocks[0])
            rows._reserve_units(max(units))
        for b, s in enumerate(sequences):  # setup, once per batch: a loop over rows is fine here
            if s.block is not None:
                for held_t, row_t in zip(_block_tensors(rows.block), _block_tensors(s.block)):
                    _bytes(held_t)[b * heads:(b + 1) * heads, :units[b]] = _bytes(row_t)
            if s.tail_slots:
                rows.tail[b, :, :s.tail_slots] = s.tail.to(kv_dtype)
        rows.units, rows.tails = units, [s.tail_slots for s in sequences]
        return rows

    # --- sizes ------------------------------------------------------------------------------
    @property
    def lengths(self) -> list[int]:
        """Tokens held by each row."""
        return [u * self.unit + t for u, t in zip(self.units, self.tails)]

    @property
    def width(self) -> int:
        """The longest row's length: the slots :meth:`read` returns."""
        return max(self.lengths, default=0)

    @property
    def unit_capacity(self) -> int:
        return 0 if self.block is None else self.block.data.shape[1]

    def _unit_bytes(self) -> int:
        """Bytes one unit of one head takes (codes, scales, zero points)."""
        return sum(t[0, 0].numel() * t.element_size() for t in _block_tensors(self.block))

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' real units and tail tokens: the sum of their ``QuantizedSequence.nbytes``."""
        return self.sealed_bytes + sum(self.tails) * self.heads * self.dim * self.tail.element_size()

    @property
    def sealed_bytes(self) -> int:
        """Bytes of the rows' real units (codes, scales, zero points): what the rows' stores hold as views."""
        return 0 if self.block is None else sum(self.units) * self.heads * self._unit_bytes()

    @property
    def held_bytes(self) -> int:
        """Bytes of the tensors really allocated, spare capacity included."""
        blocks = 0 if self.block is None else sum(t.numel() * t.element_size() for t in _block_tensors(self.block))
        return blocks + self.tail.numel() * self.tail.element_size()

    # --- capacity ---------------------------------------------------------------------------
    def _allocate(self, like: QuantizedBlock) -> None:
        """An empty block of ``B * H`` heads (no capacity yet; see :meth:`_reserve_units`) laid out as ``like``'s units."""
        def empty(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.new_zeros(self.batch * self.heads, 0, *t.shape[2:])

        self.block = replace(like, data=empty(like.data), scale=empty(like.scale), zero=empty(like.zero),
                             shape=(self.batch * self.heads, 0, self.dim))

    def _reserve_units(self, units: int) -> None:
        """Room for ``units`` units per row, copying the held units once into larger tensors."""
        if units <= self.unit_capacity:
            return
        capacity, held = _grown_capacity(units, self.unit), max(self.units)

        def grown(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else _with_capacity(t, 1, capacity, held)

        b = self.block
        self.block = replace(b, data=grown(b.data), scale=grown(b.scale), zero=grown(b.zero),
                             shape=(b.shape[0], capacity * self.unit, b.shape[2]))
        self.grown = True

    def _make_tail_room(self, counts: list[int]) -> None:
        """Room for ``counts[b]`` more tail slots after each row's tail: when a row's would pass the end, every tail
        moves to slot 0 of a tensor with room for them (the same one, or a larger one), and views must be retaken."""
        if all(s + t + c <= self.tail.shape[2] for s, t, c in zip(self.starts, self.tails, counts)):
            return
        needed = max(t + c for t, c in zip(self.tails, counts))
        capacity = max(self.tail.shape[2], _grown_capacity(needed, 1))
        tail = self.tail.new_zeros(self.batch, self.heads, capacity, self.dim)
        longest = max(self.tails)
        if longest:
            tail[:, :, :longest] = self._tail_slots(longest)
        self.tail, self.starts, self.grown = tail, [0] * self.batch, True

    def _tail_slots(self, count: int, rows: list[int] | None = None) -> torch.Tensor:
        """``[len(rows), H, count, D]``: each row's first ``count`` tail slots (slots past its tail: any values)."""
        rows = list(range(self.batch)) if rows is None else rows
        starts = [self.starts[b] for b in rows]
        if len(set(starts)) == 1 and starts[0] + count <= self.tail.shape[2]:
            held = self.tail[:, :, starts[0]:starts[0] + count]
            return held if len(rows) == self.batch else held[uploaded(tuple(rows), held.device)]
        device = self.tail.device
        source = (uploaded(tuple(starts), device)[:, None] + slot_range(count, device)).clamp(max=self.tail.shape[2] - 1)
        return take_slots(self.tail[uploaded(tuple(rows), device)], source[:, None, :].expand(-1, self.heads, -1))

    # --- decode step ------------------------------------------------------------------------
    def append(self, x: torch.Tensor, real: torch.Tensor, counts: list[int], runs: "tuple[tuple[int, int], ...] | None" = None,
               seal: bool = True) -> None:
        """Append each row's real tokens, then seal what aged out of the residual window, as ``QuantizedSequence``.

        ``x`` is ``[B, H, q, D]`` in ``kv_dtype``; ``real`` the ``[B, q]`` bool mask of real tokens (the others are
        dropped, e.g. a row that has finished); ``counts`` its row sums, known to the caller without a device sync;
        ``runs`` each row's real columns ``[start, stop)``, where the caller knows them
        (:func:`~kveval.tensors.batch_buffer.run_targets`). ``seal=False`` leaves the seal to the caller
        (:func:`seal_together`), before anything reads the rows.
        """
        q = x.shape[2]
        self._make_tail_room(counts)
        ends = [s + t for s, t in zip(self.starts, self.tails)]
        if all(c == q for c in counts) and len(set(ends)) == 1:  # one slice write for every row
            self.tail[:, :, ends[0]:ends[0] + q] = x
        elif q == 1:
            # A decode step over rows of different lengths, or with finished rows: each real token to its row's next
            # tail slot, by one flat index per (row, head) made on the host (a boolean one calls nonzero, which on a
            # GPU waits for the device, per layer and step).
            rows = tuple(b for b, c in enumerate(counts) if c)
            if rows:
                ends = uploaded(tuple(ends), x.device)[:, None, None].expand(self.batch, self.heads, 1)
                slots = slot_rows(self.tail, ends).view(self.batch, self.heads)  # [B, H]: rows of the flat tail
                if len(rows) < self.batch:
                    picked = uploaded(rows, x.device)
                    slots, x = slots.index_select(0, picked), x.index_select(0, picked)
                self.tail.view(-1, self.dim).index_copy_(0, slots.reshape(-1), x.reshape(-1, self.dim).to(self.tail.dtype))
        elif runs is not None:
            rows, columns, slots = run_targets(runs, tuple(ends), x.device)
            self.tail[rows, :, slots] = x[rows, :, columns]
        else:
            slot = uploaded(tuple(ends), x.device)[:, None] + real.long().cumsum(dim=1) - 1  # [B, q]: where each real token goes
            rows, columns = real.nonzero(as_tuple=True)
            self.tail[rows, :, slot[rows, columns]] = x[rows, :, columns]
        self.tails = [t + c for t, c in zip(self.tails, counts)]
        if seal:
            self._seal()

    def _aged(self) -> tuple[list[int], list[tuple[list[int], torch.Tensor]]]:
        """Each row's tail slots that aged out of the residual window (the rule of :meth:`QuantizedSequence.seal`: the
        oldest ``(tail - residual) // unit * unit``), and those tokens by count: ``(rows, [len(rows), H, count,
        D])`` per count (usually one: every row ages the same tokens at once)."""
        aged = [max(0, (t - self.residual) // self.unit * self.unit) for t in self.tails]
        groups = []
        for count in sorted(set(aged) - {0}):
            rows = [b for b, a in enumerate(aged) if a == count]
            groups.append((rows, self._tail_slots(count, rows)))
        return aged, groups

    def _seal(self) -> None:
        """Encode each row's aged tail slots into its next units and start its tail after them."""
        aged, groups = self._aged()
        if groups:
            self._store(aged, [(rows, self._encoded(tokens)) for rows, tokens in groups])

    def _encoded(self, tokens: torch.Tensor) -> QuantizedBlock:
        """``[rows, H, count, D]`` tokens encoded as one block of ``rows * H`` heads (row-major)."""
        rows, heads, count, dim = tokens.shape
        return encode(self.quant, tokens.reshape(rows * heads, count, dim))

    def pairs_with(self, other: "CodedRows") -> bool:
        """Whether ``other`` encodes as this one does, holds the same shapes and ages the same slots (K and V of
        ``quant`` and ``fp8``), so that their seals can encode both sides' tokens as one tensor."""
        return (self.quant == other.quant and (self.residual, self.batch, self.heads, self.dim, self.tails)
                == (other.residual, other.batch, other.heads, other.dim, other.tails) and self.tail.dtype == other.tail.dtype)

    def _store(self, aged: list[int], encoded: list[tuple[list[int], QuantizedBlock]]) -> None:
        """Write the encoded aged slots (:meth:`_aged`'s groups) at each row's next units; start its tail after them."""
        units = [u + a // self.unit for u, a in zip(self.units, aged)]
        if self.block is None:
            self._allocate(encoded[0][1])
        self._reserve_units(max(units))  # before any write: growth copies only the units held so far
        for rows, new in encoded:
            self._write_units(rows, new)
        self.starts = [s + a for s, a in zip(self.starts, aged)]
        self.units = units
        self.tails = [t - a for t, a in zip(self.tails, aged)]

    def _write_units(self, rows: list[int], new: QuantizedBlock) -> None:
        """Store ``new`` (``len(rows) * H`` heads, row-major) at each of ``rows``' next units (room reserved)."""
        firsts = [self.units[b] for b in rows]
        n = new.units
        for held, part in zip(_block_tensors(self.block), _block_tensors(new)):
            held = _bytes(held).view(self.batch, self.heads, *held.shape[1:])  # [B, H, capacity, ...]
            part = _bytes(part).view(len(rows), self.heads, *part.shape[1:])  # [rows, H, n, ...]
            if len(rows) == self.batch and len(set(firsts)) == 1:  # every row's next units are the same: a slice
                held[:, :, firsts[0]:firsts[0] + n] = part
            else:
                index = uploaded(tuple(rows), held.device)[:, None]
                slots = uploaded(tuple(firsts), held.device)[:, None] + slot_range(n, held.device)
                held[index, :, slots] = part.transpose(1, 2)  # advanced indices first: [rows, n, H, ...]

    # --- one row, as its QuantizedSequence holds it -----------------------------------------------
    def row_block(self, b: int) -> QuantizedBlock | None:
        """Row ``b``'s sealed units, ``[H, units, ...]``: views of the batch's block (no copy), ``None`` if none."""
        units = self.units[b]
        if not units:
            return None
        heads = slice(b * self.heads, (b + 1) * self.heads)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[heads, :units]

        blk = self.block
        return replace(blk, data=rows(blk.data), scale=rows(blk.scale), zero=rows(blk.zero),
                       shape=(self.heads, units * self.unit, self.dim))

    def row_tail(self, b: int) -> torch.Tensor:
        """Row ``b``'s full-precision tail, ``[H, tails[b], D]`` in ``kv_dtype``: a view (held tokens never move
        until :attr:`grown` says so)."""
        return self.tail[b, :, self.starts[b]:self.starts[b] + self.tails[b]]

    # --- read -------------------------------------------------------------------------------
    def read(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every row's tokens, ``[B, H, width, D]`` in ``dtype``: row ``b``'s slots ``[0, lengths[b])`` are exactly
        ``QuantizedSequence.materialize()`` of that row; padding slots are zero.

        With ``out`` (``[B, H, >= width, D]`` in ``dtype``, e.g. a scratch shared by a model's layers) the result is
        written into, and returned as, the view ``out[:, :, :width]``. Only the first ``max(units)`` units are
        dequantized, straight into the view (:func:`~kveval.tensors.quantization.dequantize_into`: the bits of
        :func:`~kveval.tensors.quantization.dequantize`).
        """
        lengths, width = self.lengths, self.width
        view = (torch.empty(self.batch, self.heads, width, self.dim, dtype=dtype, device=self.tail.device)
                if out is None else out[:, :, :width])
        sealed_units = max(self.units)
        sealed = sealed_units * self.unit
        if sealed:
            b = self.block
            head = replace(b, data=b.data[:, :sealed_units], scale=b.scale[:, :sealed_units],
                           zero=None if b.zero is None else b.zero[:, :sealed_units], shape=(b.shape[0], sealed, self.dim))
            dequantize_into(head, view[:, :, :sealed].view(-1, sealed, self.dim))  # [B * H, sealed, D], in place
        self._read_tails(view, dtype)
        shortest = min(lengths)
        if shortest < width:  # padding: slots at or past a row's length
            slots = slot_range(width, view.device)[shortest:]
            padding = slots >= uploaded(tuple(lengths), view.device)[:, None]  # [B, width - shortest]
            view[:, :, shortest:].masked_fill_(padding[:, None, :, None], 0)
        return view

    def _read_tails(self, view: torch.Tensor, dtype: torch.dtype) -> None:
        """Write each row's tail, in ``dtype``, after its sealed tokens in ``view``."""
        longest = max(self.tails)
        if not longest:
            return
        firsts = [u * self.unit for u in self.units]
        if len(set(firsts)) == 1:  # every tail goes to the same slot: one write (a shorter tail's spare slots are padding)
            view[:, :, firsts[0]:firsts[0] + longest].copy_(self._tail_slots(longest))  # converted as it is copied
            return
        # Row b's tail slots [start, start + tail) go to slots firsts[b] onwards: index maths on the host, made once
        # for every layer and side that reads the same lengths.
        runs = tuple((start, start + tail) for start, tail in zip(self.starts, self.tails))
        rows, sources, slots = run_targets(runs, tuple(firsts), view.device)
        view[rows, :, slots] = self.tail[rows, :, sources].to(dtype)


def seal_together(keys: CodedRows, values: CodedRows) -> None:
    """Seal both sides after an append (``seal=False``). Where they encode alike and age the same slots, one encoding
    of both sides' aged tokens (stacked on the rows, which no group spans) serves both: the codes each gets alone,
    in about half the operations."""
    if not keys.pairs_with(values):
        keys._seal()
        values._seal()
        return
    aged, groups = keys._aged()
    if not groups:
        return
    _, other = values._aged()
    encoded = [(rows, keys._encoded(torch.cat((k, v))), len(rows) * keys.heads) for (rows, k), (_, v) in zip(groups, other)]
    keys._store(aged, [(rows, _heads(both, slice(0, n))) for rows, both, n in encoded])
    values._store(aged, [(rows, _heads(both, slice(n, None))) for rows, both, n in encoded])


def _heads(block: QuantizedBlock, heads: slice) -> QuantizedBlock:
    """Heads ``heads`` of ``block`` (views)."""
    data, scale = block.data[heads], block.scale[heads]
    return replace(block, data=data, scale=scale, zero=None if block.zero is None else block.zero[heads],
                   shape=(scale.shape[0], *block.shape[1:]))


class SharedScratch:
    """Reusable tensors a model's layers dequantize into, one at a time (a cache holds one of these).

    :meth:`get` returns a ``[B, H, capacity, D]`` tensor for a ``name`` (``"keys"``, ``"values"``) with at least
    ``slots`` slots; layers of the same shape share it, so only one layer's dequantized K/V exist at a time. What
    a layer reads from it is valid until the next layer's read. Capacity grows by an eighth, at least 64 slots.
    """

    def __init__(self):
        self._tensors: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, batch: int, heads: int, slots: int, dim: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = (name, batch, heads, dim, dtype, str(device))
        held = self._tensors.get(key)
        if held is None or held.shape[2] < slots:
            held = torch.empty(batch, heads, _grown_capacity(slots, 1), dim, dtype=dtype, device=device)
            self._tensors[key] = held
        return held

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


__all__ = ["CodedRows", "SharedScratch", "seal_together"]
