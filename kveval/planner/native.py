"""A model's own (native) KV cache, part by part, and how each part is stored: the planner's answer for policy ``none``.

This module owns the part layout of every cache the planner knows and the storage formats of those parts:

* per-head K/V (``k``, ``v``) and MLA (``latent``, ``rope``), as :mod:`kveval.planner.memory` plans them;
* DeepSeek-V3.2 (DSA): MLA plus the lightning indexer's key cache (``indexer``: ``index_head_dim`` values per token
  and layer);
* DeepSeek-V4: every layer's sliding window of K=V entries (``window``), CSA layers' compressed entries
  (``csa-entries``, one per ``compress_rate`` tokens) and indexer entries (``csa-indexer``), HCA layers'
  compressed entries (``hca-entries``), and the constant-size state that waits for a window to close (``state``:
  ``buffer_kv``/``buffer_gate``, CSA's ``overlap_kv``/``overlap_gate``);
* DeepSeek-V4.1: V4's ``window``, ``csa-entries`` and ``csa-indexer`` (every compressing layer is sparse, one entry
  per 2 or per 1 token), the entries and keys stored in the ``kv_source_layer_ids`` only, as its reference inference
  code holds them (:class:`~kveval.planner.model_specs.V4Shape`).

The layout is what transformers' own cache classes hold (``DynamicIndexedLayer``, ``DeepseekV4CSACache``,
``DeepseekV4HCACache``, ``DynamicSlidingWindowLayer``): tests run tiny models of both and require the planned bytes to
equal the bytes of every tensor those cache layers hold. Each part's storage (:class:`Storage`) defaults to the
planned dtype; presets state how the model's own serving stack stores it (``kv_storage``), and ``storage=``
overrides any part (:func:`parse_storage`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kveval.errors import UsageError
from kveval.planner.model_specs import ModelSpec

# ----------------------------------------------------------------------------------------------
# storage formats

@dataclass(frozen=True)
class Storage:
    """How a part stores one entry: ``bits`` per value (``None``: the planned dtype), the RoPE values of the entry
    at ``rope_bits`` (``None``: as the others), and one ``scale_bytes`` scale per ``group`` non-RoPE values (every
    value, RoPE ones included, where ``whole_entry``: a format quantized after RoPE)."""

    name: str
    bits: float | None
    rope_bits: float | None = None
    scale_bytes: int = 0
    group: int = 0
    about: str = ""
    whole_entry: bool = False

    def entry_bytes(self, width: int, rope: int, dtype_bytes: int) -> int:
        """Bytes of one entry of ``width`` values, ``rope`` of them RoPE values."""
        bits = dtype_bytes * 8 if self.bits is None else self.bits
        rope_bits = bits if self.rope_bits is None else self.rope_bits
        plain = width - rope
        scaled = width if self.whole_entry else plain
        scales = math.ceil(scaled / self.group) * self.scale_bytes if self.group else 0
        return math.ceil(plain * bits / 8 + rope * rope_bits / 8) + scales


#: Named storage formats (``--storage PART=NAME``).
FORMATS: dict[str, Storage] = {s.name: s for s in (
    Storage("dtype", None, about="the planned dtype (--dtype-bytes)"),
    Storage("fp32", 32, about="4 bytes per value"),
    Storage("bf16", 16, about="2 bytes per value (also fp16)"),
    Storage("fp16", 16, about="2 bytes per value"),
    Storage("fp8", 8, about="1 byte per value, no scale"),
    Storage("fp8-128", 8, scale_bytes=4, group=128,
            about="FP8 with one float32 scale per 128 values (DeepSeek's block FP8: FlashMLA's FP8 latent, "
                  "V3.2's indexer keys)"),
    Storage("fp8-mixed", 8, rope_bits=16, scale_bytes=1, group=64,
            about="FP8 E4M3 for the non-RoPE values with a 1-byte UE8M0 scale per 64, BF16 for the RoPE values "
                  "(DeepSeek-V4's KV entries; vLLM pads the 7 scale bytes to 8, not counted)"),
    Storage("fp4-32", 4, scale_bytes=1, group=32,
            about="FP4 with a 1-byte scale per 32 values (MXFP4-style; assumed for V4's indexer keys)"),
    Storage("fp8-32", 8, scale_bytes=1, group=32, whole_entry=True,
            about="FP8 E4M3 for every value, RoPE ones included, with a 1-byte UE8M0 scale per 32 (MXFP8: "
                  "DeepSeek-V4.1's window, 528 bytes an entry of 512)"),
    Storage("fp4-16", 4, scale_bytes=1, group=16, whole_entry=True,
            about="FP4 E2M1 for every value, after RoPE, with a 1-byte E4M3 scale per 16 (NVFP4's blocks, no "
                  "per-tensor scale: DeepSeek-V4.1's compressed KV, 288 bytes an entry of 512)"),
    Storage("6bit", 6, about="6 bits per value on average, scales included (DeepSeek-V2's deployment)"),
)}


def parse_storage(spec) -> dict[str, str]:
    """``{"indexer": "fp8-128"}`` from ``"indexer=fp8-128,latent=bf16"`` (or a dict); ``all=NAME`` sets every part."""
    if spec is None or spec == "":
        return {}
    items = spec.items() if isinstance(spec, dict) else (
        part.split("=", 1) if "=" in part else (part, None) for part in str(spec).split(",") if part.strip())
    out: dict[str, str] = {}
    for part, name in items:
        part, name = str(part).strip(), (str(name).strip() if name is not None else "")
        if name not in FORMATS:
            raise UsageError(f"storage {part}={name or '?'}: give PART=FORMAT with FORMAT one of "
                             f"{', '.join(FORMATS)}")
        if part in out:
            raise UsageError(f"storage names {part} twice ({part}={out[part]}, {part}={name}); give each part once")
        out[part] = name
    return out


# ----------------------------------------------------------------------------------------------
# the parts of a native cache

@dataclass
class PartPlan:
    """One part of a native cache for one sequence, over every layer holding it.

    ``entries`` is the entries it holds summed over those layers (``state``: values), ``entry_bytes`` one entry in
    its ``storage``,
    ``growth_per_token`` what each further token adds over all layers (amortized: a CSA entry per 4 tokens; 0 for a
    window or a state that stops growing).
    """

    name: str
    storage: str
    layers: int
    width: int
    entry_bytes: int
    entries: int
    bytes: int
    growth_per_token: float


@dataclass
class NativeLayer:
    """One layer of a native cache: its kind, window, tokens seen or held, bytes and bytes by part."""

    index: int
    kind: str
    window: int | None
    tokens: int
    bytes: int
    parts: dict[str, int]


def part_widths(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each part's entry ``(width, RoPE values)`` (per KV head for ``k``/``v``)."""
    if spec.v4 is not None:
        v4 = spec.v4
        out = {"window": (spec.head_dim, v4.rope), "hca-entries": (spec.head_dim, v4.rope),
               "csa-entries": (spec.head_dim, v4.rope), "csa-indexer": (v4.index_dim, 0), "state": (1, 0)}
        kinds = {kind for kind, _ in v4.layers}
        return {k: w for k, w in out.items()
                if not (k.startswith("csa") and "csa" not in kinds or k.startswith("hca") and "hca" not in kinds
                        or k == "state" and v4.reference_layout)}
    if spec.mla_dim is not None:
        out = {"latent": (spec.mla_dim - spec.mla_rope, 0), "rope": (spec.mla_rope, spec.mla_rope)}
        if spec.indexer_dim:
            out["indexer"] = (spec.indexer_dim, 0)
        return out
    return {"k": (spec.head_dim, 0), "v": (spec.head_dim, 0)}


