"""KV-cache memory planning: bytes per token, per sequence, and what fits on a GPU (the command: :mod:`kveval.commands.memory`).

Everything is arithmetic on a model's config; no weights are loaded. A model is
(:mod:`kveval.planner.model_specs`) a named preset (:data:`~kveval.planner.model_specs.PRESETS`), a local ``config.json`` (or a folder holding
one), a ``.gguf`` file (its metadata), a Hugging Face Hub id (a preset's: that
preset; another: read with ``transformers.AutoConfig``, refused at once offline
unless the config is cached), a ``dict`` or a ``PretrainedConfig``.

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
  models' caches are planned as kveval's cache holds them, part by part (:func:`kveval.planner.native_plans.native_sequence`).
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
subtracts the weights (given; else as the checkpoint stores them where the planner
knows it: a GGUF's tensors, an FP8 checkpoint's byte per parameter; else
parameters x bytes per parameter) and keeps a ``headroom`` fraction of the GPU
free for the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kveval.errors import UsageError
from kveval.planner.fit import FitResult, max_fit
from kveval.planner.layouts import (
    LayerPlan,
    MemoryPlan,
    merged_layers,
    merged_stream_bytes,
    policy_stack,
    reading_layers,
    sequence_layers,
    stream_layout,
    stream_per_token,
)
from kveval.planner.model_specs import load_model_spec
from kveval.planner.native import native_layers, parse_storage, storages
from kveval.planner.native_plans import native_plan, plans_native
from kveval.planner.units import check_dtype_bytes, check_int, human_bytes, parse_headroom, parse_size, parse_tokens
from kveval.policies.base import PolicyStack


# ----------------------------------------------------------------------------------------------
# the plan

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
    dtype_bytes = check_dtype_bytes(dtype_bytes)
    stack = policy_stack(policy)
    notes = ([spec.origin] if spec.origin else []) + list(spec.notes)
    overrides = parse_storage(storage)
    if plans_native(spec, stack, overrides) or (stack.is_none and spec.storage):
        return native_plan(spec, stack, context, batch, dtype_bytes, new_tokens, overrides, notes, achieved_ratio)
    layout = stream_layout(spec, stack, notes)
    base_layout = stream_layout(spec, policy_stack(None), [])
    layers = sequence_layers(spec, stack, layout, context, new_tokens, dtype_bytes, achieved_ratio)
    base_layers = sequence_layers(spec, PolicyStack(), base_layout, context, new_tokens, dtype_bytes)
    pairs = len(merged_layers(spec, stack))  # MiniCache's merged pairs, amortized over this context below
    not_own = set(reading_layers(spec, stack)) | {i for pair in merged_layers(spec, stack).items() for i in pair}
    kv_layers = sum(spec.holds_kv) - len(reading_layers(spec, stack)) - 2 * pairs  # readers store nothing
    if layout.coded is not None:  # coded K and V of their widths; the coding's own native layers in the cache dtype
        kept_native = sorted(i for i in layout.native_layers(spec) if spec.holds_kv[i] and i not in not_own)
        native = len(kept_native)
        heads, key_dim, value_dim = layout.coded_widths
        per_stream = [b * (kv_layers - native) + heads * dim * dtype_bytes * native
                      for b, dim in zip(layout.coded_per_token(dtype_bytes), (key_dim, value_dim))]
        if native:
            notes.append(f"{stack.quantization.spec()}: {native} layer(s) stay in the model dtype "
                         f"({', '.join(map(str, kept_native))})")
    else:
        per_stream = [stream_per_token(heads, dim, q, dtype_bytes) * kv_layers for _, heads, dim, q in layout.streams]
    if pairs:  # a pair's two layers, per prefill token they hold (what a selection kept of this context)
        kept = next(layer.tokens for layer in layers if layer.index in merged_layers(spec, stack)) - new_tokens
        per_stream = [b + pairs * sum(pair) / max(kept, 1)
                      for b, pair in zip(per_stream, merged_stream_bytes(stack, layout, kept, 0, dtype_bytes))]
    key_pt = per_stream[0]
    value_pt = per_stream[1] if len(per_stream) > 1 else 0.0
    # uncompressed, every layer holds its own K/V (readers and merged pairs included)
    base_pt = int(sum(stream_per_token(h, d, None, dtype_bytes) for _, h, d, _ in base_layout.streams) * sum(spec.holds_kv))
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
# formatting

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
    head = f"{'model':20s}"
    for n in c.contexts:
        label = _tokens_label(n)
        head += f" {'B/token @' + label:>14s} {'cache @' + label:>13s} {'x prev':>7s}"
    lines = [f"native KV cache (policy none), batch {c.batch}, per sequence x batch", head]
    for row in c.rows:
        line = f"{row.model.split('/')[-1]:20s}"
        for p, ratio in zip(row.plans, row.ratios):
            line += (f" {human_bytes(p.bytes_per_context_token):>14s} {human_bytes(p.total_bytes):>13s} "
                     f"{'-' if ratio is None else f'{ratio:.3f}':>7s}")
        lines.append(line)
    lines.append("storage")
    for row in c.rows:
        grouped: dict[str, list[str]] = {}
        for part, name in row.storage.items():
            grouped.setdefault(_storage_label(name, c.dtype_bytes), []).append(part)
        lines.append(f"  {row.model.split('/')[-1]:20s} " + "; ".join(f"{', '.join(parts)} {name}"
                                                                    for name, parts in grouped.items()))
    lines += [("notes  " if i == 0 else "       ") + n for i, n in enumerate(c.notes)]
    return "\n".join(lines)


@dataclass
class ConcurrencyRow:
    """One model at one context: its native cache in total at each batch, and the bytes one more request adds
    (``slope``: the per-sequence cache; doubling a batch of ``b`` adds ``b x slope``)."""

    model: str
    context: int
    totals: list[int]
    slope: int
    slope_ratio: float  # slope over the first model's at the same context


@dataclass
class ConcurrencyTable:
    """Native caches (policy none) of several models at several contexts and batches: how memory grows with
    concurrency. Each cache is ``batch x`` one sequence's (no sharing across requests), so the increment when
    concurrency doubles is a ratio of slopes, the same at every batch."""

    batches: list[int]
    dtype_bytes: int
    rows: list[ConcurrencyRow]
    storage: dict[str, dict[str, str]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def concurrency(models, contexts, batches, dtype_bytes: int = 2, storage=None) -> ConcurrencyTable:
    """The total native cache of each of ``models`` at each of ``contexts`` and ``batches`` (:class:`ConcurrencyTable`)."""
    batches = [check_int(b, "batch", 1) for b in batches]
    if not batches:
        raise UsageError("give one or more batches, e.g. --concurrency 1,2,4,8")
    result = compare(models, contexts, 1, dtype_bytes, storage)
    rows = []
    for j, context in enumerate(result.contexts):
        first = result.rows[0].plans[j].sequence_bytes
        for row in result.rows:
            seq = row.plans[j].sequence_bytes
            rows.append(ConcurrencyRow(row.model, context, [seq * b for b in batches], seq, seq / first))
    return ConcurrencyTable(batches, dtype_bytes, rows, {row.model: row.storage for row in result.rows})


def format_concurrency(t: ConcurrencyTable) -> str:
    """The table: per context and model, the total cache at each batch, the increment per request and its ratio to
    the first model's."""
    first = t.rows[0].model.split("/")[-1]
    head = f"{'context':>8s}  {'model':20s}" + "".join(f" {'batch ' + str(b):>11s}" for b in t.batches)
    head += f" {'+1 request':>11s} {'x ' + first:>{max(8, len(first) + 2)}s}"
    lines = ["native KV cache in total (policy none) at each concurrency, each model stored as served", head]
    for row in t.rows:
        lines.append(f"{_tokens_label(row.context):>8s}  {row.model.split('/')[-1]:20s}"
                     + "".join(f" {human_bytes(v):>11s}" for v in row.totals)
                     + f" {human_bytes(row.slope):>11s} {row.slope_ratio:>{max(8, len(first) + 2)}.4f}")
    lines.append(f"+1 request: what each further request adds (doubling a batch of b adds b of them); "
                 f"x {first}: that increment over {first}'s")
    return "\n".join(lines)


# The planner's public names, wherever they live (the commands, the gate and the tests import them from here).
__all__ = ["Comparison", "ComparisonRow", "ConcurrencyRow", "ConcurrencyTable", "concurrency", "format_concurrency", "FitResult", "LayerPlan", "MemoryPlan", "check_int", "compare",
           "format_compare", "format_plan", "human_bytes", "max_fit", "parse_headroom", "parse_size", "parse_tokens",
           "plan"]
