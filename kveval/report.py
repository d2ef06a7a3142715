"""Leaderboard reports: markdown, CSV, one self-contained HTML page and PNG plots.

``kveval report RUN_DIRS... --out DIR`` takes run folders, or sweep folders
holding ``runs/*/``, groups the runs by model, compares every compressed run
with its model's baseline item by item (:mod:`kveval.compare`) and writes::

    DIR/leaderboard.md     # one row per model x policy (x ratio); best values in bold
    DIR/leaderboard.csv    # the same numbers, unformatted, plus p-values
    DIR/leaderboard.json
    DIR/leaderboard.html        # table + plots, inline CSS, PNGs embedded as base64
    DIR/score_vs_compression.png
    DIR/heatmap_<model>.png     # change vs baseline over context length x depth, per policy
    DIR/confusion_<model>.png   # stacked memory-confusion categories per policy

"Best" is judged within each model: highest score per task and over all items,
largest change, highest compression, lowest negative flip and confusion rates.
p-values in the CSV are Holm/BH-adjusted across every candidate x task of the
report (the whole sweep).
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kveval.compare import (
    CATEGORIES,
    expand_run_dirs,
    OVERALL,
    Run,
    RunComparison,
    _clean,
    adjust_sweep,
    compare_runs,
    confusion_rates,
    load_run,
)
from kveval.records import ResultFileError, atomic_write_text

STAR = "\u2605"


# ----------------------------------------------------------------------------- collecting runs


@dataclass
class Row:
    """One leaderboard row: a run, and its comparison with the baseline (None for the baseline itself)."""

    run: Run
    comparison: RunComparison | None
    task_scores: dict[str, float]
    score: float
    confusion_rate: float | None
    verdict: str | None = None
    best: set[str] = field(default_factory=set)

    @property
    def info(self):
        return self.run.info

    @property
    def fidelity(self) -> dict[str, float] | None:
        """All items' teacher-forced fidelity summary (:func:`kveval.fidelity.summarize`), if the run measured it."""
        return self.comparison.overall.fidelity if self.comparison is not None else None

    @property
    def label(self) -> str:
        i = self.info
        if i.is_baseline:
            return "baseline"
        return i.policy if i.mode == "context" else f"{i.policy} [{i.mode}]"


