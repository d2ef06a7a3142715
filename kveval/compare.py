"""Paired comparison of a candidate run against its baseline, item by item.

Two kinds of results pair:

* kveval run folders (``run.json`` + ``items.jsonl``, see :mod:`kveval.records`):
  items pair on ``id``; their prompt ``hash`` must agree.
* lm-evaluation-harness ``--log_samples`` output (``samples_<task>_<time>.jsonl``
  under ``--output_path``): lines pair on ``(task, doc_id, filter)``; their
  ``prompt_hash`` must agree. The score is the task's metric value (``acc``,
  ``exact_match``, ``score``, ... or the one asked for); for log-likelihood
  tasks the gold answer's log-probability is read from ``filtered_resps``.

Runs that do not pair exactly (missing or extra items, different prompts,
different models) are refused with :class:`~kveval.records.ResultFileError`:
a comparison on a partial or different item set is not a comparison.

A :class:`RunComparison` holds one :class:`Comparison` per task (tested, with
Holm- and Benjamini-Hochberg-adjusted p-values across the tasks), one for all
items pooled, and one per (task, context length, depth) cell for heatmaps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from kveval import stats
from kveval.records import ITEMS_FILE, RUN_FILE, ItemRecord, ResultFileError, RunInfo, read_items, read_run_info

#: Memory-confusion categories of probe items, in display order.
CATEGORIES = ("correct", "distractor", "stale", "partial", "over_inclusion", "fabricated", "empty")
#: Wrong answers that still give a value (a confused memory); their summed rate is ``"overall"``.
CONFUSION_CATEGORIES = ("distractor", "stale", "partial", "over_inclusion", "fabricated")
#: Key of the summed confusion rate in the confusion dictionaries.
OVERALL = "overall"
#: Cell name of the comparison that pools every item.
ALL = "ALL"
#: Metrics taken, in this order, as an lm-eval task's score when none is asked for.
LM_EVAL_METRICS = ("acc", "exact_match", "score", "acc_norm", "em", "f1", "accuracy")

DEFAULT_RESAMPLES = 9999
CELL_RESAMPLES = 1999  # heatmap cells are descriptive; a cheaper bootstrap is enough


# ----------------------------------------------------------------------------- loading


@dataclass
class Run:
    """One loaded run: what it was and its per-item records.

    Attributes
    ----------
    path : Path
        Folder (or samples file) it was read from.
    info : RunInfo
        Run description (synthesized from ``results_*.json`` for lm-eval output).
    items : list of ItemRecord
        Per-item outcomes. lm-eval samples become records with
        ``id = "<task>/<doc_id>"`` (plus ``"/<filter>"`` for filters other than
        ``none``), ``hash = prompt_hash``.
    source : str
        ``"kveval"`` or ``"lm-eval"``.
    """

    path: Path
    info: RunInfo
    items: list[ItemRecord]
    source: str


def load_run(path: str | os.PathLike | Run, *, metric: str | dict[str, str] | None = None) -> Run:
    """Load a kveval run folder or lm-eval ``--log_samples`` output.

    Parameters
    ----------
    path : path or Run
        A kveval run folder (holds ``run.json``), an lm-eval output folder
        (``samples_*.jsonl`` in it or one level of model folders below), or one
        samples file. A :class:`Run` is returned unchanged.
    metric : str or dict, optional
        lm-eval only: the metric to score by. A string applies to every task
        that reports it (others use the default choice, :data:`LM_EVAL_METRICS`);
        a dict maps task names to metrics that must exist.

    Raises
    ------
    ResultFileError
        Missing, truncated or corrupt files, or a folder that is neither.
    """
    if isinstance(path, Run):
        return path
    p = Path(path)
    if not p.exists():
        raise ResultFileError(f"{p}: no such file or folder")
    if p.is_dir() and (p / RUN_FILE).is_file():
        return load_kveval_run(p)
    if p.is_file() and p.name.startswith("samples_") and p.name.endswith(".jsonl"):
        return load_lm_eval_run(p, metric=metric)
    if p.is_dir() and _samples_files(p):
        return load_lm_eval_run(p, metric=metric)
    if p.is_dir() and (p / ITEMS_FILE).is_file():
        read_run_info(p)  # raises the "no run file" error
    raise ResultFileError(
        f"{p}: neither a kveval run folder ({RUN_FILE} + {ITEMS_FILE}) nor lm-eval --log_samples output (samples_*.jsonl)"
    )


def load_kveval_run(path: str | os.PathLike) -> Run:
    """Read a kveval run folder; raises :class:`ResultFileError` on bad files."""
    p = Path(path)
    info = read_run_info(p)
    items = read_items(p)
    if not items:
        raise ResultFileError(f"{p / ITEMS_FILE}: no items; the run did not finish any item")
    return Run(p, info, items, "kveval")


def expand_run_dirs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Run folders from the given paths: a run folder itself, or every ``runs/*/`` (or ``*/``) run of a sweep folder."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise ResultFileError(f"{p}: no such run or sweep folder")
        if p.is_file() or (p / RUN_FILE).is_file() or list(p.glob("samples_*.jsonl")) or list(p.glob("*/samples_*.jsonl")):
            found = [p]
        else:
            # a run folder with items but no run.json is kept, so that loading it reports the problem
            found = sorted({q.parent for name in (RUN_FILE, ITEMS_FILE) for q in p.glob(f"runs/*/{name}")})
            found = found or sorted({q.parent for name in (RUN_FILE, ITEMS_FILE) for q in p.glob(f"*/{name}")})
            if not found:
                raise ResultFileError(f"{p}: neither a run folder ({RUN_FILE}) nor a sweep folder with runs/*/{RUN_FILE}")
        for f in found:
            if all(f.resolve() != o.resolve() for o in out):
                out.append(f)
    if not out:
        raise ResultFileError("no runs given")
    return out


def _samples_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("samples_*.jsonl"))
    if not files:
        files = sorted(folder.glob("*/samples_*.jsonl"))
    return files


def _split_samples_name(name: str) -> tuple[str, str]:
    """``samples_<task>_<date>.jsonl`` -> (task, date). Task names may hold underscores, dates do not."""
    stem = name[len("samples_") : -len(".jsonl")]
    task, sep, date = stem.rpartition("_")
    if not sep or not task:
        raise ResultFileError(f"{name}: not an lm-eval samples file name (samples_<task>_<time>.jsonl)")
    return task, date


def load_lm_eval_run(path: str | os.PathLike, *, metric: str | dict[str, str] | None = None) -> Run:
    """Read lm-eval ``--log_samples`` output as a :class:`Run`.

    When a folder holds several samples files for one task (runs repeated into
    the same ``--output_path``), the latest timestamp is used, as lm-eval does.
    """
    p = Path(path)
    files = [p] if p.is_file() else _samples_files(p)
    if not files:
        raise ResultFileError(f"{p}: no samples_*.jsonl files; run lm_eval with --log_samples --output_path")
    parents = sorted({f.parent for f in files})
    if len(parents) > 1:
        names = ", ".join(str(x) for x in parents[:3])
        raise ResultFileError(f"{p}: samples for {len(parents)} models ({names}); point at one model's folder")
    latest: dict[str, tuple[str, Path]] = {}
    for f in files:
        task, date = _split_samples_name(f.name)
        if task not in latest or date > latest[task][0]:
            latest[task] = (date, f)
    items: list[ItemRecord] = []
    for task in sorted(latest):
        items.extend(_read_samples(latest[task][1], task, metric))
    if not items:
        raise ResultFileError(f"{p}: the samples files hold no lines")
    info = _lm_eval_run_info(p, parents[0], max(d for d, _ in latest.values()))
    return Run(p, info, items, "lm-eval")


def _read_samples(path: Path, task: str, metric: str | dict[str, str] | None) -> list[ItemRecord]:
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        raise ResultFileError(f"{path}: truncated (the last line was cut off mid-write); rerun lm_eval")
    rows: list[dict] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ResultFileError(f"{path}:{number}: corrupt samples line ({exc!r})") from exc
        row["_line"] = number
        rows.append(row)
    return records_from_samples(rows, task, metric, path)


def records_from_samples(rows: list[dict], task: str, metric: str | dict[str, str] | None, path: Path | str) -> list[ItemRecord]:
    """lm-eval ``--log_samples`` rows of one task as :class:`ItemRecord` (``path`` names the source in errors)."""
    # A per-task metric is required to exist; one metric for all tasks applies where the task has it.
    strict = isinstance(metric, dict) and task in metric
    chosen: str | None = metric.get(task) if isinstance(metric, dict) else metric
    filters: set[str] = set()
    for number, row in enumerate(rows, start=1):
        row.setdefault("_line", number)
        if not isinstance(row, dict) or "doc_id" not in row or "prompt_hash" not in row:
            raise ResultFileError(f"{path}:{number}: corrupt samples line (needs doc_id and prompt_hash)")
        filters.add(str(row.get("filter", "none")))
    if chosen is not None and not strict and rows and chosen not in rows[0].get("metrics", []):
        chosen = None
    records = []
    for row in rows:
        if chosen is None:
            chosen = _pick_metric(row, path)
        value = row.get(chosen)
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ResultFileError(
                f"{path}:{row['_line']}: metric {chosen!r} is missing or not a number ({value!r}); "
                f"pick a scalar metric with --metric (line has {row.get('metrics')})"
            )
        flt = str(row.get("filter", "none"))
        cell = task if len(filters) == 1 else f"{task}[{flt}]"
        item_id = f"{task}/{row['doc_id']}" + ("" if flt == "none" else f"/{flt}")
        answer, gold_lp = _lm_eval_answer(row)
        score = float(value)
        records.append(
            ItemRecord(
                id=item_id,
                hash=str(row["prompt_hash"]),
                task=cell,
                score=score,
                correct=score >= 1.0,
                answer=answer,
                gold=[str(row.get("target", ""))],
                logprob_gold=gold_lp,
                metrics={"metric": chosen, "doc_id": row["doc_id"], "filter": flt},
            )
        )
    return records


def _pick_metric(row: dict, path: Path) -> str:
    names = [m for m in row.get("metrics", []) if isinstance(m, str)]
    for m in LM_EVAL_METRICS:
        if m in names and isinstance(row.get(m), (int, float)):
            return m
    for m in names:
        if isinstance(row.get(m), (int, float)):
            return m
    raise ResultFileError(f"{path}: no scalar metric in {names}; pick one with --metric")


def _as_float(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _lm_eval_answer(row: dict) -> tuple[str, float | None]:
    """The model's output as text and the gold continuation's log-likelihood (if a loglikelihood task)."""
    resps = row.get("filtered_resps")
    if resps is None:
        resps = [r[0] if isinstance(r, (list, tuple)) and r else r for r in row.get("resps", [])]
    if not isinstance(resps, list) or not resps:
        return "", None
    lls = []
    for r in resps:
        if isinstance(r, (list, tuple)) and len(r) == 2 and _as_float(r[0]) is not None:  # tuples in memory, lists in JSON
            lls.append(_as_float(r[0]))
        else:
            lls = []
            break
    if not lls:  # generation: the (filtered) output text
        first = resps[0]
        return (first if isinstance(first, str) else json.dumps(first)), None
    best = int(np.argmax(lls))
    gold = _gold_index(row, len(lls))
    return str(best), (lls[gold] if gold is not None else None)


def _gold_index(row: dict, n_choices: int) -> int | None:
    target = row.get("target")
    if n_choices == 1:
        return 0
    try:
        idx = int(str(target).strip())
        if 0 <= idx < n_choices:
            return idx
    except ValueError:
        pass
    args = row.get("arguments")
    conts: list[str] = []
    if isinstance(args, dict):
        conts = [str(v.get("arg_1", "")) for _, v in sorted(args.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[-1]))]
    elif isinstance(args, list):
        conts = [str(a[1]) if isinstance(a, list) and len(a) > 1 else "" for a in args]
    matches = [i for i, c in enumerate(conts) if c.strip() == str(target).strip()]
    return matches[0] if len(matches) == 1 else None


def _lm_eval_run_info(path: Path, folder: Path, date: str) -> RunInfo:
    results = sorted(folder.glob("results_*.json"))
    match = [r for r in results if r.name == f"results_{date}.json"]
    config: dict[str, Any] = {}
    src = (match or results[-1:] or [None])[0]
    if src is not None:
        try:
            config = json.loads(src.read_text(encoding="utf-8")).get("config", {}) or {}
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ResultFileError(f"{src}: corrupt lm-eval results file ({exc})") from exc
    margs = config.get("model_args") or {}
    if isinstance(margs, str):
        margs = dict(kv.split("=", 1) for kv in margs.split(",") if "=" in kv)

    def first(*keys: str) -> Any:
        for k in keys:
            for source in (config, margs, config.get("kveval") if isinstance(config.get("kveval"), dict) else {}):
                if k in source and source[k] not in (None, ""):
                    return source[k]
        return None

    model = first("pretrained", "model_name") or config.get("model") or folder.name
    policy = str(first("kveval_policy", "policy") or "none")
    ratio = _as_float(first("kveval_ratio", "ratio"))
    return RunInfo(
        name=path.name if path.is_dir() else path.stem,
        model=str(model),
        policy=policy,
        mode=str(first("kveval_mode", "mode") or "context"),
        family=str(first("kveval_family", "family") or (policy.split("(")[0] if policy else "none")),
        ratio=ratio,
        bytes_per_token=_as_float(first("kveval_bytes_per_token", "bytes_per_token")),
        nominal_bytes_per_token=_as_float(first("kveval_nominal_bytes_per_token", "nominal_bytes_per_token")),
        extra={"source": "lm-eval", "lm_eval_model": config.get("model")},
    )


# ----------------------------------------------------------------------------- pairing


def _ids(xs: Iterable[str], k: int = 5) -> str:
    xs = list(xs)
    shown = ", ".join(xs[:k])
    return shown + (f", ... ({len(xs) - k} more)" if len(xs) > k else "")


def pair_runs(baseline: Run, candidate: Run) -> list[tuple[ItemRecord, ItemRecord]]:
    """Pair two runs item by item, in the baseline's order.

    Raises
    ------
    ResultFileError
        Duplicate ids, items present in only one run, prompt-hash or task
        mismatches, different result formats, or (kveval runs) different models.
    """
    if baseline.source != candidate.source:
        raise ResultFileError(
            f"cannot pair a {baseline.source} result ({baseline.path}) with a {candidate.source} result ({candidate.path})"
        )
    if baseline.source == "kveval" and baseline.info.model != candidate.info.model:
        raise ResultFileError(
            f"cannot pair runs of different models: baseline {baseline.info.model!r} ({baseline.path}) "
            f"vs candidate {candidate.info.model!r} ({candidate.path})"
        )
    maps = []
    for run in (baseline, candidate):
        counts = Counter(it.id for it in run.items)
        dups = sorted(i for i, c in counts.items() if c > 1)
        if dups:
            raise ResultFileError(f"{run.path}: {len(dups)} duplicate item id(s) ({_ids(dups)}); the result file is corrupt")
        maps.append({it.id: it for it in run.items})
    base, cand = maps
    only_base = [i for i in base if i not in cand]
    only_cand = [i for i in cand if i not in base]
    if only_base or only_cand:
        parts = []
        if only_base:
            parts.append(f"{len(only_base)} item(s) only in the baseline ({_ids(only_base)})")
        if only_cand:
            parts.append(f"{len(only_cand)} item(s) only in the candidate ({_ids(only_cand)})")
        raise ResultFileError(
            f"unpaired runs {baseline.path} vs {candidate.path}: " + " and ".join(parts)
            + "; both runs must evaluate the same items"
        )
    bad_hash = [i for i, it in base.items() if it.hash != cand[i].hash]
    if bad_hash:
        raise ResultFileError(
            f"mismatched runs {baseline.path} vs {candidate.path}: {len(bad_hash)} item(s) have different prompt hashes "
            f"({_ids(bad_hash)}); the runs did not see the same prompts"
        )
    bad_task = [i for i, it in base.items() if it.task != cand[i].task]
    if bad_task:
        raise ResultFileError(
            f"mismatched runs {baseline.path} vs {candidate.path}: {len(bad_task)} item(s) belong to different tasks "
            f"({_ids(bad_task)})"
        )
    return [(b, cand[i]) for i, b in base.items()]


# ----------------------------------------------------------------------------- comparisons


@dataclass
class Comparison:
    """Candidate vs baseline on one cell (a task, all items, or a task x length x depth cell).

    Attributes
    ----------
    cell : str
        ``"<task>"``, ``"ALL"`` or ``"<task>@len=<L>,depth=<d>"``.
    task : str
        Task name (``"ALL"`` for the pooled comparison).
    length, depth : int or float or None
        Heatmap coordinates (context-length bucket, rounded depth) of a cell.
    n : int
        Paired items.
    baseline_score, candidate_score, delta : float
        Mean scores and their difference (candidate - baseline).
    ci_low, ci_high : float
        Paired bootstrap interval of ``delta`` at ``confidence_level``.
    binary : bool
        Every score is 0 or 1.
    pvalue : float
        The cell's test: exact McNemar for binary scores, Wilcoxon otherwise.
    test : str
        ``"mcnemar"`` or ``"wilcoxon"``.
    mcnemar_p : float
        Exact McNemar p on correctness (reported for every cell).
    score_test, score_p : str, float
        Test on the scores themselves: paired permutation (binary) or Wilcoxon.
    p_holm, p_bh : float or None
        ``pvalue`` adjusted across the family (the run's tasks, or its heatmap
        cells); set by :func:`adjust_pvalues`.
    n_regressed, n_improved : int
        Right->wrong and wrong->right items.
    negative_flip_rate, positive_flip_rate : float
        The same per item.
    agreement : float
        Share of items whose output text is identical.
    confusion_baseline, confusion_candidate, confusion_delta : dict
        Share of items per category (and ``"overall"``: the summed
        :data:`CONFUSION_CATEGORIES`); empty when the task has no taxonomy.
    logprob_delta, logprob_ci_low, logprob_ci_high : float or None
        Mean change of the gold answer's log-probability, where both runs have it.
    regressed : list of dict
        The right->wrong items: id, task, category, recalled, baseline and
        candidate answers, length, depth.
    """

    cell: str
    task: str
    n: int
    baseline_score: float
    candidate_score: float
    delta: float
    ci_low: float
    ci_high: float
    confidence_level: float
    ci_method: str
    binary: bool
    pvalue: float
    test: str
    mcnemar_p: float
    score_test: str
    score_p: float
    n_regressed: int
    n_improved: int
    negative_flip_rate: float
    positive_flip_rate: float
    agreement: float
    confusion_baseline: dict[str, float]
    confusion_candidate: dict[str, float]
    confusion_delta: dict[str, float]
    regressed: list[dict[str, Any]]
    length: int | None = None
    depth: float | None = None
    logprob_delta: float | None = None
    logprob_ci_low: float | None = None
    logprob_ci_high: float | None = None
    n_logprob: int = 0
    p_holm: float | None = None
    p_bh: float | None = None
    baseline_scores: np.ndarray = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    candidate_scores: np.ndarray = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("baseline_scores", "candidate_scores")}
        return _clean(out)

    def regressed_categories(self) -> Counter:
        """Candidate categories of the regressed items (``""`` becomes ``"wrong"``)."""
        return Counter((r.get("category") or "wrong") for r in self.regressed)


def confusion_rates(items: Sequence[ItemRecord]) -> dict[str, float]:
    """Share of items per category, plus ``"overall"`` (summed confusion categories).

    Returns an empty dict when no item carries a category.
    """
    n = len(items)
    counts = Counter(it.category for it in items if it.category)
    if not n or not counts:
        return {}
    rates = {c: counts.get(c, 0) / n for c in CATEGORIES}
    for c in sorted(counts):
        if c not in rates:
            rates[c] = counts[c] / n
    rates[OVERALL] = sum(counts.get(c, 0) for c in CONFUSION_CATEGORIES) / n
    return rates


def compare_pairs(
    pairs: Sequence[tuple[ItemRecord, ItemRecord]],
    *,
    cell: str,
    task: str,
    length: int | None = None,
    depth: float | None = None,
    confidence_level: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int | None = 0,
) -> Comparison:
    """Compare paired items of one cell (see :class:`Comparison`)."""
    if not pairs:
        raise ValueError(f"cell {cell!r} has no items")
    base = [b for b, _ in pairs]
    cand = [c for _, c in pairs]
    a = np.array([b.score for b in base], dtype=float)
    b = np.array([c.score for c in cand], dtype=float)
    ac = np.array([bool(x.correct) for x in base])
    bc = np.array([bool(x.correct) for x in cand])
    ci = stats.paired_bootstrap_ci(a, b, confidence_level=confidence_level, n_resamples=n_resamples, seed=seed)
    mc = stats.mcnemar_exact(ac, bc)
    fl = stats.flips(ac, bc)
    binary = stats.is_binary(a, b)
    if binary:
        score_test, score_p = "permutation", stats.paired_permutation_test(a, b, n_resamples=n_resamples, seed=seed)
        test, pvalue = "mcnemar", mc.pvalue
    else:
        score_test, score_p = "wilcoxon", stats.wilcoxon_test(a, b)
        test, pvalue = "wilcoxon", score_p
    cb, cc = confusion_rates(base), confusion_rates(cand)
    keys = list(dict.fromkeys([*cb, *cc]))
    cd = {k: cc.get(k, 0.0) - cb.get(k, 0.0) for k in keys} if (cb or cc) else {}
    regressed = [
        {
            "id": y.id,
            "task": y.task,
            "category": y.category,
            "recalled": y.recalled,
            "baseline_answer": x.answer,
            "answer": y.answer,
            "length": y.length,
            "depth": y.depth,
        }
        for x, y in pairs
        if x.correct and not y.correct
    ]
    lp = [(x.logprob_gold, y.logprob_gold) for x, y in pairs if x.logprob_gold is not None and y.logprob_gold is not None]
    lp_delta = lp_low = lp_high = None
    if lp:
        la = np.array([p[0] for p in lp], dtype=float)
        lb = np.array([p[1] for p in lp], dtype=float)
        if np.all(np.isfinite(la)) and np.all(np.isfinite(lb)):
            lci = stats.paired_bootstrap_ci(la, lb, confidence_level=confidence_level, n_resamples=n_resamples, seed=seed)
            lp_delta, lp_low, lp_high = lci.estimate, lci.low, lci.high
    return Comparison(
        cell=cell,
        task=task,
        n=len(pairs),
        baseline_score=float(a.mean()),
        candidate_score=float(b.mean()),
        delta=ci.estimate,
        ci_low=ci.low,
        ci_high=ci.high,
        confidence_level=confidence_level,
        ci_method=ci.method,
        binary=binary,
        pvalue=pvalue,
        test=test,
        mcnemar_p=mc.pvalue,
        score_test=score_test,
        score_p=score_p,
        n_regressed=fl.n_regressed,
        n_improved=fl.n_improved,
        negative_flip_rate=fl.negative_rate,
        positive_flip_rate=fl.positive_rate,
        agreement=float(np.mean([x.answer == y.answer for x, y in pairs])),
        confusion_baseline=cb,
        confusion_candidate=cc,
        confusion_delta=cd,
        regressed=regressed,
        length=length,
        depth=depth,
        logprob_delta=lp_delta,
        logprob_ci_low=lp_low,
        logprob_ci_high=lp_high,
        n_logprob=len(lp),
        baseline_scores=a,
        candidate_scores=b,
    )


def adjust_pvalues(comparisons: Sequence[Comparison]) -> None:
    """Set ``p_holm`` and ``p_bh`` of each comparison, adjusting across the given family."""
    if not comparisons:
        return
    p = [c.pvalue for c in comparisons]
    for c, h, q in zip(comparisons, stats.holm(p), stats.benjamini_hochberg(p)):
        c.p_holm, c.p_bh = float(h), float(q)


def length_buckets(lengths: Iterable[int]) -> dict[int, int]:
    """Map measured prompt lengths to heatmap buckets.

    Lengths within 15% of a bucket's smallest member share the bucket (prompts
    built for one target length differ by a few tokens); a bucket is labeled by
    the median of its distinct lengths, rounded.
    """
    uniq = sorted({int(x) for x in lengths})
    out: dict[int, int] = {}
    group: list[int] = []

    def close(g: list[int]) -> None:
        label = int(round(float(np.median(g))))
        for x in g:
            out[x] = label

    for x in uniq:
        if group and x > group[0] * 1.15:
            close(group)
            group = []
        group.append(x)
    if group:
        close(group)
    return out


def depth_bucket(depth: float | None) -> float | None:
    return None if depth is None else round(float(depth), 2)


def _grid_key(b: ItemRecord, buckets: dict[int, int]) -> tuple[int | None, float | None]:
    return (buckets.get(int(b.length)) if b.length is not None else None, depth_bucket(b.depth))


@dataclass
class RunComparison:
    """A candidate run against its baseline.

    Attributes
    ----------
    baseline, candidate : RunInfo
    baseline_path, candidate_path : str
    source : str
        ``"kveval"`` or ``"lm-eval"``.
    n : int
        Paired items in all.
    overall : Comparison
        Every item pooled (cell ``"ALL"``; not part of the adjusted family).
    tasks : list of Comparison
        One per task; ``p_holm``/``p_bh`` adjusted across these.
    cells : list of Comparison
        One per (task, length bucket, depth) with a length or depth; adjusted
        across these separately.
    pairs : list of (ItemRecord, ItemRecord)
        The paired items (not serialized).
    """

    baseline: RunInfo
    candidate: RunInfo
    baseline_path: str
    candidate_path: str
    source: str
    n: int
    overall: Comparison
    tasks: list[Comparison]
    cells: list[Comparison]
    pairs: list[tuple[ItemRecord, ItemRecord]] = field(default_factory=list, repr=False, compare=False)

    def task(self, name: str) -> Comparison:
        for c in self.tasks:
            if c.task == name:
                return c
        raise KeyError(f"task {name!r} not in comparison (tasks: {', '.join(c.task for c in self.tasks)})")

    @property
    def task_names(self) -> list[str]:
        return [c.task for c in self.tasks]

    def grid(self) -> tuple[list[int | None], list[float | None], np.ndarray, np.ndarray]:
        """Mean score change per (length bucket, depth), all tasks pooled.

        Returns
        -------
        lengths, depths : list
            Sorted bucket labels (rows, columns).
        delta : ndarray
            ``len(lengths) x len(depths)``, NaN where a cell has no items.
        counts : ndarray
            Items per cell.
        """
        return delta_grid(self.pairs)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return _clean(
            {
                "baseline": asdict(self.baseline),
                "candidate": asdict(self.candidate),
                "baseline_path": self.baseline_path,
                "candidate_path": self.candidate_path,
                "source": self.source,
                "n": self.n,
                "overall": self.overall.to_dict(),
                "tasks": [c.to_dict() for c in self.tasks],
                "cells": [c.to_dict() for c in self.cells],
            }
        )


def delta_grid(pairs: Sequence[tuple[ItemRecord, ItemRecord]]):
    """Mean ``candidate - baseline`` score per (length bucket, depth) over the given pairs."""
    with_grid = [(b, c) for b, c in pairs if b.length is not None or b.depth is not None]
    buckets = length_buckets(b.length for b, _ in with_grid if b.length is not None)
    acc: dict[tuple, list[float]] = defaultdict(list)
    for b, c in with_grid:
        acc[_grid_key(b, buckets)].append(c.score - b.score)
    lengths = sorted({k[0] for k in acc}, key=lambda x: (x is None, x or 0))
    depths = sorted({k[1] for k in acc}, key=lambda x: (x is None, x or 0))
    delta = np.full((len(lengths), len(depths)), np.nan)
    counts = np.zeros((len(lengths), len(depths)), dtype=int)
    for (L, d), vals in acc.items():
        i, j = lengths.index(L), depths.index(d)
        delta[i, j] = float(np.mean(vals))
        counts[i, j] = len(vals)
    return lengths, depths, delta, counts


def compare_runs(
    baseline: str | os.PathLike | Run,
    candidate: str | os.PathLike | Run,
    *,
    confidence_level: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int | None = 0,
    cells: bool = True,
    metric: str | dict[str, str] | None = None,
) -> RunComparison:
    """Load, pair and compare a candidate with its baseline.

    Parameters
    ----------
    baseline, candidate : path or Run
        kveval run folders or lm-eval ``--log_samples`` outputs (same kind).
    confidence_level : float, optional
        Two-sided bootstrap interval coverage (default 0.95).
    n_resamples : int, optional
        Bootstrap and permutation resamples per task (heatmap cells use at
        most :data:`CELL_RESAMPLES`).
    seed : int or None, optional
        Seed for every resampling step.
    cells : bool, optional
        Also compare each (task, length, depth) cell.
    metric : str or dict, optional
        lm-eval only: the metric to score by.

    Raises
    ------
    ResultFileError
        Unreadable results or runs that do not pair.
    """
    base = load_run(baseline, metric=metric)
    cand = load_run(candidate, metric=metric)
    pairs = pair_runs(base, cand)
    kw = dict(confidence_level=confidence_level, n_resamples=n_resamples, seed=seed)
    by_task: dict[str, list] = defaultdict(list)
    for p in pairs:
        by_task[p[0].task].append(p)
    tasks = [compare_pairs(ps, cell=t, task=t, **kw) for t, ps in by_task.items()]
    adjust_pvalues(tasks)
    overall = compare_pairs(pairs, cell=ALL, task=ALL, **kw)
    cell_list: list[Comparison] = []
    if cells:
        buckets = length_buckets(b.length for b, _ in pairs if b.length is not None)
        by_cell: dict[tuple, list] = defaultdict(list)
        for p in pairs:
            b = p[0]
            if b.length is None and b.depth is None:
                continue
            by_cell[(b.task, *_grid_key(b, buckets))].append(p)
        ckw = dict(kw, n_resamples=min(n_resamples, CELL_RESAMPLES))
        for (t, L, d), ps in sorted(by_cell.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0, kv[0][2] or 0)):
            name = f"{t}@len={L if L is not None else '-'},depth={d if d is not None else '-'}"
            cell_list.append(compare_pairs(ps, cell=name, task=t, length=L, depth=d, **ckw))
        adjust_pvalues(cell_list)
    return RunComparison(
        baseline=base.info,
        candidate=cand.info,
        baseline_path=str(base.path),
        candidate_path=str(cand.path),
        source=base.source,
        n=len(pairs),
        overall=overall,
        tasks=tasks,
        cells=cell_list,
        pairs=pairs,
    )


def adjust_sweep(comparisons: Sequence[RunComparison], tasks: Sequence[str] | None = None) -> list[Comparison]:
    """Holm/BH-adjust the task p-values across every candidate of a sweep, in place.

    Parameters
    ----------
    comparisons : sequence of RunComparison
        All candidates of the sweep.
    tasks : sequence of str, optional
        Only these tasks form the family (default: all).

    Returns
    -------
    list of Comparison
        The adjusted family.
    """
    family = [c for rc in comparisons for c in rc.tasks if tasks is None or c.task in tasks]
    adjust_pvalues(family)
    return family


# ----------------------------------------------------------------------------- formatting


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, tuples -> lists."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return _clean(x.tolist())
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return v if math.isfinite(v) else None
    return x


def fmt_p(p: float | None) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "-"
    if p < 0.0001:
        return f"{p:.1e}"
    return f"{p:.4f}" if p < 0.01 else f"{p:.3f}"


def fmt_delta_ci(c: Comparison, digits: int = 2) -> str:
    return f"{c.delta:+.{digits}f} [{c.ci_low:+.{digits}f},{c.ci_high:+.{digits}f}]"


def top_confusion_change(c: Comparison, k: int = 2) -> str:
    changes = [(cat, d) for cat, d in c.confusion_delta.items() if cat not in ("correct", OVERALL) and abs(d) > 1e-12]
    changes.sort(key=lambda kv: -abs(kv[1]))
    return ", ".join(f"{cat} {d * 100:+.0f}pt" for cat, d in changes[:k]) or "-"


def format_table(rc: RunComparison) -> str:
    """Readable terminal table of a :class:`RunComparison`."""
    head = (
        f"baseline:  {rc.baseline.name} ({rc.baseline_path})\n"
        f"candidate: {rc.candidate.name} ({rc.candidate_path})\n"
        f"{rc.n} paired items ({rc.source} results); delta = candidate - baseline, "
        f"{int(round(rc.overall.confidence_level * 100))}% paired bootstrap CI; Holm/BH across {len(rc.tasks)} task(s)\n"
    )
    cols = ["task", "n", "base", "cand", "delta [CI]", "test", "p", "Holm", "BH", "-flip", "+flip", "agree", "confusion change"]
    rows = []
    for c in [*rc.tasks, rc.overall]:
        rows.append(
            [
                c.cell,
                str(c.n),
                f"{c.baseline_score:.3f}",
                f"{c.candidate_score:.3f}",
                fmt_delta_ci(c),
                c.test,
                fmt_p(c.pvalue),
                fmt_p(c.p_holm) if c is not rc.overall else "",
                fmt_p(c.p_bh) if c is not rc.overall else "",
                f"{c.negative_flip_rate * 100:.1f}%",
                f"{c.positive_flip_rate * 100:.1f}%",
                f"{c.agreement * 100:.0f}%",
                top_confusion_change(c),
            ]
        )
    widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) if i in (0, 4, 5, 12) else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in [cols, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = head + "\n" + "\n".join(lines)
    lp = [c for c in rc.tasks if c.logprob_delta is not None]
    if lp:
        out += "\n\ngold log-probability change (mean, CI): " + "; ".join(
            f"{c.task} {c.logprob_delta:+.3f} [{c.logprob_ci_low:+.3f},{c.logprob_ci_high:+.3f}] (n={c.n_logprob})" for c in lp
        )
    reg = [r for c in rc.tasks for r in c.regressed]
    if reg:
        shown = ", ".join(f"{r['id']} ({r.get('recalled') or r['category'] or 'wrong'})" for r in reg[:8])
        out += f"\n\nregressed items ({len(reg)}): {shown}" + (", ..." if len(reg) > 8 else "")
    return out


# ----------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", metavar="BASE", help="baseline run folder (or lm-eval --log_samples output)")
    parser.add_argument("candidate", metavar="CAND", help="candidate run folder (or lm-eval --log_samples output)")
    parser.add_argument("--json", metavar="PATH", help="also write the full comparison (tasks, cells, regressed items) as JSON")
    parser.add_argument("--metric", help="lm-eval outputs: metric to score by (default: acc, exact_match, score, ...)")
    parser.add_argument("--confidence", type=float, default=0.95, help="bootstrap interval coverage (default 0.95)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples (default 9999)")
    parser.add_argument("--seed", type=int, default=0, help="resampling seed (default 0)")
    parser.add_argument("--cells", action="store_true", help="also print the per (task, length, depth) cells")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.confidence < 1:
        raise ValueError(f"--confidence must be in (0, 1), got {args.confidence}")
    rc = compare_runs(
        args.baseline,
        args.candidate,
        confidence_level=args.confidence,
        n_resamples=args.resamples,
        seed=args.seed,
        metric=args.metric,
    )
    print(format_table(rc))
    if args.cells and rc.cells:
        print("\ncells:")
        for c in rc.cells:
            print(f"  {c.cell:40s} n={c.n:4d}  {fmt_delta_ci(c)}  p={fmt_p(c.pvalue)}  -flip {c.negative_flip_rate * 100:.0f}%")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rc.to_dict(), indent=2), encoding="utf-8")
        print(f"\nwrote {path}")
    return 0
