"""Decode budgets kept for a whole batch at once (:mod:`kveval.buffered_decode`): one ranking, and gathers in place
in the layer's :class:`~kveval.batch_buffer.BatchBuffer`, as each row's layer would evict for itself.

- :class:`BudgetEviction`: one budget for every head (window, streaming, H2O, TOVA, knorm, random; a sliding layer);
- :class:`HeadBudgetEviction`: budgets per KV head, fixed (DuoAttention) or shared by score (AdaKV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.batch_buffer import PAD_POSITION, BatchBuffer, move_rows, slot_range, slot_rows, take_rows
from kveval.policies import ScoringState
from kveval.policies.base import best_first, top_slots


@dataclass(frozen=True)
class LayerScoring:
    """What a batched scoring gives a policy beside the buffer (:class:`~kveval.policies.base.ScoringState`):
    the layer, the model, and each row's seed (the ``random`` control's), as the layer gives them for one row."""

    layer_idx: int = 0
    num_layers: int = 1
    model: object = None
    seeds: "torch.Tensor | int" = 0  # [B] on the rows' device, made once per refresh


def scored_slots(buffer: BatchBuffer, scores, context: LayerScoring,
                 tokens_first: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's ``scores`` of every slot of ``buffer`` (``[B, H, width]``, float32 or wider: ``-inf`` on padding,
    ``+inf`` on each row's newest slot, which is never evicted) and the padding mask, as the layer scores one row.

    ``tokens_first``: each row's tokens are its first ``lengths[b]`` slots in every head (not per-head stores). When
    every row then fills the width, there is no padding to mask (the mask returned is ``None``) and every row's
    newest slot is the last.
    """
    width = buffer.width
    positions = buffer.positions[:, :, :width]
    full = tokens_first and all(n == width for n in buffer.lengths)
    padding = None if full else positions == PAD_POSITION
    attention = None if buffer.attention is None else buffer.attention[:, :, :width]
    state = ScoringState(keys=buffer.keys[:, :, :width], positions=positions if full else positions.masked_fill(padding, -1),
                         attention=attention, layer_idx=context.layer_idx, num_layers=context.num_layers,
                         seed=context.seeds, model=context.model)
    scored = scores(state)
    if scored.dtype not in (torch.float32, torch.float64):
        scored = scored.to(torch.promote_types(scored.dtype, torch.float32))
    if full:  # out of place: a policy may hand back the buffer's own attention (TOVA)
        return scored.index_fill(2, slot_range(width, scored.device)[-1:], float("inf")), None
    scored = scored.masked_fill(padding, float("-inf"))
    newest = torch.tensor(buffer.lengths, device=scored.device)[:, None, None] - 1
    scored.scatter_(2, newest.clamp(min=0).expand(-1, scored.shape[1], 1), float("inf"))
    return scored, padding


def single_drops(scores: torch.Tensor, decisive: torch.Tensor | None = None) -> torch.Tensor | None:
    """The slot of each row's and head's lowest score (``[B, H]``) where keeping all but one leaves out just that
    slot whatever the order of equal scores: wherever the lowest score is unique (``decisive``, ``[B, 1]``: the
    rows where it must be; all if ``None``). ``None`` when a tie (or a NaN) leaves it to the ranking
    (:func:`~kveval.policies.base.top_slots`)."""
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
    if scores.shape[2] == budget + 1:
        full = None if all(n == budget + 1 for n in lengths) else \
            torch.tensor([n == budget + 1 for n in lengths], device=scores.device)[:, None]
        drop = single_drops(scores, full)
        if drop is not None:
            return _skipping(drop, budget), int(drop.min())
    return top_slots(scores, budget, dim=2), 0


def _skipping(drop: torch.Tensor, budget: int) -> torch.Tensor:
    """``[B, H, budget]``: the slots ``0 .. budget`` less each row's and head's ``drop``."""
    slots = slot_range(budget, drop.device)
    return slots + (slots >= drop[..., None])


class BudgetEviction:
    """A decode budget kept for the whole batch at once.

    After each step's attention, every row holding more than ``budget`` tokens keeps its ``budget`` best-scored,
    its newest always, exactly as the layer would for each row by itself
    (:meth:`kveval.cache_layers.CompressedLayer._evict_to`: the policy's scores, the best ranked, kept in order; one
    ``min`` when each row drops one token, :func:`kept_slots`). The buffer's K, V, positions and accumulated
    attention are compacted in place by one gather per tensor (:func:`~kveval.batch_buffer.take_slots` for K and
    V), of the slots from the first one any row dropped: H2O, whose recent tokens are never dropped, mostly drops
    late slots (in SmolLM2 at batch 8, the first dropped slot was at 80% of the budget in the median step).

    Two sources:

    - a selection's ``decode_budget`` whose :meth:`scores` take a batch (``batch_scores``: window, streaming, H2O,
      TOVA, knorm), scored on the buffer's views (positions, the attention it accumulated, keys);
    - a sliding-window layer of ``window`` positions, which keeps what its next query can see: the ``window - 1``
      newest tokens, by position (:meth:`~kveval.cache_layers.CompressedLayer._trim_to_window`, while every row
      holds consecutive positions, which :meth:`BufferedDecode.for_rows` checks).
    """

    def __init__(self, budget: int, scores, context: LayerScoring = LayerScoring()):
        self.budget, self.scores, self.context = budget, scores, context

    @staticmethod
    def serves(selection) -> bool:
        """Whether ``selection``'s decode budget can be kept for a batch (one budget for every head, batch scores)."""
        return (selection.decode_budget is not None and selection.batch_scores and not selection.per_head_budgets
                and selection.attention in ("none", "all", "last"))

    @classmethod
    def of_window(cls, window: int) -> "BudgetEviction":
        return cls(window - 1, lambda state: state.positions.float())

    def apply(self, buffer: BatchBuffer) -> bool:
        """Keep the budget in every row; whether any row dropped a token."""
        width = buffer.width
        if width <= self.budget:
            return False
        scores, _ = scored_slots(buffer, self.scores, self.context, tokens_first=True)
        keep, first = kept_slots(scores, self.budget, buffer.lengths)
        keep = keep[:, :, first:]  # slots before the first dropped one stay where they are
        rows = slot_rows(buffer.keys, keep)  # K and V: the same slots
        for held in (buffer.keys, buffer.values):
            held[:, :, first:self.budget] = take_rows(held, rows, keep.shape)
        for held, fill in ((buffer.positions, PAD_POSITION), (buffer.attention, 0)):
            if held is not None:
                held[:, :, first:self.budget] = held[:, :, :width].gather(2, keep)
                held[:, :, self.budget:width] = fill
        buffer.lengths = [min(n, self.budget) for n in buffer.lengths]
        buffer.width = max(buffer.lengths)
        buffer.fit()
        return True


