"""The batch a cache layer hands to attention: every row's kept K/V in one padded tensor, updated in place.

A :class:`BatchBuffer` holds, for one layer, ``[B, H, capacity, D]`` keys and
values in the compute dtype and ``[B, H, capacity]`` original positions.
Layout: row ``b``'s tokens are slots ``[0, lengths[b])``, in the order its
store holds them; later slots are padding, with :data:`PAD_POSITION` (never
visible to a query). Attention reads views of the first :attr:`width` slots, so
no step copies the cache: new tokens are written after each row's last one
(:meth:`append`, one batched write for all rows), and a row whose store changed
held tokens (eviction, a quantizer sealing its residual) is rewritten from the
first changed slot only (:meth:`write_row`, with
:meth:`kveval.stores.base.TokenStore.changed_from`).

Capacity grows by an eighth (at least 64 slots) when a write needs more, so
growth copies are rare (amortised constant per token). The slack is not cache:
measured bytes come from the stores, never from this buffer.

When the compute dtype is the cache dtype (a bf16 model on a GPU), a dense row's
store is a view of this buffer (see :meth:`kveval.cache.layers.CompressedLayer`),
so the cache is held once. On a CPU computing in float32, the buffer is the
dequantized copy attention needs, in the one reusable tensor.
"""

from __future__ import annotations

import functools

import torch

PAD_POSITION = 2**62  # slot position of padding: never visible to any query
_MIN_GROWTH = 64


