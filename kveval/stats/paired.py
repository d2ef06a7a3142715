"""Score intervals, margin tests and sample sizes for paired right/wrong outcomes.

A candidate and its baseline answer the same ``n`` items. Only the discordant
items carry information about the change of accuracy:

* ``regressed`` (``b``): right at baseline, wrong under the candidate;
* ``improved`` (``c``): wrong at baseline, right under the candidate.

The change is ``delta = (c - b) / n`` (candidate - baseline accuracy; a loss is
negative). Tango's asymptotic score statistic (Tango 1998, Stat Med
17:891-908) tests ``delta = delta0`` for any ``delta0`` with the variance
estimated under that hypothesis (restricted maximum likelihood). Inverting it
gives Tango's score interval, which stays valid with zero discordant items
(``b = c = 0`` gives ``[-z^2/(n+z^2), z^2/(n+z^2)]``, never a zero-width
interval), and testing at ``delta0 = -margin`` gives the non-inferiority and
inferiority tests that agree with that interval by construction. At
``delta0 = 0`` the statistic is the asymptotic McNemar statistic
``(c - b) / sqrt(b + c)``.

Scores between 0 and 1 (partial credit) enter as fractional counts
(:func:`score_discordance`): an item whose score goes from ``a`` to ``b`` is
``a - b`` of a regression or ``b - a`` of an improvement, as if each score were
the chance of a right answer and both runs drew it with one coin. ``(c - b) / n``
is then the change of the mean score, and the interval's per-item variance
``|d| - delta^2`` bounds the scores' own ``d^2 - delta^2`` from above (``|d| >= d^2``
for ``|d| <= 1``): conservative on graded items, exact Tango on 0/1 ones, and
never as narrow as a bootstrap of two or three equal differences.

Newcombe's hybrid score interval (method 10 of Newcombe 1998, Stat Med
17:2635-2650) is provided as a cross-check.

Items that share a context (``multi_turn``'s turns, requests under one system prompt) are not independent: their
flips go together, and a count of them overstates the evidence (Miller 2024, "Adding error bars to evals").
:func:`design_effect` measures how much (the cluster-robust variance of the mean change over the independent one,
as in Obuchowski 1998, Biometrics 54:1581-1587), and every test here then runs on the counts divided by it: the
Rao-Scott adjustment (Rao and Scott 1992, Biometrics 48:577-585), which keeps Tango's interval valid at zero
discordance and equals the unclustered test exactly where every item is its own cluster.

Everything here is pure arithmetic on counts (no files, no randomness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize
from scipy import stats as _st

from kveval.errors import UsageError
from kveval.values import is_real

__all__ = [
    "MarginTest",
    "PlanResult",
    "design_effect",
    "min_detectable_loss",
    "items_needed",
    "items_needed_approx",
    "margin_test",
    "newcombe_interval",
    "plan",
    "power",
    "score_discordance",
    "tango_interval",
    "tango_pvalue",
    "tango_z",
    "wilson_interval",
]

_EDGE = 1e-12


def _check_counts(regressed: float, improved: float, n: int) -> None:
    if n <= 0:
        raise UsageError(f"need at least one paired item, got n={n}")
    if regressed < 0 or improved < 0 or regressed + improved > n + 1e-9:
        raise UsageError(f"discordant counts regressed={regressed}, improved={improved} do not fit n={n}")


def score_discordance(baseline, candidate) -> tuple[float, float]:
    """Fractional regressed and improved counts of paired scores in [0, 1]: the summed falls and rises.

    For 0/1 scores these are the right->wrong and wrong->right counts; ``(improved - regressed) / n`` is the change
    of the mean score. Every function here takes them where it takes counts.
    """
    a, b = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    change = b - a
    return float(np.sum(np.clip(-change, 0, None))), float(np.sum(np.clip(change, 0, None)))


def tango_z(regressed, improved, n, delta0):
    """Tango's score statistic for ``H0: delta = delta0`` (vectorized over counts).

    Parameters
    ----------
    regressed, improved : float or array of float
        Right->wrong (``b``) and wrong->right (``c``) items, or the fractional counts of graded scores
        (:func:`score_discordance`).
    n : int or array of int
        Paired items.
    delta0 : float
        Hypothesised change of accuracy, in (-1, 1).

    Returns
    -------
    float or ndarray
        ``(c - b - n delta0) / sqrt(n (2 p_b + delta0 (1 - delta0)))`` with ``p_b``
        the restricted MLE of the right->wrong probability under ``H0``. Large
        positive values say the change is above ``delta0``. 0 where the
        variance vanishes (no discordant item and ``delta0 = 0``).
    """
    b = np.asarray(regressed, dtype=float)
    c = np.asarray(improved, dtype=float)
    n = np.asarray(n, dtype=float)
    d = float(delta0)
    # Restricted MLE of p_b with p_c = p_b + d: root of 2n p^2 + B p + C = 0 (Tango 1998, eq. 4).
    B = -(b + c) + d * (2 * n + b - c)
    C = -b * d * (1 - d)
    p_b = (-B + np.sqrt(np.maximum(B * B - 8 * n * C, 0.0))) / (4 * n)
    var = n * (2 * p_b + d * (1 - d))
    num = c - b - n * d
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(var > 1e-15, num / np.sqrt(np.maximum(var, 1e-300)), 0.0)
    return float(z) if z.ndim == 0 else z


def tango_pvalue(regressed: float, improved: float, n: int) -> float:
    """Two-sided p-value of "no change" (``delta = 0``) by Tango's statistic, ``(c - b) / sqrt(b + c)``: the test the
    interval of :func:`tango_interval` inverts at 0, so ``p < 1 - confidence`` exactly when it excludes 0. 1.0
    when nothing changed."""
    _check_counts(regressed, improved, n)
    if regressed + improved <= 0:
        return 1.0
    return float(min(1.0, 2 * _st.norm.sf(abs(tango_z(regressed, improved, n, 0.0)))))


def tango_interval(regressed: float, improved: float, n: int, confidence_level: float = 0.95) -> tuple[float, float]:
    """Tango's two-sided score interval for the change of accuracy ``(c - b) / n``.

    The bounds solve ``tango_z(delta0) = +-z`` (``z`` the two-sided normal
    quantile); each bound is also a one-sided ``1 - (1 - confidence_level) / 2``
    bound. Returns ``(low, high)`` within ``[-1, 1]``.
    """
    _check_counts(regressed, improved, n)
    if not 0 < confidence_level < 1:
        raise UsageError(f"confidence_level must be in (0, 1), got {confidence_level}")
    z = float(_st.norm.ppf(0.5 + confidence_level / 2))
    est = (improved - regressed) / n

    def f(d: float, target: float) -> float:
        return tango_z(regressed, improved, n, d) - target

    lo_edge, hi_edge = -1 + _EDGE, 1 - _EDGE
    low = -1.0 if f(lo_edge, z) <= 0 else optimize.brentq(f, lo_edge, min(est, hi_edge), args=(z,), xtol=1e-12)
    high = 1.0 if f(hi_edge, -z) >= 0 else optimize.brentq(f, max(est, lo_edge), hi_edge, args=(-z,), xtol=1e-12)
    return float(low), float(high)


def wilson_interval(successes: int, n: int, confidence_level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of one proportion."""
    z = float(_st.norm.ppf(0.5 + confidence_level / 2))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def newcombe_interval(both: int, regressed: int, improved: int, neither: int, confidence_level: float = 0.95) -> tuple[float, float]:
    """Newcombe's hybrid score interval (method 10) for the change ``(c - b) / n``.

    Parameters
    ----------
    both, regressed, improved, neither : int
        Items right in both runs, right->wrong, wrong->right, wrong in both.

    Returns
    -------
    (low, high)
        Bounds for candidate - baseline accuracy (Wilson intervals of the two
        marginal accuracies combined with Newcombe's phi correction).
    """
    n = both + regressed + improved + neither
    _check_counts(regressed, improved, n)
    p1, p2 = (both + improved) / n, (both + regressed) / n  # candidate, baseline accuracy
    l1, u1 = wilson_interval(both + improved, n, confidence_level)
    l2, u2 = wilson_interval(both + regressed, n, confidence_level)
    # Newcombe's phi from the 2x2 table (a=both, b, c, d=neither), truncated as in the paper.
    a, d = both, neither
    prod = (a + improved) * (regressed + d) * (a + regressed) * (improved + d)
    cross = a * d - improved * regressed
    if prod == 0:
        phi = 0.0
    else:
        corrected = cross - n / 2 if cross > n / 2 else (cross if cross < 0 else 0.0)
        phi = corrected / math.sqrt(prod)
    dd = p1 - p2
    low = dd - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    high = dd + math.sqrt(max((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2, 0.0))
    return max(-1.0, low), min(1.0, high)


@dataclass(frozen=True)
class MarginTest:
    """One task's change of accuracy tested against ``-margin`` (Tango score tests).

    Attributes
    ----------
    delta : float
        Observed change ``(improved - regressed) / n``.
    lower, upper : float
        One-sided ``1 - alpha`` bounds (together a ``1 - 2 alpha`` interval).
    margin, alpha : float
    p_noninferior : float
        One-sided p-value of ``H0: delta <= -margin``; below ``alpha`` exactly
        when ``lower > -margin`` (non-inferiority shown).
    p_inferior : float
        One-sided p-value of ``H0: delta >= -margin``; below ``alpha`` exactly
        when ``upper < -margin`` (a loss larger than the margin shown).
    """

    delta: float
    lower: float
    upper: float
    margin: float
    alpha: float
    p_noninferior: float
    p_inferior: float


def margin_test(regressed: float, improved: float, n: int, margin: float, alpha: float = 0.05) -> MarginTest:
    """Test the change of accuracy against ``-margin`` both ways (see :class:`MarginTest`)."""
    _check_counts(regressed, improved, n)
    if not 0 <= margin < 1:
        raise UsageError(f"margin must be in [0, 1), got {margin}")
    if not 0 < alpha < 0.5:
        raise UsageError(f"alpha must be in (0, 0.5), got {alpha}")
    low, high = tango_interval(regressed, improved, n, confidence_level=1 - 2 * alpha)
    z = tango_z(regressed, improved, n, -margin) if margin > 0 else (improved - regressed) / math.sqrt(max(regressed + improved, 1))
    return MarginTest(
        delta=(improved - regressed) / n,
        lower=low,
        upper=high,
        margin=float(margin),
        alpha=float(alpha),
        p_noninferior=float(_st.norm.sf(z)),
        p_inferior=float(_st.norm.cdf(z)),
    )


# ----------------------------------------------------------------------------- clusters


def design_effect(lost, gained, clusters) -> float:
    """How many independent items' worth of variance each item carries when items share clusters (>= 1).

    ``lost``/``gained``: per-item fractional discordances (:func:`score_discordance` of one item each: 1/0 for a
    right->wrong item); ``clusters``: per-item cluster ids (one id per shared context). The design effect is the
    cluster-robust variance of the mean change, ``K/(K-1) sum_k (D_k - delta n_k)^2 / n^2`` over the ``K``
    clusters' summed changes ``D_k`` of ``n_k`` items (Obuchowski 1998), over the independent items' variance
    ``n/(n-1) sum_i (d_i - delta)^2 / n^2``. It is 1 where every item is its own cluster or nothing changed, never
    below 1 (clustering is not taken to help), at most the largest cluster's size, and ``n`` (one item's worth)
    where one cluster holds every item.
    """
    d = np.asarray(gained, dtype=float) - np.asarray(lost, dtype=float)
    ids = list(clusters)
    n = d.size
    if n != len(ids):
        raise UsageError(f"design_effect: {n} items but {len(ids)} cluster ids")
    _, index = np.unique(np.asarray(ids, dtype=object).astype(str), return_inverse=True)
    k = int(index.max()) + 1 if n else 0
    if n < 2 or k == n:
        return 1.0
    mean = d.mean()
    independent = float(np.sum((d - mean) ** 2)) * n / (n - 1)
    if independent <= 1e-15:
        return 1.0
    if k < 2:
        return float(n)
    totals = np.bincount(index, weights=d, minlength=k)
    sizes = np.bincount(index, minlength=k)
    clustered = float(np.sum((totals - mean * sizes) ** 2)) * k / (k - 1)
    # Equal clusters of m items cannot carry more than m items' variance each (intra-cluster correlation <= 1): a
    # larger ratio is the estimate's own noise with few clusters.
    return float(min(int(sizes.max()), max(1.0, clustered / independent)))


def min_detectable_loss(n: float, p_improve: float, margin: float, alpha: float = 0.05, power_goal: float = 0.8,
                        design_effect: float = 1.0) -> float | None:
    """The smallest true loss of accuracy that ``n`` items would show as a FAIL with ``power_goal`` probability.

    The alternative keeps the observed wrong->right rate ``p_improve`` and adds the loss to the right->wrong rate
    (``p_regress = p_improve + loss``); a FAIL is the one-sided Tango test showing the change below ``-margin``
    (:func:`power`, ``goal="fail"``), on ``n / design_effect`` effective items. A PASS or an INCONCLUSIVE of that
    task could have missed a loss below this. ``None`` where no loss up to ``1 - p_improve`` is detected that often
    (too few items).
    """
    if not 0 < alpha < 0.5 or not 0 < power_goal < 1:
        raise UsageError(f"min_detectable_loss: alpha={alpha} must be in (0, 0.5) and power={power_goal} in (0, 1)")
    effective = max(1, int(round(n / max(design_effect, 1.0))))
    top = 1.0 - p_improve
    if top <= margin or power(effective, p_improve + top, p_improve, margin, alpha, goal="fail") < power_goal:
        return None
    low, high = margin, top  # power rises with the loss: bisect for where it reaches the goal
    for _ in range(40):
        mid = (low + high) / 2
        if power(effective, p_improve + mid, p_improve, margin, alpha, goal="fail") >= power_goal:
            high = mid
        else:
            low = mid
        if high - low < 1e-4:
            break
    return float(high)


# ----------------------------------------------------------------------------- planning


def _count_grid(n: int, p_b: float, p_c: float, k_sd: float = 8.0):
    """Discordant counts (b, c) covering the multinomial's mass, with their probabilities."""

    def rng(p: float) -> np.ndarray:
        if p <= 0:
            return np.array([0])
        sd = math.sqrt(n * p * (1 - p))
        lo = max(0, int(n * p - k_sd * sd - 2))
        hi = min(n, int(n * p + k_sd * sd + 3))
        return np.arange(lo, hi + 1)

    bs, cs = rng(p_b), rng(p_c)
    B, C = np.meshgrid(bs, cs, indexing="ij")
    # b ~ Bin(n, p_b); c | b ~ Bin(n - b, p_c / (1 - p_b)).
    pb = _st.binom.pmf(B, n, p_b)
    q = p_c / (1 - p_b) if p_b < 1 else 0.0
    pc = _st.binom.pmf(C, np.maximum(n - B, 0), q)
    return B, C, pb * pc * (B + C <= n)


def power(n: int, p_regress: float, p_improve: float, margin: float, alpha: float = 0.05, goal: str = "pass") -> float:
    """Probability that ``n`` items decide a task (exact sum over the discordant counts).

    Parameters
    ----------
    n : int
        Items per task.
    p_regress, p_improve : float
        True right->wrong and wrong->right probabilities per item.
    margin, alpha : float
        The gate's margin and one-sided error rate.
    goal : {"pass", "fail"}
        ``"pass"``: show non-inferiority (lower bound above ``-margin``);
        ``"fail"``: show a loss beyond the margin (upper bound below it).
    """
    B, C, P = _count_grid(int(n), p_regress, p_improve)
    z = tango_z(B, C, n, -margin)
    crit = float(_st.norm.ppf(1 - alpha))
    hit = z > crit if goal == "pass" else z < -crit
    return float(np.sum(P * hit))


def _restricted_p_regress(p_regress: float, p_improve: float, delta0: float) -> float:
    """Tango's restricted MLE of the right->wrong probability under ``delta = delta0``, from proportions."""
    B = -(p_regress + p_improve) + delta0 * (2 + p_regress - p_improve)
    C = -p_regress * delta0 * (1 - delta0)
    return (-B + math.sqrt(max(B * B - 8 * C, 0.0))) / 4


def items_needed_approx(
    p_regress: float, p_improve: float, margin: float, alpha: float = 0.05, target_power: float = 0.8
) -> int | None:
    """Closed-form items per task for the Tango margin test (Nam 1997 style), ``None`` on the margin.

    ``n = (z_a sqrt(V0) + z_b sqrt(V1))^2 / (delta + margin)^2`` with ``V1`` the
    variance of one item's change under the expected rates and ``V0`` the one
    Tango's test assumes at ``delta = -margin``. Within a few items of
    :func:`items_needed`, and instant: the gate quotes it for every
    INCONCLUSIVE task.
    """
    delta = p_improve - p_regress
    gap = abs(delta + margin)
    if gap < 1e-9:
        return None
    z_a, z_b = float(_st.norm.ppf(1 - alpha)), float(_st.norm.ppf(target_power))
    v1 = max(p_regress + p_improve - delta * delta, 0.0)
    pb0 = _restricted_p_regress(p_regress, p_improve, -margin)
    v0 = max(2 * pb0 - margin * (1 + margin), 1e-12)
    return max(1, math.ceil((z_a * math.sqrt(v0) + z_b * math.sqrt(v1)) ** 2 / gap**2))


def items_needed(
    p_regress: float, p_improve: float, margin: float, alpha: float = 0.05, target_power: float = 0.8, max_items: int = 1_000_000
) -> int | None:
    """Fewest items per task that decide with ``target_power`` (``None`` when the change sits on the margin).

    The goal follows the expected change ``p_improve - p_regress``: above
    ``-margin`` the task should PASS (non-inferiority), below it FAIL.
    """
    delta = p_improve - p_regress
    if abs(delta + margin) < 1e-9:
        return None
    goal = "pass" if delta > -margin else "fail"
    if p_regress + p_improve == 0:  # zero churn: the bound is -z^2/(n+z^2), no sampling noise
        z_a = float(_st.norm.ppf(1 - alpha))
        return max(1, math.ceil(z_a * z_a * (1 - margin) / margin)) if margin > 0 else None
    guess = items_needed_approx(p_regress, p_improve, margin, alpha, target_power) or 1
    if guess > max_items:  # past the exact search's reach (its grid grows with n): the closed form, close there
        return guess
    # Power is not monotone in n (lattice effects): find the first n from which it stays above target.
    lo, hi = 1, max(2, guess)
    while power(hi, p_regress, p_improve, margin, alpha, goal) < target_power:
        lo, hi = hi, hi * 2
        if hi > max_items:
            return guess
    while lo < hi:  # binary search on a power curve that is monotone apart from small lattice wiggles
        mid = (lo + hi) // 2
        if power(mid, p_regress, p_improve, margin, alpha, goal) >= target_power:
            hi = mid
        else:
            lo = mid + 1
    return hi


#: The most items per task :func:`plan` answers with: past it a margin is too small for any run to show.
MAX_PLANNED_ITEMS = 10**9


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer for one scenario (see :func:`plan`)."""

    baseline_accuracy: float
    churn: float
    loss: float
    margin: float
    alpha: float
    target_power: float
    p_regress: float
    p_improve: float
    goal: str
    items: int | None


def plan(
    baseline_accuracy: float,
    churn: float,
    margin: float,
    alpha: float = 0.05,
    *,
    loss: float = 0.0,
    target_power: float = 0.8,
) -> PlanResult:
    """Items per task needed to decide a candidate.

    Parameters
    ----------
    baseline_accuracy : float
        Share of items the baseline answers right, in (0, 1].
    churn : float
        Share of the baseline's right items that flip to wrong while as many
        items flip wrong->right (no net change): ``p_regress = p_improve =
        baseline_accuracy * churn``.
    margin, alpha : float
        The gate's margin and one-sided error rate.
    loss : float, optional
        Expected net loss of accuracy on top of the churn (added right->wrong
        flips). With ``loss > margin`` the answer is the items needed to FAIL.
    target_power : float, optional
        Probability of a decision (default 0.8).
    """
    for name, value, low, high, closed in (
        ("baseline accuracy", baseline_accuracy, 0, 1, "(0, 1]"), ("churn", churn, 0, 1, "[0, 1]"),
        ("margin", margin, 0, 1, "(0, 1)"), ("alpha (one-sided error rate)", alpha, 0, 0.5, "(0, 0.5)"),
        ("power", target_power, 0, 1, "(0, 1)"), ("loss", loss, 0, 1, "[0, 1)"),
    ):
        inside = is_real(value) and (low <= value if closed[0] == "[" else low < value) and (
            value <= high if closed[-1] == "]" else value < high)
        if not inside:
            raise UsageError(f"{name} must be in {closed}, got {value}")
    p_improve = min(baseline_accuracy * churn, 1 - baseline_accuracy) if baseline_accuracy < 1 else 0.0
    p_regress = baseline_accuracy * churn + loss
    if p_regress > baseline_accuracy:
        raise UsageError(f"churn {churn} and loss {loss} flip more than the baseline's right items")
    goal = "pass" if p_improve - p_regress > -margin else "fail"
    n = items_needed(p_regress, p_improve, margin, alpha, target_power)
    if n is not None and n > MAX_PLANNED_ITEMS:
        raise UsageError(f"margin {margin:g} would need about {n:.2g} items per task (churn {churn:g}, power "
                         f"{target_power:g}): more than {MAX_PLANNED_ITEMS:.0e}, which no run holds; give a larger margin")
    return PlanResult(baseline_accuracy, churn, loss, margin, alpha, target_power, p_regress, p_improve, goal, n)
