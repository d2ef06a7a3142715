"""Group-sequential designs for the gate's paired margin tests: decide a candidate at planned looks, errors kept.

The fixed-n gate tests each task once, after every item: a PASS rejects "the change is at or below ``-margin``"
(Tango's statistic ``z = tango_z(regressed, improved, n, -margin)`` above ``z_{1-alpha}``), a FAIL rejects "the
change is at or above ``-margin``" (``z`` below ``-z_{1-alpha}``). Both tests are of one point, ``delta = -margin``,
one each way. A group-sequential design looks at the same statistic after each of ``K`` planned blocks of items and
stops at the first look whose ``z`` crosses a boundary:

* ``z >= upper[k]``: PASS, non-inferiority shown;
* ``z <= lower[k]``: FAIL, a loss beyond the margin shown;
* otherwise continue; after the last look, INCONCLUSIVE, as the fixed-n gate says when neither is shown.

Looked at ``K`` times, the fixed-n critical value would claim a PASS (or a FAIL) on a null change far more often
than ``alpha``. The boundaries here are set so that the probability of ever crossing the upper one at
``delta = -margin`` is exactly ``alpha_pass`` and the lower one ``alpha_fail``: each decision's error rate is spent
across the looks by a spending function of the information fraction (Lan and DeMets 1983), whose families and
boundaries (O'Brien-Fleming-type, Pocock-type, Hwang-Shih-DeCani; the numerical integration that places them) live
in :mod:`kveval.stats.boundaries`.

Tango's statistic on counts is asymptotically normal with the canonical covariance (its information grows with the
items), as is the Rao-Scott-adjusted statistic of clustered items; the information fraction at a look is its share
of the maximum items. Everything here is arithmetic (no files, no randomness); the gate does not use it yet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import optimize
from scipy import stats as _st

from kveval.errors import ConfigError, UsageError
from kveval.stats import paired
from kveval.stats.boundaries import (
    Boundaries,
    HwangShihDeCaniSpending,
    OBrienFlemingSpending,
    PocockSpending,
    SpendingFunction,
    cached_spending_boundaries,
    check_alpha,
    check_fractions,
    constant_shape_boundaries,
    crossing_probabilities,
    parse_spending,
    register_spending,
    spending_boundaries,
)
from kveval.values import is_real

__all__ = [
    "CONTINUE",
    "FAIL",
    "INCONCLUSIVE",
    "PASS",
    "Boundaries",
    "HwangShihDeCaniSpending",
    "LookDecision",
    "OBrienFlemingSpending",
    "PocockSpending",
    "SequentialDesign",
    "SequentialPlan",
    "SimulatedRuns",
    "SpendingFunction",
    "constant_shape_boundaries",
    "crossing_probabilities",
    "decide",
    "decide_many",
    "inflation_factor",
    "parse_spending",
    "plan_sequential",
    "register_spending",
    "simulate",
    "spending_boundaries",
]

PASS, FAIL, INCONCLUSIVE, CONTINUE = "PASS", "FAIL", "INCONCLUSIVE", "CONTINUE"

# ----------------------------------------------------------------------------- the design


def _default_spending() -> SpendingFunction:
    return OBrienFlemingSpending()


@dataclass(frozen=True)
class SequentialDesign:
    """Looks, spending and error rates of a group-sequential gate on one task (validated on construction).

    Attributes
    ----------
    looks : tuple of int
        Items of the task tested at each look, strictly increasing; the last is the maximum (every item).
    alpha_pass : float
        Probability of a PASS when the change is exactly ``-margin`` (one-sided; the fixed-n gate's ``alpha``).
    alpha_fail : float
        Probability of a FAIL when the change is exactly ``-margin`` (before Holm's adjustment over the family).
    pass_spending, fail_spending : SpendingFunction
        How each error rate is spent over the looks.

    The default, :meth:`default`, is four equally spaced looks with O'Brien-Fleming-type spending for both
    decisions at the gate's alpha 0.05: the last look's boundary (1.720 against the fixed-n 1.645) keeps the
    verdicts of a full run and the items for the same power within 3% of the fixed-n plan, while a candidate that
    loses most of its answers (z beyond -3.75) is stopped after a quarter of the items.
    """

    looks: tuple[int, ...]
    alpha_pass: float = 0.05
    alpha_fail: float = 0.05
    pass_spending: SpendingFunction = field(default_factory=_default_spending)
    fail_spending: SpendingFunction = field(default_factory=_default_spending)

    def __post_init__(self):
        looks = tuple(self.looks) if isinstance(self.looks, (list, tuple)) else None
        if not looks or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in looks):
            raise UsageError(f"looks must be a list of item counts (whole numbers), got {self.looks!r}")
        if looks[0] < 1:
            raise UsageError(f"the first look must test at least 1 item, got {looks[0]}")
        bad = next((k for k in range(1, len(looks)) if looks[k] <= looks[k - 1]), None)
        if bad is not None:
            raise UsageError(f"looks must increase strictly: look {bad + 1} ({looks[bad]} items) is not after look "
                             f"{bad} ({looks[bad - 1]} items)")
        object.__setattr__(self, "looks", tuple(int(x) for x in looks))
        check_alpha(self.alpha_pass, "alpha_pass (one-sided PASS error rate)")
        check_alpha(self.alpha_fail, "alpha_fail (one-sided FAIL error rate)")
        object.__setattr__(self, "pass_spending", parse_spending(self.pass_spending))
        object.__setattr__(self, "fail_spending", parse_spending(self.fail_spending))

    # -- construction

    @classmethod
    def from_fractions(cls, fractions: Sequence[float], max_items: int, **kwargs) -> SequentialDesign:
        """Looks at information ``fractions`` (increasing, ending at 1) of ``max_items``, rounded up to items."""
        if isinstance(max_items, bool) or not isinstance(max_items, (int, np.integer)) or max_items < 1:
            raise UsageError(f"max_items must be a whole number of items >= 1, got {max_items!r}")
        t = check_fractions(fractions)
        return cls(tuple(max(1, math.ceil(x * max_items - 1e-9)) for x in t), **kwargs)

    @classmethod
    def default(cls, max_items: int, alpha: float = 0.05) -> SequentialDesign:
        """Four equally spaced looks, O'Brien-Fleming-type spending, ``alpha`` for each decision (see the class)."""
        return cls.from_fractions((0.25, 0.5, 0.75, 1.0), max_items, alpha_pass=alpha, alpha_fail=alpha)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "sequential", alpha: float = 0.05) -> SequentialDesign:
        """Parse a config's ``sequential:`` section once, at the edge (:class:`ConfigError` naming ``source``).

        Keys: ``max_items`` (required unless ``looks`` are item counts), ``looks`` (item counts, or fractions of
        ``max_items`` when all are at most 1; default four equal ones), ``spending`` (both decisions) or
        ``pass_spending``/``fail_spending`` (default ``obrien-fleming``), ``alpha_pass``/``alpha_fail`` (default
        ``alpha``, the gate's).
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: must be a mapping of looks, max_items, spending, got {data!r}")
        known = {"looks", "max_items", "spending", "pass_spending", "fail_spending", "alpha_pass", "alpha_fail"}
        extra = sorted(set(data) - known)
        if extra:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(str, extra))} (known: {', '.join(sorted(known))})")
        try:
            spending = data.get("spending", "obrien-fleming")
            kwargs = {
                "alpha_pass": data.get("alpha_pass", alpha),
                "alpha_fail": data.get("alpha_fail", alpha),
                "pass_spending": parse_spending(data.get("pass_spending", spending)),
                "fail_spending": parse_spending(data.get("fail_spending", spending)),
            }
            looks = data.get("looks", (0.25, 0.5, 0.75, 1.0))
            max_items = data.get("max_items")
            if not isinstance(looks, (list, tuple)) or not looks:
                raise UsageError(f"looks must be a list of item counts or information fractions, got {looks!r}")
            as_fractions = all(is_real(x) and not isinstance(x, bool) and 0 < x <= 1 for x in looks) and not (
                max_items is None and all(isinstance(x, int) for x in looks))
            if as_fractions:
                if max_items is None:
                    raise UsageError("looks given as fractions need max_items")
                return cls.from_fractions(looks, max_items, **kwargs)
            design = cls(tuple(looks), **kwargs)
            if max_items is not None and max_items != design.max_items:
                if is_real(max_items) and max_items < design.looks[0]:
                    raise UsageError(f"max_items {max_items} is below the first look ({design.looks[0]} items)")
                raise UsageError(f"the last look ({design.max_items} items) must be max_items ({max_items})")
            return design
        except ConfigError:
            raise
        except UsageError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    # -- what it implies

    @property
    def max_items(self) -> int:
        return self.looks[-1]

    @property
    def fractions(self) -> tuple[float, ...]:
        return tuple(n / self.max_items for n in self.looks)

    @property
    def boundaries(self) -> Boundaries:
        """The planned boundaries (every look at its planned item count)."""
        return self.boundaries_at(self.looks)

    def boundaries_at(self, items: Sequence[float]) -> Boundaries:
        """Boundaries for looks taken at ``items`` (the counts reached so far, possibly off plan), the rest planned.

        Spending makes the design flexible (Lan and DeMets 1983): a look's boundary depends only on the information
        fractions of the looks up to it. The last look always spends what is left (fraction 1).
        """
        reached = [float(x) for x in items]
        if len(reached) > len(self.looks):
            raise UsageError(f"{len(reached)} looks taken, the design has {len(self.looks)}")
        counts = reached + [float(x) for x in self.looks[len(reached):]]
        t = [min(c / self.max_items, 1.0) for c in counts]
        t[-1] = 1.0
        return cached_spending_boundaries(check_fractions(t), self.pass_spending, self.alpha_pass, self.fail_spending,
                                    self.alpha_fail)

    def describe(self) -> str:
        """One line: looks, spending and error rates, as a verdict or a report names the design."""
        same = self.pass_spending == self.fail_spending
        how = self.pass_spending.name if same else f"PASS {self.pass_spending.name}, FAIL {self.fail_spending.name}"
        return (f"group-sequential: looks at {', '.join(map(str, self.looks))} items, {how} spending, "
                f"alpha {self.alpha_pass:g} (PASS) / {self.alpha_fail:g} (FAIL)")

    def to_dict(self) -> dict[str, Any]:
        b = self.boundaries
        return {"looks": list(self.looks), "alpha_pass": self.alpha_pass, "alpha_fail": self.alpha_fail,
                "pass_spending": self.pass_spending.name, "fail_spending": self.fail_spending.name,
                "upper": list(b.upper), "lower": list(b.lower)}


# ----------------------------------------------------------------------------- deciding at a look


@dataclass(frozen=True)
class LookDecision:
    """What a look decides for one task.

    ``status``: PASS, FAIL, CONTINUE, or INCONCLUSIVE at the last look; ``look``: its index (0-based) and ``n`` the
    items tested; ``z``: Tango's statistic at ``-margin`` on the design-effect-adjusted counts; ``upper``/``lower``:
    the boundaries it was held to (``boundary`` the one crossed, ``None`` when none was).
    """

    status: str
    look: int
    n: float
    z: float
    upper: float
    lower: float

    @property
    def boundary(self) -> float | None:
        return self.upper if self.status == PASS else self.lower if self.status == FAIL else None

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "look": self.look, "n": self.n, "z": self.z, "upper": self.upper,
                "lower": self.lower, "boundary": self.boundary}


def _margin_z(regressed, improved, n, margin: float):
    """The statistic of :func:`kveval.stats.paired.margin_test`, vectorised: Tango's ``z`` at ``-margin``, and the
    McNemar statistic on at least one discordance where the margin is 0 (as that test computes it)."""
    if margin > 0:
        return paired.tango_z(regressed, improved, n, -margin)
    b, c = np.asarray(regressed, dtype=float), np.asarray(improved, dtype=float)
    return (c - b) / np.sqrt(np.maximum(b + c, 1.0))


def _check_look(design: SequentialDesign, look: int) -> int:
    if isinstance(look, bool) or not isinstance(look, (int, np.integer)) or not 0 <= look < len(design.looks):
        raise UsageError(f"look must be 0..{len(design.looks) - 1} for a design of {len(design.looks)} looks, got {look!r}")
    return int(look)


def decide_many(design: SequentialDesign, look: int, regressed, improved, n, margin: float,
                design_effect=1.0, earlier: Sequence[float] | None = None) -> np.ndarray:
    """:func:`decide` over arrays of counts (one task per element, all at the same look): an array of statuses."""
    look = _check_look(design, look)
    if not 0 <= margin < 1:
        raise UsageError(f"margin must be in [0, 1), got {margin}")
    b = design.boundaries_at([*(earlier if earlier is not None else design.looks[:look]), design.looks[look]])
    de = np.maximum(np.asarray(design_effect, dtype=float), 1.0)
    z = _margin_z(np.asarray(regressed, dtype=float) / de, np.asarray(improved, dtype=float) / de,
                  np.asarray(n, dtype=float) / de, margin)
    last = INCONCLUSIVE if look == len(design.looks) - 1 else CONTINUE
    return np.where(z >= b.upper[look], PASS, np.where(z <= b.lower[look], FAIL, last))


def decide(design: SequentialDesign, look: int, regressed: float, improved: float, n: int, margin: float,
           design_effect: float = 1.0, earlier: Sequence[float] | None = None) -> LookDecision:
    """The decision at look ``look`` (0-based) on one task's cumulative paired counts so far.

    Parameters
    ----------
    regressed, improved, n :
        The counts the fixed-n gate tests: right->wrong and wrong->right items (fractional for graded scores,
        :func:`kveval.stats.paired.score_discordance`) over ``n`` paired items.
    margin : float
        The task's margin; the statistic is Tango's ``z`` at ``-margin`` (:func:`kveval.stats.paired.tango_z`).
    design_effect : float
        Items sharing contexts (:func:`kveval.stats.paired.design_effect`): the counts are divided by it, as the
        fixed-n margin test takes them (Rao-Scott).
    earlier : sequence of float, optional
        Items tested at the earlier looks when they were off plan (the boundaries follow the information actually
        reached); default: as planned. The information fraction of this look is ``n / max_items`` (1 at the last).
    """
    _check_look(design, look)
    paired._check_counts(regressed, improved, n)
    status = str(decide_many(design, look, regressed, improved, n, margin, design_effect, earlier)[()])
    b = design.boundaries_at([*(earlier if earlier is not None else design.looks[:look]), design.looks[look]])
    de = max(float(design_effect), 1.0)
    z = float(_margin_z(regressed / de, improved / de, n / de, margin))
    return LookDecision(status, look, float(n), z, b.upper[look], b.lower[look])


# ----------------------------------------------------------------------------- planning


def inflation_factor(design: SequentialDesign, target_power: float = 0.8, goal: str = "pass") -> float:
    """Maximum items of the design over the fixed-n items for the same power (>= 1 in practice).

    ``goal="pass"``: power to PASS a change above ``-margin`` (the upper boundary, ``alpha_pass``); ``"fail"``: to
    FAIL a loss beyond it (the lower boundary, ``alpha_fail``). The drift ``theta`` that crosses with
    ``target_power`` is found by the integration; the fixed-n test needs ``z_{1-alpha} + z_{power}``; the ratio of
    their squares is the factor (Jennison and Turnbull 2000, section 7.2).
    """
    if goal not in ("pass", "fail"):
        raise UsageError(f"goal must be 'pass' or 'fail', got {goal!r}")
    if not is_real(target_power) or not 0 < target_power < 1:
        raise UsageError(f"power must be in (0, 1), got {target_power!r}")
    b = design.boundaries
    alpha = design.alpha_pass if goal == "pass" else design.alpha_fail
    sign = 1.0 if goal == "pass" else -1.0

    def power(theta: float) -> float:
        up, down = crossing_probabilities(b, sign * theta)
        return float((up if goal == "pass" else down).sum())

    theta = optimize.brentq(lambda th: power(th) - target_power, 0.0, 15.0, xtol=1e-10)
    fixed = float(_st.norm.ppf(1 - alpha) + _st.norm.ppf(target_power))
    return (theta / fixed) ** 2


@dataclass(frozen=True)
class SequentialPlan:
    """The planner's answer for a sequential design: the fixed-n items, the factor, and the design's looks."""

    fixed_items: int | None
    inflation: float
    max_items: int | None
    design: SequentialDesign | None


def plan_sequential(p_regress: float, p_improve: float, margin: float, fractions: Sequence[float] = (0.25, 0.5, 0.75, 1.0),
                    alpha: float = 0.05, target_power: float = 0.8, spending: SpendingFunction | str = "obrien-fleming",
                    design_effect: float = 1.0) -> SequentialPlan:
    """Maximum items per task a sequential design needs for the power of the fixed-n plan, and that design.

    The fixed-n items are :func:`kveval.stats.paired.items_needed` (times the design effect); the maximum is that
    times :func:`inflation_factor` of the looks and spending, and the looks are its ``fractions``. ``None`` items
    where the expected change sits on the margin (no number decides it).
    """
    delta = p_improve - p_regress
    goal = "pass" if delta > -margin else "fail"
    fixed = paired.items_needed(p_regress, p_improve, margin, alpha, target_power)
    probe = SequentialDesign.from_fractions(fractions, 10_000, alpha_pass=alpha, alpha_fail=alpha,
                                            pass_spending=parse_spending(spending), fail_spending=parse_spending(spending))
    factor = inflation_factor(probe, target_power, goal)
    if fixed is None:
        return SequentialPlan(None, factor, None, None)
    fixed = math.ceil(fixed * max(float(design_effect), 1.0))
    top = max(math.ceil(fixed * factor), len(probe.looks))
    design = SequentialDesign.from_fractions(fractions, top, alpha_pass=alpha, alpha_fail=alpha,
                                             pass_spending=probe.pass_spending, fail_spending=probe.fail_spending)
    return SequentialPlan(fixed, factor, top, design)


# ----------------------------------------------------------------------------- operating characteristics


@dataclass(frozen=True)
class SimulatedRuns:
    """Verdicts of simulated runs of one design (see :func:`simulate`): shares and the mean items spent."""

    runs: int
    passed: float
    failed: float
    inconclusive: float
    mean_items: float
    decided_at: tuple[float, ...]  # share of runs decided (PASS or FAIL) at each look


def simulate(design: SequentialDesign, p_regress: float, p_improve: float, margin: float, runs: int,
             rng: np.random.Generator) -> SimulatedRuns:
    """Run ``runs`` simulated candidates through :func:`decide_many`, look by look, and tally their verdicts.

    Each item independently regresses with probability ``p_regress`` and improves with ``p_improve``; a run stops at
    its first PASS or FAIL. The generator is the caller's (seeded where reproducibility is wanted).
    """
    if not (0 <= p_regress and 0 <= p_improve and p_regress + p_improve <= 1):
        raise UsageError(f"p_regress={p_regress} and p_improve={p_improve} must be probabilities summing to <= 1")
    sizes = np.diff(design.looks, prepend=0)
    probs = [p_regress, p_improve, max(0.0, 1 - p_regress - p_improve)]
    counts = np.cumsum(np.stack([rng.multinomial(int(m), probs, size=runs) for m in sizes]), axis=0)
    status = np.full(runs, CONTINUE, dtype=object)
    items = np.zeros(runs)
    decided_at = []
    for k, n in enumerate(design.looks):
        open_ = status == CONTINUE
        now = decide_many(design, k, counts[k, open_, 0], counts[k, open_, 1], n, margin)
        status[open_] = now
        items[open_] = n
        decided_at.append(float(np.isin(now, (PASS, FAIL)).sum() / runs))
    return SimulatedRuns(runs, float(np.mean(status == PASS)), float(np.mean(status == FAIL)),
                         float(np.mean(status == INCONCLUSIVE)), float(items.mean()), tuple(decided_at))