def storages(spec: ModelSpec, overrides: dict[str, str] | None = None) -> dict[str, Storage]:
    """Each part's storage: ``overrides`` (``all`` for every part), else the model's own (``spec.storage``), else
    the planned dtype. An unknown part is refused."""
    parts = part_widths(spec)
    overrides = dict(overrides or {})
    every = overrides.pop("all", None)
    unknown = sorted(set(overrides) - set(parts))
    if unknown:
        raise UsageError(f"{spec.name} has no cache part {', '.join(unknown)}; its parts: {', '.join(parts)} "
                         f"(or all)")
    return {part: FORMATS[overrides.get(part) or every or spec.storage.get(part) or "dtype"] for part in parts}


def native_layers(spec: ModelSpec, tokens: int, dtype_bytes: int,
                  overrides: dict[str, str] | None = None) -> tuple[list[NativeLayer], list[PartPlan]]:
    """The native cache of one sequence that has seen ``tokens`` tokens: per layer, and per part."""
    store = storages(spec, overrides)
    widths = part_widths(spec)
    entry = {part: store[part].entry_bytes(*widths[part], dtype_bytes) for part in widths}
    layers: list[NativeLayer] = []
    totals = {part: [0, 0, 0] for part in widths}  # layers, entries, bytes
    growth = dict.fromkeys(widths, 0.0)

    def add(held: dict[str, int], index: int, kind: str, window: int | None, seen: int):
        sizes = {part: n * entry[part] for part, n in held.items()}
        for part, n in held.items():
            totals[part][0] += 1
            totals[part][1] += n
            totals[part][2] += sizes[part]
        layers.append(NativeLayer(index, kind, window, seen, sum(sizes.values()), sizes))

    if spec.v4 is not None:
        _v4_layers(spec, tokens, entry, growth, add)
    else:
        for i in range(spec.num_layers):
            window = spec.windows[i]
            held = 0 if not spec.holds_kv[i] else tokens if window is None else min(tokens, window - 1)
            grows = spec.holds_kv[i] and window is None
            kind = ("state" if not spec.holds_kv[i] else "mla" if spec.mla_dim is not None
                    else "full" if window is None else "sliding")
            heads = spec.kv_heads if spec.mla_dim is None else 1
            counts = ({part: held * heads for part in widths if part != "indexer" or spec.keeps_indexer(i)}
                      if spec.holds_kv[i] else {})
            for part in counts:
                growth[part] += entry[part] * heads if grows else 0
            add(counts, i, kind, window, held)
    parts = [PartPlan(part, store[part].name, n_layers, widths[part][0], entry[part], n_entries, size, growth[part])
             for part, (n_layers, n_entries, size) in totals.items() if n_layers]
    return layers, parts


