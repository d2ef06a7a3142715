"""Loading and pairing result files: kveval run folders and lm-eval ``--log_samples`` output.

Two kinds of results pair:

* kveval run folders (``run.json`` + ``items.jsonl``, see :mod:`kveval.runs.records`):
  items pair on ``id``; their prompt ``hash`` must agree.
* lm-evaluation-harness ``--log_samples`` output (``samples_<task>_<time>.jsonl``
  under ``--output_path``): lines pair on ``(task, doc_id, filter)``; their
  ``prompt_hash`` must agree. The score is the task's metric value (``acc``,
  ``exact_match``, ``score``, ... or the one asked for); for log-likelihood
  tasks the gold answer's log-probability is read from ``filtered_resps``.

Every item is validated where it is read (:func:`validate_items`): a score
outside [0, 1], a ``correct`` that is not a boolean or a non-string id is
refused with one line naming the file and the item. Runs that do not pair
exactly (missing or extra items, different prompts, different models) are
refused with :class:`~kveval.errors.ResultFileError`: a comparison on a
partial or different item set is not a comparison.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from kveval.runs.lm_eval_schema import as_float as _as_float
from kveval.runs.lm_eval_schema import read_run_fields  # the keys the kveval model type writes
from kveval.runs.records import (
    ITEMS_FILE,
    RUN_FILE,
    ItemRecord,
    ResultFileError,
    RunInfo,
    item_line,
    missing_items,
    read_items,
    read_run_info,
)
from kveval.runs.validation import validate_items, validate_run_info
from kveval.values import is_real

#: How many folder levels below a given path a run folder is looked for (sweep/runs/<model>/<policy>).
RUN_SEARCH_DEPTH = 3
#: Metrics taken, in this order, as an lm-eval task's score when none is asked for.
LM_EVAL_METRICS = ("acc", "exact_match", "score", "acc_norm", "em", "f1", "accuracy")

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


#: ``run.json`` ``extra`` key of a sequential sweep's decision on a run (:mod:`kveval.gate.sequential`): the run
#: holds only the first blocks of the sweep's items, those up to the look that decided it.
SEQUENTIAL_DECISION = "sequential_decision"


def baseline_for(baseline: Run, candidate: Run) -> Run:
    """The baseline as ``candidate`` pairs with it: whole, or, where the candidate was decided early by a sequential
    sweep (its ``run.json`` records :data:`SEQUENTIAL_DECISION`), on the candidate's items only."""
    if not candidate.info.extra.get(SEQUENTIAL_DECISION):
        return baseline
    ids = {r.id for r in candidate.items}
    return replace(baseline, items=[r for r in baseline.items if r.id in ids])


def run_digest(run: Run) -> dict[str, Any]:
    """What a verdict on ``run`` was computed on, as ``gate.json`` records it (``judged``) and ``kveval report --gate``
    checks it: the run's identity (name, model and its full identity, policy, mode, cache dtype), its number of items
    and the SHA-256 of its items as ``items.jsonl`` lines (for a run kveval wrote: ``sha256sum items.jsonl``)."""
    info = run.info
    return {
        "identity": {"name": info.name, "model": info.model, "model_identity": info.model_identity,
                     "policy": info.policy, "mode": info.mode, "kv_dtype": info.kv_dtype},
        "items": len(run.items),
        "items_sha256": hashlib.sha256("".join(item_line(r) for r in run.items).encode()).hexdigest(),
    }


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
    """Read a kveval run folder; raises :class:`ResultFileError` on bad files, and on a run that holds fewer items
    than its ``run.json`` records (:func:`~kveval.runs.records.missing_items`): no verdict on a part of a run."""
    p = Path(path)
    info = read_run_info(p)
    items = read_items(p)
    if not items:
        raise ResultFileError(f"{p / ITEMS_FILE}: no items; the run did not finish any item")
    short = missing_items(info, items)
    if short:
        raise ResultFileError(f"{p}: the run {info.name} {short}; finish it first (run the kveval sweep or kveval eval "
                              f"that wrote it again: it resumes), or run it again into a new folder")
    validate_run_info(info, p / RUN_FILE)
    validate_items(items, p / ITEMS_FILE)
    return Run(p, info, items, "kveval")


