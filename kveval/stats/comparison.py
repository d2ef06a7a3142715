"""Paired comparison of a candidate run against its baseline, item by item.

A :class:`RunComparison` holds one :class:`Comparison` per task (tested, with
Holm- and Benjamini-Hochberg-adjusted p-values across the tasks), one for all
items pooled, and one per (task, context length, depth) cell for heatmaps.

Every cell's change is the change of its mean score (for right/wrong items, of
accuracy). Its interval is Tango's score interval on the items' fractional
discordances (:func:`kveval.stats.paired.score_discordance`): Tango's own on 0/1
scores, conservative on partial ones, and never zero-width because no item
changed. Where more than :data:`GRADED_SHARE_MAX` of the items carry partial
scores and there are at least :data:`BOOTSTRAP_MIN_ITEMS` of them, the paired
bootstrap's percentile interval instead: there the fractional counts' variance
(``|d|`` per item) would overstate many small changes several times over. The
descriptive p-value tests the same change as the interval beside it (exact
McNemar on 0/1 scores).
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from kveval.errors import UsageError
from kveval.runs.fidelity import attach_fidelity
from kveval.runs.records import CATEGORIES, CONFUSION_CATEGORIES, ItemRecord, RunInfo
from kveval.runs.results import Run, load_run, pair_runs
from kveval.stats import fidelity, paired
from kveval.stats import significance as stats
from kveval.values import is_real, is_whole

#: Key of the summed confusion rate in the confusion dictionaries.
OVERALL = "overall"
#: Cell name of the comparison that pools every item.
ALL = "ALL"

DEFAULT_RESAMPLES = 9999
#: Fewest bootstrap resamples a comparison or gate accepts (fewer give percentile bounds of a handful of means).
MIN_RESAMPLES = 100
CELL_RESAMPLES = 1999  # heatmap cells are descriptive; a cheaper bootstrap is enough
#: Largest share of graded items (a score strictly between 0 and 1) whose task keeps Tango's interval.
GRADED_SHARE_MAX = 0.10
#: Fewest items whose spread the bootstrap is trusted with; fewer keep Tango's (a bootstrap of two or three
#: differences spans only those differences).
BOOTSTRAP_MIN_ITEMS = 30


def uses_bootstrap(n: int, n_graded: int) -> bool:
    """Whether a cell of ``n`` items, ``n_graded`` of them with partial scores, takes the paired bootstrap."""
    return n_graded > GRADED_SHARE_MAX * n and n >= BOOTSTRAP_MIN_ITEMS


# ----------------------------------------------------------------------------- comparisons


@dataclass
class Comparison:
    """Candidate vs baseline on one cell (a task, all items, or a task x length x depth cell).

    Attributes
    ----------
    cell : str
        ``"<task>"``, ``"ALL"`` or ``"<task>@len=<L>,depth=<d>"``.
    task : str
        Task name (``"ALL"`` for the pooled comparison).
    length, depth : int or float or None
        Heatmap coordinates (context-length bucket, rounded depth) of a cell.
    n : int
        Paired items.
    baseline_score, candidate_score, delta : float
        Mean score of each run (accuracy, where every score is 0 or 1), and
        their difference (candidate - baseline).
    ci_low, ci_high : float
        Two-sided interval of ``delta`` at ``confidence_level``: Tango's score
        interval on ``score_lost`` and ``score_gained``, or the paired
        bootstrap's percentile interval (:func:`uses_bootstrap`); never zero-width.
    ci_method : str
        ``"tango"`` or ``"bootstrap"``.
    score_lost, score_gained : float
        The summed falls and rises of the items' scores (the right->wrong and
        wrong->right counts where every score is 0 or 1).
    binary : bool
        Every score is 0 or 1.
    n_graded : int
        Items with a score strictly between 0 and 1 in either run.
    pvalue : float
        Two-sided test of "no change", of the change the interval shows: exact
        McNemar (every score 0 or 1), the bootstrap's, or Tango's score test at
        0 on ``score_lost``/``score_gained``. Descriptive; the gate tests against its margin.
    test : str
        ``"mcnemar"``, ``"tango"`` or ``"bootstrap"``.
    mcnemar_p : float
        Exact McNemar p on correctness (reported for every cell).
    p_holm, p_bh : float or None
        ``pvalue`` adjusted across the family (the run's tasks, or its heatmap
        cells); set by :func:`adjust_pvalues`.
    n_regressed, n_improved : int
        Right->wrong and wrong->right items.
    negative_flip_rate, positive_flip_rate : float
        The same per item.
    agreement : float
        Share of items whose output text is identical.
    confusion_baseline, confusion_candidate, confusion_delta : dict
        Share of items per category (and ``"overall"``: the summed
        :data:`CONFUSION_CATEGORIES`); empty when the task has no taxonomy.
    logprob_delta, logprob_ci_low, logprob_ci_high : float or None
        Mean change of the gold answer's log-probability, where both runs have it.
    regressed : list of dict
        The right->wrong items: id, task, category, recalled, baseline and
        candidate answers, length, depth.
    clusters : int
        Shared contexts among the items (``metrics["group"]``: ``multi_turn``'s turns share one); ``n`` where
        every item stands alone.
    design_effect : float
        How many independent items' variance each item carries (:func:`kveval.stats.paired.design_effect`); the
        interval, the test and the gate's margin tests run on the counts divided by it. 1 for independent items.
    output_length_ratio, output_length_delta : float or None
        The candidate's answer length against the baseline's, paired by item, from the items' ``new_tokens``
        (generated tokens): the mean of candidate / baseline over the items where the baseline wrote any, and the
        mean difference in tokens; ``None`` where the runs did not record lengths. A compression that makes the
        model write longer (repeating, losing its place) pays for it in decode steps and cache.
    fidelity : dict or None
        The baseline's answer teacher-forced through the candidate
        (:func:`kveval.stats.fidelity.summarize`): ``n``, mean ``kl_mean``,
        ``kl_max``, ``top1_agreement``, ``answer_logprob_delta``,
        ``kl_max_item`` and ``kl_mean_upper``; ``None`` when the candidate run
        has no ``fidelity.jsonl``.
    """

    cell: str
    task: str
    n: int
    baseline_score: float
    candidate_score: float
    delta: float
    ci_low: float
    ci_high: float
    confidence_level: float
    ci_method: str
    score_lost: float
    score_gained: float
    binary: bool
    n_graded: int
    pvalue: float
    test: str
    mcnemar_p: float
    n_regressed: int
    n_improved: int
    negative_flip_rate: float
    positive_flip_rate: float
    agreement: float
    confusion_baseline: dict[str, float]
    confusion_candidate: dict[str, float]
    confusion_delta: dict[str, float]
    regressed: list[dict[str, Any]]
    length: int | None = None
    depth: float | None = None
    logprob_delta: float | None = None
    logprob_ci_low: float | None = None
    logprob_ci_high: float | None = None
    n_logprob: int = 0
    p_holm: float | None = None
    p_bh: float | None = None
    fidelity: dict[str, float] | None = None
    output_length_ratio: float | None = None
    output_length_delta: float | None = None
    clusters: int = 0
    design_effect: float = 1.0
    baseline_scores: np.ndarray = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    candidate_scores: np.ndarray = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """The comparison as JSON (``compare.json``, ``gate.json``); the output lengths only where the runs recorded
        them, so that a gate rebuilt on runs made before lengths were recorded reads as it was written."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("baseline_scores", "candidate_scores")
               and not (k in _LENGTH_FIELDS and v is None)}
        return _clean(out)

    def regressed_categories(self) -> Counter:
        """Candidate categories of the regressed items (``""`` becomes ``"wrong"``)."""
        return Counter((r.get("category") or "wrong") for r in self.regressed)