def _v4_layers(spec: ModelSpec, tokens: int, entry, growth, add) -> None:
    """DeepSeek-V4's layers as transformers' cache holds them (:mod:`transformers.models.deepseek_v4`):

    * every layer keeps the newest ``sliding_window - 1`` tokens' K=V entries (``head_dim`` values, one per KV
      head); a pure sliding layer (``DynamicSlidingWindowLayer``) holds K and V as two tensors, CSA/HCA layers hold
      one tensor for both;
    * a CSA/HCA layer emits one compressed entry per ``rate`` tokens (CSA: and an indexer entry of
      ``index_head_dim``); the ``tokens % rate`` tokens of the open window wait in ``buffer_kv`` and
      ``buffer_gate`` (CSA: ``2 x head_dim`` wide each, HCA: ``head_dim``; CSA's indexer: ``2 x index_head_dim``);
      once a window has closed, CSA keeps its last window's first half in ``overlap_kv``/``overlap_gate``
      (``rate`` x ``head_dim``, and ``rate`` x ``index_head_dim`` for the indexer).
    """
    v4 = spec.v4
    window = v4.window
    if v4.reference_layout:  # V4.1: one ring of `window` entries a layer; entries and keys in the sources only
        held = min(tokens, window) * spec.kv_heads
        for i, (kind, rate) in enumerate(v4.layers):
            parts = {"window": held}
            if kind != "sliding" and v4.stores_entries(i):
                parts |= {f"{kind}-entries": tokens // rate} | ({"csa-indexer": tokens // rate} if kind == "csa" else {})
                for part in parts.keys() - {"window"}:
                    growth[part] += entry[part] / rate
            add(parts, i, kind if kind == "sliding" or v4.stores_entries(i) else f"{kind}-reuse", window, tokens)
        return
    held = min(tokens, window - 1)
    for i, (kind, rate) in enumerate(v4.layers):
        if kind == "sliding":
            add({"window": 2 * held * spec.kv_heads}, i, kind, window, tokens)
            continue
        closed, pending = divmod(tokens, rate)
        held_parts = {"window": held * spec.kv_heads, f"{kind}-entries": closed}
        growth[f"{kind}-entries"] += entry[f"{kind}-entries"] / rate
        if kind == "csa":
            held_parts["csa-indexer"] = closed
            growth["csa-indexer"] += entry["csa-indexer"] / rate
            values = pending * 2 * (2 * spec.head_dim + 2 * v4.index_dim)  # buffers: kv and gate, Ca and Cb halves
            if closed:
                values += 2 * rate * (spec.head_dim + v4.index_dim)  # overlap: kv and gate, the Ca half
        else:
            values = pending * 2 * spec.head_dim
        add(held_parts | {"state": values}, i, kind, window, tokens)


__all__ = ["FORMATS", "NativeLayer", "PartPlan", "Storage", "native_layers", "parse_storage", "part_widths",
           "storages"]
