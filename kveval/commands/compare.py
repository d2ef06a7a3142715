"""``kveval compare BASE CAND``: the paired comparison as a terminal table (and JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kveval.runs.records import atomic_write_text
from kveval.runs.results import baseline_for, is_same_run, load_run, pairing_warnings
from kveval.stats.comparison import DEFAULT_RESAMPLES, check_settings, compare_runs
from kveval.stats.tables import fmt_delta_ci, fmt_p, format_table


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", metavar="BASE", help="baseline run folder (or lm-eval --log_samples output)")
    parser.add_argument("candidate", metavar="CAND", help="candidate run folder (or lm-eval --log_samples output)")
    parser.add_argument("--json", metavar="PATH", help="also write the full comparison (tasks, cells, regressed items) as JSON")
    parser.add_argument("--metric", help="lm-eval outputs: metric to score by (default: acc, exact_match, score, ...)")
    parser.add_argument("--confidence", type=float, default=0.95, help="interval coverage (default 0.95)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples of the log-prob change (default 9999)")
    parser.add_argument("--seed", type=int, default=0, help="resampling seed (default 0)")
    parser.add_argument("--cells", action="store_true", help="also print the per (task, length, depth) cells")


def run(args: argparse.Namespace) -> int:
    check_settings(args.confidence, args.resamples)  # before any run loads

    base, cand = load_run(args.baseline, metric=args.metric), load_run(args.candidate, metric=args.metric)
    if is_same_run(base, cand):
        print(f"kveval compare: warning: baseline and candidate are the same run ({base.path}, {cand.path}); the "
              f"comparison tells nothing", file=sys.stderr)
    for warning in pairing_warnings(base, cand):
        print(f"kveval compare: warning: {warning}", file=sys.stderr)
    rc = compare_runs(
        baseline_for(base, cand),  # a candidate a sequential sweep stopped early: on the items it holds
        cand,
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
        atomic_write_text(path, json.dumps(rc.to_dict(), indent=2))
        print(f"\nwrote {path}")
    return 0
