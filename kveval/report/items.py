"""The per-item before/after view's data: which items a compressed run changed, and what each one asked and answered.

For every candidate run and its model's baseline, the items whose outcome changed, in three kinds:

``regressed``
    right at baseline, wrong under the policy;
``improved``
    wrong at baseline, right under the policy;
``changed``
    wrong in both runs, in another confusion category (listed apart: no score moved, the way it failed did).

Each :class:`ItemChange` carries what ``items.jsonl`` records (task, length, depth, gold, both answers with their
categories and the values recalled instead of the gold) and, where the prompt is known, what was asked: a probe's
question, its target needle and a window of the context around it (:class:`Passage`), a wrong value named by the
needle it belongs to (a distractor's value as that key's); an lm-eval item's document, prompt and choices
(:class:`~kveval.runs.results.SampleDocument`). Probe prompts come keyed by prompt hash
(:func:`kveval.sweep.recorded.recorded_probe_items`), so a prompt is only shown beside the record run on it.

Whether a needle's own tokens survived is recorded per item as ``needle_kept`` (the share of the target needle's
token slots the cache held once the prompt was in, over layers and KV heads; runs written before kveval recorded
it have only ``kept_tokens_mean``): :attr:`ItemChange.kept` says what is known, in words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from kveval.probes.item import ProbeItem
from kveval.runs.records import ItemRecord
from kveval.runs.results import Run, SampleDocument, baseline_for, pair_runs

KINDS = ("regressed", "improved", "changed")
#: Characters of context shown on each side of the needle.
WINDOW = 320
#: What a confusion category means, in words, for "N right answers became ...".
CATEGORY_WORDS = {
    "empty": "empty",
    "no_value": "text with no value",
    "fabricated": "fabricated values",
    "distractor": "another key's value",
    "stale": "an overwritten value",
    "partial": "part of the value",
    "over_inclusion": "the value plus others",
    "correct": "correct",
    "": "wrong",
}


@dataclass(frozen=True)
class Recalled:
    """A value an answer gave instead of (or besides) the gold: its ``role`` (``distractor``, ``stale``, ``partial``,
    ``fabricated``), the ``value``, and the key of the needle it belongs to, where the prompt is known."""

    role: str
    value: str
    key: str | None = None

    def describe(self) -> str:
        if self.role == "distractor" and self.key:
            return f"{self.value}: the value of {self.key!r} (a distractor)"
        if self.role == "stale" and self.key:
            return f"{self.value}: an overwritten value of {self.key!r}"
        return f"{self.value} ({self.role})"


@dataclass(frozen=True)
class Answer:
    """One run's answer to an item."""

    text: str
    category: str
    score: float
    correct: bool
    recalled: tuple[Recalled, ...] = ()


@dataclass(frozen=True)
class Passage:
    """A window of the context: ``before``, the ``needle`` text (highlighted), ``after``; ``clipped_*``: the
    context goes on beyond the window."""

    before: str
    needle: str
    after: str
    clipped_before: bool
    clipped_after: bool


@dataclass(frozen=True)
class ItemChange:
    """One item whose outcome a policy changed (``kind``: one of :data:`KINDS`)."""

    id: str
    task: str
    kind: str
    length: int | None
    depth: float | None
    gold: tuple[str, ...]
    baseline: Answer
    candidate: Answer
    question: str | None = None
    needle: str | None = None
    passage: Passage | None = None
    kept: str = ""
    document: SampleDocument | None = None


@dataclass(frozen=True)
class RunChanges:
    """The changed items of one candidate run against its baseline, in the baseline's order, and a ``note`` on what
    the view cannot show (no prompt recorded)."""

    name: str
    items: tuple[ItemChange, ...]
    note: str = ""

    def of(self, kind: str, task: str | None = None) -> list[ItemChange]:
        return [c for c in self.items if c.kind == kind and (task is None or c.task == task)]


def kind_of(base: ItemRecord, cand: ItemRecord) -> str | None:
    """Which of :data:`KINDS` a baseline/candidate pair is, or ``None`` (no change worth showing)."""
    if base.correct and not cand.correct:
        return "regressed"
    if cand.correct and not base.correct:
        return "improved"
    if not base.correct and base.category != cand.category:
        return "changed"
    return None


def parse_recalled(recalled: str | None, probe: ProbeItem | None) -> tuple[Recalled, ...]:
    """``"distractor:7431,fabricated:12"`` (:attr:`kveval.probes.scoring.Score.recalled`) as :class:`Recalled`
    values, each named by the needle whose value it is where ``probe`` is known."""
    if not recalled:
        return ()
    keys = {n.value.lower(): n.key for n in (probe.needles if probe else []) if n.role != "target"}
    out = []
    for part in recalled.split(","):
        role, _, value = part.partition(":")
        out.append(Recalled(role, value, keys.get(value.lower())))
    return tuple(out)