def cluster_of(record: ItemRecord) -> str:
    """The shared context an item belongs to: its ``group`` (recorded by the probe runner), else the item itself."""
    return str(record.metrics.get("group") or record.id)


def confusion_rates(items: Sequence[ItemRecord]) -> dict[str, float]:
    """Share of items per category, plus ``"overall"`` (summed confusion categories).

    Returns an empty dict when no item carries a category.
    """
    n = len(items)
    counts = Counter(it.category for it in items if it.category)
    if not n or not counts:
        return {}
    rates = {c: counts.get(c, 0) / n for c in CATEGORIES}
    for c in sorted(counts):
        if c not in rates:
            rates[c] = counts[c] / n
    rates[OVERALL] = sum(counts.get(c, 0) for c in CONFUSION_CATEGORIES) / n
    return rates


def compare_pairs(
    pairs: Sequence[tuple[ItemRecord, ItemRecord]],
    *,
    cell: str,
    task: str,
    length: int | None = None,
    depth: float | None = None,
    confidence_level: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int | None = 0,
) -> Comparison:
    """Compare paired items of one cell (see :class:`Comparison`)."""
    if not pairs:
        raise ValueError(f"cell {cell!r} has no items")
    base = [b for b, _ in pairs]
    cand = [c for _, c in pairs]
    a = np.array([b.score for b in base], dtype=float)
    b = np.array([c.score for c in cand], dtype=float)
    ac = np.array([bool(x.correct) for x in base])
    bc = np.array([bool(x.correct) for x in cand])
    mc = stats.mcnemar_exact(ac, bc)
    fl = stats.flips(ac, bc)
    n_graded = int(np.sum(((a > 0) & (a < 1)) | ((b > 0) & (b < 1))))
    lost, gained = paired.score_discordance(a, b)
    clusters = [cluster_of(x) for x in base]
    design = paired.design_effect(np.clip(a - b, 0, None), np.clip(b - a, 0, None), clusters)
    base_score, cand_score, estimate = float(a.mean()), float(b.mean()), (gained - lost) / len(pairs)
    binary = n_graded == 0  # scores are in [0, 1]: none strictly between is all 0/1
    if uses_bootstrap(len(pairs), n_graded):  # its two-sided interval and p-value from the same resamples
        t = stats.bootstrap_margin_test(a, b, 0.0, alpha=(1 - confidence_level) / 2, n_resamples=n_resamples, seed=seed)
        low, high, method = t.lower, t.upper, "bootstrap"
        test, pvalue = "bootstrap", min(1.0, 2 * min(t.p_noninferior, t.p_inferior))
    elif design > 1:  # items share contexts: Rao-Scott, the counts divided by the design effect
        low, high = paired.tango_interval(lost / design, gained / design, len(pairs) / design, confidence_level)
        method = "tango"
        test, pvalue = "tango-clustered", paired.tango_pvalue(lost / design, gained / design, len(pairs) / design)
    else:
        low, high = paired.tango_interval(lost, gained, len(pairs), confidence_level)
        method = "tango"
        test, pvalue = ("mcnemar", mc.pvalue) if binary else ("tango", paired.tango_pvalue(lost, gained, len(pairs)))
    cb, cc = confusion_rates(base), confusion_rates(cand)
    keys = list(dict.fromkeys([*cb, *cc]))
    cd = {k: cc.get(k, 0.0) - cb.get(k, 0.0) for k in keys} if (cb or cc) else {}
    regressed = [
        {
            "id": y.id,
            "task": y.task,
            "category": y.category,
            "recalled": y.recalled,
            "baseline_answer": x.answer,
            "answer": y.answer,
            "length": y.length,
            "depth": y.depth,
        }
        for x, y in pairs
        if x.correct and not y.correct
    ]
    lp = [(x.logprob_gold, y.logprob_gold) for x, y in pairs if x.logprob_gold is not None and y.logprob_gold is not None]
    lp_delta = lp_low = lp_high = None
    if lp:
        la = np.array([p[0] for p in lp], dtype=float)
        lb = np.array([p[1] for p in lp], dtype=float)
        if np.all(np.isfinite(la)) and np.all(np.isfinite(lb)):
            lci = stats.paired_bootstrap_ci(la, lb, confidence_level=confidence_level, n_resamples=n_resamples, seed=seed)
            lp_delta, lp_low, lp_high = lci.estimate, lci.low, lci.high
    return Comparison(
        cell=cell,
        task=task,
        n=len(pairs),
        baseline_score=base_score,
        candidate_score=cand_score,
        delta=estimate,
        ci_low=low,
        ci_high=high,
        confidence_level=confidence_level,
        ci_method=method,
        score_lost=lost,
        score_gained=gained,
        binary=binary,
        n_graded=n_graded,
        pvalue=pvalue,
        test=test,
        mcnemar_p=mc.pvalue,
        n_regressed=fl.n_regressed,
        n_improved=fl.n_improved,
        negative_flip_rate=fl.negative_rate,
        positive_flip_rate=fl.positive_rate,
        agreement=float(np.mean([x.answer == y.answer for x, y in pairs])),
        confusion_baseline=cb,
        confusion_candidate=cc,
        confusion_delta=cd,
        regressed=regressed,
        length=length,
        depth=depth,
        logprob_delta=lp_delta,
        logprob_ci_low=lp_low,
        logprob_ci_high=lp_high,
        n_logprob=len(lp),
        fidelity=fidelity.summarize(cand, 1 - confidence_level, seed or 0),
        **output_length_change(pairs),
        clusters=len(set(clusters)),
        design_effect=design,
        baseline_scores=a,
        candidate_scores=b,
    )


