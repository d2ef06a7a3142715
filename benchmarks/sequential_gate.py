"""Error rates and items spent by group-sequential designs of the gate's margin test, beside the fixed-n test.

For each design (default: the three of tests/test_sequential.py, sized for the gate simulation's 300-item run at
margin 0.05) this simulates candidates through :func:`kveval.stats.sequential.decide_many`, look by look, and prints
per scenario the PASS, FAIL and INCONCLUSIVE shares, the mean items spent and their share of the design's maximum.
The fixed-n rows are the exact probabilities of :func:`kveval.stats.paired.power` at the 300 items the designs are
sized against (see :func:`designs`).

    python3 benchmarks/sequential_gate.py [--runs 20000] [--seed 20261207] [--margin 0.05]

Scenarios (baseline accuracy 0.9): A/A (5% of right items flip and as many back), the change exactly on the
margin (the null both decisions are tested at), a planted 10-point loss, a 50-point loss. CPU only, a few seconds.
"""

from __future__ import annotations

import argparse
import math

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


if __name__ == "__main__":
    main()
