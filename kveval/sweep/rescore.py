"""Stored answers scored again with this version's scorer, without running a model (``kveval rescore``).

Answers do not change when the scorer does (a confusion named more precisely, a value format read right), so
runs need not be computed again: each probe record's answer is scored against its item, and the record keeps
everything else (answer, bytes, timings) as it was. Two kinds of target:

- a finished sweep (:func:`rescore_sweep`): the items are generated again from its config, and every run folder of
  the sweep must hold all of them;
- ``kveval eval`` run folders (:func:`rescore_eval_folders`): their items generated again from the probe sets each
  run recorded (``extra.probe_sets``), or read from an items file written by ``kveval probes``.

Every probe record must match an item of the same id and prompt hash, in every run, before anything is written;
lm-eval records (scored by lm-eval) are kept as they are. :meth:`RescoredRun.write` replaces an ``items.jsonl``
atomically. The command (:mod:`kveval.commands.rescore`) parses arguments, prints and rebuilds a sweep's report
and gate.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from kveval.errors import ResultFileError, RunFolderError, UsageError
from kveval.modeling.sources import load_tokenizer
from kveval.probes import score_answer
from kveval.probes.item import read_probe_items
from kveval.probes.sets import ProbeSet
from kveval.runs.records import ITEMS_FILE, RUN_FILE, ItemRecord, read_items, read_run_info, replace_items
from kveval.runs.ownership import MANIFEST_FILE
from kveval.sweep.run import sweep_items, sweep_runs, unfinished


@dataclass(frozen=True)
class RescoredRun:
    """One run folder's records scored again (not yet written).

    Attributes
    ----------
    run_dir : Path
    records : list of ItemRecord
        Every record of ``items.jsonl``, in its order: probe records with their new score, correctness, category
        and recalled values, lm-eval records as they were.
    probe_items : int
        How many records are probe items (scored again).
    moves : Counter
        ``(old category, new category)`` -> items whose score, correctness, category or recalled values changed.
    lm_eval_probe_records : int
        Records of kveval's own probe tasks run through lm-eval (``kveval_*``): scored by ``tasks/utils.py`` when
        lm-eval ran them, kept as they are (their items are lm-eval's documents, not the sweep's).
    """

    run_dir: Path
    records: list[ItemRecord]
    probe_items: int
    moves: Counter
    lm_eval_probe_records: int = 0

    @property
    def changed(self) -> int:
        return sum(self.moves.values())

    def write(self) -> None:
        """Replace the run's ``items.jsonl`` (atomically), where anything changed."""
        if self.changed:
            replace_items(self.run_dir, self.records)


def rescore_run(run_dir: Path, items: dict, fix: str) -> RescoredRun:
    """Score ``run_dir``'s probe records again against ``items`` (id -> :class:`~kveval.probes.ProbeItem`).

    Raises :class:`~kveval.errors.ResultFileError` where a probe record's id is not among ``items``, or its item
    holds another prompt (hash); ``fix`` says how to give the right items."""
    records, moves, probes, own_tasks = [], Counter(), 0, 0
    for number, record in enumerate(read_items(run_dir), start=1):
        wrong = [name for name, kind in (("hash", str), ("answer", str), ("metrics", dict))
                 if not isinstance(getattr(record, name), kind)]
        if wrong:
            raise ResultFileError(f"{run_dir / ITEMS_FILE}:{number}: {', '.join(wrong)} of the wrong type; not a kveval "
                                  f"items file, or a damaged one: rerun that run to rewrite it")
        if "lm_eval_task" in record.metrics:  # scored when lm-eval ran
            own_tasks += str(record.metrics["lm_eval_task"]).startswith("kveval_")
            records.append(record)
            continue
        item = items.get(record.id)
        if item is None:
            raise ResultFileError(f"{run_dir}: item {record.id} is not among the items given; {fix}")
        if item.hash != record.hash:
            raise ResultFileError(f"{run_dir}: item {record.id} was run on another prompt (hash {record.hash[:12]}, "
                                  f"the items given hold {item.hash[:12]}); {fix}")
        score = score_answer(item, record.answer)
        new = replace(record, score=score.score, correct=score.correct, category=score.category,
                      recalled=score.recalled)
        if (new.score, new.correct, new.category, new.recalled) != (record.score, record.correct, record.category,
                                                                     record.recalled):
            moves[(record.category, new.category)] += 1
        records.append(new)
        probes += 1
    return RescoredRun(Path(run_dir), records, probes, moves, own_tasks)


def describe(rescored: list[RescoredRun], verb: str = "change") -> str:
    """``"1 of 480 items change: fabricated -> distractor 1"`` over ``rescored``."""
    moves = sum((r.moves for r in rescored), Counter())
    total, changed = sum(r.probe_items for r in rescored), sum(moves.values())
    text = f"{changed} of {total} items {verb}"
    if moves:
        text += ": " + ", ".join(f"{old or '-'} -> {new} {n}" for (old, new), n in sorted(moves.items()))
    return text


