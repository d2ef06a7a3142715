"""Statistics of teacher-forced fidelity (:mod:`kveval.runs.fidelity`): bounds on the mean KL, per-run summaries,
and how many items separate two candidates."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from kveval.errors import UsageError
from kveval.runs.fidelity import FIELDS, METRIC_KEY


def kl_bounds(values: Sequence[float], alpha: float = 0.05, n_resamples: int = 9999, seed: int = 0) -> tuple[float, float]:
    """One-sided ``1 - alpha`` lower and upper bounds of the mean per-item KL (bootstrap percentiles; nats).

    Values that are all equal (one item, or ``none`` against itself) have no
    spread: both bounds are that value. An empty list gives ``(0, inf)``:
    nothing shown either way.
    """
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return 0.0, math.inf
    if np.all(x == x[0]):
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_resamples, x.size))].mean(axis=1)
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def fidelity_values(records: Iterable, key: str = "kl_mean") -> list[float]:
    """The attached per-item ``key`` (one of :data:`FIELDS`) of the records that have fidelity measurements."""
    return [r.metrics[METRIC_KEY][key] for r in records if METRIC_KEY in r.metrics]


def summarize(records: Iterable, alpha: float = 0.05, seed: int = 0) -> dict[str, float] | None:
    """Mean per-item fidelity numbers of ``records`` (their attached ``metrics["fidelity"]``), or ``None`` if none has them.

    Keys: ``n``, the means of :data:`FIELDS`, ``kl_max_item`` (largest
    per-position KL of any item), ``kl_mean_lower`` and ``kl_mean_upper``
    (the one-sided ``1 - alpha`` bootstrap bounds of the mean per-item ``kl_mean``).
    """
    rows = [r.metrics[METRIC_KEY] for r in records if METRIC_KEY in r.metrics]
    if not rows:
        return None
    out: dict[str, float] = {"n": len(rows)}
    for key in FIELDS:
        out[key] = float(np.mean([row[key] for row in rows]))
    out["kl_max_item"] = float(max(row["kl_max"] for row in rows))
    out["kl_mean_lower"], out["kl_mean_upper"] = kl_bounds([row["kl_mean"] for row in rows], alpha, seed=seed)
    return out


def items_to_separate(a: Sequence[float], b: Sequence[float], test: str, *, power: float = 0.8, alpha: float = 0.05,
                      sizes: Sequence[int] = (5, 10, 15, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 1000),
                      n_resamples: int = 400, seed: int = 0) -> int | None:
    """Smallest item count in ``sizes`` at which a paired test separates ``a`` from ``b`` in ``power`` of resamples.

    ``a``, ``b``: per-item values of two policies on the same items (0/1
    correctness for ``test="mcnemar"``, per-item ``kl_mean`` for
    ``test="wilcoxon"``, signed-rank with the normal approximation). Items are
    resampled with replacement to each size; a resample counts when the
    two-sided test gives ``p < alpha``. Returns
    ``None`` when even the largest size does not reach ``power``.
    """
    from scipy import stats as st

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.size == 0:
        raise UsageError("items_to_separate: give two equally long, non-empty per-item lists")
    if test not in ("mcnemar", "wilcoxon"):
        raise UsageError(f"items_to_separate: test={test!r}; use 'mcnemar' or 'wilcoxon'")
    rng = np.random.default_rng(seed)
    for n in sizes:
        pick = rng.integers(0, x.size, size=(n_resamples, n))
        xa, yb = x[pick], y[pick]
        if test == "mcnemar":  # exact two-sided McNemar: binomial on the discordant pairs
            k, m = np.sum((xa > 0.5) & (yb < 0.5), axis=1), np.sum((xa < 0.5) & (yb > 0.5), axis=1)
            p = np.minimum(1.0, 2 * st.binom.cdf(np.minimum(k, m), k + m, 0.5))
            p[k + m == 0] = 1.0
        else:
            d = yb - xa
            p = np.ones(n_resamples)
            moved = np.any(d != 0, axis=1)
            if moved.any():  # the normal approximation: scipy's small-n default with ties is a slow permutation test
                with np.errstate(invalid="ignore", divide="ignore"):
                    p[moved] = np.asarray(st.wilcoxon(d[moved], axis=1, method="approx").pvalue, dtype=float)
            p[np.isnan(p)] = 1.0
        if np.sum(p < alpha) >= power * n_resamples:
            return int(n)
    return None
