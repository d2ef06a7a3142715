"""The rows of a leaderboard (:mod:`kveval.report.leaderboard`): run folders grouped by model, every compressed run compared
with its model's baseline item by item (:mod:`kveval.stats.comparison`), the gate's verdicts attached, and the best value
of each column marked within each model."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kveval.errors import UsageError
from kveval.gate.verdicts import GateResult
from kveval.gate.verify import check_gate_file, read_gate_file
from kveval.runs.records import ResultFileError
from kveval.runs.results import Run, baseline_for, expand_run_dirs, load_run, run_digest
from kveval.stats.comparison import OVERALL, RunComparison, adjust_sweep, check_settings, compare_runs, confusion_rates


@dataclass
class Row:
    """One leaderboard row: a run, and its comparison with the baseline (None for the baseline itself)."""

    run: Run
    comparison: RunComparison | None
    task_scores: dict[str, float]
    score: float
    confusion_rate: float | None
    verdict: str | None = None
    task_confusion: dict[str, float | None] = field(default_factory=dict)  # the confusion rate of each task's items
    best: set[str] = field(default_factory=set)
    gate: dict[str, Any] | None = None  # the gate's candidate entry (gate.json), when it judged this run
    baseline: Run | None = None  # the model's baseline run the comparison is against

    @property
    def info(self):
        return self.run.info

    @property
    def fidelity(self) -> dict[str, float] | None:
        """All items' teacher-forced fidelity summary (:func:`kveval.stats.fidelity.summarize`), if the run measured it."""
        return self.comparison.overall.fidelity if self.comparison is not None else None

    @property
    def label(self) -> str:
        i = self.info
        if i.is_baseline:
            return "baseline"
        return i.policy if i.mode == "context" else f"{i.policy} [{i.mode}]"


