"""``kveval rescore``: score stored answers again with this version's scorer, without running a model.

Answers do not change when the scorer does (a confusion named more precisely, a value format read right), so
runs need not be computed again: each probe record's answer is scored against its item, and the record keeps
everything else (answer, bytes, timings) as it was. Two kinds of target:

- a sweep, given by its config (``kveval rescore configs/quickstart.yaml [--out DIR]``): the items are
  generated again from the config, every run folder of the sweep must hold all of them, and the sweep's report
  and gate are rebuilt, as ``kveval sweep`` does for a finished folder; its manifest records
  ``rescored_under`` (the code that scored);
- ``kveval eval`` run folders, or a folder holding them under ``runs/``: their items generated again from the
  probe sets each run recorded (``extra.probe_sets``), or read from ``--items`` (written by ``kveval probes``
  with the eval's arguments; runs from before probe sets were recorded need it).

Every probe record must match an item of the same id and prompt hash, in every run, before anything is written;
lm-eval records (scored by lm-eval) are kept as they are. Each rewritten ``items.jsonl`` is replaced atomically.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kveval.deployment import add_deployment_arguments, deployment_of
from kveval.errors import UsageError
from kveval.runs.records import atomic_write_text
from kveval.gate.config import shipped_gate_configs
from kveval.sweep.config import load_config, with_gate
from kveval.sweep.rescore import RescoredRun, describe, rescore_eval_folders, rescore_sweep
from kveval.runs.ownership import MANIFEST_FILE
from kveval.sweep.run import read_manifest, running_code, summarize, sweep_lock


def configure(parser) -> None:
    parser.add_argument("target", nargs="+",
                        help="a sweep config (its folder rescored, its report and gate rebuilt), or kveval eval run "
                             "folders (with --items)")
    parser.add_argument("--out", help="the sweep's folder (default: the config's `out`, else runs/<name>)")
    parser.add_argument("--items", help="items file the run folders were run on (kveval probes, with the eval's "
                                        "arguments); default: the probe sets each run recorded")
    parser.add_argument("--dry-run", action="store_true", help="say what would change; write nothing")
    parser.add_argument("--strict", action="store_true", help="a sweep: exit with the gate's code (1 FAIL, 3 INCONCLUSIVE)")
    parser.add_argument("--gate", metavar="NAME|PATH",
                        help=f"a sweep: rebuild its gate with this gate config instead of the config's `gate:` (a name "
                             f"kveval ships: {', '.join(shipped_gate_configs())}; or a path)")
    add_deployment_arguments(parser)  # the gate is rebuilt: ask its deployment question again, as the sweep did


def run(args) -> int:
    targets = [Path(t) for t in args.target]
    configs = [t for t in targets if t.suffix in (".yaml", ".yml") or t.is_file()]
    if configs:
        if len(targets) > 1:
            raise UsageError("give one sweep config alone, or run folders (with --items)")
        if not targets[0].is_file():
            raise FileNotFoundError(f"{targets[0]}: no such sweep config")
        if args.items:
            raise UsageError("--items is for kveval eval run folders; a sweep's items come from its config")
        return _run_sweep(targets[0], args)
    for target in targets:
        if (target / MANIFEST_FILE).is_file():
            raise UsageError(f"{target} is a sweep folder: give its config (kveval rescore CONFIG.yaml --out {target}), "
                             f"so the items come from it and its report and gate are rebuilt")
    if args.gpu_memory or args.strict or args.gate:
        raise UsageError("--gpu-memory, --strict and --gate are for a sweep (its gate is rebuilt); run folders have none")
    rescored = rescore_eval_folders(targets, Path(args.items) if args.items else None)
    _report(rescored, args.dry_run)
    return 0


def _run_sweep(config_path: Path, args) -> int:
    config = load_config(config_path)
    if args.gate:
        config = with_gate(config, args.gate)
    deploy = deployment_of(args)
    out = Path(args.out or config.out or Path("runs") / config.name)
    remedy = f"give the folder {config.name}'s sweep ran into with --out"
    if not out.is_dir() or read_manifest(out, config, remedy) is None:  # checked before the lock file is made
        raise FileNotFoundError(f"{out}: no sweep of {config.name} here (no {MANIFEST_FILE}); {remedy}")
    with sweep_lock(out):
        manifest = read_manifest(out, config, remedy)
        run_dirs, rescored, probes = rescore_sweep(config, out)
        _report(rescored, args.dry_run)
        if args.dry_run:
            return 0
        manifest["rescored_under"] = running_code()
        atomic_write_text(out / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True))
        code = summarize(out, run_dirs, config.gate, deploy, probes=probes, rank=config.rank)
    print(f"kveval rescore: {out} rescored; its report and gate are rebuilt", file=sys.stderr)
    return code if args.strict else (2 if code == 2 else 0)


def _report(rescored: list[RescoredRun], dry_run: bool) -> None:
    """Print each run's changes and the total; write them (every run checked first) unless ``dry_run``."""
    verb = "would change (dry run: nothing written)" if dry_run else "change"
    for run in rescored:
        print(f"{run.run_dir}: {describe([run], verb)}")
    print(f"in all, {describe(rescored, verb)}")
    kept = sum(run.lm_eval_probe_records for run in rescored)
    if kept:
        print(f"kveval rescore: warning: {kept} records of kveval's probe tasks run through lm-eval (kveval_*) keep the "
              f"scores lm-eval gave them; run those tasks again into a new folder to score them with this version",
              file=sys.stderr)
    if not dry_run:
        for run in rescored:
            run.write()

