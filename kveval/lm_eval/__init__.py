"""lm-evaluation-harness integration: the ``kveval`` model type and kveval's task folder.

``--model kveval`` evaluates any causal LM that :func:`kveval.runner.models.load_model`
accepts with its KV cache compressed by a kveval policy
(:class:`kveval.lm_eval.model.KVEvalLM`). kveval declares it as an ``lm_eval.models`` entry point, but no
lm-eval release on the index loads model plugins yet (0.4.13, 0.5.0.dev1: ``docs/lm-eval.md``), so use kveval's
wrapper of the lm-eval CLI, which registers the model type, adds kveval's ``tasks/`` folder and hands lm-eval the
device that runs::

    kveval lm-eval --model kveval \\
        --model_args 'pretrained=smollm2-135m,policy=snapkv(ratio=0.5)+kivi(bits=4),compress=context' \\
        --tasks kveval_passkey --limit 5 --log_samples --output_path runs/lm_eval

(``python -m kveval.lm_eval ...`` is the same command). From Python, call
:func:`register` once before ``lm_eval.simple_evaluate(model="kveval", ...)``, or hand ``simple_evaluate`` a
``KVEvalLM(...)`` (``model=register()(pretrained=..., policy=...)``).

This package module imports nothing heavy; lm-eval and torch load on first use.
"""

from __future__ import annotations

import os
from pathlib import Path

import kveval

__all__ = ["register", "tasks_dir"]


def register():
    """Register the ``kveval`` model type with lm-eval (idempotent); returns the class."""
    from kveval.lm_eval.model import KVEvalLM, register_model_type  # lm-eval is an optional dependency

    register_model_type()
    return KVEvalLM


def _looks_like_kveval_tasks(folder: Path) -> bool:
    if not folder.is_dir():
        return False
    for path in sorted(folder.rglob("*.yaml"))[:200]:
        try:
            if "kveval" in path.name or "kveval" in path.read_text(encoding="utf-8", errors="ignore")[:4000]:
                return True
        except OSError:
            continue
    return False


def tasks_dir() -> Path | None:
    """kveval's lm-eval task folder, or ``None`` when this installation has none.

    Looked up in order: ``$KVEVAL_TASKS``; ``tasks/`` at the root of a source
    checkout (next to the ``kveval`` package); ``kveval/tasks`` inside the
    package (installed layouts that ship the tasks as package data). A folder
    counts only if it holds a YAML that mentions kveval, so an unrelated
    ``site-packages/tasks`` is never picked up.
    """
    package = Path(kveval.__file__).resolve().parent
    candidates = []
    if os.environ.get("KVEVAL_TASKS"):
        candidates.append(Path(os.environ["KVEVAL_TASKS"]).expanduser())
    candidates += [package.parent / "tasks", package / "tasks"]
    for folder in candidates:
        if _looks_like_kveval_tasks(folder):
            return folder
    return None
