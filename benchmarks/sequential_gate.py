"""Error rates and items spent by group-sequential designs of the gate's margin test, beside the fixed-n test.

For each design (default: the three of tests/test_sequential.py, sized for the gate simulation's 300-item run at
margin 0.05) this simulates candidates through :func:`kveval.stats.sequential.decide_many`, look by look, and prints
per scenario the PASS, FAIL and INCONCLUSIVE shares, the mean items spent and their share of the design's maximum.
The fixed-n rows are the exact probabilities of :func:`kveval.stats.paired.power` at the 300 items the designs are
sized against (see :func:`designs`).

    python3 benchmarks/sequential_gate.py [--runs 20000] [--seed 20261207] [--margin 0.05] [--gate-draws 400]

Then the same three designs through the gate itself (``--gate-draws`` candidates per row): synthetic run folders
(:func:`write_sim_run`) judged by ``kveval gate`` under a gate config with a ``sequential:`` section, the margin
alone (flip and confusion caps off): A/A, on the margin, a 10-point loss, 3 unchanged items, and contexts of 3-5
items flipping together, with the coverage of the reported 95% interval at the look that decided.

Scenarios (baseline accuracy 0.9): A/A (5% of right items flip and as many back), the change exactly on the
margin (the null both decisions are tested at), a planted 10-point loss, a 50-point loss. CPU only, a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import tempfile
from pathlib import Path

import numpy as np
from scipy import stats as _st

from kveval.stats import paired
from kveval.stats import sequential as seq
from kveval.stats.sequential import SequentialDesign


#: The fixed-n items the designs are sized against: the gate simulation's planted-loss run (95% power at 0.05).
FIXED_ITEMS = 300


def designs() -> dict[str, SequentialDesign]:
    """Three designs sized against the fixed-n 300 items: O'Brien-Fleming at 300 (its 3% inflation left out, the
    simulated power still holds), Pocock at 360 (its factor 1.20), Hwang-Shih-DeCani at 320 (1.05, rounded up)."""
    equal4 = (0.25, 0.5, 0.75, 1.0)
    return {
        "obrien-fleming x4 (default)": SequentialDesign.default(300),
        "pocock x4": SequentialDesign.from_fractions(equal4, 360, pass_spending="pocock", fail_spending="pocock"),
        "hsd(gamma=-2) x3": SequentialDesign.from_fractions((1 / 3, 2 / 3, 1.0), 320, pass_spending="hsd(gamma=-2)",
                                                            fail_spending="hsd(gamma=-2)"),
    }


def scenarios(margin: float) -> dict[str, tuple[float, float]]:
    """name -> (p_regress, p_improve)."""
    return {
        "A/A, 5% churn": (0.045, 0.045),
        f"on the margin (-{margin:g})": (0.02 + margin, 0.02),
        "10-point loss": (0.1, 0.0),
        "50-point loss": (0.5, 0.0),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20_000, help="simulated candidates per design and scenario")
    ap.add_argument("--seed", type=int, default=20261207)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--gate-draws", type=int, default=400,
                    help="candidates per design and scenario judged through kveval gate (0: skip; about a minute per "
                         "100 on 2 cores)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"{args.runs} simulated candidates per row, margin {args.margin:g}, alpha 0.05 per decision; "
          f"fixed-n rows exact (kveval.stats.paired.power)\n")
    print(f"| design | looks (items) | upper boundaries | inflation | scenario | PASS | FAIL | INCONCLUSIVE | "
          f"mean items | of max |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|")
    fixed_n = FIXED_ITEMS
    head = f"| fixed-n | {fixed_n} | {_st.norm.ppf(0.95):.3f} | 1 "
    for label, (pr, pi) in scenarios(args.margin).items():
        p_pass = paired.power(fixed_n, pr, pi, args.margin, 0.05, "pass")
        p_fail = paired.power(fixed_n, pr, pi, args.margin, 0.05, "fail")
        print(f"{head}| {label} | {p_pass:.4f} | {p_fail:.4f} | {1 - p_pass - p_fail:.4f} | {fixed_n} | 100% |")
        head = "| | | | "
    for name, d in designs().items():
        b = d.boundaries
        head = (f"| {name} | {', '.join(map(str, d.looks))} | {', '.join(f'{u:.3f}' for u in b.upper)} | "
                f"{seq.inflation_factor(d):.3f}")
        for label, (pr, pi) in scenarios(args.margin).items():
            r = seq.simulate(d, pr, pi, args.margin, args.runs, rng)
            print(f"{head} | {label} | {r.passed:.4f} | {r.failed:.4f} | {r.inconclusive:.4f} | {r.mean_items:.1f} | "
                  f"{r.mean_items / d.max_items:.0%} |")
            head = "| | | |"
    se = math.sqrt(0.05 * 0.95 / args.runs)
    print(f"\nMonte Carlo standard error of a 5% rate: {se:.4f}")
    if args.gate_draws:
        print(f"\n## Through the gate: synthetic run folders judged by `kveval gate` under a sequential gate config "
              f"({args.gate_draws} candidates per row)\n")
        print_gate_simulation(args.gate_draws, args.seed, args.margin)


# ----------------------------------------------------------------------------- the same designs through the gate

#: Item fields of a synthetic run's records (see :func:`write_sim_run`).
_TEMPLATE = {"gold": [], "recalled": None, "length": None, "depth": None, "logprob_gold": None}


def write_sim_run(path: Path, policy: str, correct, groups=None, task: str = "passkey") -> Path:
    """A run folder of ``len(correct)`` 0/1 items of one task, as ``kveval eval`` writes one (``groups``: each
    item's shared context, recorded as ``metrics.group``)."""
    from kveval.runs.records import ITEMS_FILE, RunInfo, write_run_info

    write_run_info(path, RunInfo(name=f"sim/{path.name}", model="sim-model", policy=policy,
                                 family=policy.split("(")[0]))
    lines = []
    for i, right in enumerate(correct):
        metrics = {"group": f"g{groups[i]}"} if groups is not None else {}
        lines.append(json.dumps({**_TEMPLATE, "id": f"{task}/{i}", "hash": f"h{i}", "task": task,
                                 "score": float(right), "correct": bool(right),
                                 "category": "correct" if right else "empty", "answer": "1234" if right else "",
                                 "metrics": metrics}))
    (path / ITEMS_FILE).write_text("\n".join(lines) + "\n")
    return path


def paired_draw(rng: np.random.Generator, n: int, p_regress: float, p_improve: float, accuracy: float = 0.9):
    """One candidate's items against a baseline: each item regresses (right -> wrong) with ``p_regress``, improves
    with ``p_improve``, else keeps the baseline's answer (right with ``accuracy``). Returns (baseline, candidate)
    correctness arrays and the true change of accuracy, ``p_improve - p_regress``."""
    u = rng.random(n)
    regress, improve = u < p_regress, (u >= p_regress) & (u < p_regress + p_improve)
    base = np.where(regress, True, np.where(improve, False, rng.random(n) < accuracy))
    return base, base ^ (regress | improve), p_improve - p_regress


def clustered_draw(rng: np.random.Generator, contexts: int, flip: float = 0.15, noise: float = 0.03):
    """Contexts of 3-5 items whose flips go together: a context regresses whole with ``flip``, improves whole with
    ``flip / 3``; other items flip alone with ``noise`` each way. Returns (baseline, candidate, groups, true
    change), the true change exactly (as tests/test_clusters_and_noise_floor.py derives it)."""
    sizes = rng.integers(3, 6, contexts)
    ids = np.repeat(np.arange(contexts), sizes)
    u = rng.random(contexts)[ids]
    lost = u < flip
    gained = (u >= flip) & (u < flip * 4 / 3)
    calm = ~lost & ~gained
    lost |= calm & (rng.random(ids.size) < noise)
    calm = ~lost & ~gained
    gained |= calm & (rng.random(ids.size) < noise)
    base = np.where(lost, True, np.where(gained, False, rng.random(ids.size) < 0.5))
    true = -2 * flip / 3 - (1 - 4 * flip / 3) * noise**2
    return base, base ^ (lost | gained), ids, true


def gate_cli(config: Path, baseline: Path, candidates: list[Path], out: Path) -> list[dict]:
    """``kveval gate`` through its command line; each candidate's verdict as ``gate.json`` records it."""
    from kveval.commands.main import main as kveval

    argv = ["gate", "--baseline", str(baseline), "--config", str(config), "--out", str(out)]
    for c in candidates:
        argv += ["--candidate", str(c)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = kveval(argv)
    if code not in (0, 1, 3):
        raise RuntimeError(f"kveval gate exited {code}: {err.getvalue().strip()}")
    return json.loads((out / "gate.json").read_text())["candidates"]


def gate_rates(folder: Path, gate_yaml: str, draws: int, rng: np.random.Generator, n: int, scenario) -> dict:
    """Simulate ``draws`` candidates of ``scenario`` (``(p_regress, p_improve)``, or ``"clustered"``: contexts
    flipping together, sized to about ``n`` items), each against its own baseline, judged through
    :func:`gate_cli` under ``gate_yaml``: the shares of PASS, FAIL and INCONCLUSIVE, the mean items spent, and the
    coverage of the reported 95% interval of the change at the look that decided."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "gate.yaml"
    config.write_text(gate_yaml)
    verdicts, covered, items = [], 0, []
    for d in range(draws):
        if scenario == "clustered":
            base, cand, groups, true = clustered_draw(rng, max(1, n // 4))
        else:
            (base, cand, true), groups = paired_draw(rng, n, *scenario), None
        b = write_sim_run(folder / f"b{d}", "none", base, groups)
        c = write_sim_run(folder / f"c{d}", "quant(bits=2)", cand, groups)
        [v] = gate_cli(config, b, [c], folder / f"gate{d}")
        verdicts.append(v["status"])
        [task] = v["tasks"]
        covered += task["comparison"]["ci_low"] <= true <= task["comparison"]["ci_high"]
        items.append(v["sequential"]["items_total"] if "sequential" in v else len(base))
    share = lambda s: sum(x == s for x in verdicts) / draws  # noqa: E731
    return {"PASS": share("PASS"), "FAIL": share("FAIL"), "INCONCLUSIVE": share("INCONCLUSIVE"),
            "ERROR": share("ERROR"), "items": float(np.mean(items)), "coverage": covered / draws}


def gate_designs() -> dict[str, tuple[str, int]]:
    """The designs of :func:`designs` as gate config sections, with the items per task each is sized to."""
    return {
        "obrien-fleming x4 (default)": ("sequential: true", 300),
        "pocock x4": ("sequential: {spending: pocock}", 360),
        "hsd(gamma=-2) x3": ("sequential: {looks: [0.3333333333, 0.6666666667, 1.0], spending: hsd(gamma=-2)}", 320),
    }


def gate_yaml(section: str, margin: float) -> str:
    """A gate config of ``margin`` that tests the margin alone (the flip and confusion caps off), with ``section``."""
    return f"margin: {margin}\nmax_negative_flip_rate: null\nmax_confusion_increase: null\n{section}\n"


def print_gate_simulation(draws: int, seed: int, margin: float) -> None:
    """Error rates of the three designs through ``kveval gate``: A/A, on the margin, a 10-point loss, 3 items and
    clustered items (the issue's guarantees: A/A FAIL <= 5%, a 10-point loss FAIL >= 95% at the maximum, 3 items
    never PASS, clustered coverage >= 0.93)."""
    rng = np.random.default_rng(seed)
    print("| design | scenario | items per task | PASS | FAIL | INCONCLUSIVE | mean items | 95% interval coverage |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (section, n) in gate_designs().items():
            rows = {"A/A, 5% churn": ((0.045, 0.045), n), f"on the margin (-{margin:g})": ((0.02 + margin, 0.02), n),
                    "10-point loss": ((0.1, 0.0), n), "3 items, unchanged": ((0.0, 0.0), 3),
                    "clustered contexts (3-5 items)": ("clustered", n)}
            for label, (scenario, items) in rows.items():
                slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{name}-{label}")
                r = gate_rates(Path(tmp) / slug, gate_yaml(section, margin), draws, rng, items, scenario)
                print(f"| {name} | {label} | {items} | {r['PASS']:.3f} | {r['FAIL']:.3f} | {r['INCONCLUSIVE']:.3f} | "
                      f"{r['items']:.1f} | {r['coverage']:.3f} |")
                name = ""


if __name__ == "__main__":
    main()