def adjust_pvalues(comparisons: Sequence[Comparison]) -> None:
    """Set ``p_holm`` and ``p_bh`` of each comparison, adjusting across the given family."""
    if not comparisons:
        return
    p = [c.pvalue for c in comparisons]
    for c, h, q in zip(comparisons, stats.holm(p), stats.benjamini_hochberg(p)):
        c.p_holm, c.p_bh = float(h), float(q)


def length_buckets(lengths: Iterable[int]) -> dict[int, int]:
    """Map measured prompt lengths to heatmap buckets.

    Lengths within 15% of a bucket's smallest member share the bucket (prompts
    built for one target length differ by a few tokens); a bucket is labeled by
    the median of its distinct lengths, rounded.
    """
    uniq = sorted({int(x) for x in lengths})
    out: dict[int, int] = {}
    group: list[int] = []

    def close(g: list[int]) -> None:
        label = int(round(float(np.median(g))))
        for x in g:
            out[x] = label

    for x in uniq:
        if group and x > group[0] * 1.15:
            close(group)
            group = []
        group.append(x)
    if group:
        close(group)
    return out


def depth_bucket(depth: float | None) -> float | None:
    return None if depth is None else round(float(depth), 2)


def _grid_key(b: ItemRecord, buckets: dict[int, int]) -> tuple[int | None, float | None]:
    return (buckets.get(int(b.length)) if b.length is not None else None, depth_bucket(b.depth))


