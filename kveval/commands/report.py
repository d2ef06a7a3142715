"""``kveval report``: the leaderboard, its plots and the per-item views from run or sweep folders."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kveval.report.leaderboard import build_report
from kveval.runs.ownership import refuse_sweep_folder
from kveval.runs.results import expand_run_dirs
from kveval.sweep.recorded import recorded_probe_items


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders, or sweep folders holding runs/*/")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument("--gate", metavar="PATH", help="gate.json (or its folder) from kveval gate --out, for the verdict column")
    parser.add_argument("--resamples", type=int, default=9999, help="bootstrap resamples of the log-prob change (default 9999)")
    parser.add_argument("--seed", type=int, default=0, help="resampling seed (default 0)")
    parser.add_argument("--rank", action="store_true",
                        help="also rank each model's candidates against each other, item by item (ranking.md: "
                             "which loses least, and which differences are real)")
    parser.add_argument("--no-prompts", action="store_true",
                        help="do not generate the probe items again (it loads each model's tokenizer) for the item "
                             "views' questions and contexts; the views then show the recorded answers only")


def run(args: argparse.Namespace) -> int:
    probes = None
    if not args.no_prompts:
        recorded = recorded_probe_items(expand_run_dirs(args.runs))
        for note in recorded.notes:
            print(f"kveval report: warning: {note}", file=sys.stderr)
        probes = recorded.items
    refuse_sweep_folder(Path(args.out), "report", "give --out a new folder; kveval rescore CONFIG rebuilds a "
                                                  "sweep's own report")
    paths = build_report(args.runs, args.out, gate_result=args.gate, n_resamples=args.resamples, seed=args.seed,
                         probes=probes, rank=args.rank)
    print(Path(paths["markdown"]).read_text(encoding="utf-8"))
    if args.rank:
        print(Path(paths["ranking"]).read_text(encoding="utf-8"))
    print(f"wrote {paths['markdown']}, {paths['csv']}, {paths['html']} and {len(paths['plots'])} plot(s) in {args.out}")
    return 0