def eval_run_dirs(folder: Path) -> list[Path]:
    """The run folders of ``folder``: itself where it is one, else ``runs/<model>/<run>`` below it."""
    if (folder / RUN_FILE).is_file():
        return [folder]
    found = sorted(p.parent for p in folder.glob(f"runs/*/*/{RUN_FILE}"))
    if not found:
        raise FileNotFoundError(f"{folder}: no such run folder (one holding {RUN_FILE}, or runs/<model>/<run>/ below it)")
    return found


def _sweep_remedy(run_dir: Path) -> str:
    """How to rescore a sweep's run: from the config, in the sweep folder holding it (``<sweep>/runs/<model>/<run>``
    with its manifest), or, for a run copied out of its sweep, in the sweep's own folder."""
    folder = run_dir.parent.parent.parent
    if run_dir.parent.parent.name == "runs" and (folder / MANIFEST_FILE).is_file():
        return f"rescore the sweep from its config (kveval rescore CONFIG.yaml --out {folder})"
    return (f"it is not inside its sweep's folder (no {folder.absolute() / MANIFEST_FILE}): rescore the "
            f"sweep from its config in the folder it ran into (kveval rescore CONFIG.yaml --out SWEEP_FOLDER)")


def rescore_eval_folders(folders: list[Path], items_file: Path | None) -> list[RescoredRun]:
    """``kveval eval`` run folders scored again against their items: those of ``items_file``, else generated again
    from the probe sets each run recorded (``extra.probe_sets``, written by ``kveval eval``). A sweep's run is
    refused (its lock, report and gate go with the sweep: :func:`rescore_sweep`)."""
    run_dirs = list(dict.fromkeys(run_dir for folder in folders for run_dir in eval_run_dirs(folder)))
    recorded = {}
    for run_dir in run_dirs:
        info = read_run_info(run_dir)
        sweep = info.extra.get("sweep")
        if sweep is not None:
            raise RunFolderError(f"{run_dir} is a run of the sweep {sweep}: {_sweep_remedy(run_dir)}")
        sets = info.extra.get("probe_sets")
        if items_file is None and not sets:
            raise UsageError(f"{run_dir} records no probe set (a kveval eval run from before they were recorded): "
                             f"give --items, the items file it was run on (kveval probes with the eval's family, "
                             f"length, n, depth and seed arguments)")
        recorded[run_dir] = [ProbeSet.from_dict(s, str(run_dir / RUN_FILE)) for s in sets or []]
    if items_file is not None:
        if not items_file.is_file():
            raise FileNotFoundError(f"{items_file}: no such items file; write it with kveval probes, with the eval's "
                                    f"family, length, n, depth and seed arguments")
        try:
            given = {item.id: item for item in read_probe_items(items_file)}
        except UnicodeDecodeError:
            raise ResultFileError(f"{items_file}: not a probe item file (not UTF-8 text); write it with kveval probes") from None
        fix = ("give the items file they were run on (kveval probes with the eval's family, length, n, depth and "
               "seed arguments, and its --model)")
        return [rescore_run(run_dir, given, fix) for run_dir in run_dirs]
    generated, out = {}, []
    for run_dir in run_dirs:
        items = {}
        for probe_set in recorded[run_dir]:
            key = repr(probe_set)
            if key not in generated:
                generated[key] = probe_set.items(load_tokenizer(probe_set.tokenizer))
            items.update((item.id, item) for item in generated[key])
        fix = ("its recorded probe sets generate other items here (another tokenizer or kveval version); give "
               "--items, the items file it was run on")
        out.append(rescore_run(run_dir, items, fix))
    return out


def rescore_sweep(config, out: Path) -> tuple[list[Path], list[RescoredRun], dict]:
    """A finished sweep's run folders (in :func:`~kveval.sweep.run.run_sweep`'s order) scored again against the items
    its config generates, and those items by prompt hash (for the rebuilt report's item views); refused where
    ``out`` holds another config's sweep or an unfinished one (:func:`~kveval.sweep.run.unfinished`: every item,
    lm-eval task and fidelity record)."""
    fix = (f"{out} holds answers to other items than {config.name}'s config generates here (another tokenizer or "
           f"kveval version); run it again with kveval sweep --out to a new folder")
    runs, items_of = sweep_runs(config, out), {}
    for model, spec, run_dir in runs:
        if model not in items_of:
            items_of[model] = sweep_items(config, load_tokenizer(model))
        reason = unfinished(config, spec, run_dir, items_of[model])
        if reason:
            raise RunFolderError(f"{run_dir}: {reason}; finish the sweep with kveval sweep first")
    rescored = [rescore_run(run_dir, {item.id: item for item in items_of[model]}, fix) for model, _, run_dir in runs]
    probes = {item.hash: item for items in items_of.values() for item in items}
    return [run_dir for _, _, run_dir in runs], rescored, probes


__all__ = ["RescoredRun", "describe", "eval_run_dirs", "rescore_eval_folders", "rescore_run", "rescore_sweep"]
