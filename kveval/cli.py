"""The ``kveval`` command line: one subcommand per module, each with ``configure(parser)`` and ``run(args) -> int``.

Exit codes: 0 success, 1 a regression (``gate``), 2 any error (bad input, missing
or corrupt files, unknown model or policy), printed as one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Modules keep heavy imports (torch, transformers) inside `run`.
COMMANDS = {
    "generate": ("kveval.generate_cli", "greedy generation under a compression policy, with measured cache bytes"),
    "policies": ("kveval.policies.cli", "list every policy with its parameters"),
    "probes": ("kveval.probes.cli", "write long-context recall probe items as jsonlines"),
    "eval": ("kveval.evaluate", "run probe items under one policy and write a run folder"),
    "compare": ("kveval.compare", "paired comparison of a candidate run against its baseline"),
    "gate": ("kveval.gate", "regression gate before deployment (exit 0 pass, 1 regression, 2 error)"),
    "report": ("kveval.report", "leaderboard (markdown, CSV, HTML) and plots from run folders"),
    "sweep": ("kveval.sweep", "models x policies x probes sweep, ending in a leaderboard and a gate verdict"),
    "memory": ("kveval.memory", "KV-cache memory planner: bytes per token, largest context or batch that fits"),
    "lm-eval": ("kveval.lm_eval.__main__", "lm-evaluation-harness CLI with the kveval model type and kveval's tasks"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "lm-eval":  # hand every remaining argument to lm_eval's own parser
        from kveval.lm_eval.__main__ import main as lm_eval_main

        return lm_eval_main(argv[1:])
    parser = argparse.ArgumentParser(prog="kveval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if argv and argv[0] == name:  # import only the command that runs: start-up stays fast
            module = importlib.import_module(module_name)
            module.configure(command_parser)
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("kveval: interrupted; results written so far are kept", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line for the user; KVEVAL_DEBUG=1 shows the traceback
        import os

        if os.environ.get("KVEVAL_DEBUG"):
            raise
        if not _is_user_error(exc):
            raise
        print(f"kveval {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _is_user_error(exc: Exception) -> bool:
    from kveval.models import ModelNotFoundError
    from kveval.records import ResultFileError

    return isinstance(exc, (ValueError, FileNotFoundError, ModelNotFoundError, ResultFileError))


if __name__ == "__main__":
    sys.exit(main())