#: :class:`Comparison`'s fields that runs made before output lengths were recorded leave ``None``.
_LENGTH_FIELDS = ("output_length_ratio", "output_length_delta")


def output_length_change(pairs: Sequence[tuple[ItemRecord, ItemRecord]]) -> dict[str, float | None]:
    """``output_length_ratio`` and ``output_length_delta`` of :class:`Comparison` (``None`` each where no pair
    recorded both lengths, ``metrics["new_tokens"]``; the ratio also where every baseline length is 0)."""
    lengths = [(x.metrics.get("new_tokens"), y.metrics.get("new_tokens")) for x, y in pairs]
    lengths = [(a, b) for a, b in lengths if a is not None and b is not None]
    ratios = [b / a for a, b in lengths if a > 0]
    return {"output_length_ratio": float(np.mean(ratios)) if ratios else None,
            "output_length_delta": float(np.mean([b - a for a, b in lengths])) if lengths else None}


@dataclass
class RunComparison:
    """A candidate run against its baseline.

    Attributes
    ----------
    baseline, candidate : RunInfo
    baseline_path, candidate_path : str
    source : str
        ``"kveval"`` or ``"lm-eval"``.
    n : int
        Paired items in all.
    overall : Comparison
        Every item pooled (cell ``"ALL"``; not part of the adjusted family).
    tasks : list of Comparison
        One per task; ``p_holm``/``p_bh`` adjusted across these.
    cells : list of Comparison
        One per (task, length bucket, depth) with a length or depth; adjusted
        across these separately.
    pairs : list of (ItemRecord, ItemRecord)
        The paired items (not serialized).
    """

    baseline: RunInfo
    candidate: RunInfo
    baseline_path: str
    candidate_path: str
    source: str
    n: int
    overall: Comparison
    tasks: list[Comparison]
    cells: list[Comparison]
    pairs: list[tuple[ItemRecord, ItemRecord]] = field(default_factory=list, repr=False, compare=False)

    def task(self, name: str) -> Comparison:
        for c in self.tasks:
            if c.task == name:
                return c
        raise KeyError(f"task {name!r} not in comparison (tasks: {', '.join(c.task for c in self.tasks)})")

    @property
    def task_names(self) -> list[str]:
        return [c.task for c in self.tasks]

    def grid(self) -> tuple[list[int | None], list[float | None], np.ndarray, np.ndarray]:
        """Mean score change per (length bucket, depth), all tasks pooled.

        Returns
        -------
        lengths, depths : list
            Sorted bucket labels (rows, columns).
        delta : ndarray
            ``len(lengths) x len(depths)``, NaN where a cell has no items.
        counts : ndarray
            Items per cell.
        """
        return delta_grid(self.pairs)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return _clean(
            {
                "baseline": asdict(self.baseline),
                "candidate": asdict(self.candidate),
                "baseline_path": self.baseline_path,
                "candidate_path": self.candidate_path,
                "source": self.source,
                "n": self.n,
                "overall": self.overall.to_dict(),
                "tasks": [c.to_dict() for c in self.tasks],
                "cells": [c.to_dict() for c in self.cells],
            }
        )


