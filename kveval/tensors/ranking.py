"""Ranking of scored tokens: stable top-k and AdaKV's head-adaptive budgets, for policies and the cache alike."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


#: AdaKV's safeguard default (Feng et al. 2024 use alpha = 0.2 of each head's even share).
ADAKV_FLOOR = 0.2


def best_first(scores: "torch.Tensor", dim: int = -1) -> "torch.Tensor":
    """Indices along ``dim``, the best score first and equal scores in slot order (a stable sort).

    Decode evictions rank by this order, row by row and in batch alike, so a row keeps the same tokens alone and
    in a batch, where it is padded to the batch's width (padding scores ``-inf`` and ranks last), even where
    scores tie: H2O scores its recent tokens ``+inf`` (all of them tie under a budget below ``recent``), and max
    pooling gives neighbours one score. ``topk`` leaves the order of equal scores to its kernel, which differs
    with the width: such a row kept other tokens in a batch than alone.
    """
    return scores.argsort(dim=dim, descending=True, stable=True)


def best_indices(scores: "torch.Tensor", count: int, dim: int = -1, stable: bool = True) -> "torch.Tensor":
    """The indices of the ``count`` best scores along ``dim``, best first: by :func:`best_first` (``stable``) or by
    ``topk`` (its own order of equal scores)."""
    if stable:
        return best_first(scores, dim).narrow(dim, 0, count)
    return scores.topk(count, dim=dim).indices


def top_slots(scores: "torch.Tensor", keep: int, dim: int = -1, stable: bool = True) -> "torch.Tensor":
    """The ``keep`` best slots along ``dim`` (:func:`best_indices`), in increasing slot order.

    A prefill ranks each row alone, at its own width whatever its batch, by ``topk`` (``stable=False``): its order
    of equal scores is then the same in any batch, and runs kept what they kept. A decode eviction ranks stably.
    """
    return best_indices(scores, keep, dim, stable).sort(dim=dim).values


def adaptive_choice(scores: "torch.Tensor", keep: int, floor: float, stable: bool = False) -> "list[torch.Tensor]":
    """AdaKV's allocation: ``keep x heads`` tokens chosen by score across all heads of a layer.

    Each head first keeps its top ``max(1, floor(floor x keep))`` tokens (the
    paper's fair-guaranteed safeguard); the rest of the layer's budget goes
    to the best scores over the flattened ``[heads, tokens]`` scores. Padding
    slots (``-inf``) are never kept; the budget shrinks to the real tokens
    there are. Returns one increasing index tensor per head. ``stable``: ranked by :func:`best_first` (decode
    evictions; :func:`adaptive_choice_batch` ranks so), else by ``topk`` (a prefill, each row alone).
    """
    import torch

    heads, n = scores.shape
    real = scores > float("-inf")
    total = min(keep * heads, int(real.sum()))
    safe = min(n, max(1, math.floor(floor * keep)))
    guaranteed = torch.zeros_like(real).scatter_(1, best_indices(scores, safe, 1, stable), True) & real
    ranked = scores.masked_fill(guaranteed, float("inf"))
    chosen = torch.zeros(heads * n, dtype=torch.bool, device=scores.device)
    chosen[best_indices(ranked.flatten(), total, 0, stable)] = True
    return [row.nonzero().squeeze(1) for row in chosen.reshape(heads, n)]


def adaptive_choice_batch(scores: "torch.Tensor", keep: int, floor: float) -> "torch.Tensor":
    """:func:`adaptive_choice` (``stable``: the decode eviction's ranking) for every row of ``[B, heads, slots]``
    scores at once: the boolean kept mask.

    Rows differ in how many real tokens they hold: one ranking (:func:`best_first`) of the flattened scores, of
    which each row keeps its own total's first.
    """
    import torch

    batch, heads, n = scores.shape
    real = scores > float("-inf")
    counts = real.sum(dim=2)  # [B, heads]
    total = counts.sum(dim=1)  # [B]
    safe = min(n, max(1, math.floor(floor * keep)))
    few = _adaptive_few_drops(scores, real, counts, total, keep * heads, safe)
    if few is not None:
        return few
    total = total.clamp(max=keep * heads)
    guaranteed = torch.zeros_like(real).scatter_(2, best_indices(scores, safe, 2), True) & real
    ranked = scores.masked_fill(guaranteed, float("inf")).reshape(batch, heads * n)
    most = min(keep * heads, heads * n)
    best = best_indices(ranked, most, 1)  # [B, most]: padding (-inf) ranks last, so each row's real tokens first
    own = torch.arange(most, device=scores.device)[None, :] < total[:, None]  # each row's first total[b]
    return torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, best, own).reshape(batch, heads, n)


#: Most tokens a row may be over AdaKV's budget for :func:`_adaptive_few_drops` to find them by one ``topk``.
FEW_DROPS = 64


def _adaptive_few_drops(scores: "torch.Tensor", real: "torch.Tensor", counts: "torch.Tensor", total: "torch.Tensor",
                        budget: int, safe: int) -> "torch.Tensor | None":
    """:func:`adaptive_choice_batch`'s kept mask where a decode step leaves it nothing to rank: each row over
    ``budget`` by ``e`` tokens (at most :data:`FEW_DROPS`) drops its ``e`` lowest scores, found by one ``topk``.

    A decode step appends one token to every head, so a row at the budget comes back ``heads`` over. The ranking
    keeps each head's ``safe`` best (guaranteed), then the best of the rest: it drops exactly the ``e`` lowest
    where they are told apart from the others (the ``e``-th lowest below the next, so the order of equal scores
    cannot matter) and none of them is guaranteed (a head losing ``d`` tokens keeps at least ``safe``, all above
    the dropped ones). ``None`` where the ranking must decide: a tie at that boundary, a NaN, a guaranteed token
    among the lowest, or a row more than :data:`FEW_DROPS` over. ``counts``: each head's real tokens
    (``[B, heads]``); ``total``: each row's (``[B]``)."""
    import torch

    batch, heads, n = scores.shape
    excess = (total - budget).clamp(min=0)  # [B]
    flat = scores.reshape(batch, heads * n)
    most = int(excess.max())
    if most == 0:
        return real.clone()
    if most > FEW_DROPS or most + 1 > heads * n:
        return None
    # The e + 1 lowest real scores of each row, ascending (padding never among them: +inf, above any real score
    # but an +inf one, and a tie with that is no boundary).
    lowest, slots = flat.masked_fill(~real.reshape(batch, -1), float("inf")).topk(most + 1, dim=1, largest=False)
    at = excess[:, None]
    told_apart = lowest.gather(1, (at - 1).clamp(min=0)) < lowest.gather(1, at)  # [B, 1]
    dropped = torch.zeros_like(flat, dtype=torch.bool).scatter_(
        1, slots, torch.arange(most + 1, device=scores.device)[None, :] < at)
    lost = dropped.view(batch, heads, n).sum(dim=2)  # [B, heads]
    unclear = (excess > 0) & ~told_apart.squeeze(1)
    unclear |= ((lost > 0) & (counts - lost < safe)).any(dim=1) | flat.isnan().any(dim=1)
    if bool(unclear.any()):
        return None
    return (real.reshape(batch, -1) & ~dropped).view(batch, heads, n)


