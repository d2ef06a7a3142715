"""``kveval lm-eval ...`` / ``python -m kveval.lm_eval ...``: lm-eval's own CLI with kveval added.

Every argument is lm-eval's (``lm-eval run --help``); this wrapper only

1. registers the ``kveval`` model type (lm-eval 0.4.13 has no model plugins),
2. adds kveval's task folder (:func:`kveval.lm_eval.tasks_dir`) to the task
   search path. A user's ``--include_path`` is kept as well (several folders
   may be joined with ``os.pathsep``, ``:`` on Linux); lm-eval's own CLI takes
   one folder, so the wrapper hands lm-eval's ``TaskManager`` the list,
3. defaults ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1`` (kveval's models
   and tasks need no network; set them to 0 to reach the Hub),

then runs lm-eval's CLI exactly as ``lm-eval`` would.
"""

from __future__ import annotations

import os
import sys

from kveval.errors import UsageError, run_command  # run_command: the one place exceptions become exit codes
from kveval.lm_eval import register, tasks_dir


def _include_paths(user: str | list | None) -> list[str] | str | None:
    paths = []
    ours = tasks_dir()
    if ours is not None:
        paths.append(str(ours))
    if user:
        for item in user if isinstance(user, (list, tuple)) else str(user).split(os.pathsep):
            if item and str(item) not in paths:
                paths.append(str(item))  # later paths win on name clashes: the user's override ours
    if not paths:
        return None
    return paths if len(paths) > 1 else paths[0]


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI on ``argv`` (default ``sys.argv[1:]``) with the kveval model type and tasks; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    register()
    from lm_eval.utils import setup_logging

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        setup_logging()
        try:
            from lm_eval._cli import HarnessCLI
        except ImportError:  # a later lm-eval layout: fall back to its entry point with one --include_path folder
            return _fallback(argv)
        parser = HarnessCLI()
        args = parser.parse_args()
        _check_kveval_args(args)
        if getattr(args, "command", None) in ("run", "ls", "validate") and hasattr(args, "include_path"):
            args.include_path = _include_paths(args.include_path)
        parser.execute(args)
        return 0
    except SystemExit as exc:  # lm-eval's own exits: argparse (2), --help (0); any other failure is an error, never 1
        return 0 if exc.code in (0, None) else 2
    finally:
        sys.argv = saved


def _check_kveval_args(args) -> None:
    """Fail in a second on a bad policy spec or mode, before lm-eval indexes its tasks and loads the model."""
    if getattr(args, "model", None) != "kveval" or not isinstance(getattr(args, "model_args", None), dict):
        return
    # imported after main() set HF_HUB_OFFLINE: huggingface_hub reads it once, when transformers first loads it
    from kveval.lm_eval.arguments import policy_from_arg
    from kveval.runner.runspec import MODES

    policy_from_arg(args.model_args.get("policy", "none"))
    compress = args.model_args.get("compress", "context")
    if compress not in MODES:
        raise UsageError(f"compress={compress!r}; use 'context' (query-agnostic) or 'query' (query-aware)")


def _fallback(argv: list[str]) -> int:
    from lm_eval.__main__ import cli_evaluate

    if "--include_path" not in argv and tasks_dir() is not None:
        sys.argv = [*sys.argv, "--include_path", str(tasks_dir())]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(run_command("lm-eval", main))
