"""A plan's records (:class:`MemoryPlan`, :class:`LayerPlan`) and the per-layer arithmetic of K/V streams: what each
layer holds under a selection, and the bytes of its streams under a structure and a quantizer's
:meth:`~kveval.policies.base.QuantizationPolicy.planned_coding` (grouped codes with scales, or codes sized per
token, with residual and sink tokens in the cache dtype). See :mod:`kveval.planner.memory` for what it follows."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

from kveval.errors import UnsupportedModelError, UsageError
from kveval.modeling.layer_types import selecting_layers
from kveval.planner.model_specs import ModelSpec
from kveval.planner.native import PartPlan
from kveval.policies.base import Need, PlannedCoding, require_stack
from kveval.policies.compatibility import check_cache, has_indexer_keys, refuse_indexer_term


@dataclass
class LayerPlan:
    """One layer for one sequence: its kind, window, tokens held and bytes."""

    index: int
    kind: str  # "full", "sliding", "mla", "state", "reads N" (layer N's K/V, holding nothing) or "merged with N"
    window: int | None
    tokens: int
    bytes: int


@dataclass
class MemoryPlan:
    """KV-cache size of one model under one policy.

    ``bytes_per_token`` is what one stored token costs over all layers in the
    policy's representation (quantized codes with their amortized scales,
    low-rank coefficients, MLA latent), before selection, windows and the
    full-precision residual; ``key_bytes_per_token``/``value_bytes_per_token``
    split it (MLA: the latent counts as K, the shared RoPE key as V, as the cache holds them; a native plan: all
    as K, and ``bytes_per_token`` is what each further token adds, amortized). ``sequence_bytes`` is the exact
    cache of one sequence of ``context`` tokens (plus ``new_tokens`` generated),
    ``total_bytes`` that times ``batch``; ``baseline_*`` are the same without
    compression. ``layers`` lists every layer for one sequence.
    """

    model: str
    policy: str
    context: int
    batch: int
    dtype_bytes: int
    new_tokens: int
    bytes_per_token: float
    key_bytes_per_token: float
    value_bytes_per_token: float
    baseline_bytes_per_token: int
    sequence_bytes: int
    total_bytes: int
    baseline_sequence_bytes: int
    baseline_total_bytes: int
    layers: list[LayerPlan]
    notes: list[str]
    #: The cache's parts under policy ``none`` (K and V, an MLA latent and RoPE key, V3.2's indexer keys, V4's window,
    #: compressed entries and state), each with its storage and bytes; under a compression policy, those of a
    #: DeepSeek V3.2/V4 cache as kveval holds them (``latent``, ``indexer``, ``window``, ``csa``, ``hca``, ``state``)
    #: and none for other models.
    parts: list[PartPlan] = dataclasses.field(default_factory=list)
    #: Whether the plan is the native cache, part by part (V3.2/V4 layouts, or a ``storage`` override).
    native: bool = False

    @property
    def compression(self) -> float:
        """Uncompressed bytes / compressed bytes at this context."""
        return self.baseline_sequence_bytes / self.sequence_bytes if self.sequence_bytes else math.inf

    @property
    def bytes_per_context_token(self) -> float:
        """Effective bytes per token of the sequence (selection, windows and residual included)."""
        return self.sequence_bytes / (self.context + self.new_tokens)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["compression"] = self.compression
        data["bytes_per_context_token"] = self.bytes_per_context_token
        return data


def policy_stack(policy):
    """The planned stack: a :class:`~kveval.policies.base.PolicyStack` parsed at the edge (``None``: the baseline)."""
    return require_stack(policy, "the memory planner")


@dataclass
class StreamLayout:
    """Per-layer streams: (name, heads, dim, TensorQuant or None), the residual, and the quantizer's coding where its
    codes are sized per token (``coded``: not grouped streams, e.g. KVQuant's codes, outliers and sinks,
    :func:`_token_coded_bytes`)."""

    streams: list[tuple[str, int, int, Any]]
    residual: int
    coded: PlannedCoding | None = None

    def native_layers(self, spec: ModelSpec) -> frozenset[int]:
        """Under codes sized per token: the layers the coding keeps in the cache dtype (:attr:`PlannedCoding.native_layers`)."""
        if self.coded is None or self.coded.native_layers is None:
            return frozenset()
        return self.coded.native_layers(spec.num_layers, not all(spec.holds_kv))

    @property
    def coded_widths(self) -> tuple[int, int, int]:
        """Under codes sized per token: ``(heads, key width, value width)`` of its two streams (an MLA latent and its
        RoPE key differ)."""
        (_, heads, key_dim, _), (_, _, value_dim, _) = self.streams
        return heads, key_dim, value_dim

    def coded_per_token(self, dtype_bytes: int) -> tuple[int, int]:
        """Under codes sized per token: the bytes ``(K, V)`` one coded token holds in a layer, over its heads."""
        heads, key_dim, value_dim = self.coded_widths
        return tuple(heads * b for b in self.coded.token_bytes(key_dim, value_dim, dtype_bytes))


def _token_coded_layout(spec: ModelSpec, stack, coding: PlannedCoding) -> StreamLayout:
    quant = stack.quantization
    if stack.structure is not None and not stack.structure.keeps_head_widths:
        raise UsageError(f"{quant.spec()}: codes K/V heads, not low-rank coefficients")
    if spec.mla_dim is not None:  # as the cache holds MLA: the latent in K's place, the shared RoPE key in V's
        refusal = quant.mla_refusal(spec.name)
        if refusal is not None:
            raise UsageError(refusal)
        if Need.ROPE_HOOK in quant.needs:
            raise UsageError(f"{quant.spec()}: an MLA latent is cached without RoPE, and kveval's cache has no RoPE "
                             f"hook for MLA's shared key to code it before RoPE; plan pre_rope=false")
        streams = [("latent", 1, spec.mla_dim - spec.mla_rope, None), ("rope", 1, spec.mla_rope, None)]
    else:
        streams = [("k", spec.kv_heads, spec.head_dim, None), ("v", spec.kv_heads, spec.head_dim, None)]
    for dim in sorted({dim for _, _, dim, _ in streams if dim}):
        quant.check_head_dim(dim)
    return StreamLayout(streams, int(coding.residual), coding)


def _token_coded_bytes(tokens: int, oldest: int, layout: StreamLayout, dtype_bytes: int) -> int:
    """Bytes of one layer's K/V under codes sized per token (KVQuant's :class:`kveval.stores.kvquant.KVQuantStore`, an
    engine's): the ``residual`` newest tokens and those at positions below ``sink`` in the cache dtype, every other
    token coded (``token_bytes``). ``oldest``: the position of the oldest token held (a sliding layer's window has
    moved past the sinks)."""
    coding = layout.coded
    heads, key_dim, value_dim = layout.coded_widths
    whole = min(tokens, coding.residual) + max(0, min(coding.sink - oldest, tokens - coding.residual))
    coded = tokens - whole
    return heads * (coded * sum(coding.token_bytes(key_dim, value_dim, dtype_bytes))
                    + whole * (key_dim + value_dim) * dtype_bytes)


def stream_layout(spec: ModelSpec, stack, notes: list[str]) -> StreamLayout:
    _check_selection(spec, stack)
    check_planned_cache(spec, stack)
    quant = stack.quantization
    coding = quant.planned_coding() if quant is not None else PlannedCoding()
    if not coding.grouped:  # codes sized per token (KVQuant's, an engine's)
        return _token_coded_layout(spec, stack, coding)
    kq, vq, residual = coding.key, coding.value, coding.residual
    structure = stack.structure
    if spec.mla_dim is not None:
        # As kveval's cache holds MLA: the normed latent in K's place, the shared RoPE key in V's (one "head" each);
        # a structure policy projects them as it projects a K and a V head.
        latent, rope = spec.mla_dim - spec.mla_rope, spec.mla_rope
        if structure is not None:
            widths = structure.planned_widths(1, latent, rope, mla=True)
            latent, rope = widths.k, widths.v
        streams = [("latent", 1, latent, kq)] + ([("rope", 1, rope, vq)] if rope else [])
        if quant is not None:
            notes.append(f"MLA: the latent is quantized with the key settings of {quant.spec()}, the shared RoPE "
                         f"key with its value settings")
    else:
        heads, k_dim, v_dim = spec.kv_heads, spec.head_dim, spec.head_dim
        if structure is not None:
            widths = structure.planned_widths(spec.kv_heads, spec.head_dim, spec.head_dim)
            if widths.k is None or widths.v is None:
                notes.append(f"{structure.spec()}: energy= ranks come from calibration on the model; "
                             f"planned at head_dim {spec.head_dim} (an upper bound) where no rank is given")
            heads, k_dim, v_dim = widths.heads, widths.k or spec.head_dim, widths.v or spec.head_dim
        streams = [("k", heads, k_dim, kq), ("v", heads, v_dim, vq)]
    for which, _, dim, q in streams:
        if q is not None and q.axis == "token" and dim % q.group:
            what = {"latent": "latent width", "rope": "RoPE key width"}.get(which) or ("rank" if dim != spec.head_dim else "head_dim")
            raise UsageError(f"{quant.spec()}: {which} group={q.group} does not divide {what}={dim}; "
                             f"pick a divisor of {dim}")
    return StreamLayout(streams, residual)


def check_planned_cache(spec: ModelSpec, stack) -> None:
    """Refuse, in one line, a quantizer that cannot code this model's cache (its ``check_cache``, as the cache asks)."""
    try:
        check_cache(spec.cache_shape, stack)
    except UnsupportedModelError as refused:  # the planner answers bad input with one UsageError line
        raise UsageError(str(refused)) from None


