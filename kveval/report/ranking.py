"""A ranking of one model's compressed runs against each other, with the pairs it cannot tell apart.

The leaderboard compares every candidate with the baseline. A user choosing between formats at the same bytes asks
another question: *which loses least, and is the difference real?* Two candidates' changes against the baseline
can both be inside each other's intervals and still differ, or overlap although one is reliably worse, because the
items are paired three ways. This module compares the candidates with one another directly, item by item:

* for every pair (A, B) of one model's candidates in one mode, the items both ran (a sequential run may stop early:
  only the items both hold are paired, and their prompts must match) give B's change against A, with Tango's score
  interval on the discordances (the bootstrap's where scores are graded, :func:`kveval.stats.comparison.compare_pairs`)
  and a two-sided p-value of "no difference" (exact McNemar for 0/1 scores);
* the p-values of all pairs of a model are Holm-adjusted together (family-wise error 5%);
* candidates are ordered by their mean change against the baseline (each on the items it ran); a candidate's
  *tier* is 1 + the number of candidates it is shown worse than (Holm p < 0.05 and B below A), so formats in one
  tier cannot be told apart on these items.

Nothing here reads a file or a model: it works on the rows :func:`kveval.report.rows.collect_rows` loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Any, Sequence

from kveval.report.rows import Row
from kveval.runs.records import ResultFileError
from kveval.stats import significance
from kveval.stats.comparison import Comparison, compare_pairs

#: Family-wise error rate of the pairwise differences (Holm over every pair of one model and mode).
RANKING_ALPHA = 0.05


@dataclass(frozen=True)
class PairDifference:
    """Candidate ``b`` against candidate ``a`` on the items both ran: ``delta`` = mean score of b - mean score of a."""

    a: str
    b: str
    n: int
    delta: float
    ci_low: float
    ci_high: float
    pvalue: float
    p_holm: float
    method: str

    @property
    def separated(self) -> bool:
        """Whether the pair differs at the ranking's family-wise error rate (:data:`RANKING_ALPHA`)."""
        return self.p_holm < RANKING_ALPHA

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "n": self.n, "delta": self.delta, "ci_low": self.ci_low,
                "ci_high": self.ci_high, "pvalue": self.pvalue, "p_holm": self.p_holm, "method": self.method,
                "separated": self.separated}


@dataclass(frozen=True)
class RankedRun:
    """One candidate in the ranking: its change against the baseline and interval, items, and tier."""

    label: str
    bytes_per_token: float | None
    n: int
    change: float
    ci_low: float
    ci_high: float
    tier: int
    worse_than: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "bytes_per_token": self.bytes_per_token, "n": self.n, "change": self.change,
                "ci_low": self.ci_low, "ci_high": self.ci_high, "tier": self.tier, "worse_than": list(self.worse_than)}


@dataclass(frozen=True)
class ModelRanking:
    """The ranking of one model's candidates in one mode."""

    model: str
    mode: str
    runs: tuple[RankedRun, ...]
    pairs: tuple[PairDifference, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "mode": self.mode, "alpha": RANKING_ALPHA,
                "runs": [r.to_dict() for r in self.runs], "pairs": [p.to_dict() for p in self.pairs]}


def _common_pairs(a: Row, b: Row) -> list:
    """The items both runs hold, paired in ``a``'s order; a prompt that differs under one id is refused."""
    by_id = {it.id: it for it in b.run.items}
    pairs = []
    for it in a.run.items:
        other = by_id.get(it.id)
        if other is None:
            continue
        if other.hash != it.hash:
            raise ResultFileError(f"{a.run.path} and {b.run.path}: item {it.id!r} has another prompt in each "
                                  f"(hash {it.hash} against {other.hash}); they cannot be ranked against each other")
        pairs.append((it, other))
    return pairs


def _difference(a: Row, b: Row, n_resamples: int, seed: int) -> tuple[Comparison, int]:
    pairs = _common_pairs(a, b)
    if not pairs:
        raise ResultFileError(f"{a.run.path} and {b.run.path} hold no item in common; they cannot be ranked")
    return compare_pairs(pairs, cell="ALL", task="ALL", n_resamples=n_resamples, seed=seed), len(pairs)


