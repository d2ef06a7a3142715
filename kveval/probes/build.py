"""Assemble a probe context to an exact token budget and plant needles at token depths.

The context has the shape::

    [pad + pad_sep] intro intro_sep <region> outro

where the *region* is the haystack: units (sentences, JSON pairs or needles)
joined by ``joiner``, with planted needles inserted between units. Its length is
fitted by binary search on (whole units, then single pad words) against the
model's tokenizer, so ``len(context_ids) + len(question_ids) <= target`` with a
gap of a few tokens at most.

Depth is measured in tokens over the region: a needle at depth ``d`` has
``d * (region tokens without the needle)`` region tokens before it. Other
needles are inserted first, in order of requested depth, each at the unit
boundary nearest its target counting the needles already inserted (clustered
needles push each other). The primary needle (the item's depth) goes in last at
the gap nearest its target among everything, so its depth is exact to within
one unit or neighbouring needle, unless an ordering constraint (stale values
before the latest one, chain hops in order) pushes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kveval.errors import UsageError
from kveval.probes.item import PromptFrame, char_spans_to_tokens, encode_parts


@dataclass
class Plant:
    """A needle to insert into the region.

    Attributes
    ----------
    text : str
        The needle sentence or JSON pair.
    key, value : str
        What it states (see :class:`kveval.probes.item.Needle`).
    depth : float
        Requested relative depth in [0, 1].
    primary : bool
        The needle whose depth is the item's reported depth; placed last, exactly.
    order : str
        ``"before"`` or ``"after"``: must stay before/after the primary needle
        (chains, update streams); ``""`` for no constraint.
    """

    text: str
    key: str
    value: str
    depth: float
    primary: bool = False
    order: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.depth <= 1.0:
            raise UsageError(f"needle depth {self.depth} is outside [0, 1]")
        if self.order not in ("", "before", "after"):
            raise UsageError(f"order must be '', 'before' or 'after', not {self.order!r}")


@dataclass
class Unit:
    """A haystack unit: plain text, or a needle (``key``/``value`` set) such as a JSON pair."""

    text: str
    key: str | None = None
    value: str | None = None


@dataclass
class Layout:
    """Everything needed to assemble one context (see module docstring)."""

    intro: str
    units: Callable[[int], Unit]
    pad_words: Callable[[int], list[str]]
    plants: list[Plant]
    intro_sep: str = "\n"
    joiner: str = " "
    outro: str = ""
    pad_at_head: bool = False
    pad_sep: str = "\n\n"


@dataclass
class Turn:
    """One question against a context.

    Attributes
    ----------
    question, answer_prefix : str
    gold : list of str
        Values the answer must contain.
    primary : str
        Value of the needle whose depth is the item's depth.
    depth : float
        Requested depth of that needle.
    stale : list of str
        Overwritten values of the asked key(s); every other non-gold needle is a distractor.
    """

    question: str
    answer_prefix: str
    gold: list[str]
    primary: str
    depth: float
    stale: list[str] = field(default_factory=list)


@dataclass
class Spec:
    layout: Layout
    turns: list[Turn]
    value_kind: str


@dataclass
class Placed:
    key: str
    value: str
    text: str
    token_span: tuple[int, int]
    primary: bool
    depth: float


@dataclass
class Built:
    """An assembled context with token positions (within the prompt) of its needles."""

    context: str
    prompt_context: str
    context_tokens: int
    region_span: tuple[int, int]
    placed: list[Placed] = field(default_factory=list)

    def depth_of(self, placed: Placed) -> float:
        """Region tokens before the needle / region tokens without the needle."""
        start, end = self.region_span
        size = (end - start) - (placed.token_span[1] - placed.token_span[0])
        if size <= 0:
            return 0.0
        return min(1.0, max(0.0, (placed.token_span[0] - start) / size))


class _Assembler:
    def __init__(self, layout: Layout, frame: PromptFrame, tokenizer):
        self.layout = layout
        self.frame = frame
        self.tokenizer = tokenizer
        self._count_cache: dict[str, int] = {}
        if sum(p.primary for p in layout.plants) != 1:
            raise UsageError("a layout needs exactly one primary needle")

    def count(self, text: str) -> int:
        """Approximate tokens of ``text`` inside running text (with a leading space)."""
        n = self._count_cache.get(text)
        if n is None:
            n = len(self.tokenizer(" " + text, add_special_tokens=False)["input_ids"])
            self._count_cache[text] = n
        return n

    def assemble(self, k: int, w: int):
        """Context text with ``k`` whole units and ``w`` pad words; returns (context, needle char spans, region chars)."""
        lay = self.layout
        units = [lay.units(i) for i in range(k)]
        pad = " ".join(lay.pad_words(k)[:w]) if w else ""
        seq: list[tuple[str, object]] = [(u.text, u) for u in units]
        if pad and not lay.pad_at_head:
            seq.append((pad, None))
        # Other needles first: walk the units and insert each (in order of requested depth) at the gap
        # nearest its target, depth * (region tokens without it), counting needles already inserted.
        total = sum(self.count(text) for text, _ in seq) + sum(self.count(p.text) for p in lay.plants)
        rank = {"before": 0, "": 1, "after": 2}
        primary = next(p for p in lay.plants if p.primary)
        merged: list[tuple[str, object]] = []
        cum, j = 0, 0
        for plant in sorted((p for p in lay.plants if not p.primary), key=lambda p: (p.depth, rank[p.order])):
            target = plant.depth * (total - self.count(plant.text))
            while j < len(seq):
                step = self.count(seq[j][0])
                if abs(cum + step - target) >= abs(cum - target):
                    break
                merged.append(seq[j])
                cum += step
                j += 1
            merged.append((plant.text, plant))
            cum += self.count(plant.text)
        merged.extend(seq[j:])
        # The primary needle last, at the gap nearest its target among everything, within its ordering constraints.
        cum_at = [0]
        for text, _ in merged:
            cum_at.append(cum_at[-1] + self.count(text))
        lo, hi = 0, len(merged)
        for i, (_, obj) in enumerate(merged):
            if isinstance(obj, Plant) and obj.order == "before":
                lo = max(lo, i + 1)
            if isinstance(obj, Plant) and obj.order == "after":
                hi = min(hi, i)
        lo = min(lo, hi)
        target = primary.depth * cum_at[-1]
        g = min(range(lo, hi + 1), key=lambda i: (abs(cum_at[i] - target), i))
        merged.insert(g, (primary.text, primary))

        head = (pad + lay.pad_sep) if (pad and lay.pad_at_head) else ""
        head += lay.intro + lay.intro_sep
        parts, spans, offset = [], [], len(self.frame.head) + len(head)
        region_start = offset
        for i, (text, obj) in enumerate(merged):
            if i:
                parts.append(lay.joiner)
                offset += len(lay.joiner)
            if isinstance(obj, Plant) or (isinstance(obj, Unit) and obj.key is not None):
                spans.append((offset, offset + len(text), obj))
            parts.append(text)
            offset += len(text)
        context = head + "".join(parts) + lay.outro
        return context, spans, (region_start, offset)

    def context_tokens(self, k: int, w: int) -> int:
        context, _, _ = self.assemble(k, w)
        return len(encode_parts(self.tokenizer, self.frame.head + context, "")[0])


def fit(layout: Layout, frame: PromptFrame, tokenizer, budget: int) -> Built:
    """Assemble the longest context whose prompt-context tokens fit in ``budget``.

    Parameters
    ----------
    layout : Layout
    frame : PromptFrame
        Chat-template frame of the tokenizer.
    tokenizer
    budget : int
        Tokens available to the context part (target length minus question-part tokens).

    Raises
    ------
    ValueError
        When even an empty haystack (instructions and needles alone) exceeds the budget.
    """
    asm = _Assembler(layout, frame, tokenizer)
    base = asm.context_tokens(0, 0)
    if base > budget:
        raise UsageError(f"needles and instructions alone take {base} context tokens, more than the {budget} available; "
                         f"ask for a longer length or fewer needles")
    # Estimate the unit count from standalone token counts, correct the estimate by one real
    # measurement, then bracket (galloping) and bisect.
    cum = [base]
    while cum[-1] <= budget and len(cum) < 1_000_000:
        cum.append(cum[-1] + asm.count(layout.units(len(cum) - 1).text))
    k_est = len(cum) - 2
    measured = asm.context_tokens(k_est, 0)
    drift = measured - cum[k_est]
    while k_est > 0 and cum[k_est] + drift > budget:
        k_est -= 1
    while cum[-1] + drift <= budget and len(cum) < 1_000_000:
        cum.append(cum[-1] + asm.count(layout.units(len(cum) - 1).text))
    while k_est + 1 < len(cum) and cum[k_est + 1] + drift <= budget:
        k_est += 1
    step = 1
    lo, hi = max(0, k_est), k_est + step
    while lo > 0 and asm.context_tokens(lo, 0) > budget:
        lo, hi, step = max(0, lo - 2 * step), lo, step * 2
    while asm.context_tokens(hi, 0) <= budget:
        lo, hi, step = hi, hi + 2 * step, step * 2
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if asm.context_tokens(mid, 0) <= budget:
            lo = mid
        else:
            hi = mid
    k = lo
    words = layout.pad_words(k)
    wlo, whi = 0, len(words) + 1
    while whi - wlo > 1:
        mid = (wlo + whi) // 2
        if asm.context_tokens(k, mid) <= budget:
            wlo = mid
        else:
            whi = mid
    context, spans, (r0, r1) = asm.assemble(k, wlo)
    prompt_context = frame.head + context
    token_spans, n_tokens = char_spans_to_tokens(tokenizer, prompt_context, [(a, b) for a, b, _ in spans] + [(r0, r1)])
    region = token_spans.pop()
    placed = []
    for (a, b, obj), span in zip(spans, token_spans):
        placed.append(Placed(obj.key, obj.value, prompt_context[a:b], span,
                             bool(getattr(obj, "primary", False)), float(getattr(obj, "depth", -1.0))))
    return Built(context, prompt_context, n_tokens, region, placed)
