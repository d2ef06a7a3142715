"""``kveval sweep CONFIG.yaml``: models x policies x probes, then comparison, leaderboard and gate verdict."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from kveval.deployment import add_deployment_arguments, deployment_of
from kveval.modeling.sources import add_placement_arguments, placement_from_args
from kveval.gate.config import shipped_gate_configs
from kveval.sweep.config import load_config, with_gate
from kveval.sweep.executors import Cell, CellResult, make_executor
from kveval.sweep.run import run_sweep, summarize, sweep_lock


class CellReport:
    """The executor's progress: one line per finished cell on stderr (unless quiet), saying whether it ran or was
    complete already; it also counts the cells, so that a sweep that ran nothing says so."""

    def __init__(self, quiet: bool):
        self.quiet, self.cells, self.complete = quiet, 0, 0

    def __call__(self, cell: Cell, result: CellResult | None) -> None:
        self.cells += 1
        already = result is not None and result.already_complete
        self.complete += already
        if not self.quiet:
            print(f"kveval sweep: {'already complete' if already else 'done'} {cell.label}", file=sys.stderr)

    @property
    def ran_nothing(self) -> bool:
        return self.cells > 0 and self.complete == self.cells


def configure(parser) -> None:
    parser.add_argument("config", help="sweep YAML, e.g. configs/quickstart.yaml")
    parser.add_argument("--out", help="run folder (default: the config's `out`, else runs/<name>)")
    parser.add_argument("--strict", action="store_true", help="exit with the gate's code: 1 FAIL, 3 INCONCLUSIVE (for CI)")
    parser.add_argument("--gate", metavar="NAME|PATH",
                        help=f"judge by this gate config instead of the config's `gate:`: a name kveval ships "
                             f"({', '.join(shipped_gate_configs())}) or the path of a gate YAML")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--noise-floor", action="store_true",
                        help="also run each baseline again in another batch arrangement: the gate then shows the "
                             "flips no compression causes beside every candidate's (the config key noise_floor)")
    add_deployment_arguments(parser)
    parser.add_argument("--executor", choices=["inprocess", "ray"], default="inprocess",
                        help="where cells (model x policy group) run: this process (default) or Ray tasks, one GPU "
                             "(else one CPU) each; needs pip install 'kveval[ray]'")
    parser.add_argument("--address", help="Ray cluster to join (e.g. auto, ray://head:10001); default: start one locally")
    parser.add_argument("--workers", type=int, help="CPUs of the local Ray cluster (default: all); ignored with --address")
    parser.add_argument("--policies-per-cell", type=int,
                        help="policies one cell evaluates, sharing its prefill (default: all of a model's policies "
                             "in process, 1 with --executor ray)")
    parser.add_argument("--skip-self-check", action="store_true",
                        help="load models that kveval's load-time exactness check refuses (only if you know why)")
    add_placement_arguments(parser)


def run(args) -> int:
    config = load_config(args.config)
    if args.gate:
        config = with_gate(config, args.gate)
    if args.noise_floor:
        config = replace(config, noise_floor=True)
    for warning in config.warnings:
        print(f"kveval sweep: warning: {warning}", file=sys.stderr)

    deploy = deployment_of(args)  # asked before the sweep runs, not refused after it
    load_options = placement_from_args(args) | ({"self_check": False} if args.skip_self_check else {})
    cells = CellReport(args.quiet)
    executor = make_executor(args.executor, args.address, args.workers, progress=cells)
    out = Path(args.out or config.out or Path("runs") / config.name)
    with sweep_lock(out):
        run_dirs = run_sweep(config, out, quiet=args.quiet or args.executor != "inprocess", executor=executor,
                             load_options=load_options,
                             policies_per_cell=args.policies_per_cell or (1 if args.executor == "ray" else None))
        if cells.ran_nothing:
            print(f"kveval sweep: {out} is already complete ({len(run_dirs)} runs): nothing was run; its report and "
                  f"gate are rebuilt from them", file=sys.stderr)
        code = summarize(out, run_dirs, config.gate, deploy, rank=config.rank)
    return code if args.strict else (2 if code == 2 else 0)
