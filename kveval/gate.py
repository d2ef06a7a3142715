"""Regression gate: may this compression policy be deployed instead of the baseline?

``kveval gate --config configs/gate.yaml --baseline RUN --candidate RUN [...] --out DIR``
compares each candidate with the baseline item by item (:mod:`kveval.compare`)
and applies the rules of the gate config (see ``configs/gate.yaml``) to every
gated task: no significant regression (Holm-adjusted), non-inferiority within a
margin, a bounded negative flip rate and bounded rises of memory-confusion
categories. It prints one verdict line per candidate with its reasons, writes
``gate.md``, ``gate.xml`` (JUnit: one testcase per candidate x task) and
``gate.json`` to ``--out``, and exits 0 when every candidate passes, 1 when any
regressed, 2 on any error: missing, corrupt, truncated or unpaired results
never pass.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from kveval import stats
from kveval.compare import (
    CATEGORIES,
    OVERALL,
    Comparison,
    RunComparison,
    _clean,
    adjust_pvalues,
    compare_runs,
    expand_run_dirs,
    fmt_p,
    load_run,
)
from kveval.records import ResultFileError, RunInfo, atomic_write_text

PASS, FAIL, ERROR = "PASS", "FAIL", "ERROR"
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "gate.yaml"
_KEYS = {
    "tasks",
    "alpha",
    "family",
    "margin",
    "require_non_inferiority",
    "max_negative_flip_rate",
    "max_confusion_increase",
    "confidence_level",
    "n_resamples",
    "seed",
}


@dataclass
class GateConfig:
    """Rules of the gate (the YAML file, validated).

    Attributes
    ----------
    tasks : "all" or list of str
        Tasks to gate.
    alpha : float
        Family-wise error rate of the Holm-adjusted regression test; the
        non-inferiority bound is one-sided at ``1 - alpha``.
    family : {"candidate", "sweep"}
        Holm family: one candidate's gated tasks, or all candidates' together.
    margin : dict
        Non-inferiority margin per task, ``"default"`` for the rest.
    require_non_inferiority : bool
        Fail unless the lower bound of the change is above ``-margin``.
    max_negative_flip_rate : float or None
        Largest right->wrong share per task.
    max_confusion_increase : dict
        Largest rise in share per category, ``"overall"`` and ``"default"``.
    confidence_level, n_resamples, seed
        Bootstrap settings.
    """

    tasks: str | list[str] = "all"
    alpha: float = 0.05
    family: str = "candidate"
    margin: dict[str, float] = field(default_factory=lambda: {"default": 0.05})
    require_non_inferiority: bool = True
    max_negative_flip_rate: float | None = 0.10
    max_confusion_increase: dict[str, float] = field(default_factory=lambda: {OVERALL: 0.10, "default": 0.10})
    confidence_level: float = 0.95
    n_resamples: int = 9999
    seed: int = 0

    def margin_for(self, task: str) -> float:
        return float(self.margin.get(task, self.margin.get("default", 0.05)))

    def confusion_limit(self, category: str) -> float | None:
        if category in self.max_confusion_increase:
            return self.max_confusion_increase[category]
        if category == OVERALL:
            return None
        return self.max_confusion_increase.get("default")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "gate config") -> "GateConfig":
        data = dict(data or {})
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
        cfg = cls()
        if "tasks" in data:
            t = data["tasks"]
            if t == "all" or t is None:
                cfg.tasks = "all"
            elif isinstance(t, str):
                cfg.tasks = [t]
            elif isinstance(t, list) and t and all(isinstance(x, str) for x in t):
                cfg.tasks = list(t)
            else:
                raise ValueError(f"{source}: tasks must be 'all' or a non-empty list of task names, got {t!r}")
        if "alpha" in data:
            cfg.alpha = _prob(data["alpha"], "alpha", source, open_interval=True)
        if "family" in data:
            if data["family"] not in ("candidate", "sweep"):
                raise ValueError(f"{source}: family must be 'candidate' or 'sweep', got {data['family']!r}")
            cfg.family = data["family"]
        if "margin" in data:
            m = data["margin"]
            if isinstance(m, dict):
                cfg.margin = {str(k): _nonneg(v, f"margin.{k}", source) for k, v in m.items()}
                cfg.margin.setdefault("default", 0.05)
            else:
                cfg.margin = {"default": _nonneg(m, "margin", source)}
        if "require_non_inferiority" in data:
            if not isinstance(data["require_non_inferiority"], bool):
                raise ValueError(f"{source}: require_non_inferiority must be true or false")
            cfg.require_non_inferiority = data["require_non_inferiority"]
        if "max_negative_flip_rate" in data:
            v = data["max_negative_flip_rate"]
            cfg.max_negative_flip_rate = None if v is None else _prob(v, "max_negative_flip_rate", source)
        if "max_confusion_increase" in data:
            v = data["max_confusion_increase"]
            if v is None:
                cfg.max_confusion_increase = {}
            elif isinstance(v, dict):
                allowed = {*CATEGORIES, OVERALL, "default"} - {"correct"}
                bad = sorted(str(k) for k in v if k not in allowed)
                if bad:
                    raise ValueError(
                        f"{source}: max_confusion_increase: unknown category {', '.join(bad)} (use {', '.join(sorted(allowed))})"
                    )
                cfg.max_confusion_increase = {str(k): _prob(x, f"max_confusion_increase.{k}", source) for k, x in v.items() if x is not None}
            else:
                x = _prob(v, "max_confusion_increase", source)
                cfg.max_confusion_increase = {OVERALL: x, "default": x}
        if "confidence_level" in data:
            cfg.confidence_level = _prob(data["confidence_level"], "confidence_level", source, open_interval=True)
        if "n_resamples" in data:
            if not isinstance(data["n_resamples"], int) or data["n_resamples"] < 100:
                raise ValueError(f"{source}: n_resamples must be an integer >= 100")
            cfg.n_resamples = data["n_resamples"]
        if "seed" in data:
            if not isinstance(data["seed"], int):
                raise ValueError(f"{source}: seed must be an integer")
            cfg.seed = data["seed"]
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(v: Any, name: str, source: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{source}: {name} must be a number, got {v!r}")
    return float(v)


def _nonneg(v: Any, name: str, source: str) -> float:
    x = _num(v, name, source)
    if x < 0:
        raise ValueError(f"{source}: {name} must be >= 0, got {v!r}")
    return x


def _prob(v: Any, name: str, source: str, open_interval: bool = False) -> float:
    x = _num(v, name, source)
    if open_interval and not 0 < x < 1 or not 0 <= x <= 1:
        raise ValueError(f"{source}: {name} must be in {'(0, 1)' if open_interval else '[0, 1]'}, got {v!r}")
    return x


def load_gate_config(config: str | os.PathLike | dict | GateConfig | None = None) -> GateConfig:
    """A :class:`GateConfig` from a YAML path, a dict, a config, or ``None`` (built-in defaults)."""
    if config is None:
        return GateConfig()
    if isinstance(config, GateConfig):
        return config
    if isinstance(config, dict):
        return GateConfig.from_dict(config)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such gate config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{path}: a gate config is a mapping of settings")
    return GateConfig.from_dict(data, source=str(path))


@dataclass
class TaskVerdict:
    """One candidate x task testcase.

    Attributes
    ----------
    task : str
    status : str
        ``"PASS"`` or ``"FAIL"``.
    summary : str
        One-line description of the change.
    reasons : list of str
        Broken rules (empty when passing).
    margin : float
    lower_bound : float
        One-sided ``1 - alpha`` lower bound of the score change.
    comparison : Comparison
    """

    task: str
    status: str
    summary: str
    reasons: list[str]
    margin: float
    lower_bound: float
    comparison: Comparison

    def to_dict(self) -> dict[str, Any]:
        return _clean(
            {
                "task": self.task,
                "status": self.status,
                "summary": self.summary,
                "reasons": self.reasons,
                "margin": self.margin,
                "lower_bound": self.lower_bound,
                "comparison": self.comparison.to_dict(),
            }
        )


@dataclass
class CandidateVerdict:
    """The verdict on one candidate run.

    Attributes
    ----------
    path : str
        Candidate results as given.
    name : str
        Run name (the path when the run could not be read).
    status : str
        ``"PASS"``, ``"FAIL"`` or ``"ERROR"``.
    tasks : list of TaskVerdict
    error : str or None
        Why the candidate could not be evaluated.
    info : RunInfo or None
    comparison : RunComparison or None
    """

    path: str
    name: str
    status: str
    tasks: list[TaskVerdict] = field(default_factory=list)
    error: str | None = None
    info: RunInfo | None = None
    comparison: RunComparison | None = None

    @property
    def reasons(self) -> list[str]:
        return [f"{t.summary}: {'; '.join(t.reasons)}" for t in self.tasks if t.status == FAIL]

    def line(self) -> str:
        """The verdict line: ``PASS name: ...``, ``FAIL name: reasons`` or ``ERROR name: message``."""
        if self.status == ERROR:
            return f"ERROR {self.name}: {self.error}"
        if self.status == FAIL:
            return f"FAIL {self.name}: " + " | ".join(self.reasons)
        return f"PASS {self.name}: " + "; ".join(t.summary for t in self.tasks)

    def to_dict(self) -> dict[str, Any]:
        return _clean(
            {
                "path": self.path,
                "name": self.name,
                "status": self.status,
                "error": self.error,
                "run": asdict(self.info) if self.info else None,
                "reasons": self.reasons,
                "tasks": [t.to_dict() for t in self.tasks],
            }
        )


@dataclass
class GateResult:
    """Verdicts on every candidate against one baseline.

    ``exit_code`` is 2 when any candidate could not be evaluated, else 1 when
    any failed, else 0.
    """

    config: GateConfig
    baseline: RunInfo
    baseline_path: str
    tasks: list[str]
    candidates: list[CandidateVerdict]

    @property
    def exit_code(self) -> int:
        if any(c.status == ERROR for c in self.candidates):
            return 2
        if any(c.status == FAIL for c in self.candidates):
            return 1
        return 0

    @property
    def passed(self) -> bool:
        return self.exit_code == 0

    @property
    def status(self) -> str:
        return {0: PASS, 1: FAIL, 2: ERROR}[self.exit_code]

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
            }
        )


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _summary(c: Comparison) -> str:
    cats = c.regressed_categories()
    cat_text = ", ".join(f"{n} {k}" for k, n in cats.most_common())
    head = f"{c.task} regressed {c.n_regressed}/{c.n} items" + (f" ({cat_text})" if c.n_regressed and cats else "")
    if c.n_improved:
        head += f", improved {c.n_improved}"
    test = "McNemar" if c.test == "mcnemar" else "Wilcoxon"
    return (
        f"{head}, delta {c.delta:+.2f} [{c.ci_low:+.2f},{c.ci_high:+.2f}], "
        f"{test} p={fmt_p(c.pvalue)} (Holm {fmt_p(c.p_holm)})"
    )


def _judge(c: Comparison, cfg: GateConfig) -> TaskVerdict:
    margin = cfg.margin_for(c.task)
    ni = stats.non_inferiority(
        c.baseline_scores, c.candidate_scores, margin, alpha=cfg.alpha, n_resamples=cfg.n_resamples, seed=cfg.seed
    )
    reasons: list[str] = []
    if c.delta < 0 and c.p_holm is not None and c.p_holm < cfg.alpha:
        reasons.append(f"significant regression (Holm p={fmt_p(c.p_holm)} < alpha={cfg.alpha:g})")
    if cfg.require_non_inferiority and not ni.passed:
        reasons.append(
            f"non-inferiority not shown: {int(round((1 - cfg.alpha) * 100))}% lower bound {ni.lower:+.3f} <= -margin {-margin:+.3f}"
        )
    if cfg.max_negative_flip_rate is not None and c.negative_flip_rate > cfg.max_negative_flip_rate + 1e-12:
        reasons.append(
            f"negative flip rate {_pct(c.negative_flip_rate)} ({c.n_regressed}/{c.n} right->wrong) > {_pct(cfg.max_negative_flip_rate)}"
        )
    for cat, d in c.confusion_delta.items():
        if cat == "correct":
            continue
        limit = cfg.confusion_limit(cat)
        if limit is not None and d > limit + 1e-12:
            label = "confusion (all categories)" if cat == OVERALL else cat
            reasons.append(
                f"{label} rate rose {c.confusion_baseline.get(cat, 0.0) * 100:.1f}% -> "
                f"{c.confusion_candidate.get(cat, 0.0) * 100:.1f}% (+{d * 100:.1f} points > {limit * 100:.1f})"
            )
    return TaskVerdict(c.task, FAIL if reasons else PASS, _summary(c), reasons, margin, ni.lower, c)


def evaluate_gate(
    config: str | os.PathLike | dict | GateConfig | None,
    baseline_dir: str | os.PathLike,
    candidate_dirs: Sequence[str | os.PathLike],
    *,
    metric: str | dict[str, str] | None = None,
) -> GateResult:
    """Evaluate candidates against a baseline under the gate rules.

    Parameters
    ----------
    config : path, dict, GateConfig or None
        Gate YAML (``configs/gate.yaml`` schema); ``None`` uses the defaults.
    baseline_dir : path
        Baseline run folder (or lm-eval ``--log_samples`` output).
    candidate_dirs : sequence of paths
        Candidate runs. A candidate whose results cannot be read or paired gets
        status ``"ERROR"`` (the others are still evaluated).
    metric : str or dict, optional
        lm-eval outputs only: metric to score by.

    Returns
    -------
    GateResult
        ``exit_code`` 0 pass, 1 regression, 2 error.

    Raises
    ------
    ResultFileError
        The baseline is missing, corrupt or truncated, or a gated task is not
        in the baseline.
    ValueError
        Invalid config or no candidates.
    """
    cfg = load_gate_config(config)
    if not candidate_dirs:
        raise ValueError("no candidate runs to gate")
    base = load_run(baseline_dir, metric=metric)
    base_tasks = list(dict.fromkeys(it.task for it in base.items))
    if cfg.tasks == "all":
        gated = base_tasks
    else:
        missing = [t for t in cfg.tasks if t not in base_tasks]
        if missing:
            raise ResultFileError(
                f"gated task(s) {', '.join(missing)} not in the baseline results {base.path} (it has {', '.join(base_tasks)})"
            )
        gated = list(cfg.tasks)
    verdicts: list[CandidateVerdict] = []
    for cand in candidate_dirs:
        try:
            rc = compare_runs(
                base,
                cand,
                confidence_level=cfg.confidence_level,
                n_resamples=cfg.n_resamples,
                seed=cfg.seed,
                cells=False,
                metric=metric,
            )
        except (ResultFileError, ValueError, OSError) as exc:
            verdicts.append(CandidateVerdict(str(cand), str(cand), ERROR, error=str(exc)))
            continue
        verdicts.append(CandidateVerdict(str(cand), rc.candidate.name, PASS, info=rc.candidate, comparison=rc))
    result = GateResult(cfg, base.info, str(base.path), gated, verdicts)
    _judge_all([result], cfg)
    return result


def _judge_all(results: Sequence[GateResult], cfg: GateConfig) -> None:
    """Holm-adjust over the configured family, then apply the rules to every candidate x gated task."""
    ok = [(r, v) for r in results for v in r.candidates if v.comparison is not None]
    if cfg.family == "sweep":
        adjust_pvalues([v.comparison.task(t) for r, v in ok for t in r.tasks])
    else:
        for r, v in ok:
            adjust_pvalues([v.comparison.task(t) for t in r.tasks])
    for r, v in ok:
        v.tasks = [_judge(v.comparison.task(t), cfg) for t in r.tasks]
        v.status = FAIL if any(t.status == FAIL for t in v.tasks) else PASS


def group_runs_by_baseline(run_dirs: Sequence[str | os.PathLike]) -> list[tuple[Path, list[Path]]]:
    """Pair each compressed run of a sweep with its model's baseline run.

    Parameters
    ----------
    run_dirs : sequence of paths
        Run folders, or sweep folders holding ``runs/*/``.

    Returns
    -------
    list of (baseline, candidates)
        One entry per model, in the order models first appear.

    Raises
    ------
    ResultFileError
        An unreadable run, a model with candidates but no baseline, or a model
        with two baselines: a candidate without its baseline never passes.
    """
    groups: dict[str, dict[str, Any]] = {}
    for path in expand_run_dirs(run_dirs):
        info = load_run(path).info
        g = groups.setdefault(info.model, {"baseline": None, "candidates": []})
        if info.is_baseline:
            if g["baseline"] is not None:
                raise ResultFileError(f"two baseline runs for model {info.model!r}: {g['baseline']} and {path}")
            g["baseline"] = path
        else:
            g["candidates"].append(path)
    out = []
    for model, g in groups.items():
        if g["baseline"] is None:
            raise ResultFileError(
                f"no baseline run (policy none) for model {model!r}; its {len(g['candidates'])} run(s) cannot be gated "
                f"({', '.join(str(c) for c in g['candidates'][:3])})"
            )
        if g["candidates"]:
            out.append((g["baseline"], g["candidates"]))
    return out


def evaluate_sweep(
    config: str | os.PathLike | dict | GateConfig | None,
    run_dirs: Sequence[str | os.PathLike],
    *,
    metric: str | dict[str, str] | None = None,
) -> list[GateResult]:
    """Gate every compressed run of a sweep against its own model's baseline (one :class:`GateResult` per model).

    The overall exit code is :func:`exit_code` of the returned list. With
    ``family: sweep`` the Holm family spans every candidate x gated task of
    every model.
    """
    cfg = load_gate_config(config)
    results = [evaluate_gate(cfg, base, cands, metric=metric) for base, cands in group_runs_by_baseline(run_dirs)]
    if cfg.family == "sweep" and len(results) > 1:
        _judge_all(results, cfg)
    return results


def exit_code(results: GateResult | Sequence[GateResult]) -> int:
    """0 when every candidate passed, 1 when any regressed, 2 when any errored (or there is nothing gated)."""
    results = [results] if isinstance(results, GateResult) else list(results)
    return max((r.exit_code for r in results), default=2)


# ----------------------------------------------------------------------------- outputs


def to_markdown(result: GateResult) -> str:
    cfg = result.config
    out = [
        f"# kveval gate: {result.status}",
        "",
        f"Baseline: `{result.baseline.name}` ({result.baseline_path}). Gated tasks: {', '.join(result.tasks)}.",
        f"Rules: Holm-adjusted regression test at alpha={cfg.alpha:g} (family: {cfg.family}); "
        + (f"non-inferiority ({int(round((1 - cfg.alpha) * 100))}% one-sided lower bound > -margin); " if cfg.require_non_inferiority else "")
        + (f"negative flip rate <= {_pct(cfg.max_negative_flip_rate)}; " if cfg.max_negative_flip_rate is not None else "")
        + (
            "confusion increase <= " + ", ".join(f"{k} {v * 100:.0f} points" for k, v in cfg.max_confusion_increase.items())
            if cfg.max_confusion_increase
            else "no confusion limit"
        )
        + ".",
        "",
        "| verdict | candidate | task | n | baseline | candidate | delta [CI] | p (Holm) | -flips | margin | lower bound | reasons |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for cv in result.candidates:
        if cv.status == ERROR:
            out.append(f"| **ERROR** | `{_md(cv.name)}` | | | | | | | | | | {_md(cv.error or '')} |")
            continue
        for t in cv.tasks:
            c = t.comparison
            verdict = "PASS" if t.status == PASS else "**FAIL**"
            out.append(
                f"| {verdict} | `{_md(cv.name)}` | {_md(t.task)} | {c.n} | {c.baseline_score:.3f} | {c.candidate_score:.3f} | "
                f"{c.delta:+.3f} [{c.ci_low:+.3f}, {c.ci_high:+.3f}] | {fmt_p(c.pvalue)} ({fmt_p(c.p_holm)}) | "
                f"{c.n_regressed} ({_pct(c.negative_flip_rate)}) | {t.margin:g} | {t.lower_bound:+.3f} | {_md('; '.join(t.reasons)) or '-'} |"
            )
    out += ["", "## Verdicts", ""] + [f"- {_md(line)}" for line in result.lines()]
    reg = [(cv, t) for cv in result.candidates for t in cv.tasks if t.comparison.regressed]
    if reg:
        out += ["", "## Regressed items", ""]
        for cv, t in reg:
            items = ", ".join(
                f"`{r['id']}` ({r.get('recalled') or r['category'] or 'wrong'})"
                for r in t.comparison.regressed[:20]
            )
            more = f" and {len(t.comparison.regressed) - 20} more" if len(t.comparison.regressed) > 20 else ""
            out.append(f"- `{_md(cv.name)}` {_md(t.task)}: {items}{more}")
    return "\n".join(out) + "\n"


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def to_junit(result: GateResult | Sequence[GateResult]) -> str:
    """JUnit XML: one testsuite per candidate, one testcase per candidate x task."""
    results = [result] if isinstance(result, GateResult) else list(result)
    candidates = [c for r in results for c in r.candidates]
    n_fail = sum(1 for c in candidates for t in c.tasks if t.status == FAIL)
    n_err = sum(1 for c in candidates if c.status == ERROR)
    n_tests = sum(len(c.tasks) or 1 for c in candidates)
    root = ET.Element("testsuites", name="kveval gate", tests=str(n_tests), failures=str(n_fail), errors=str(n_err))
    for cv in candidates:
        fails = sum(1 for t in cv.tasks if t.status == FAIL)
        suite = ET.SubElement(
            root,
            "testsuite",
            name=cv.name,
            tests=str(len(cv.tasks) or 1),
            failures=str(fails),
            errors=str(1 if cv.status == ERROR else 0),
        )
        if cv.status == ERROR:
            case = ET.SubElement(suite, "testcase", classname=f"kveval.gate.{cv.name}", name="results", time="0")
            err = ET.SubElement(case, "error", message=cv.error or "error", type="ResultFileError")
            err.text = cv.error
            continue
        for t in cv.tasks:
            case = ET.SubElement(suite, "testcase", classname=f"kveval.gate.{cv.name}", name=t.task, time="0")
            if t.status == FAIL:
                f = ET.SubElement(case, "failure", message=f"{t.summary}: {'; '.join(t.reasons)}", type="regression")
                regressed = "\n".join(
                    f"  {r['id']}: {r['category'] or 'wrong'}" + (f" ({r['recalled']})" if r.get("recalled") else "")
                    for r in t.comparison.regressed
                )
                f.text = "\n".join(t.reasons) + ("\nregressed items:\n" + regressed if regressed else "")
            else:
                out = ET.SubElement(case, "system-out")
                out.text = t.summary
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_gate_outputs(result: GateResult | Sequence[GateResult], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``gate.md``, ``gate.xml`` (JUnit) and ``gate.json``; return their paths.

    Several results (one per model of a sweep) go into the same three files;
    their ``gate.json`` is ``{"status", "exit_code", "results": [...]}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "gate.md", "junit": out / "gate.xml", "json": out / "gate.json"}
    if isinstance(result, GateResult):
        md, data = to_markdown(result), result.to_dict()
    else:
        results = list(result)
        code = exit_code(results)
        md = "\n".join(to_markdown(r).replace("# kveval gate:", f"# kveval gate ({r.baseline.model}):", 1) for r in results)
        data = {"status": {0: PASS, 1: FAIL, 2: ERROR}[code], "exit_code": code, "results": [r.to_dict() for r in results]}
    atomic_write_text(paths["markdown"], md)
    atomic_write_text(paths["junit"], to_junit(result))
    atomic_write_text(paths["json"], json.dumps(data, indent=2))
    return paths


# ----------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help=f"gate YAML (default: {DEFAULT_CONFIG_PATH.relative_to(DEFAULT_CONFIG_PATH.parent.parent)} if present, else built-in defaults)",
    )
    parser.add_argument("--baseline", required=True, metavar="RUN", help="baseline run folder")
    parser.add_argument("--candidate", required=True, action="append", metavar="RUN", help="candidate run folder (repeatable)")
    parser.add_argument("--out", metavar="DIR", help="write gate.md, gate.xml (JUnit) and gate.json here")
    parser.add_argument("--metric", help="lm-eval outputs: metric to score by")


def run(args: argparse.Namespace) -> int:
    config = args.config or (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None)
    result = evaluate_gate(config, args.baseline, args.candidate, metric=args.metric)
    for cv in result.candidates:
        if cv.status == ERROR:
            print(f"kveval gate: error: {cv.error}", file=sys.stderr)
        else:
            print(cv.line())
    if args.out:
        paths = write_gate_outputs(result, args.out)
        print(f"wrote {paths['markdown']}, {paths['junit']}, {paths['json']}")
    print(f"gate: {result.status} (exit {result.exit_code})")
    return result.exit_code
