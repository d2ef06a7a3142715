"""One validation of runs and items, shared by every reader: what a comparison, a gate or a report may use.

A run read back is refused, in one line naming the file and the item, where its items contradict themselves or
what kveval writes: ids and tasks that are not strings, scores outside [0, 1] or not numbers, a ``correct`` that is
no boolean or says otherwise than its score, a category outside the taxonomy, a byte count below 0; and where its
``run.json`` holds fields of the wrong type. Every loader (:func:`kveval.runs.results.load_run`) calls these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from kveval.runs.records import BYTE_COUNTS, CATEGORIES, ItemRecord, ResultFileError, RunInfo
from kveval.values import is_real


def validate_items(items: Sequence[ItemRecord], source: Path | str) -> None:
    """Refuse, with one line naming ``source`` and the item, what a comparison cannot use.

    Ids must be strings, scores finite numbers in [0, 1], ``correct`` a JSON boolean (``"false"`` as a string
    would read as true) that says what the score says (an item is right exactly when its score is 1, the rule of
    every task kveval scores), the category one of the taxonomy's (:data:`~kveval.runs.records.CATEGORIES`, or
    ``""`` for a task without it) and every byte count (:data:`~kveval.runs.records.BYTE_COUNTS`) a number >= 0.
    """
    for number, it in enumerate(items, start=1):
        where = f"{source}: item {number}"
        if not isinstance(it.id, str) or not it.id:
            raise ResultFileError(f"{where}: id {it.id!r} is not a non-empty string; item ids are strings such as \"passkey/3\"")
        where = f"{source}: item {it.id!r}"
        score = it.score
        if not is_real(score) or not 0 <= score <= 1:
            raise ResultFileError(f"{where}: score {score!r} is not a number in [0, 1]")
        if not isinstance(it.correct, bool):
            raise ResultFileError(f"{where}: correct {it.correct!r} is not a boolean (true or false, not a string or number)")
        if it.correct != (score == 1):
            raise ResultFileError(f"{where}: correct {str(it.correct).lower()} with score {score!r}; an item is "
                                  f"correct exactly when its score is 1: the file was edited or is corrupt")
        if not isinstance(it.task, str) or not it.task:
            raise ResultFileError(f"{where}: task {it.task!r} is not a non-empty string")
        if it.category != "" and it.category not in CATEGORIES:
            raise ResultFileError(f"{where}: category {it.category!r} is not one of the taxonomy's "
                                  f"({', '.join(CATEGORIES)})")
        metrics = it.metrics if isinstance(it.metrics, dict) else {}
        for key in BYTE_COUNTS:
            value = metrics.get(key)
            if value is not None and not (is_real(value) and value >= 0):
                raise ResultFileError(f"{where}: {key} {value!r} is not a byte count (a number >= 0)")


def validate_run_info(info: RunInfo, source: Path | str) -> None:
    """Refuse a ``run.json`` a comparison cannot use (one line naming ``source``): names that are not non-empty
    strings, a mode other than ``context``/``query``, fields of another type, byte counts that are not numbers >= 0."""
    for key, value in (("name", info.name), ("model", info.model), ("policy", info.policy), ("family", info.family)):
        if not isinstance(value, str) or not value:
            raise ResultFileError(f"{source}: {key} {value!r} is not a non-empty string")
    if info.mode not in ("context", "query"):
        raise ResultFileError(f"{source}: mode {info.mode!r} is neither context nor query")
    if info.kv_dtype is not None and not isinstance(info.kv_dtype, str):
        raise ResultFileError(f"{source}: kv_dtype {info.kv_dtype!r} is not a dtype name")
    for key, value in (("model_identity", info.model_identity), ("extra", info.extra)):
        if not isinstance(value, dict):
            raise ResultFileError(f"{source}: {key} {value!r} is not a JSON object")
    if info.ratio is not None and not (is_real(info.ratio) and 0 <= info.ratio < 1):
        raise ResultFileError(f"{source}: ratio {info.ratio!r} is not a fraction in [0, 1)")
    for key, value in (("bytes_per_token", info.bytes_per_token),
                       ("nominal_bytes_per_token", info.nominal_bytes_per_token)):
        if value is not None and not (is_real(value) and value >= 0):
            raise ResultFileError(f"{source}: {key} {value!r} is not a byte count (a number >= 0)")


__all__ = ["validate_items", "validate_run_info"]
