"""KV-cache memory planning: bytes per token, per sequence, and what fits on a GPU (the command: :mod:`kveval.commands.memory`).

Everything is arithmetic on a model's config; no weights are loaded. A model is
(:mod:`kveval.planner.model_specs`) a named preset (:data:`~kveval.planner.model_specs.PRESETS`), a local ``config.json`` (or a folder holding
one), a Hugging Face Hub id (read with ``transformers.AutoConfig``; offline it
works only when the config is cached), a ``dict`` or a ``PretrainedConfig``.

What the arithmetic follows
---------------------------
* Attention layout: ``num_key_value_heads`` K/V heads (GQA/MQA; default
  ``num_attention_heads``) of ``head_dim`` (default ``hidden_size //
  num_attention_heads``), K and V per layer.
* Sliding-window layers hold at most ``window - 1`` tokens, as transformers' own
  and kveval's cache do: from ``layer_types`` (``"sliding_attention"``;
  ``"chunked_attention"``'s window is ``attention_chunk_size``),
  else ``sliding_window`` with ``sliding_window_pattern`` (Gemma 2/3 convention:
  layer ``i`` is full-attention when ``(i + 1) % pattern == 0``; Gemma 3 defaults
  to 6, Gemma 2 to 2), else ``sliding_window`` alone on every layer (Mistral-7B
  v0.1); ``use_sliding_window: false`` (Qwen2) switches it off.
* MLA (DeepSeek-V2/V3: ``kv_lora_rank``): each layer caches one latent of
  ``kv_lora_rank + qk_rope_head_dim`` values per token, shared by all heads.
* DeepSeek-V3.2's indexer keys and DeepSeek-V4's compressed layout (sliding window, CSA and HCA entries, indexer
  entries, pending-window state) are planned as their own cache holds them, part by part, for policy ``none``
  (:mod:`kveval.planner.native`); ``storage=`` sets how each part is stored (FP8 with scales, FP4, BF16, ...).
  Every plan of policy ``none`` lists its cache's parts (``MemoryPlan.parts``). Under a compression policy these
  models' caches are planned as kveval's cache holds them, part by part (:func:`_native_policy_layers`).
* Policies (``kveval policies``), as :mod:`kveval.cache.compressed` stores them:

  - selection keeps ``keep_count(context, layer, num_layers)`` tokens per layer
    (PyramidKV's budgets differ per layer: the planner sums the layers); with
    ``new_tokens`` generated, a ``decode_budget`` caps the cache. As in the
    cache, selection skips sliding layers (they are bounded already: a sliding
    layer holds ``window - 1`` tokens, as transformers' own does), unless every
    attention layer slides (Mistral-7B-v0.1): it then keeps ``keep_count`` of
    the ``window - 1`` tokens each holds, where nothing it kept can leave the
    window (no new tokens, or a run shorter than the window; otherwise which
    ones leave depends on their scores, and the plan is refused); Mamba and
    linear-attention layers hold no K/V;
  - low-rank structure stores ``k_rank`` + ``v_rank`` coefficients per KV head
    instead of ``2 x head_dim`` values (``energy=`` ranks need a calibration
    run: the planner uses ``head_dim``, an upper bound, and says so);
  - quantization (:mod:`kveval.tensors.quantization`, :mod:`kveval.stores.base`): codes
    packed ``8 / bits`` per byte, a float16 scale per group plus a float16 zero
    point unless symmetric (FP8: scale only); per-token groups are ``group``
    channels of one token, per-channel groups ``group`` tokens of one channel
    (only whole groups are quantized, the remainder stays in full precision);
    the ``residual`` most recent tokens stay in the model dtype.

Weights, activations and allocator slack are not part of the cache: ``max_fit``
subtracts the weights (given, or parameters x bytes per parameter) and keeps a
``headroom`` fraction of the GPU free for the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from kveval.errors import UnsupportedModelError, UsageError
from kveval.modeling.layer_types import selecting_layers
from kveval.planner.model_specs import ModelSpec, load_model_spec
from kveval.planner.native import PartPlan, native_layers, parse_storage, storages
from kveval.policies.base import Need, PlannedCoding, PolicyStack, require_stack
from kveval.policies.compatibility import check_policy, part_coding
from kveval.values import is_real, is_whole

_GIANT = 1 << 50  # a context no model reaches: beyond it the search calls the cache unbounded


# ----------------------------------------------------------------------------------------------
# the plan

@dataclass
class LayerPlan:
    """One layer for one sequence: its kind, window, tokens held and bytes."""

    index: int
    kind: str  # "full", "sliding" or "mla"
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


def _policy_stack(policy):
    """The planned stack: a :class:`~kveval.policies.base.PolicyStack` parsed at the edge (``None``: the baseline)."""
    return require_stack(policy, "the memory planner")


def check_int(value, what: str, minimum: int) -> int:
    """``value`` when it is a whole number of at least ``minimum``; else ``ValueError`` (one line) naming ``what``."""
    if not is_whole(value):
        raise UsageError(f"{what}={value!r} must be an integer")
    if value < minimum:
        raise UsageError(f"{what}={value} must be >= {minimum}")
    return value


@dataclass
class _Layout:
    """Per-layer streams: (name, heads, dim, TensorQuant or None), the residual, and the quantizer's coding where its
    codes are sized per token (``coded``: not grouped streams, e.g. KVQuant's codes, outliers and sinks,
    :func:`_token_coded_bytes`)."""

    streams: list[tuple[str, int, int, Any]]
    residual: int
    coded: PlannedCoding | None = None

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


def _token_coded_layout(spec: ModelSpec, stack, coding: PlannedCoding) -> _Layout:
    quant = stack.quantization
    if stack.structure is not None:
        raise UsageError(f"{quant.spec()}: codes K/V heads, not low-rank coefficients")
    if spec.mla_dim is not None:  # as the cache holds MLA: the latent in K's place, the shared RoPE key in V's
        if Need.ROPE_HOOK in quant.needs:
            raise UsageError(f"{quant.spec()}: an MLA latent is cached without RoPE, and kveval's cache has no RoPE "
                             f"hook for MLA's shared key to code it before RoPE; plan pre_rope=false")
        streams = [("latent", 1, spec.mla_dim - spec.mla_rope, None), ("rope", 1, spec.mla_rope, None)]
    else:
        streams = [("k", spec.kv_heads, spec.head_dim, None), ("v", spec.kv_heads, spec.head_dim, None)]
    for dim in sorted({dim for _, _, dim, _ in streams if dim}):
        quant.check_head_dim(dim)
    return _Layout(streams, int(coding.residual), coding)


def _token_coded_bytes(tokens: int, oldest: int, layout: _Layout, dtype_bytes: int) -> int:
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


def _layout(spec: ModelSpec, stack, notes: list[str]) -> _Layout:
    _check_selection(spec, stack)
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
    return _Layout(streams, residual)


def _scale_bytes(q) -> int:
    """Bytes of scale (+ zero point) per quantization group."""
    return 2 if (q.fp8 is not None or q.symmetric) else 4


def _stream_bytes(tokens: int, heads: int, dim: int, q, residual: int, dtype_bytes: int,
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
    return data + groups * _scale_bytes(q) + heads * tail * dim * dtype_bytes


@functools.lru_cache(maxsize=4096)
def _sliding_slots(context: int, new_tokens: int, window: int, residual: int, unit: int) -> tuple[int, int]:
    """Quantized and full-precision slots of a sliding layer's per-channel stream (``unit``-token groups), as
    :class:`kveval.stores.base.QuantizedSequence` holds them: the prefill keeps its last ``window - 1`` tokens and
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


