"""Paired statistics for a candidate run against its baseline, item by item.

Every function takes the *baseline* outcome first and the *candidate* outcome
second, paired by position (item ``i`` of one array is item ``i`` of the other),
and reports changes as ``candidate - baseline``: a negative change is a loss.

The functions are pure: no files, no printing, deterministic for a given
``seed``. They wrap SciPy where SciPy has the test (bootstrap, binomial test,
Benjamini-Hochberg) and implement Holm by hand, because SciPy has no Holm
correction. The change of a task's score is :mod:`kveval.stats.paired`'s (Tango's
score interval and tests on the items' discordances, the planner); the
bootstrap here serves unbounded per-item changes (the gold answer's log-prob)
and tasks of mostly partial scores with enough items
(:func:`kveval.stats.comparison.uses_bootstrap`).
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats as _st

from kveval.errors import UsageError
from kveval.stats import paired

__all__ = [
    "Interval",
    "McNemarResult",
    "Flips",
    "paired_bootstrap_ci",
    "mcnemar_exact",
    "bootstrap_margin_test",
    "flips",
    "holm",
    "benjamini_hochberg",
]

ArrayLike = Sequence[float] | np.ndarray

#: Above this many paired items the bootstrap uses the percentile interval instead of BCa.
BCA_MAX_ITEMS = 10_000


@dataclass(frozen=True)
class Interval:
    """A point estimate with a confidence interval.

    Attributes
    ----------
    estimate : float
        The statistic on the observed data (mean of ``candidate - baseline``).
    low, high : float
        Interval bounds; ``high`` is ``inf`` for a one-sided lower bound.
    confidence_level : float
        Coverage of the interval, e.g. 0.95.
    method : str
        ``"BCa"``, ``"percentile"`` or ``"degenerate"`` (every paired difference
        is the same value, so the interval is that value).
    """

    estimate: float
    low: float
    high: float
    confidence_level: float
    method: str


@dataclass(frozen=True)
class McNemarResult:
    """Exact McNemar test on paired right/wrong outcomes.

    Attributes
    ----------
    n_regressed : int
        Items right at baseline and wrong under the candidate.
    n_improved : int
        Items wrong at baseline and right under the candidate.
    pvalue : float
        Two-sided exact p-value; 1.0 when there are no discordant pairs.
    """

    n_regressed: int
    n_improved: int
    pvalue: float


@dataclass(frozen=True)
class Flips:
    """How many individual answers changed correctness.

    Attributes
    ----------
    n : int
        Paired items.
    n_regressed, n_improved : int
        Right->wrong and wrong->right counts.
    negative_rate, positive_rate : float
        The same counts divided by ``n`` (0.0 when ``n`` is 0).
    """

    n: int
    n_regressed: int
    n_improved: int
    negative_rate: float
    positive_rate: float


def _paired(baseline: ArrayLike, candidate: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(baseline, dtype=float).ravel()
    b = np.asarray(candidate, dtype=float).ravel()
    if a.shape != b.shape:
        raise UsageError(f"paired samples differ in length: {a.size} baseline vs {b.size} candidate")
    if a.size == 0:
        raise UsageError("no paired items")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise UsageError("paired samples contain NaN or infinite values")
    return a, b


def _paired_bool(baseline: ArrayLike, candidate: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(baseline).ravel()
    b = np.asarray(candidate).ravel()
    if a.shape != b.shape:
        raise UsageError(f"paired samples differ in length: {a.size} baseline vs {b.size} candidate")
    return a.astype(bool), b.astype(bool)


def _discordant(baseline_correct: ArrayLike, candidate_correct: ArrayLike) -> tuple[int, int, int]:
    """``(items, regressed, improved)``: paired items, right->wrong and wrong->right counts."""
    a, b = _paired_bool(baseline_correct, candidate_correct)
    return int(a.size), int(np.sum(a & ~b)), int(np.sum(~a & b))


def _mean_diff(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(b - a, axis=axis)


_BOOTSTRAP_TAKES_RNG = "rng" in inspect.signature(_st.bootstrap).parameters


def _rng_kwargs(seed: int | None, takes_rng: bool) -> dict:
    # SciPy >= 1.15 takes `rng`; older releases call it `random_state`.
    gen = np.random.default_rng(seed)
    return {"rng": gen} if takes_rng else {"random_state": gen}


def _batch_for(n: int, n_resamples: int) -> int:
    # Bound the memory of one vectorized call (resamples x items, and BCa's jackknife).
    return int(max(1, min(n_resamples, 4_000_000 // max(n, 1))))


def paired_bootstrap_ci(
    baseline: ArrayLike,
    candidate: ArrayLike,
    *,
    confidence_level: float = 0.95,
    n_resamples: int = 9999,
    seed: int | None = 0,
    method: str = "BCa",
    alternative: str = "two-sided",
) -> Interval:
    """Paired bootstrap confidence interval of the mean change ``candidate - baseline``.

    Items are resampled as pairs (``scipy.stats.bootstrap((a, b), stat,
    paired=True)``), so item difficulty cancels out.

    Parameters
    ----------
    baseline, candidate : array_like
        Per-item scores, paired by position.
    confidence_level : float, optional
        Coverage of the interval (default 0.95).
    n_resamples : int, optional
        Bootstrap resamples (default 9999).
    seed : int or None, optional
        Seed of ``np.random.default_rng``; the same seed gives the same interval.
    method : {"BCa", "percentile", "basic"}, optional
        SciPy's interval method. When BCa cannot be computed (few distinct
        values), the percentile interval is returned instead; above
        ``BCA_MAX_ITEMS`` items BCa's jackknife (quadratic in the number of
        items) is skipped for the percentile interval too.
    alternative : {"two-sided", "greater", "less"}, optional
        ``"greater"`` gives a one-sided lower bound (``high`` is ``inf``).

    Returns
    -------
    Interval
        Estimate and bounds. When all paired differences are equal the
        bootstrap distribution is a single point and the interval is
        ``(d, d)`` (``method="degenerate"``).

    Raises
    ------
    ValueError
        On empty, unequal-length or non-finite input.
    """
    a, b = _paired(baseline, candidate)
    diff = b - a
    estimate = float(diff.mean())
    if np.all(diff == diff[0]):
        low = estimate if alternative != "less" else -math.inf
        high = estimate if alternative != "greater" else math.inf
        return Interval(estimate, low, high, confidence_level, "degenerate")

    def run(m: str):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DegenerateDataWarning, RuntimeWarning from BCa on tiny samples
            res = _st.bootstrap(
                (a, b),
                _mean_diff,
                paired=True,
                vectorized=True,
                n_resamples=n_resamples,
                batch=_batch_for(a.size, n_resamples),
                confidence_level=confidence_level,
                alternative=alternative,
                method=m,
                **_rng_kwargs(seed, _BOOTSTRAP_TAKES_RNG),
            )
        return float(res.confidence_interval.low), float(res.confidence_interval.high)

    used = method
    if method.lower() == "bca" and a.size > BCA_MAX_ITEMS:
        used = "percentile"
    low, high = run(used)
    if used.lower() == "bca" and (math.isnan(low) or math.isnan(high)):
        low, high = run("percentile")
        used = "percentile"
    return Interval(estimate, low, high, confidence_level, used)


def mcnemar_exact(baseline_correct: ArrayLike, candidate_correct: ArrayLike) -> McNemarResult:
    """Exact (binomial) McNemar test of paired right/wrong outcomes.

    Only discordant pairs carry information: under the null hypothesis an item
    that changed is equally likely to have regressed or improved, so the p-value
    is ``scipy.stats.binomtest(n_regressed, n_regressed + n_improved, 0.5)``.

    Parameters
    ----------
    baseline_correct, candidate_correct : array_like of bool
        Per-item correctness, paired by position.

    Returns
    -------
    McNemarResult
        Discordant counts and the two-sided p-value (1.0 when no item changed),
        equal to statsmodels' ``mcnemar(table, exact=True)``.
    """
    _, regressed, improved = _discordant(baseline_correct, candidate_correct)
    if regressed + improved == 0:
        return McNemarResult(regressed, improved, 1.0)
    p = float(_st.binomtest(regressed, regressed + improved, 0.5).pvalue)
    return McNemarResult(regressed, improved, min(1.0, p))


def flips(baseline_correct: ArrayLike, candidate_correct: ArrayLike) -> Flips:
    """Count answers that went right->wrong (negative) and wrong->right (positive).

    A compressed cache can keep the mean score while changing many individual
    answers; the negative flip rate shows that.

    Parameters
    ----------
    baseline_correct, candidate_correct : array_like of bool
        Per-item correctness, paired by position.

    Returns
    -------
    Flips
    """
    n, regressed, improved = _discordant(baseline_correct, candidate_correct)
    return Flips(n, regressed, improved, regressed / n if n else 0.0, improved / n if n else 0.0)


def holm(pvalues: ArrayLike) -> np.ndarray:
    """Holm step-down adjusted p-values (family-wise error control).

    The ``i``-th smallest of ``m`` p-values is multiplied by ``m - i`` (``i``
    from 0), then a running maximum keeps the order, and values are capped at 1.
    Equal to statsmodels ``multipletests(p, method="holm")[1]``.

    Parameters
    ----------
    pvalues : array_like
        Raw p-values (any order).

    Returns
    -------
    numpy.ndarray
        Adjusted p-values in the input order.
    """
    p = np.asarray(pvalues, dtype=float).ravel()
    m = p.size
    if m == 0:
        return p.copy()
    if np.any(np.isnan(p)) or np.any((p < 0) | (p > 1)):
        raise UsageError("p-values must be in [0, 1]")
    order = np.argsort(p, kind="mergesort")
    scaled = p[order] * (m - np.arange(m))
    adjusted_sorted = np.minimum(np.maximum.accumulate(scaled), 1.0)
    out = np.empty(m)
    out[order] = adjusted_sorted
    return out


def benjamini_hochberg(pvalues: ArrayLike) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (false discovery rate).

    Parameters
    ----------
    pvalues : array_like
        Raw p-values (any order).

    Returns
    -------
    numpy.ndarray
        ``scipy.stats.false_discovery_control(p, method="bh")``, input order.
    """
    p = np.asarray(pvalues, dtype=float).ravel()
    if p.size == 0:
        return p.copy()
    return np.asarray(_st.false_discovery_control(p, method="bh"), dtype=float)


