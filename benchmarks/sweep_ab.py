"""One sweep config run by two checkouts of kveval, side by side on one machine: wall time and answers.

    python3 benchmarks/sweep_ab.py OLD_TREE [NEW_TREE] [--config configs/quickstart.yaml] [--repeats 1]

``OLD_TREE`` and ``NEW_TREE`` (default: this checkout) are source trees of kveval (a ``git worktree add`` of an
older commit, say). Each repeat runs ``python3 -m kveval sweep CONFIG --out <temporary folder>`` once in each tree,
in alternating order (old first on odd repeats, new first on even ones) so that a machine warming up or slowing
down favours neither. Printed: every run's wall time, the ratio of the new tree's total to the old's, and whether
both trees wrote the same items (every field of every item of every run but its timings) as each other and
as the config's committed results (``--results``, default ``results/<config name>`` in the new tree).

Run it alone on the machine (``flock /tmp/kveval-heavy.lock``): it is a timing, and any other torch process slows
both sides by 5-10x. A refactor that must not change speed or answers is checked with it: issue 60's target was
the quickstart's wall time within 5% of the old code's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Item metrics that are timings: the only fields two runs of the same items may disagree on.
TIMING_METRICS = ("ttft_s", "decode_tokens_per_s")


def run_sweep(tree: Path, config: Path, out: Path) -> float:
    """Wall seconds of one sweep of ``config`` by the kveval in ``tree`` into ``out``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kveval", "sweep", str(config), "--out", str(out)], cwd=tree, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"sweep_ab: {tree}: the sweep exited {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds


def items_of(folder: Path) -> dict[str, list[dict]]:
    """Every run's items under a sweep folder, by run path, each without its :data:`TIMING_METRICS`."""
    out = {}
    for path in sorted(folder.glob("runs/*/*/items.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for r in rows:
            for key in TIMING_METRICS:
                r.get("metrics", {}).pop(key, None)
        out[str(path.relative_to(folder))] = sorted(rows, key=lambda r: r["id"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the older kveval source tree")
    parser.add_argument("new", type=Path, nargs="?", default=Path(__file__).resolve().parent.parent,
                        help="the newer tree (default: this checkout)")
    parser.add_argument("--config", default="configs/quickstart.yaml", help="sweep config, relative to each tree")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--results", type=Path, default=None, help="committed results to compare the items with")
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    times: dict[str, list[float]] = {"old": [], "new": []}
    items: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kveval-ab-") as tmp:
        for repeat in range(args.repeats):
            for side in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
                out = Path(tmp) / f"{side}-{repeat}"
                seconds = run_sweep(trees[side], trees[side] / args.config, out)
                times[side].append(seconds)
                items.setdefault(side, items_of(out))
                print(f"repeat {repeat + 1} {side}: {seconds:.1f} s", flush=True)
    old, new = sum(times["old"]), sum(times["new"])
    print(f"new/old wall time: {new / old:.3f} (old {old:.1f} s, new {new:.1f} s over {args.repeats} repeat(s))")
    print(f"same items, old and new: {items['old'] == items['new']} ({sum(map(len, items['new'].values()))} items)")
    committed = args.results or trees["new"] / "results" / Path(args.config).stem
    if committed.is_dir():
        print(f"same items as {committed}: {items_of(committed) == items['new']}")


if __name__ == "__main__":
    main()