def delta_grid(pairs: Sequence[tuple[ItemRecord, ItemRecord]]):
    """Mean ``candidate - baseline`` score per (length bucket, depth) over the given pairs."""
    with_grid = [(b, c) for b, c in pairs if b.length is not None or b.depth is not None]
    buckets = length_buckets(b.length for b, _ in with_grid if b.length is not None)
    acc: dict[tuple, list[float]] = defaultdict(list)
    for b, c in with_grid:
        acc[_grid_key(b, buckets)].append(c.score - b.score)
    lengths = sorted({k[0] for k in acc}, key=lambda x: (x is None, x or 0))
    depths = sorted({k[1] for k in acc}, key=lambda x: (x is None, x or 0))
    delta = np.full((len(lengths), len(depths)), np.nan)
    counts = np.zeros((len(lengths), len(depths)), dtype=int)
    for (L, d), vals in acc.items():
        i, j = lengths.index(L), depths.index(d)
        delta[i, j] = float(np.mean(vals))
        counts[i, j] = len(vals)
    return lengths, depths, delta, counts


def check_settings(confidence_level: float, n_resamples: int) -> None:
    """Refuse an interval coverage outside (0, 1) or too few bootstrap resamples, in one line, before any run loads
    (zero resamples passed, leaving the bootstrap no resampled mean to draw bounds from)."""
    if not is_real(confidence_level) or not 0 < confidence_level < 1:
        raise UsageError(f"confidence level {confidence_level!r} must be in (0, 1), e.g. 0.95")
    if not is_whole(n_resamples) or n_resamples < MIN_RESAMPLES:
        raise UsageError(f"resamples={n_resamples!r} must be a whole number >= {MIN_RESAMPLES} (bootstrap resamples)")