def is_same_run(baseline: "Run", candidate: "Run") -> bool:
    """Whether ``candidate`` is ``baseline`` again: the same folder, or a copy (same policy and mode, the same answers
    and scores item by item). The gate refuses such a pairing: a baseline gated against itself shows nothing."""
    if Path(baseline.path).resolve() == Path(candidate.path).resolve():
        return True
    return (baseline.info.policy == candidate.info.policy and baseline.info.mode == candidate.info.mode
            and [(b.id, b.answer, b.score) for b in baseline.items] == [(c.id, c.answer, c.score) for c in candidate.items])


def pairing_warnings(baseline: "Run", candidate: "Run") -> list[str]:
    """Warnings (not errors) about a pairing that looks mistaken: the runs swapped."""
    if not baseline.info.is_baseline and candidate.info.is_baseline:
        return [f"baseline and candidate look swapped: the baseline {baseline.path} ran policy "
                f"{baseline.info.policy!r}, the candidate {candidate.path} ran none"]
    return []


def expand_run_dirs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Run folders from the given paths: a run folder, a runs folder, or a sweep folder.

    A sweep folder holds ``runs/<model>/<policy>/``; every folder up to
    :data:`RUN_SEARCH_DEPTH` levels below a given path that holds a run file
    (or an items file, so that loading it reports the missing run file) is a
    run.
    """
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise ResultFileError(f"{p}: no such run or sweep folder")
        if p.is_file() or (p / RUN_FILE).is_file() or list(p.glob("samples_*.jsonl")) or list(p.glob("*/samples_*.jsonl")):
            found = [p]
        else:
            # a run folder with items but no run.json is kept, so that loading it reports the problem
            found = sorted(
                {q.parent for name in (RUN_FILE, ITEMS_FILE) for depth in range(1, RUN_SEARCH_DEPTH + 1)
                 for q in p.glob("/".join(["*"] * depth + [name]))}
            )
            if not found:
                raise ResultFileError(
                    f"{p}: no run folders in it; give a run folder ({RUN_FILE}), a runs folder or a sweep folder (runs/<model>/<policy>/)"
                )
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
    latest = _latest_samples(files)
    items: list[ItemRecord] = []
    for task in sorted(latest):
        items.extend(records_from_samples(_read_sample_rows(latest[task][1]), task, metric, latest[task][1]))
    if not items:
        raise ResultFileError(f"{p}: the samples files hold no lines")
    info = _lm_eval_run_info(p, parents[0], max(d for d, _ in latest.values()))
    validate_run_info(info, p)
    validate_items(items, p)
    return Run(p, info, items, "lm-eval")


def _latest_samples(files: Sequence[Path]) -> dict[str, tuple[str, Path]]:
    """Task -> (timestamp, file) of its latest samples file, as lm-eval reads a repeated ``--output_path``."""
    latest: dict[str, tuple[str, Path]] = {}
    for f in files:
        task, date = _split_samples_name(f.name)
        if task not in latest or date > latest[task][0]:
            latest[task] = (date, f)
    return latest


@dataclass(frozen=True)
class SampleDocument:
    """What an lm-eval ``--log_samples`` line shows of its document, for reading an item's answers beside it.

    Attributes
    ----------
    doc : dict
        The dataset row as lm-eval logged it.
    prompt : str
        The text the model was given (the first request's context).
    choices : list of str
        Loglikelihood tasks: each choice's continuation, in order (an answer ``"2"`` is ``choices[2]``); empty for
        generation tasks.
    target : str
    """

    doc: dict
    prompt: str
    choices: list[str]
    target: str


def sample_documents(run: Run) -> dict[str, SampleDocument]:
    """The documents of an lm-eval run read from its ``--log_samples`` files, by item id (as in ``run.items``);
    empty for a kveval run (a sweep's lm-eval records keep no documents)."""
    if run.source != "lm-eval":
        return {}
    files = [run.path] if run.path.is_file() else _samples_files(run.path)
    out: dict[str, SampleDocument] = {}
    for task, (_, path) in _latest_samples(files).items():
        for row in _read_sample_rows(path):
            args = _request_arguments(row)
            doc = row.get("doc")
            out[sample_item_id(task, row)] = SampleDocument(
                doc=doc if isinstance(doc, dict) else {"doc": doc},
                prompt=args[0][0] if args else "",
                choices=[second for _, second in args] if _loglikelihoods(_responses(row)) else [],
                target=str(row.get("target", "")),
            )
    return out


def _request_arguments(row: dict) -> list[tuple[str, str]]:
    """A sample's requests as (context, second argument) pairs: the continuation of a loglikelihood request, the
    generation settings of a generation one."""
    args = row.get("arguments")
    if isinstance(args, dict):
        args = [v for _, v in sorted(args.items(), key=lambda kv: int(str(kv[0]).rsplit("_", 1)[-1]))]
        return [(str(a.get("arg_0", "")), str(a.get("arg_1", ""))) if isinstance(a, dict) else ("", "") for a in args]
    if isinstance(args, list):
        return [(str(a[0]), str(a[1]) if len(a) > 1 else "") if isinstance(a, list) and a else ("", "") for a in args]
    return []


def sample_item_id(task: str, row: dict) -> str:
    """The item id of an lm-eval samples line: ``<task>/<doc_id>``, plus ``/<filter>`` for filters other than ``none``."""
    flt = str(row.get("filter", "none"))
    return f"{task}/{row['doc_id']}" + ("" if flt == "none" else f"/{flt}")


def _read_sample_rows(path: Path) -> list[dict]:
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
    return rows


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
        if not is_real(value):
            raise ResultFileError(
                f"{path}:{row['_line']}: metric {chosen!r} is missing or not a number ({value!r}); "
                f"pick a scalar metric with --metric (line has {row.get('metrics')})"
            )
        flt = str(row.get("filter", "none"))
        cell = task if len(filters) == 1 else f"{task}[{flt}]"
        item_id = sample_item_id(task, row)
        answer, gold_lp = _lm_eval_answer(row)
        score = float(value)
        if not 0 <= score <= 1:
            raise ResultFileError(
                f"{path}:{row['_line']}: doc {row['doc_id']!r}: metric {chosen!r} = {score!r} is outside [0, 1]; "
                f"pick a per-item score in [0, 1] with --metric"
            )
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
                category=_category(row),
                metrics={"metric": chosen, "doc_id": row["doc_id"], "filter": flt},
            )
        )
    return records