def stream_bytes(tokens: int, heads: int, dim: int, q, residual: int, dtype_bytes: int,
                  sliding: tuple[int, int, int] | None = None) -> int:
    """Exact bytes of one of K/V (or the MLA latent) holding ``tokens`` tokens in one layer.

    ``sliding``: ``(context, new_tokens, window)`` of a sliding layer, whose per-channel groups the window cuts
    as it moves on while decoding (:func:`_sliding_slots`).
    """
    if q is None or tokens <= 0:
        return heads * tokens * dim * dtype_bytes
    unit = q.group if q.axis == "channel" else 1
    if sliding is not None and unit > 1:
        aged, tail = _sliding_slots(*sliding, residual, unit)
    else:
        aged = max(0, tokens - residual) // unit * unit
        tail = tokens - aged
    groups = heads * (aged // q.group) * dim if q.axis == "channel" else heads * aged * (dim // q.group)
    data = math.ceil(heads * aged * dim * q.bits / 8)
    # + per-tensor scales (NVFP4's FP32), one per stream a sequence holds in the layer: fixed at its first seal
    return data + groups * q.scale_bytes + heads * tail * dim * dtype_bytes + q.global_scale_bytes


@functools.lru_cache(maxsize=4096)
def _sliding_slots(context: int, new_tokens: int, window: int, residual: int, unit: int) -> tuple[int, int]:
    """Quantized and full-precision slots of a sliding layer's per-channel stream (``unit``-token groups), as
    :class:`kveval.stores.quantized.QuantizedSequence` holds them: the prefill keeps its last ``window - 1`` tokens and
    seals whole groups past the ``residual`` newest; each decode step appends a token, seals, then drops the
    oldest live one. A group the window cuts keeps its dead slots until all are dead."""
    held = min(context, window - 1)
    groups = max(0, held - residual) // unit
    first_live, tail = unit, held - groups * unit  # live slots of the oldest group; tokens in full precision
    for _ in range(new_tokens):
        tail += 1
        sealed = max(0, tail - residual) // unit
        if sealed:
            groups, tail = groups + sealed, tail - sealed * unit
            if groups == sealed:
                first_live = unit
        if groups * unit - (unit - first_live) + tail <= window - 1:
            continue  # still within the window
        if groups:  # the oldest live token is in the oldest group
            first_live -= 1
            if first_live == 0:
                groups, first_live = groups - 1, unit
        else:
            tail -= 1
    return groups * unit, tail


def stream_per_token(heads: int, dim: int, q, dtype_bytes: int) -> float:
    """Amortized bytes of one stored token of one stream (scales of per-channel groups spread over ``group`` tokens;
    per-tensor scales, a few bytes per layer whatever the length, left out)."""
    if q is None:
        return heads * dim * dtype_bytes
    data = heads * dim * q.bits / 8
    if q.axis == "channel":
        return data + heads * dim * q.scale_bytes / q.group
    return data + heads * (dim // q.group) * q.scale_bytes


def selection_layers(spec: ModelSpec) -> list[bool]:
    """Per layer: whether a selection acts on it, as in the cache (:func:`~kveval.modeling.layer_types.selecting_layers`:
    full layers, and sliding ones where every layer slides); never a layer without K/V."""
    kv = [i for i, holds in enumerate(spec.holds_kv) if holds]
    chunked = spec.chunked or [False] * spec.num_layers
    out = [False] * spec.num_layers
    for i, acts in zip(kv, selecting_layers([spec.windows[i] for i in kv], [chunked[i] for i in kv])):
        out[i] = acts
    return out


def _check_selection(spec: ModelSpec, stack) -> None:
    """Refuse a selection policy where it acts on no layer (every attention layer chunked), as the cache does, and
    one scored by a model's own indexer (run on the model only)."""
    if stack.selection is not None and Need.INDEXER in stack.selection.needs:  # V4's are sized apart
        raise UsageError(f"{stack.selection.spec()}: scores with DeepSeek V4's lightning indexer over its compressed "
                         f"entries, which {spec.name} does not have; plan a selection of its own (knorm, snapkv, ...)")
    try:
        if not has_indexer_keys(spec.model_type):
            refuse_indexer_term(stack, spec.name)
    except UnsupportedModelError as refused:  # the planner answers bad input with one UsageError line
        raise UsageError(str(refused)) from None
    if stack.selection is not None and not any(selection_layers(spec)):
        raise UsageError(f"{stack.selection.spec()}: every attention layer of {spec.name} is chunked, and selection "
                         f"acts on full-attention or sliding-window layers only; plan a quantization or low-rank policy")


def _layer_tokens(spec: ModelSpec, stack, i: int, context: int, new_tokens: int, selects: bool,
                  achieved_ratio: float | None = None) -> int:
    """Tokens layer ``i`` holds after ``context`` then ``new_tokens``; ``selects``: whether the selection acts on it;
    ``achieved_ratio``: the ratio a run reached, for a selection sized by it
    (:meth:`~kveval.policies.base.SelectionPolicy.planned_keep`)."""
    if not spec.holds_kv[i]:
        return 0
    window = spec.windows[i]
    selection = stack.selection if selects else None
    if selection is None:
        tokens = context + new_tokens
    else:
        held = context if window is None else min(context, window - 1)  # a sliding layer selects in its window
        if window is not None and new_tokens and context + new_tokens >= window:
            raise UsageError(f"{selection.spec()} on {spec.name}'s {window}-token sliding window: which of the tokens "
                             f"it keeps leave the window while decoding depends on their scores, so {context} + "
                             f"{new_tokens} new tokens cannot be sized; plan the prefill alone (new_tokens=0) or a "
                             f"run shorter than the window")
        kept = selection.planned_keep(held, i, spec.num_layers, achieved_ratio=achieved_ratio)
        tokens = kept + new_tokens
        budget = selection.decode_limit  # the budget, and what it may grow by between evictions (decode_interval)
        if new_tokens and budget is not None:
            tokens = min(tokens, max(int(budget), 1))
        whole = selection.whole_head_fraction  # duo: retrieval heads keep every token
        if whole:
            tokens = math.ceil(whole * (held + new_tokens) + (1 - whole) * tokens)  # mean per KV head
    return tokens if window is None else min(tokens, window - 1)  # what transformers' sliding layers keep


def _layer_kinds(spec: ModelSpec) -> list:
    """Each layer's kind as a structure across layers reads it, as the cache does: ``(window, chunked)``, ``None``
    without K/V or beside a state of its own (a hybrid layer: never shared)."""
    chunked = spec.chunked or [False] * spec.num_layers
    hybrid = spec.hybrid or [False] * spec.num_layers
    return [(spec.windows[i], chunked[i]) if holds and not hybrid[i] else None for i, holds in enumerate(spec.holds_kv)]


def reading_layers(spec: ModelSpec, stack) -> dict[int, int]:
    """Layers that store nothing and read another layer's K/V under ``stack``'s structure (reading layer -> source),
    as the cache makes them (:meth:`~kveval.policies.base.StructurePolicy.reused_layers`): attention layers of one
    kind per window and chunking."""
    return {} if stack.structure is None else stack.structure.reused_layers(_layer_kinds(spec))


def merged_layers(spec: ModelSpec, stack) -> dict[int, int]:
    """Pairs of layers merged under ``stack``'s structure, later -> earlier
    (:meth:`~kveval.policies.base.StructurePolicy.merged_layers`: MiniCache)."""
    return {} if stack.structure is None else stack.structure.merged_layers(_layer_kinds(spec))


def merged_stream_bytes(stack, layout: StreamLayout, tokens: int, new_tokens: int,
                        dtype_bytes: int) -> list[tuple[int, int]]:
    """Per stream of the layout (K, V): bytes of a merged pair's earlier and later layer
    (:meth:`~kveval.policies.base.StructurePolicy.merged_bytes`), each of its stores coded as the stack's quantizer
    codes the stream (:func:`stream_bytes`: its groups and residual window; grouped codes, the only ones MiniCache
    stacks with)."""
    def coded(heads: int, dim: int, q):
        return lambda n: stream_bytes(n, heads, dim, q, layout.residual, dtype_bytes)

    return [stack.structure.merged_bytes(tokens, new_tokens, heads, dim, dtype_bytes, coded(heads, dim, q))
            for _, heads, dim, q in layout.streams]


def sequence_layers(spec: ModelSpec, stack, layout: StreamLayout, context: int, new_tokens: int,
                     dtype_bytes: int, achieved_ratio: float | None = None) -> list[LayerPlan]:
    out = []
    selecting = selection_layers(spec) if stack.selection is not None else [False] * spec.num_layers
    reading = reading_layers(spec, stack)
    later = merged_layers(spec, stack)
    pairs = {**{e: (0, f"merged with {l}") for l, e in later.items()}, **{l: (1, f"merged with {e}") for l, e in later.items()}}
    native = layout.native_layers(spec)
    for i, selects in enumerate(selecting):
        if i in reading:  # reads layer reading[i]'s K/V: holds nothing
            out.append(LayerPlan(i, f"reads {reading[i]}", spec.windows[i], 0, 0))
            continue
        if i in pairs:  # a merged pair's earlier (0) or later (1) layer: the prefill tokens a selection kept, merged
            which, kind = pairs[i]
            kept = _layer_tokens(spec, stack, i, context, 0, selects, achieved_ratio)
            size = sum(pair[which] for pair in merged_stream_bytes(stack, layout, kept, new_tokens, dtype_bytes))
            out.append(LayerPlan(i, kind, spec.windows[i], kept + new_tokens, size))
            continue
        tokens = _layer_tokens(spec, stack, i, context, new_tokens, selects, achieved_ratio)
        if i in native:  # kept in the cache dtype by the coding itself
            heads, key_dim, value_dim = layout.coded_widths
            size = tokens * heads * (key_dim + value_dim) * dtype_bytes
        elif layout.coded is not None:
            window = spec.windows[i]  # the oldest position its window still holds, selected or not
            oldest = max(0, context + new_tokens - (window - 1)) if window is not None else 0
            size = _token_coded_bytes(tokens, oldest, layout, dtype_bytes)
        else:
            # A sliding layer's window cuts per-channel groups as it moves on, unless a selection sealed what it
            # kept in the window (where the planner sizes it, nothing it kept leaves the window).
            sliding = (context, new_tokens, spec.windows[i]) if spec.windows[i] is not None and not selects else None
            size = sum(stream_bytes(tokens, heads, dim, q, layout.residual, dtype_bytes, sliding)
                       for _, heads, dim, q in layout.streams)
        kind = ("state" if not spec.holds_kv[i] else "mla" if spec.mla_dim is not None
                else "full" if spec.windows[i] is None else "sliding")
        out.append(LayerPlan(i, kind, spec.windows[i], tokens, size))
    return out


__all__ = ["LayerPlan", "MemoryPlan", "StreamLayout", "merged_layers", "merged_stream_bytes", "policy_stack", "reading_layers", "selection_layers", "sequence_layers",
           "stream_bytes", "stream_layout", "stream_per_token"]
