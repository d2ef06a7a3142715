"""The ``kveval`` command line: a lazy command registry, :data:`COMMANDS` (name -> module, one-line help).

Only the module of the command that runs is imported (each has ``configure(parser)`` and ``run(args) -> int``),
so start-up stays fast and the analysis commands load no torch. Exceptions become exit codes in one place,
:func:`kveval.errors.run_command`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kveval import __version__
from kveval.errors import EXIT_CODE_MEANINGS, run_command  # run_command: the one place exceptions become exit codes

#: What ``kveval --help`` opens with.
DESCRIPTION = ("kveval measures what a compressed KV cache costs a language model: it runs recall probes\n"
               "(and lm-eval tasks) under compression policies, measures the cache's real bytes, compares\n"
               "each run with its baseline item by item and gates deployment with an exit code.")

# name -> (module, one-line help). Modules keep heavy imports (torch, transformers) inside `run`.
COMMANDS = {
    "generate": ("kveval.commands.generate", "greedy generation under a compression policy, with measured cache bytes"),
    "policies": ("kveval.commands.policies", "list every policy with its parameters"),
    "probes": ("kveval.commands.probes", "write long-context recall probe items as jsonlines"),
    "eval": ("kveval.commands.eval", "run probe items under one policy and write a run folder"),
    "compare": ("kveval.commands.compare", "paired comparison of a candidate run against its baseline"),
    "gate": ("kveval.commands.gate", "regression gate before deployment (exit 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 2 error); --plan sizes a run"),
    "report": ("kveval.commands.report", "leaderboard (markdown, CSV, HTML) and plots from run folders"),
    "sweep": ("kveval.commands.sweep", "models x policies x probes sweep, ending in a leaderboard and a gate verdict"),
    "rescore": ("kveval.commands.rescore", "score stored answers again with this version's scorer (a sweep or run folders), no model run"),
    "memory": ("kveval.commands.memory", "KV-cache memory planner: bytes per token, largest context or batch that fits"),
    "lm-eval": ("kveval.lm_eval.__main__", "lm-evaluation-harness CLI with the kveval model type and kveval's tasks"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "lm-eval":  # hand every remaining argument to lm_eval's own parser
        from kveval.lm_eval.__main__ import main as lm_eval_main  # lm-eval is an optional dependency

        return run_command("lm-eval", lambda: lm_eval_main(argv[1:]))
    parser = argparse.ArgumentParser(prog="kveval", description=DESCRIPTION, epilog=_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kveval {__version__}",
                        help="print kveval's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:  # import only the command that runs: start-up stays fast
            module = importlib.import_module(module_name)
            module.configure(command_parser)
    args = parser.parse_args(argv)
    return run_command(args.command, lambda: module.run(args))


def _epilog() -> str:
    codes = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODE_MEANINGS)
    return (f"exit codes:\n{codes}\n\n"
            f"kveval COMMAND --help describes a command; the README and docs/ describe the rest.")


if __name__ == "__main__":
    sys.exit(main())