def compare_runs(
    baseline: str | os.PathLike | Run,
    candidate: str | os.PathLike | Run,
    *,
    confidence_level: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int | None = 0,
    cells: bool = True,
    metric: str | dict[str, str] | None = None,
) -> RunComparison:
    """Load, pair and compare a candidate with its baseline.

    Parameters
    ----------
    baseline, candidate : path or Run
        kveval run folders or lm-eval ``--log_samples`` outputs (same kind).
    confidence_level : float, optional
        Two-sided bootstrap interval coverage (default 0.95).
    n_resamples : int, optional
        Bootstrap and permutation resamples per task (heatmap cells use at
        most :data:`CELL_RESAMPLES`).
    seed : int or None, optional
        Seed for every resampling step.
    cells : bool, optional
        Also compare each (task, length, depth) cell.
    metric : str or dict, optional
        lm-eval only: the metric to score by.

    Raises
    ------
    ResultFileError
        Unreadable results or runs that do not pair.
    UsageError
        ``n_resamples`` not a whole number of at least :data:`MIN_RESAMPLES`, or ``confidence_level`` outside (0, 1).
    """
    check_settings(confidence_level, n_resamples)
    base = load_run(baseline, metric=metric)
    cand = load_run(candidate, metric=metric)
    pairs = pair_runs(base, cand)
    attach_fidelity(cand.path, [c for _, c in pairs])  # the teacher-forced measurements, if the run has them
    kw = dict(confidence_level=confidence_level, n_resamples=n_resamples, seed=seed)
    by_task: dict[str, list] = defaultdict(list)
    for p in pairs:
        by_task[p[0].task].append(p)
    tasks = [compare_pairs(ps, cell=t, task=t, **kw) for t, ps in by_task.items()]
    adjust_pvalues(tasks)
    overall = compare_pairs(pairs, cell=ALL, task=ALL, **kw)
    cell_list: list[Comparison] = []
    if cells:
        buckets = length_buckets(b.length for b, _ in pairs if b.length is not None)
        by_cell: dict[tuple, list] = defaultdict(list)
        for p in pairs:
            b = p[0]
            if b.length is None and b.depth is None:
                continue
            by_cell[(b.task, *_grid_key(b, buckets))].append(p)
        ckw = dict(kw, n_resamples=min(n_resamples, CELL_RESAMPLES))
        for (t, L, d), ps in sorted(by_cell.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2] or 0)):
            name = f"{t}@len={L if L is not None else '-'},depth={d if d is not None else '-'}"
            cell_list.append(compare_pairs(ps, cell=name, task=t, length=L, depth=d, **ckw))
        adjust_pvalues(cell_list)
    return RunComparison(
        baseline=base.info,
        candidate=cand.info,
        baseline_path=str(base.path),
        candidate_path=str(cand.path),
        source=base.source,
        n=len(pairs),
        overall=overall,
        tasks=tasks,
        cells=cell_list,
        pairs=pairs,
    )


def adjust_sweep(comparisons: Sequence[RunComparison], tasks: Sequence[str] | None = None) -> list[Comparison]:
    """Holm/BH-adjust the task p-values across every candidate of a sweep, in place.

    Parameters
    ----------
    comparisons : sequence of RunComparison
        All candidates of the sweep.
    tasks : sequence of str, optional
        Only these tasks form the family (default: all).

    Returns
    -------
    list of Comparison
        The adjusted family.
    """
    family = [c for rc in comparisons for c in rc.tasks if tasks is None or c.task in tasks]
    adjust_pvalues(family)
    return family


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, tuples -> lists."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return _clean(x.tolist())
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return v if math.isfinite(v) else None
    return x
