"""Does a sequential sweep give its fixed-n verdicts? Finish a copy of it fixed-n and compare, candidate by candidate.

A sequential sweep (``sequential: true``, or a sequential gate) stops each candidate at its first PASS or FAIL. This
copies such a sweep's folder (default ``results/<name>``), resumes the copy with ``sequential: false`` (``sequential``
is outside the config hash: the resumed sweep runs only the items the stopped candidates skipped), and prints for each
candidate its sequential verdict, the look and items it stopped at, and its fixed-n verdict on every item; then the
item-runs of both and the time the fixed-n completion took. The committed folder is never written.

    python3 benchmarks/sequential_verdicts.py configs/four-bit-kv.yaml [--sweep results/four-bit-kv] [--keep DIR]

Runs the model(s) for the skipped items: minutes on a 2-core CPU; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

# Run as a script only benchmarks/ is on sys.path; the tests import this module as benchmarks.sequential_verdicts, and
# both find its sibling the same way from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.sequential_quickstart import REPO, _candidates, _run, _variant, checked_config  # noqa: E402


def _recorded(sweep: Path) -> dict[str, dict]:
    """The sweep's ``sequential_decisions``: run folder (relative) -> decision (look, looks, items_total)."""
    return json.loads((sweep / "manifest.json").read_text()).get("sequential_decisions") or {}


def _decisions(sweep: Path) -> dict[str, dict]:
    """Per run (its name, ``model/policy``): its recorded sequential decision."""
    recorded = _recorded(sweep)
    names = {k: json.loads((sweep / k / "run.json").read_text())["name"] for k in recorded}
    return {names[k]: v for k, v in recorded.items()}


def compare(config: Path, sweep: Path, root: Path) -> dict:
    """Copy ``sweep`` under ``root``, finish the copy fixed-n from ``config``; the per-candidate verdicts of both."""
    from kveval.runs.records import read_items

    decisions = _decisions(sweep)
    copy = root / sweep.name
    shutil.copytree(sweep, copy)
    seconds, code = _run(_variant(config, root, False), copy)
    sequential = {c["name"]: c["status"] for c in _candidates(sweep)}
    fixed = {c["name"]: c["status"] for c in _candidates(copy)}
    rows = [{"candidate": name, "sequential": status, "look": decisions[name]["look"],
             "looks": decisions[name]["looks"], "items": decisions[name]["items_total"],
             "fixed_n": fixed.get(name, "-")} for name, status in sequential.items()]
    return {"rows": rows, "seconds": seconds, "exit_code": code,
            "item_runs": {"sequential": sum(d["items_total"] for d in decisions.values()),
                          "fixed_n": sum(len(read_items(copy / k)) for k in _recorded(sweep))}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path, help="the sweep config (e.g. configs/four-bit-kv.yaml)")
    ap.add_argument("--sweep", type=Path, help="its sequential sweep folder (default: results/<the config's name>)")
    ap.add_argument("--keep", type=Path, help="finish the copy here (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    sweep = args.sweep or REPO / "results" / checked_config(ap, args.config).name
    if not (sweep / "manifest.json").is_file() or not _decisions(sweep):
        ap.error(f"{sweep} holds no sequential sweep (no manifest.json recording sequential_decisions); give its "
                 f"folder with --sweep")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        out = compare(args.config.resolve(), sweep.resolve(), root)
    print(f"{sweep}: sequential, then finished fixed-n (a copy)\n")
    print("| candidate | sequential verdict | look | items | fixed-n verdict | same |")
    print("|---|---|---:|---:|---|---|")
    for r in out["rows"]:
        print(f"| {r['candidate']} | {r['sequential']} | {r['look']} of {r['looks']} | {r['items']} | {r['fixed_n']} | "
              f"{'yes' if r['sequential'] == r['fixed_n'] else 'NO'} |")
    same = sum(r["sequential"] == r["fixed_n"] for r in out["rows"])
    runs = out["item_runs"]
    print(f"\n{same} of {len(out['rows'])} verdicts the same; item-runs (baseline included, noise floor not): "
          f"sequential {runs['sequential']}, fixed-n {runs['fixed_n']} ({runs['sequential'] / runs['fixed_n']:.2f}); "
          f"the fixed-n completion took {out['seconds']:.1f} s (exit code {out['exit_code']})")
    return {**out, "same": same}


if __name__ == "__main__":
    main()
