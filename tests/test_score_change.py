"""The change of a task's mean score, the number the leaderboard shows and the gate tests, on graded items too.

Every score is in [0, 1]. An item whose score goes from a to b counts as a discordance of |b - a| (a loss when
b < a): for right/wrong items these are the right->wrong and wrong->right counts, and Tango's score interval on
them is the interval of the change of accuracy. On partial scores it is the same interval on fractional counts,
whose variance, |d| - delta^2 per item, bounds the scores' own (d^2 - delta^2) from above: conservative, and
never collapsing to the few differences a bootstrap of two or three items resamples. Tasks of mostly partial
scores with 30 items or more take the paired bootstrap, where that bound would overstate many small changes.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_compare_gate import write_run

from kveval.gate.config import GateConfig

from kveval.gate.rules import evaluate_gate

from kveval.gate.verdicts import FAIL, INCONCLUSIVE, PASS
from kveval.runs.records import ItemRecord
from kveval.stats import paired
from kveval.stats.comparison import compare_runs

NO_FLIP_CAP = {"margin": 0.10, "max_negative_flip_rate": None, "max_confusion_increase": None}


def _items(scores, correct=None, task="t"):
    correct = [s >= 1 for s in scores] if correct is None else correct
    return [ItemRecord(id=f"{task}/{i}", hash=str(i), task=task, score=float(s), correct=bool(c))
            for i, (s, c) in enumerate(zip(scores, correct))]


def _gate(tmp_path, base_scores, cand_scores, cfg: dict, correct=None, cand_correct=None):
    base = write_run(tmp_path / "b", _items(base_scores, correct))
    cand = write_run(tmp_path / "c", _items(cand_scores, cand_correct if cand_correct is not None else correct),
                     policy="kivi(bits=2)")
    return evaluate_gate(GateConfig.from_dict(cfg), base, [cand]).candidates[0].tasks[0]


def test_a_mean_score_shown_below_the_margin_never_passes(tmp_path):
    """10 of 100 items keep their `correct` flag (wrong in both runs) while their partial score falls from 0.99 to
    0.01: the mean score drops 0.098, twice the margin. The gate tested the right/wrong flags alone and said PASS."""
    base = [1.0] * 90 + [0.99] * 10
    cand = [1.0] * 90 + [0.01] * 10
    flags = [True] * 90 + [False] * 10
    task = _gate(tmp_path, base, cand, {"margin": 0.05}, correct=flags)
    c = task.comparison
    assert task.status != PASS
    assert c.delta == pytest.approx(-0.098) and c.baseline_score == pytest.approx(0.999)
    # the p-value beside the interval tests the same change (McNemar on the unchanged flags said p = 1)
    assert c.ci_high < 0 and c.pvalue < 0.05 and c.mcnemar_p == 1.0
    assert "mean score -0.098" in task.summary


@pytest.mark.parametrize("base, cand", [
    ([0.5, 0.5], [0.5, 0.51]),  # one graded item up a hair: PASSed on a bootstrap of two differences
    ([0.5, 0.5], [0.5, 0.5]),
    ([0.7, 0.7, 0.7], [0.5, 0.5, 0.49]),  # three losses of about 0.2: FAILed (Holm p=1e-4)
    ([0.7, 0.7, 0.7], [0.5, 0.5, 0.5]),
])
def test_two_or_three_graded_items_decide_nothing(tmp_path, base, cand):
    """Whether the differences varied at all decided between PASS and INCONCLUSIVE, or FAIL and INCONCLUSIVE."""
    task = _gate(tmp_path, base, cand, NO_FLIP_CAP)
    assert task.status == INCONCLUSIVE
    assert task.test.lower < -0.10 < task.test.upper


def test_the_score_interval_on_graded_items_covers_the_true_change():
    """Coverage of the two-sided 90% interval over 400 simulated tasks of 40 graded items (true change -0.05)."""
    rng = np.random.default_rng(1)
    hits, true = 0, _true_change()
    for _ in range(400):
        a = rng.uniform(0.3, 1.0, 40)
        b = np.clip(a - 0.05 + rng.normal(0, 0.15, 40), 0, 1)
        lost, gained = paired.score_discordance(a, b)
        low, high = paired.tango_interval(lost, gained, 40, 0.90)
        hits += low <= true <= high
    assert hits / 400 >= 0.90


def _true_change(samples: int = 400_000) -> float:
    """E[b - a] of the simulation above, by Monte Carlo (the clipping at 0 and 1 moves it off -0.05)."""
    rng = np.random.default_rng(99)
    a = rng.uniform(0.3, 1.0, samples)
    b = np.clip(a - 0.05 + rng.normal(0, 0.15, samples), 0, 1)
    return float(np.mean(b - a))


def test_many_small_graded_changes_take_the_bootstrap_and_can_pass(tmp_path):
    """100 graded items whose scores jitter by about 0.1 around a change of -0.01: the fractional counts'
    variance (|d| per item) is several times the scores' own, so Tango's interval is about [-0.057, +0.047] and
    could not show a 5-point margin; the bootstrap of 100 items can, and it does."""
    rng = np.random.default_rng(5)
    base = rng.uniform(0.3, 1.0, 100)
    cand = np.clip(base - 0.01 + rng.normal(0, 0.1, 100), 0, 1)
    task = _gate(tmp_path, base, cand, {"margin": 0.05, "max_negative_flip_rate": None,
                                        "max_confusion_increase": None})  # correct exactly where a score is 1
    assert task.comparison.ci_method == "bootstrap" and task.status == PASS
    lost, gained = paired.score_discordance(base, cand)
    assert paired.tango_interval(lost, gained, 100, 0.90)[0] < -0.05 < task.test.lower


def test_right_wrong_items_keep_tangos_interval_on_their_counts(tmp_path):
    """On 0/1 scores the fractional discordances are the right->wrong and wrong->right counts themselves."""
    base = [1.0] * 30 + [0.0] * 10
    cand = [0.0] * 4 + [1.0] * 26 + [1.0] * 1 + [0.0] * 9
    c = compare_runs(write_run(tmp_path / "b", _items(base)), write_run(tmp_path / "c", _items(cand), policy="q")).task("t")
    assert paired.score_discordance(base, cand) == (4.0, 1.0)
    assert (c.ci_low, c.ci_high) == pytest.approx(paired.tango_interval(4, 1, 40), abs=1e-12)
    assert c.delta == pytest.approx(-3 / 40)


def test_inconclusive_names_items_that_satisfy_every_pending_rule(tmp_path):
    """30 unchanged items under a 5% net-flip cap: the margin test alone would be shown at 25 items, which the
    gate quoted though 30 were there; the cap needs 52."""
    cfg = {"margin": 0.10, "max_negative_flip_rate": 0.05, "max_confusion_increase": None}
    task = _gate(tmp_path, [1.0] * 30, [1.0] * 30, cfg)
    assert task.status == INCONCLUSIVE and task.items_needed > 30
    enough = _gate(tmp_path / "more", [1.0] * task.items_needed, [1.0] * task.items_needed, cfg)
    assert enough.status == PASS
    fewer = _gate(tmp_path / "fewer", [1.0] * (task.items_needed - 1), [1.0] * (task.items_needed - 1), cfg)
    assert fewer.status == INCONCLUSIVE


def test_a_graded_loss_far_beyond_the_margin_fails(tmp_path):
    """Conservative, not blind: 200 graded items losing about 0.3 each FAIL."""
    rng = np.random.default_rng(3)
    base = rng.uniform(0.5, 1.0, 200)
    cand = np.clip(base - 0.3 + rng.normal(0, 0.05, 200), 0, 1)
    task = _gate(tmp_path, base, cand, NO_FLIP_CAP, correct=[False] * 200)
    assert task.status == FAIL and task.test.upper < -0.10
