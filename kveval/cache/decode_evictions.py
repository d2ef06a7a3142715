"""Decode budgets kept for a whole batch at once (:mod:`kveval.cache.buffered_decode`): one ranking, and gathers in place
in the layer's :class:`~kveval.tensors.batch_buffer.BatchBuffer`, as each row's layer would evict for itself.

- :class:`BudgetEviction`: one budget for every head (window, streaming, H2O, TOVA, knorm, random; a sliding layer);
- :class:`HeadBudgetEviction`: budgets per KV head, fixed (DuoAttention) or shared by score (AdaKV).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kveval.tensors.batch_buffer import PAD_POSITION, BatchBuffer, move_rows, slot_range, slot_rows, take_rows
from kveval.tensors.ranking import best_first, top_slots
from kveval.tensors.scoring_state import ScoringState


@dataclass(frozen=True)
class LayerScoring:
    """What a batched scoring gives a policy beside the buffer (:class:`~kveval.tensors.scoring_state.ScoringState`):
    the layer, the model, and each row's seed (the ``random`` control's), as the layer gives them for one row."""

    layer_idx: int = 0
    num_layers: int = 1
    model: object = None
    seeds: "tuple[int, ...] | int" = 0  # one per row, on the host (the random control hashes them once per layer)


def scored_slots(buffer: BatchBuffer, scores, context: LayerScoring,
                 tokens_first: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's ``scores`` of every slot of ``buffer`` (``[B, H, width]``, float32 or wider: ``-inf`` on padding,
    ``+inf`` on each row's newest slot, which is never evicted) and the padding mask, as the layer scores one row.

    ``tokens_first``: each row's tokens are its first ``lengths[b]`` slots in every head (not per-head stores). When
    every row then fills the width, there is no padding to mask (the mask returned is ``None``) and every row's
    newest slot is the last.
    """
    width = buffer.width
    attention = None if buffer.attention is None else buffer.attention[:, :, :width]
    return _scored(buffer.positions[:, :, :width], attention, buffer.keys[:, :, :width], buffer.lengths, scores,
                   context, tokens_first)


