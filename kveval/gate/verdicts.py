"""The regression gate's verdicts: the statuses, one task's verdict, a candidate's, a gated comparison's result
and the exit code of it all. :mod:`kveval.gate.rules` decides them; the report, the deployment decision and the
command read them here.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from kveval.errors import EXIT_ERROR, EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_PASS
from kveval.gate.config import GateConfig
from kveval.runs.records import RunInfo
from kveval.stats import paired
from kveval.stats.comparison import Comparison, RunComparison, _clean
from kveval.stats.sequential import LookDecision

PASS, FAIL, INCONCLUSIVE, ERROR = "PASS", "FAIL", "INCONCLUSIVE", "ERROR"
_ORDER = {PASS: 0, INCONCLUSIVE: 1, FAIL: 2, ERROR: 3}


@dataclass(frozen=True)
class NoiseFloor:
    """The baseline against itself on one task, run again in another batch arrangement (batch size and order).

    Greedy decoding turns the different rounding of other batch shapes into different answers at near-ties; a
    candidate's flips that do not exceed these are not evidence of harm. ``flips``: items whose correctness differs
    (right->wrong plus wrong->right); ``answers``: items whose answer text differs; ``n``: paired items.
    """

    task: str
    n: int
    flips: int
    answers: int


def within_noise_floor(c: Comparison, floor: NoiseFloor | None) -> bool:
    """Whether a candidate's flips (right->wrong plus wrong->right) do not exceed the baseline's own flips under
    another batch arrangement; ``False`` where no floor was measured."""
    return floor is not None and c.n_regressed + c.n_improved <= floor.flips


@dataclass
class TaskVerdict:
    """One candidate x task testcase.

    Attributes
    ----------
    task : str
    status : str
        ``"PASS"``, ``"FAIL"`` or ``"INCONCLUSIVE"``.
    summary : str
        One-line description of the change.
    reasons : list of str
        Broken rules (FAIL) or what could not be shown (INCONCLUSIVE).
    notes : list of str
        Reported, never failing: e.g. confusion shifts among items already
        wrong at baseline.
    margin : float
    test : paired.MarginTest
        The task's change tested against ``-margin`` (one-sided bounds at
        ``1 - alpha``, p-values).
    p_inferior_holm : float
        ``test.p_inferior`` Holm-adjusted over the family.
    items_needed : int or None
        INCONCLUSIVE only: items per task to decide every open rule with the
        configured power at the observed discordance (``None``: a change sits
        on its margin, or only the KL rule is open).
    comparison : Comparison
    min_detectable_loss : float or None
        The smallest true loss of accuracy this task's items would FAIL with the configured power, at its ``n``,
        observed wrong->right rate and design effect (:func:`kveval.stats.paired.min_detectable_loss`): what a PASS
        or an INCONCLUSIVE could have missed. ``None``: no loss is detected that often with so few items.
    noise_floor : NoiseFloor or None
        The baseline's own flips on this task when run again in another batch arrangement, if measured.
    """

    task: str
    status: str
    summary: str
    reasons: list[str]
    notes: list[str]
    margin: float
    test: paired.MarginTest
    p_inferior_holm: float
    items_needed: int | None
    comparison: Comparison
    min_detectable_loss: float | None = None
    noise_floor: "NoiseFloor | None" = None
    #: A sequential gate's decision on the margin at the look that decided (or the last one reached).
    look: "LookDecision | None" = None

    @property
    def could_miss(self) -> str:
        """``", could miss a loss below 0.203"``: the minimum detectable loss, said where a verdict needs it."""
        if self.status == FAIL:
            return ""
        if self.min_detectable_loss is None:
            return ", too few items to detect any loss reliably"
        return f", could miss a loss below {self.min_detectable_loss:.3f}"

    @property
    def within_noise_floor(self) -> bool:
        """Whether this candidate's flips on the task are no more than the baseline's own under a batch rearrangement."""
        return within_noise_floor(self.comparison, self.noise_floor)

    @property
    def lower_bound(self) -> float:
        return self.test.lower

    def to_dict(self) -> dict[str, Any]:
        sequential = {"sequential": self.look.to_dict()} if self.look is not None else {}
        return _clean(
            {
                "task": self.task,
                "status": self.status,
                "summary": self.summary,
                "reasons": self.reasons,
                "notes": self.notes,
                "margin": self.margin,
                "lower_bound": self.test.lower,
                "upper_bound": self.test.upper,
                "p_noninferior": self.test.p_noninferior,
                "p_inferior": self.test.p_inferior,
                "p_inferior_holm": self.p_inferior_holm,
                "items_needed": self.items_needed,
                "min_detectable_loss": self.min_detectable_loss,
                "noise_floor": asdict(self.noise_floor) if self.noise_floor else None,
                "within_noise_floor": self.within_noise_floor if self.noise_floor else None,
                "comparison": self.comparison.to_dict(),
                **sequential,
            }
        )


@dataclass
class CandidateVerdict:
    """The verdict on one candidate run (``status``: the worst of its tasks, or ``"ERROR"``)."""

    path: str
    name: str
    status: str
    tasks: list[TaskVerdict] = field(default_factory=list)
    error: str | None = None
    info: RunInfo | None = None
    comparison: RunComparison | None = None
    warnings: list[str] = field(default_factory=list)
    #: What the verdict was computed on: ``{"baseline", "candidate"}`` -> :func:`~kveval.runs.results.run_digest`
    #: (the candidate's ``None`` where it could not be read). ``kveval report --gate`` attaches the verdict only to
    #: the runs it names.
    judged: dict[str, Any] | None = None
    #: A sequential gate's record (:func:`kveval.gate.rules.judge_sequential`): ``decision`` (PASS, FAIL, CONTINUE,
    #: INCONCLUSIVE), ``look`` (1-based) of ``looks``, ``items`` per task and ``items_total`` spent, the ``boundary``
    #: each task crossed (``None``: none), the ``design``. ``None``: a fixed-n verdict.
    sequential: dict[str, Any] | None = None

    @property
    def reasons(self) -> list[str]:
        return [f"{t.task}: {'; '.join(t.reasons)}" for t in self.tasks if t.status != PASS]

    def line(self) -> str:
        """``PASS name: ...``, ``FAIL name: reasons``, ``INCONCLUSIVE name: ...`` or ``ERROR name: message``."""
        if self.status == ERROR:
            return f"ERROR {self.name}: {self.error}"
        where = ""
        if self.sequential is not None:
            s = self.sequential
            where = f" [look {s['look']} of {s['looks']}, {s['items_total']} items]"
        if self.status == PASS:
            return f"PASS {self.name}{where}: " + "; ".join(t.summary + t.could_miss for t in self.tasks)
        shown = [t for t in self.tasks if t.status == self.status]
        return f"{self.status} {self.name}{where}: " + " | ".join(f"{t.summary}{t.could_miss}: {'; '.join(t.reasons)}" for t in shown)

    def to_dict(self) -> dict[str, Any]:
        return _clean(
            {
                "path": self.path,
                "name": self.name,
                "status": self.status,
                "error": self.error,
                "warnings": self.warnings,
                "run": asdict(self.info) if self.info else None,
                "reasons": self.reasons,
                "tasks": [t.to_dict() for t in self.tasks],
                "judged": self.judged,
                **({"sequential": self.sequential} if self.sequential is not None else {}),
            }
        )


def _exit_for(status: str, cfg: GateConfig) -> int:
    if status == ERROR:
        return EXIT_ERROR
    if status == FAIL:
        return EXIT_FAIL
    if status == INCONCLUSIVE:
        return EXIT_INCONCLUSIVE if cfg.inconclusive_blocks else EXIT_PASS
    return EXIT_PASS


@dataclass
class GateResult:
    """Verdicts on every candidate against one baseline.

    ``status`` is the worst candidate status (ERROR > FAIL > INCONCLUSIVE >
    PASS); ``exit_code`` follows it (:mod:`kveval.errors`).
    """

    config: GateConfig
    baseline: RunInfo
    baseline_path: str
    tasks: list[str]
    candidates: list[CandidateVerdict]
    deployment: Any = None  # kveval.deployment.Deployment, set by deployment_decision
    noise_floor: dict[str, NoiseFloor] = field(default_factory=dict)  # per task, where the baseline was rerun
    noise_floor_path: str | None = None

    @property
    def status(self) -> str:
        return max((c.status for c in self.candidates), key=_ORDER.__getitem__, default=ERROR)

    @property
    def exit_code(self) -> int:
        return _exit_for(self.status, self.config)

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def verdict(self, run: str | os.PathLike | RunInfo) -> str | None:
        """Status of a candidate given its path, name or RunInfo (``None`` if not gated)."""
        key = run.name if isinstance(run, RunInfo) else str(run)
        for c in self.candidates:
            if key == c.name or _same_path(key, c.path):
                return c.status
        return None

    def lines(self) -> list[str]:
        return [c.line() for c in self.candidates]

    def to_dict(self) -> dict[str, Any]:
        return _clean(
            {
                "status": self.status,
                "exit_code": self.exit_code,
                "baseline": asdict(self.baseline),
                "baseline_path": self.baseline_path,
                "tasks": self.tasks,
                "config": self.config.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates],
                "deployment": self.deployment.to_dict() if self.deployment else None,
                "noise_floor_path": self.noise_floor_path,
            }
        )


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def exit_code(results: GateResult | Sequence[GateResult]) -> int:
    """The exit code of the worst result (2 when there is nothing gated)."""
    results = [results] if isinstance(results, GateResult) else list(results)
    if not results:
        return EXIT_ERROR
    worst = max(results, key=lambda r: _ORDER[r.status])
    return worst.exit_code


def overall_status(results: GateResult | Sequence[GateResult]) -> str:
    results = [results] if isinstance(results, GateResult) else list(results)
    return max((r.status for r in results), key=_ORDER.__getitem__, default=ERROR)


__all__ = ["ERROR", "FAIL", "INCONCLUSIVE", "PASS", "CandidateVerdict", "GateResult", "NoiseFloor", "TaskVerdict",
           "exit_code", "overall_status", "within_noise_floor"]
