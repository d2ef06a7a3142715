"""The regression gate: its rules, its verdicts, its config and its reports (the deployment decision that reads
the verdicts is :mod:`kveval.deployment`).

This package is also the Python API's ``kveval.gate``: calling it judges runs, ``kveval.gate(baseline, candidates,
config="cpu")`` (:func:`gate`). A function could not hold that name, since importing any ``kveval.gate.*`` module
sets the attribute ``kveval.gate`` to this package; so the package itself is callable (its module type,
:class:`GatePackage`, calls :func:`gate`), and ``kveval.gate.rules`` and the rest stay where they are.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Sequence

from kveval.gate.config import DEFAULT_GATE, GateConfig, load_gate_config
from kveval.gate.rules import evaluate_gate
from kveval.gate.verdicts import GateResult


def gate(baseline: str | os.PathLike, candidates: str | os.PathLike | Sequence[str | os.PathLike],
         config: str | os.PathLike | dict | GateConfig | None = DEFAULT_GATE, *, metric: str | None = None,
         noise_floor: str | os.PathLike | None = None) -> GateResult:
    """Judge each candidate run against the baseline run, item by item, as ``kveval gate`` does (runs -> verdicts).

    Parameters
    ----------
    baseline, candidates
        Run folders (``kveval eval``'s, a sweep's ``runs/<model>/<policy>``, or lm-eval ``--log_samples`` outputs);
        one candidate or several.
    config
        The gate's rules: a shipped gate's name (``"default"``, margin 0.05; ``"cpu"``, margin 0.10), the path of a
        gate YAML, a mapping of its settings or a :class:`~kveval.gate.config.GateConfig`.
    metric
        lm-eval outputs: the metric to score by.
    noise_floor
        The baseline run again in another batch arrangement: its flips are shown beside every candidate's.

    Returns
    -------
    GateResult
        ``status`` (PASS, FAIL or INCONCLUSIVE), ``exit_code`` (0, 1, 3) and ``candidates``, one
        :class:`~kveval.gate.verdicts.CandidateVerdict` each (``status``, ``tasks``, ``line()``: its verdict in one
        line); :func:`kveval.gate.report.write_gate_outputs` writes ``gate.md``, ``gate.xml`` and ``gate.json``.
    """
    runs = [candidates] if isinstance(candidates, (str, os.PathLike)) else list(candidates)
    return evaluate_gate(load_gate_config(config), baseline, runs, metric=metric, noise_floor=noise_floor)


class GatePackage(types.ModuleType):
    """The module type of :mod:`kveval.gate`: calling the package calls :func:`gate`."""

    def __call__(self, *args, **kwargs) -> GateResult:
        return gate(*args, **kwargs)


sys.modules[__name__].__class__ = GatePackage

__all__ = ["GatePackage", "gate"]
