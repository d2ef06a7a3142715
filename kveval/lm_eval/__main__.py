"""``kveval lm-eval ...`` / ``python -m kveval.lm_eval ...``: lm-eval's own CLI with kveval added.

Every argument is lm-eval's (``lm-eval run --help``); this wrapper only

1. registers the ``kveval`` model type (no lm-eval release on the index loads model plugins yet),
2. adds kveval's task folder (:func:`kveval.lm_eval.tasks_dir`) to the task
   search path. A user's ``--include_path`` is kept as well (several folders
   may be joined with ``os.pathsep``, ``:`` on Linux); lm-eval's own CLI takes
   one folder, so the wrapper hands lm-eval's ``TaskManager`` the list,
3. defaults ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1`` (kveval's models
   and tasks need no network; set them to 0 to reach the Hub),
4. with ``--model kveval``, hands lm-eval the device the model runs on (:func:`_settle_device`), so that the
   results record it: lm-eval records the device it is given, and gives ``cuda:0`` when told none,

then runs lm-eval's CLI exactly as ``lm-eval`` would.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kveval.errors import UsageError, run_command  # run_command: the one place exceptions become exit codes
from kveval.lm_eval import register, tasks_dir
from kveval.yaml_files import load_yaml


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
        if getattr(args, "model", None) == "kveval":
            _check_kveval_args(args)
            _settle_device(args)
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
    if not isinstance(getattr(args, "model_args", None), dict):
        return
    # imported after main() set HF_HUB_OFFLINE: huggingface_hub reads it once, when transformers first loads it
    from kveval.lm_eval.arguments import policy_from_arg
    from kveval.runner.runspec import MODES

    policy_from_arg(args.model_args.get("policy", "none"))
    compress = args.model_args.get("compress", "context")
    if compress not in MODES:
        raise UsageError(f"compress={compress!r}; use 'context' (query-agnostic) or 'query' (query-aware)")


def _settle_device(args) -> None:
    """Set ``args.device`` to the device the ``kveval`` model will run on.

    lm-eval records in its results the device it was handed (``--device``, else its config's default ``cuda:0``), not
    the one that ran, and hands that default to the model type as if the user had asked for it: a CPU run warned
    "device=cuda:0 requested but CUDA is not available" and recorded ``"device": "cuda:0"``. A device the user gave
    (``--device``, ``device:`` in ``--config``'s YAML, or ``device=`` in ``--model_args``, which the model takes
    first) is kept, and refused in one line where it names CUDA on a machine without it; with none, the device
    ``auto`` picks (CUDA when present, else the CPU) is given, and recorded.
    """
    model_args = args.model_args if isinstance(getattr(args, "model_args", None), dict) else {}
    in_model_args = model_args.get("device") if model_args.get("device") not in (None, "", "auto") else None
    flag = getattr(args, "device", None) or _config_value(getattr(args, "config", None), "device")
    flag = None if flag == "auto" else flag
    if flag and in_model_args and str(flag) != str(in_model_args):
        raise UsageError(f"--device {flag} and the model argument device={in_model_args} differ; give the device once")
    # imported after main() set HF_HUB_OFFLINE: huggingface_hub reads it once, when transformers first loads it
    from kveval.modeling.sources import resolve_device_dtype

    available, _ = resolve_device_dtype()  # "cuda" where CUDA is available, else "cpu"
    device = str(in_model_args or flag or available)
    if device.startswith("cuda") and available == "cpu":
        raise UsageError(f"device {device} was asked for, but CUDA is not available here; give --device cpu, or no "
                         f"device (kveval then runs on the CPU)")
    args.device = device


def _config_value(path, key: str):
    """``key`` of lm-eval's ``--config`` YAML, or ``None`` (no file: lm-eval says so itself)."""
    if not path or not Path(path).is_file():
        return None
    data = load_yaml(Path(path), "lm-eval config")
    return data.get(key) if isinstance(data, dict) else None


def _fallback(argv: list[str]) -> int:
    from lm_eval.__main__ import cli_evaluate

    if "--include_path" not in argv and tasks_dir() is not None:
        sys.argv = [*sys.argv, "--include_path", str(tasks_dir())]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(run_command("lm-eval", main))
