"""The gate's outputs: ``gate.md`` (tables and verdicts), ``gate.xml`` (JUnit) and ``gate.json``.

JUnit has no "inconclusive": an INCONCLUSIVE task is a ``<skipped>`` testcase
carrying its reasons and the items needed, a FAIL a ``<failure>``, an
unreadable candidate an ``<error>``.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Sequence

from kveval.gate.verdicts import ERROR, FAIL, INCONCLUSIVE, PASS, GateResult, exit_code, overall_status
from kveval.gate.verify import sealed
from kveval.runs.records import atomic_write_texts
from kveval.stats.tables import fmt_p

#: Regressed items listed per candidate x task in ``gate.md``.
SHOWN_REGRESSED = 20
#: Characters of an answer quoted in ``gate.md``.
QUOTED = 80


def _quote(answer: str | None) -> str:
    """An answer as inline code on one line, cut to :data:`QUOTED` characters (``(empty)`` for none)."""
    text = " ".join(str(answer or "").split())
    if not text:
        return "(empty)"
    text = text if len(text) <= QUOTED else text[: QUOTED - 1] + "\u2026"
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _floor(t) -> str:
    """A task's noise floor cell: the baseline's own flips under another batch arrangement, and whether the
    candidate's stay within them."""
    if t.noise_floor is None:
        return "-"
    return f"{t.noise_floor.flips}/{t.noise_floor.n}" + (" (within)" if t.within_noise_floor else "")


def _sequential_note(result: GateResult) -> str:
    """What a sequential gate changes in the rules above, and where each candidate stopped ("" at fixed n)."""
    seq = result.config.sequential
    if seq is None:
        return ""
    looks = ", ".join(f"{x:g}" for x in seq.looks) + (" of each task's items" if seq.fractions else " items per task")
    stops = "; ".join(f"`{_md(c.name)}` {c.sequential['decision']} at look {c.sequential['look']} "
                      f"({c.sequential['items_total']} items)" for c in result.candidates if c.sequential)
    return (f" Sequential: looks at {looks}, {seq.pass_spending.name} (PASS) / {seq.fail_spending.name} (FAIL)"
            f" spending; the margin is tested by the group-sequential boundaries in place of the bounds above (FAIL"
            f" alpha split over the tests, Bonferroni), each candidate judged on the first blocks it holds and stopped"
            f" at its first PASS or FAIL" + (f": {stops}." if stops else "."))