def load_gate_result(gate_result: Any) -> dict[str, Any] | None:
    """Gate verdicts as the ``gate.json`` dict, from a GateResult, a dict, or a gate.json path (or its folder)."""
    if gate_result is None:
        return None
    if isinstance(gate_result, dict):
        return _flatten_gate(gate_result)
    if hasattr(gate_result, "to_dict"):
        return gate_result.to_dict()
    if isinstance(gate_result, (list, tuple)):
        return {"candidates": [c for r in gate_result for c in load_gate_result(r)["candidates"]]}
    p = Path(gate_result)
    if p.is_dir():
        p = p / "gate.json"
    if not p.is_file():
        raise ResultFileError(f"{p}: no gate result (gate.json written by kveval gate --out)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultFileError(f"{p}: corrupt gate result ({exc})") from exc
    if not isinstance(data, dict) or not (isinstance(data.get("candidates"), list) or isinstance(data.get("results"), list)):
        raise ResultFileError(f"{p}: not a gate result (no candidates)")
    return _flatten_gate(data)


def _flatten_gate(data: dict[str, Any]) -> dict[str, Any]:
    """A multi-model ``gate.json`` (``results``: one per baseline) as one list of candidates."""
    if "results" in data and "candidates" not in data:
        return dict(data, candidates=[c for r in data["results"] for c in r.get("candidates", [])])
    return data


def _verdicts(gate: dict[str, Any] | None) -> dict[str, str]:
    """Map candidate path (resolved) and name to its verdict."""
    out: dict[str, str] = {}
    for c in (gate or {}).get("candidates", []):
        out[f"name:{c.get('name')}"] = c["status"]
        try:
            out[f"path:{Path(c['path']).resolve()}"] = c["status"]
        except OSError:
            pass
    return out


def collect_rows(
    run_dirs: Sequence[str | os.PathLike],
    *,
    gate_result: Any = None,
    n_resamples: int = 9999,
    seed: int = 0,
    confidence_level: float = 0.95,
) -> tuple[list[Row], list[str]]:
    """Load the runs, pair each candidate with its model's baseline and build the leaderboard rows.

    Returns
    -------
    rows : list of Row
        Sorted by model, baseline first, then policy family and ratio.
    tasks : list of str
        Task columns, in first-seen order.

    Raises
    ------
    ResultFileError
        Unreadable or unpaired results.
    ValueError
        Two baselines for one model.
    """
    runs = [load_run(p) for p in expand_run_dirs(run_dirs)]
    baselines: dict[str, Run] = {}
    for r in runs:
        if r.info.is_baseline:
            if r.info.model in baselines:
                raise ValueError(
                    f"two baselines for model {r.info.model!r}: {baselines[r.info.model].path} and {r.path}; report one"
                )
            baselines[r.info.model] = r
    verdicts = _verdicts(load_gate_result(gate_result))
    rows: list[Row] = []
    tasks: list[str] = []
    for r in runs:
        for it in r.items:
            if it.task not in tasks:
                tasks.append(it.task)
        comp = None
        if not r.info.is_baseline and r.info.model in baselines:
            comp = compare_runs(
                baselines[r.info.model], r, n_resamples=n_resamples, seed=seed, confidence_level=confidence_level, cells=False
            )
        by_task: dict[str, list[float]] = {}
        for it in r.items:
            by_task.setdefault(it.task, []).append(it.score)
        conf = confusion_rates(r.items)
        verdict = None
        if not r.info.is_baseline:
            verdict = verdicts.get(f"path:{r.path.resolve()}") or verdicts.get(f"name:{r.info.name}")
        rows.append(
            Row(
                run=r,
                comparison=comp,
                task_scores={t: float(np.mean(v)) for t, v in by_task.items()},
                score=float(np.mean([it.score for it in r.items])),
                confusion_rate=conf.get(OVERALL) if conf else None,
                verdict=verdict,
            )
        )
    adjust_sweep([row.comparison for row in rows if row.comparison is not None])
    rows.sort(
        key=lambda row: (
            row.info.model,
            not row.info.is_baseline,
            row.info.family,
            row.info.ratio if row.info.ratio is not None else -1.0,
            row.info.policy,
            row.info.mode,
        )
    )
    _mark_best(rows, tasks)
    return rows, tasks


def _mark_best(rows: list[Row], tasks: list[str]) -> None:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.info.model, []).append(r)

    def mark(group: list[Row], key: str, value, higher: bool) -> None:
        vals = [(r, value(r)) for r in group]
        vals = [(r, v) for r, v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
        if len(vals) < 2:
            return
        best = max(v for _, v in vals) if higher else min(v for _, v in vals)
        for r, v in vals:
            if abs(v - best) <= 1e-12:
                r.best.add(key)

    for group in groups.values():
        for t in tasks:
            mark(group, f"score:{t}", lambda r, t=t: r.task_scores.get(t), True)
        mark(group, "score", lambda r: r.score, True)
        mark(group, "delta", lambda r: r.comparison.overall.delta if r.comparison else None, True)
        mark(group, "compression", lambda r: r.info.compression, True)
        mark(group, "flips", lambda r: r.comparison.overall.negative_flip_rate if r.comparison else None, False)
        mark(group, "confusion", lambda r: r.confusion_rate, False)
        mark(group, "kl", lambda r: r.fidelity["kl_mean"] if r.fidelity else None, False)


# ----------------------------------------------------------------------------- tables


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _table(rows: list[Row], tasks: list[str]) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """Header and rows of (text, is_best) cells shared by markdown and HTML."""
    header = ["model", "policy", "ratio", "bytes/token", "compression", *tasks, "all items", "change [CI]", "-flips", "confusion", "verdict"]
    with_kl = any(r.fidelity for r in rows)  # runs made with --fidelity: mean KL from the baseline, nats
    if with_kl:
        header.insert(-1, "KL")
    out = []
    for r in rows:
        cells: list[tuple[str, bool]] = [
            (r.info.model, False),
            (r.label, False),
            (_f(r.info.ratio, "{:g}"), False),
            (_f(r.info.bytes_per_token, "{:,.0f}"), False),
            (_f(r.info.compression, "{:.2f}x"), "compression" in r.best),
        ]
        for t in tasks:
            s = r.task_scores.get(t)
            text = _f(s)
            if r.comparison is not None and s is not None:
                try:
                    c = r.comparison.task(t)
                    text += f" ({c.delta:+.2f})"
                except KeyError:
                    pass
            cells.append((text, f"score:{t}" in r.best))
        cells.append((_f(r.score), "score" in r.best))
        if r.comparison is not None:
            o = r.comparison.overall
            cells.append((f"{o.delta:+.3f} [{o.ci_low:+.3f}, {o.ci_high:+.3f}]", "delta" in r.best))
            cells.append((f"{o.negative_flip_rate * 100:.1f}%", "flips" in r.best))
        else:
            cells.append(("baseline" if r.info.is_baseline else "no baseline", False))
            cells.append(("-", False))
        cells.append((_f(r.confusion_rate, "{:.1%}") if r.confusion_rate is not None else "-", "confusion" in r.best))
        if with_kl:
            cells.append((f"{r.fidelity['kl_mean']:.3g}" if r.fidelity else ("0" if r.info.is_baseline else "-"), "kl" in r.best))
        cells.append(("baseline" if r.info.is_baseline else (r.verdict or "-"), False))
        out.append(cells)
    return header, out


def to_markdown(rows: list[Row], tasks: list[str], gate_lines: Sequence[str] = ()) -> str:
    header, body = _table(rows, tasks)

    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    lines = [
        "# kveval leaderboard",
        "",
        "Per-task cells: mean score (change vs the model's baseline). *change [CI]*: all items pooled, "
        "95% paired bootstrap interval. *-flips*: share of items right at baseline and wrong under the policy. "
        "*confusion*: share of items answered with a wrong value (distractor, stale, partial, over-inclusion, fabricated). "
        "Best per model in **bold**."
        + (" *KL*: mean per-token KL divergence (nats) of the policy's next-token distributions from the baseline's, "
           "along the baseline's own answer (teacher-forced; `kveval eval --fidelity`)." if "KL" in header else ""),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|",
    ]
    for cells in body:
        lines.append("| " + " | ".join(f"**{esc(t)}**" if b else esc(t) for t, b in cells) + " |")
    if gate_lines:
        lines += ["", "## Gate", ""] + [f"- {esc(g)}" for g in gate_lines]
    return "\n".join(lines) + "\n"


def csv_records(rows: list[Row], tasks: list[str]) -> list[dict[str, Any]]:
    recs = []
    for r in rows:
        i = r.info
        rec: dict[str, Any] = {
            "model": i.model,
            "policy": i.policy,
            "family": i.family,
            "mode": i.mode,
            "ratio": i.ratio,
            "bytes_per_token": i.bytes_per_token,
            "nominal_bytes_per_token": i.nominal_bytes_per_token,
            "compression": i.compression,
            "is_baseline": i.is_baseline,
            "n_items": len(r.run.items),
            "score": r.score,
        }
        o = r.comparison.overall if r.comparison else None
        rec.update(
            {
                "delta": o.delta if o else None,
                "delta_ci_low": o.ci_low if o else None,
                "delta_ci_high": o.ci_high if o else None,
                "negative_flip_rate": o.negative_flip_rate if o else None,
                "positive_flip_rate": o.positive_flip_rate if o else None,
                "agreement": o.agreement if o else None,
                "confusion_rate": r.confusion_rate,
            }
        )
        if r.fidelity:
            rec.update({f"fidelity_{k}": r.fidelity[k] for k in ("kl_mean", "kl_mean_upper", "kl_max_item", "top1_agreement",
                                                                  "answer_logprob_delta")})
        for t in tasks:
            rec[f"score[{t}]"] = r.task_scores.get(t)
            c = None
            if r.comparison is not None:
                try:
                    c = r.comparison.task(t)
                except KeyError:
                    c = None
            rec[f"delta[{t}]"] = c.delta if c else None
            rec[f"delta_ci_low[{t}]"] = c.ci_low if c else None
            rec[f"delta_ci_high[{t}]"] = c.ci_high if c else None
            rec[f"p[{t}]"] = c.pvalue if c else None
            rec[f"p_holm_sweep[{t}]"] = c.p_holm if c else None
            rec[f"p_bh_sweep[{t}]"] = c.p_bh if c else None
            rec[f"negative_flip_rate[{t}]"] = c.negative_flip_rate if c else None
        rec["verdict"] = "baseline" if i.is_baseline else r.verdict
        rec["run"] = i.name
        rec["path"] = str(r.run.path)
        recs.append(_clean(rec))
    return recs


def _write_csv(path: Path, recs: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    fields = list(dict.fromkeys(k for rec in recs for k in rec))
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for rec in recs:
        w.writerow({k: ("" if v is None else v) for k, v in rec.items()})
    atomic_write_text(path, buf.getvalue())


# ----------------------------------------------------------------------------- plots


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)  # Agg canvas, no pyplot and no global backend switch
    return fig


def _save(fig, path: Path) -> Path:
    fig.savefig(path, format="png", bbox_inches="tight", metadata={"Software": None})
    return path


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "model"


def _by_model(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.info.model, []).append(r)
    return out


def plot_score_vs_compression(rows: list[Row], path: Path) -> Path | None:
    """Score (all items) vs compression factor: a line per policy family, the baseline dashed."""
    models = _by_model(rows)
    n = len(models)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig = _figure(5.2 * cols, 3.8 * nrows)
    for k, (model, group) in enumerate(models.items()):
        ax = fig.add_subplot(nrows, cols, k + 1)
        families: dict[str, list[tuple[float, float, bool]]] = {}
        for r in group:
            if r.info.is_baseline:
                ax.axhline(r.score, linestyle="--", color="0.3", label=f"baseline ({r.score:.2f})")
                ax.plot([r.info.compression or 1.0], [r.score], marker="*", markersize=10, color="0.3", linestyle="none")
                continue
            x, measured = r.info.compression, True
            if x is None and r.info.ratio is not None and r.info.ratio < 1:
                x, measured = 1.0 / (1.0 - r.info.ratio), False
            if x is None:
                continue
            fam = r.info.family + ("" if r.info.mode == "context" else f" [{r.info.mode}]")
            families.setdefault(fam, []).append((x, r.score, measured))
        for fam, pts in sorted(families.items()):
            pts.sort()
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)[0]
            hollow = [p for p in pts if not p[2]]
            if hollow:
                ax.plot([p[0] for p in hollow], [p[1] for p in hollow], "o", mfc="white", mec=line.get_color())
        ax.set_xlabel("compression factor (uncompressed / measured cache bytes; hollow: nominal)")
        ax.set_ylabel("score (all items)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return _save(fig, path)


def plot_kl_vs_compression(rows: list[Row], path: Path) -> Path | None:
    """Mean KL from the baseline (teacher-forced baseline answers, log scale) vs compression factor, per policy family."""
    measured = [r for r in rows if r.fidelity and r.info.compression]
    if not measured:
        return None
    models = _by_model(measured)
    cols = min(len(models), 3)
    fig = _figure(5.2 * cols, 3.8 * math.ceil(len(models) / cols))
    for k, (model, group) in enumerate(models.items()):
        ax = fig.add_subplot(math.ceil(len(models) / cols), cols, k + 1)
        families: dict[str, list[tuple[float, float]]] = {}
        for r in group:
            fam = r.info.family + ("" if r.info.mode == "context" else f" [{r.info.mode}]")
            families.setdefault(fam, []).append((r.info.compression, max(r.fidelity["kl_mean"], 1e-8)))
        for fam, pts in sorted(families.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        ax.set_yscale("log")
        ax.set_xlabel("compression factor (uncompressed / measured cache bytes)")
        ax.set_ylabel("mean KL from baseline (nats/token)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)


def plot_heatmaps(model: str, group: list[Row], path: Path) -> Path | None:
    """Per policy of one model: mean score change vs baseline over context length x needle depth."""
    panels = []
    for r in group:
        if r.comparison is None:
            continue
        lengths, depths, delta, counts = r.comparison.grid()
        if delta.size:
            panels.append((r, lengths, depths, delta, counts))
    if not panels:
        return None
    cols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / cols)
    fig = _figure(4.6 * cols, 3.6 * nrows)
    image = None
    for k, (r, lengths, depths, delta, counts) in enumerate(panels):
        ax = fig.add_subplot(nrows, cols, k + 1)
        image = ax.imshow(np.ma.masked_invalid(delta), cmap="RdBu", vmin=-1, vmax=1, aspect="auto", origin="lower")
        ax.set_xticks(range(len(depths)), [("-" if d is None else f"{d:g}") for d in depths])
        ax.set_yticks(range(len(lengths)), [("-" if L is None else str(L)) for L in lengths])
        ax.set_xlabel("needle depth")
        if k % cols == 0:
            ax.set_ylabel("context length (tokens)")
        ax.set_title(r.label, fontsize=9)
        for i in range(delta.shape[0]):
            for j in range(delta.shape[1]):
                if counts[i, j]:
                    v = delta[i, j]
                    ax.text(j, i, f"{v:+.2f}", ha="center", va="center", fontsize=7, color="white" if abs(v) > 0.6 else "black")
    fig.subplots_adjust(wspace=0.3, hspace=0.45)
    if image is not None:
        fig.colorbar(image, ax=fig.axes, shrink=0.8, label="score change vs baseline")
    fig.suptitle(f"{model}: change vs baseline")
    return _save(fig, path)


def plot_confusion(model: str, group: list[Row], path: Path) -> Path | None:
    """Stacked bars: share of items per wrong-answer category, per policy of one model."""
    data = [(r, confusion_rates(r.run.items)) for r in group]
    data = [(r, c) for r, c in data if c]
    if not data:
        return None
    cats = [c for c in CATEGORIES if c != "correct"]
    extra = sorted({k for _, c in data for k in c if k not in CATEGORIES and k != OVERALL})
    cats += extra
    fig = _figure(max(5.0, 0.9 * len(data) + 2.5), 4.0)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(data))
    bottom = np.zeros(len(data))
    colors = {"distractor": "#d62728", "stale": "#ff7f0e", "partial": "#bcbd22", "over_inclusion": "#9467bd",
              "fabricated": "#8c564b", "empty": "#7f7f7f"}
    for cat in cats:
        vals = np.array([c.get(cat, 0.0) for _, c in data])
        if not vals.any():
            continue
        ax.bar(x, vals, bottom=bottom, label=cat, color=colors.get(cat))
        bottom += vals
    ax.set_xticks(x, [r.label for r, _ in data], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("share of items")
    ax.set_ylim(0, max(0.05, float(bottom.max()) * 1.15))
    ax.set_title(f"{model}: wrong answers by category")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)


# ----------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;color:#222;max-width:1400px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:0.85em}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right;white-space:nowrap}
th{background:#f0f0f0}td.l{text-align:left}
td.best{font-weight:bold;background:#eef7ee}
td.PASS{color:#1a7f37;font-weight:bold}td.FAIL{color:#c62828;font-weight:bold}td.ERROR{color:#c62828}
p.note{font-size:0.85em;color:#555;max-width:1000px}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}
ul.gate li{font-family:monospace;font-size:0.85em}
"""


def to_html(rows: list[Row], tasks: list[str], plots: Sequence[Path], gate_lines: Sequence[str] = ()) -> str:
    header, body = _table(rows, tasks)
    e = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>kveval leaderboard</title>',
        f"<style>{_CSS}</style></head><body>",
        "<h1>kveval leaderboard</h1>",
        '<p class="note">Per-task cells: mean score (change vs the model\'s baseline). <i>change [CI]</i>: all items pooled, '
        "95% paired bootstrap interval. <i>-flips</i>: share of items right at baseline and wrong under the policy. "
        "<i>confusion</i>: share of items answered with a wrong value. "
        f"{STAR} marks the best value per model.</p>",
        '<table id="leaderboard"><thead><tr>' + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr></thead><tbody>",
    ]
    for cells in body:
        tds = []
        for idx, (text, best) in enumerate(cells):
            cls = []
            if idx < 2:
                cls.append("l")
            if best:
                cls.append("best")
            if idx == len(cells) - 1 and text in ("PASS", "FAIL", "ERROR"):
                cls.append(text)
            attr = f' class="{" ".join(cls)}"' if cls else ""
            tds.append(f"<td{attr}>{e(text)}{' ' + STAR if best else ''}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</tbody></table>")
    if gate_lines:
        out.append("<h2>Gate</h2><ul class=\"gate\">" + "".join(f"<li>{e(g)}</li>" for g in gate_lines) + "</ul>")
    if plots:
        out.append("<h2>Plots</h2>")
        for p in plots:
            data = base64.b64encode(Path(p).read_bytes()).decode("ascii")
            out.append(f'<figure><img alt="{e(p.stem)}" src="data:image/png;base64,{data}"><figcaption>{e(p.stem)}</figcaption></figure>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- entry points


def _gate_lines(gate: dict[str, Any] | None) -> list[str]:
    """One line per candidate (``PASS``, ``FAIL``, ``INCONCLUSIVE`` with its reasons, ``ERROR``), then the deployment decision."""
    lines = []
    for c in (gate or {}).get("candidates", []):
        if c["status"] == "ERROR":
            lines.append(f"ERROR {c['name']}: {c.get('error')}")
        elif c["status"] == "PASS":
            lines.append(f"PASS {c['name']}: " + "; ".join(t["summary"] for t in c.get("tasks", [])))
        else:
            lines.append(f"{c['status']} {c['name']}: " + " | ".join(c.get("reasons", [])))
    lines += [f"deployment: {d['line']}" for d in _deployments(gate)]
    return lines


def _deployments(gate: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not gate:
        return []
    results = gate.get("results") or [gate]
    return [r["deployment"] for r in results if isinstance(r, dict) and r.get("deployment")]


def build_report(
    run_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    gate_result: Any = None,
    *,
    n_resamples: int = 9999,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the leaderboard (markdown, CSV, JSON, HTML) and plots.

    Parameters
    ----------
    run_dirs : sequence of paths
        Run folders, or sweep folders holding ``runs/*/``.
    out_dir : path
        Output folder (created).
    gate_result : GateResult, list of GateResult, dict, path or None
        Gate verdicts for the *verdict* column: :class:`kveval.gate.GateResult`
        (one, or one per model from :func:`kveval.gate.evaluate_sweep`), or the
        ``gate.json`` written by ``kveval gate --out`` / ``write_gate_outputs``
        (or its folder).
    n_resamples, seed : int
        Bootstrap settings of the change intervals.

    Returns
    -------
    dict
        ``{"markdown", "csv", "json", "html"}`` -> Path, and ``"plots"`` -> list of Path.
    """
    gate = load_gate_result(gate_result)
    rows, tasks = collect_rows(run_dirs, gate_result=gate, n_resamples=n_resamples, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gate_lines = _gate_lines(gate)
    plots: list[Path] = []
    for fn, name in ((plot_score_vs_compression, "score_vs_compression.png"), (plot_kl_vs_compression, "kl_vs_compression.png")):
        p = fn(rows, out / name)
        if p:
            plots.append(p)
    for model, group in _by_model(rows).items():
        for fn, stem in ((plot_heatmaps, "heatmap"), (plot_confusion, "confusion")):
            p = fn(model, group, out / f"{stem}_{_slug(model)}.png")
            if p:
                plots.append(p)
    paths: dict[str, Any] = {
        "markdown": out / "leaderboard.md",
        "csv": out / "leaderboard.csv",
        "json": out / "leaderboard.json",
        "html": out / "leaderboard.html",
    }
    recs = csv_records(rows, tasks)
    atomic_write_text(paths["markdown"], to_markdown(rows, tasks, gate_lines))
    _write_csv(paths["csv"], recs)
    atomic_write_text(paths["json"], json.dumps({"tasks": tasks, "rows": recs}, indent=2))
    atomic_write_text(paths["html"], to_html(rows, tasks, plots, gate_lines))
    paths["plots"] = plots
    return paths


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders, or sweep folders holding runs/*/")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument("--gate", metavar="PATH", help="gate.json (or its folder) from kveval gate --out, for the verdict column")
    parser.add_argument("--resamples", type=int, default=9999, help="bootstrap resamples (default 9999)")
    parser.add_argument("--seed", type=int, default=0, help="resampling seed (default 0)")


def run(args: argparse.Namespace) -> int:
    paths = build_report(args.runs, args.out, gate_result=args.gate, n_resamples=args.resamples, seed=args.seed)
    print(Path(paths["markdown"]).read_text(encoding="utf-8"))
    print(f"wrote {paths['markdown']}, {paths['csv']}, {paths['html']} and {len(paths['plots'])} plot(s) in {args.out}")
    return 0
