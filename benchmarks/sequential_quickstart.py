"""Time to verdict: a sweep run fixed-n and sequentially, one after the other in one process, side by side.

Runs the sweep config (default ``configs/quickstart.yaml``) twice into two fresh temporary folders, first with
``sequential: false`` (every candidate runs every item), then with ``sequential: true`` (the gate's design: a
candidate stops at its first PASS or FAIL), and prints for each candidate its verdict and the items it ran under
both, then the wall times and their ratio (sequential / fixed-n; the issue asks for at most 0.60 with the same
verdicts). Where a candidate ran every item (decided at the last look, or not at all), a third sweep runs the
baseline and those candidates alone, fixed-n: the floor no look schedule can beat while they need every item, since
the baseline's shared prefill is paid per item whatever number of candidates remain. All runs load the model
themselves, so the times compare like with like; run it on an otherwise idle machine and say which one.

    python3 benchmarks/sequential_quickstart.py [--config configs/quickstart.yaml] [--keep DIR]

On the embedded SmolLM2-135M this is two quickstarts (minutes on a 2-core CPU); tests run it on a tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def _variant(config: Path, folder: Path, sequential: bool, policies: list[str] | None = None,
             label: str | None = None) -> Path:
    """A copy of the sweep config ``config`` in ``folder`` with ``sequential`` set and, where given, only
    ``policies`` (its gate, where a path, kept pointing at the original's)."""
    from kveval.gate.config import is_gate_name

    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    gate = raw.get("gate")
    if isinstance(gate, str) and not is_gate_name(gate):
        raw["gate"] = str((config.parent / gate).resolve())
    raw["sequential"] = sequential
    if policies is not None:
        raw["policies"] = policies
    path = folder / f"{config.stem}-{label or ('sequential' if sequential else 'fixed')}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path


def _run(config: Path, out: Path) -> tuple[float, int]:
    """``kveval sweep config --out out`` in this process: (wall seconds, exit code)."""
    from kveval.commands.main import main

    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["sweep", str(config), "--out", str(out), "--quiet"])
    return time.perf_counter() - start, code


def _candidates(out: Path) -> list[dict]:
    data = json.loads((out / "gate" / "gate.json").read_text())
    return [c for r in (data["results"] if "results" in data else [data]) for c in r["candidates"]]


def _verdicts(out: Path) -> dict[str, tuple[str, int]]:
    """Per candidate (run name): its gate verdict and the items its run holds."""
    from kveval.runs.records import read_items

    return {c["name"]: (c["status"], len(read_items(Path(c["path"])))) for c in _candidates(out)}


def _ran_every_item(out: Path, fixed: dict[str, tuple[str, int]]) -> list[str]:
    """The policies (as their runs record them, each once: a sweep of several models runs it for each) of the
    sequential sweep ``out`` whose runs hold as many items as the fixed-n run's (``fixed``: :func:`_verdicts`)."""
    from kveval.runs.records import read_items

    return list(dict.fromkeys(json.loads((Path(c["path"]) / "run.json").read_text())["policy"]
                              for c in _candidates(out) if len(read_items(Path(c["path"]))) == fixed[c["name"]][1]))


def checked_config(ap: argparse.ArgumentParser, config: Path):
    """The sweep config ``config`` loaded, or the parser's one-line error (exit 2) where it cannot be."""
    from kveval.errors import KvevalError
    from kveval.sweep.config import load_config

    try:
        return load_config(config)
    except (KvevalError, FileNotFoundError) as exc:
        ap.error(str(exc))


def compare(config: Path, root: Path) -> dict:
    """Run ``config`` fixed-n then sequentially under ``root``; the times, exit codes and per-candidate verdicts."""
    runs = {}
    for label, sequential in (("fixed-n", False), ("sequential", True)):
        out = root / label
        seconds, code = _run(_variant(config, root, sequential), out)
        runs[label] = {"seconds": seconds, "exit_code": code, "candidates": _verdicts(out)}
    full = _ran_every_item(root / "sequential", runs["fixed-n"]["candidates"])
    if full:
        seconds, code = _run(_variant(config, root, False, policies=full, label="floor"), root / "floor")
        runs["floor"] = {"seconds": seconds, "exit_code": code, "policies": full}
    return runs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "quickstart.yaml")
    ap.add_argument("--keep", type=Path, help="write both sweeps here (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    checked_config(ap, args.config)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        runs = compare(args.config.resolve(), root)
    fixed, seq = runs["fixed-n"], runs["sequential"]
    print(f"{args.config}: fixed-n, then sequential, in one process\n")
    print("| candidate | fixed-n verdict | items | sequential verdict | items | same verdict |")
    print("|---|---|---:|---|---:|---|")
    for name, (status, items) in fixed["candidates"].items():
        s_status, s_items = seq["candidates"].get(name, ("-", 0))
        print(f"| {name} | {status} | {items} | {s_status} | {s_items} | {'yes' if status == s_status else 'NO'} |")
    ratio = seq["seconds"] / fixed["seconds"]
    print(f"\nwall time: fixed-n {fixed['seconds']:.1f} s, sequential {seq['seconds']:.1f} s, ratio {ratio:.2f} "
          f"(exit codes {fixed['exit_code']}, {seq['exit_code']})")
    floor = runs.get("floor")
    if floor:
        floor_ratio = floor["seconds"] / fixed["seconds"]
        print(f"floor: the baseline and {', '.join(floor['policies'])} (every item each), fixed-n, "
              f"{floor['seconds']:.1f} s, ratio {floor_ratio:.2f}: no look schedule goes below it while "
              f"{'they need' if len(floor['policies']) > 1 else 'it needs'} every item")
        return {**runs, "ratio": ratio, "floor_ratio": floor_ratio}
    print("floor: every candidate stopped before its last item")
    return {**runs, "ratio": ratio}


if __name__ == "__main__":
    main()
