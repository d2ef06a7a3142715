"""Group-sequential designs (kveval.stats.sequential): published boundaries, spending, refusals, and the error rates
of simulated runs through the per-look decision (seeded, vectorised, a few seconds).

Published values checked:

* classic Pocock constants, two-sided alpha 0.05, K = 2..5 equal looks: 2.178, 2.289, 2.361, 2.413 (Pocock 1977,
  Biometrika 64:191-199, Table 1; Jennison and Turnbull 2000, Table 2.1);
* classic O'Brien-Fleming constants (the last look's boundary), same settings: 1.977, 2.004, 2.024, 2.040 (O'Brien
  and Fleming 1979; Jennison and Turnbull 2000, Table 2.3);
* Lan-DeMets O'Brien-Fleming-type spending, one-sided 0.025, K = 5 equal looks: 4.877, 3.357, 2.680, 2.290, 2.031
  (gsDesign's ``sfLDOF`` design, ``gsDesign(k=5, test.type=1, sfu=sfLDOF)``, as printed in its documentation);
* the same spending at one-sided 0.05 with K = 4: 3.7496, 2.5399, 2.0160, 1.7201 (SeqBounds.jl's README, computed
  on a coarser grid, so to 1e-3).

The spending is also checked independently of the integration, by scipy's multivariate normal CDF (Genz).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as _st

from kveval.errors import ConfigError, UsageError
from kveval.stats import paired
from kveval.stats import sequential as seq
from kveval.stats.sequential import SequentialDesign


def _equal(k: int) -> list[float]:
    return [i / k for i in range(1, k + 1)]


# ----------------------------------------------------------------------------- published boundaries


@pytest.mark.parametrize("k,pocock,obf", [(2, 2.178, 1.977), (3, 2.289, 2.004), (4, 2.361, 2.024), (5, 2.413, 2.040)])
def test_classic_pocock_and_obrien_fleming_constants(k, pocock, obf):
    p = seq.constant_shape_boundaries(_equal(k), "pocock", 0.05)
    o = seq.constant_shape_boundaries(_equal(k), "obrien-fleming", 0.05)
    assert p.upper[0] == pytest.approx(pocock, abs=5e-4)
    assert o.upper[-1] == pytest.approx(obf, abs=5e-4)
    assert o.upper[0] == pytest.approx(obf * math.sqrt(k), abs=1e-3)  # the shape C / sqrt(t_k)
    assert p.lower == tuple(-u for u in p.upper)


def test_lan_demets_obrien_fleming_spending_k5_one_sided_0025():
    b = seq.spending_boundaries(_equal(5), "obrien-fleming", 0.025)
    assert np.allclose(b.upper, [4.877, 3.357, 2.680, 2.290, 2.031], atol=5e-4)
    assert b.lower == (-40.0,) * 5  # one-sided: no lower boundary


def test_lan_demets_obrien_fleming_spending_k4_one_sided_005():
    b = seq.spending_boundaries(_equal(4), "obrien-fleming", 0.05)
    assert np.allclose(b.upper, [3.7496, 2.5399, 2.0160, 1.7201], atol=1e-3)


# ----------------------------------------------------------------------------- spending


SPENDINGS = ["obrien-fleming", "pocock", "hsd(gamma=-4)", "hsd(gamma=1)", "hsd(gamma=0)"]


@pytest.mark.parametrize("spending", SPENDINGS)
def test_each_look_spends_what_the_function_says_and_all_of_alpha(spending):
    t = [0.2, 0.45, 0.7, 1.0]  # unequal looks
    f = seq.parse_spending(spending)
    b = seq.spending_boundaries(t, f, 0.05, f, 0.025)
    up, down = seq.crossing_probabilities(b)
    assert np.allclose(up, np.diff(f.spent(np.array(t), 0.05), prepend=0.0), atol=1e-8)
    assert np.allclose(down, np.diff(f.spent(np.array(t), 0.025), prepend=0.0), atol=1e-8)
    assert up.sum() == pytest.approx(0.05, abs=1e-8) and down.sum() == pytest.approx(0.025, abs=1e-8)


@pytest.mark.parametrize("spending", ["obrien-fleming", "pocock", "hsd(gamma=-2)"])
def test_spending_agrees_with_the_multivariate_normal_cdf(spending):
    """Independent of the integration: P(no upper crossing by look k) = 1 - alpha(t_k), Corr(Z_i, Z_j) = sqrt(t_i/t_j)."""
    t = np.array([0.25, 0.5, 0.75, 1.0])
    f = seq.parse_spending(spending)
    b = seq.spending_boundaries(t, f, 0.025)
    for k in range(1, t.size + 1):
        cov = np.sqrt(np.minimum.outer(t[:k], t[:k]) / np.maximum.outer(t[:k], t[:k]))
        stay = _st.multivariate_normal(np.zeros(k), cov, abseps=1e-7, releps=1e-7).cdf(np.array(b.upper[:k]))
        assert stay == pytest.approx(1 - f.spent(t[k - 1], 0.025), abs=2e-5)


def test_spending_functions_start_at_zero_end_at_alpha_and_rise():
    t = np.linspace(0, 1, 101)
    for spec in SPENDINGS + ["hsd(-40)", "hsd(40)"]:
        s = seq.parse_spending(spec).spent(t, 0.05)
        assert s[0] == 0.0 and s[-1] == 0.05 and np.all(np.diff(s) >= 0), spec
    assert seq.parse_spending("hsd(0)").spent(0.3, 0.05) == pytest.approx(0.015)


def test_the_two_decisions_are_mirror_images_when_spent_alike():
    b = SequentialDesign.default(200).boundaries
    assert np.allclose(b.lower, [-u for u in b.upper], atol=1e-9)
    assert all(u > _st.norm.ppf(0.95) for u in b.upper)  # never easier than the fixed-n test at any look


def test_one_look_is_the_fixed_n_test():
    b = SequentialDesign((60,)).boundaries
    assert b.upper[0] == pytest.approx(_st.norm.ppf(0.95), abs=1e-9)
    assert seq.inflation_factor(SequentialDesign((60,))) == pytest.approx(1.0, abs=1e-6)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("make,words", [
    (lambda: SequentialDesign((30, 30, 60)), "increase strictly"),
    (lambda: SequentialDesign((60, 30)), "increase strictly"),
    (lambda: SequentialDesign(()), "list of item counts"),
    (lambda: SequentialDesign((0, 10)), "at least 1 item"),
    (lambda: SequentialDesign((10.5, 20)), "whole numbers"),
    (lambda: SequentialDesign((10, 20), alpha_pass=0.5), "alpha_pass"),
    (lambda: SequentialDesign((10, 20), alpha_fail=0), "alpha_fail"),
    (lambda: SequentialDesign.from_fractions([0.5, 0.25, 1], 100), "increase strictly"),
    (lambda: SequentialDesign.from_fractions([0.5, 0.9], 100), "exactly 1"),
    (lambda: SequentialDesign.from_fractions([0.25, 0.5, 0.75, 1], 2), "increase strictly"),
    (lambda: SequentialDesign.from_fractions([0.5, 1], 0), "max_items"),
    (lambda: seq.parse_spending("hsd(gamma=41)"), "gamma must be a number in [-40, 40]"),
    (lambda: seq.parse_spending("hsd(gamma=nan)"), "gamma must be a number in [-40, 40]"),
    (lambda: seq.parse_spending("hsd(gamma=steep)"), "gamma must be a number"),
    (lambda: seq.parse_spending("pocock(2)"), "only hsd takes a parameter"),
    (lambda: seq.parse_spending("haybittle"), "unknown spending function"),
    (lambda: seq.decide(SequentialDesign((10, 20)), 2, 0, 0, 20, 0.1), "look must be 0..1"),
    (lambda: seq.decide(SequentialDesign((10, 20)), 0, 5, 7, 10, 0.1), "do not fit"),
])
def test_bad_input_is_refused_in_one_line(make, words):
    with pytest.raises(UsageError) as info:
        make()
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("data,words", [
    ({"looks": [50, 100], "max_items": 40}, "max_items 40 is below the first look (50 items)"),
    ({"looks": [50, 100], "max_items": 120}, "the last look (100 items) must be max_items (120)"),
    ({"looks": [100, 50]}, "increase strictly"),
    ({"looks": [0.5, 1.0]}, "need max_items"),
    ({"looks": [0.5, 1.0], "max_items": 100, "spending": "hsd(gamma=-50)"}, "gamma"),
    ({"looks": [0.5, 1.0], "max_items": 100, "wait": 3}, "unknown key(s) wait"),
])
def test_a_config_section_is_refused_in_one_line_naming_its_source(data, words):
    with pytest.raises(ConfigError) as info:
        SequentialDesign.from_mapping(data, "gate.yaml: sequential")
    message = str(info.value)
    assert message.startswith("gate.yaml: sequential: ") and words in message and "\n" not in message


def test_a_config_section_parses_into_the_design():
    d = SequentialDesign.from_mapping({"looks": [0.25, 0.5, 1], "max_items": 120, "pass_spending": "pocock"}, alpha=0.025)
    assert d == SequentialDesign((30, 60, 120), 0.025, 0.025, seq.PocockSpending(), seq.OBrienFlemingSpending())
    assert SequentialDesign.from_mapping({"looks": [40, 80, 120]}).looks == (40, 80, 120)
    assert SequentialDesign.from_mapping({"max_items": 120}) == SequentialDesign.default(120)
    assert SequentialDesign.default(120).describe() == (
        "group-sequential: looks at 30, 60, 90, 120 items, obrien-fleming spending, alpha 0.05 (PASS) / 0.05 (FAIL)")


def test_a_spending_family_name_cannot_be_taken_twice():
    with pytest.raises(UsageError, match="already registered"):
        seq.register_spending("pocock", seq.PocockSpending)
    with pytest.raises(UsageError, match="not a concrete SpendingFunction"):
        seq.register_spending("abstract", seq.SpendingFunction)


# ----------------------------------------------------------------------------- the decision at a look


def test_decision_is_tangos_statistic_held_to_the_looks_boundary():
    d = SequentialDesign.default(120)
    b = d.boundaries
    cases = [(0, 28, 0, 30, "FAIL"), (0, 15, 0, 30, "CONTINUE"), (0, 0, 0, 30, "CONTINUE"), (1, 0, 0, 60, "PASS"), (2, 1, 1, 90, "PASS"),
             (3, 9, 2, 120, "INCONCLUSIVE"), (3, 30, 2, 120, "FAIL")]
    for look, regressed, improved, n, status in cases:
        got = seq.decide(d, look, regressed, improved, n, 0.1)
        z = paired.tango_z(regressed, improved, n, -0.1)
        assert (got.status, got.look, got.z, got.upper, got.lower) == (status, look, z, b.upper[look], b.lower[look])
        assert got.boundary == {"PASS": b.upper[look], "FAIL": b.lower[look]}.get(status)


def test_a_one_look_design_gives_the_fixed_n_margin_tests_verdicts():
    """Every 0/1 outcome of 40 items: PASS exactly where the fixed-n test shows non-inferiority, FAIL where it shows
    the loss, at margin 0.1 and at margin 0 (whose statistic margin_test computes apart)."""
    d = SequentialDesign((40,))
    for margin in (0.1, 0.0):
        for regressed in range(41):
            for improved in range(41 - regressed):
                t = paired.margin_test(regressed, improved, 40, margin, 0.05)
                want = "PASS" if t.p_noninferior < 0.05 else "FAIL" if t.p_inferior < 0.05 else "INCONCLUSIVE"
                assert seq.decide(d, 0, regressed, improved, 40, margin).status == want, (margin, regressed, improved)


def test_clustered_items_enter_divided_by_the_design_effect():
    d = SequentialDesign.default(120)
    clustered = seq.decide(d, 2, 20, 2, 90, 0.1, design_effect=2.0)
    assert clustered.z == paired.tango_z(10, 1, 45, -0.1)
    assert clustered.status == seq.decide(d, 2, 10, 1, 45, 0.1).status  # same z, same planned boundary
    assert seq.decide(d, 2, 20, 2, 90, 0.1, design_effect=0.5).z == seq.decide(d, 2, 20, 2, 90, 0.1).z  # never below 1


def test_looks_off_plan_take_the_boundaries_of_the_information_reached():
    d = SequentialDesign.default(120)
    planned, early = seq.decide(d, 1, 0, 0, 60, 0.1), seq.decide(d, 1, 0, 0, 60, 0.1, earlier=[20])
    assert planned.upper == d.boundaries.upper[1]
    assert early.upper == seq.spending_boundaries([20 / 120, 0.5, 0.75, 1.0], "obrien-fleming", 0.05,
                                                  "obrien-fleming", 0.05).upper[1]
    assert early.upper != planned.upper


def test_three_items_never_pass():
    designs = [SequentialDesign((3,)), SequentialDesign((3, 6, 9, 12)), SequentialDesign.default(12),
               SequentialDesign((3, 60), pass_spending="pocock"), SequentialDesign((3, 60), pass_spending="hsd(gamma=40)")]
    for d in designs:
        for margin in (0.05, 0.1):
            for regressed in range(4):
                for improved in range(4 - regressed):
                    if regressed == improved:  # identical answers, or as many gained as lost
                        assert seq.decide(d, 0, regressed, improved, 3, margin).status != "PASS", (d, margin)


# ----------------------------------------------------------------------------- planning


def test_the_sequential_plan_inflates_the_fixed_n_plan():
    obf = seq.inflation_factor(SequentialDesign.default(100))
    pocock = seq.inflation_factor(SequentialDesign.from_fractions(_equal(4), 100, pass_spending="pocock"))
    assert 1.0 < obf < 1.05 < 1.15 < pocock < 1.25  # OBF costs little at the end, Pocock a fifth more items
    p = seq.plan_sequential(0.02, 0.02, 0.1, alpha=0.05, target_power=0.8)
    assert p.fixed_items == paired.items_needed(0.02, 0.02, 0.1, 0.05, 0.8)
    assert p.max_items == math.ceil(p.fixed_items * p.inflation) and p.design.max_items == p.max_items
    assert seq.plan_sequential(0.02, 0.02, 0.1, design_effect=2.0).fixed_items == 2 * p.fixed_items
    assert seq.plan_sequential(0.12, 0.02, 0.1).max_items is None  # on the margin: nothing decides it


# ----------------------------------------------------------------------------- simulated error rates

#: Three designs sized for the gate simulation's 300-item fixed-n run: the default (O'Brien-Fleming, 4 looks),
#: Pocock with its maximum inflated for the same power (x1.2), Hwang-Shih-DeCani gamma -2 at 3 looks.
DESIGNS = {
    "obrien-fleming x4, 300": SequentialDesign.default(300),
    "pocock x4, 360": SequentialDesign.from_fractions(_equal(4), 360, pass_spending="pocock", fail_spending="pocock"),
    "hsd(-2) x3, 320": SequentialDesign.from_fractions(_equal(3), 320, pass_spending="hsd(gamma=-2)",
                                                        fail_spending="hsd(gamma=-2)"),
}
RUNS = 20_000


def _slack(p: float) -> float:
    return 3 * math.sqrt(p * (1 - p) / RUNS)


@pytest.mark.parametrize("name", list(DESIGNS))
def test_simulated_error_rates(name):
    d = DESIGNS[name]
    rng = np.random.default_rng(20261207)
    margin = 0.05
    # A/A: baseline accuracy 0.9, 5% of right items flip and as many back (the gate simulation's no-change case).
    aa = seq.simulate(d, 0.045, 0.045, margin, RUNS, rng)
    assert aa.failed <= 0.05
    # On the margin (change exactly -0.05): each decision's error no worse than the fixed-n test's exact one at the
    # maximum n (Tango's statistic is not exact: 0.056 for the FAIL there), within the simulation's noise.
    null = seq.simulate(d, 0.07, 0.02, margin, RUNS, rng)
    fixed_pass = paired.power(d.max_items, 0.07, 0.02, margin, 0.05, "pass")
    fixed_fail = paired.power(d.max_items, 0.07, 0.02, margin, 0.05, "fail")
    assert null.passed <= 0.05 and null.passed <= fixed_pass + _slack(fixed_pass)
    assert null.failed <= fixed_fail + _slack(fixed_fail)
    # A planted 10-point loss (each right item of 0.9 turns wrong with probability 1/9): caught by the maximum n.
    loss = seq.simulate(d, 0.1, 0.0, margin, RUNS, rng)
    assert loss.failed >= 0.95 and loss.passed <= 0.001  # a PASS needs almost no regression in 90+ items
    assert loss.mean_items < 0.75 * d.max_items  # and most runs stop early
    # A 50-point loss is decided at the first look.
    clear = seq.simulate(d, 0.5, 0.0, margin, RUNS, rng)
    assert clear.failed == 1.0 and clear.decided_at[0] == 1.0 and clear.mean_items == d.looks[0]


def test_simulation_is_seeded():
    d = SequentialDesign.default(120)
    a = seq.simulate(d, 0.05, 0.02, 0.1, 500, np.random.default_rng(3))
    assert a == seq.simulate(d, 0.05, 0.02, 0.1, 500, np.random.default_rng(3))