def _scored(positions: torch.Tensor, attention: torch.Tensor | None, keys: torch.Tensor | None, lengths: list[int],
            scores, context: LayerScoring, tokens_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`scored_slots` of rows given as tensors (``[rows, H, width]``; ``lengths``: each row's slots)."""
    width = positions.shape[2]
    full = tokens_first and all(n == width for n in lengths)
    padding = None if full else positions == PAD_POSITION
    state = ScoringState(keys=keys, positions=positions if full else positions.masked_fill(padding, -1),
                         attention=attention, layer_idx=context.layer_idx, num_layers=context.num_layers,
                         seed=context.seeds, model=context.model)
    scored = _float_scores(scores(state))
    if full:
        return _newest_kept(scored), None
    scored = scored.masked_fill(padding, float("-inf"))
    newest = torch.tensor(lengths, device=scored.device)[:, None, None] - 1
    scored.scatter_(2, newest.clamp(min=0).expand(-1, scored.shape[1], 1), float("inf"))
    return scored, padding


def _float_scores(scored: torch.Tensor) -> torch.Tensor:
    """A policy's scores as float32 or wider (what the rankings compare)."""
    if scored.dtype not in (torch.float32, torch.float64):
        scored = scored.to(torch.promote_types(scored.dtype, torch.float32))
    return scored


def _newest_kept(scored: torch.Tensor) -> torch.Tensor:
    """``scored`` (``[..., width]``, every row full) with its last slot, each row's newest, scored ``+inf``: out of
    place, as a policy may hand back the buffer's own attention (TOVA)."""
    return scored.index_fill(-1, slot_range(scored.shape[-1], scored.device)[-1:], float("inf"))


def single_drops(scores: torch.Tensor, decisive: torch.Tensor | None = None) -> torch.Tensor | None:
    """The slot of each row's and head's lowest score (``[B, H]``) where keeping all but one leaves out just that
    slot whatever the order of equal scores: wherever the lowest score is unique (``decisive``, ``[B, 1]``: the
    rows where it must be; all if ``None``). ``None`` when a tie (or a NaN) leaves it to the ranking
    (:func:`~kveval.tensors.ranking.top_slots`)."""
    lowest, drop = scores.min(dim=2)  # [B, H]
    unclear = (scores == lowest[..., None]).sum(dim=2) != 1
    if decisive is not None:
        unclear &= decisive
    return None if bool(unclear.any()) else drop


def kept_slots(scores: torch.Tensor, budget: int, lengths: list[int]) -> tuple[torch.Tensor, int]:
    """The ``[B, H, budget]`` slots each row keeps of ``scores`` (:func:`scored_slots`, newest marked), ascending:
    its ``budget`` best-scored, as one row's eviction ranks them (``choose(..., stable=True)``: equal scores in slot
    order, padding last); and the first slot any row drops (0 if unknown).

    A decode step over budget appends one token per row, so rows hold ``budget + 1`` slots and each drops one:
    its lowest score (:func:`single_drops`), one ``min`` rather than a ranking and a ``sort``. Rows holding fewer
    slots drop a padding slot (``-inf``); which one does not matter, as every padding slot is invisible.
    """
    keep, drop = _kept_and_drops(scores, budget, lengths)
    return keep, 0 if drop is None else int(drop.min())


def _kept_and_drops(scores: torch.Tensor, budget: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kept_slots`' ``[B, H, budget]`` kept slots, and the ``[B, H]`` slot each row and head drops where
    each drops one (:func:`single_drops`), else ``None`` (ranked)."""
    if scores.shape[2] == budget + 1:
        full = None if all(n == budget + 1 for n in lengths) else \
            torch.tensor([n == budget + 1 for n in lengths], device=scores.device)[:, None]
        drop = single_drops(scores, full)
        if drop is not None:
            return _skipping(drop, budget), drop
    return top_slots(scores, budget, dim=2), None


def _skipping(drop: torch.Tensor, budget: int) -> torch.Tensor:
    """``[B, H, budget]``: the slots ``0 .. budget`` less each row's and head's ``drop``."""
    slots = slot_range(budget, drop.device)
    return slots + (slots >= drop[..., None])


class BudgetEviction:
    """A decode budget kept for the whole batch at once.

    After each step's attention, every row the step gave a token that holds more than ``budget`` keeps its
    ``budget`` best-scored, its newest always (a row given nothing keeps its cache: :func:`spared_rows`), exactly
    as the layer would for each row by itself
    (:meth:`kveval.cache.layers.CompressedLayer._evict_to`: the policy's scores, the best ranked, kept in order; one
    ``min`` when each row drops one token, :func:`kept_slots`). The buffer's K, V, positions and accumulated
    attention are compacted in place by one gather per tensor (:func:`~kveval.tensors.batch_buffer.take_slots` for K and
    V), of the slots from the first one any row dropped: H2O, whose recent tokens are never dropped, mostly drops
    late slots (in SmolLM2 at batch 8, the first dropped slot was at 80% of the budget in the median step). Scores
    that do not stack across layers (the random control's, key norms: they drop anywhere) are ranked by one stable
    sort and compacted from slot 0, with no device read (:func:`_ranked_kept`); a sliding window keeps each row's
    newest tokens, known from the lengths (:func:`_window_kept`).

    Two sources:

    - a selection's ``decode_budget`` whose :meth:`scores` take a batch (``batch_scores``: window, streaming, H2O,
      TOVA, knorm), scored on the buffer's views (positions, the attention it accumulated, keys);
    - a sliding-window layer of ``window`` positions, which keeps what its next query can see: the ``window - 1``
      newest tokens, by position (:meth:`~kveval.cache.layers.CompressedLayer._trim_to_window`, while every row
      holds consecutive positions, which :meth:`BufferedDecode.for_rows` checks).
    """

    def __init__(self, budget: int, scores, context: LayerScoring = LayerScoring(), stacks: bool = False,
                 trims_window: bool = False):
        self.budget, self.scores, self.context = budget, scores, context
        self.stacks = stacks  # the scores read positions and attention alone (SelectionPolicy.scores_stack_layers)
        self.trims_window = trims_window  # a sliding layer's window over consecutive positions (of_window)

    def defers(self, buffer: BatchBuffer) -> bool:
        """Whether this step's eviction may wait for the forward's other layers' (:class:`DeferredEvictions`): the
        scores stack across layers, and some row holds more than the budget (the eviction drops a token)."""
        return self.stacks and self._drops(buffer)

    def _drops(self, buffer: BatchBuffer) -> bool:
        """Whether the step drops a token: some row it gave one holds more than the budget (a row given nothing
        keeps its cache, :func:`spared_rows`)."""
        return buffer.width > self.budget and any(evicting_rows(buffer, self.budget))

    @staticmethod
    def serves(selection) -> bool:
        """Whether ``selection``'s decode budget can be kept for a batch (one budget for every head, batch scores,
        evicted at every step over it: a ``decode_interval`` above 1 decodes row by row)."""
        return (selection.decode_budget is not None and selection.batch_scores and not selection.per_head_budgets
                and selection.attention in ("none", "all", "last") and selection.decode_interval == 1)

    def stacks_with(self, other: "BudgetEviction", held: BatchBuffer, buffer: BatchBuffer) -> bool:
        """Whether ``other``'s pending eviction (of ``buffer``; this one's of ``held``, of the same rows and heads) is
        kept in one stack with this one's: the same budget and scores, buffers of the same width."""
        return self.budget == other.budget and self.scores == other.scores and held.width == buffer.width

    @staticmethod
    def apply_stacked(chunk: "list[tuple[BudgetEviction, BatchBuffer]]") -> None:
        """Keep the pending evictions of ``chunk`` (layers that :meth:`stacks_with` one another) as one stack."""
        _apply_stacked(chunk)

    @classmethod
    def of_window(cls, window: int) -> "BudgetEviction":
        """A sliding layer's window: the ``window - 1`` newest positions, known from the rows' lengths with no
        scores (:func:`_window_kept`)."""
        return cls(window - 1, None, trims_window=True)

    def apply(self, buffer: BatchBuffer) -> bool:
        """Keep the budget in every row the step gave a token; whether any row dropped one."""
        if not self._drops(buffer):
            return False
        spared = spared_rows(buffer, self.budget)
        if self.trims_window:
            shifts = tuple(max(0, n - self.budget) for n in buffer.lengths)
            _compact(buffer, _window_kept(shifts, buffer.positions.shape[1], self.budget, buffer.positions.device),
                     0, self.budget, spared=spared)
            return True
        scores, _ = scored_slots(buffer, self.scores, self.context, tokens_first=True)
        if not self.stacks:  # scores per layer (random, key norms): rank without reading the device
            _compact(buffer, _ranked_kept(scores, self.budget), 0, self.budget, spared=spared)
            return True
        keep, first = kept_slots(scores, self.budget, buffer.lengths)
        _compact(buffer, keep[:, :, first:], first, self.budget, spared=spared)
        return True


def _ranked_kept(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """:func:`kept_slots`' kept slots, with no device read: where each row drops one slot (``budget + 1`` slots),
    every slot but the one ranked last by :func:`~kveval.tensors.ranking.best_first` (one stable sort: equal scores
    in slot order, NaN first, so the ranking's own choice); else the ranking. :func:`kept_slots` reads whether a
    ``min`` is unique and the first slot any row drops, two waits that spare a GPU's sort and the copy of the slots
    before that one; for scores made per layer (the random control's, key norms), which drop anywhere, the
    slots before are few, and the waits, per layer and step, cost more."""
    if scores.shape[2] == budget + 1:
        return _skipping(best_first(scores, dim=2).select(2, -1), budget)
    return top_slots(scores, budget, dim=2)


@functools.lru_cache(maxsize=64)
def _window_kept(shifts: tuple[int, ...], heads: int, budget: int, device) -> torch.Tensor:
    """``[B, heads, budget]``: the slots a sliding window keeps of rows holding tokens at consecutive positions in
    slot order (what :meth:`BufferedDecode.for_rows` checks and the window keeps so), row ``b`` holding
    ``shifts[b] + budget`` of them: its newest ``budget``, its last slots, exactly as the ranking by position keeps
    them (a row holding no more than the budget, shift 0, keeps its first ``budget`` slots, its tokens and
    padding). Known on the host from the rows' lengths alone, so the step reads nothing from the device (scoring
    and ranking took about 12 operations and two waits per layer) and makes nothing new once the shifts repeat."""
    return (torch.tensor(shifts, device=device)[:, None, None] + slot_range(budget, device)).expand(-1, heads, -1)


def evicting_rows(buffer: BatchBuffer, budget: int) -> list[bool]:
    """Per row of ``buffer``, whether the step evicts from it: it holds more than ``budget`` slots and the step
    gave it a token (every row, before any append). A row given nothing keeps its cache (:func:`spared_rows`)."""
    given = buffer.given or (1,) * len(buffer.lengths)
    return [n > budget and c > 0 for n, c in zip(buffer.lengths, given)]


def spared_rows(buffer: BatchBuffer, budget: int) -> tuple[bool, ...] | None:
    """Per row of ``buffer``, whether the step gave it no token while it holds more than ``budget`` slots; ``None``
    where no row is so (the usual step: every row is kept to the budget).

    A decode budget evicts only from the rows a step gave a token. A row the step gave nothing (its sequence ended)
    keeps its cache, as it would alone, where no step follows: a query-aware prefill keeps the question beyond
    the budget (selection does not touch it), and a row whose first token is EOS never drops that excess.
    Rows the step gave nothing that hold no more than the budget are left as they are by the eviction itself."""
    given = buffer.given
    if given is None:
        return None
    spared = tuple(c == 0 and n > budget for c, n in zip(given, buffer.lengths))
    return spared if any(spared) else None


def _compact(buffer: BatchBuffer, keep: torch.Tensor, first: int, budget: int,
             kept_positions: torch.Tensor | None = None, kept_attention: torch.Tensor | None = None,
             spared: tuple[bool, ...] | None = None) -> None:
    """Every row of ``buffer`` keeps slots ``keep`` (``[B, H, budget - first]``, ascending) in its slots ``first`` to
    ``budget``: slots before ``first`` stay where they are. ``kept_positions``/``kept_attention``: the positions and
    attention of those slots, where the caller gathered them already. ``spared`` (:func:`spared_rows`): rows that
    keep every slot, past the budget too."""
    width = buffer.width
    if spared is not None:  # their slots stay where they are: kept in place (a rare step: rows that ended early)
        own = torch.tensor(spared, device=keep.device)[:, None, None]
        keep = torch.where(own, slot_range(budget, keep.device)[first:], keep)
        kept_positions = kept_attention = None
    rows = slot_rows(buffer.keys, keep)  # K and V: the same slots
    for held in (buffer.keys, buffer.values):
        held[:, :, first:budget] = take_rows(held, rows, keep.shape)
    for held, kept, fill in ((buffer.positions, kept_positions, PAD_POSITION), (buffer.attention, kept_attention, 0)):
        if held is not None:
            held[:, :, first:budget] = held[:, :, :width].gather(2, keep) if kept is None else kept
            if spared is None:
                held[:, :, budget:width] = fill
            else:
                for b in (b for b, keeps_all in enumerate(spared) if not keeps_all):
                    held[b, :, budget:width] = fill
    buffer.lengths = [min(n, budget) if spared is None or not spared[b] else n for b, n in enumerate(buffer.lengths)]
    buffer.width = max(buffer.lengths)
    buffer.fit()


#: Most slots (layers x rows x heads x slots) whose positions and attention one stacked eviction copies at once.
STACKED_SLOTS = 2**20


class DeferredEvictions:
    """The decode budgets of one forward's layers, kept together once its last attention layer has run.

    A layer's eviction reads and writes that layer's buffer alone, and nothing reads the buffer between the layer's
    attention and its next step, so it may wait for the layers after it (:meth:`BudgetEviction.defers`). Layers
    whose budgets ask the same (one budget, scores that read positions and attention alone:
    :attr:`BudgetEviction.stacks`) and whose buffers hold the same width are then scored and ranked together, on
    their positions and attention stacked into one ``[layers * B, H, width]`` tensor: the same elementwise scores,
    the same padding and newest-slot marks, the same ranking per row (rows of finished sequences, under the budget,
    drop a padding slot), so each layer keeps exactly the slots it would keep alone, in one set of operations per
    forward rather than one per layer; each layer's K and V are then gathered as :meth:`BudgetEviction.apply`
    gathers them. AdaKV's budget shared by a row's heads (:class:`HeadBudgetEviction`, H2O's scores) stacks
    likewise, layers of any width (each padded to the widest, as a shorter row is): its scores, its choice and the
    plan of each head's new slots are made once per forward, and each layer's K and V moved as it would move them.
    A decode step of a small model at batch 8 otherwise spends as long on its budgets' 20 to 100 small operations
    per layer as on the layer's own attention. At most :data:`STACKED_SLOTS` slots are stacked at once.

    Whatever reads a waiting layer first ends the wait: the forward's last attention layer
    (:meth:`kveval.cache.layers.CompressedLayer.after_attention`), else the layer's next update or any read of its
    rows (bytes, kept tokens, a catch-up).
    """

    def __init__(self):
        self.pending: list[tuple["BudgetEviction | HeadBudgetEviction", BatchBuffer]] = []

    def add(self, eviction: "BudgetEviction | HeadBudgetEviction", buffer: BatchBuffer) -> None:
        self.pending.append((eviction, buffer))

    def holds(self, buffer: BatchBuffer | None) -> bool:
        return any(held is buffer for _, held in self.pending)

    def flush(self) -> None:
        """Keep every pending budget (each row a layer's step gave a token then holds at most its budget)."""
        pending, self.pending = self.pending, []
        groups: list[list[tuple["BudgetEviction | HeadBudgetEviction", BatchBuffer]]] = []
        for eviction, buffer in pending:
            like = next((g for g in groups if _stack_together(g[0], (eviction, buffer))), None)
            if like is None:
                groups.append([(eviction, buffer)])
            else:
                like.append((eviction, buffer))
        for group in groups:
            per_layer = group[0][1].positions[:, :, :group[0][1].width].numel()
            step = max(1, STACKED_SLOTS // per_layer)
            for start in range(0, len(group), step):
                chunk = group[start:start + step]
                if len(chunk) == 1:
                    chunk[0][0].apply(chunk[0][1])
                else:
                    chunk[0][0].apply_stacked(chunk)


def _stack_together(a: tuple["BudgetEviction | HeadBudgetEviction", BatchBuffer],
                    b: tuple["BudgetEviction | HeadBudgetEviction", BatchBuffer]) -> bool:
    """Whether two layers' pending evictions are kept in one stack: the same kind and budget, buffers of the same
    rows and heads on one device (and, one budget for every head, of the same width)."""
    (first, held), (other, buffer) = a, b
    if type(first) is not type(other) or not (held.positions.shape[:2] == buffer.positions.shape[:2]
                                              and held.positions.device == buffer.positions.device
                                              and (held.attention is None) == (buffer.attention is None)):
        return False
    return first.stacks_with(other, held, buffer)


def _stacked(buffers: list[BatchBuffer], width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The buffers' positions and attention (if held) stacked as ``[layers, B, H, width]``: one ``stack`` where every
    buffer holds ``width`` slots, else each narrower layer's slots past its own width are padding (no attention)."""
    if all(buffer.width == width for buffer in buffers):
        return (torch.stack([buffer.positions[:, :, :width] for buffer in buffers]),
                None if buffers[0].attention is None else torch.stack([buffer.attention[:, :, :width] for buffer in buffers]))
    layers, (batch, heads) = len(buffers), buffers[0].positions.shape[:2]
    positions = buffers[0].positions.new_full((layers, batch, heads, width), PAD_POSITION)
    attention = None if buffers[0].attention is None else buffers[0].attention.new_zeros(positions.shape)
    for layer, buffer in enumerate(buffers):
        positions[layer, :, :, :buffer.width] = buffer.positions[:, :, :buffer.width]
        if attention is not None:
            attention[layer, :, :, :buffer.width] = buffer.attention[:, :, :buffer.width]
    return positions, attention


def _apply_stacked(chunk: list[tuple[BudgetEviction, BatchBuffer]]) -> None:
    """:meth:`BudgetEviction.apply` for layers of one budget whose buffers hold the same width (see
    :class:`DeferredEvictions`), scored and ranked at once."""
    eviction, budget = chunk[0][0], chunk[0][0].budget
    buffers = [buffer for _, buffer in chunk]
    width = buffers[0].width
    positions, attention = _stacked(buffers, width)  # [L, B, H, width]
    layers, batch, heads = positions.shape[:3]
    lengths = [n for buffer in buffers for n in buffer.lengths]
    flat = (layers * batch, heads, width)
    scores, _ = _scored(positions.view(flat), None if attention is None else attention.view(flat), None, lengths,
                        eviction.scores, eviction.context, tokens_first=True)
    keep, drop = _kept_and_drops(scores, budget, lengths)
    keep = keep.view(layers, batch, heads, budget)
    # Each layer compacts from the first slot any of its rows drops, as it would alone (kept_slots).
    firsts = [0] * layers if drop is None else drop.view(layers, -1).amin(dim=1).tolist()
    kept_positions = positions.gather(3, keep)
    kept_attention = None if attention is None else attention.gather(3, keep)
    for layer, (buffer, first) in enumerate(zip(buffers, firsts)):
        _compact(buffer, keep[layer, :, :, first:], first, budget, kept_positions[layer, :, :, first:],
                 None if kept_attention is None else kept_attention[layer, :, :, first:], spared_rows(buffer, budget))


class HeadBudgetEviction:
    """A decode budget per KV head, kept for the whole batch at once. Two kinds:

    - fixed per head (``budgets``; DuoAttention: retrieval heads keep every token, streaming heads
      ``sink + window``): each head keeps its best-scored tokens up to its budget (one ranking,
      :func:`~kveval.tensors.ranking.best_first`);
    - chosen by score across the heads of a row (``budgets=None``; AdaKV's ``decode_budget x heads`` shared
      by the heads): the policy's :meth:`~kveval.policies.base.SelectionPolicy.choose_batch`.

    Rows hold per-head stores (:class:`~kveval.stores.headwise.HeadwiseStore`): in the buffer, each head's tokens end
    at its row's last slot, padding (an invisible position) before them. After each step's attention every row
    the step gave a token that holds more than ``decode_budget`` slots keeps what
    :meth:`kveval.cache.layers.CompressedLayer._evict_to` and
    the policy's ``choose`` would keep for it (its newest token always); each head's kept tokens, in slot order,
    are lined up at its row's new last slot (their ranks by a ``cumsum``, placed by one ``scatter``): one gather
    per tensor moves positions and attention, and K and V are moved only where a token changes slot
    (:func:`~kveval.tensors.batch_buffer.move_rows`), not copied whole.
    """

    def __init__(self, selection, budgets: list[int | None] | None, context: LayerScoring):
        self.selection, self.decode_budget, self.context = selection, selection.decode_budget, context
        self.budgets = budgets  # per head (None: every token); None: chosen by score (AdaKV)
        # AdaKV's choice over scores that read positions and attention alone may wait for the forward's other layers
        # (DeferredEvictions); fixed per-head budgets differ from layer to layer (DuoAttention's retrieval heads).
        self.stacks = budgets is None and selection.scores_stack_layers

    @staticmethod
    def serves(selection) -> bool:
        return (selection.decode_budget is not None and selection.per_head_budgets and selection.batch_scores
                and selection.decode_interval == 1)

    def defers(self, buffer: BatchBuffer) -> bool:
        """Whether this step's eviction may wait for the forward's other layers' (:class:`DeferredEvictions`): a
        budget shared by the heads by scores that read positions and attention alone, and some row over it."""
        return self.stacks and any(evicting_rows(buffer, self.decode_budget))

    trims_window = False  # never a sliding layer's window (BudgetEviction.trims_window)

    def stacks_with(self, other: "HeadBudgetEviction", held: BatchBuffer | None = None,
                    buffer: BatchBuffer | None = None) -> bool:
        """Whether ``other``'s pending eviction is kept in one stack with this one's: both choose by scores that
        stack, for one selection (the buffers, of the same rows and heads, may differ in width)."""
        return self.stacks and other.stacks and self.selection == other.selection

    @staticmethod
    def apply_stacked(chunk: "list[tuple[HeadBudgetEviction, BatchBuffer]]") -> None:
        """Keep the pending evictions of ``chunk`` (layers that :meth:`stacks_with` one another) as one stack."""
        _apply_stacked_heads(chunk)

    def _kept(self, scores: torch.Tensor, padding: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, H, width]``: the slots an over-budget row keeps."""
        if self.budgets is None:
            return self.selection.choose_batch(scores, self.decode_budget)
        budgets = torch.tensor([width if b is None else b for b in self.budgets], device=scores.device)[None, :, None]
        # The slot ranked r in its head (best_first) is kept where r is under the head's budget: one sort.
        within = (slot_range(width, scores.device) < budgets).expand(*scores.shape)
        return ~padding & torch.zeros_like(padding).scatter_(2, best_first(scores, 2), within)

    def apply(self, buffer: BatchBuffer) -> bool:
        """Keep every head's budget in every row; whether any row was over the decode budget (it then evicted)."""
        over = evicting_rows(buffer, self.decode_budget)
        if not any(over):
            return False
        scores, padding = scored_slots(buffer, self.selection.scores, self.context)
        plan = self._plan(scores, padding, buffer.lengths, over)
        if plan is None:  # nothing dropped (retrieval heads keep every token): the layout stands
            return False
        _line_up(buffer, *plan)
        return True

    def _plan(self, scores: torch.Tensor, padding: torch.Tensor, lengths: list[int], over: list[bool]):
        """Where each row's kept tokens go (``[rows, H, width]`` scores and padding; ``lengths``: each row's slots;
        ``over``: the rows that evict, :func:`evicting_rows`):
        ``(index, padded, new_lengths)``, ``index``/``padded`` ``[rows, H, new width]`` (the slot each new slot
        takes, and the new slots that are padding); ``None`` where no row drops a token. Each row's plan is its
        own whatever the rows beside it (rows of other layers, padded to another width)."""
        device, width = scores.device, scores.shape[2]
        over = torch.tensor(over, device=device)[:, None, None]
        kept = self._kept(scores, padding, width) | (~padding & ~over)  # rows that do not evict keep everything
        if bool((kept == ~padding).all()):
            return None
        counts = kept.sum(dim=2)  # [rows, H]
        new_lengths = counts.max(dim=1).values.tolist()
        new_width = max(new_lengths)
        # Each head's kept tokens, in slot order, end at its row's new last slot: a kept slot goes to its rank among
        # them from there; a dropped one to a spare column past new_width. Padding slots read slot 0.
        ends = torch.tensor(new_lengths, device=device)[:, None, None]  # [rows, 1, 1]
        target = (kept.cumsum(dim=2) + (ends - 1 - counts[..., None])).masked_fill_(~kept, new_width)
        slots = slot_range(width, device).expand(*kept.shape)
        index = kept.new_zeros(*kept.shape[:2], new_width + 1, dtype=torch.long).scatter_(2, target, slots)[..., :new_width]
        column = slot_range(new_width, device)
        padded = (column < ends - counts[..., None]) | (column >= ends)  # [rows, H, new_width]
        return index, padded, new_lengths


def _line_up(buffer: BatchBuffer, index: torch.Tensor, padded: torch.Tensor, new_lengths: list[int],
             kept_positions: torch.Tensor | None = None, kept_attention: torch.Tensor | None = None) -> None:
    """Move ``buffer``'s slots as :meth:`HeadBudgetEviction._plan` planned (``index``/``padded`` may be wider than
    the buffer's new width: their first columns serve). ``kept_positions``/``kept_attention``: the planned
    positions and attention, padding filled, where the caller gathered them already."""
    width, new_width = buffer.width, max(new_lengths)
    index, padded = index[..., :new_width], padded[..., :new_width]
    column = slot_range(new_width, index.device)
    # K and V move only where a kept token changes slot (in a step that drops one token per row, the tokens of one
    # head before the dropped one, not the whole cache), and every padding slot is zeroed: the rows of the flat
    # [B * H * slots, D] views (a few rows, about 3x faster on a CPU than a mask broadcast over D).
    sources, targets = slot_rows(buffer.keys, index), slot_rows(buffer.keys, column.expand_as(index))
    moved = ((index != column) & ~padded).view(-1).nonzero().squeeze(1)
    move_rows((buffer.keys, buffer.values), sources[moved], targets[moved], targets[padded.reshape(-1)])
    for held, kept, fill in ((buffer.positions, kept_positions, PAD_POSITION), (buffer.attention, kept_attention, 0)):
        if held is not None:
            held[:, :, :new_width] = (held[:, :, :width].gather(2, index).masked_fill_(padded, fill) if kept is None
                                      else kept[..., :new_width])
            held[:, :, new_width:width] = fill
    buffer.lengths, buffer.width = new_lengths, new_width
    buffer.fit()


def _apply_stacked_heads(chunk: list[tuple[HeadBudgetEviction, BatchBuffer]]) -> None:
    """:meth:`HeadBudgetEviction.apply` for layers of one AdaKV budget (see :class:`DeferredEvictions`): scored,
    chosen and planned at once, on their positions and attention stacked into ``[layers * B, H, width]``, the
    widest layer's width (a narrower layer's extra slots are padding, as a shorter row's are); each layer's K and
    V are then moved, and its positions and attention written, as it would alone."""
    eviction = chunk[0][0]
    buffers = [buffer for _, buffer in chunk]
    width = max(buffer.width for buffer in buffers)
    positions, attention = _stacked(buffers, width)  # [L, B, H, width]
    layers, batch, heads = positions.shape[:3]
    lengths = [n for buffer in buffers for n in buffer.lengths]
    flat = (layers * batch, heads, width)
    positions = positions.view(flat)
    attention = None if attention is None else attention.view(flat)
    scores, padding = _scored(positions, attention, None, lengths, eviction.selection.scores, eviction.context,
                              tokens_first=False)
    over = [o for buffer in buffers for o in evicting_rows(buffer, eviction.decode_budget)]
    plan = eviction._plan(scores, padding, lengths, over)
    if plan is None:
        return
    index, padded, new_lengths = plan
    kept_positions = positions.gather(2, index).masked_fill_(padded, PAD_POSITION).view(layers, batch, heads, -1)
    kept_attention = (None if attention is None
                      else attention.gather(2, index).masked_fill_(padded, 0).view(layers, batch, heads, -1))
    index, padded = index.view(layers, batch, heads, -1), padded.view(layers, batch, heads, -1)
    for layer, buffer in enumerate(buffers):
        _line_up(buffer, index[layer], padded[layer], new_lengths[layer * batch:(layer + 1) * batch],
                 kept_positions[layer], None if kept_attention is None else kept_attention[layer])


__all__ = ["BudgetEviction", "DeferredEvictions", "HeadBudgetEviction", "LayerScoring", "kept_slots", "scored_slots",
           "evicting_rows", "single_drops", "spared_rows"]
