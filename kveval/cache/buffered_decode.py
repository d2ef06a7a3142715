"""Decode steps that update the whole batch of a layer at once; the rows' stores catch up later.

Once every row of a layer is compressed, a decode step does the same thing to
every row. :class:`BufferedDecode` does it for the batch with a few tensor ops
on the layer's :class:`~kveval.tensors.batch_buffer.BatchBuffer`, with no Python loop
over rows or heads:

- the new tokens go in after each row's last slot, as ``kv_dtype`` values;
- quantized rows: tokens that age out of the full-precision residual window
  are encoded by :func:`kveval.stores.quantized.encode` exactly as each row's store
  encodes them (groups per token, or per channel over the same ``group``
  consecutive tokens the store would group) and replaced, in place, by their
  dequantized values; or, held as codes (:class:`~kveval.cache.coded_rows.CodedRows`,
  the default on CUDA), the layer is dequantized at each step into a scratch
  that all layers share, so the cache is never held a second time;
- attention-scored selection (H2O, TOVA) under a decode budget adds or sets
  each step's attention mass in a ``[B, H, slots]`` tensor beside the tokens
  (without a budget, nothing ranks the tokens again after the prefill);
- a decode budget (window, streaming, H2O, TOVA, knorm, random) keeps its tokens
  by one ranking of the policy's own scores (a ``min`` when each row drops one,
  or for scores made per layer, knorm and random, one stable sort and no device
  read) and one in-place gather (:class:`BudgetEviction`); a sliding-window
  layer (Gemma 3's local layers) keeps each row's newest tokens, slots known
  from the rows' lengths alone;
- per-head budgets, fixed per head (DuoAttention) or shared by the heads of a
  row by score (AdaKV's decode budget), by one ranking, moving K and V only
  where a kept token changes slot (:class:`HeadBudgetEviction`);
- a decode step's mask is made from the rows' lengths where that is all it
  depends on (one query per row, tokens first, no chunks, and no window or
  one that holds only what the query sees):
  :meth:`~kveval.cache.layers.CompressedLayer._step_mask`;
- low-rank and latent rows: each step encodes and reconstructs the batch's new
  tokens at once (:class:`CoefficientSteps`); over quantized coefficients, the
  tokens whose coefficients leave the residual window are reconstructed again;
- quantized rows held per head (AdaKV's budgets at the prefill): each row's
  head is a row of its own for the residual windows, on a ``[B * H, 1, slots, D]``
  view of the buffer;
- KVQuant rows: the tokens leaving the residual window are encoded by the
  layer's codec at their positions and read back in place (:class:`KVQuantResidual`);
- quantized and KVQuant rows of a sliding layer, when its window holds each
  row's unencoded tokens (``residual + unit <= window``): a trim then drops
  only whole, encoded tokens, and the rows replay the steps when they catch up;
- quantized rows under a decode budget, when each token is encoded alone as it
  arrives (per-token groups, no residual window): the buffer evicts whole
  encoded tokens, and the rows append, seal and keep what the buffer kept when
  they catch up.

What still goes row by row: steps of several tokens per row on low-rank and
latent rows (the query after the context), quantized rows under a decode
budget per head (DuoAttention, AdaKV's decode budget) or with a residual
window or per-channel groups (an eviction may reach the window or split a
unit), and sliding layers whose residual window does not fit in the window.
Each is checked once per refresh (:meth:`BufferedDecode.for_rows`).

The new tokens' positions (and, for plain quantized rows, the tokens) are kept
until the rows *catch up*: each row's store takes them (appending and sealing,
which encodes the same tokens into the same codes; loading the buffer's tokens
under a budget; pointing at the batch's codes when held as codes). The rows
catch up when anything reads them (measurement, forking, deriving) and every
:data:`CATCH_UP_STEPS` steps, which bounds the memory of what is pending. Every
path is bit-identical to decoding row by row (``tests/test_buffered_decode.py``).
"""

