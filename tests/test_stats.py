"""kveval.stats.significance against SciPy / statsmodels references and brute-force enumeration."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st
from scipy import optimize
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests

from kveval.stats import paired
from kveval.stats import significance as stats

RNG = np.random.default_rng(12345)
BASE_BIN = (RNG.random(60) < 0.7).astype(float)
CAND_BIN = BASE_BIN.copy()
CAND_BIN[[0, 3, 5, 8, 13, 21, 34]] = 0.0  # some regressions ...
CAND_BIN[[1, 2]] = 1.0  # ... and maybe improvements
BASE_GRADED = RNG.random(50)
CAND_GRADED = np.clip(BASE_GRADED - 0.05 + RNG.normal(0, 0.1, 50), 0, 1)


def _mean_diff(a, b, axis=-1):
    return np.mean(b - a, axis=axis)


@pytest.mark.parametrize("a,b", [(BASE_BIN, CAND_BIN), (BASE_GRADED, CAND_GRADED)])
@pytest.mark.parametrize("method", ["BCa", "percentile"])
def test_bootstrap_ci_equals_scipy(a, b, method):
    ci = stats.paired_bootstrap_ci(a, b, seed=7, n_resamples=2000, method=method)
    ref = st.bootstrap(
        (a, b), _mean_diff, paired=True, vectorized=True, n_resamples=2000, method=method, rng=np.random.default_rng(7)
    )
    assert ci.estimate == pytest.approx(np.mean(b - a), abs=1e-12)
    assert ci.low == pytest.approx(ref.confidence_interval.low, abs=1e-12)
    assert ci.high == pytest.approx(ref.confidence_interval.high, abs=1e-12)
    assert ci.low <= ci.estimate <= ci.high
    # same seed, same interval; another seed, another one
    assert stats.paired_bootstrap_ci(a, b, seed=7, n_resamples=2000, method=method) == ci


def test_bootstrap_degenerate_and_errors():
    ci = stats.paired_bootstrap_ci(BASE_BIN, BASE_BIN)
    assert (ci.estimate, ci.low, ci.high, ci.method) == (0.0, 0.0, 0.0, "degenerate")
    with pytest.raises(ValueError):
        stats.paired_bootstrap_ci([1, 0], [1])
    with pytest.raises(ValueError):
        stats.paired_bootstrap_ci([], [])
    with pytest.raises(ValueError):
        stats.paired_bootstrap_ci([1.0, np.nan], [1.0, 0.0])


@pytest.mark.parametrize(
    "table",
    [[[30, 12], [0, 18]], [[20, 5], [3, 12]], [[10, 1], [9, 5]], [[40, 0], [0, 20]], [[0, 7], [7, 0]], [[3, 25], [18, 4]]],
)
def test_mcnemar_equals_statsmodels(table):
    # table[i][j]: baseline i (0 right, 1 wrong) x candidate j (0 right, 1 wrong)
    base, cand = [], []
    for i in range(2):
        for j in range(2):
            base += [i == 0] * table[i][j]
            cand += [j == 0] * table[i][j]
    res = stats.mcnemar_exact(base, cand)
    assert (res.n_regressed, res.n_improved) == (table[0][1], table[1][0])
    assert res.pvalue == pytest.approx(mcnemar(np.array(table), exact=True).pvalue, abs=1e-9)
    if table[0][1] + table[1][0]:
        ref = st.binomtest(table[0][1], table[0][1] + table[1][0], 0.5).pvalue
        assert res.pvalue == pytest.approx(ref, abs=1e-12)
    else:
        assert res.pvalue == 1.0


def test_flips():
    base = [1, 1, 1, 0, 0, 1, 0, 1]
    cand = [1, 0, 0, 1, 0, 1, 0, 0]
    f = stats.flips(base, cand)
    assert (f.n, f.n_regressed, f.n_improved) == (8, 3, 1)
    assert f.negative_rate == pytest.approx(3 / 8) and f.positive_rate == pytest.approx(1 / 8)


@pytest.mark.parametrize(
    "p",
    [
        [0.01, 0.04, 0.03, 0.2, 0.001],
        [0.5, 0.5, 0.01],
        [0.0004, 0.9, 0.02, 0.02, 0.049, 1.0],
        [0.3],
        list(np.random.default_rng(1).random(25) ** 3),
    ],
)
def test_holm_and_bh_equal_statsmodels(p):
    np.testing.assert_allclose(stats.holm(p), multipletests(p, method="holm")[1], atol=1e-12)
    np.testing.assert_allclose(stats.benjamini_hochberg(p), multipletests(p, method="fdr_bh")[1], atol=1e-12)
    np.testing.assert_allclose(stats.benjamini_hochberg(p), st.false_discovery_control(p), atol=1e-15)


def test_holm_edge_cases():
    assert stats.holm([]).size == 0 and stats.benjamini_hochberg([]).size == 0
    with pytest.raises(ValueError):
        stats.holm([0.5, 1.5])


# ----------------------------------------------------------------------------- paired proportions (kveval.stats.paired)



def test_newcombe_hybrid_score_matches_the_tabulated_example():
    # Cavo et al. (2012) complete response before/after consolidation, table [[59, 6], [16, 80]]:
    # Newcombe's square-and-add (method 10) interval -0.0621 (-0.1186 to -0.0046), as tabulated by
    # Fagerland, Lydersen and Laake (Statistical Analysis of Contingency Tables, ch. 8) and their R package.
    low, high = paired.newcombe_interval(both=59, regressed=16, improved=6, neither=80)
    assert (round(low, 4), round(high, 4)) == (-0.1186, -0.0046)


def _tango_reference(b: int, c: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Tango's interval by brute force: restricted MLE by numerical maximisation, then root finding."""
    z = st.norm.ppf(0.5 + level / 2)

    def score(d):
        m = n - b - c
        lo, hi = max(0.0, -d) + 1e-12, min(1.0, (1 - d) / 2) - 1e-12
        nll = lambda p: -(b * np.log(p) + c * np.log(p + d) + m * np.log(max(1 - 2 * p - d, 1e-300)))  # noqa: E731
        p = optimize.minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
        return (c - b - n * d) / np.sqrt(n * (2 * p + d * (1 - d)))

    est = (c - b) / n
    low = optimize.brentq(lambda d: score(d) - z, -1 + 1e-9, est)
    high = optimize.brentq(lambda d: score(d) + z, est, 1 - 1e-9)
    return low, high