class HeadBudgetEviction:
    """A decode budget per KV head, kept for the whole batch at once. Two kinds:

    - fixed per head (``budgets``; DuoAttention: retrieval heads keep every token, streaming heads
      ``sink + window``): each head keeps its best-scored tokens up to its budget (one ranking,
      :func:`~kveval.policies.base.best_first`);
    - chosen by score across the heads of a row (``budgets=None``; AdaKV's ``decode_budget x heads`` shared
      by the heads): the policy's :meth:`~kveval.policies.base.SelectionPolicy.choose_batch`.

    Rows hold per-head stores (:class:`~kveval.head_stores.HeadwiseStore`): in the buffer, each head's tokens end
    at its row's last slot, padding (an invisible position) before them. After each step's attention every row
    holding more than ``decode_budget`` slots keeps what :meth:`kveval.cache_layers.CompressedLayer._evict_to` and
    the policy's ``choose`` would keep for it (its newest token always); each head's kept tokens, in slot order,
    are lined up at its row's new last slot (their ranks by a ``cumsum``, placed by one ``scatter``): one gather
    per tensor moves positions and attention, and K and V are moved only where a token changes slot
    (:func:`~kveval.batch_buffer.move_rows`), not copied whole.
    """

    def __init__(self, selection, budgets: list[int | None] | None, context: LayerScoring):
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
        # The slot ranked r in its head (best_first) is kept where r is under the head's budget: one sort.
        within = (slot_range(width, scores.device) < budgets).expand(*scores.shape)
        return ~padding & torch.zeros_like(padding).scatter_(2, best_first(scores, 2), within)

    def apply(self, buffer: BatchBuffer) -> bool:
        """Keep every head's budget in every row; whether any row was over the decode budget (it then evicted)."""
        lengths, width = buffer.lengths, buffer.width
        if not any(n > self.decode_budget for n in lengths):
            return False
        scores, padding = scored_slots(buffer, self.selection.scores, self.context)
        device = scores.device
        over = torch.tensor([n > self.decode_budget for n in lengths], device=device)[:, None, None]
        kept = self._kept(scores, padding, width) | (~padding & ~over)  # rows within the decode budget keep everything
        if bool((kept == ~padding).all()):  # nothing dropped (retrieval heads keep every token): the layout stands
            return False
        counts = kept.sum(dim=2)  # [B, H]
        new_lengths = counts.max(dim=1).values.tolist()
        new_width = max(new_lengths)
        # Each head's kept tokens, in slot order, end at its row's new last slot: a kept slot goes to its rank among
        # them from there; a dropped one to a spare column past new_width. Padding slots read slot 0.
        ends = torch.tensor(new_lengths, device=device)[:, None, None]  # [B, 1, 1]
        target = (kept.cumsum(dim=2) + (ends - 1 - counts[..., None])).masked_fill_(~kept, new_width)
        slots = slot_range(width, device).expand(*kept.shape)
        index = kept.new_zeros(*kept.shape[:2], new_width + 1, dtype=torch.long).scatter_(2, target, slots)[..., :new_width]
        column = slot_range(new_width, device)
        padded = (column < ends - counts[..., None]) | (column >= ends)  # [B, H, new_width]
        # K and V move only where a kept token changes slot (in a step that drops one token per row, the tokens of
        # one head before the dropped one, not the whole cache), and every padding slot is zeroed: the rows of the
        # flat [B * H * slots, D] views (a few rows, about 3x faster on a CPU than a mask broadcast over D).
        sources, targets = slot_rows(buffer.keys, index), slot_rows(buffer.keys, column.expand_as(index))
        moved = ((index != column) & ~padded).view(-1).nonzero().squeeze(1)
        move_rows((buffer.keys, buffer.values), sources[moved], targets[moved], targets[padded.view(-1)])
        for held, fill in ((buffer.positions, PAD_POSITION), (buffer.attention, 0)):
            if held is not None:
                held[:, :, :new_width] = held[:, :, :width].gather(2, index).masked_fill_(padded, fill)
                held[:, :, new_width:width] = fill
        buffer.lengths, buffer.width = new_lengths, new_width
        buffer.fit()
        return True


__all__ = ["BudgetEviction", "HeadBudgetEviction", "LayerScoring", "kept_slots", "scored_slots", "single_drops"]
