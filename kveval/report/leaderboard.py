"""The leaderboard: markdown, CSV, one self-contained HTML page and PNG plots (rows:
:mod:`kveval.report.rows`; plots: :mod:`kveval.report.plots`).

``kveval report RUN_DIRS... --out DIR`` takes run folders, or sweep folders
holding ``runs/*/``, groups the runs by model, compares every compressed run
with its model's baseline item by item (:mod:`kveval.stats.comparison`) and writes::

    DIR/leaderboard.md     # one row per model x policy (x ratio); best values in bold
    DIR/leaderboard.csv    # the same numbers, unformatted, plus p-values
    DIR/leaderboard.json
    DIR/leaderboard.html   # one self-contained page (kveval.report.html): verdicts in words, a sortable and
                           # filterable table, plots, and every changed item before and after compression
    DIR/score_vs_compression.png
    DIR/heatmap_<model>.png     # change vs baseline over context length x depth, per policy
    DIR/confusion_<model>.png   # stacked memory-confusion categories per policy

"Best" is judged within each model: highest score per task and over all items,
largest change, highest compression, lowest negative flip and confusion rates.
p-values in the CSV are Holm/BH-adjusted across every candidate x task of the
report (the whole sweep).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from kveval.report.html import to_html
from kveval.report.ranking import rank_rows, ranking_markdown
from kveval.report.items import RunChanges, run_changes
from kveval.report.plots import (
    by_model,
    plot_achieved_ratios,
    plot_confusion,
    plot_heatmaps,
    plot_kl_vs_compression,
    plot_score_vs_compression,
    slug,
)
from kveval.report.rows import (
    DECODE_HEADER,
    MODES_HEADER,
    SHARED_PREFIX_HEADER,
    Row,
    collect_rows,
    decode_cells,
    fmt,
    load_gate_result,
    modes_table,
    part_bytes,
    part_bytes_text,
    peak_decode_bytes,
    shared_prefix_table,
    shows_decode,
)
from kveval.runs.records import atomic_write_texts
from kveval.runs.results import sample_documents
from kveval.stats.comparison import _clean

# ----------------------------------------------------------------------------- tables


def _table(rows: list[Row], tasks: list[str]) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """Header and rows of (text, is_best) cells shared by markdown and HTML."""
    header = ["model", "policy", "ratio", "bytes/token", "compression", *tasks, "all items", "change [CI]", "-flips", "confusion", "verdict"]
    with_kl = any(r.fidelity for r in rows)  # runs made with --fidelity: mean KL from the baseline, nats
    if with_kl:
        header.insert(-1, "KL")
    with_parts = any(part_bytes(r) for r in rows)  # DeepSeek V3.2/V4: their caches' parts, measured apart
    if with_parts:
        header.insert(4, "bytes/token by part")
    with_decode = shows_decode(rows)  # peak bytes while decoding, and the answers' length against the baseline
    if with_decode:
        header[header.index("compression") + 1:header.index("compression") + 1] = DECODE_HEADER
    out = []
    for r in rows:
        cells: list[tuple[str, bool]] = [
            (r.info.model, False),
            (r.label, False),
            (r.info.ratio_text, False),
            (fmt(r.info.bytes_per_token, "{:,.0f}"), False),
            (fmt(r.info.compression, "{:.2f}x"), "compression" in r.best),
        ]
        if with_parts:
            cells.insert(4, (part_bytes_text(r), False))
        if with_decode:
            cells += [(text, False) for text, _ in decode_cells(r)]
        for t in tasks:
            s = r.task_scores.get(t)
            text = fmt(s)
            if r.comparison is not None and s is not None:
                try:
                    c = r.comparison.task(t)
                    text += f" ({c.delta:+.2f})"
                except KeyError:
                    pass
            cells.append((text, f"score:{t}" in r.best))
        cells.append((fmt(r.score), "score" in r.best))
        if r.comparison is not None:
            o = r.comparison.overall
            cells.append((f"{o.delta:+.3f} [{o.ci_low:+.3f}, {o.ci_high:+.3f}]", "delta" in r.best))
            cells.append((f"{o.negative_flip_rate * 100:.1f}%", "flips" in r.best))
        else:
            cells.append(("baseline" if r.info.is_baseline else "no baseline", False))
            cells.append(("-", False))
        cells.append((fmt(r.confusion_rate, "{:.1%}") if r.confusion_rate is not None else "-", "confusion" in r.best))
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
        "95% Tango score interval (each item's score change as a discordance; mostly graded tasks: paired bootstrap). *-flips*: share of items right at baseline and wrong under the policy. "
        "*confusion*: share of items answered with a wrong value (distractor, stale, partial, over-inclusion, fabricated). "
        "Best per model in **bold**."
        + (" *bytes/token by part*: DeepSeek V3.2/V4's own cache parts (latent, window, csa, hca, indexer), measured "
           "apart, and the compressors' constant-size state per sequence." if "bytes/token by part" in header else "")
        + (" *peak decode MiB*: the most K/V bytes an item's cache held between decode steps, mean over items. "
           "*output length*: the answers' tokens against the baseline's, mean ratio per item (mean change in "
           "tokens): longer answers spend what compression saves." if DECODE_HEADER[0] in header else "")
        + (" *KL*: mean per-token KL divergence (nats) of the policy's next-token distributions from the baseline's, "
           "along the baseline's own answer (teacher-forced; `kveval eval --fidelity`)." if "KL" in header else ""),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|",
    ]
    for cells in body:
        lines.append("| " + " | ".join(f"**{esc(t)}**" if b else esc(t) for t, b in cells) + " |")
    modes = modes_table(rows)
    if modes:
        lines += ["", "## Query-agnostic and query-aware", "",
                  "The same policies compressing the context before the question is seen (agnostic, what a cache "
                  "reused across questions gets) and with the question in view (aware).", "",
                  "| " + " | ".join(MODES_HEADER) + " |", "|---|---|" + "---:|" * (len(MODES_HEADER) - 2)]
        lines += ["| " + " | ".join(esc(c) for c in line) + " |" for line in modes]
    shared = shared_prefix_table(rows)
    if shared:
        lines += ["", "## Shared prefixes", "",
                  "Requests that share one compressed prompt (`system_rules`: a system prompt; `multi_turn`: a "
                  "context), its bytes counted once: *bytes per prompt* is the prefix plus every request's own "
                  "bytes, *bytes/request shared* the prompts' bytes over their requests, *unshared* each request "
                  "holding a copy of the prefix (the per-item figure of the table above). Where each request "
                  "changes its copy of the prefix (a decode budget evicts from it, a residual window codes its "
                  "newest tokens), the prefix cannot be held once: *prefix held once* says why, and the bytes per "
                  "prompt are its requests' own caches.", "",
                  "| " + " | ".join(SHARED_PREFIX_HEADER) + " |", "|---|---|" + "---:|" * (len(SHARED_PREFIX_HEADER) - 2)]
        lines += ["| " + " | ".join(esc(c) for c in line) + " |" for line in shared]
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
            **{f"achieved_ratio_{k}": i.achieved_ratio.get(k) for k in ("mean", "min", "max")},
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
                "peak_decode_bytes_mean": peak_decode_bytes(r),
                "output_length_ratio": o.output_length_ratio if o else None,
                "output_length_delta": o.output_length_delta if o else None,
            }
        )
        parts = part_bytes(r)
        for name, value in parts.items():
            rec[f"bytes_per_token[{name}]"] = value
        if parts:
            rec["state_bytes"] = i.extra.get("state_bytes_mean")
        for name, value in (i.extra.get("shared_prefix") or {}).items():  # each shared prompt's bytes counted once
            rec[f"shared_prefix_{name}"] = value
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


def _csv_text(recs: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    fields = list(dict.fromkeys(k for rec in recs for k in rec))
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for rec in recs:
        w.writerow({k: ("" if v is None else v) for k, v in rec.items()})
    return buf.getvalue()


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


def item_changes(rows: Sequence[Row], probes: Mapping[str, Any] | None = None) -> dict[str, RunChanges]:
    """Each compared run's changed items (:func:`kveval.report.items.run_changes`) by run name, lm-eval runs with
    their documents (read once per baseline)."""
    documents: dict[Any, Any] = {}
    out = {}
    for r in rows:
        if r.comparison is None or r.baseline is None:
            continue
        key = id(r.baseline)
        if key not in documents:
            documents[key] = sample_documents(r.baseline)
        out[r.info.name] = run_changes(r.baseline, r.run, probes, documents[key])
    return out


def build_report(
    run_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    gate_result: Any = None,
    *,
    n_resamples: int = 9999,
    seed: int = 0,
    probes: Mapping[str, Any] | None = None,
    rank: bool = False,
) -> dict[str, Any]:
    """Write the leaderboard (markdown, CSV, JSON, HTML) and plots.

    Parameters
    ----------
    run_dirs : sequence of paths
        Run folders, or sweep folders holding ``runs/*/``.
    out_dir : path
        Output folder (created).
    gate_result : GateResult, list of GateResult, dict, path or None
        Gate verdicts for the *verdict* column: :class:`kveval.gate.verdicts.GateResult`
        (one, or one per model from :func:`kveval.gate.rules.evaluate_sweep`), or the
        ``gate.json`` written by ``kveval gate --out`` / ``write_gate_outputs``
        (or its folder).
    n_resamples, seed : int
        Bootstrap settings of the log-prob change intervals.
    probes : mapping, optional
        Probe items (:class:`~kveval.probes.item.ProbeItem`) by prompt hash, for the item views' questions,
        needles and contexts (:func:`kveval.sweep.recorded.recorded_probe_items`); without them the views show
        what ``items.jsonl`` records.
    rank : bool
        Also rank each model's candidates against each other (:mod:`kveval.report.ranking`) into ``ranking.md``
        and ``ranking.json``.

    Returns
    -------
    dict
        ``{"markdown", "csv", "json", "html"}`` -> Path (and ``"ranking"``, ``"ranking_json"`` under ``rank``),
        and ``"plots"`` -> list of Path.
    """
    gate = load_gate_result(gate_result)
    rows, tasks = collect_rows(run_dirs, gate_result=gate, n_resamples=n_resamples, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gate_lines = _gate_lines(gate)
    # Plots are drawn into a folder of their own first, then written with the text formats in one go: a report
    # that fails part way (a full disk, a bad row) leaves every file of the previous report as it was.
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    try:
        staged: list[Path] = []
        for fn, name in ((plot_score_vs_compression, "score_vs_compression.png"),
                         (plot_kl_vs_compression, "kl_vs_compression.png")):
            p = fn(rows, staging / name)
            if p:
                staged.append(p)
        for model, group in by_model(rows).items():
            for fn, stem in ((plot_heatmaps, "heatmap"), (plot_confusion, "confusion"),
                             (plot_achieved_ratios, "achieved_ratio")):
                p = fn(model, group, staging / f"{stem}_{slug(model)}.png")
                if p:
                    staged.append(p)
        paths: dict[str, Any] = {
            "markdown": out / "leaderboard.md",
            "csv": out / "leaderboard.csv",
            "json": out / "leaderboard.json",
            "html": out / "leaderboard.html",
        }
        recs = csv_records(rows, tasks)
        ranked: dict[Path, str] = {}
        if rank:
            rankings = rank_rows(rows, n_resamples=n_resamples, seed=seed)
            paths["ranking"], paths["ranking_json"] = out / "ranking.md", out / "ranking.json"
            ranked = {paths["ranking"]: ranking_markdown(rankings),
                      paths["ranking_json"]: json.dumps([m.to_dict() for m in rankings], indent=2)}
        atomic_write_texts({
            **ranked,
            paths["markdown"]: to_markdown(rows, tasks, gate_lines),
            paths["csv"]: _csv_text(recs),
            paths["json"]: json.dumps({"tasks": tasks, "rows": recs}, indent=2),
            paths["html"]: to_html(rows, tasks, staged, [f"deployment: {d['line']}" for d in _deployments(gate)],
                                   item_changes(rows, probes)),
            **{out / p.name: p.read_bytes() for p in staged},
        })
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    paths["plots"] = [out / p.name for p in staged]
    return paths