def to_markdown(result: GateResult) -> str:
    cfg = result.config
    level = int(round((1 - cfg.alpha) * 100))
    out = [
        f"# kveval gate: {result.status}",
        "",
        f"Baseline: `{result.baseline.name}` ({result.baseline_path}). Gated tasks: {', '.join(result.tasks)}.",
        f"PASS: the {level}% one-sided lower bound of the change lies above -margin"
        + (f" and the net negative-flip rate is shown under {cfg.max_negative_flip_rate:g}" if cfg.max_negative_flip_rate is not None else "")
        + f". FAIL: the {level}% upper bound lies below -margin (Holm, family: {cfg.family}), or a rule is broken at {level}%"
        + (
            " (items right at baseline that fell into a confusion category, share of all items: " + ", ".join(f"{k} {v * 100:.0f}%" for k, v in cfg.max_confusion_increase.items()) + ")"
            if cfg.max_confusion_increase
            else ""
        )
        + ". INCONCLUSIVE: neither (too few items)"
        + ("." if cfg.inconclusive_blocks else "; it does not block (inconclusive_blocks: false).")
        + f" Min. detectable loss: the true loss that would FAIL with {cfg.power:.0%} power at the task's n, churn and"
        " clustering; a PASS could have missed a smaller one."
        + (f" Noise floor: the baseline run again in another batch arrangement ({result.noise_floor_path}); a FAIL"
           " whose flips stay within it is reported INCONCLUSIVE." if result.noise_floor_path else "")
        + _sequential_note(result),
        "",
        "| verdict | candidate | task | n | baseline | candidate | change [one-sided bounds] | p any change (Holm) | -flips | +flips | noise floor | margin | min. detectable loss | reasons |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for cv in result.candidates:
        if cv.status == ERROR:
            out.append(f"| **ERROR** | `{_md(cv.name)}` | | | | | | | | | | | | {_md(cv.error or '')} |")
            continue
        for t in cv.tasks:
            c = t.comparison
            verdict = t.status if t.status == PASS else f"**{t.status}**"
            out.append(
                f"| {verdict} | `{_md(cv.name)}` | {_md(t.task)} | {c.n} | {c.baseline_score:.3f} | {c.candidate_score:.3f} | "
                f"{t.test.delta:+.3f} [{t.test.lower:+.3f}, {t.test.upper:+.3f}] | {fmt_p(c.pvalue)} ({fmt_p(c.p_holm)}) | "
                f"{c.n_regressed} ({_pct(c.negative_flip_rate)}) | {c.n_improved} | {_floor(t)} | {t.margin:g} | "
                f"{'-' if t.min_detectable_loss is None else f'{t.min_detectable_loss:.3f}'} | "
                f"{_md('; '.join(t.reasons + t.notes)) or '-'} |"
            )
    out += ["", "## Verdicts", ""] + [f"- {_md(line)}" for line in result.lines()]
    warnings = [w for cv in result.candidates for w in cv.warnings]
    if warnings:
        out += ["", "## Warnings", ""] + [f"- {_md(w)}" for w in warnings]
    if result.deployment is not None:
        out += ["", "## Deployment", "", f"- {_md(result.deployment.line)}"]
    reg = [(cv, t) for cv in result.candidates for t in cv.tasks if t.comparison.regressed]
    if reg:
        out += ["", "## Regressed items", "", "Right at baseline, wrong under the candidate: the baseline's answer, then the "
                f"candidate's (the first {SHOWN_REGRESSED} per task; every one, with its prompt, in the report's item "
                "view: kveval report).", ""]
        for cv, t in reg:
            out.append(f"- `{_md(cv.name)}` {_md(t.task)}: {len(t.comparison.regressed)} item(s)")
            for r in t.comparison.regressed[:SHOWN_REGRESSED]:
                out.append(f"  - `{r['id']}` ({_md(r.get('recalled') or r['category'] or 'wrong')}): "
                           f"{_quote(r.get('baseline_answer'))} \u2192 {_quote(r.get('answer'))}")
            if len(t.comparison.regressed) > SHOWN_REGRESSED:
                out.append(f"  - and {len(t.comparison.regressed) - SHOWN_REGRESSED} more")
    return "\n".join(out) + "\n"



def to_junit(result: GateResult | Sequence[GateResult]) -> str:
    """JUnit XML: one testsuite per candidate, one testcase per candidate x task."""
    results = [result] if isinstance(result, GateResult) else list(result)
    candidates = [c for r in results for c in r.candidates]
    n_fail = sum(1 for c in candidates for t in c.tasks if t.status == FAIL)
    n_skip = sum(1 for c in candidates for t in c.tasks if t.status == INCONCLUSIVE)
    n_err = sum(1 for c in candidates if c.status == ERROR)
    n_tests = sum(len(c.tasks) or 1 for c in candidates)
    root = ET.Element(
        "testsuites", name="kveval gate", tests=str(n_tests), failures=str(n_fail), errors=str(n_err), skipped=str(n_skip)
    )
    for cv in candidates:
        suite = ET.SubElement(
            root,
            "testsuite",
            name=cv.name,
            tests=str(len(cv.tasks) or 1),
            failures=str(sum(1 for t in cv.tasks if t.status == FAIL)),
            errors=str(1 if cv.status == ERROR else 0),
            skipped=str(sum(1 for t in cv.tasks if t.status == INCONCLUSIVE)),
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
            elif t.status == INCONCLUSIVE:
                skip = ET.SubElement(case, "skipped", message=f"INCONCLUSIVE {t.summary}: {'; '.join(t.reasons)}")
                skip.text = "\n".join(t.reasons)
            else:
                ET.SubElement(case, "system-out").text = t.summary
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_gate_outputs(result: GateResult | Sequence[GateResult], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``gate.md``, ``gate.xml`` (JUnit) and ``gate.json``; return their paths.

    Several results (one per model of a sweep) go into the same three files;
    their ``gate.json`` is ``{"status", "exit_code", "results": [...]}``.
    Written atomically: a full or read-only disk leaves the old files (or
    none) and no temporary file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "gate.md", "junit": out / "gate.xml", "json": out / "gate.json"}
    if isinstance(result, GateResult):
        md, data = to_markdown(result), result.to_dict()
    else:
        results = list(result)
        md = "\n".join(to_markdown(r).replace("# kveval gate:", f"# kveval gate ({r.baseline.model}):", 1) for r in results)
        data = {"status": overall_status(results), "exit_code": exit_code(results), "results": [r.to_dict() for r in results]}
    atomic_write_texts({paths["markdown"]: md, paths["junit"]: to_junit(result),
                        paths["json"]: json.dumps(sealed(data), indent=2)})
    return paths