def _category(row: dict) -> str:
    """The confusion category a task's ``cat_<name>`` metrics give the sample (kveval's probe tasks write one per
    category, 1.0 for the answer's own), or ``""`` where the task has none or they do not name exactly one."""
    named = [m[4:] for m in row.get("metrics", []) if isinstance(m, str) and m.startswith("cat_") and row.get(m) == 1]
    return named[0] if len(named) == 1 else ""


def _pick_metric(row: dict, path: Path) -> str:
    names = [m for m in row.get("metrics", []) if isinstance(m, str)]
    for m in LM_EVAL_METRICS:
        if m in names and isinstance(row.get(m), (int, float)):
            return m
    for m in names:
        if isinstance(row.get(m), (int, float)):
            return m
    raise ResultFileError(f"{path}: no scalar metric in {names}; pick one with --metric")




def _responses(row: dict) -> list:
    resps = row.get("filtered_resps")
    if resps is None:
        resps = [r[0] if isinstance(r, (list, tuple)) and r else r for r in row.get("resps", [])]
    return resps if isinstance(resps, list) else []


def _loglikelihoods(resps: list) -> list[float]:
    """Each choice's log-likelihood, where ``resps`` are loglikelihood responses; empty for generation."""
    lls = []
    for r in resps:
        if isinstance(r, (list, tuple)) and len(r) == 2 and _as_float(r[0]) is not None:  # tuples in memory, lists in JSON
            lls.append(_as_float(r[0]))
        else:
            return []
    return lls


