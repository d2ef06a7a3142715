"""Verdicts in plain words: one sentence per leaderboard row, the gate's status first.

``FAIL: loses 96 points on passkey, where 57 of 57 right answers became text with no value.`` The sentence reads
the row's comparison with its baseline (:class:`kveval.stats.comparison.RunComparison`: the change per task, the regressed
items and their categories) and the gate's entry for the run (``gate.json``: each task's status, margin and the
items an INCONCLUSIVE task needs). The statistics behind it (bounds, p-values, rules) stay in the gate's reasons,
which the page folds under the sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kveval.report.items import category_phrase
from kveval.report.rows import Row


@dataclass(frozen=True)
class Verdict:
    """A row's verdict: ``status`` (``PASS``, ``FAIL``, ``INCONCLUSIVE``, ``ERROR``, ``baseline``, or ``-`` where
    no gate judged it), the ``sentence`` saying it in words, and the gate's ``reasons`` (one line per rule)."""

    status: str
    sentence: str
    reasons: tuple[str, ...] = ()


def _points(delta: float) -> str:
    """A score change in points (hundredths of the 0-1 score), as a verb phrase."""
    pts = round(abs(delta) * 100)
    if pts == 0:
        return "holds its score"
    return f"{'loses' if delta < 0 else 'gains'} {pts} point{'s' if pts != 1 else ''}"


def task_phrase(row: Row, task: str) -> str:
    """``"loses 96 points on passkey, where 57 of 57 right answers became text with no value"``."""
    c = row.comparison.task(task)
    text = f"{_points(c.delta)} on {task}"
    if c.n_regressed:
        right = sum(1 for it in row.baseline.items if it.task == task and it.correct) if row.baseline else c.n
        text += f", where {c.n_regressed} of {right} right answers {category_phrase([r.get('category') or '' for r in c.regressed])}"
    if c.n_improved:
        text += f"{' and' if c.n_regressed else ', where'} {c.n_improved} wrong answer{'s' if c.n_improved != 1 else ''} became right"
    return text


def _tasks(gate: dict[str, Any] | None, status: str) -> list[dict[str, Any]]:
    return [t for t in (gate or {}).get("tasks", []) if t.get("status") == status]


def verdict(row: Row) -> Verdict:
    """The row's :class:`Verdict` (see the module docstring)."""
    if row.info.is_baseline:
        return Verdict("baseline", "The baseline: every other row of this model is compared with it, item by item.")
    gate = row.gate
    reasons = tuple(f"{t['task']}: {r}" for t in (gate or {}).get("tasks", []) for r in t.get("reasons", []) + t.get("notes", []))
    if gate and gate.get("status") == "ERROR":
        return Verdict("ERROR", f"ERROR: the gate could not judge this run ({gate.get('error')}).", reasons)
    if row.comparison is None:
        return Verdict("-", "No baseline of this model to compare with.", reasons)
    tasks = [c.task for c in row.comparison.tasks]
    status = gate["status"] if gate else "-"
    if status == "FAIL":
        shown = [t["task"] for t in _tasks(gate, "FAIL")]
        body = "; ".join(task_phrase(row, t) for t in shown)
    elif status == "INCONCLUSIVE":
        parts = []
        for t in _tasks(gate, "INCONCLUSIVE"):
            need = f" (about {t['items_needed']} items per task would decide)" if t.get("items_needed") else ""
            parts.append(f"{task_phrase(row, t['task'])}, but too few items to tell{need}")
        body = "; ".join(parts)
    elif status == "PASS":
        margins = sorted({t.get("margin") for t in gate.get("tasks", []) if t.get("margin") is not None})
        within = f"within {round(margins[0] * 100)} points of the baseline" if len(margins) == 1 else "within its margins"
        body = f"{within} on every task (" + "; ".join(task_phrase(row, t) for t in tasks) + ")"
    else:
        body = "not gated; " + "; ".join(task_phrase(row, t) for t in tasks)
    prefix = f"{status}: " if status != "-" else ""
    return Verdict(status, f"{prefix}{body[0].upper() + body[1:] if not prefix else body}.", reasons)


__all__ = ["Verdict", "task_phrase", "verdict"]
