"""What fits on a GPU: the largest context at a batch, or the largest batch at a context, once the weights and a
headroom are taken from its memory (:func:`max_fit`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from kveval.errors import UsageError
from kveval.planner.layouts import policy_stack, selection_layers, sequence_layers, stream_layout
from kveval.planner.model_specs import ModelSpec, load_model_spec
from kveval.planner.native import parse_storage
from kveval.planner.native_plans import native_sequence, plans_native
from kveval.planner.units import check_dtype_bytes, check_int, human_bytes, parse_headroom, parse_size
from kveval.values import is_real

if TYPE_CHECKING:
    from kveval.policies.base import PolicyStack

_GIANT = 1 << 50  # a context no model reaches: beyond it the search calls the cache unbounded


@dataclass
class FitResult:
    """The largest ``context`` (at ``batch``) or ``batch`` (at ``context``) whose cache fits.

    ``value`` is that number (0: nothing fits; ``None``: the cache stops growing,
    any context fits). ``cache_budget_bytes`` = GPU x (1 - headroom) - weights.
    ``cache_bytes`` is the cache at the answer.
    """

    solve: str
    value: int | None
    context: int | None
    batch: int
    gpu_bytes: int
    headroom: float
    weights_bytes: int
    weights_estimated: bool
    cache_budget_bytes: int
    cache_bytes: int
    model: str
    policy: str
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def stored_weights(spec: ModelSpec, notes: list[str]) -> tuple[int, bool] | None:
    """``(bytes, estimated)`` of the weights as the checkpoint stores them, where the planner knows it (a GGUF's
    tensors; an FP8 checkpoint's byte per parameter), with a note saying so; ``None`` otherwise."""
    size = spec.weights.bytes_for(spec.num_parameters) if spec.weights is not None else None
    if size is None:
        return None
    how = "" if spec.weights.exact else f"{spec.weights.describe(spec.num_parameters)} "
    notes.append(f"weights {human_bytes(size)}{' estimated' if not spec.weights.exact else ''}: {how}"
                 f"{spec.weights.source}; --weights or --weight-bytes-per-param overrides")
    return size, not spec.weights.exact


def _weights(spec: ModelSpec, weights, weight_bytes_per_param, dtype_bytes: int, notes: list[str]) -> tuple[int, bool]:
    if weights is not None:
        return parse_size(weights, "weights"), False
    if weight_bytes_per_param is None and (stored := stored_weights(spec, notes)) is not None:
        return stored
    if not spec.num_parameters:
        raise UsageError(f"cannot estimate the weights of {spec.name} from its config (mixture of experts, MLA or "
                         f"missing sizes); give them, e.g. --weights 16GB")
    per_param = dtype_bytes if weight_bytes_per_param is None else weight_bytes_per_param
    if not is_real(per_param) or not per_param > 0:
        raise UsageError(f"weight_bytes_per_param={per_param!r} must be a positive number (2 = fp16/bf16, 1 = int8/fp8, 0.5 = int4)")
    size = int(math.ceil(spec.num_parameters * per_param))
    notes.append(f"weights estimated: {spec.num_parameters / 1e9:.2f}e9 parameters x {per_param:g} bytes = {human_bytes(size)}")
    return size, True


def max_fit(model, gpu_memory, weights=None, *, context: int | None = None, batch: int | None = None,
            policy: "PolicyStack | None" = None, dtype_bytes: int = 2, headroom=0.1, new_tokens: int = 0,
            weight_bytes_per_param: float | None = None, storage=None, achieved_ratio: float | None = None) -> FitResult:
    """Largest context (give ``batch`` or nothing: batch 1) or largest batch (give ``context``) that fits.

    Usable cache memory = ``gpu_memory`` x (1 - ``headroom``) - ``weights``.
    ``gpu_memory``/``weights``: bytes or strings such as ``"80GiB"``/``"16GB"``;
    without ``weights``, the checkpoint's own where it is known (:func:`stored_weights`), else parameters x
    ``weight_bytes_per_param`` (default ``dtype_bytes``) when the config allows the count; a given
    ``weight_bytes_per_param`` overrides the checkpoint's. The context answer is the
    largest length whose cache fits at every length up to it (quantization's
    full-precision remainder makes the size dip when a group is sealed). ``achieved_ratio``: as :func:`plan`'s.
    """
    if context is not None and batch is not None:
        raise UsageError("give context (to find the largest batch) or batch (to find the largest context), not both")
    spec = load_model_spec(model)
    gpu = parse_size(gpu_memory, "gpu_memory")
    h = parse_headroom(headroom)
    dtype_bytes = check_dtype_bytes(dtype_bytes)
    new_tokens = check_int(new_tokens, "new_tokens", 0)
    stack = policy_stack(policy)
    notes: list[str] = []
    overrides = parse_storage(storage)
    native = plans_native(spec, stack, overrides) or (stack.is_none and bool(spec.storage))
    layout = None if native else stream_layout(spec, stack, notes)
    weight_bytes, estimated = _weights(spec, weights, weight_bytes_per_param, dtype_bytes, notes)
    budget = math.floor(gpu * (1 - Fraction(repr(h)))) - weight_bytes  # exact: 0.9 x 80 GiB is a whole number
    if budget <= 0:
        notes.append(f"the weights ({human_bytes(weight_bytes)}) leave nothing of {human_bytes(gpu)} less "
                     f"{h:.0%} headroom for the cache")

    def seq_bytes(n: int, sized=stack) -> int:
        if native:
            return sum(layer.bytes for layer in native_sequence(spec, sized, n, new_tokens, dtype_bytes, overrides,
                                                                 [], achieved_ratio)[0])
        return sum(layer.bytes for layer in sequence_layers(spec, sized, layout, n, new_tokens, dtype_bytes,
                                                             achieved_ratio))

    common = dict(gpu_bytes=gpu, headroom=h, weights_bytes=weight_bytes, weights_estimated=estimated,
                  cache_budget_bytes=budget, model=spec.name, policy=stack.spec, notes=notes)
    if context is not None:
        context = check_int(context, "context", 1)
        per_seq = seq_bytes(context)
        value = max(0, budget // per_seq) if budget > 0 else 0
        return FitResult("batch", value, context, value, cache_bytes=value * per_seq, **common)
    batch = check_int(1 if batch is None else batch, "batch", 1)
    limit = budget // batch if budget > 0 else -1
    # A selection on sliding layers, decoding: sized only while nothing it kept can leave the window (the longest
    # such context is ``sizable``); past it, the window bounds the cache at what it holds without the selection.
    windows = [w for w, acts in zip(spec.windows, selection_layers(spec)) if acts and w is not None]
    sizable = _GIANT
    if stack.selection is not None and new_tokens and windows:  # the sliding layers it acts on
        sizable = max(0, min(windows) - new_tokens - 1)
        unselected = dataclasses.replace(stack, selection=None)
        if seq_bytes(_GIANT, unselected) <= limit:
            notes.append(f"the window bounds the cache at {human_bytes(seq_bytes(_GIANT, unselected) * batch)} "
                         f"whatever {stack.selection.spec()} keeps: any context fits")
            return FitResult("context", None, None, batch, cache_bytes=seq_bytes(_GIANT, unselected) * batch, **common)
        if sizable == 0 or seq_bytes(1) > limit:
            return FitResult("context", 0, 0, batch, cache_bytes=0, **common)
        if seq_bytes(sizable) <= limit:
            notes.append(f"{sizable:,} tokens is the longest context sized under {stack.selection.spec()} with "
                         f"{new_tokens} new tokens: past it, which kept tokens leave the {min(windows)}-token window "
                         f"depends on their scores, and the window's bound, without the selection, does not fit")
            return FitResult("context", sizable, sizable, batch, cache_bytes=seq_bytes(sizable) * batch, **common)
    elif seq_bytes(_GIANT) <= limit:
        notes.append(f"the cache stops growing at {human_bytes(seq_bytes(_GIANT) * batch)} (windows or budgets bound "
                     f"every layer): any context fits")
        return FitResult("context", None, None, batch, cache_bytes=seq_bytes(_GIANT) * batch, **common)
    elif seq_bytes(1) > limit:
        return FitResult("context", 0, 0, batch, cache_bytes=0, **common)
    lo, hi = 1, sizable  # seq_bytes(lo) fits, seq_bytes(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if seq_bytes(mid) <= limit:
            lo = mid
        else:
            hi = mid
    # Sealing a per-channel group, or closing a V4 compression window (its buffered tokens become one entry), makes
    # the size dip: make sure every shorter length fits as well.
    coding = stack.quantization.planned_coding() if stack.quantization is not None else None
    span = 0
    if native:
        span = max([rate for _, rate in spec.v4.layers] if spec.v4 is not None else [0]) + 1
        grouped = coding is not None and coding.grouped
        span += max(coding.key.group, coding.value.group) + coding.residual if grouped else 0
    elif coding is not None and layout.coded is None:
        span = max(q.group for _, _, _, q in layout.streams) + layout.residual + 1
    n = lo  # scan down until ``span`` lengths in a row below the answer fit (a dip may hide several periods)
    while span and n >= 1 and n > lo - span:
        if seq_bytes(n) > limit:
            lo = n - 1
        n -= 1
    if spec.max_position and lo + new_tokens > spec.max_position:
        notes.append(f"the largest context ({lo:,} tokens) is beyond the model's max_position_embeddings ({spec.max_position:,})")
    return FitResult("context", lo, lo, batch, cache_bytes=seq_bytes(lo) * batch, **common)


__all__ = ["FitResult", "max_fit", "stored_weights"]
