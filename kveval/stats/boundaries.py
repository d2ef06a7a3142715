"""Group-sequential boundaries: spending functions, and the numerical integration that turns them into the
boundaries of a design's looks (:mod:`kveval.stats.sequential` decides with them).

A spending function ``alpha(t)`` of the information fraction ``t`` says how much of a decision's error rate may be
spent by each look (Lan and DeMets 1983, Biometrika 70:659-663): ``alpha(t_k) - alpha(t_{k-1})`` at look ``k``.
Three families are registered by name (:func:`parse_spending`): O'Brien-Fleming-type, Pocock-type and
Hwang-Shih-DeCani. The boundaries are computed for the design's own looks by the recursive numerical integration
of the canonical joint distribution (Armitage, McPherson and Rowe 1969, J R Stat Soc A 132:235-244), on the grid
and Simpson weights of Jennison and Turnbull (2000, ch. 19); the same integration gives the classic
constant-shape boundaries of Pocock (1977) and O'Brien and Fleming (1979), which the tests check against their
published tables. Everything here is arithmetic: no files, no randomness.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import optimize
from scipy import stats as _st

from kveval.errors import UsageError
from kveval.values import is_real

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


def check_fractions(fractions) -> tuple[float, ...]:
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
def cached_spending_boundaries(fractions: tuple[float, ...], upper: SpendingFunction, alpha_upper: float,
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
    t = check_fractions(fractions)
    check_alpha(alpha_upper, "alpha of the upper boundary")
    if lower is not None:
        check_alpha(alpha_lower, "alpha of the lower boundary")
    return cached_spending_boundaries(t, parse_spending(upper), float(alpha_upper),
                                parse_spending(lower) if lower is not None else None,
                                float(alpha_lower) if lower is not None else 0.0)


def constant_shape_boundaries(fractions: Sequence[float], shape: str, alpha: float) -> Boundaries:
    """The classic symmetric two-sided boundaries ``+-C s_k`` of total error ``alpha`` (``alpha / 2`` each side).

    ``shape``: ``"pocock"`` (``s_k = 1``, Pocock 1977) or ``"obrien-fleming"`` (``s_k = 1 / sqrt(t_k)``, O'Brien and
    Fleming 1979); ``C`` is found by the same integration. Used to check the integration against their tables.
    """
    t = np.asarray(check_fractions(fractions))
    check_alpha(alpha, "alpha", high=1.0)
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


def check_alpha(alpha, what: str, high: float = 0.5) -> None:
    if not is_real(alpha) or not 0 < alpha < high:
        raise UsageError(f"{what} must be in (0, {high:g}), got {alpha!r}")


__all__ = ["GRID_R", "HSD_GAMMA_LIMIT", "Boundaries", "HwangShihDeCaniSpending", "OBrienFlemingSpending", "PocockSpending",
           "SpendingFunction", "cached_spending_boundaries", "check_alpha", "check_fractions", "constant_shape_boundaries", "crossing_probabilities",
           "parse_spending", "register_spending", "spending_boundaries"]
