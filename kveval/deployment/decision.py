"""The deployment decision: target context and concurrency -> KV memory -> the GPU's budget -> the policy to ship.

Given a GPU's memory, a context length and a batch (with the memory
planner's headroom, :func:`kveval.planner.memory.max_fit`), the gated runs whose KV
cache fits are named, and among them the most compressed one that PASSes the
gate. ``kveval gate`` and ``kveval sweep`` take ``--gpu-memory --context
--batch``; the line lands in ``gate.md``/``gate.json`` and the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from kveval.dtypes import CACHE_DTYPE_BYTES
from kveval.errors import UsageError
from kveval.gate.verdicts import PASS, GateResult
from kveval.planner import memory
from kveval.planner.units import token_count_arg


@dataclass
class Deployment:
    """Which candidates fit a GPU at a target context and batch, and the most compressed one that PASSes.

    ``fits`` maps run name -> (KV-cache bytes, fits?); ``budget_bytes`` is the
    cache budget (GPU x (1 - headroom) - weights, :func:`kveval.planner.memory.max_fit`).
    ``unplanned`` maps the runs the planner cannot size (their policy or model)
    to why: they are left out of the pick, named in ``line``, and never turn
    the gate's verdicts into an error.
    """

    gpu_memory: str
    context: int
    batch: int
    headroom: float
    budget_bytes: int
    fits: dict[str, tuple[int, bool]]
    choice: str | None
    line: str
    unplanned: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _element_bytes(info) -> int:
    """Bytes per cached value of the run's cache dtype (2, a 16-bit cache, where the run records none)."""
    name = str(info.kv_dtype or "bfloat16").removeprefix("torch.")
    if name not in CACHE_DTYPE_BYTES:
        raise UsageError(f"kv_dtype {name!r} is not a cache dtype ({', '.join(CACHE_DTYPE_BYTES)})")
    return CACHE_DTYPE_BYTES[name]


def add_deployment_arguments(parser) -> None:
    """The deployment question's options, as ``kveval gate``, ``sweep`` and ``rescore`` take them (:func:`deployment_of`)."""
    deploy = parser.add_argument_group("deployment decision")
    deploy.add_argument("--gpu-memory", help="GPU memory, e.g. 80GiB: name the policies whose cache fits and the one to deploy")
    deploy.add_argument("--context", type=token_count_arg("--context"),
                        help="target context tokens, e.g. 32768 or 32k (with --gpu-memory)")
    deploy.add_argument("--batch", type=int, default=1, help="concurrent sequences (with --gpu-memory; default 1)")
    deploy.add_argument("--headroom", default="0.1", help="fraction of the GPU kept free (default 0.1)")
    deploy.add_argument("--weights", help="model weight bytes, e.g. 16GB (default: parameters x 2 bytes, where the "
                                          "planner can count them)")


def deployment_of(args) -> dict | None:
    """The deployment question :func:`add_deployment_arguments`' options ask, checked before anything runs
    (``None``: none asked); the keyword arguments of :func:`deployment_decision`."""
    if args.gpu_memory and not args.context:
        raise UsageError("--gpu-memory needs --context (target tokens per sequence) and optionally --batch")
    if not args.gpu_memory:
        return None
    deploy = {"gpu_memory": args.gpu_memory, "context": args.context, "batch": args.batch, "headroom": args.headroom,
              "weights": args.weights}
    check_deployment_inputs(**deploy)
    return deploy


def check_deployment_inputs(gpu_memory: str, context: int, batch: int = 1, headroom: str | float = 0.1,
                            weights: str | None = None) -> float:
    """Refuse a deployment question that cannot be asked (``ValueError``, one line), before a sweep or gate runs;
    the headroom as a fraction."""
    memory.parse_size(gpu_memory, "gpu_memory")
    if weights is not None:
        memory.parse_size(weights, "weights")
    memory.check_int(context, "context", 1)
    memory.check_int(batch, "batch", 1)
    return memory.parse_headroom(headroom)


def deployment_decision(
    results: GateResult | Sequence[GateResult], gpu_memory: str, context: int, batch: int = 1,
    headroom: str | float = 0.1, weights: str | None = None,
) -> list[Deployment]:
    """For each model: cache bytes of the baseline and every candidate at ``context`` x ``batch``, what fits, and the pick.

    The pick is the PASSing candidate with the smallest planned cache that
    fits; the baseline is the fallback when it fits and nothing compressed
    PASSes. ``weights``: the model's weight bytes (``"16GB"``; default: its
    parameters x 2 bytes, where the planner can count them). Bad numbers raise
    ``ValueError`` before anything is decided; a model the planner cannot size
    (no parameter count for its weights, a baseline policy it does not model)
    gets a "not decided" line, and the gate's verdicts stand.
    """
    fraction = check_deployment_inputs(gpu_memory, context, batch, headroom, weights)
    out = []
    for r in [results] if isinstance(results, GateResult) else list(results):
        try:
            decided = _decide(r, memory, gpu_memory, context, batch, fraction, weights)
        except ValueError as exc:
            decided = Deployment(str(gpu_memory), context, batch, fraction, 0, {}, None,
                                 f"{r.baseline.model}: deployment not decided: {exc}")
        out.append(decided)
        r.deployment = decided
    return out


def _decide(r: GateResult, memory, gpu_memory: str, context: int, batch: int, headroom: float,
            weights: str | None) -> Deployment:
    from kveval.runner.runspec import recorded_policy  # the policy registry loads torch: only once a question is asked

    runs = [(r.baseline.name, r.baseline, PASS)] + [(c.name, c.info, c.status) for c in r.candidates if c.info]
    budget = memory.max_fit(r.baseline.model, gpu_memory, weights, context=context, headroom=headroom).cache_budget_bytes
    fits: dict[str, tuple[int, bool]] = {}
    unplanned: dict[str, str] = {}
    for name, info, _ in runs:
        try:
            # run.json records the policy as its spec: read once, where the decision loads the run
            stack = recorded_policy(info)
            plan = memory.plan(info.model, context, batch, policy=stack, dtype_bytes=_element_bytes(info),
                               achieved_ratio=info.achieved_ratio.get("mean"))  # a threshold is sized at it
        except ValueError as exc:  # a policy the planner does not model, or one that does not fit the model
            unplanned[name] = str(exc)
            continue
        fits[name] = (int(plan.total_bytes), plan.total_bytes <= budget)
    if r.baseline.name in unplanned:
        raise UsageError(f"cannot plan the baseline's cache ({unplanned[r.baseline.name]})")
    passing = [(fits[name][0], name) for name, info, status in runs[1:] if status == PASS and name in fits
               and fits[name][1]]
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
    if unplanned:
        line += f"; not sized by the planner, so not picked: {', '.join(unplanned)}"
    return Deployment(str(gpu_memory), context, batch, headroom, int(budget), fits, choice, line, unplanned)
