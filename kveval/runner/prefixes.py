"""Rows of a batch that share one context prefill: which do (:func:`plan_prefixes`), and each row's own copy of
its compressed prefix after the prefill (:func:`serve_prefixes`).

Rows whose contexts are the same token ids (a long system prompt shared by several requests) are prefilled and
compressed once in ``context`` mode; each row then continues from its own copy, so its answer is that of its own
prefill, bit for bit. :mod:`kveval.runner.generation` drives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.cache.compressed import CacheStats, CompressedCache


@dataclass(frozen=True)
class PrefixPlan:
    """Which rows of a batch continue from one shared context prefill.

    Attributes
    ----------
    firsts : tuple of int
        Prefill ``g`` holds the context of row ``firsts[g]`` (the first row with that context, in order).
    index : tuple of int
        Row ``b`` continues from prefill ``index[b]``.
    """

    firsts: tuple[int, ...]
    index: tuple[int, ...]

    @property
    def shares(self) -> bool:
        """Whether some prefill serves more than one row."""
        return len(self.firsts) < len(self.index)

    def pick(self, rows: list) -> list:
        """The entries of ``rows`` (one per row of the batch) of the rows the prefills hold."""
        return [rows[b] for b in self.firsts]


def plan_prefixes(prompts: list, mode: str, seeds: list[int], seeded: bool) -> PrefixPlan:
    """Rows sharing a prefix among ``prompts`` (:class:`~kveval.runner.generation.Prompt`): in ``context`` mode
    those whose contexts are the same token ids and, where the policy reads each row's seed (``seeded``: the
    ``random`` control), the same seed, so a row's compressed prefix is exactly the one its own prefill would give.
    In ``query`` mode the question is in the prefill: no row shares.
    """
    if mode != "context":
        return PrefixPlan(tuple(range(len(prompts))), tuple(range(len(prompts))))
    prefills: dict[tuple, int] = {}
    index = [prefills.setdefault((tuple(p.context), seeds[b] if seeded else None), len(prefills))
             for b, p in enumerate(prompts)]
    firsts = [index.index(g) for g in range(len(prefills))]
    return PrefixPlan(tuple(firsts), tuple(index))


def serve_prefixes(model, cache: CompressedCache, plan: PrefixPlan, last_logits: torch.Tensor, seen: list[int],
                   mode: str) -> tuple[CompressedCache, torch.Tensor, list[int], "list[CacheStats] | None"]:
    """After the prefill of ``plan``'s contexts: the cache, next-token logits and tokens seen with one row per
    prompt, and each row's prefix stats (``context`` mode; else ``None``).

    Where the plan shares, each row gets its own copy of its prefix's compressed rows
    (:meth:`CompressedCache.fork_rows`; the model's weights are never copied): rows never see each other's
    tokens, and each decodes as its own prefill would let it."""
    prefixes = [cache.stats(row=g) for g in range(len(plan.firsts))] if mode == "context" else None
    if not plan.shares:
        return cache, last_logits, seen, prefixes
    index = list(plan.index)
    memo = {id(t): t for t in (model, *model.modules(), *model.parameters(), *model.buffers())}
    forked = cache.fork_rows(index, memo)
    return forked, last_logits[index], [seen[g] for g in index], [prefixes[g] for g in index]


__all__ = ["PrefixPlan", "plan_prefixes", "serve_prefixes"]