def bootstrap_margin_test(
    baseline: ArrayLike,
    candidate: ArrayLike,
    margin: float,
    *,
    alpha: float = 0.05,
    n_resamples: int = 9999,
    seed: int | None = 0,
):
    """Mostly graded scores of enough items: the mean change tested against ``-margin`` with the paired bootstrap.

    Returns a :class:`kveval.stats.paired.MarginTest`: ``lower``/``upper`` are the
    percentile bounds of the ``1 - 2 alpha`` interval, ``p_noninferior`` the
    share of resampled means at or below ``-margin`` and ``p_inferior`` the share
    at or above it, so ``p < alpha`` agrees with the bound. When every
    difference is the same value the bootstrap has no spread; the bounds are
    then widened by Tango's zero-discordance bound (a difference bounded in
    [-1, 1] that never varied is no more certain than a right/wrong task with
    no flip), never a zero-width interval.
    """
    a, b = _paired(baseline, candidate)
    diff = b - a
    est = float(diff.mean())
    if np.all(diff == diff[0]):
        zl, zh = paired.tango_interval(0, 0, a.size, confidence_level=1 - 2 * alpha)
        lower, upper = max(-1.0, est + zl), min(1.0, est + zh)
        p_ni = 0.0 if lower > -margin else 1.0
        p_inf = 0.0 if upper < -margin else 1.0
        return paired.MarginTest(est, lower, upper, float(margin), float(alpha), p_ni, p_inf)
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    step = _batch_for(a.size, n_resamples)
    for start in range(0, n_resamples, step):
        k = min(step, n_resamples - start)
        idx = rng.integers(0, a.size, size=(k, a.size))
        means[start : start + k] = diff[idx].mean(axis=1)
    lower, upper = (float(x) for x in np.quantile(means, [alpha, 1 - alpha]))
    p_ni = float((np.sum(means <= -margin) + 1) / (n_resamples + 1))
    p_inf = float((np.sum(means >= -margin) + 1) / (n_resamples + 1))
    return paired.MarginTest(est, lower, upper, float(margin), float(alpha), p_ni, p_inf)

