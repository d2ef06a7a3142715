"""The fidelity file of a candidate run folder: ``fidelity.jsonl``, one :class:`FidelityItem` per line.

Written by :func:`kveval.runner.fidelity.record_fidelity` (the teacher-forced measurement), read back and joined
to the candidate's items here, summarized by :mod:`kveval.stats.fidelity`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from kveval.errors import ResultFileError

#: Per-candidate file of per-item fidelity measurements, next to ``items.jsonl``.
FIDELITY_FILE = "fidelity.jsonl"
#: Key of an item's fidelity measurements in ``ItemRecord.metrics`` once attached.
METRIC_KEY = "fidelity"
#: Per-item fields summarized by :func:`summarize`, in display order.
FIELDS = ("kl_mean", "kl_max", "top1_agreement", "answer_logprob_delta")



@dataclass
class FidelityItem:
    """One item's teacher-forced comparison of a candidate with the baseline.

    Attributes
    ----------
    id, hash, task : str
        The item (as in ``items.jsonl``; ``hash`` is the prompt hash).
    positions : int
        Answer positions compared (baseline answer tokens, EOS included).
    kl_mean, kl_max : float
        Mean and largest per-position ``KL(baseline || candidate)``, nats.
    top1_agreement : float
        Share of positions whose argmax tokens agree, in [0, 1].
    baseline_logprob, candidate_logprob : float
        Log-probability (nats) of the baseline answer under each model.
    answer_logprob_delta : float
        ``candidate_logprob - baseline_logprob``.
    """

    id: str
    hash: str
    task: str
    positions: int
    kl_mean: float
    kl_max: float
    top1_agreement: float
    baseline_logprob: float
    candidate_logprob: float
    answer_logprob_delta: float



def read_fidelity(run_dir: str | os.PathLike) -> dict[str, FidelityItem]:
    """``{item id: FidelityItem}`` of a candidate run folder (empty when it has no ``fidelity.jsonl``).

    A half-written last line (a killed run) is ignored; any other bad line is
    a :class:`ResultFileError` naming the file and line.
    """
    path = Path(run_dir) / FIDELITY_FILE
    out: dict[str, FidelityItem] = {}
    if not path.is_file():
        return out
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = FidelityItem(**json.loads(line))
        except (ValueError, TypeError) as exc:
            if number == len(lines) and not path.read_text().endswith("\n"):
                break  # the line a killed run was writing: measured again on resume
            raise ResultFileError(f"{path}:{number}: not a fidelity record ({exc}); delete the file to measure again") from None
        out[item.id] = item
    return out



def cut_partial_line(path: Path) -> None:
    """Drop a half-written last line (a killed run's) so that appending continues on a line of its own."""
    if path.is_file():
        text = path.read_text()
        if text and not text.endswith("\n"):
            path.write_text(text[: text.rfind("\n") + 1])



def attach_fidelity(run_dir: str | os.PathLike, records: Iterable) -> int:
    """Put each record's fidelity numbers (``fidelity.jsonl`` in ``run_dir``) into ``record.metrics["fidelity"]``.

    Only records whose prompt hash matches are joined. Returns how many were.
    """
    found = read_fidelity(run_dir) if Path(run_dir).is_dir() else {}
    joined = 0
    for record in records:
        item = found.get(record.id)
        if item is not None and item.hash == record.hash:
            record.metrics[METRIC_KEY] = {k: getattr(item, k) for k in FIELDS}
            joined += 1
    return joined


