"""Verdicts are derived, never trusted: a ``gate.json`` read back is checked against the verdicts its runs give now.

``kveval report --gate`` and ``kveval memory --gate`` show a gate's verdicts beside other numbers. A verdict is
shown only where the runs it names, judged again under the gate config the file records, give the same verdict:
an edited status (``FAIL`` to ``PASS``, or to ``"LGTM"``), an edited reason or a run changed since are refused in
one line naming the first difference. ``gate.json`` also carries a digest of its own content
(:data:`VERDICTS_DIGEST`), so that an edit is named as such even where its runs cannot be found.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from kveval.errors import ResultFileError
from kveval.gate.config import load_gate_config
from kveval.gate.rules import evaluate_gate
from kveval.runs.results import Run

#: The key of ``gate.json`` that holds the SHA-256 of the rest of the file (canonical JSON).
VERDICTS_DIGEST = "verdicts_sha256"


def verdicts_digest(data: Mapping[str, Any]) -> str:
    """The SHA-256 of a gate file's content, :data:`VERDICTS_DIGEST` aside, as canonical JSON."""
    body = {k: v for k, v in data.items() if k != VERDICTS_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its digest (:func:`verdicts_digest`) added, as :func:`kveval.gate.report.write_gate_outputs`
    writes it."""
    return {**data, VERDICTS_DIGEST: verdicts_digest(data)}


def read_gate_file(where: str | os.PathLike) -> tuple[dict[str, Any], Path]:
    """``gate.json`` at ``where`` (the file, or the folder holding it) and its path; refused in one line where it is
    missing, not JSON, or not a gate's result."""
    path = Path(where)
    if path.is_dir():
        path = path / "gate.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ResultFileError(f"{path}: no gate result ({type(exc).__name__}); give the folder kveval gate --out (or a "
                              f"sweep's gate/) wrote, or its gate.json") from exc
    except ValueError as exc:
        raise ResultFileError(f"{path}: corrupt gate result ({exc}); run kveval gate again to rebuild it") from exc
    if not isinstance(data, dict) or not isinstance(data.get("results", data.get("candidates")), list):
        raise ResultFileError(f"{path}: not a gate result (no results); give the gate.json kveval gate wrote")
    return data, path


def gate_results(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The per-baseline results of a gate file (a one-model gate writes one result at the top level)."""
    return list(data["results"]) if "results" in data else [dict(data)]


def judged_models(data: Mapping[str, Any]) -> list[str]:
    """The models a gate file judged, in its order."""
    return [str((r.get("baseline") or {}).get("model")) for r in gate_results(data)]


def locate_run(recorded: str, gate_file: Path) -> Path | None:
    """The run folder a gate file recorded as ``recorded``: as written (relative to the working folder, where the
    gate ran), else the longest tail of it found beside the gate's folder (a sweep's ``<out>/gate/gate.json`` names
    ``<out>/runs/<model>/<policy>``, wherever ``<out>`` has been copied or moved)."""
    path = Path(recorded)
    if (path / "run.json").is_file() or path.is_file():
        return path
    parts = path.parts
    for root in (gate_file.parent, gate_file.parent.parent):
        for k in range(1, len(parts)):
            candidate = root.joinpath(*parts[k:])
            if (candidate / "run.json").is_file():
                return candidate
    return None


def check_gate_file(data: Mapping[str, Any], source: Path, runs: Mapping[str, Run | Path] | None = None) -> None:
    """Refuse (:class:`ResultFileError`, one line) a gate file whose verdicts are not what its runs give now.

    Each result is judged again: its recorded config (a sequential one replays its looks from the runs) over its
    baseline and candidates (``runs``: loaded runs or
    folders by run name, as a report holds them; else the folders the file records, :func:`locate_run`) and its
    noise floor where one was measured. The overall status, each candidate's status and reasons and each task's
    status must equal the recorded ones; then the file's digest must match its content (an edit no verdict shows).
    """
    runs = dict(runs or {})
    results = gate_results(data)
    known_tasks = sorted({t for r in results for t in r.get("tasks") or []})
    for recorded in results:
        fresh = _judge_again(recorded, source, runs, known_tasks).to_dict()
        difference = _first_difference(recorded, fresh)
        if difference:
            raise ResultFileError(f"{source}: {difference}; the gate file does not match its runs: run kveval gate "
                                  f"(or kveval rescore for a sweep) again to rebuild it")
    statuses = [r.get("status") for r in results]
    if "results" in data and data.get("status") not in statuses:
        raise ResultFileError(f"{source}: overall status {data.get('status')!r} is none of its results' "
                              f"({', '.join(map(str, statuses))}); run kveval gate again to rebuild it")
    # Last: what the runs decide is named above as a difference; an edit that changes no verdict (a note, a bound)
    # is caught here.
    recorded_digest = data.get(VERDICTS_DIGEST)
    if recorded_digest is not None and recorded_digest != verdicts_digest(data):
        raise ResultFileError(f"{source}: edited after kveval wrote it (its {VERDICTS_DIGEST} does not match its "
                              f"content); run kveval gate again to rebuild it")


def _judge_again(recorded: Mapping[str, Any], source: Path, runs: dict[str, Run | Path], known_tasks: list[str]):
    def find(name: str | None, path: str | None, what: str):
        if name in runs:
            return runs[name]
        found = locate_run(path, source) if path else None
        if found is None:
            raise ResultFileError(f"{source}: the {what} run {name or path!r} it judged is not found; give the run "
                                  f"folders it judged, or run kveval gate again")
        return found

    baseline = recorded.get("baseline") or {}
    base = find(baseline.get("name"), recorded.get("baseline_path"), "baseline")
    candidates = [find(c.get("name"), c.get("path"), "candidate") for c in recorded.get("candidates") or []]
    floor = recorded.get("noise_floor_path")
    floor_dir = (locate_run(floor, source) if floor else None)
    if floor and floor_dir is None:
        raise ResultFileError(f"{source}: the noise-floor run {floor!r} it judged with is not found; run kveval gate "
                              f"again")
    try:
        config = load_gate_config(recorded.get("config") or {})
    except (ValueError, TypeError) as exc:
        raise ResultFileError(f"{source}: its recorded gate config does not load ({exc}); run kveval gate again") from exc
    return evaluate_gate(config, base, candidates, known_tasks=known_tasks, noise_floor=floor_dir)


def _first_difference(recorded: Mapping[str, Any], fresh: Mapping[str, Any]) -> str | None:
    """The first verdict in ``recorded`` that the runs do not give (``fresh``), in words; ``None`` where all agree."""
    model = (recorded.get("baseline") or {}).get("model")
    if recorded.get("status") != fresh.get("status"):
        return f"{model}: status {recorded.get('status')!r} recorded, the runs give {fresh.get('status')!r}"
    old, new = recorded.get("candidates") or [], fresh.get("candidates") or []
    if len(old) != len(new):
        return f"{model}: {len(old)} candidates recorded, {len(new)} judged again"
    for a, b in zip(old, new):
        name = a.get("name")
        for key in ("name", "status", "reasons", "error", "sequential"):  # a sequential gate's looks replayed too
            if a.get(key) != b.get(key):
                return f"candidate {name}: {key} {a.get(key)!r} recorded, the runs give {b.get(key)!r}"
        tasks_a, tasks_b = a.get("tasks") or [], b.get("tasks") or []
        if [t.get("task") for t in tasks_a] != [t.get("task") for t in tasks_b]:
            return f"candidate {name}: tasks {[t.get('task') for t in tasks_a]} recorded, the runs give " \
                   f"{[t.get('task') for t in tasks_b]}"
        for ta, tb in zip(tasks_a, tasks_b):
            for key in ("status", "reasons"):
                if ta.get(key) != tb.get(key):
                    return f"candidate {name}, task {ta.get('task')}: {key} {ta.get(key)!r} recorded, the runs give " \
                           f"{tb.get(key)!r}"
    return None
