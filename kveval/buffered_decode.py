"""Decode steps that update the whole batch of a layer at once; the rows' stores catch up later.

Once every row of a layer is compressed, a decode step does the same thing to
every row. :class:`BufferedDecode` does it for the batch with a few tensor ops
on the layer's :class:`~kveval.batch_buffer.BatchBuffer`, with no Python loop
over rows or heads:

- the new tokens go in after each row's last slot, as ``kv_dtype`` values;
- quantized rows: tokens that age out of the full-precision residual window
  are encoded by :func:`kveval.storage.encode` exactly as each row's store
  encodes them (groups per token, or per channel over the same ``group``
  consecutive tokens the store would group) and replaced, in place, by their
  dequantized values; or, held as codes (:class:`~kveval.coded_rows.CodedRows`,
  the default on CUDA), the layer is dequantized at each step into a scratch
  that all layers share, so the cache is never held a second time;
- attention-scored selection (H2O, TOVA) adds or sets each step's attention
  mass in a ``[B, H, slots]`` tensor beside the tokens;
- a decode budget (window, streaming, H2O, TOVA, knorm, random) or a sliding-window
  layer (Gemma 3's local layers) keeps its tokens by one ``topk`` of the
  policy's own scores and one in-place gather (:class:`_BudgetEviction`);
- per-head budgets, fixed per head (DuoAttention) or shared by the heads of a
  row by score (AdaKV's decode budget), by one ranking and one gather
  (:class:`_HeadBudgetEviction`).

- low-rank and latent rows over dense coefficients: each step encodes and
  reconstructs the batch's new tokens at once (:class:`_CoefficientSteps`);
- KVQuant rows: the tokens leaving the residual window are encoded by the
  layer's codec at their positions and read back in place (:class:`_KVQuantResidual`).

What still goes row by row: low-rank and latent rows over quantized
coefficients, steps of several tokens per row on those rows, and
quantized stores held per head (AdaKV, DuoAttention) or evicting while decoding
(a decode budget, a sliding layer: an eviction splits quantization units). Each
is checked once per refresh (:meth:`BufferedDecode.for_rows`).

The new tokens' positions (and, for plain quantized rows, the tokens) are kept
until the rows *catch up*: each row's store takes them (appending and sealing,
which encodes the same tokens into the same codes; loading the buffer's tokens
under a budget; pointing at the batch's codes when held as codes). The rows
catch up when anything reads them (measurement, forking, deriving) and every
:data:`CATCH_UP_STEPS` steps, which bounds the memory of what is pending. Every
path is bit-identical to decoding row by row (``tests/test_buffered_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.batch_buffer import PAD_POSITION, BatchBuffer, take_slots
from kveval.coded_rows import CodedRows, SharedScratch
from kveval.head_stores import HeadwiseStore
from kveval.kvquant import KVQuantStore
from kveval.lowrank import CoefficientStore
from kveval.policies import ScoringState
from kveval.policies.window import SinkWindowPolicy, WindowPolicy
from kveval.quantization import dequantize
from kveval.storage import DenseStore, QuantizedSequence, QuantizedStore, encode

CATCH_UP_STEPS = 64  # decode steps between catch-ups of the rows' stores


@dataclass
class _AgedRun:
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
        index = torch.tensor(self.rows, device=device)[:, None]
        return index, torch.tensor(self.firsts, device=device)[:, None] + torch.arange(self.count, device=device)

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
class _ResidualWindow:
    """A residual window of ``residual`` recent tokens kept as they came, encoded ``unit`` tokens at a time once
    they leave it, and each row's unencoded tail (slots at its end)."""

    residual: int
    unit: int  # tokens per quantization unit: 1 per token, ``group`` per channel
    tails: list[int]

    def aged(self, lengths: list[int], counts: list[int]) -> list[_AgedRun]:
        """After each row appended ``counts[b]`` tokens (now ``lengths[b]`` slots), the slots that leave the
        window, as each row's store seals them, grouped by count (usually one: every row ages one token at once)."""
        self.tails = [t + c for t, c in zip(self.tails, counts)]
        aged = [max(0, (t - self.residual) // self.unit * self.unit) for t in self.tails]
        runs = []
        for count in sorted(set(aged) - {0}):
            rows = [b for b, a in enumerate(aged) if a == count]
            runs.append(_AgedRun(rows, [lengths[b] - self.tails[b] for b in rows], count, len(aged)))
            for b in rows:
                self.tails[b] -= count
        return runs


class _Residual(_ResidualWindow):
    """One of K or V of a quantized layer (:class:`~kveval.storage.QuantizedSequence`): its encoding and window."""

    def __init__(self, quant, residual: int, unit: int, tails: list[int]):
        super().__init__(residual, unit, tails)
        self.quant = quant  # kveval.policies.quant.TensorQuant

    @classmethod
    def of(cls, sequences: list[QuantizedSequence]) -> "_Residual":
        first = sequences[0]
        return cls(first.quant, first.residual, first.unit, [s.tail_slots for s in sequences])

    def encode_aged(self, held: torch.Tensor, lengths: list[int], counts: list[int], kv_dtype: torch.dtype) -> None:
        """Replace the slots that left the window in ``held`` (``[B, H, slots, D]``, the buffer's K or V) by their
        dequantized values."""
        for run in self.aged(lengths, counts):
            run.put(held, self._decoded(run.take(held), kv_dtype))

    def _decoded(self, tokens: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
        """``tokens`` (``[rows, H, count, D]``) encoded as the store encodes them, read back in their dtype."""
        rows, heads, count, dim = tokens.shape
        flat = tokens.reshape(rows * heads, count, dim).to(kv_dtype)
        return dequantize(encode(self.quant, flat), tokens.dtype).reshape(rows, heads, count, dim)


class _KVQuantResidual(_ResidualWindow):
    """KVQuant rows (:class:`~kveval.kvquant.KVQuantStore`): the layer's codec, sink and window. A token leaving
    the window is encoded with its position (pre-RoPE keys are un-rotated there) and read back as the row's store
    reads it, unless it is a sink (position below ``sink``), which stays as it came."""

    def __init__(self, codec, sink: int, residual: int, tails: list[int]):
        super().__init__(residual, 1, tails)
        self.codec, self.sink = codec, sink

    @classmethod
    def of(cls, stores) -> "_KVQuantResidual | None":
        """The window of ``stores`` when every one is a KVQuant store of one codec whose tail holds every head's
        newest tokens (no evicted slots in it)."""
        first = stores[0]
        if not all(type(s) is KVQuantStore and s.codec is first.codec and (s.sink, s.residual) == (first.sink, first.residual)
                   and s.tail.alive is None for s in stores):
            return None
        return cls(first.codec, first.sink, first.residual, [s.tail.slots for s in stores])

    def encode_aged(self, buffer: BatchBuffer, counts: list[int], kv_dtype: torch.dtype) -> None:
        for run in self.aged(buffer.lengths, counts):
            keys, values, positions = (run.take(held).contiguous() for held in (buffer.keys, buffer.values, buffer.positions))
            data = self.codec.encode(keys.to(kv_dtype), values.to(kv_dtype), positions, kv_dtype)
            decoded_keys, decoded_values = self.codec.decode(data, positions, keys.dtype)
            sink = (positions < self.sink)[..., None]
            run.put(buffer.keys, torch.where(sink, keys, decoded_keys))
            run.put(buffer.values, torch.where(sink, values, decoded_values))


def _dense(store) -> bool:
    """A dense store, or per-head stores whose every head is dense (what a batched append or eviction may load)."""
    return type(store) is DenseStore or (type(store) is HeadwiseStore and all(type(h) is DenseStore for h in store.heads))


@dataclass(frozen=True)
class _LayerScoring:
    """What a batched scoring gives a policy beside the buffer (:class:`~kveval.policies.base.ScoringState`):
    the layer, the model, and each row's seed (the ``random`` control's), as the layer gives them for one row."""

    layer_idx: int = 0
    num_layers: int = 1
    model: object = None
    seeds: "torch.Tensor | int" = 0  # [B] on the rows' device, made once per refresh


def _scored(buffer: BatchBuffer, scores, context: _LayerScoring) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's ``scores`` of every slot of ``buffer`` (``[B, H, width]``, float32 or wider: ``-inf`` on padding,
    ``+inf`` on each row's newest slot, which is never evicted) and the padding mask, as the layer scores one row."""
    width = buffer.width
    positions = buffer.positions[:, :, :width]
    padding = positions == PAD_POSITION
    attention = None if buffer.attention is None else buffer.attention[:, :, :width]
    state = ScoringState(keys=buffer.keys[:, :, :width], positions=positions.masked_fill(padding, -1),
                         attention=attention, layer_idx=context.layer_idx, num_layers=context.num_layers,
                         seed=context.seeds, model=context.model)
    scored = scores(state)
    scored = scored.to(torch.promote_types(scored.dtype, torch.float32)).masked_fill(padding, float("-inf"))
    newest = torch.tensor(buffer.lengths, device=scored.device)[:, None, None] - 1
    scored.scatter_(2, newest.clamp(min=0).expand(-1, scored.shape[1], 1), float("inf"))
    return scored, padding


class _BudgetEviction:
    """A decode budget kept for the whole batch at once.

    After each step's attention, every row holding more than ``budget`` tokens keeps its ``budget`` best-scored,
    its newest always, exactly as the layer would for each row by itself
    (:meth:`kveval.cache_layers.CompressedLayer._evict_to`: the policy's scores, ``topk``, kept in order). The
    buffer's K, V, positions and accumulated attention are compacted in place by one gather per tensor
    (:func:`~kveval.batch_buffer.take_slots` for K and V).

    Two sources:

    - a selection's ``decode_budget`` whose :meth:`scores` take a batch (``batch_scores``: window, streaming, H2O,
      TOVA, knorm), scored on the buffer's views (positions, the attention it accumulated, keys);
    - a sliding-window layer of ``window`` positions, which keeps what its next query can see: the ``window - 1``
      newest tokens, by position (:meth:`~kveval.cache_layers.CompressedLayer._trim_to_window`, while every row
      holds consecutive positions, which :meth:`BufferedDecode.for_rows` checks).
    """

    def __init__(self, budget: int, scores, context: _LayerScoring = _LayerScoring()):
        self.budget, self.scores, self.context = budget, scores, context

    @staticmethod
    def serves(selection) -> bool:
        """Whether ``selection``'s decode budget can be kept for a batch (one budget for every head, batch scores)."""
        return (selection.decode_budget is not None and selection.batch_scores and not selection.per_head_budgets
                and selection.attention in ("none", "all", "last"))

    @classmethod
    def of_window(cls, window: int) -> "_BudgetEviction":
        return cls(window - 1, lambda state: state.positions.float())

    def apply(self, buffer: BatchBuffer) -> bool:
        """Keep the budget in every row; whether any row dropped a token."""
        width = buffer.width
        if width <= self.budget:
            return False
        scores, _ = _scored(buffer, self.scores, self.context)
        keep = scores.topk(self.budget, dim=2).indices.sort(dim=2).values  # [B, H, budget]
        for held in (buffer.keys, buffer.values):
            held[:, :, :self.budget] = take_slots(held, keep)
        for held, fill in ((buffer.positions, PAD_POSITION), (buffer.attention, 0)):
            if held is not None:
                held[:, :, :self.budget] = held[:, :, :width].gather(2, keep)
                held[:, :, self.budget:width] = fill
        buffer.lengths = [min(n, self.budget) for n in buffer.lengths]
        buffer.width = max(buffer.lengths)
        buffer.fit()
        return True


class _HeadBudgetEviction:
    """A decode budget per KV head, kept for the whole batch at once. Two kinds:

    - fixed per head (``budgets``; DuoAttention: retrieval heads keep every token, streaming heads
      ``sink + window``): each head keeps its best-scored tokens up to its budget (one ranking ``argsort``);
    - chosen by score across the heads of a row (``budgets=None``; AdaKV's ``decode_budget x heads`` shared
      by the heads): the policy's :meth:`~kveval.policies.base.SelectionPolicy.choose_batch`.

    Rows hold per-head stores (:class:`~kveval.head_stores.HeadwiseStore`): in the buffer, each head's tokens end
    at its row's last slot, padding (an invisible position) before them. After each step's attention every row
    holding more than ``decode_budget`` slots keeps what :meth:`kveval.cache_layers.CompressedLayer._evict_to` and
    the policy's ``choose`` would keep for it (its newest token always); a stable ``argsort`` lines each head's
    kept tokens up at its row's new last slot, and one gather per tensor moves them.
    """

    def __init__(self, selection, budgets: list[int | None] | None, context: _LayerScoring):
        self.selection, self.decode_budget, self.context = selection, selection.decode_budget, context
        self.budgets = budgets  # per head (None: every token); None: chosen by score (AdaKV)

    @staticmethod
    def serves(selection) -> bool:
        return selection.decode_budget is not None and selection.per_head_budgets and selection.batch_scores

    def _kept(self, scores: torch.Tensor, padding: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, H, width]``: the slots an over-budget row keeps."""
        if self.budgets is None:
            return self.selection.choose_batch(scores, self.decode_budget)
        budgets = torch.tensor([width if b is None else b for b in self.budgets], device=scores.device)[None, :, None]
        rank = scores.argsort(dim=2, descending=True, stable=True).argsort(dim=2)
        return ~padding & (rank < budgets)

    def apply(self, buffer: BatchBuffer) -> bool:
        """Keep every head's budget in every row; whether any row was over the decode budget (it then evicted)."""
        lengths, width = buffer.lengths, buffer.width
        if not any(n > self.decode_budget for n in lengths):
            return False
        scores, padding = _scored(buffer, self.selection.scores, self.context)
        device = scores.device
        over = torch.tensor([n > self.decode_budget for n in lengths], device=device)[:, None, None]
        kept = self._kept(scores, padding, width) | (~padding & ~over)  # rows within the decode budget keep everything
        counts = kept.sum(dim=2)  # [B, H]
        new_lengths = counts.max(dim=1).values.tolist()
        new_width = max(new_lengths)
        order = torch.argsort(kept.to(torch.int8), dim=2, stable=True)  # dropped first, kept last, each in slot order
        # Slot t of row b takes order[t + width - new_lengths[b]]: each head's kept tokens end at its row's last slot.
        shift = width - torch.tensor(new_lengths, device=device)[:, None, None]
        source = torch.arange(new_width, device=device)[None, None, :] + shift  # [B, 1, new_width]
        real = (source >= width - counts[..., None]) & (source < width)  # [B, H, new_width]
        index = order.gather(2, source.clamp(max=width - 1).expand(-1, order.shape[1], -1))
        for held in (buffer.keys, buffer.values):
            moved = take_slots(held, index)
            held[:, :, :new_width] = moved.masked_fill(~real[..., None], 0)
        for held, fill in ((buffer.positions, PAD_POSITION), (buffer.attention, 0)):
            if held is not None:
                held[:, :, :new_width] = held[:, :, :width].gather(2, index).masked_fill(~real, fill)
                held[:, :, new_width:width] = fill
        buffer.lengths, buffer.width = new_lengths, new_width
        buffer.fit()
        return True


class _CoefficientSteps:
    """Rows of coefficient stores (:class:`~kveval.lowrank.LowRankStore` per head,
    :class:`~kveval.latent.LatentStore` per group of heads) over dense inner stores, decoded for the batch.

    A row's store seals each new token at once: it encodes it on the layer's bases, keeps the coefficients in
    ``kv_dtype``, and attention reads their reconstruction. A step does that for every row with one encoding and
    one reconstruction, by the first row's store (the rows share its bases: :meth:`~kveval.lowrank.CoefficientStore.same_code`;
    a token's coefficients and reconstruction are the same alone or in a batch); the coefficients wait, exactly
    as computed, for the rows to catch up. Steps of one token per row only: a row's store encodes several new
    tokens as one matrix, which a batch cannot repeat.
    """

    def __init__(self, code: CoefficientStore):
        self.code = code  # the first row's store: encodes and decodes for the batch

    @classmethod
    def of(cls, stores) -> "_CoefficientSteps | None":
        """The steps of ``stores`` when every one is a sealed coefficient store over dense inner stores, all on the
        first one's bases."""
        first = stores[0]
        if not all(isinstance(s, CoefficientStore) and not s.unsealed.length and all(type(i) is DenseStore for i in s.inners)
                   and (s is first or first.same_code(s)) for s in stores):
            return None
        return cls(first)

    def step(self, keys: torch.Tensor, values: torch.Tensor, kv_dtype: torch.dtype):
        """``[B, H, q, D]`` new K/V in the compute dtype -> (each inner store's ``kv_dtype`` coefficients, the
        reconstructed K and V in the compute dtype), as each row's store seals and reads them."""
        compute = keys.dtype
        # As a row's store holds a token before sealing it: in kv_dtype, handed back in the compute dtype.
        keys, values = keys.to(kv_dtype).to(compute).contiguous(), values.to(kv_dtype).to(compute).contiguous()
        coefficients = [(ck.to(kv_dtype), cv.to(kv_dtype)) for ck, cv in self.code.encode(keys, values)]
        keys, values = self.code.decode([(ck.to(compute), cv.to(compute)) for ck, cv in coefficients])
        return coefficients, keys, values

    @staticmethod
    def catch_up(rows, pending) -> None:
        """Every row's inner stores take its real tokens' coefficients of the ``pending`` steps
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
            row.took(positions[b][keep])
            row.store.mark_read()


class BufferedDecode:
    """Batched decode steps for one layer whose rows are all dense or all plain quantized stores (see module doc).

    Parameters
    ----------
    kv_dtype : torch.dtype
        The cache dtype the rows' stores hold.
    keys, values : _Residual or None
        The quantizers' residual windows (quantized rows), else ``None``.
    eviction : _BudgetEviction, _HeadBudgetEviction or None
        A decode budget (dense rows only), kept after each step's attention.
    accumulates : str or None
        ``"all"`` (H2O: attention summed over every query) or ``"last"`` (TOVA: the newest query's), when the
        selection scores with attention at every step; the buffer then holds it beside the tokens.
    coded : (CodedRows, CodedRows) or None
        Quantized rows held as codes instead (``codes=True`` in :meth:`for_rows`): the buffer releases its
        dequantized K/V, every step dequantizes the layer into a scratch shared by the layers (:meth:`read`), and
        the rows' stores hold views of these codes, so the cache is held once, as codes.
    """

    def __init__(self, kv_dtype: torch.dtype, keys: _Residual | None = None, values: _Residual | None = None,
                 eviction: "_BudgetEviction | _HeadBudgetEviction | None" = None, accumulates: str | None = None,
                 coded: "tuple[CodedRows, CodedRows] | None" = None, coefficients: _CoefficientSteps | None = None,
                 kvquant: _KVQuantResidual | None = None):
        self.kv_dtype = kv_dtype
        self.keys, self.values, self.eviction, self.accumulates = keys, values, eviction, accumulates
        self.kvquant = kvquant
        self.coded, self.coefficients = coded, coefficients
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (K, V, positions, real)

    @staticmethod
    def could_serve(store, selection, sliding_window: int | None = None) -> bool:
        """Whether rows holding stores like ``store`` under ``selection`` (in a sliding layer of ``sliding_window``
        positions, if given) may ever decode in batch: a cheap, static check; :meth:`for_rows` then checks every row.

        Dense or plain quantized stores, or per-head stores (AdaKV's budgets) of dense heads, which append every new
        token at one slot after the longest head, as dense rows do. Anything evicting while decoding (a decode
        budget, a sliding window) needs dense stores and, for a budget, scores that take a batch
        (:attr:`SelectionPolicy.batch_scores`)."""
        if type(store) is HeadwiseStore:
            return sliding_window is None and (selection is None or selection.decode_budget is None
                                               or _HeadBudgetEviction.serves(selection))
        if isinstance(store, (CoefficientStore, KVQuantStore)):
            return sliding_window is None and (selection is None or selection.decode_budget is None)
        if type(store) not in (DenseStore, QuantizedStore):
            return False
        if sliding_window is not None:
            return type(store) is DenseStore
        if selection is None or selection.decode_budget is None:
            return True
        return type(store) is DenseStore and _BudgetEviction.serves(selection)

    @classmethod
    def for_rows(cls, rows, kv_dtype: torch.dtype, selection=None, sliding_window: int | None = None,
                 layer_idx: int = 0, num_layers: int = 1, model=None, codes: bool = False,
                 seeds: "list[int] | None" = None) -> "BufferedDecode | None":
        """The batched decode of ``rows`` (:class:`~kveval.cache_layers.RowState`, all compressed), or ``None``
        where per-row work is needed (see :meth:`could_serve`; also quantized rows with evicted slots inside
        units, and sliding rows whose positions are not consecutive). ``codes``: quantized rows are held as codes
        and dequantized at every step (see the class doc) rather than kept dequantized in the buffer. ``seeds``:
        each row's seed, for scores drawn per row (``random``)."""
        stores = [row.store for row in rows]
        if not all(cls.could_serve(s, selection, sliding_window) for s in stores):
            return None
        accumulates = selection.attention if selection is not None and selection.attention in ("all", "last") else None
        if sliding_window is not None:
            if not all(row.positions.shape[1] == 0 or int(row.positions[0, -1] - row.positions[0, 0]) == row.positions.shape[1] - 1
                       for row in rows):
                return None
            return cls(kv_dtype, eviction=_BudgetEviction.of_window(sliding_window))
        context = _LayerScoring(layer_idx, num_layers, model,
                                torch.tensor(seeds, device=rows[0].positions.device) if seeds else 0)
        if selection is not None and selection.decode_budget is not None and selection.per_head_budgets:
            budgets = selection.head_decode_budgets(model, layer_idx, num_layers, rows[0].positions.shape[0])
            if ((budgets is None and not selection.chooses_in_batch)
                    or not all(type(s) is HeadwiseStore and _dense(s) for s in stores)):
                return None
            eviction = _HeadBudgetEviction(selection, budgets, context)
            return cls(kv_dtype, eviction=eviction, accumulates=accumulates)
        if selection is not None and selection.decode_budget is not None:
            eviction = _BudgetEviction(selection.decode_budget, selection.scores, context)
            return cls(kv_dtype, eviction=eviction, accumulates=accumulates)
        if all(_dense(s) for s in stores):
            return cls(kv_dtype, accumulates=accumulates)
        coefficients = _CoefficientSteps.of(stores)
        if coefficients is not None:
            return cls(kv_dtype, accumulates=accumulates, coefficients=coefficients)
        kvquant = _KVQuantResidual.of(stores)
        if kvquant is not None:
            return cls(kv_dtype, accumulates=accumulates, kvquant=kvquant)
        if all(type(s) is QuantizedStore and s.k.alive is None and s.k.tail_alive is None
               and s.v.alive is None and s.v.tail_alive is None for s in stores):
            if codes:
                coded = (CodedRows.from_sequences([s.k for s in stores]), CodedRows.from_sequences([s.v for s in stores]))
                return cls(kv_dtype, accumulates=accumulates, coded=coded)
            return cls(kv_dtype, _Residual.of([s.k for s in stores]), _Residual.of([s.v for s in stores]), accumulates=accumulates)
        return None

    def start(self, rows, buffer: BatchBuffer) -> None:
        """Load what the steps update beside the tokens into ``buffer``: the rows' accumulated attention. Held as
        codes, the buffer's K/V are released and the rows' stores point at the batch's codes."""
        if self.coded is not None:
            buffer.release_values()
            self._point_rows(rows)
        if self.accumulates is None:
            buffer.attention = None
            return
        dtype = next((row.attention.dtype for row in rows if row.attention is not None), torch.float32)
        buffer.attention = buffer.positions.new_zeros(buffer.positions.shape, dtype=dtype)
        for b, row in enumerate(rows):
            if row.attention is not None:
                buffer.attention[b, :, :row.attention.shape[1]] = row.attention

    def after_attention(self, buffer: BatchBuffer, mass: torch.Tensor | None) -> bool:
        """What a step does once attention has read the buffer: add (``"all"``) or set (``"last"``) the step's
        attention ``mass`` (``[B, H, width]``), then keep the decode budget. Whether any row dropped a token."""
        if self.accumulates == "all":
            buffer.attention[:, :, :buffer.width] += mass
        elif self.accumulates == "last":
            buffer.attention[:, :, :buffer.width] = mass
        return self.eviction is not None and self.eviction.apply(buffer)

    def append(self, buffer: BatchBuffer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               real: torch.Tensor, counts: list[int]) -> None:
        """One decode step: ``keys``/``values`` ``[B, H, q, D]`` in the compute dtype, ``positions``/``real`` ``[B, q]``."""
        if self.coefficients is not None:
            coefficients, keys, values = self.coefficients.step(keys, values, self.kv_dtype)
            self.pending.append((coefficients, positions, real))
            buffer.append(keys.to(buffer.keys.dtype), values.to(buffer.values.dtype), positions, real, counts)
            return
        keys, values = keys.to(self.kv_dtype), values.to(self.kv_dtype)
        if self.coded is not None:
            self.pending.append((None, None, positions, real))
            buffer.append(None, None, positions, real, counts)
            for side, x in zip(self.coded, (keys, values)):
                side.append(x, real, counts)
            return
        self.pending.append((keys, values, positions, real))
        buffer.append(keys.to(buffer.keys.dtype), values.to(buffer.values.dtype), positions, real, counts)
        for side, held in ((self.keys, buffer.keys), (self.values, buffer.values)):
            if side is not None:
                side.encode_aged(held, buffer.lengths, counts, self.kv_dtype)
        if self.kvquant is not None:
            self.kvquant.encode_aged(buffer, counts, self.kv_dtype)

    def read(self, dtype: torch.dtype, scratch: SharedScratch) -> tuple[torch.Tensor, torch.Tensor]:
        """Held as codes: the layer's K and V, ``[B, H, width, D]`` in ``dtype``, dequantized into ``scratch``
        (valid until another layer reads into it)."""
        keys, values = self.coded
        out = [scratch.get(name, side.batch, side.heads, side.width, side.dim, dtype, side.tail.device)
               for name, side in (("keys", keys), ("values", values))]
        return keys.read(dtype, out[0]), values.read(dtype, out[1])

    def takes(self, counts: list[int]) -> bool:
        """Whether a step appending ``counts`` new tokens per row can be done for the batch (low-rank and latent
        rows: one token per row at most, see :class:`_CoefficientSteps`)."""
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
                for b, row in enumerate(rows):
                    row.took(positions[b][real[b]])
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
        if self.eviction is not None:  # the buffer holds the rows as they stand: only the counts are needed
            counts = torch.cat([real for *_, real in self.pending], dim=1).sum(dim=1).tolist()
            self.pending = []
            for b, row in enumerate(rows):
                n = buffer.lengths[b]
                if type(row.store) is HeadwiseStore:  # each head its real (last) slots
                    heads = (buffer.positions[b, :, :n] != PAD_POSITION).sum(dim=1).tolist()
                    row.store.load(buffer.keys[b, :, :n], buffer.values[b, :, :n], heads)
                else:
                    row.store.load(buffer.keys[b, :, :n], buffer.values[b, :, :n])
                row.store.mark_read()
                row.positions = buffer.positions[b, :, :n].clone()
                row.tokens_seen += counts[b]
                self._catch_up_attention(row, buffer, b)
            return
        keys, values, positions, real = (torch.cat(parts, dim=-2 if i < 2 else 1) for i, parts in enumerate(zip(*self.pending)))
        self.pending = []
        for b, row in enumerate(rows):
            keep = real[b]
            if not bool(keep.any()):
                continue
            row.store.append(keys[b][:, keep], values[b][:, keep])
            row.took(positions[b][keep])
            row.seal()
            row.store.mark_read()
        for b, row in enumerate(rows):
            self._catch_up_attention(row, buffer, b)

    def _catch_up_attention(self, row, buffer: BatchBuffer, b: int) -> None:
        if self.accumulates is not None:
            row.attention = buffer.attention[b, :, :buffer.lengths[b]].clone()


__all__ = ["BufferedDecode", "CATCH_UP_STEPS"]