def _lm_eval_answer(row: dict) -> tuple[str, float | None]:
    """The model's output as text and the gold continuation's log-likelihood (if a loglikelihood task)."""
    resps = _responses(row)
    if not resps:
        return "", None
    lls = _loglikelihoods(resps)
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
    conts = [second for _, second in _request_arguments(row)]
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
    fields = read_run_fields(config, margs)
    policy = fields.policy
    return RunInfo(
        name=path.name if path.is_dir() else path.stem,
        model=str(model),
        policy=policy,
        mode=fields.mode,
        family=policy.split("(")[0] if policy else "none",
        ratio=fields.ratio,
        bytes_per_token=fields.bytes_per_token,
        nominal_bytes_per_token=fields.nominal_bytes_per_token,
        kv_dtype=fields.kv_dtype,
        model_identity=fields.model_identity,
        extra={
            "source": "lm-eval",
            "lm_eval_model": config.get("model"),
            # what must agree between paired lm-eval runs besides the model name
            "revision": first("revision"),
            "tokenizer": first("tokenizer"),
            "hardware": fields.hardware,  # what pair_runs checks, as for kveval runs
        },
    )


# ----------------------------------------------------------------------------- pairing


def _ids(xs: Iterable[str], k: int = 5) -> str:
    xs = list(xs)
    shown = ", ".join(xs[:k])
    return shown + (f", ... ({len(xs) - k} more)" if len(xs) > k else "")


def _model_of(info: RunInfo) -> str:
    """``'smollm2-135m' (embedded:smollm2-135m@None, hash 6e985e12)``: a run's model and its recorded identity."""
    ident = info.model_identity
    return f"{info.model!r}" + (f" ({ident.get('source')}@{ident.get('revision')}, hash {ident.get('hash')})" if ident else "")


def pair_runs(baseline: Run, candidate: Run) -> list[tuple[ItemRecord, ItemRecord]]:
    """Pair two runs item by item, in the baseline's order.

    Raises
    ------
    ResultFileError
        Duplicate ids, items present in only one run, prompt-hash or task
        mismatches, different result formats, different models (their names, and their full recorded identities
        where both record one: source, revision, hash), different cache dtypes (where both
        record one), or runs computed on different hardware (``extra["hardware"]``, :func:`kveval.runner.evaluate.hardware_of`; runs that predate it pair as before).
    """
    if baseline.source != candidate.source:
        raise ResultFileError(
            f"cannot pair a {baseline.source} result ({baseline.path}) with a {candidate.source} result ({candidate.path})"
        )
    identities = [run.info.model_identity for run in (baseline, candidate)]
    if any(identities) and not all(identities):
        lacking, other = (baseline, candidate) if not identities[0] else (candidate, baseline)
        raise ResultFileError(
            f"{lacking.path} records no model identity, while {other.path} ran {_model_of(other.info)}: nothing shows "
            f"they ran one model; run both again with this kveval (run.json's model_identity)")
    if baseline.info.model != candidate.info.model or (all(identities) and identities[0] != identities[1]):
        raise ResultFileError(
            f"cannot pair runs of different models: baseline {_model_of(baseline.info)} ({baseline.path}) "
            f"vs candidate {_model_of(candidate.info)} ({candidate.path}); compare runs of one model"
        )
    hardware = [run.info.extra.get("hardware") for run in (baseline, candidate)]
    if all(hardware) and (hardware[0] != hardware[1] or hardware[0].startswith("mixed")):
        raise ResultFileError(
            f"cannot pair runs computed on different hardware: baseline {hardware[0]!r} ({baseline.path}) vs candidate "
            f"{hardware[1]!r} ({candidate.path}); float kernels round differently there, which would count as the "
            f"policy's effect: run both on one machine (kveval sweep runs a baseline with its candidates)"
        )
    dtypes = [run.info.kv_dtype for run in (baseline, candidate)]
    if all(dtypes) and dtypes[0] != dtypes[1]:
        raise ResultFileError(
            f"cannot pair runs with different cache dtypes: baseline {dtypes[0]} ({baseline.path}) vs candidate "
            f"{dtypes[1]} ({candidate.path}); the dtype's rounding would count as the policy's effect and its bytes "
            f"as the policy's compression: run both with one --kv-dtype"
        )
    if baseline.source == "lm-eval":
        for key in ("revision", "tokenizer"):
            a, b = baseline.info.extra.get(key), candidate.info.extra.get(key)
            if a != b:
                raise ResultFileError(
                    f"cannot pair lm-eval runs of different models: {key} {a!r} ({baseline.path}) vs {b!r} ({candidate.path})"
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