def passage(context: str, value: str, window: int = WINDOW) -> Passage | None:
    """The sentence of ``context`` stating ``value`` (its first occurrence), with ``window`` characters each side
    cut at word boundaries; ``None`` where the value is not in the context."""
    at = context.find(value)
    if at < 0:
        return None
    start = max(context.rfind(b, 0, at) for b in (". ", "\n", "{", ", \"")) + 1
    start = max(start, at - 200)
    ends = [e for e in (context.find(b, at + len(value)) for b in (".", "\n", "}", ", \"")) if e >= 0]
    end = min(min(ends) + 1 if ends else len(context), at + len(value) + 200)
    while start < at and context[start] in " \n":
        start += 1
    lo = max(0, start - window)
    hi = min(len(context), end + window)
    if lo > 0:
        lo = context.find(" ", lo, start) + 1 or lo
    if hi < len(context):
        cut = context.rfind(" ", end, hi)
        hi = cut if cut > end else hi
    return Passage(context[lo:start], context[start:end], context[end:hi], lo > 0, hi < len(context))


def kept_note(record: ItemRecord, probe: ProbeItem | None, baseline: ItemRecord | None = None) -> str:
    """What is known of whether the needle's tokens stayed in the candidate's cache, in words (``""``: the run kept
    every token, no selection). ``baseline``: its share is named where the model's own cache does not hold the whole
    needle either (sliding-window layers)."""
    kept = record.metrics.get("kept_tokens_mean")
    seen = record.metrics.get("tokens_seen") or record.length
    share = record.metrics.get("needle_kept")
    targets = [n for n in (probe.needles if probe else []) if n.role == "target"]
    where = ""
    if targets and targets[0].span != (0, 0):
        where = f" (tokens {targets[0].span[0]}-{targets[0].span[1]} of the prompt)"
    if share is not None:
        if share >= 1 and (kept is None or not seen or kept >= seen):
            return ""
        if share >= 1:
            return f"The needle{where} was kept whole in every layer and head."
        if share <= 0:
            return f"The needle{where} was dropped from every layer and head."
        own = baseline.metrics.get("needle_kept") if baseline is not None else None
        also = f"; the uncompressed cache held {own:.0%} (sliding layers)" if own is not None and own < 1 else ""
        return f"The cache kept {share:.0%} of the needle's token slots{where}, over layers and heads{also}."
    if kept is None or (seen and kept >= seen):
        return ""
    of = f" of the {seen} tokens seen" if seen else " tokens"
    return (f"The cache held {kept:g}{of}, on average over layers and heads{where}. Whether the needle's own tokens "
            f"were kept is not recorded by this run (it predates needle_kept).")


def run_changes(
    baseline: Run,
    candidate: Run,
    probes: Mapping[str, ProbeItem] | None = None,
    documents: Mapping[str, SampleDocument] | None = None,
) -> RunChanges:
    """The changed items of ``candidate`` against ``baseline`` (see the module docstring).

    ``probes``: probe items by prompt hash; ``documents``: lm-eval documents by item id
    (:func:`kveval.runs.results.sample_documents`). Either may be empty: the view then shows what the records hold
    and the note says why no prompt is shown.
    """
    probes, documents = probes or {}, documents or {}
    out = []
    shown = 0
    for base, cand in pair_runs(baseline_for(baseline, candidate), candidate):
        kind = kind_of(base, cand)
        if kind is None:
            continue
        probe = probes.get(base.hash)
        target = next((n for n in probe.needles if n.role == "target"), None) if probe else None
        shown += probe is not None or base.id in documents
        out.append(
            ItemChange(
                id=base.id,
                task=base.task,
                kind=kind,
                length=base.length,
                depth=base.depth,
                gold=tuple(base.gold),
                baseline=_answer(base, probe),
                candidate=_answer(cand, probe),
                question=probe.question if probe else None,
                needle=f"{target.key} = {target.value}" if target else None,
                passage=passage(probe.context, target.value) if target else None,
                kept=kept_note(cand, probe, base),
                document=documents.get(base.id),
            )
        )
    note = ""
    if out and not shown:
        note = ("The prompts are not shown: the runs record no probe set this report could generate again (run "
                "kveval report on the sweep folder, with its model's tokenizer installed), and no lm-eval documents.")
    return RunChanges(candidate.info.name, tuple(out), note)


def _answer(record: ItemRecord, probe: ProbeItem | None) -> Answer:
    return Answer(record.answer, record.category, record.score, record.correct, parse_recalled(record.recalled, probe))


def category_phrase(categories: Sequence[str]) -> str:
    """``"became text with no value"``, or ``"went wrong (27 no_value, 13 fabricated)"`` for mixed categories: what
    regressed answers became."""
    counts: dict[str, int] = {}
    for c in categories:
        counts[c or ""] = counts.get(c or "", 0) + 1
    if len(counts) == 1:
        return f"became {CATEGORY_WORDS.get(next(iter(counts)), next(iter(counts)))}"
    parts = ", ".join(f"{n} {c or 'wrong'}" for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"went wrong ({parts})"


__all__ = ["Answer", "ItemChange", "KINDS", "Passage", "Recalled", "RunChanges", "category_phrase", "kind_of",
           "kept_note", "parse_recalled", "passage", "run_changes"]