def _stream_per_token(heads: int, dim: int, q, dtype_bytes: int) -> float:
    """Amortized bytes of one stored token of one stream (scales of per-channel groups spread over ``group`` tokens)."""
    if q is None:
        return heads * dim * dtype_bytes
    data = heads * dim * q.bits / 8
    if q.axis == "channel":
        return data + heads * dim * _scale_bytes(q) / q.group
    return data + heads * (dim // q.group) * _scale_bytes(q)


def _selecting(spec: ModelSpec) -> list[bool]:
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
    if stack.selection is not None and not any(_selecting(spec)):
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


def _sequence_layers(spec: ModelSpec, stack, layout: _Layout, context: int, new_tokens: int,
                     dtype_bytes: int, achieved_ratio: float | None = None) -> list[LayerPlan]:
    out = []
    selecting = _selecting(spec) if stack.selection is not None else [False] * spec.num_layers
    for i, selects in enumerate(selecting):
        tokens = _layer_tokens(spec, stack, i, context, new_tokens, selects, achieved_ratio)
        if layout.coded is not None:
            window = spec.windows[i]  # the oldest position its window still holds, selected or not
            oldest = max(0, context + new_tokens - (window - 1)) if window is not None else 0
            size = _token_coded_bytes(tokens, oldest, layout, dtype_bytes)
        else:
            # A sliding layer's window cuts per-channel groups as it moves on, unless a selection sealed what it
            # kept in the window (where the planner sizes it, nothing it kept leaves the window).
            sliding = (context, new_tokens, spec.windows[i]) if spec.windows[i] is not None and not selects else None
            size = sum(_stream_bytes(tokens, heads, dim, q, layout.residual, dtype_bytes, sliding)
                       for _, heads, dim, q in layout.streams)
        kind = ("state" if not spec.holds_kv[i] else "mla" if spec.mla_dim is not None
                else "full" if spec.windows[i] is None else "sliding")
        out.append(LayerPlan(i, kind, spec.windows[i], tokens, size))
    return out


def _check_dtype_bytes(dtype_bytes) -> int:
    if not is_whole(dtype_bytes) or dtype_bytes not in (1, 2, 4, 8):
        raise UsageError(f"dtype_bytes={dtype_bytes!r} must be 1, 2 (fp16/bf16), 4 (fp32) or 8")
    return dtype_bytes


def _native(spec: ModelSpec, stack, overrides: dict[str, str]) -> bool:
    """Whether the plan is the native cache part by part (DeepSeek V3.2/V4's layouts, or a storage override); a
    storage override is refused under a compression policy, whose coding says how each part is stored, and so is
    what kveval's cache refuses on these models (:func:`kveval.policies.compatibility.check_policy`, checked here
    once for a plan or a fit)."""
    if not (spec.native_only or overrides):
        return False
    if not stack.is_none and overrides:
        raise UsageError(f"{stack.spec}: storage overrides size the native cache (policy none); under a policy its "
                         f"own coding stores each part: drop --storage")
    if not stack.is_none:
        indexer_types = ["full" if spec.keeps_indexer(i) else "shared" for i in range(spec.num_layers)]
        try:
            check_policy({"model_type": spec.model_type, "indexer_types": indexer_types}, stack)
        except UnsupportedModelError as refused:  # the planner answers bad input with one UsageError line
            raise UsageError(str(refused)) from None
        if stack.quantization is not None and spec.v4 is not None:
            stack.quantization.check_head_dim(spec.head_dim)  # an explicit group that does not divide the entries
    return True


def _native_sequence(spec: ModelSpec, stack, context: int, new_tokens: int, dtype_bytes: int,
                     overrides: dict[str, str], notes: list[str],
                     achieved_ratio: float | None = None) -> tuple[list[LayerPlan], list[PartPlan]]:
    """The native cache of one sequence, per layer and per part: the model's own under policy ``none``, kveval's
    under a policy (:func:`_native_policy_layers`)."""
    if not stack.is_none:
        return _native_policy_layers(spec, stack, context, new_tokens, dtype_bytes, notes, achieved_ratio)
    layers, parts = native_layers(spec, context + new_tokens, dtype_bytes, overrides)
    return [LayerPlan(n.index, n.kind, n.window, n.tokens, n.bytes) for n in layers], parts


def _native_plan(spec: ModelSpec, stack, context: int, batch: int, dtype_bytes: int, new_tokens: int,
                 overrides: dict[str, str], notes: list[str], achieved_ratio: float | None = None) -> MemoryPlan:
    layers, parts = _native_sequence(spec, stack, context, new_tokens, dtype_bytes, overrides, notes, achieved_ratio)
    if stack.is_none:
        base_layers, base_parts = native_layers(spec, context + new_tokens, dtype_bytes, overrides)
    else:  # what the policy is measured against: kveval's own cache under none, in the cache dtype
        base_layers, base_parts = _native_policy_layers(spec, PolicyStack(), context, new_tokens, dtype_bytes, [])
        if spec.storage:
            served = sum(layer.bytes for layer in native_layers(spec, context + new_tokens, dtype_bytes)[0])
            notes.append(f"uncompressed here: the cache dtype ({dtype_bytes} bytes per value), as kveval measures "
                         f"policy none; as {spec.name} is served ({', '.join(f'{k} {v}' for k, v in spec.storage.items())}) "
                         f"its cache holds {human_bytes(served)} (plan policy none)")
    seq, base = sum(layer.bytes for layer in layers), sum(layer.bytes for layer in base_layers)
    growth = sum(part.growth_per_token for part in parts)
    base_growth = sum(part.growth_per_token for part in base_parts)
    if spec.max_position and context + new_tokens > spec.max_position:
        notes.append(f"{context + new_tokens:,} tokens exceed the model's max_position_embeddings ({spec.max_position:,})")
    return MemoryPlan(model=spec.name, policy=stack.spec, context=context, batch=batch, dtype_bytes=dtype_bytes,
                      new_tokens=new_tokens, bytes_per_token=growth, key_bytes_per_token=growth,
                      value_bytes_per_token=0.0, baseline_bytes_per_token=math.ceil(base_growth), sequence_bytes=seq,
                      total_bytes=seq * batch, baseline_sequence_bytes=base, baseline_total_bytes=base * batch,
                      layers=layers, notes=notes, parts=parts, native=True)


# --- a policy on a native cache, as kveval's cache holds it --------------------------------------------------------

@dataclass(frozen=True)
class _PartCoding:
    """How kveval codes one part of keys alone (:func:`kveval.cache.native_layers.part_codes`), as
    :func:`kveval.policies.compatibility.part_coding` describes it: grouped codes (``coding.key``), codes sized per
    token (``coding.token_bytes``: an entry's bytes, its sinks and residual in the cache dtype), or the cache dtype
    (neither); the ``residual`` newest entries stay uncoded."""

    coding: PlannedCoding = PlannedCoding()

    @property
    def residual(self) -> int:
        return self.coding.residual

    @property
    def label(self) -> str:
        """The storage column: ``dtype`` (uncoded), ``kvquant4``, ``int4/64``, ``int2/32ch`` (per channel), ``fp8-e4m3/128``."""
        if not self.coding.grouped:
            return self.coding.label
        return "dtype" if self.coding.key is None else self.coding.key.label

    @property
    def sealed_before_selection(self) -> bool:
        """Whether the bytes a selection leaves depend on which entries it keeps: a part's entries are coded after
        its forward's attention, before the prefill is compressed, so a per-channel group keeps evicted slots and an
        evicted entry may be a coded or an uncoded one (the residual window's, the sinks aside)."""
        key = self.coding.key
        return self.residual > 0 or (key is not None and key.axis == "channel")

    def per_entry(self, width: int, dtype_bytes: int) -> float:
        """Bytes of one coded entry, amortized (a per-channel group's scales over its entries)."""
        if not self.coding.grouped:
            return self.coding.token_bytes(width, 0, dtype_bytes)[0]
        return _stream_per_token(1, width, self.coding.key, dtype_bytes)

    def bytes(self, n: int, width: int, dtype_bytes: int, first: int = 0, stride: int = 1,
              sliding: "tuple[int, int, int] | None" = None) -> int:
        """Bytes of ``n`` held entries of ``width`` values; the oldest starts at token ``first``, one entry per
        ``stride`` tokens (sinks: entries whose window starts below ``sink``). ``sliding``: a sliding
        window's ``(context, new_tokens, window)``, whose per-channel groups it cuts as it moves."""
        if not self.coding.grouped:
            sinks = max(0, min(n, math.ceil((self.coding.sink - first) / stride)))
            whole = min(n, self.residual) + max(0, min(sinks, n - self.residual))
            coded = self.coding.token_bytes(width, 0, dtype_bytes)[0]
            return (n - whole) * coded + whole * width * dtype_bytes
        return _stream_bytes(n, 1, width, self.coding.key, self.residual, dtype_bytes, sliding)


def _part_coding(quant, part: str, width: int) -> _PartCoding:
    """The coding of ``part`` (``width`` values an entry) under quantizer ``quant``, as the cache's
    (:func:`kveval.cache.native_layers.part_codes`)."""
    return _PartCoding(part_coding(quant, part, width))


def _native_policy_layers(spec: ModelSpec, stack, context: int, new_tokens: int, dtype_bytes: int,
                          notes: list[str], achieved_ratio: float | None = None) -> tuple[list[LayerPlan], list[PartPlan]]:
    """kveval's cache of a DeepSeek V3.2 (GLM MoE-DSA) or V4 model under ``stack``, part by part, as
    :mod:`kveval.cache.native_layers` holds it (parts named as ``kveval generate`` prints them):

    * V3.2: ``latent``, the latent and RoPE key as V2/V3's (K's and V's coding, a selection's kept tokens), and
      ``indexer``, the keys of the same tokens in the layers that keep them, coded as a part of keys alone;
    * V4: ``window``, every layer's newest ``window - 1`` K=V entries, stored once and coded as keys (transformers'
      sliding-only layers hold them twice: the native cache the policy is compared with); ``csa``/``hca``, one
      entry per ``rate`` tokens, of which a selection keeps its share of the prefill's, with CSA's ``indexer``
      entries alongside; the compressors' pending tokens and CSA's overlap (``state``) as the native cache holds
      them.

    The stack has passed :func:`_native`'s checks; refused here in one line: a selection over parts coded before
    it acts with per-channel groups or a residual window (their bytes depend on which entries it keeps)."""
    selection, quant = stack.selection, stack.quantization
    parts: dict[str, list] = {}  # name -> [layers, entries, bytes, width, growth per token, storage]
    layers: list[LayerPlan] = []

    def add(name: str, n: int, size: int, width: int, growth: float, storage: str = "dtype") -> None:
        entry = parts.setdefault(name, [0, 0, 0, width, 0.0, storage])
        entry[0] += 1
        entry[1] += n
        entry[2] += size
        entry[4] += growth

    def sized(part: str, coded: _PartCoding) -> _PartCoding:
        """``coded``, for a part a selection acts on after its entries were coded (every part these layers hold
        but V4's window); refused where the bytes it leaves depend on which entries it keeps."""
        if selection is not None and coded.sealed_before_selection:
            raise UsageError(
                f"{stack.spec}: its {part} entries are coded before {selection.spec()} acts, with "
                f"{'a residual window' if coded.residual else 'per-channel groups'}, so the bytes it leaves depend "
                f"on which entries it keeps; plan the selection with a per-token quantizer and residual=0, or each "
                f"alone")
        return coded

    def coding(part: str, width: int) -> _PartCoding:
        return sized(part, _part_coding(quant, part, width))

    tokens = context + new_tokens
    if spec.v4 is None:  # V3.2: the latent as MLA's, the indexer keys of the tokens it holds
        layout = _layout(spec, stack, notes)
        for _, _, _, q in layout.streams:  # the latent's K coding and its RoPE key's V coding
            sized("latent", _PartCoding(layout.coded or PlannedCoding(q, residual=layout.residual)))
        latent = _sequence_layers(spec, stack, layout, context, new_tokens, dtype_bytes, achieved_ratio)
        indexer = coding("indexer", spec.indexer_dim)
        if layout.coded is not None:
            latent_growth = sum(layout.coded_per_token(dtype_bytes))
        else:
            latent_growth = sum(_stream_per_token(heads, dim, q, dtype_bytes) for _, heads, dim, q in layout.streams)
        for layer in latent:
            layers.append(layer)
            add("latent", layer.tokens, layer.bytes, spec.mla_dim, latent_growth,
                _part_coding(quant, "latent", spec.mla_dim - spec.mla_rope).label)
            if spec.keeps_indexer(layer.index):
                size = indexer.bytes(layer.tokens, spec.indexer_dim, dtype_bytes)
                layers[-1] = dataclasses.replace(layer, bytes=layer.bytes + size)
                add("indexer", layer.tokens, size, spec.indexer_dim, indexer.per_entry(spec.indexer_dim, dtype_bytes),
                    indexer.label)
    else:
        v4 = spec.v4
        native = native_layers(spec, tokens, dtype_bytes)[0]
        held = min(tokens, v4.window - 1)
        window = _part_coding(quant, "window", spec.head_dim)  # no selection acts on the window
        for (kind, rate), own in zip(v4.layers, native):
            sizes = {"window": window.bytes(held, spec.head_dim, dtype_bytes, first=tokens - held,
                                            sliding=(context, new_tokens, v4.window))}
            add("window", held, sizes["window"], spec.head_dim, 0.0, window.label)
            if kind != "sliding":
                emitted, before = tokens // rate, context // rate
                # HCA has no indexer: a selection scored by it leaves HCA's entries (as the cache's layer does)
                scores = selection is not None and not (Need.INDEXER in selection.needs and kind == "hca")
                kept = (min(before, selection.planned_keep(before, own.index, spec.num_layers,
                                                           achieved_ratio=achieved_ratio)) if scores else before)
                n = kept + emitted - before
                series = [(kind, spec.head_dim)] + ([("indexer", v4.index_dim)] if kind == "csa" else [])
                for part, width in series:
                    coded = coding(part, width)
                    sizes[part] = coded.bytes(n, width, dtype_bytes, stride=rate)
                    add(part, n, sizes[part], width, coded.per_entry(width, dtype_bytes) / rate, coded.label)
                sizes["state"] = own.parts["state"]
                add("state", own.parts["state"] // dtype_bytes, own.parts["state"], 1, 0.0)
            layers.append(LayerPlan(own.index, kind, v4.window, tokens, sum(sizes.values())))
        notes.append("kveval's cache: every layer's K=V window stored once (transformers' sliding-only layers hold "
                     "it twice); the state uncoded, in the cache dtype")
    sinks = quant.planned_coding().sink if quant is not None else 0
    if selection is not None and sinks:
        notes.append(f"{quant.spec()}: the entries of the first {sinks} token(s) are counted as kept in the "
                     f"cache dtype; {selection.spec()} may evict them")
    order = ("latent", "window", "csa", "indexer", "hca", "state")  # as kveval generate prints them
    plans = [PartPlan(name, storage, n_layers, width, math.ceil(size / entries) if entries else 0, entries, size,
                      growth) for name, (n_layers, entries, size, width, growth, storage)
             in sorted(parts.items(), key=lambda item: order.index(item[0]))]
    return layers, plans


def plan(model, context: int, batch: int = 1, policy: "PolicyStack | None" = None, dtype_bytes: int = 2, new_tokens: int = 0,
         storage=None, achieved_ratio: float | None = None) -> MemoryPlan:
    """KV-cache bytes of ``batch`` sequences of ``context`` tokens (plus ``new_tokens`` generated) under ``policy``.

    ``model``: preset name, ``config.json`` path or folder, Hub id, dict, ``PretrainedConfig`` or :class:`ModelSpec`.
    ``storage``: per-part storage formats for policy ``none`` (``"indexer=fp8-128"``, ``{"all": "bf16"}``;
    :data:`kveval.planner.native.FORMATS`), over the model's own (a preset's ``kv_storage``) and the dtype.
    ``achieved_ratio``: the fraction removed that a run of the policy reached on average, for a selection whose
    kept count its scores decide (a threshold: refused without it).
    Raises ``ValueError`` (one line) for unknown models, bad numbers or a policy that does not fit the model.
    """
    spec = load_model_spec(model)
    context = check_int(context, "context", 1)
    batch = check_int(batch, "batch", 1)
    new_tokens = check_int(new_tokens, "new_tokens", 0)
    dtype_bytes = _check_dtype_bytes(dtype_bytes)
    stack = _policy_stack(policy)
    notes = list(spec.notes)
    overrides = parse_storage(storage)
    if _native(spec, stack, overrides) or (stack.is_none and spec.storage):
        return _native_plan(spec, stack, context, batch, dtype_bytes, new_tokens, overrides, notes, achieved_ratio)
    layout = _layout(spec, stack, notes)
    base_layout = _layout(spec, _policy_stack(None), [])
    layers = _sequence_layers(spec, stack, layout, context, new_tokens, dtype_bytes, achieved_ratio)
    base_layers = _sequence_layers(spec, PolicyStack(), base_layout, context, new_tokens, dtype_bytes)
    kv_layers = sum(spec.holds_kv)
    if layout.coded is not None:  # coded K and V of their widths
        per_stream = [b * kv_layers for b in layout.coded_per_token(dtype_bytes)]
    else:
        per_stream = [_stream_per_token(heads, dim, q, dtype_bytes) * kv_layers for _, heads, dim, q in layout.streams]
    key_pt = per_stream[0]
    value_pt = per_stream[1] if len(per_stream) > 1 else 0.0
    base_pt = int(sum(_stream_per_token(h, d, None, dtype_bytes) for _, h, d, _ in base_layout.streams) * kv_layers)
    if spec.max_position and context + new_tokens > spec.max_position:
        notes.append(f"{context + new_tokens:,} tokens exceed the model's max_position_embeddings ({spec.max_position:,})")
    if stack.selection is not None and stack.selection.per_head_budgets and stack.quantization is not None:
        notes.append(f"{stack.selection.spec()}: per-head budgets are planned as equal heads; each head's own "
                     f"remainder of per-channel groups and residual makes the measured bytes differ slightly")
    if stack.selection is not None and layout.coded is not None and layout.coded.sink:
        notes.append(f"{stack.quantization.spec()}: the sink token(s) are counted as kept in full precision; "
                     f"{stack.selection.spec()} may drop them (then each is coded instead)")
    if layout.residual and stack.quantization is not None:
        notes.append(f"the {layout.residual} most recent tokens of each layer stay in the model dtype "
                     f"({dtype_bytes} bytes per value)")
    seq = sum(layer.bytes for layer in layers)
    base_seq = sum(layer.bytes for layer in base_layers)
    return MemoryPlan(model=spec.name, policy=stack.spec, context=context, batch=batch, dtype_bytes=dtype_bytes,
                      new_tokens=new_tokens, bytes_per_token=key_pt + value_pt, key_bytes_per_token=key_pt,
                      value_bytes_per_token=value_pt, baseline_bytes_per_token=base_pt, sequence_bytes=seq,
                      total_bytes=seq * batch, baseline_sequence_bytes=base_seq, baseline_total_bytes=base_seq * batch,
                      layers=layers, notes=notes,
                      parts=native_layers(spec, context + new_tokens, dtype_bytes)[1] if stack.is_none else [])


# ----------------------------------------------------------------------------------------------
# what fits

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text, what: str = "size") -> int:
    """Bytes from ``80GiB``, ``16GB``, ``1.5TiB`` or a plain number of bytes (GB = 10^9, GiB = 2^30)."""
    if is_real(text):
        value = float(text)
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise UsageError(f"{what}={text!r} is not a size; write e.g. 80GiB, 16GB, 512MiB or a number of bytes")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not value > 0 or not math.isfinite(value):
        raise UsageError(f"{what}={text!r} must be a positive size")
    return int(value)


def parse_tokens(text, what: str = "context") -> int:
    """Tokens from ``8192``, ``8k`` (8192) or ``1m`` (1048576)."""
    if is_whole(text):
        return text
    match = re.match(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([kKmM]?)\s*$", str(text))
    if not match:
        raise UsageError(f"{what}={text!r} is not a token count; write e.g. 8192 or 8k")
    value = float(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
    if value != int(value):
        raise UsageError(f"{what}={text!r} is not a whole number of tokens")
    return int(value)


def parse_headroom(value) -> float:
    """A fraction ``0 <= h < 1`` from ``0.1`` or ``"10%"``."""
    text = str(value).strip()
    try:
        h = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UsageError(f"headroom={value!r} is not a number; give a fraction such as 0.1 or a percentage such as 10%") from None
    if not 0 <= h < 1:
        raise UsageError(f"headroom={value!r} is out of range; give a fraction 0 <= headroom < 1 (e.g. 0.1) or a percentage (10%)")
    return h


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


def _weights(spec: ModelSpec, weights, weight_bytes_per_param, dtype_bytes: int, notes: list[str]) -> tuple[int, bool]:
    if weights is not None:
        return parse_size(weights, "weights"), False
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
    without ``weights``, parameters x ``weight_bytes_per_param`` (default
    ``dtype_bytes``) when the config allows the count. The context answer is the
    largest length whose cache fits at every length up to it (quantization's
    full-precision remainder makes the size dip when a group is sealed). ``achieved_ratio``: as :func:`plan`'s.
    """
    if context is not None and batch is not None:
        raise UsageError("give context (to find the largest batch) or batch (to find the largest context), not both")
    spec = load_model_spec(model)
    gpu = parse_size(gpu_memory, "gpu_memory")
    h = parse_headroom(headroom)
    dtype_bytes = _check_dtype_bytes(dtype_bytes)
    new_tokens = check_int(new_tokens, "new_tokens", 0)
    stack = _policy_stack(policy)
    notes: list[str] = []
    overrides = parse_storage(storage)
    native = _native(spec, stack, overrides) or (stack.is_none and bool(spec.storage))
    layout = None if native else _layout(spec, stack, notes)
    weight_bytes, estimated = _weights(spec, weights, weight_bytes_per_param, dtype_bytes, notes)
    budget = math.floor(gpu * (1 - Fraction(repr(h)))) - weight_bytes  # exact: 0.9 x 80 GiB is a whole number
    if budget <= 0:
        notes.append(f"the weights ({human_bytes(weight_bytes)}) leave nothing of {human_bytes(gpu)} less "
                     f"{h:.0%} headroom for the cache")

    def seq_bytes(n: int, sized=stack) -> int:
        if native:
            return sum(layer.bytes for layer in _native_sequence(spec, sized, n, new_tokens, dtype_bytes, overrides,
                                                                 [], achieved_ratio)[0])
        return sum(layer.bytes for layer in _sequence_layers(spec, sized, layout, n, new_tokens, dtype_bytes,
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
    windows = [w for w, acts in zip(spec.windows, _selecting(spec)) if acts and w is not None]
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


# ----------------------------------------------------------------------------------------------
# formatting and the command

def human_bytes(n: float) -> str:
    """``512 KiB``, ``1.5 GiB``: binary units, at most two decimals."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            text = f"{n:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        n /= 1024
    raise AssertionError


def _layer_groups(layers: list[LayerPlan]) -> list[str]:
    groups: dict[tuple, list[int]] = {}
    for layer in layers:
        groups.setdefault((layer.kind, layer.window, layer.tokens, layer.bytes), []).append(layer.index)
    if len(groups) > 6:  # per-layer budgets (PyramidKV): a range, not a list
        tokens = [layer.tokens for layer in layers]
        sizes = [layer.bytes for layer in layers]
        return [f"{len(layers)} layers, {min(tokens):,}-{max(tokens):,} tokens, "
                f"{human_bytes(min(sizes))}-{human_bytes(max(sizes))} each"]
    out = []
    for (kind, window, tokens, size), idx in groups.items():
        label = f"{kind} (window {window:,})" if window else kind
        out.append(f"{len(idx)} {label}: {tokens:,} tokens, {human_bytes(size)} each")
    return out


def _storage_label(name: str, dtype_bytes: int) -> str:
    return {1: "1-byte", 2: "bf16", 4: "fp32", 8: "fp64"}[dtype_bytes] if name == "dtype" else name


def format_plan(p: MemoryPlan, fits: list[FitResult] | None = None, all_layers: bool = False) -> str:
    kv = (f"K {human_bytes(p.key_bytes_per_token)} + V {human_bytes(p.value_bytes_per_token)}"
          if p.value_bytes_per_token else "MLA latent")
    per_token = (f"per token  {human_bytes(p.bytes_per_token)} added by each further token (amortized over all "
                 f"layers; windows and state do not grow)" if p.native else
                 f"per token  {human_bytes(p.bytes_per_token)} ({kv}); uncompressed {human_bytes(p.baseline_bytes_per_token)}")
    lines = [
        f"model      {p.model}",
        f"policy     {p.policy}  (dtype {p.dtype_bytes} bytes)",
        per_token,
        f"context    {p.context:,} tokens" + (f" + {p.new_tokens:,} generated" if p.new_tokens else "") + f" x batch {p.batch}",
        f"cache      {human_bytes(p.sequence_bytes)} per sequence, {human_bytes(p.total_bytes)} in total "
        f"(uncompressed {human_bytes(p.baseline_total_bytes)}, {p.compression:.2f}x)",
    ]
    if all_layers:
        lines += [f"  layer {lay.index:3d}  {lay.kind:7s} {lay.tokens:>10,} tokens  {human_bytes(lay.bytes)}" for lay in p.layers]
    else:
        lines += [("layers     " if i == 0 else "           ") + g for i, g in enumerate(_layer_groups(p.layers))]
    if p.native:
        lines += [("parts      " if i == 0 else "           ")
                  + f"{part.name:12s} {_storage_label(part.storage, p.dtype_bytes):10s} {part.layers:3d} layers  "
                    f"{human_bytes(part.bytes):>11s}" + (f"  ({part.entries:,} entries of {part.entry_bytes} B)"
                                                          if part.name != "state" else f"  ({part.entries:,} values)")
                  for i, part in enumerate(p.parts)]
    notes = list(p.notes)
    for fit in fits or []:
        head, body = _format_fit(fit)
        if head not in lines:
            lines.append(head)
        lines.append(body)
        notes += [n for n in fit.notes if n not in notes]
    lines += [("notes      " if i == 0 else "           ") + n for i, n in enumerate(notes)]
    return "\n".join(lines)


def _format_fit(fit: FitResult) -> tuple[str, str]:
    weights = human_bytes(fit.weights_bytes) + (" estimated" if fit.weights_estimated else "")
    head = (f"fit        {human_bytes(fit.gpu_bytes)} GPU - {fit.headroom:.0%} headroom - {weights} weights "
            f"= {human_bytes(max(fit.cache_budget_bytes, 0))} for the cache")
    if fit.solve == "context":
        value = "any (bounded cache)" if fit.value is None else f"{fit.value:,} tokens"
        body = f"           largest context at batch {fit.batch}: {value}"
    else:
        body = f"           largest batch at {fit.context:,} tokens: {fit.value:,}"
    return head, body


# ----------------------------------------------------------------------------------------------
# comparing models: the native cache of each at a few contexts

@dataclass
class ComparisonRow:
    """One model of a comparison: its storage per part and its plan at each context; ``ratios[j]``: its cache over
    the previous row's at ``contexts[j]`` (``None`` for the first row)."""

    model: str
    describe: str
    storage: dict[str, str]
    plans: list[MemoryPlan]
    ratios: list[float | None]


@dataclass
class Comparison:
    """Several models' native caches (policy ``none``) at the same contexts, in the order given."""

    contexts: list[int]
    batch: int
    dtype_bytes: int
    rows: list[ComparisonRow]
    notes: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"contexts": self.contexts, "batch": self.batch, "dtype_bytes": self.dtype_bytes, "notes": self.notes,
                "models": [{"model": row.model, "describe": row.describe, "storage": row.storage,
                            "at": [{"context": p.context, "sequence_bytes": p.sequence_bytes,
                                    "total_bytes": p.total_bytes, "bytes_per_context_token": p.bytes_per_context_token,
                                    "ratio_to_previous": ratio, "parts": [asdict(part) for part in p.parts]}
                                   for p, ratio in zip(row.plans, row.ratios)]}
                           for row in self.rows]}


def compare(models, contexts, batch: int = 1, dtype_bytes: int = 2, storage=None) -> Comparison:
    """The native cache of each of ``models`` at each of ``contexts``, and each model's ratio to the one before it."""
    models, contexts = list(models), [check_int(c, "context", 1) for c in contexts]
    if len(models) < 2 or not contexts:
        raise UsageError("compare needs two or more models and one or more contexts (e.g. 128k,1m)")
    rows: list[ComparisonRow] = []
    notes: list[str] = []
    overrides = parse_storage(storage)
    specs = [load_model_spec(model) for model in models]
    known = {"all"}.union(*(storages(spec) for spec in specs))
    if set(overrides) - known:
        raise UsageError(f"no model compared has a cache part {', '.join(sorted(set(overrides) - known))}; "
                         f"parts: {', '.join(sorted(known))}")
    for spec in specs:
        mine = {part: name for part, name in overrides.items() if part == "all" or part in storages(spec)}
        plans = [plan(spec, c, batch, None, dtype_bytes, storage=mine) for c in contexts]
        previous = rows[-1].plans if rows else None
        ratios = [p.sequence_bytes / q.sequence_bytes if previous else None
                  for p, q in zip(plans, previous or plans)]
        over = [c for c in contexts if spec.max_position and c > spec.max_position]
        if over:
            notes.append(f"{spec.name}: {over[0]:,} tokens exceed its max_position_embeddings ({spec.max_position:,}); "
                         f"planned as if it ran that long")
        rows.append(ComparisonRow(spec.name, spec.describe, {part.name: part.storage for part in plans[0].parts},
                                  plans, ratios))
    return Comparison(contexts, batch, dtype_bytes, rows, notes)


def _tokens_label(n: int) -> str:
    return f"{n // 2**20}m" if n % 2**20 == 0 else f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def format_compare(c: Comparison) -> str:
    """The comparison as a table: per model, bytes per token of context and the cache at each context, and the
    ratio to the model above; then how each model stores its parts."""
    head = f"{'model':18s}"
    for n in c.contexts:
        label = _tokens_label(n)
        head += f" {'B/token @' + label:>14s} {'cache @' + label:>13s} {'x prev':>7s}"
    lines = [f"native KV cache (policy none), batch {c.batch}, per sequence x batch", head]
    for row in c.rows:
        line = f"{row.model.split('/')[-1]:18s}"
        for p, ratio in zip(row.plans, row.ratios):
            line += (f" {human_bytes(p.bytes_per_context_token):>14s} {human_bytes(p.total_bytes):>13s} "
                     f"{'-' if ratio is None else f'{ratio:.3f}':>7s}")
        lines.append(line)
    lines.append("storage")
    for row in c.rows:
        grouped: dict[str, list[str]] = {}
        for part, name in row.storage.items():
            grouped.setdefault(_storage_label(name, c.dtype_bytes), []).append(part)
        lines.append(f"  {row.model.split('/')[-1]:16s} " + "; ".join(f"{', '.join(parts)} {name}"
                                                                    for name, parts in grouped.items()))
    lines += [("notes  " if i == 0 else "       ") + n for i, n in enumerate(c.notes)]
    return "\n".join(lines)
