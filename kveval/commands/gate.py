"""The ``kveval gate`` command: its options, ``--plan``'s table, and the run that prints each candidate's verdict,
the deployment decision (:mod:`kveval.deployment`) and the written outputs (:mod:`kveval.gate.report`), and
returns the gate's exit code. The verdicts themselves come from :mod:`kveval.gate.rules`, which imports neither."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from kveval.errors import EXIT_PASS, UsageError
from kveval.gate.config import DEFAULT_GATE, GateConfig, load_gate_config, shipped_gate_configs
from kveval.deployment import add_deployment_arguments, deployment_decision, deployment_of
from kveval.gate.report import write_gate_outputs
from kveval.gate.rules import evaluate_gate
from kveval.gate.verdicts import ERROR, INCONCLUSIVE
from kveval.runs.ownership import refuse_sweep_folder
from kveval.stats import paired


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gate", "--config", dest="config", metavar="NAME|PATH",
        help=f"gate config: a name kveval ships ({', '.join(shipped_gate_configs())}) or the path of a gate YAML "
             f"(default: {DEFAULT_GATE})",
    )
    parser.add_argument("--baseline", metavar="RUN", help="baseline run folder (or lm-eval --log_samples output)")
    parser.add_argument("--candidate", action="append", metavar="RUN", help="candidate run folder (repeatable)")
    parser.add_argument("--out", metavar="DIR", help="write gate.md, gate.xml (JUnit) and gate.json here")
    parser.add_argument("--metric", help="lm-eval outputs: metric to score by")
    parser.add_argument("--noise-floor", metavar="RUN",
                        help="the baseline run again in another batch arrangement (kveval sweep --noise-floor writes "
                             "<out>/noise_floor/runs/...): its flips are shown beside every candidate's")
    plan = parser.add_argument_group("planning (--plan: print items per task and exit)")
    plan.add_argument("--plan", action="store_true", help="items per task needed for --power to decide")
    plan.add_argument("--baseline-accuracy", type=float, default=0.9, help="expected baseline accuracy (default 0.9)")
    plan.add_argument("--churn", type=float, action="append", help="share of right items that flip, as many flipping back (repeatable; default 0, 0.02, 0.05, 0.1)")
    plan.add_argument("--loss", type=float, default=0.0, help="expected net loss of accuracy on top of the churn (default 0)")
    plan.add_argument("--margin", type=float, help="margin (default: the config's default margin)")
    plan.add_argument("--alpha", type=float, help="one-sided error rate (default: the config's)")
    plan.add_argument("--power", type=float, help="power (default: the config's, 0.8)")
    plan.add_argument("--cluster-size", type=int, default=1,
                      help="items that share one context (multi_turn turns, requests under one system prompt; default 1)")
    plan.add_argument("--icc", type=float, default=1.0,
                      help="with --cluster-size: how alike the flips of one context's items are, 0 (independent) to "
                           "1 (all or none; the default, the safe choice)")
    add_deployment_arguments(parser)


def format_plan(cfg: GateConfig, args: argparse.Namespace) -> str:
    margin = args.margin if args.margin is not None else cfg.margin_for("default")
    alpha = args.alpha if args.alpha is not None else cfg.alpha
    power = args.power if args.power is not None else cfg.power
    churns = args.churn or [0.0, 0.02, 0.05, 0.10]
    if args.cluster_size < 1 or not 0 <= args.icc <= 1:
        raise UsageError(f"--cluster-size {args.cluster_size} must be >= 1 and --icc {args.icc:g} in [0, 1]")
    design = 1 + (args.cluster_size - 1) * args.icc  # Kish's design effect of clusters of equal size
    lines = [
        f"items per task for {power:.0%} power: baseline accuracy {args.baseline_accuracy:g}, margin {margin:g}, "
        f"one-sided alpha {alpha:g}" + (f", net loss {args.loss:g}" if args.loss else "")
        + (f", clusters of {args.cluster_size} items at ICC {args.icc:g} (design effect {design:.2f})" if design > 1 else ""),
        f"{'churn':>7}  {'p(right->wrong)':>15}  {'p(wrong->right)':>15}  {'to':>4}  items",
    ]
    for churn in churns:
        r = paired.plan(args.baseline_accuracy, churn, margin, alpha, loss=args.loss, target_power=power)
        n = "never (change on the margin)" if r.items is None else str(math.ceil(r.items * design))
        lines.append(f"{churn:>7.3f}  {r.p_regress:>15.4f}  {r.p_improve:>15.4f}  {r.goal:>4}  {n}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = load_gate_config(args.config or DEFAULT_GATE)
    if args.plan:
        print(format_plan(cfg, args))
        return EXIT_PASS
    if not args.baseline or not args.candidate:
        raise UsageError("give --baseline RUN and at least one --candidate RUN (or --plan)")
    deploy = deployment_of(args)  # asked before any run loads
    if args.out:
        refuse_sweep_folder(Path(args.out), "gate", "give --out a new folder; kveval rescore CONFIG rebuilds a "
                                                    "sweep's own gate")
    result = evaluate_gate(cfg, args.baseline, args.candidate, metric=args.metric, noise_floor=args.noise_floor)
    # Sized before anything is printed or written: what cannot be sized is one line (exit 2), never a FAIL hidden
    # behind an error after the verdicts.
    decisions = deployment_decision(result, **deploy) if deploy else []
    # Written before anything is printed: a reader that goes away (| head) or a full terminal loses no verdict.
    paths = write_gate_outputs(result, args.out) if args.out else None
    for cv in result.candidates:
        for w in cv.warnings:
            print(f"kveval gate: warning: {w}", file=sys.stderr)
        if cv.status == ERROR:
            print(f"kveval gate: error: {cv.error}", file=sys.stderr)
        else:
            print(cv.line())
    for d in decisions:
        print(d.line)
    if paths:
        print(f"wrote {paths['markdown']}, {paths['junit']}, {paths['json']}")
    if result.status == INCONCLUSIVE and not cfg.inconclusive_blocks:
        print("kveval gate: warning: INCONCLUSIVE does not block (inconclusive_blocks: false)", file=sys.stderr)
    print(f"gate: {result.status} (exit {result.exit_code})")
    return result.exit_code


__all__ = ["configure", "format_plan", "run"]