def take_slots(held: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``held[b, h, index[b, h, t]]`` for a ``[B, H, slots, D]`` tensor and a ``[B, H, n]`` slot index: ``[B, H, n, D]``.

    Equal to ``held.gather(2, index[..., None].expand(..., D))``, but as one ``index_select`` of whole D-wide
    rows, about 5x faster on a CPU than a gather through an index expanded over D (an eviction does this for
    every layer at every decode step).
    """
    return take_rows(held, slot_rows(held, index), index.shape)


def slot_rows(held: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of ``held.view(-1, D)`` that :func:`take_slots` reads for ``index``: one flat index, which serves
    every tensor of ``held``'s ``[B, H, slots]`` (K and V alike)."""
    batch, heads, slots = held.shape[:3]
    return (_row_offsets(batch, heads, slots, index.device) + index).view(-1)


def take_rows(held: torch.Tensor, rows: torch.Tensor, shape) -> torch.Tensor:
    """``held``'s D-wide rows ``rows`` (:func:`slot_rows`), shaped ``[*shape, D]``."""
    if not held.is_contiguous():
        held = held.contiguous()
    return held.view(-1, held.shape[-1]).index_select(0, rows).view(*shape, held.shape[-1])


def move_rows(tensors, sources: torch.Tensor, targets: torch.Tensor, cleared: torch.Tensor) -> None:
    """In place, for each ``[B, H, slots, D]`` tensor (contiguous, as a buffer's are): the D-wide rows ``targets``
    of its flat view take the values of rows ``sources`` (all read before any is written), then rows ``cleared``
    are zeroed (flat rows: :func:`slot_rows`)."""
    for held in tensors:
        flat = held.view(-1, held.shape[-1])
        flat.index_copy_(0, targets, flat.index_select(0, sources))
        flat.index_fill_(0, cleared, 0)


def _room(slots: int) -> int:
    """The capacity a buffer takes to hold ``slots`` slots: an eighth more (at least :data:`_MIN_GROWTH`)."""
    return slots + max(_MIN_GROWTH, slots // 8)


def real_runs(real: torch.Tensor) -> tuple[list[int], list[slice | None]]:
    """Per row of ``real`` (``[B, q]`` boolean, True on real tokens): how many real tokens, and the columns holding
    them as a slice where they are contiguous (a left- or right-padded row, or one without padding), else ``None``.

    Read from the device in one transfer. A slice selects a row's tokens as a view, where a boolean index would
    call ``nonzero``, which on a GPU waits for the device: once per row and layer, the batch's rows then run at
    the host's pace."""
    q = real.shape[1]
    counts = real.sum(dim=1)
    if q == 0:
        return counts.tolist(), [slice(0, 0)] * real.shape[0]
    flags = real.to(torch.uint8)
    first = flags.argmax(dim=1)  # the first real column (0 for a row without any)
    last = (q - 1) - flags.flip(1).argmax(dim=1)
    counts, first, span = torch.stack([counts, first, last - first + 1]).tolist()
    return counts, [slice(f, f + n) if n == 0 or s == n else None for n, f, s in zip(counts, first, span)]


@functools.lru_cache(maxsize=64)
def run_targets(runs: tuple[tuple[int, int], ...], ends: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Where a forward's real tokens go, for rows whose real tokens are the contiguous input columns
    ``[start, stop)`` of ``runs[b]``: each token's row, its column and its slot (row ``b``'s from ``ends[b]`` on),
    row by row, as ``real.nonzero(as_tuple=True)`` orders them. Made on the host once per distinct runs and ends,
    for every layer that appends the same (never written to); ``nonzero`` would make a GPU's host wait, per layer."""
    rows = [b for b, (start, stop) in enumerate(runs) for _ in range(start, stop)]
    columns = [j for start, stop in runs for j in range(start, stop)]
    slots = [ends[b] + j for b, (start, stop) in enumerate(runs) for j in range(stop - start)]
    return tuple(torch.tensor(values, dtype=torch.long).to(device) for values in (rows, columns, slots))


@functools.lru_cache(maxsize=256)
def uploaded(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, made once per distinct tuple (never written to). Each layer of a
    forward reads the same row lengths; a copy from the host per layer would also make a GPU's host wait per layer."""
    return torch.tensor(values, device=device)


@functools.lru_cache(maxsize=64)
def slot_range(count: int, device: torch.device) -> torch.Tensor:
    """``arange(count)`` made once per count and device (never written to): slot numbers, which masks and
    evictions compare and index with at every decode step."""
    return torch.arange(count, device=device)


@functools.lru_cache(maxsize=64)
def _row_offsets(batch: int, heads: int, slots: int, device: torch.device) -> torch.Tensor:
    """``[B, H, 1]``: where each (row, head)'s slots start in a flat ``[B * H * slots]`` view (one tensor per shape:
    two ops fewer at every eviction)."""
    return torch.arange(batch * heads, device=device).view(batch, heads, 1) * slots


class BatchBuffer:
    """One layer's kept K/V for a whole batch, ``[B, H, slots, D]``, left-aligned per row.

    Parameters
    ----------
    batch, heads : int
        Rows and stored KV heads.
    key_dim, value_dim : int
        Head widths of K and V as attention sees them.
    dtype, device
        The compute dtype and device of the layer.
    capacity : int
        Slots to make room for at once (the room grows as writes need it).
    """

    def __init__(self, batch: int, heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, device,
                 capacity: int = 0):
        self.keys = torch.zeros(batch, heads, capacity, key_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, heads, capacity, value_dim, dtype=dtype, device=device)
        self.positions = torch.full((batch, heads, capacity), PAD_POSITION, dtype=torch.long, device=device)
        # [B, H, capacity] attention accumulated per slot, while a batched decode scores with it (0 on padding);
        # kept in step by append and grown by reserve, loaded by kveval.cache.buffered_decode.BufferedDecode.start.
        self.attention: torch.Tensor | None = None
        self.lengths = [0] * batch  # slots held by each row
        self.width = 0  # max(lengths): the slots attention reads
        # Real tokens each row was given by the last append (None: none yet). A decode budget evicts only from rows
        # given one: a row the step gave nothing (it ended) keeps its cache as it would alone (kveval.cache.decode_evictions).
        self.given: tuple[int, ...] | None = None
        self.grown = False  # set when a write reallocated (views of the old tensors no longer alias)

    @classmethod
    def packed(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, runs: tuple[tuple[int, int], ...],
               kv_dtype: torch.dtype) -> tuple["BatchBuffer", torch.Tensor, torch.Tensor, torch.Tensor]:
        """A buffer of the first tokens of every row, built for the whole batch at once (no loop over rows).

        Row ``b`` takes the input columns ``[start, stop)`` of ``runs[b]`` of ``keys``/``values`` (``[B, H, q, D]``, the compute
        dtype) at ``positions`` (``[B, q]``), rounded through ``kv_dtype`` as a store holds them. Returns the
        buffer, and the packed ``[B, H, width, D]`` keys and values in ``kv_dtype`` and ``[B, H, width]``
        positions (row ``b``: its first ``stop - start`` slots, zeros and :data:`PAD_POSITION` after), of which
        the rows' stores and positions may hold views. The same tensors, bit for bit, as appending each row's
        tokens to a store and writing them row by row (:meth:`write_row`)."""
        batch, heads, q = keys.shape[:3]
        counts = [stop - start for start, stop in runs]
        width, device = max(counts), keys.device

        def stored(x: torch.Tensor) -> torch.Tensor:
            return x.to(kv_dtype, memory_format=torch.contiguous_format)

        if all(n == q for n in counts):  # no padding: every column of every row
            stored_keys, stored_values, held = stored(keys), stored(values), positions
        else:
            index = (uploaded(tuple(start for start, _ in runs), device)[:, None] + slot_range(width, device)).clamp_(max=q - 1)
            padding = slot_range(width, device) >= uploaded(tuple(counts), device)[:, None]  # [B, width]

            def gathered(x: torch.Tensor) -> torch.Tensor:
                taken = x.gather(2, index[:, None, :, None].expand(batch, heads, width, x.shape[-1]))
                return stored(taken.masked_fill_(padding[:, None, :, None], 0))

            stored_keys, stored_values = gathered(keys), gathered(values)
            held = positions.gather(1, index).masked_fill_(padding, PAD_POSITION)
        buffer = cls(batch, heads, keys.shape[-1], values.shape[-1], keys.dtype, device, capacity=_room(width))
        buffer.keys[:, :, :width].copy_(stored_keys)
        buffer.values[:, :, :width].copy_(stored_values)
        held = held[:, None, :].expand(batch, heads, width).contiguous()
        buffer.positions[:, :, :width].copy_(held)
        buffer.lengths, buffer.width = counts, width
        return buffer, stored_keys, stored_values, held

    @property
    def capacity(self) -> int:
        return self.positions.shape[2]

    @property
    def holds_values(self) -> bool:
        """False once :meth:`release_values` ran: the buffer then keeps positions (and attention) only."""
        return self.keys is not None

    def release_values(self) -> None:
        """Free the K/V tensors: a quantized layer's batched decode holds its codes and dequantizes at each step
        (:class:`kveval.cache.coded_rows.CodedRows`). Positions, lengths and attention stay in step."""
        self.keys = self.values = None

    def views(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Keys, values and positions of the first :attr:`width` slots (views, no copy; K/V ``None`` once released)."""
        if self.keys is None:
            return None, None, self.positions[:, :, :self.width]
        return self.keys[:, :, :self.width], self.values[:, :, :self.width], self.positions[:, :, :self.width]

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` slots per row (copying what is held once, into a larger tensor)."""
        if slots > self.capacity:
            self._resize(_room(slots))

    def oversized(self, slots: int) -> bool:
        """Whether the room is over twice ``slots`` (the most any row holds) and over twice the minimum growth:
        worth giving back once compression or an eviction shrank the rows."""
        return self.capacity > 2 * max(_MIN_GROWTH, slots)

    def fit(self) -> None:
        """Give back room the rows no longer need (:meth:`oversized`) after an eviction shrank them: one copy into
        a smaller tensor."""
        if self.oversized(self.width):
            self._resize(_room(self.width))

    def _resize(self, size: int) -> None:
        """Reallocate every tensor with ``size`` slots, keeping the first :attr:`width`."""
        def resized(old: torch.Tensor | None, fill) -> torch.Tensor | None:
            if old is None:
                return None
            new = old.new_full((*old.shape[:2], size, *old.shape[3:]), fill)
            new[:, :, :self.width] = old[:, :, :self.width]
            return new

        self.keys, self.values = resized(self.keys, 0), resized(self.values, 0)
        self.positions, self.attention = resized(self.positions, PAD_POSITION), resized(self.attention, 0)
        self.grown = True

    def write_row(self, b: int, start: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Row ``b`` now holds ``start + n`` slots: ``keys``/``values`` (``[H, n, D]``) and ``positions`` (``[H, n]``)
        replace slots ``start`` onwards; slots it held beyond become padding."""
        end = start + keys.shape[1]
        self.reserve(end)
        self.keys[b, :, start:end] = keys
        self.values[b, :, start:end] = values
        self.positions[b, :, start:end] = positions
        if self.lengths[b] > end:
            self.positions[b, :, end:self.lengths[b]] = PAD_POSITION
        self.lengths[b] = end
        self.width = max(self.lengths)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, real: torch.Tensor,
               counts: list[int], runs: "tuple[tuple[int, int], ...] | None" = None) -> None:
        """Append the real tokens of ``keys``/``values`` (``[B, H, q, D]``, any float dtype: converted to the
        buffer's as they are written) after each row's last slot, in one write.

        ``positions`` is ``[B, q]`` (the tokens' original positions), ``real`` the ``[B, q]`` mask of real tokens
        and ``counts`` its row sums (known to the caller without a device sync); ``runs``, where the caller knows
        them, each row's real columns ``[start, stop)`` (:func:`run_targets`). Once the values are released,
        ``keys``/``values`` are ignored (pass ``None``): only positions and lengths advance.
        """
        q = positions.shape[1]
        held = self.keys is not None
        start = self.lengths[0]
        if all(n == q for n in counts) and all(n == start for n in self.lengths):
            # Every row appends q real tokens at the same slot: a slice write.
            self.reserve(start + q)
            if held:
                self.keys[:, :, start:start + q] = keys
                self.values[:, :, start:start + q] = values
            self.positions.narrow(2, start, q).copy_(positions.unsqueeze(1))  # broadcast over heads by the copy
            if self.attention is not None:
                self.attention.narrow(2, start, q).zero_()
        elif q == 1 and all(n == 1 for n in counts):
            # A decode step over rows of different lengths (mixed prompt lengths, per-head budgets): each row's one
            # token goes to its own next slot, one flat index per (row, head) and one index_copy_ per tensor.
            self.reserve(max(self.lengths) + 1)
            batch, heads, capacity = self.positions.shape
            slots = (_row_offsets(batch, heads, capacity, positions.device)
                     + uploaded(tuple(self.lengths), positions.device)[:, None, None]).view(-1)
            if held:
                for buffer, new in ((self.keys, keys), (self.values, values)):
                    buffer.view(-1, buffer.shape[-1]).index_copy_(0, slots, new.reshape(-1, new.shape[-1]).to(buffer.dtype))
            self.positions.view(-1).index_copy_(0, slots, positions.expand(batch, heads).reshape(-1))
            if self.attention is not None:
                self.attention.view(-1).index_fill_(0, slots, 0)
        else:
            self.reserve(max(n + c for n, c in zip(self.lengths, counts)))
            if runs is not None:
                rows, columns, slots = run_targets(runs, tuple(self.lengths), positions.device)
            else:
                lengths = uploaded(tuple(self.lengths), positions.device)
                slot = lengths[:, None] + real.long().cumsum(dim=1) - 1  # [B, q]: where each real token goes
                rows, columns = real.nonzero(as_tuple=True)
                slots = slot[rows, columns]
            if held:  # an indexed write takes the buffer's dtype only
                self.keys[rows, :, slots] = keys[rows, :, columns].to(self.keys.dtype)
                self.values[rows, :, slots] = values[rows, :, columns].to(self.values.dtype)
            self.positions[rows, :, slots] = positions[rows, columns][:, None]
            if self.attention is not None:
                self.attention[rows, :, slots] = 0
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]
        self.width = max(self.lengths)
        self.given = tuple(counts)


__all__ = ["BatchBuffer", "PAD_POSITION", "move_rows", "real_runs", "run_targets", "slot_range", "slot_rows", "take_rows",
           "take_slots", "uploaded"]
