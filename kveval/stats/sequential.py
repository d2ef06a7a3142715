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
across the looks by a spending function ``alpha(t)`` of the information fraction ``t`` (Lan and DeMets 1983,
Biometrika 70:659-663), ``alpha(t_k) - alpha(t_{k-1})`` at look ``k``. Three families are provided:

* :class:`OBrienFlemingSpending`: ``2 - 2 Phi(z_{1-alpha/2} / sqrt(t))`` (Lan and DeMets 1983), the O'Brien and
  Fleming (1979, Biometrics 35:549-556) shape: almost nothing early, a last boundary close to the fixed-n one.
* :class:`PocockSpending`: ``alpha ln(1 + (e - 1) t)`` (Lan and DeMets 1983), the Pocock (1977, Biometrika
  64:191-199) shape: nearly constant boundaries, early stops at moderate effects, a dearer last look.
* :class:`HwangShihDeCaniSpending`: ``alpha (1 - e^{-gamma t}) / (1 - e^{-gamma})`` (Hwang, Shih and DeCani 1990,
  Stat Med 9:1439-1445), ``gamma`` from -40 (O'Brien-Fleming-like at -4) to 40 (Pocock-like at 1).

The boundaries are computed for the design's own looks by the recursive numerical integration of the canonical
joint distribution (the statistics at the looks are a Brownian motion sampled at the information times:
``Z_k sqrt(I_k)`` has independent normal increments; Armitage, McPherson and Rowe 1969, J R Stat Soc A
132:235-244), on the grid and Simpson weights of Jennison and Turnbull (2000, "Group Sequential Methods with
Applications to Clinical Trials", ch. 19). The same integration gives the classic constant-shape boundaries of
Pocock and O'Brien-Fleming (:func:`constant_shape_boundaries`); the tests check both against published tables.

Tango's statistic on counts is asymptotically normal with the canonical covariance (its information grows with the
items), as is the Rao-Scott-adjusted statistic of clustered items; the information fraction at a look is its share
of the maximum items. Everything here is arithmetic (no files, no randomness); the gate does not use it yet.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from scipy import optimize
from scipy import stats as _st

from kveval.errors import ConfigError, UsageError
from kveval.stats import paired
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

#: Grid density of the numerical integration (Jennison and Turnbull's ``r``: 6r - 1 points per look, then
#: Simpson's midpoints). 32 puts boundaries within 1e-5 of the exact ones (their ch. 19 recommends 16 or more).
GRID_R = 32

#: Where a boundary that spends nothing sits: no statistic reaches it (Phi(-40) underflows to 0).
_NEVER = 40.0


# ----------------------------------------------------------------------------- spending functions


class SpendingFunction(ABC):
    """How much of a decision's error rate ``alpha`` is spent by information fraction ``t`` (cumulative).

    Subclasses give :meth:`fraction`, the share of ``alpha`` spent by ``t``: 0 at ``t = 0``, non-decreasing, 1 at
    ``t = 1``. ``name`` is the spec a config writes (``parse_spending`` reads it back).
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """The spec that names this function, e.g. ``"obrien-fleming"`` or ``"hsd(gamma=-4)"``."""

    @abstractmethod
    def fraction(self, t: np.ndarray, alpha: float) -> np.ndarray:
        """Share of ``alpha`` spent by information fractions ``t`` in [0, 1] (an array of the same shape)."""

    def spent(self, t, alpha: float) -> np.ndarray:
        """Cumulative error spent by ``t``: ``alpha * fraction(t)``, exactly ``alpha`` at ``t = 1``."""
        t = np.clip(np.asarray(t, dtype=float), 0.0, 1.0)
        out = alpha * self.fraction(t, alpha)
        return np.where(t >= 1.0, alpha, np.where(t <= 0.0, 0.0, out))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SpendingFunction) and self.name == other.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class OBrienFlemingSpending(SpendingFunction):
    """Lan-DeMets O'Brien-Fleming-type spending, ``2 - 2 Phi(z_{1-alpha/2} / sqrt(t))`` (Lan and DeMets 1983)."""

    name = "obrien-fleming"

    def fraction(self, t, alpha):
        with np.errstate(divide="ignore"):
            z = _st.norm.ppf(1 - alpha / 2) / np.sqrt(np.maximum(t, 1e-300))
        return 2 * _st.norm.sf(z) / alpha


class PocockSpending(SpendingFunction):
    """Lan-DeMets Pocock-type spending, ``alpha ln(1 + (e - 1) t)`` (Lan and DeMets 1983)."""

    name = "pocock"

    def fraction(self, t, alpha):
        return np.log1p((math.e - 1) * t)


#: The Hwang-Shih-DeCani parameter's domain: beyond +-40 ``e^{-gamma}`` over- or underflows the spending's
#: arithmetic, and the shape no longer changes (the same range as gsDesign's ``sfHSD``).
HSD_GAMMA_LIMIT = 40.0


@dataclass(frozen=True, eq=False)
class HwangShihDeCaniSpending(SpendingFunction):
    """Hwang-Shih-DeCani spending, ``(1 - e^{-gamma t}) / (1 - e^{-gamma})`` of ``alpha`` (``t`` itself at 0).

    ``gamma = -4`` is close to O'Brien-Fleming, ``gamma = 1`` to Pocock (Hwang, Shih and DeCani 1990).
    """

    gamma: float = -4.0

    def __post_init__(self):
        if not is_real(self.gamma) or not -HSD_GAMMA_LIMIT <= self.gamma <= HSD_GAMMA_LIMIT:
            raise UsageError(f"Hwang-Shih-DeCani gamma must be a number in [-{HSD_GAMMA_LIMIT:g}, "
                             f"{HSD_GAMMA_LIMIT:g}], got {self.gamma!r}")

    @property
    def name(self) -> str:
        return f"hsd(gamma={self.gamma:g})"

    def fraction(self, t, alpha):
        g = float(self.gamma)
        if g == 0:
            return np.asarray(t, dtype=float)
        return np.expm1(-g * np.asarray(t, dtype=float)) / math.expm1(-g)


_SPENDING: dict[str, type[SpendingFunction]] = {}


def register_spending(key: str, cls: type[SpendingFunction]) -> None:
    """Make ``cls`` the spending family a spec ``key`` or ``key(param=value)`` names; a key taken is refused."""
    if not (isinstance(cls, type) and issubclass(cls, SpendingFunction)) or getattr(cls, "__abstractmethods__", None):
        raise UsageError(f"spending family {key!r}: {cls!r} is not a concrete SpendingFunction")
    if key in _SPENDING:
        raise UsageError(f"spending family {key!r} is already registered ({_SPENDING[key].__name__})")
    _SPENDING[key] = cls


register_spending("obrien-fleming", OBrienFlemingSpending)
register_spending("pocock", PocockSpending)
register_spending("hsd", HwangShihDeCaniSpending)

_SPEC = re.compile(r"^\s*([a-z-]+)\s*(?:\(\s*(?:(\w+)\s*=\s*)?([^()]*?)\s*\))?\s*$")


def parse_spending(spec: str | SpendingFunction) -> SpendingFunction:
    """The spending function a spec names: ``"obrien-fleming"``, ``"pocock"``, ``"hsd(gamma=-4)"`` (or ``"hsd(-4)"``)."""
    if isinstance(spec, SpendingFunction):
        return spec
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    if m is None or m.group(1) not in _SPENDING:
        raise UsageError(f"unknown spending function {spec!r}: give one of {', '.join(sorted(_SPENDING))} "
                         f"(hsd takes gamma, e.g. 'hsd(gamma=-4)')")
    cls, keyword, value = _SPENDING[m.group(1)], m.group(2), m.group(3)
    if value is None:
        return cls()
    if cls is not HwangShihDeCaniSpending or keyword not in (None, "gamma"):
        raise UsageError(f"spending function {spec!r}: only hsd takes a parameter (gamma)")
    try:
        gamma = float(value)
    except ValueError:
        raise UsageError(f"spending function {spec!r}: gamma must be a number, got {value!r}") from None
    return HwangShihDeCaniSpending(gamma)


# ----------------------------------------------------------------------------- the numerical integration


def _grid(mean: float, low: float, high: float, r: int = GRID_R) -> tuple[np.ndarray, np.ndarray]:
    """Points and Simpson weights for integrating a density of ``Z_k`` (mean ``mean``) over ``[low, high]``.

    Jennison and Turnbull (2000), section 19.2.1: ``6r - 1`` points, dense within 3 standard deviations of the mean
    and spreading logarithmically to 3 + 4 log r beyond, trimmed to the continuation region with its ends added,
    then the midpoints of each interval for Simpson's rule.
    """
    i = np.arange(1, 6 * r)
    x = np.where(i < r, mean - 3 - 4 * np.log(r / np.maximum(i, 1)),
                 np.where(i <= 5 * r, mean - 3 + 3 * (i - r) / (2 * r), mean + 3 + 4 * np.log(r / np.maximum(6 * r - i, 1))))
    inside = x[(x > low) & (x < high)]
    lo, hi = max(low, x[0]), min(high, x[-1])
    if not lo < hi:
        return np.array([lo]), np.array([0.0])
    ends = np.concatenate([[lo], inside, [hi]])
    z = np.empty(2 * ends.size - 1)
    z[0::2], z[1::2] = ends, (ends[:-1] + ends[1:]) / 2
    h = np.diff(ends)
    w = np.zeros(z.size)
    w[0:-1:2] += h / 6
    w[2::2] += h / 6
    w[1::2] = 4 * h / 6
    return z, w


@dataclass(frozen=True)
class _Look:
    """The subdensity of ``Z_k`` on the continuation region of look ``k``, times its grid weights."""

    z: np.ndarray
    mass: np.ndarray  # density x weight at each point
    info: float


def _first(info: float, drift: float, low: float, high: float) -> _Look:
    z, w = _grid(drift * math.sqrt(info), low, high)
    return _Look(z, _st.norm.pdf(z - drift * math.sqrt(info)) * w, info)


def _exceed(prev: _Look, info: float, drift: float, bound: float, upper: bool) -> float:
    """P(continue to look k - 1, then ``Z_k >= bound`` (upper) or ``Z_k <= bound``), from the previous look."""
    dk = info - prev.info
    shift = prev.z * math.sqrt(prev.info) + drift * dk
    if upper:
        return float(np.sum(prev.mass * _st.norm.sf((bound * math.sqrt(info) - shift) / math.sqrt(dk))))
    return float(np.sum(prev.mass * _st.norm.cdf((bound * math.sqrt(info) - shift) / math.sqrt(dk))))


def _next(prev: _Look, info: float, drift: float, low: float, high: float) -> _Look:
    """The subdensity at look k on its continuation region (the recursion of Armitage, McPherson and Rowe)."""
    z, w = _grid(drift * math.sqrt(info), low, high)
    dk = info - prev.info
    scale = math.sqrt(info / dk)
    arg = (z[:, None] * math.sqrt(info) - prev.z[None, :] * math.sqrt(prev.info) - drift * dk) / math.sqrt(dk)
    dens = (_st.norm.pdf(arg) * prev.mass[None, :]).sum(axis=1) * scale
    return _Look(z, dens * w, info)


def _first_exceed(info: float, drift: float, bound: float, upper: bool) -> float:
    m = drift * math.sqrt(info)
    return float(_st.norm.sf(bound - m) if upper else _st.norm.cdf(bound - m))


def _check_fractions(fractions) -> tuple[float, ...]:
    t = tuple(float(x) for x in fractions)
    if not t or any(not math.isfinite(x) for x in t):
        raise UsageError(f"information fractions must be finite numbers, got {list(fractions)!r}")
    if t[0] <= 0 or t[-1] != 1.0 or any(b <= a for a, b in zip(t, t[1:])):
        raise UsageError(f"information fractions must increase strictly from above 0 to exactly 1, got {list(t)}")
    return t


def _solve(target: float, prob, upper: bool) -> float:
    """The boundary whose crossing probability (``prob(bound)``, monotone) is ``target``; never crossed at 0."""
    if target <= 1e-15:
        return _NEVER if upper else -_NEVER
    f = lambda b: prob(b) - target  # noqa: E731
    lo, hi = (-_NEVER, _NEVER)
    if upper and f(lo) < 0 or not upper and f(hi) < 0:  # cannot spend that much (the region left is too small)
        return lo if upper else hi
    return float(optimize.brentq(f, lo, hi, xtol=1e-10))


@dataclass(frozen=True)
class Boundaries:
    """Critical values of the look statistics: PASS at ``z >= upper[k]``, FAIL at ``z <= lower[k]``.

    ``fractions``: the information fraction of each look; a bound of +-40 is never crossed (nothing spent there).
    """

    fractions: tuple[float, ...]
    upper: tuple[float, ...]
    lower: tuple[float, ...]

    @property
    def looks(self) -> int:
        return len(self.fractions)


def crossing_probabilities(b: Boundaries, drift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """P(first crossing at look k) of the upper and of the lower boundary, for ``E[Z_k] = drift sqrt(t_k)``.

    ``drift`` is the mean the statistic would have at the maximum information (0: the null ``delta = -margin``).
    Their sums are the design's PASS and FAIL probabilities; one minus both, INCONCLUSIVE.
    """
    up, down = np.zeros(b.looks), np.zeros(b.looks)
    look = None
    for k, (t, u, l) in enumerate(zip(b.fractions, b.upper, b.lower)):
        if look is None:
            up[k], down[k] = _first_exceed(t, drift, u, True), _first_exceed(t, drift, l, False)
            look = _first(t, drift, l, u)
        else:
            up[k], down[k] = _exceed(look, t, drift, u, True), _exceed(look, t, drift, l, False)
            look = _next(look, t, drift, l, u)
    return up, down


@lru_cache(maxsize=256)
def _spending_boundaries(fractions: tuple[float, ...], upper: SpendingFunction, alpha_upper: float,
                         lower: SpendingFunction | None, alpha_lower: float) -> Boundaries:
    t = np.asarray(fractions)
    du = np.diff(upper.spent(t, alpha_upper), prepend=0.0)
    dl = np.diff(lower.spent(t, alpha_lower), prepend=0.0) if lower is not None else np.zeros(t.size)
    ups: list[float] = []
    lows: list[float] = []
    look = None
    for k, tk in enumerate(fractions):
        if look is None:
            u = _solve(du[k], lambda x: _first_exceed(tk, 0.0, x, True), True)
            l = _solve(dl[k], lambda x: _first_exceed(tk, 0.0, x, False), False)
        else:
            u = _solve(du[k], lambda x: _exceed(look, tk, 0.0, x, True), True)
            l = _solve(dl[k], lambda x: _exceed(look, tk, 0.0, x, False), False)
        l = min(l, u)  # the two regions may not overlap (only where both spend a lot at once)
        ups.append(u)
        lows.append(l)
        look = _first(tk, 0.0, l, u) if look is None else _next(look, tk, 0.0, l, u)
    return Boundaries(fractions, tuple(ups), tuple(lows))


def spending_boundaries(fractions: Sequence[float], upper: SpendingFunction | str, alpha_upper: float,
                        lower: SpendingFunction | str | None = None, alpha_lower: float | None = None) -> Boundaries:
    """Boundaries that spend ``alpha_upper`` on crossing the upper boundary and ``alpha_lower`` on the lower one,
    both at the null (``drift = 0``), by the spending functions given, at the looks' information ``fractions``.

    ``lower=None``: a one-sided design (no lower boundary, every bound -40). Each look's bounds solve
    ``P(continue to k, cross at k) = alpha(t_k) - alpha(t_{k-1})`` by the recursive integration.
    """
    t = _check_fractions(fractions)
    _check_alpha(alpha_upper, "alpha of the upper boundary")
    if lower is not None:
        _check_alpha(alpha_lower, "alpha of the lower boundary")
    return _spending_boundaries(t, parse_spending(upper), float(alpha_upper),
                                parse_spending(lower) if lower is not None else None,
                                float(alpha_lower) if lower is not None else 0.0)


def constant_shape_boundaries(fractions: Sequence[float], shape: str, alpha: float) -> Boundaries:
    """The classic symmetric two-sided boundaries ``+-C s_k`` of total error ``alpha`` (``alpha / 2`` each side).

    ``shape``: ``"pocock"`` (``s_k = 1``, Pocock 1977) or ``"obrien-fleming"`` (``s_k = 1 / sqrt(t_k)``, O'Brien and
    Fleming 1979); ``C`` is found by the same integration. Used to check the integration against their tables.
    """
    t = np.asarray(_check_fractions(fractions))
    _check_alpha(alpha, "alpha", high=1.0)
    if shape == "pocock":
        s = np.ones(t.size)
    elif shape == "obrien-fleming":
        s = 1 / np.sqrt(t)
    else:
        raise UsageError(f"shape must be 'pocock' or 'obrien-fleming', got {shape!r}")

    def total(c: float) -> float:
        b = Boundaries(tuple(t), tuple(c * s), tuple(-c * s))
        up, down = crossing_probabilities(b)
        return float(up.sum() + down.sum())

    c = optimize.brentq(lambda c: total(c) - alpha, 0.5, 10.0, xtol=1e-10)
    return Boundaries(tuple(t), tuple(c * s), tuple(-c * s))


def _check_alpha(alpha, what: str, high: float = 0.5) -> None:
    if not is_real(alpha) or not 0 < alpha < high:
        raise UsageError(f"{what} must be in (0, {high:g}), got {alpha!r}")


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
        _check_alpha(self.alpha_pass, "alpha_pass (one-sided PASS error rate)")
        _check_alpha(self.alpha_fail, "alpha_fail (one-sided FAIL error rate)")
        object.__setattr__(self, "pass_spending", parse_spending(self.pass_spending))
        object.__setattr__(self, "fail_spending", parse_spending(self.fail_spending))

    # -- construction

    @classmethod
    def from_fractions(cls, fractions: Sequence[float], max_items: int, **kwargs) -> SequentialDesign:
        """Looks at information ``fractions`` (increasing, ending at 1) of ``max_items``, rounded up to items."""
        if isinstance(max_items, bool) or not isinstance(max_items, (int, np.integer)) or max_items < 1:
            raise UsageError(f"max_items must be a whole number of items >= 1, got {max_items!r}")
        t = _check_fractions(fractions)
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
        return _spending_boundaries(_check_fractions(t), self.pass_spending, self.alpha_pass, self.fail_spending,
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