@pytest.mark.parametrize("b, c, n", [(16, 6, 161), (7, 1, 21), (12, 2, 50), (3, 3, 100), (30, 0, 300)])
def test_tango_interval_equals_brute_force_inversion(b, c, n):
    assert paired.tango_interval(b, c, n) == pytest.approx(_tango_reference(b, c, n), abs=2e-5)


def test_tango_identities():
    # at delta0 = 0 the score statistic is the asymptotic McNemar statistic
    assert paired.tango_z(5, 9, 100, 0.0) == pytest.approx((9 - 5) / np.sqrt(14), abs=1e-12)
    # zero discordance: [-z^2/(n+z^2), +z^2/(n+z^2)], never zero-width
    z2 = st.norm.ppf(0.975) ** 2
    for n in (1, 3, 30, 1000):
        low, high = paired.tango_interval(0, 0, n)
        assert low == pytest.approx(-z2 / (n + z2), abs=1e-9) and high == pytest.approx(z2 / (n + z2), abs=1e-9)
    # the margin test agrees with its interval
    t = paired.margin_test(20, 5, 200, 0.05, 0.05)
    assert (t.p_noninferior < 0.05) == (t.lower > -0.05) and (t.p_inferior < 0.05) == (t.upper < -0.05)


def test_planner_numbers():
    assert paired.plan(0.9, 0.0, 0.05).items == 52
    assert paired.plan(0.9, 0.05, 0.05).items == 245
    r = paired.plan(0.9, 0.0, 0.05, loss=0.10)
    assert r.goal == "fail" and paired.power(r.items, r.p_regress, r.p_improve, 0.05, 0.05, "fail") >= 0.8
    assert paired.power(r.items - 5, r.p_regress, r.p_improve, 0.05, 0.05, "fail") < 0.8
    # the closed form the gate quotes stays within 10% of the exact search
    for pb, pc in [(0.045, 0.045), (0.1, 0.0), (0.02, 0.01)]:
        exact, approx = paired.items_needed(pb, pc, 0.05), paired.items_needed_approx(pb, pc, 0.05)
        assert abs(approx - exact) <= 0.1 * exact
