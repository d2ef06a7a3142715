"""The probe items run folders were run on, generated again from what the runs recorded, for the report's item view.

``items.jsonl`` keeps each item's answer, gold and prompt hash, not its context, question or needles: those are
deterministic for the run's probe set and tokenizer (:mod:`kveval.probes.sets`), so they are generated again
here. A run of a sweep takes its set from the sweep's ``manifest.json`` (its config's ``probes``), a ``kveval eval``
run from ``run.json`` (``extra.probe_sets``). Items are keyed by prompt hash, so an item is only ever shown beside
the record of the very prompt it was run on; a run whose set cannot be generated here (no tokenizer, no recorded
set) gets a note instead of items.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kveval.errors import KvevalError
from kveval.modeling.sources import load_tokenizer as named_tokenizer
from kveval.probes.sets import ProbeSet
from kveval.runs.records import RUN_FILE, read_run_info
from kveval.runs.ownership import MANIFEST_FILE


@dataclass
class RecordedItems:
    """Probe items by prompt hash, and one note per run folder whose items could not be generated again."""

    items: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def manifest_probe_set(sweep_dir: Path, model: str) -> ProbeSet | None:
    """The probe set of the sweep in ``sweep_dir`` for ``model``'s tokenizer (``None``: no readable manifest there)."""
    try:
        config = json.loads((sweep_dir / MANIFEST_FILE).read_text(encoding="utf-8"))["config"]
        probes = config.get("probes") or {}
        return ProbeSet(tokenizer=model, families=list(probes.get("families") or ["passkey"]),
                        lengths=list(probes.get("lengths") or [512]), n=int(probes.get("n", 10)),
                        depths=probes.get("depths"), seed=int(probes.get("seed", config.get("seed", 0))),
                        params=dict(probes.get("params") or {}))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def probe_sets_of(run_dir: Path) -> list[ProbeSet]:
    """The probe sets ``run_dir`` records: its sweep's (``runs/<model>/<run>`` below the manifest), else
    ``extra.probe_sets``; empty for an lm-eval run or one that records none."""
    if not (run_dir / RUN_FILE).is_file():
        return []
    info = read_run_info(run_dir)
    if info.extra.get("sweep") is not None:
        found = manifest_probe_set(run_dir.parent.parent.parent, info.model)
        return [found] if found else []
    return [ProbeSet.from_dict(s, str(run_dir / RUN_FILE)) for s in info.extra.get("probe_sets") or []]


def recorded_probe_items(run_dirs: Sequence[Path], load_tokenizer: Callable | None = None) -> RecordedItems:
    """Every item the kveval runs among ``run_dirs`` recorded a probe set for, generated again (each set once).

    ``load_tokenizer`` (default :func:`kveval.modeling.sources.load_tokenizer`) loads a set's tokenizer by name;
    one that fails leaves a note naming the run and why, not an error: the report is still written.
    """
    if load_tokenizer is None:
        load_tokenizer = named_tokenizer
    out, generated = RecordedItems(), {}
    for run_dir in run_dirs:
        try:
            sets = probe_sets_of(Path(run_dir))
        except KvevalError as exc:
            out.notes.append(f"{run_dir}: no prompts shown ({exc})")
            continue
        for probe_set in sets:
            key = repr(probe_set)
            if key not in generated:
                try:
                    generated[key] = probe_set.items(load_tokenizer(probe_set.tokenizer))
                except (KvevalError, OSError, ValueError) as exc:
                    generated[key] = []
                    out.notes.append(f"{run_dir}: its prompts could not be generated again ({str(exc).splitlines()[0]})")
            out.items.update((item.hash, item) for item in generated[key])
    return out


__all__ = ["RecordedItems", "manifest_probe_set", "probe_sets_of", "recorded_probe_items"]