from __future__ import annotations

import torch

from kveval.cache.coded_rows import CodedRows, SharedScratch, seal_together
from kveval.cache.decode_encodings import CoefficientSteps, KVQuantResidual, QuantizedResidual, encode_aged_sides
from kveval.cache.decode_evictions import BudgetEviction, DeferredEvictions, HeadBudgetEviction, LayerScoring
from kveval.cache.rows import seal_rows
from kveval.stores.base import BatchFamily
from kveval.tensors.batch_buffer import BatchBuffer, real_runs

CATCH_UP_STEPS = 64  # decode steps between catch-ups of the rows' stores

_DENSE, _QUANTIZED, _KVQUANT = BatchFamily.DENSE, BatchFamily.QUANTIZED, BatchFamily.KVQUANT
_COEFFICIENTS, _PER_HEAD = BatchFamily.COEFFICIENTS, BatchFamily.PER_HEAD


def _plain_quantized(store) -> bool:
    """A quantized store with no evicted slot (inside a unit or in the residual window)."""
    return store.batch_family is _QUANTIZED and store.every_slot_alive()


class BufferedDecode:
    """Batched decode steps for one layer whose rows all hold one kind of store (see the module doc).

    Parameters
    ----------
    kv_dtype : torch.dtype
        The cache dtype the rows' stores hold.
    keys, values : QuantizedResidual or None
        The quantizers' residual windows (quantized rows), else ``None``.
    eviction : BudgetEviction, HeadBudgetEviction or None
        A decode budget (dense rows) or a sliding window, kept after each step's attention.
    kvquant : KVQuantResidual or None
        KVQuant rows' codec and residual window.
    coefficients : CoefficientSteps or None
        Low-rank or latent rows over dense coefficients.
    window : int or None
        Encoded rows (quantized, KVQuant) of a sliding layer of this many positions: their stores replay the
        steps (append, seal, trim) when they catch up.
    per_head : bool
        Quantized rows held per head (:class:`~kveval.stores.headwise.HeadwiseStore`: AdaKV's budgets at the
        prefill): ``keys``/``values`` then hold one residual window per row and head, in that order.
    accumulates : str or None
        ``"all"`` (H2O: attention summed over every query) or ``"last"`` (TOVA: the newest query's), when the
        selection scores with attention at every step (under a decode budget); the buffer then holds it beside the
        tokens.
    coded : (CodedRows, CodedRows) or None
        Quantized rows held as codes instead (``codes=True`` in :meth:`for_rows`): the buffer releases its
        dequantized K/V, every step dequantizes the layer into a scratch shared by the layers (:meth:`read`), and
        the rows' stores hold views of these codes, so the cache is held once, as codes.
    """

    def __init__(self, kv_dtype: torch.dtype, keys: QuantizedResidual | None = None, values: QuantizedResidual | None = None,
                 eviction: "BudgetEviction | HeadBudgetEviction | None" = None, accumulates: str | None = None,
                 coded: "tuple[CodedRows, CodedRows] | None" = None, coefficients: CoefficientSteps | None = None,
                 kvquant: KVQuantResidual | None = None, window: int | None = None, per_head: bool = False):
        self.kv_dtype = kv_dtype
        self.keys, self.values, self.eviction, self.accumulates = keys, values, eviction, accumulates
        self.kvquant, self.window, self.per_head = kvquant, window, per_head
        self.coded, self.coefficients = coded, coefficients
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (K, V, positions, real)

    @staticmethod
    def could_serve(store, selection, sliding_window: int | None = None) -> bool:
        """Whether rows holding stores like ``store`` under ``selection`` (in a sliding layer of ``sliding_window``
        positions, if given) may ever decode in batch: a cheap, static check; :meth:`for_rows` then checks every row.

        Dense, quantized, KVQuant, low-rank or latent stores, or per-head stores (AdaKV's budgets), which append
        every new token at one slot after the longest head, as dense rows do. A decode budget needs scores that
        take a batch (:attr:`SelectionPolicy.batch_scores`) and, in :meth:`for_rows`, dense stores (per head or
        not) or tokens quantized alone as they arrive; a sliding window, dense, quantized or KVQuant stores."""
        family = store.batch_family
        if family is _PER_HEAD:
            return sliding_window is None and (selection is None or selection.decode_budget is None
                                               or HeadBudgetEviction.serves(selection))
        if family is _COEFFICIENTS:
            return sliding_window is None and (selection is None or selection.decode_budget is None)
        if family is _KVQUANT:
            return selection is None or selection.decode_budget is None
        if family not in (_DENSE, _QUANTIZED):
            return False
        if sliding_window is not None:
            return True
        if selection is None or selection.decode_budget is None:
            return True
        return BudgetEviction.serves(selection)

    @classmethod
    def for_rows(cls, rows, kv_dtype: torch.dtype, selection=None, sliding_window: int | None = None,
                 layer_idx: int = 0, num_layers: int = 1, model=None, codes: bool = False,
                 seeds: "list[int] | None" = None) -> "BufferedDecode | None":
        """The batched decode of ``rows`` (:class:`~kveval.cache.rows.RowState`, all compressed), or ``None``
        where per-row work is needed (see :meth:`could_serve`; also quantized rows with evicted slots inside
        units, and sliding rows whose positions are not consecutive). ``codes``: quantized rows are held as codes
        and dequantized at every step (see the class doc) rather than kept dequantized in the buffer. ``seeds``:
        each row's seed, for scores drawn per row (``random``)."""
        stores = [row.store for row in rows]
        if not all(cls.could_serve(s, selection, sliding_window) for s in stores):
            return None
        # Attention scores are kept while decoding only for a decode budget to rank (see CompressedLayer.after_attention).
        accumulates = (selection.attention if selection is not None and selection.attention in ("all", "last")
                       and selection.decode_budget is not None else None)
        if sliding_window is not None:
            held = [row for row in rows if row.positions.shape[1]]
            spans = torch.stack([row.positions[0, -1] - row.positions[0, 0] for row in held]).tolist() if held else []
            if any(span != row.positions.shape[1] - 1 for span, row in zip(spans, held)):  # one read for the rows
                return None
            eviction = BudgetEviction.of_window(sliding_window)
            if all(s.batch_family is _DENSE for s in stores):
                return cls(kv_dtype, eviction=eviction)
            return cls._quantized_window(stores, kv_dtype, eviction, sliding_window)
        context = LayerScoring(layer_idx, num_layers, model,
                                tuple(seeds) if seeds else 0)
        if selection is not None and selection.decode_budget is not None and selection.per_head_budgets:
            budgets = selection.head_decode_budgets(model, layer_idx, num_layers, rows[0].positions.shape[0])
            if ((budgets is None and not selection.chooses_in_batch)
                    or not all(s.batch_family is _PER_HEAD and s.holds_dense() for s in stores)):
                return None
            eviction = HeadBudgetEviction(selection, budgets, context)
            return cls(kv_dtype, eviction=eviction, accumulates=accumulates)
        if selection is not None and selection.decode_budget is not None:
            eviction = BudgetEviction(selection.decode_budget, selection.scores, context,
                                      stacks=selection.scores_stack_layers)
            if all(s.batch_family is _DENSE for s in stores):
                return cls(kv_dtype, eviction=eviction, accumulates=accumulates)
            if not all(s.batch_family is _QUANTIZED and s.encodes_on_arrival() for s in stores):
                return None
            return cls(kv_dtype, QuantizedResidual.of([s.k for s in stores]), QuantizedResidual.of([s.v for s in stores]),
                       eviction=eviction, accumulates=accumulates)
        if all(s.holds_dense() for s in stores):
            return cls(kv_dtype, accumulates=accumulates)
        if all(s.batch_family is _PER_HEAD for s in stores):  # per-head budgets at the prefill: each head is a row
            heads = [head for s in stores for head in s.heads]
            if not all(_plain_quantized(head) for head in heads):
                return None
            return cls(kv_dtype, QuantizedResidual.of([h.k for h in heads]), QuantizedResidual.of([h.v for h in heads]),
                       accumulates=accumulates, per_head=True)
        coefficients = CoefficientSteps.of(stores)
        if coefficients is not None:
            return cls(kv_dtype, accumulates=accumulates, coefficients=coefficients)
        kvquant = KVQuantResidual.of(stores)
        if kvquant is not None:
            return cls(kv_dtype, accumulates=accumulates, kvquant=kvquant)
        if all(_plain_quantized(s) for s in stores):
            if codes:
                coded = (CodedRows.from_sequences([s.k for s in stores]), CodedRows.from_sequences([s.v for s in stores]))
                return cls(kv_dtype, accumulates=accumulates, coded=coded)
            return cls(kv_dtype, QuantizedResidual.of([s.k for s in stores]), QuantizedResidual.of([s.v for s in stores]), accumulates=accumulates)
        return None

    @classmethod
    def _quantized_window(cls, stores, kv_dtype, eviction: BudgetEviction, window: int) -> "BufferedDecode | None":
        """Quantized or KVQuant rows of a sliding layer, when a trim can only drop encoded tokens: each row's
        unencoded tokens (at most ``residual + unit - 1`` after a seal) stay below the ``window`` it holds, so the
        buffer evicts whole encoded tokens and the rows replay the steps when they catch up (:meth:`catch_up`)."""
        kvquant = KVQuantResidual.of(stores)
        if kvquant is not None:
            return cls(kv_dtype, eviction=eviction, kvquant=kvquant, window=window) if kvquant.residual + 1 <= window else None
        if not all(s.batch_family is _QUANTIZED and s.residual_intact() for s in stores):
            return None
        keys, values = QuantizedResidual.of([s.k for s in stores]), QuantizedResidual.of([s.v for s in stores])
        if any(side.residual + side.unit > window for side in (keys, values)):
            return None
        return cls(kv_dtype, keys, values, eviction=eviction, window=window)

    def start(self, rows, buffer: BatchBuffer) -> None:
        """Load what the steps update beside the tokens into ``buffer``: the rows' accumulated attention. Held as
        codes, the buffer's K/V are released and the rows' stores point at the batch's codes."""
        if self.coded is not None:
            buffer.release_values()
            self._point_rows(rows)
        if self.coefficients is not None:
            self.coefficients.start(rows)
        if self.accumulates is None:
            buffer.attention = None
            return
        dtype = next((row.attention.dtype for row in rows if row.attention is not None), torch.float32)
        buffer.attention = buffer.positions.new_zeros(buffer.positions.shape, dtype=dtype)
        for b, row in enumerate(rows):
            if row.attention is not None:
                buffer.attention[b, :, :row.attention.shape[1]] = row.attention

    def after_attention(self, buffer: BatchBuffer, mass: torch.Tensor | None,
                        deferred: "DeferredEvictions | None" = None) -> bool:
        """What a step does once attention has read the buffer: add (``"all"``) or set (``"last"``) the step's
        attention ``mass`` (``[B, H, width]``), then keep the decode budget, or leave it to ``deferred`` where it
        may wait for the forward's other layers (:meth:`BudgetEviction.defers`). Whether any row dropped (or will
        drop) a token."""
        if self.accumulates == "all":
            buffer.attention.narrow(2, 0, buffer.width).add_(mass)
        elif self.accumulates == "last":
            buffer.attention.narrow(2, 0, buffer.width).copy_(mass)
        if self.eviction is None:
            return False
        if deferred is not None and self.eviction.defers(buffer):
            deferred.add(self.eviction, buffer)
            return True  # a row holds more than the budget: it will drop a token
        return self.eviction.apply(buffer)

    def append(self, buffer: BatchBuffer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               real: torch.Tensor, counts: list[int], runs: "tuple[tuple[int, int], ...] | None" = None,
               bound: int | None = None) -> None:
        """One decode step: ``keys``/``values`` ``[B, H, q, D]`` in the compute dtype, ``positions``/``real`` ``[B, q]``
        (``runs``: each row's real columns ``[start, stop)``, where known: :func:`~kveval.tensors.batch_buffer.run_targets`;
        ``bound``: a number above every position the layer holds, where it knows one on the host)."""
        if self.coefficients is not None:
            coefficients, keys, values = self.coefficients.step(keys, values, self.kv_dtype, positions, real, counts)
            self.pending.append((coefficients, positions, real))
            buffer.append(keys.to(buffer.keys.dtype), values.to(buffer.values.dtype), positions, real, counts)
            self.coefficients.rewrite_aged(buffer)
            return
        if keys.dtype != self.kv_dtype:  # the cache's rounding (a no-op .to costs a dispatch, per layer and step)
            keys, values = keys.to(self.kv_dtype), values.to(self.kv_dtype)
        if self.coded is not None:
            self.pending.append((None, None, positions, real))
            buffer.append(None, None, positions, real, counts, runs)
            for side, x in zip(self.coded, (keys, values)):
                side.append(x, real, counts, runs, seal=False)
            seal_together(*self.coded)
            return
        self.pending.append((keys, values, positions, real))
        buffer.append(keys, values, positions, real, counts, runs)  # converted to the buffer's dtype as they are written
        lengths = buffer.lengths
        if self.per_head:  # each (row, head) its own residual window: [B * H, 1, slots, D] views, heads ending together
            heads = buffer.keys.shape[1]
            lengths, counts = [n for n in lengths for _ in range(heads)], [c for c in counts for _ in range(heads)]
        if self.keys is not None or self.values is not None:
            held_keys, held_values = ((held.view(-1, 1, *held.shape[2:]) if self.per_head else held)
                                      for held in (buffer.keys, buffer.values))
            encode_aged_sides(self.keys, self.values, held_keys, held_values, lengths, counts, self.kv_dtype)
        if self.kvquant is not None:
            self.kvquant.encode_aged(buffer, counts, self.kv_dtype, bound)

    def read(self, dtype: torch.dtype, scratch: SharedScratch) -> tuple[torch.Tensor, torch.Tensor]:
        """Held as codes: the layer's K and V, ``[B, H, width, D]`` in ``dtype``, dequantized into ``scratch``
        (valid until another layer reads into it)."""
        keys, values = self.coded
        out = [scratch.get(name, side.batch, side.heads, side.width, side.dim, dtype, side.tail.device)
               for name, side in (("keys", keys), ("values", values))]
        return keys.read(dtype, out[0]), values.read(dtype, out[1])

    def takes(self, counts: list[int]) -> bool:
        """Whether a step appending ``counts`` new tokens per row can be done for the batch (low-rank and latent
        rows: one token per row at most, see :class:`CoefficientSteps`)."""
        return self.coefficients is None or max(counts, default=0) <= 1

    @property
    def due(self) -> bool:
        """Whether the rows must catch up now: enough steps pending, or the codes moved (the rows' views of them
        would keep the old tensors alive)."""
        return len(self.pending) >= CATCH_UP_STEPS or (self.coded is not None and any(side.grown for side in self.coded))

    def _point_rows(self, rows) -> None:
        """Every row's store holds views of its codes and of its full-precision tail in the batch."""
        for b, row in enumerate(rows):
            for sequence, side in ((row.store.k, self.coded[0]), (row.store.v, self.coded[1])):
                sequence.block, sequence.tail = side.row_block(b), side.row_tail(b)
                sequence.count = sequence.read = side.lengths[b]
        for side in self.coded:
            side.grown = False

    def catch_up(self, rows, buffer: BatchBuffer) -> None:
        """Every row's store appends its pending tokens and seals; the rows' positions and counts follow.

        Under a decode budget the dense rows instead take the buffer's tokens as they stand (its ``kv_dtype``
        values read back exactly), since appending would skip the evictions."""
        if self.coded is not None:  # the codes are the rows' as they stand: point at them, count the new tokens
            if self.pending:
                positions, real = (torch.cat(parts, dim=1) for parts in list(zip(*self.pending))[2:])
                self.pending = []
                columns = real_runs(real)[1]
                for b, row in enumerate(rows):
                    row.took(positions[b][real[b] if columns[b] is None else columns[b]])
                    self._catch_up_attention(row, buffer, b)
            self._point_rows(rows)
            return
        if not self.pending:
            return
        if self.coefficients is not None:
            self.coefficients.catch_up(rows, self.pending)
            self.pending = []
            for b, row in enumerate(rows):
                self._catch_up_attention(row, buffer, b)
            return
        if self.window is not None:  # encoded rows of a sliding layer: append and seal, then trim as the layer would
            for row, took in zip(rows, self._append_pending(rows)):
                # The trim its next query sees: its positions are consecutive (checked when the batched decode
                # started; each step appends the next), so the window keeps its last window - 1, known on the host.
                held = row.positions.shape[1]
                if took and held > self.window - 1:
                    row.keep_last(self.window - 1)
                row.store.mark_read()
            return
        if self.eviction is not None and self.keys is not None:  # quantized rows under a decode budget
            self._append_pending(rows)
            for b, row in enumerate(rows):
                # Keep what the buffer kept, as the dense rows below take it: each head's positions (ascending in
                # both) located in the row's; positions and attention are then the buffer's.
                kept = buffer.positions[b, :, :buffer.lengths[b]].clone()
                row.store.select(torch.searchsorted(row.positions.contiguous(), kept))
                row.positions = kept
                row.store.mark_read()
                self._catch_up_attention(row, buffer, b)
            return
        if self.eviction is not None:  # the buffer holds the rows as they stand: only the counts are needed
            counts = torch.cat([real for *_, real in self.pending], dim=1).sum(dim=1).tolist()
            self.pending = []
            for b, row in enumerate(rows):
                n = buffer.lengths[b]
                row.store.load_buffer_row(buffer.keys[b, :, :n], buffer.values[b, :, :n], buffer.positions[b, :, :n])
                row.store.mark_read()
                row.positions = buffer.positions[b, :, :n].clone()
                row.tokens_seen += counts[b]
                self._catch_up_attention(row, buffer, b)
            return
        for row, took in zip(rows, self._append_pending(rows)):
            if took:
                row.store.mark_read()
        for b, row in enumerate(rows):
            self._catch_up_attention(row, buffer, b)

    def _append_pending(self, rows) -> list[bool]:
        """Each row's store appends its real pending tokens and seals (encoding what leaves its residual window, as
        the row would have step by step); whether each row took any."""
        keys, values, positions, real = self._pending_tokens()
        counts, columns = real_runs(real)  # a finished row's real steps are a prefix: a slice, no sync per row
        took = [n > 0 for n in counts]
        for b, row in enumerate(rows):
            if took[b]:
                row.take(keys[b], values[b], positions[b], real[b] if columns[b] is None else columns[b])
        seal_rows([row for row, t in zip(rows, took) if t])
        return took

    def _pending_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pending steps' K, V (``[B, H, steps, D]``), positions and real flags (``[B, steps]``), taken."""
        keys, values, positions, real = (torch.cat(parts, dim=-2 if i < 2 else 1) for i, parts in enumerate(zip(*self.pending)))
        self.pending = []
        return keys, values, positions, real

    def _catch_up_attention(self, row, buffer: BatchBuffer, b: int) -> None:
        if self.accumulates is not None:
            row.attention = buffer.attention[b, :, :buffer.lengths[b]].clone()


__all__ = ["BufferedDecode", "CATCH_UP_STEPS"]
