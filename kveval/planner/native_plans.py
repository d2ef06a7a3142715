"""DeepSeek V3.2 (GLM MoE-DSA) and V4 caches planned part by part: the model's own under policy ``none``
(:mod:`kveval.planner.native`), and kveval's under a policy, as :mod:`kveval.cache.native_layers` holds it, after the
checks the cache makes (:func:`kveval.policies.compatibility.check_policy`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kveval.errors import UnsupportedModelError, UsageError
from kveval.planner.layouts import (
    LayerPlan,
    MemoryPlan,
    check_planned_cache,
    sequence_layers,
    stream_bytes,
    stream_layout,
    stream_per_token,
)
from kveval.planner.model_specs import ModelSpec
from kveval.planner.native import PartPlan, native_layers
from kveval.planner.units import human_bytes
from kveval.policies.base import Need, PlannedCoding, PolicyStack
from kveval.policies.compatibility import check_policy, part_coding


def plans_native(spec: ModelSpec, stack, overrides: dict[str, str]) -> bool:
    """Whether the plan is the native cache part by part (DeepSeek V3.2/V4's layouts, or a storage override); a
    storage override is refused under a compression policy, whose coding says how each part is stored, and so is
    what kveval's cache refuses on these models (:func:`kveval.policies.compatibility.check_policy`, checked here
    once for a plan or a fit)."""
    if not (spec.native_only or overrides):
        return False
    if not stack.is_none and overrides:
        raise UsageError(f"{stack.spec}: storage overrides size the native cache (policy none); under a policy its "
                         f"own coding stores each part: drop --storage")
    if not stack.is_none and spec.v4 is not None and spec.v4.reference_layout:
        raise UsageError(f"{stack.spec}: kveval has no cache of {spec.name} to compress (transformers has no "
                         f"{spec.model_type}); plan its native cache with policy none, its storage with --storage")
    if not stack.is_none:
        check_planned_cache(spec, stack)
        indexer_types = ["full" if spec.keeps_indexer(i) else "shared" for i in range(spec.num_layers)]
        try:
            widths = ({"head_dim": spec.head_dim, "index_head_dim": spec.v4.index_dim} if spec.v4 is not None else
                      {"kv_lora_rank": spec.mla_dim - spec.mla_rope, "qk_rope_head_dim": spec.mla_rope,
                       "index_head_dim": spec.indexer_dim})
            check_policy({"model_type": spec.model_type, "indexer_types": indexer_types, **widths}, stack)
        except UnsupportedModelError as refused:  # the planner answers bad input with one UsageError line
            raise UsageError(str(refused)) from None
        if stack.quantization is not None and spec.v4 is not None:
            stack.quantization.check_head_dim(spec.head_dim)  # an explicit group that does not divide the entries
    return True


def native_sequence(spec: ModelSpec, stack, context: int, new_tokens: int, dtype_bytes: int,
                     overrides: dict[str, str], notes: list[str],
                     achieved_ratio: float | None = None) -> tuple[list[LayerPlan], list[PartPlan]]:
    """The native cache of one sequence, per layer and per part: the model's own under policy ``none``, kveval's
    under a policy (:func:`_native_policy_layers`)."""
    if not stack.is_none:
        return _native_policy_layers(spec, stack, context, new_tokens, dtype_bytes, notes, achieved_ratio)
    layers, parts = native_layers(spec, context + new_tokens, dtype_bytes, overrides)
    return [LayerPlan(n.index, n.kind, n.window, n.tokens, n.bytes) for n in layers], parts


def native_plan(spec: ModelSpec, stack, context: int, batch: int, dtype_bytes: int, new_tokens: int,
                 overrides: dict[str, str], notes: list[str], achieved_ratio: float | None = None) -> MemoryPlan:
    layers, parts = native_sequence(spec, stack, context, new_tokens, dtype_bytes, overrides, notes, achieved_ratio)
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
        return stream_per_token(1, width, self.coding.key, dtype_bytes)

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
        return stream_bytes(n, 1, width, self.coding.key, self.residual, dtype_bytes, sliding)


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

    The stack has passed :func:`plans_native`'s checks; refused here in one line: a selection over parts coded before
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
        layout = stream_layout(spec, stack, notes)
        for _, _, _, q in layout.streams:  # the latent's K coding and its RoPE key's V coding
            sized("latent", _PartCoding(layout.coded or PlannedCoding(q, residual=layout.residual)))
        latent = sequence_layers(spec, stack, layout, context, new_tokens, dtype_bytes, achieved_ratio)
        indexer = coding("indexer", spec.indexer_dim)
        if layout.coded is not None:
            latent_growth = sum(layout.coded_per_token(dtype_bytes))
        else:
            latent_growth = sum(stream_per_token(heads, dim, q, dtype_bytes) for _, heads, dim, q in layout.streams)
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


__all__ = ["native_plan", "native_sequence", "plans_native"]
