"""How a batched decode step encodes the batch's new tokens as each row's store would (:mod:`kveval.cache.buffered_decode`).

- :class:`QuantizedResidual`: plain quantized rows (INT/FP8, KIVI), whose tokens leaving the residual window are
  encoded and replaced in the buffer by their dequantized values;
- :class:`KVQuantResidual`: KVQuant rows, the same with the layer's codec at the tokens' positions;
- :class:`CoefficientSteps`: low-rank and latent rows, whose every new token is encoded and reconstructed at once.

Each is bit-identical to the rows' own stores (``tests/test_buffered_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.stores.base import BatchFamily, TokenStore
from kveval.stores.quantized import QuantizedSequence
from kveval.tensors.batch_buffer import BatchBuffer, slot_range, uploaded
from kveval.tensors.quantization import quantized_values


@dataclass
class AgedRun:
    """The slots of some rows that left the residual window in one step: ``count`` slots from ``firsts[i]`` in row
    ``rows[i]``. :meth:`take` and :meth:`put` read and write them in a ``[B, H, slots, ...]`` buffer tensor as
    ``[rows, H, count, ...]`` (a view when every row ages the same slots)."""

    rows: list[int]
    firsts: list[int]
    count: int
    batch: int

    def _where(self, device):
        if len(self.rows) == self.batch and len(set(self.firsts)) == 1:
            return None
        index = uploaded(tuple(self.rows), device)[:, None]
        return index, uploaded(tuple(self.firsts), device)[:, None] + slot_range(self.count, device)

    def take(self, held: torch.Tensor) -> torch.Tensor:
        where = self._where(held.device)
        if where is None:
            return held[:, :, self.firsts[0]:self.firsts[0] + self.count]
        return held[where[0], :, where[1]].movedim(1, 2)

    def put(self, held: torch.Tensor, value: torch.Tensor) -> None:
        where = self._where(held.device)
        if where is None:
            held[:, :, self.firsts[0]:self.firsts[0] + self.count] = value
        else:
            held[where[0], :, where[1]] = value.movedim(2, 1)


@dataclass
class ResidualWindow:
    """A residual window of ``residual`` recent tokens kept as they came, encoded ``unit`` tokens at a time once
    they leave it, and each row's unencoded tail (slots at its end)."""

    residual: int
    unit: int  # tokens per quantization unit: 1 per token, ``group`` per channel
    tails: list[int]

    def aged(self, lengths: list[int], counts: list[int]) -> list[AgedRun]:
        """After each row appended ``counts[b]`` tokens (now ``lengths[b]`` slots), the slots that leave the
        window, as each row's store seals them, grouped by count (usually one: every row ages one token at once)."""
        self.tails = [t + c for t, c in zip(self.tails, counts)]
        aged = [max(0, (t - self.residual) // self.unit * self.unit) for t in self.tails]
        runs = []
        for count in sorted(set(aged) - {0}):
            rows = [b for b, a in enumerate(aged) if a == count]
            runs.append(AgedRun(rows, [lengths[b] - self.tails[b] for b in rows], count, len(aged)))
            for b in rows:
                self.tails[b] -= count
        return runs


class QuantizedResidual(ResidualWindow):
    """One of K or V of a quantized layer (:class:`~kveval.stores.quantized.QuantizedSequence`): its encoding and window."""

    def __init__(self, quant, residual: int, unit: int, tails: list[int]):
        super().__init__(residual, unit, tails)
        self.quant = quant  # kveval.tensors.quantization.TensorQuant

    @classmethod
    def of(cls, sequences: list[QuantizedSequence]) -> "QuantizedResidual":
        first = sequences[0]
        return cls(first.quant, first.residual, first.unit, [s.tail_slots for s in sequences])

    def encode_aged(self, held: torch.Tensor, lengths: list[int], counts: list[int], kv_dtype: torch.dtype) -> list[AgedRun]:
        """Replace the slots that left the window in ``held`` (``[B, H, slots, D]``, the buffer's K or V) by their
        dequantized values; those slots."""
        runs = self.aged(lengths, counts)
        for run in runs:
            run.put(held, self._decoded(run.take(held), kv_dtype))
        return runs

    def pairs_with(self, other: "QuantizedResidual") -> bool:
        """Whether ``other`` encodes as this one does and ages the same slots at every step (K and V of ``quant`` and
        ``fp8``: one encoding, one window): their aged tokens can then be encoded as one tensor."""
        return (self.quant == other.quant and (self.residual, self.unit, self.tails) == (other.residual, other.unit, other.tails))

    def _decoded(self, tokens: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
        """``tokens`` (``[rows, H, count, D]``) encoded as the store encodes them, read back in their dtype: the bits
        of the store's ``dequantize(encode(...))`` (:func:`~kveval.tensors.quantization.quantized_values`)."""
        rows, heads, count, dim = tokens.shape
        q = self.quant
        flat = tokens.reshape(rows * heads, count, dim).to(kv_dtype)
        return quantized_values(flat, q.bits, q.axis, q.group, q.symmetric, q.fp8, tokens.dtype,
                                q.mx).reshape(rows, heads, count, dim)


def encode_aged_sides(keys: QuantizedResidual | None, values: QuantizedResidual | None, held_keys: torch.Tensor,
                      held_values: torch.Tensor, lengths: list[int], counts: list[int], kv_dtype: torch.dtype) -> None:
    """:meth:`QuantizedResidual.encode_aged` for K and V (either ``None``: not quantized); where both encode and age
    alike, their aged tokens go through one encoding (about half the operations of two), which gives each
    group the bits it gets alone (groups never span K and V)."""
    if keys is not None and values is not None and keys.pairs_with(values) and held_keys.shape == held_values.shape:
        runs = keys.aged(lengths, counts)
        values.aged(lengths, counts)
        for run in runs:
            rows = len(run.rows)
            both = keys._decoded(torch.cat((run.take(held_keys), run.take(held_values))), kv_dtype)
            run.put(held_keys, both[:rows])
            run.put(held_values, both[rows:])
        return
    for side, held in ((keys, held_keys), (values, held_values)):
        if side is not None:
            side.encode_aged(held, lengths, counts, kv_dtype)


class KVQuantResidual(ResidualWindow):
    """KVQuant rows (:class:`~kveval.stores.kvquant.KVQuantStore`): the layer's codec, sink and window. A token leaving
    the window is encoded with its position (pre-RoPE keys are un-rotated there) and read back as the row's store
    reads it, unless it is a sink (position below ``sink``), which stays as it came."""

    def __init__(self, codec, sink: int, residual: int, tails: list[int]):
        super().__init__(residual, 1, tails)
        self.codec, self.sink = codec, sink

    @classmethod
    def of(cls, stores) -> "KVQuantResidual | None":
        """The window of ``stores`` when every one is a KVQuant store of one codec whose tail holds every head's
        newest tokens (no evicted slots in it)."""
        first = stores[0]
        if not all(s.batch_family is BatchFamily.KVQUANT and first.same_code(s) and s.residual_intact() for s in stores):
            return None
        return cls(first.codec, first.sink, first.residual, [s.tail.slots for s in stores])

    def encode_aged(self, buffer: BatchBuffer, counts: list[int], kv_dtype: torch.dtype, bound: int | None = None) -> None:
        """The tokens leaving the window, encoded at their positions and read back in place; ``bound``: a number
        above every position, where the layer knows one on the host."""
        for run in self.aged(buffer.lengths, counts):
            keys, values, positions = (run.take(held).contiguous() for held in (buffer.keys, buffer.values, buffer.positions))
            decoded_keys, decoded_values = self.codec.read_encoded(keys.to(kv_dtype), values.to(kv_dtype), positions,
                                                                   kv_dtype, keys.dtype, bound)
            sink = (positions < self.sink)[..., None]
            run.put(buffer.keys, torch.where(sink, keys, decoded_keys))
            run.put(buffer.values, torch.where(sink, values, decoded_values))


class CoefficientSteps:
    """Rows of coefficient stores (:class:`~kveval.stores.lowrank.LowRankStore` per head,
    :class:`~kveval.stores.latent.LatentStore` per group of heads), decoded for the batch.

    A row's store seals each new token at once: it encodes it on the layer's bases, keeps the coefficients in
    ``kv_dtype`` (in dense inner stores, or quantized ones with their own residual window), and attention reads
    their reconstruction. A step does that for every row with one encoding and one reconstruction, by the first
    row's store (the rows share its bases: :meth:`~kveval.stores.lowrank.CoefficientStore.same_code`; a token's
    coefficients and reconstruction are the same alone or in a batch); the coefficients wait, exactly as
    computed, for the rows to catch up. Steps of one token per row only: a row's store encodes several new tokens
    as one matrix, which a batch cannot repeat.

    Over quantized inner stores, the batch also holds every row's coefficients as its stores read them back
    (one :class:`~kveval.tensors.batch_buffer.BatchBuffer` per inner store, loaded by :meth:`start`): coefficients
    leaving the residual window are replaced by their dequantized values (:class:`QuantizedResidual`), and
    their tokens are reconstructed again into the layer's buffer (:meth:`rewrite_aged`).
    """

    def __init__(self, code: TokenStore, residuals: "list[tuple[QuantizedResidual, QuantizedResidual]] | None" = None):
        self.code = code  # the first row's store: encodes and decodes for the batch
        self.residuals = residuals  # per inner store, its K and V quantizers' windows (quantized inners)
        self.held: list[BatchBuffer] = []  # per inner store, the rows' coefficients (quantized inners)
        self.aged: list[tuple[str, AgedRun]] = []  # this step's slots whose K ("keys") or V ("values") changed

    @classmethod
    def of(cls, stores) -> "CoefficientSteps | None":
        """The steps of ``stores`` when every one is a sealed coefficient store on the first one's bases, over
        dense inner stores or plain quantized ones with no evicted slots."""
        first = stores[0]
        if not all(s.batch_family is BatchFamily.COEFFICIENTS and not s.unsealed.length and (s is first or first.same_code(s))
                   for s in stores):
            return None
        inners = [inner for s in stores for inner in s.inners]
        if all(i.batch_family is BatchFamily.DENSE for i in inners):
            return cls(first)
        if not all(i.batch_family is BatchFamily.QUANTIZED and i.every_slot_alive() for i in inners):
            return None
        return cls(first, [(QuantizedResidual.of([s.inners[i].k for s in stores]), QuantizedResidual.of([s.inners[i].v for s in stores]))
                           for i in range(len(first.inners))])

    def start(self, rows) -> None:
        """Quantized inner stores: load every row's coefficients, as its stores read them back, into the batch."""
        if self.residuals is None:
            return
        self.held = []
        for i in range(len(self.code.inners)):
            held = None
            for b, row in enumerate(rows):
                ck, cv = row.store.inners[i].keys_values()
                if held is None:
                    held = BatchBuffer(len(rows), ck.shape[0], ck.shape[-1], cv.shape[-1], ck.dtype, ck.device)
                held.write_row(b, 0, ck, cv, torch.zeros(ck.shape[:2], dtype=torch.long, device=ck.device))
            self.held.append(held)

    def step(self, keys: torch.Tensor, values: torch.Tensor, kv_dtype: torch.dtype, positions: torch.Tensor,
             real: torch.Tensor, counts: list[int]):
        """``[B, H, q, D]`` new K/V in the compute dtype -> (each inner store's ``kv_dtype`` coefficients, the
        reconstructed K and V in the compute dtype), as each row's store seals and reads them."""
        compute = keys.dtype
        # As a row's store holds a token before sealing it: in kv_dtype, handed back in the compute dtype.
        keys, values = keys.to(kv_dtype).to(compute).contiguous(), values.to(kv_dtype).to(compute).contiguous()
        coefficients = [(ck.to(kv_dtype), cv.to(kv_dtype)) for ck, cv in self.code.encode(keys, values)]
        if self.residuals is None:
            keys, values = self.code.decode([(ck.to(compute), cv.to(compute)) for ck, cv in coefficients])
            return coefficients, keys, values
        self.aged = []
        for i, (held, (key_side, value_side), (ck, cv)) in enumerate(zip(self.held, self.residuals, coefficients)):
            held.append(ck.to(held.keys.dtype), cv.to(held.values.dtype), positions, real, counts)
            key_runs = key_side.encode_aged(held.keys, held.lengths, counts, kv_dtype)
            value_runs = value_side.encode_aged(held.values, held.lengths, counts, kv_dtype)
            if i == 0:  # every inner store holds the same tokens: its slots age alike
                self.aged = [("keys", run) for run in key_runs] + [("values", run) for run in value_runs]
        # Each row's new token, as read after its store sealed it (its coefficients may have aged at once).
        last = torch.tensor(self.held[0].lengths, device=keys.device).sub(1).clamp(min=0)
        rows = torch.arange(len(last), device=keys.device)
        keys, values = self.code.decode([(held.keys[rows, :, last].unsqueeze(2), held.values[rows, :, last].unsqueeze(2))
                                         for held in self.held])
        return coefficients, keys.to(compute), values.to(compute)

    def rewrite_aged(self, buffer: BatchBuffer) -> None:
        """After the step's tokens went into the layer's ``buffer``: reconstruct again the K (or V) of the slots
        whose coefficients left the residual window at this step."""
        for side, run in self.aged:
            keys, values = self.code.decode([(run.take(held.keys), run.take(held.values)) for held in self.held])
            held = buffer.keys if side == "keys" else buffer.values
            run.put(held, (keys if side == "keys" else values).to(held.dtype))
        self.aged = []

    @staticmethod
    def catch_up(rows, pending) -> None:
        """Every row's inner stores take (and seal) its real tokens' coefficients of the ``pending`` steps
        (``(coefficients, positions, real)``); positions and counts follow."""
        steps = [coefficients for coefficients, _, _ in pending]
        positions, real = (torch.cat([entry[i] for entry in pending], dim=1) for i in (1, 2))
        inners = [(torch.cat([step[i][0] for step in steps], dim=-2), torch.cat([step[i][1] for step in steps], dim=-2))
                  for i in range(len(steps[0]))]
        for b, row in enumerate(rows):
            keep = real[b]
            if not bool(keep.any()):
                continue
            for inner, (ck, cv) in zip(row.store.inners, inners):
                inner.append(ck[b][:, keep], cv[b][:, keep])
                inner.seal()
            row.took(positions[b][keep])
            row.store.mark_read()


__all__ = ["AgedRun", "CoefficientSteps", "KVQuantResidual", "QuantizedResidual", "ResidualWindow", "encode_aged_sides"]
