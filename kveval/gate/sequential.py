"""The group-sequential gate: a candidate judged at planned looks on the first blocks of every task's items.

A gate config with a ``sequential:`` section (:class:`~kveval.gate.config.SequentialSettings`) judges each candidate
look by look instead of once on every item. Each task's items are put in a *look order* (:func:`stratified_order`):
within the task, every stratum (context length and needle depth) is interleaved in proportion, whole shared
contexts together, so that the first quarter of the order covers every length and depth as the whole does and an
early stop is not biased toward easy items. Look ``k`` of a task tests the first ``looks[k]`` items of that order
(:class:`LookPlan`); a sequential sweep (:mod:`kveval.sweep.run`) runs the items in exactly those blocks and
records the order in every run's ``run.json`` (``extra.sequential.order``), so that a gate can replay a run whose
baseline stopped early.

At each look, per task, the cumulative paired counts on the items both runs hold go through
:func:`kveval.stats.sequential.decide` with the task's margin and design effect (the same statistic as the fixed
gate's: Tango's ``z`` at ``-margin``, on fractional discordances for graded tasks), and the gate's other rules
(flip cap, confusion caps, KL, the noise floor) through :func:`kveval.gate.rules.judge_task` as the fixed gate
applies them. A candidate is

* PASS at the first look where every task crossed the upper boundary and no other rule objects;
* FAIL at the first look where any task crossed the lower boundary (not within the noise floor) or another rule
  FAILs;
* otherwise CONTINUE, or INCONCLUSIVE after the last look (the fixed-n rules with the final boundary).

The PASS error rate is the gate's ``alpha`` (a PASS needs every task: no adjustment); the FAIL error rate of each
task is ``alpha`` split over the Holm family (Bonferroni: ``alpha / tests``), since a step-down over tests decided
at different looks has no fixed order. A candidate's run may hold fewer items than the baseline's only here: it is
paired on the items it holds, which must be the first blocks of the look order. Replaying the looks from the runs
gives the verdict again, so ``gate.json`` is re-verified as a fixed gate's is (:mod:`kveval.gate.verify`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kveval.errors import ResultFileError
from kveval.gate.config import GateConfig, SequentialSettings
from kveval.runs.results import SEQUENTIAL_DECISION, Run
from kveval.stats.comparison import cluster_of
from kveval.stats.sequential import CONTINUE, SequentialDesign

#: ``run.json`` ``extra`` key under which a sequential sweep records its look order (``{"order": {task: [ids]}}``).
ORDER_KEY = "sequential"
#: ``run.json`` ``extra`` key under which a sequential sweep records a run's decision (look, items spent).
DECISION_KEY = SEQUENTIAL_DECISION

__all__ = ["CONTINUE", "DECISION_KEY", "ORDER_KEY", "LookPlan", "family_size", "probe_order", "run_order",
           "stratified_order"]


def stratified_order(entries: Iterable[tuple[str, str, Hashable, str]]) -> dict[str, list[str]]:
    """Per task, its item ids in look order: strata interleaved in proportion, each shared context kept whole.

    ``entries``: ``(id, task, stratum, cluster)`` in their generated order. Within a task, the ``j``-th of a
    stratum's ``m`` contexts gets the key ``((j + 0.5) / m, stratum's first appearance)``: a round-robin over the
    strata where they are of one size, proportional where they are not, so that any prefix of the order holds
    every stratum in its share (to one context). The order is a pure function of the entries.
    """
    tasks: dict[str, dict[Hashable, dict[str, list[str]]]] = {}
    for item_id, task, stratum, cluster in entries:
        tasks.setdefault(task, {}).setdefault(stratum, {}).setdefault(cluster, []).append(item_id)
    out: dict[str, list[str]] = {}
    for task, strata in tasks.items():
        keyed = [((j + 0.5) / len(clusters), s, ids)
                 for s, clusters in enumerate(strata.values()) for j, ids in enumerate(clusters.values())]
        out[task] = [item_id for _, _, ids in sorted(keyed, key=lambda k: (k[0], k[1])) for item_id in ids]
    return out


def probe_order(items: Sequence[Any]) -> dict[str, list[str]]:
    """:func:`stratified_order` of probe items (:class:`~kveval.probes.item.ProbeItem`): strata by requested
    length and depth, contexts by ``group``."""
    return stratified_order((it.id, it.family, (it.params.get("length"), it.depth), it.group or it.id) for it in items)


def run_order(run: Run) -> dict[str, list[str]]:
    """The look order of a run's items: the one a sequential sweep recorded in ``run.json``, else
    :func:`stratified_order` of its records (strata by depth, contexts by :func:`~kveval.stats.comparison.cluster_of`)."""
    recorded = (run.info.extra.get(ORDER_KEY) or {}).get("order")
    if recorded:
        if not isinstance(recorded, dict) or not all(isinstance(v, list) for v in recorded.values()):
            raise ResultFileError(f"{run.path}: run.json's extra.{ORDER_KEY}.order is not a mapping of task to item "
                                  f"ids; run the sweep again into a new folder")
        return {str(k): [str(x) for x in v] for k, v in recorded.items()}
    return stratified_order((r.id, r.task, r.depth, cluster_of(r)) for r in run.items)


def family_size(cfg: GateConfig, tasks: int, candidates: int) -> int:
    """How many FAIL tests share the gate's ``alpha`` (Bonferroni): the tasks of one candidate, or of every candidate
    judged against one baseline under ``family: sweep``."""
    return tasks * (candidates if cfg.family == "sweep" else 1)


@dataclass(frozen=True)
class LookPlan:
    """Every gated task's look order, items per look and design: which items each look tests.

    ``order``: per task, its item ids in look order (the task's maximum items is their number); ``counts``: per task,
    the items each look tests (non-decreasing: a task of fewer items than looks repeats a count, and its statistic
    does not change at that look); ``designs``: per task, the :class:`~kveval.stats.sequential.SequentialDesign` of
    its distinct counts.
    """

    order: Mapping[str, tuple[str, ...]]
    counts_by_task: Mapping[str, tuple[int, ...]]
    designs: Mapping[str, SequentialDesign]

    @classmethod
    def build(cls, settings: SequentialSettings, order: Mapping[str, Sequence[str]], alpha_pass: float,
              alpha_fail: float, where: str = "the runs") -> "LookPlan":
        counts, designs = {}, {}
        for task, ids in order.items():
            if not ids:
                raise ResultFileError(f"{where}: task {task} has no items in the look order")
            if settings.fractions:
                looks = tuple(max(1, math.ceil(f * len(ids) - 1e-9)) for f in settings.looks)
            else:
                looks = tuple(int(x) for x in settings.looks)
                if looks[-1] != len(ids):
                    raise ResultFileError(f"{where}: task {task} has {len(ids)} items, the sequential design's last "
                                          f"look {looks[-1]}: give looks as fractions, or counts ending at {len(ids)}")
            counts[task] = looks
            designs[task] = settings.design_of(tuple(sorted(set(looks))), alpha_pass, alpha_fail)
        return cls({t: tuple(ids) for t, ids in order.items()}, counts, designs)

    @property
    def looks(self) -> int:
        return len(next(iter(self.counts_by_task.values())))

    def counts(self, look: int) -> dict[str, int]:
        """Items of each task that look ``look`` (0-based) tests."""
        return {task: c[look] for task, c in self.counts_by_task.items()}

    def design_look(self, task: str, look: int) -> int:
        """The index, in ``task``'s design, of the plan's look ``look``."""
        return self.designs[task].looks.index(self.counts_by_task[task][look])

    def ids_through(self, look: int) -> list[str]:
        """The ids looks ``0..look`` test, block by block (block ``k``: every task's items from look ``k - 1`` to
        ``k``, task by task): the order a sequential sweep runs them in."""
        out: list[str] = []
        for k in range(look + 1):
            for task, c in self.counts_by_task.items():
                out += self.order[task][c[k - 1] if k else 0:c[k]]
        return out

    def reached(self, held: set[str]) -> tuple[int, dict[str, int]]:
        """The last look whose items ``held`` all holds (-1: not even the first), and per task how many of its first
        items in look order are held. Refuses held items past a gap in the order (not the first blocks)."""
        prefix = {}
        for task, ids in self.order.items():
            n = next((i for i, x in enumerate(ids) if x not in held), len(ids))
            later = [x for x in ids[n:] if x in held]
            if later:
                raise ResultFileError(f"holds {later[0]} of task {task} but not {ids[n]} before it in the look order: "
                                      f"a sequential gate judges the first blocks of every task's items (run it as a "
                                      f"sequential kveval sweep does, or give every item)")
            prefix[task] = n
        look = -1
        while look + 1 < self.looks and all(prefix[t] >= c[look + 1] for t, c in self.counts_by_task.items()):
            look += 1
        return look, prefix


def subset(run: Run, ids: set[str]) -> Run:
    """``run`` holding only the items ``ids`` (in its own order)."""
    return replace(run, items=[r for r in run.items if r.id in ids])
