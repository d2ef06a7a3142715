"""The deployment decision: target context and concurrency -> KV memory -> the GPU's budget -> the policy to ship.

Given a GPU's memory, a context length and a batch (with the memory
planner's headroom, :func:`kveval.memory.max_fit`), the gated runs whose KV
cache fits are named, and among them the most compressed one that PASSes the
gate. ``kveval gate`` and ``kveval sweep`` take ``--gpu-memory --context
--batch``; the line lands in ``gate.md``/``gate.json`` and the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from kveval.gate import PASS, GateResult


@dataclass
class Deployment:
    """Which candidates fit a GPU at a target context and batch, and the most compressed one that PASSes.

    ``fits`` maps run name -> (KV-cache bytes, fits?); ``budget_bytes`` is the
    cache budget (GPU x (1 - headroom) - weights, :func:`kveval.memory.max_fit`).
    """

    gpu_memory: str
    context: int
    batch: int
    headroom: float
    budget_bytes: int
    fits: dict[str, tuple[int, bool]]
    choice: str | None
    line: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def deployment_decision(
    results: GateResult | Sequence[GateResult], gpu_memory: str, context: int, batch: int = 1, headroom: str | float = 0.1
) -> list[Deployment]:
    """For each model: cache bytes of the baseline and every candidate at ``context`` x ``batch``, what fits, and the pick.

    The pick is the PASSing candidate with the smallest planned cache that
    fits; the baseline is the fallback when it fits and nothing compressed
    PASSes.
    """
    from kveval import memory

    out = []
    for r in [results] if isinstance(results, GateResult) else list(results):
        runs = [(r.baseline.name, r.baseline, PASS)] + [(c.name, c.info, c.status) for c in r.candidates if c.info]
        fit0 = memory.max_fit(r.baseline.model, gpu_memory, context=context, headroom=headroom)
        budget = fit0.cache_budget_bytes
        fits: dict[str, tuple[int, bool]] = {}
        for name, info, _ in runs:
            plan = memory.plan(info.model, context, batch, policy=info.policy)
            fits[name] = (int(plan.total_bytes), plan.total_bytes <= budget)
        passing = [(fits[name][0], name) for name, info, status in runs[1:] if status == PASS and fits[name][1]]
        h = memory.human_bytes
        if passing:
            choice = min(passing)[1]
            line = f"deploy {choice}: {h(fits[choice][0])} of KV cache for {batch} x {context} tokens fits the {h(budget)} budget and PASSes"
        elif fits[r.baseline.name][1]:
            choice = r.baseline.name
            line = f"no compressed candidate both fits and PASSes; the baseline fits ({h(fits[choice][0])} of {h(budget)})"
        else:
            choice = None
            line = f"nothing fits: the smallest PASSing cache needs more than the {h(budget)} budget; lower --context or --batch"
        fitting = [n for n, (_, ok) in fits.items() if ok]
        line += f" (fit: {', '.join(fitting) or 'none'})"
        out.append(Deployment(str(gpu_memory), context, batch, float(fit0.headroom), int(budget), fits, choice, line))
        r.deployment = out[-1]
    return out
