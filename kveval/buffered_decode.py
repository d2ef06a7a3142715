"""Decode steps that write the whole batch into the layer's buffer at once; the rows' stores catch up later.

Once every row of a layer is compressed and nothing evicts or scores any more
(``none``, selection done at the prefill, with a dense or quantized
representation), a decode step does the same thing to every row: store the
new tokens and, for a quantized store, encode the tokens that have aged out of
the full-precision residual window. :class:`BufferedDecode` does that for the
batch with a few tensor ops on the :class:`~kveval.batch_buffer.BatchBuffer`:

- the new tokens go in after each row's last slot, as ``kv_dtype`` values;
- tokens that age out of the residual are replaced, in place, by their
  dequantized values, encoded by :func:`kveval.storage.encode` exactly as the
  row's store encodes them (groups are per token, or per channel over the same
  ``group`` consecutive tokens the store would group).

The new tokens are also kept, in ``kv_dtype``, until the rows *catch up*: each
row's store appends them and seals, which encodes the same tokens into the same
codes (a per-token group does not depend on when it is sealed; per-channel
groups start at the same token either way). The rows catch up when anything
reads them (measurement, forking, deriving) and every :data:`CATCH_UP_STEPS`
steps, which bounds the memory of the pending tokens. Until then the measured
bytes are the stores' bytes at the last catch-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.batch_buffer import PAD_POSITION, BatchBuffer
from kveval.policies import ScoringState
from kveval.policies.window import SinkWindowPolicy, WindowPolicy
from kveval.quantization import dequantize
from kveval.storage import DenseStore, QuantizedSequence, QuantizedStore, encode

CATCH_UP_STEPS = 64  # decode steps between catch-ups of the rows' stores


@dataclass
class _Residual:
    """One of K or V of a quantized layer: its encoding, residual window and unit, and each row's unencoded tail."""

    quant: object  # kveval.policies.quant.TensorQuant
    residual: int
    unit: int  # tokens per quantization unit: 1 per token, ``group`` per channel
    tails: list[int]  # slots at the end of each row not yet encoded

    @classmethod
    def of(cls, sequences: list[QuantizedSequence]) -> "_Residual":
        first = sequences[0]
        return cls(first.quant, first.residual, first.unit, [s.tail_slots for s in sequences])

    def encode_aged(self, held: torch.Tensor, lengths: list[int], counts: list[int], kv_dtype: torch.dtype) -> None:
        """After each row appended ``counts[b]`` tokens (now ``lengths[b]`` slots), replace the slots that left the
        residual window in ``held`` (``[B, H, slots, D]``, the buffer's K or V) by their dequantized values."""
        self.tails = [t + c for t, c in zip(self.tails, counts)]
        aged = [max(0, (t - self.residual) // self.unit * self.unit) for t in self.tails]
        for count in sorted(set(aged) - {0}):  # usually one value: every row ages the same tokens at once
            rows = [b for b, a in enumerate(aged) if a == count]
            firsts = [lengths[b] - self.tails[b] for b in rows]
            if len(rows) == len(aged) and len(set(firsts)) == 1:  # the same slots in every row: a view
                first = firsts[0]
                held[:, :, first:first + count] = self._decoded(held[:, :, first:first + count], kv_dtype)
            else:
                index = torch.tensor(rows, device=held.device)[:, None]
                slots = torch.tensor(firsts, device=held.device)[:, None] + torch.arange(count, device=held.device)
                tokens = held[index, :, slots].permute(0, 2, 1, 3)  # [rows, H, count, D]
                held[index, :, slots] = self._decoded(tokens, kv_dtype).permute(0, 2, 1, 3)
            for b in rows:
                self.tails[b] -= count

    def _decoded(self, tokens: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
        """``tokens`` (``[rows, H, count, D]``) encoded as the store encodes them, read back in their dtype."""
        rows, heads, count, dim = tokens.shape
        flat = tokens.reshape(rows * heads, count, dim).to(kv_dtype)
        return dequantize(encode(self.quant, flat), tokens.dtype).reshape(rows, heads, count, dim)


class _RecencyEviction:
    """A decode budget kept by position alone (``window(size)``, ``streaming(window)``), for the whole batch.

    After each step's attention, every row holding more than the budget keeps the ``budget`` best-scored of its
    tokens, its newest always, exactly as :meth:`kveval.cache_layers.CompressedLayer._evict_to` chooses for one
    row (the policy's own scores, one ``topk``); the buffer is compacted in place by one gather for the batch.
    """

    def __init__(self, selection):
        self.selection, self.budget = selection, selection.decode_budget

    @staticmethod
    def applies_to(selection) -> bool:
        return (selection is not None and selection.decode_budget is not None and selection.attention == "none"
                and not selection.per_head_budgets and isinstance(selection, (WindowPolicy, SinkWindowPolicy)))

    def apply(self, buffer: BatchBuffer) -> None:
        width = buffer.width
        if width <= self.budget:
            return
        positions = buffer.positions[:, 0, :width]  # [B, width]: every head keeps the same tokens here
        padding = positions == PAD_POSITION
        state = ScoringState(keys=None, positions=positions.masked_fill(padding, -1), attention=None, layer_idx=0,
                             num_layers=1)
        scores = self.selection.scores(state).float().masked_fill(padding, float("-inf"))
        newest = torch.tensor(buffer.lengths, device=scores.device)[:, None] - 1
        scores.scatter_(1, newest.clamp(min=0), float("inf"))  # the newest token is never evicted
        keep = scores.topk(self.budget, dim=1).indices.sort(dim=1).values  # [B, budget]
        for held in (buffer.keys, buffer.values):
            index = keep[:, None, :, None].expand(-1, held.shape[1], -1, held.shape[3])
            held[:, :, :self.budget] = held[:, :, :width].gather(2, index)
        index = keep[:, None, :].expand(-1, buffer.positions.shape[1], -1)
        buffer.positions[:, :, :self.budget] = buffer.positions[:, :, :width].gather(2, index)
        buffer.positions[:, :, self.budget:width] = PAD_POSITION
        buffer.lengths = [min(n, self.budget) for n in buffer.lengths]
        buffer.width = max(buffer.lengths)


class BufferedDecode:
    """Batched decode steps for one layer whose rows are all dense or all plain quantized stores (see module doc)."""

    def __init__(self, kv_dtype: torch.dtype, keys: _Residual | None, values: _Residual | None,
                 eviction: _RecencyEviction | None = None):
        self.kv_dtype = kv_dtype
        self.keys, self.values, self.eviction = keys, values, eviction
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (K, V, positions, real)

    @classmethod
    def for_rows(cls, rows, kv_dtype: torch.dtype, selection=None) -> "BufferedDecode | None":
        """The batched decode of ``rows`` (:class:`~kveval.cache_layers.RowState`) under ``selection`` (its decode
        budget), or ``None`` where per-row work is needed: stores neither all dense nor all quantized with every
        slot alive (evicted slots inside units), or a decode budget other than a dense recency one."""
        stores = [row.store for row in rows]
        dense = all(type(s) is DenseStore for s in stores)
        if selection is not None and selection.decode_budget is not None:
            return cls(kv_dtype, None, None, _RecencyEviction(selection)) if dense and _RecencyEviction.applies_to(selection) else None
        if dense:
            return cls(kv_dtype, None, None)
        if all(type(s) is QuantizedStore and s.k.alive is None and s.k.tail_alive is None
               and s.v.alive is None and s.v.tail_alive is None for s in stores):
            return cls(kv_dtype, _Residual.of([s.k for s in stores]), _Residual.of([s.v for s in stores]))
        return None

    @staticmethod
    def could_serve(store, selection) -> bool:
        """Whether rows holding stores like ``store`` under ``selection`` may ever decode in batch (a cheap,
        static check; :meth:`for_rows` then checks every row)."""
        if type(store) not in (DenseStore, QuantizedStore):
            return False
        if selection is None:
            return True
        if selection.attention in ("all", "last"):  # scored at every step
            return False
        return selection.decode_budget is None or (type(store) is DenseStore and _RecencyEviction.applies_to(selection))

    def after_attention(self, buffer: BatchBuffer) -> None:
        """What a step does once attention has read the buffer: keep the decode budget."""
        if self.eviction is not None:
            self.eviction.apply(buffer)

    def append(self, buffer: BatchBuffer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               real: torch.Tensor, counts: list[int]) -> None:
        """One decode step: ``keys``/``values`` ``[B, H, q, D]`` in the compute dtype, ``positions``/``real`` ``[B, q]``."""
        keys, values = keys.to(self.kv_dtype), values.to(self.kv_dtype)
        self.pending.append((keys, values, positions, real))
        buffer.append(keys.to(buffer.keys.dtype), values.to(buffer.values.dtype), positions, real, counts)
        for side, held in ((self.keys, buffer.keys), (self.values, buffer.values)):
            if side is not None:
                side.encode_aged(held, buffer.lengths, counts, self.kv_dtype)

    @property
    def due(self) -> bool:
        return len(self.pending) >= CATCH_UP_STEPS

    def catch_up(self, rows, buffer: BatchBuffer) -> None:
        """Every row's store appends its pending tokens and seals; the rows' positions and counts follow.

        Under a decode budget the dense rows instead take the buffer's tokens as they stand (its ``kv_dtype``
        values read back exactly), since appending would skip the evictions."""
        if not self.pending:
            return
        if self.eviction is not None:  # the buffer holds the rows as they stand: only the counts are needed
            counts = torch.cat([real for *_, real in self.pending], dim=1).sum(dim=1).tolist()
            self.pending = []
            for b, row in enumerate(rows):
                n = buffer.lengths[b]
                row.store.load(buffer.keys[b, :, :n], buffer.values[b, :, :n])
                row.store.mark_read()
                row.positions = buffer.positions[b, :, :n].clone()
                row.tokens_seen += counts[b]
            return
        keys, values, positions, real = (torch.cat(parts, dim=-2 if i < 2 else 1) for i, parts in enumerate(zip(*self.pending)))
        self.pending = []
        for b, row in enumerate(rows):
            keep = real[b]
            n = int(keep.sum())
            if not n:
                continue
            row.store.append(keys[b][:, keep], values[b][:, keep])
            row.positions = torch.cat([row.positions, positions[b][keep].unsqueeze(0).expand(row.positions.shape[0], -1)], dim=1)
            row.tokens_seen += n
            row.seal()
            row.store.mark_read()


__all__ = ["BufferedDecode", "CATCH_UP_STEPS"]