def rank_model(model: str, mode: str, candidates: Sequence[Row], *, n_resamples: int = 9999,
               seed: int = 0) -> ModelRanking:
    """Rank ``candidates`` (rows of one model and mode, each compared with the baseline) against each other."""
    rows = sorted(candidates, key=lambda r: (-r.comparison.overall.delta, r.label))
    raw = []
    for a, b in combinations(rows, 2):
        c, n = _difference(a, b, n_resamples, seed)
        raw.append((a, b, c, n))
    holm = significance.holm([c.pvalue for *_, c, _ in raw]) if raw else []
    pairs = tuple(PairDifference(a.label, b.label, n, c.delta, c.ci_low, c.ci_high, c.pvalue, float(p), c.ci_method)
                  for (a, b, c, n), p in zip(raw, holm))
    worse: dict[str, list[str]] = {r.label: [] for r in rows}
    for p in pairs:
        if p.separated:
            loser, winner = (p.b, p.a) if p.delta < 0 else (p.a, p.b)
            worse[loser].append(winner)
    ranked = tuple(RankedRun(r.label, r.info.bytes_per_token, r.comparison.overall.n, r.comparison.overall.delta,
                             r.comparison.overall.ci_low, r.comparison.overall.ci_high, 1 + len(worse[r.label]),
                             tuple(worse[r.label])) for r in rows)
    return ModelRanking(model, mode, ranked, pairs)


def rank_rows(rows: Sequence[Row], *, n_resamples: int = 9999, seed: int = 0) -> list[ModelRanking]:
    """One :class:`ModelRanking` per model and mode with at least two candidates, in the rows' order."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r.comparison is not None:
            groups.setdefault((r.info.model, r.info.mode), []).append(r)
    return [rank_model(model, mode, group, n_resamples=n_resamples, seed=seed)
            for (model, mode), group in groups.items() if len(group) >= 2]


def ranking_markdown(rankings: Sequence[ModelRanking]) -> str:
    """The rankings as markdown: per model, the ordered candidates with tiers, then the pairs told apart."""
    lines = ["# kveval ranking", "",
             "Candidates of one model ranked by their change against the baseline (each on the items it ran, 95% "
             "interval). Every pair is then compared directly on the items both ran; *tier* = 1 + the number of "
             f"candidates shown better at a family-wise {RANKING_ALPHA:.0%} (Holm over the model's pairs), so "
             "candidates in one tier cannot be told apart on these items.", ""]
    for m in rankings:
        lines += [f"## {m.model} ({m.mode})", "",
                  "| rank | policy | bytes/token | items | change [95% CI] | tier | shown worse than |",
                  "|---:|---|---:|---:|---:|---:|---|"]
        for i, r in enumerate(m.runs, 1):
            size = "-" if r.bytes_per_token is None else f"{r.bytes_per_token:,.0f}"
            lines.append(f"| {i} | {r.label} | {size} | {r.n} | {r.change:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}] "
                         f"| {r.tier} | {', '.join(r.worse_than) or '-'} |")
        told = [p for p in m.pairs if p.separated]
        lines += ["", f"Pairs told apart: {len(told)} of {len(m.pairs)}."]
        if told:
            lines += ["", "| better | worse | items | difference [95% CI] | p (Holm) |", "|---|---|---:|---:|---:|"]
            for p in told:
                better, worse_label, d = (p.a, p.b, -p.delta) if p.delta < 0 else (p.b, p.a, p.delta)
                lo, hi = (-p.ci_high, -p.ci_low) if p.delta < 0 else (p.ci_low, p.ci_high)
                lines.append(f"| {better} | {worse_label} | {p.n} | {d:+.3f} [{lo:+.3f}, {hi:+.3f}] | {p.p_holm:.3g} |")
        lines.append("")
    return "\n".join(lines)