def mode_pairs(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """``(query-agnostic, query-aware)`` rows of every model and policy a sweep ran in both modes, in row order: what
    the leaderboard puts side by side (as kvpress's leaderboard separates the two settings)."""
    by_key: dict[tuple[str, str], dict[str, Row]] = {}
    for r in rows:
        if not r.info.is_baseline:
            by_key.setdefault((r.info.model, r.info.policy), {})[r.info.mode] = r
    return [(modes["context"], modes["query"]) for modes in by_key.values() if {"context", "query"} <= modes.keys()]


MODES_HEADER = ["model", "policy", "bytes/token", "all items: query-agnostic", "change", "all items: query-aware",
                "change", "aware - agnostic"]


def _change(r: Row) -> str:
    return f"{r.comparison.overall.delta:+.3f}" if r.comparison is not None else "-"


def modes_table(rows: Sequence[Row]) -> list[list[str]]:
    """One line per model and policy run in both modes (:func:`mode_pairs`), under :data:`MODES_HEADER`: the mean
    score over all items and its change against the baseline in each mode, then the aware score minus the agnostic."""
    return [[agnostic.info.model, agnostic.info.policy, fmt(agnostic.info.bytes_per_token, "{:,.0f}"),
             fmt(agnostic.score), _change(agnostic), fmt(aware.score), _change(aware),
             f"{aware.score - agnostic.score:+.3f}"] for agnostic, aware in mode_pairs(rows)]


#: Columns of :func:`shared_prefix_table`.
SHARED_PREFIX_HEADER = ["model", "policy", "prompts", "requests", "prefix held once", "prefix bytes",
                        "bytes per prompt", "bytes/request shared", "bytes/request unshared"]


def shared_prefix_table(rows: Sequence[Row]) -> list[list[str]]:
    """One line per run whose items share prefixes (``run.json``'s ``shared_prefix``, from
    :func:`kveval.runner.evaluate.shared_prefix_bytes`), under :data:`SHARED_PREFIX_HEADER`: prompts (groups) and
    their requests, whether the prefix can be held once (not where each request changes its copy: a decode budget, a
    residual window), mean compressed prefix bytes, mean bytes per prompt (the prefix once plus every request, or
    every request's own cache where it cannot be held once), and bytes per request with the prefix shared
    (amortized) and with a copy per request."""
    lines = []
    for r in rows:
        shared = r.info.extra.get("shared_prefix")
        if shared:
            held = "yes" if shared.get("held_once", True) else f"no: {shared['not_held_once']}"
            lines.append([r.info.model, r.info.policy, str(shared["groups"]), str(shared["requests"]), held,
                          *(fmt(shared[k], "{:,.0f}") for k in ("prefix_kv_bytes_mean", "group_kv_bytes_mean",
                                                                 "kv_bytes_per_request",
                                                                 "unshared_kv_bytes_per_request"))])
    return lines


def fmt(x: float | None, spec: str = "{:.3f}") -> str:
    """A leaderboard cell's number as text (``"-"`` for none or NaN), for the markdown and the HTML alike."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)


def part_bytes(row: Row) -> dict[str, float]:
    """A run's bytes per token by part of the model's own cache (DeepSeek V3.2/V4: ``latent``, ``window``, ``csa``,
    ``hca``, ``indexer``), empty for other models."""
    return row.info.extra.get("parts_bytes_per_token") or {}


def part_bytes_text(row: Row) -> str:
    """:func:`part_bytes` as one cell, with the compressors' constant-size state per sequence; ``-`` where none."""
    parts = part_bytes(row)
    if not parts:
        return "-"
    state = row.info.extra.get("state_bytes_mean")
    return ", ".join(f"{name} {value:,.1f}" for name, value in parts.items()) + (f"; state {state:,.0f} B" if state else "")


def peak_decode_bytes(row: Row) -> float | None:
    """Mean over the run's items of the peak K/V bytes held while decoding (``metrics["peak_kv_bytes"]``: the
    most any step held, :attr:`~kveval.runner.generation.GenerationResult.peak_kv_bytes`); ``None`` for runs that
    did not record it."""
    peaks = [it.metrics.get("peak_kv_bytes") for it in row.run.items]
    peaks = [p for p in peaks if p is not None]
    return float(np.mean(peaks)) if peaks else None


def shows_decode(rows: Sequence[Row]) -> bool:
    """Whether the leaderboard shows the decode columns (:data:`DECODE_HEADER`): some run recorded its peak bytes."""
    return any(peak_decode_bytes(r) is not None for r in rows)


#: The decode columns: peak K/V bytes while decoding (mean per item), and the answers' length against the baseline.
DECODE_HEADER = ["peak decode MiB", "output length"]


def decode_cells(row: Row) -> list[tuple[str, float | None]]:
    """The :data:`DECODE_HEADER` cells of ``row`` as (text, sort value): the mean peak in MiB, and the mean ratio of
    the answer's tokens to the baseline's with the mean change in tokens (the baseline: its mean tokens)."""
    peak = peak_decode_bytes(row)
    peak_cell = (fmt(None if peak is None else peak / 2**20, "{:,.2f}"), peak)
    o = row.comparison.overall if row.comparison is not None else None
    if o is not None and o.output_length_ratio is not None:
        return [peak_cell, (f"x{o.output_length_ratio:.2f} ({o.output_length_delta:+.1f} tok)", o.output_length_ratio)]
    lengths = [it.metrics.get("new_tokens") for it in row.run.items]
    lengths = [n for n in lengths if n is not None]
    return [peak_cell, (f"{np.mean(lengths):.1f} tok" if lengths and row.info.is_baseline else "-", None)]


def load_gate_result(gate_result: Any) -> dict[str, Any] | None:
    """Gate verdicts as the ``gate.json`` dict, from a GateResult, a dict, or a gate.json path (or its folder)."""
    if gate_result is None:
        return None
    if isinstance(gate_result, dict):
        return _flatten_gate(gate_result)
    if isinstance(gate_result, GateResult):
        return gate_result.to_dict()
    if isinstance(gate_result, (list, tuple)):  # one result per model, as a sweep's gate.json holds them
        return _flatten_gate({"results": [load_gate_result(r) for r in gate_result]})
    data, path = read_gate_file(gate_result)
    return {**_flatten_gate(data), _FILE: str(path), _RAW: data}


#: The keys :func:`load_gate_result` keeps a gate file's path (for messages) and its content as read under: a
#: verdict read from a file is shown only once :func:`kveval.gate.verify.check_gate_file` has derived it again.
_FILE, _RAW = "_file", "_raw"


def _flatten_gate(data: dict[str, Any]) -> dict[str, Any]:
    """A multi-model ``gate.json`` (``results``: one per baseline) as one list of candidates."""
    if "results" in data and "candidates" not in data:
        return dict(data, candidates=[c for r in data["results"] for c in r.get("candidates", [])])
    return data


def _verdicts(gate: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Map candidate path (resolved) and name to its entry in the gate result."""
    out: dict[str, dict[str, Any]] = {}
    for c in (gate or {}).get("candidates", []):
        out[f"name:{c.get('name')}"] = c
        try:
            out[f"path:{Path(c['path']).resolve()}"] = c
        except OSError:
            pass
    return out


def _check_judged(entry: dict[str, Any], run: Run, baseline: Run | None, source: str) -> None:
    """Refuse a verdict computed on other data than ``run`` and its ``baseline`` hold now (``judged``: what the gate
    judged, :func:`~kveval.runs.results.run_digest`), or a gate file that does not record what it judged."""
    judged = entry.get("judged")
    folder = Path(source).parent if source.endswith(".json") else "DIR"
    regenerate = (f"regenerate it on these runs: kveval gate --config CONFIG --baseline "
                  f"{baseline.path if baseline else 'BASELINE'} --candidate {run.path} [--candidate ...] --out {folder}")
    if not isinstance(judged, dict):
        raise ResultFileError(f"{source} records no digest of the runs its verdict on {run.info.name} judged (a gate "
                              f"file written before gates recorded them); {regenerate}")
    for role, now in (("candidate", run), ("baseline", baseline)):
        if now is None:
            continue
        then, digest = judged.get(role), run_digest(now)
        if then != digest:
            raise ResultFileError(f"{source}: its verdict on {run.info.name} was computed on other data than the {role} "
                                  f"{now.path} holds now ({_difference(then, digest)}); {regenerate}")


def _difference(then: Any, now: dict[str, Any]) -> str:
    """What differs between two :func:`~kveval.runs.results.run_digest` records, in a few words."""
    if not isinstance(then, dict):
        return "the gate could not read it"
    if then.get("identity") != now["identity"]:
        return "another run or model identity"
    if then.get("items") != now["items"]:
        return f"{then.get('items')} items judged, {now['items']} now"
    return f"items sha256 {str(then.get('items_sha256'))[:12]} judged, {now['items_sha256'][:12]} now"


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
    check_settings(confidence_level, n_resamples)
    runs = [load_run(p) for p in expand_run_dirs(run_dirs)]
    baselines: dict[str, Run] = {}
    for r in runs:
        if r.info.is_baseline:
            if r.info.model in baselines:
                raise UsageError(
                    f"two baselines for model {r.info.model!r}: {baselines[r.info.model].path} and {r.path}; report one"
                )
            baselines[r.info.model] = r
    gate = load_gate_result(gate_result)
    verdicts = _verdicts(gate)
    rows: list[Row] = []
    tasks: list[str] = []
    for r in runs:
        for it in r.items:
            if it.task not in tasks:
                tasks.append(it.task)
        comp = None
        if not r.info.is_baseline and r.info.model in baselines:
            comp = compare_runs(
                baseline_for(baselines[r.info.model], r), r, n_resamples=n_resamples, seed=seed, confidence_level=confidence_level, cells=False
            )
        by_task: dict[str, list[float]] = {}
        items_of: dict[str, list] = {}
        for it in r.items:
            by_task.setdefault(it.task, []).append(it.score)
            items_of.setdefault(it.task, []).append(it)
        conf = confusion_rates(r.items)
        task_conf = {t: confusion_rates(items).get(OVERALL) for t, items in items_of.items()}
        judged = None if r.info.is_baseline else (verdicts.get(f"path:{r.path.resolve()}")
                                                  or verdicts.get(f"name:{r.info.name}"))
        if judged is not None:
            _check_judged(judged, r, baselines.get(r.info.model), (gate or {}).get(_FILE, "the gate result"))
        rows.append(
            Row(
                run=r,
                comparison=comp,
                task_scores={t: float(np.mean(v)) for t, v in by_task.items()},
                score=float(np.mean([it.score for it in r.items])),
                confusion_rate=conf.get(OVERALL) if conf else None,
                task_confusion=task_conf,
                verdict=judged["status"] if judged else None,
                gate=judged,
                baseline=baselines.get(r.info.model) if comp is not None else None,
            )
        )
    if gate is not None and _RAW in gate:  # each verdict judged its runs (above): now it must be what they give
        check_gate_file(gate[_RAW], Path(gate[_FILE]), {r.info.name: r for r in runs})
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

    def task_comparison(r: Row, t: str):
        return r.comparison.task(t) if r.comparison is not None and t in r.comparison.task_names else None

    for group in groups.values():
        for t in tasks:  # each task's own: a leaderboard filtered to one task marks the best of its items
            mark(group, f"score:{t}", lambda r, t=t: r.task_scores.get(t), True)
            mark(group, f"delta:{t}", lambda r, t=t: c.delta if (c := task_comparison(r, t)) else None, True)
            mark(group, f"flips:{t}", lambda r, t=t: c.negative_flip_rate if (c := task_comparison(r, t)) else None, False)
            mark(group, f"confusion:{t}", lambda r, t=t: r.task_confusion.get(t), False)
        mark(group, "score", lambda r: r.score, True)
        mark(group, "delta", lambda r: r.comparison.overall.delta if r.comparison else None, True)
        mark(group, "compression", lambda r: r.info.compression, True)
        mark(group, "flips", lambda r: r.comparison.overall.negative_flip_rate if r.comparison else None, False)
        mark(group, "confusion", lambda r: r.confusion_rate, False)
        mark(group, "kl", lambda r: r.fidelity["kl_mean"] if r.fidelity else None, False)


__all__ = ["DECODE_HEADER", "MODES_HEADER", "Row", "collect_rows", "decode_cells", "fmt", "load_gate_result", "mode_pairs",
           "modes_table", "part_bytes", "part_bytes_text", "peak_decode_bytes", "shows_decode"]
