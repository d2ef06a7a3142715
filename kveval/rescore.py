"""``kveval rescore``: score stored answers again with this version's scorer, without running a model.

Answers do not change when the scorer does (a confusion named more precisely, a value format read right), so
runs need not be computed again: each probe record's answer is scored against its item, and the record keeps
everything else (answer, bytes, timings) as it was. Two kinds of target:

- a sweep, given by its config (``kveval rescore configs/quickstart.yaml [--out DIR]``): the items are
  generated again from the config, every run folder of the sweep must hold all of them, and the sweep's report
  and gate are rebuilt, as ``kveval sweep`` does for a finished folder; its manifest records
  ``rescored_under`` (the code that scored);
- ``kveval eval`` run folders, or a folder holding them under ``runs/``, with the items file they were run on
  (``--items``, written by ``kveval probes`` with the eval's arguments).

Every probe record must match an item of the same id and prompt hash, in every run, before anything is written;
lm-eval records (scored by lm-eval) are kept as they are. Each rewritten ``items.jsonl`` is replaced atomically.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kveval.errors import ResultFileError, RunFolderError, UsageError
from kveval.records import ITEMS_FILE, RUN_FILE, ItemRecord, atomic_write_text, read_items


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
        ``(old category, new category)`` -> items whose score, correctness or category changed.
    """

    run_dir: Path
    records: list[ItemRecord]
    probe_items: int
    moves: Counter

    @property
    def changed(self) -> int:
        return sum(self.moves.values())

    def write(self) -> None:
        """Replace the run's ``items.jsonl`` (atomically), where anything changed."""
        if self.changed:
            atomic_write_text(self.run_dir / ITEMS_FILE,
                              "".join(json.dumps(asdict(r), sort_keys=True) + "\n" for r in self.records))


def rescore_run(run_dir: Path, items: dict, fix: str) -> RescoredRun:
    """Score ``run_dir``'s probe records again against ``items`` (id -> :class:`~kveval.probes.ProbeItem`).

    Raises :class:`~kveval.errors.ResultFileError` where a probe record's id is not among ``items``, or its item
    holds another prompt (hash); ``fix`` says how to give the right items."""
    from kveval.probes import score_answer

    records, moves, probes = [], Counter(), 0
    for record in read_items(run_dir):
        if "lm_eval_task" in record.metrics:  # scored by lm-eval's own metric
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
    return RescoredRun(Path(run_dir), records, probes, moves)


def describe(rescored: list[RescoredRun], verb: str = "change") -> str:
    """``"1 of 480 items change: fabricated -> distractor 1"`` over ``rescored``."""
    moves = sum((r.moves for r in rescored), Counter())
    total, changed = sum(r.probe_items for r in rescored), sum(moves.values())
    text = f"{changed} of {total} items {verb}"
    if moves:
        text += ": " + ", ".join(f"{old or '-'} -> {new} {n}" for (old, new), n in sorted(moves.items()))
    return text


# --- targets ----------------------------------------------------------------------------------------------------

def eval_run_dirs(folder: Path) -> list[Path]:
    """The run folders of ``folder``: itself where it is one, else ``runs/<model>/<run>`` below it."""
    if (folder / RUN_FILE).is_file():
        return [folder]
    found = sorted(p.parent for p in folder.glob(f"runs/*/*/{RUN_FILE}"))
    if not found:
        raise FileNotFoundError(f"{folder}: no such run folder (one holding {RUN_FILE}, or runs/<model>/<run>/ below it)")
    return found


def rescore_eval_folders(folders: list[Path], items_file: Path) -> list[RescoredRun]:
    """``kveval eval`` run folders scored again against the items of ``items_file``."""
    from kveval.probes.cli import read_probe_items

    if not items_file.is_file():
        raise FileNotFoundError(f"{items_file}: no such items file; write it with kveval probes, with the eval's "
                                f"family, length, n, depth and seed arguments")
    try:
        items = {item.id: item for item in read_probe_items(items_file)}
    except UnicodeDecodeError:
        raise ResultFileError(f"{items_file}: not a probe item file (not UTF-8 text); write it with kveval probes") from None
    fix = ("give the items file they were run on (kveval probes with the eval's family, length, n, depth and seed "
           "arguments, and its --model)")
    run_dirs = [run_dir for folder in folders for run_dir in eval_run_dirs(folder)]
    return [rescore_run(run_dir, items, fix) for run_dir in dict.fromkeys(run_dirs)]


def rescore_sweep(config, out: Path) -> tuple[list[Path], list[RescoredRun]]:
    """A finished sweep's run folders (in :func:`~kveval.sweep.run_sweep`'s order) scored again against the items
    its config generates; refused where ``out`` holds another config's sweep or an unfinished one."""
    from kveval.models import load_tokenizer
    from kveval.sweep import read_manifest, sweep_items, sweep_run_dirs

    if read_manifest(out, config) is None:
        raise RunFolderError(f"{out}: no sweep of {config.name} here (no manifest); give the folder it ran into with --out")
    run_dirs = sweep_run_dirs(config, out)
    fix = f"{out} holds answers to other items than {config.name}'s config generates here (another tokenizer or kveval version); run it again with kveval sweep --out to a new folder"
    rescored, items_of = [], {}
    for run_dir in run_dirs:
        model = run_dir.parent.name
        if model not in items_of:
            tokenizer = load_tokenizer(_model_of(config, run_dir))
            items_of[model] = {item.id: item for item in sweep_items(config, tokenizer)}
        items = items_of[model]
        if not (run_dir / ITEMS_FILE).is_file():
            raise RunFolderError(f"{run_dir}: not run yet; finish the sweep with kveval sweep first")
        run = rescore_run(run_dir, items, fix)
        held = {r.id for r in run.records}
        if not set(items) <= held:
            raise RunFolderError(f"{run_dir}: holds {len(held & set(items))} of {len(items)} items; finish the sweep "
                                 f"with kveval sweep first")
        rescored.append(run)
    return run_dirs, rescored


def _model_of(config, run_dir: Path) -> str:
    """The config's model whose runs ``run_dir`` holds."""
    from kveval.evaluate import model_folder, model_identity

    return next(m for m in config.models if model_folder(model_identity(m)) == run_dir.parent.name)


# --- the command ------------------------------------------------------------------------------------------------

def configure(parser) -> None:
    parser.add_argument("target", nargs="+",
                        help="a sweep config (its folder rescored, its report and gate rebuilt), or kveval eval run "
                             "folders (with --items)")
    parser.add_argument("--out", help="the sweep's folder (default: the config's `out`, else runs/<name>)")
    parser.add_argument("--items", help="items file the run folders were run on (kveval probes, with the eval's arguments)")
    parser.add_argument("--dry-run", action="store_true", help="say what would change; write nothing")
    parser.add_argument("--strict", action="store_true", help="a sweep: exit with the gate's code (1 FAIL, 3 INCONCLUSIVE)")


def run(args) -> int:
    targets = [Path(t) for t in args.target]
    if len(targets) == 1 and targets[0].is_file():
        if args.items:
            raise UsageError("--items is for kveval eval run folders; a sweep's items come from its config")
        return _run_sweep(targets[0], args)
    for target in targets:
        if (target / "manifest.json").is_file():
            raise UsageError(f"{target} is a sweep folder: give its config (kveval rescore CONFIG.yaml --out {target}), "
                             f"so the items come from it and its report and gate are rebuilt")
        if target.is_file() or target.suffix in (".yaml", ".yml"):
            raise UsageError(f"{target}: give one sweep config alone, or run folders")
    if not args.items:
        raise UsageError("run folders need --items: the items file they were run on (kveval probes with the eval's "
                         "family, length, n, depth and seed arguments)")
    rescored = rescore_eval_folders(targets, Path(args.items))
    _report(rescored, args.dry_run)
    return 0


def _run_sweep(config_path: Path, args) -> int:
    import sys

    from kveval.sweep import load_config, read_manifest, running_code, summarize, sweep_lock

    config = load_config(config_path)
    out = Path(args.out or config.out or Path("runs") / config.name)
    if not out.is_dir():
        raise FileNotFoundError(f"{out}: no such sweep folder; give the folder it ran into with --out")
    with sweep_lock(out):
        run_dirs, rescored = rescore_sweep(config, out)
        _report(rescored, args.dry_run)
        if args.dry_run:
            return 0
        manifest = read_manifest(out, config)
        manifest["rescored_under"] = running_code()
        atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True))
        code = summarize(out, run_dirs, config.gate)
    print(f"kveval rescore: {out} rescored; its report and gate are rebuilt", file=sys.stderr)
    return code if args.strict else (2 if code == 2 else 0)


def _report(rescored: list[RescoredRun], dry_run: bool) -> None:
    """Print each run's changes and the total; write them (every run checked first) unless ``dry_run``."""
    verb = "would change (dry run: nothing written)" if dry_run else "change"
    for run in rescored:
        print(f"{run.run_dir}: {describe([run], verb)}")
    print(f"in all, {describe(rescored, verb)}")
    if not dry_run:
        for run in rescored:
            run.write()


__all__ = ["RescoredRun", "describe", "eval_run_dirs", "rescore_eval_folders", "rescore_run", "rescore_sweep"]
