"""Models as the memory planner sees them: their cache-relevant shape (:class:`ModelSpec`), read from a named
preset (:data:`PRESETS`: ``config.json`` excerpts of well-known models), a local ``config.json`` or a folder holding
one, a ``.gguf`` file (its metadata and tensor types: :mod:`kveval.planner.gguf_specs`), a Hugging Face Hub id (a
preset's own id or a variant of it: that preset, with no download; another: ``transformers.AutoConfig``, refused at
once where it is not cached and the Hub cannot be reached), a ``dict`` or a ``PretrainedConfig``. No weights are
loaded. :mod:`kveval.planner.memory` plans bytes from a :class:`ModelSpec`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kveval.errors import UsageError
from kveval.modeling.layer_types import HYBRID_LAYER_TYPES, KNOWN_LAYER_TYPES, KV_LAYER_TYPES
from kveval.planner.gguf_specs import is_gguf, read_gguf
from kveval.planner.hub import hub_cached, hub_offline
from kveval.planner.presets import HUB_PRESETS, PRESET_KEYS, PRESETS, preset_key
from kveval.policies.compatibility import CacheShape
from kveval.values import is_whole

# ----------------------------------------------------------------------------------------------
# the model as the planner sees it

@dataclass
class V4Shape:
    """DeepSeek-V4's cache shape: each layer's ``(kind, rate)`` (``"sliding"``, 0; ``"csa"``, 4; ``"hca"``, 128), the
    sliding ``window`` every layer keeps, the RoPE values of an entry and the indexer's ``index_dim``.

    DeepSeek-V4.1 shares compressed KV across layers: ``kv_sources`` are the layers that compute and store compressed
    entries and the indexer keys (``index_k``) beside them; every other compressing layer reads the nearest source's
    (``None``: every compressing layer stores its own, as V4). ``index_sources`` are the layers that run the lightning
    indexer (a query of their own over a source's stored keys: no bytes of their own). ``reference_layout``: the layers
    as the model's reference inference code holds them (a ring of ``window`` entries in every layer, stored once; the
    compressors' pending tokens, a few entries a layer, not planned), for a model transformers cannot run; else as
    transformers' cache holds them (``window - 1`` tokens, a sliding-only layer's twice, and the pending state)."""

    layers: list[tuple[str, int]]
    window: int
    rope: int
    index_dim: int
    kv_sources: tuple[int, ...] | None = None
    index_sources: tuple[int, ...] | None = None
    reference_layout: bool = False

    def stores_entries(self, layer: int) -> bool:
        """Whether compressing layer ``layer`` stores its own compressed entries (and, CSA, indexer keys)."""
        return self.kv_sources is None or layer in self.kv_sources


@dataclass(frozen=True)
class Weights:
    """A checkpoint's weights as stored: ``total`` bytes (a GGUF's tensors, exact) or ``per_param`` bytes per
    parameter (an FP8 checkpoint); ``source`` says where that was read."""

    source: str
    total: int | None = None
    per_param: float | None = None
    #: The routed experts' parameters (``None``: not known) and their bytes each where they are stored otherwise
    #: (DeepSeek-V4's MXFP4 experts: 4.25 bits, a UE8M0 scale per 32 included); ``per_param`` is then the rest's.
    expert_parameters: int | None = None
    expert_per_param: float | None = None

    def split(self, parameters: int | None) -> tuple[int, int] | None:
        """``(bytes of everything but the routed experts, bytes of the routed experts)``; ``None`` where the planner
        cannot tell (no parameter count, or an exact total with no split)."""
        if self.total is not None or not parameters or self.per_param is None:
            return None
        experts = self.expert_parameters or 0
        if experts > parameters:
            raise UsageError(f"{experts:,} routed-expert parameters exceed the model's {parameters:,}")
        per_expert = self.per_param if self.expert_per_param is None else self.expert_per_param
        return (int(-(-(parameters - experts) * self.per_param // 1)), int(-(-experts * per_expert // 1)))

    def bytes_for(self, parameters: int | None) -> int | None:
        if self.total is not None:
            return self.total
        parts = self.split(parameters)
        return None if parts is None else sum(parts)

    def describe(self, parameters: int) -> str:
        """How the bytes were counted: ``6.71e11 parameters x 1 byte``, or with the experts apart."""
        if self.expert_per_param is None or not self.expert_parameters:
            per = self.per_param
            return f"{parameters / 1e9:.2f}e9 parameters x {per:g} byte{'s' * (per != 1)}"
        return (f"{self.expert_parameters / 1e9:.2f}e9 routed-expert parameters x {self.expert_per_param:g} bytes + "
                f"{(parameters - self.expert_parameters) / 1e9:.2f}e9 others x {self.per_param:g}")

    @property
    def exact(self) -> bool:
        return self.total is not None


@dataclass
class ModelSpec:
    """The cache-relevant shape of a model.

    ``windows[i]`` is layer ``i``'s sliding window or attention chunk (``None``:
    full attention); it holds ``window - 1`` tokens, as transformers' own sliding
    layers and kveval's cache do. ``holds_kv[i]`` is false for a layer without
    K/V (a Mamba, linear-attention or MLP-only layer: constant-size states, not
    planned here). ``mla_dim`` is the per-token latent width of MLA layers
    (``None``: per-head K/V), ``mla_rope`` the shared RoPE key's part of it.
    """

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    windows: list[int | None]
    #: Query heads (``num_attention_heads``; ``None``: not given): the width tensor parallelism must divide.
    num_attention_heads: int | None = None
    holds_kv: list[bool] = field(default_factory=list)
    #: ``chunked[i]``: layer ``i``'s window is an attention chunk (Llama 4), where no selection acts.
    chunked: list[bool] = field(default_factory=list)
    #: ``hybrid[i]``: layer ``i`` keeps a linear-attention/Mamba state beside its K/V (Falcon-H1), its own alone.
    hybrid: list[bool] = field(default_factory=list)
    mla_dim: int | None = None
    mla_rope: int = 0
    #: DeepSeek-V3.2 (DSA): the lightning indexer's key width per token and layer (0: none).
    indexer_dim: int = 0
    #: Per layer: whether it keeps indexer keys (GLM MoE-DSA's "shared" layers reuse an earlier layer's top-k and
    #: keep none); empty: every layer, where ``indexer_dim`` is set.
    indexer_layers: list[bool] = field(default_factory=list)
    #: DeepSeek-V4's compressed layout (``None``: another model).
    v4: V4Shape | None = None
    #: How the model's own serving stack stores each cache part (``kv_storage``; :mod:`kveval.planner.native`).
    storage: dict[str, str] = field(default_factory=dict)
    num_parameters: int | None = None
    max_position: int | None = None
    notes: list[str] = field(default_factory=list)
    model_type: str = ""
    #: The weights as the checkpoint stores them, where known (``None``: parameters x the planned bytes each).
    weights: Weights | None = None
    #: One line saying how the model was read where the name does not (a Hub id planned as a preset; a GGUF).
    origin: str = ""

    @property
    def native_only(self) -> bool:
        """Whether the cache is the model's own cache layers part by part (DSA's indexer keys, V4's compressed
        entries: :mod:`kveval.planner.native`), not per-head or MLA K/V alone."""
        return bool(self.indexer_dim) or self.v4 is not None

    @property
    def cache_shape(self) -> CacheShape:
        """What one token (V4: one entry) of the cache holds, as a quantizer's :meth:`check_cache` reads it."""
        name = self.name or self.model_type or "this model"
        if self.v4 is not None:
            return CacheShape(name, "v4", self.head_dim, self.v4.rope, self.v4.index_dim)
        if self.mla_dim is not None:
            return CacheShape(name, "indexed_mla" if self.indexer_dim else "mla", self.mla_dim - self.mla_rope,
                              self.mla_rope, self.indexer_dim)
        return CacheShape(name, "heads", self.head_dim)

    def keeps_indexer(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps indexer keys."""
        return bool(self.indexer_dim) and (not self.indexer_layers or self.indexer_layers[layer])

    @property
    def describe(self) -> str:
        if self.v4 is not None:
            v4 = self.v4
            groups = sorted(set(v4.layers), key=lambda kr: (("sliding", "csa", "hca").index(kr[0]), -kr[1]))
            counts = ", ".join(f"{v4.layers.count((k, r))} {k}" + (f" (1 entry per {r})" if r > 1 else
                                                                    " (1 entry per token)" if r else "")
                               for k, r in groups)
            text = (f"{self.num_layers} layers ({counts}), window {v4.window}, K=V entries of {self.head_dim}, "
                    f"indexer {v4.index_dim}")
            if v4.kv_sources is not None:
                text += (f"; only layers {', '.join(map(str, v4.kv_sources))} store compressed KV and indexer keys, "
                         f"the rest reuse them")
            return text
        if self.mla_dim is not None:
            text = f"{self.num_layers} layers, MLA latent {self.mla_dim} values per token and layer"
        else:
            text = f"{self.num_layers} layers, {self.kv_heads} KV heads x head_dim {self.head_dim}"
        sliding = sorted({w for w, kv in zip(self.windows, self.holds_kv) if w is not None and kv})
        if self.indexer_dim:
            text += f" + indexer keys of {self.indexer_dim}"
        if sliding:
            n = sum(w is not None and kv for w, kv in zip(self.windows, self.holds_kv))
            text += f", {n} sliding (window {', '.join(map(str, sliding))})"
        states = self.holds_kv.count(False)
        if states:
            text += f", {states} without K/V (state or MLP-only layers)"
        return text

    def __post_init__(self):
        if not self.holds_kv:
            self.holds_kv = [True] * self.num_layers


def _positive_int(value, what: str, source: str) -> int:
    if not is_whole(value) or value < 1:
        raise UsageError(f"{source}: {what}={value!r} must be a positive integer")
    return value


def _optional_int(config: dict[str, Any], key: str, source: str, minimum: int = 1) -> int | None:
    """``config[key]`` as a whole number >= ``minimum``, or ``None`` where it is absent or null; a string such as
    ``"4096"`` is refused (``config.json`` writes numbers as numbers), naming the key."""
    value = config.get(key)
    if value is None:
        return None
    if not is_whole(value) or value < minimum:
        raise UsageError(f"{source}: {key}={value!r} must be a whole number >= {minimum}")
    return value


def _indexer_layers(config: dict[str, Any], layers: int) -> list[bool]:
    """Per layer, whether it runs its own DSA indexer and keeps its keys, as GLM MoE-DSA's configuration derives it
    (``indexer_types``; else ``index_topk_pattern``, ``F``/``S`` per layer; else ``index_topk_freq`` from
    ``index_skip_topk_offset``, default 2); every layer when none is given (DeepSeek V3.2)."""
    get = config.get
    types = get("indexer_types")
    if types is None and get("index_topk_pattern") is not None:
        pattern = get("index_topk_pattern")
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None and get("index_topk_freq") is not None:
        freq, offset = max(int(get("index_topk_freq")), 1), int(get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    return [True] * layers if types is None else [kind != "shared" for kind in list(types)[:layers]]


def spec_from_config(config: dict[str, Any], name: str = "config") -> ModelSpec:
    """Read a ``config.json``-style dict (multimodal configs: their ``text_config``)."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        outer = config
        config = dict(config["text_config"])
        config.setdefault("num_parameters", outer.get("num_parameters"))
        config.setdefault("quantization_config", outer.get("quantization_config"))
    for key, minimum in (("hidden_size", 1), ("num_attention_heads", 1), ("head_dim", 1), ("sliding_window", 0),
                         ("sliding_window_pattern", 0), ("max_window_layers", 0), ("attention_chunk_size", 0),
                         ("max_position_embeddings", 1), ("qk_rope_head_dim", 0)):
        _optional_int(config, key, name, minimum)  # "4096" where a count goes: one line naming the key, not a TypeError
    get = config.get
    if get("model_type") == "deepseek_v4" or get("compress_ratios") is not None or get("compress_rates") is not None:
        return _v4_spec(config, name)
    layers = get("num_hidden_layers", get("n_layer", get("num_layers")))
    if layers is None:
        raise UsageError(f"{name}: config has no num_hidden_layers; is it a decoder language model's config.json?")
    layers = _positive_int(layers, "num_hidden_layers", name)
    notes: list[str] = []
    heads = get("num_attention_heads", get("n_head"))
    kv_heads = get("num_key_value_heads", get("num_kv_heads"))
    if kv_heads is None:
        kv_heads = 1 if get("multi_query") else heads
    head_dim = get("head_dim")
    if head_dim is None and heads and get("hidden_size"):
        heads = _positive_int(heads, "num_attention_heads", name)
        if get("hidden_size") % heads:
            raise UsageError(f"{name}: hidden_size {get('hidden_size')} does not split evenly into {heads} attention "
                             f"heads ({get('hidden_size') / heads:.4g} each); give the model's head_dim in its config")
        head_dim = get("hidden_size") // heads
    mla_dim, mla_rope = None, 0
    if get("kv_lora_rank"):
        rope = get("qk_rope_head_dim") or 0
        mla_dim = _positive_int(get("kv_lora_rank"), "kv_lora_rank", name) + rope
        notes.append(f"MLA: each layer caches one latent of kv_lora_rank {get('kv_lora_rank')} + qk_rope_head_dim "
                     f"{rope} = {mla_dim} values per token, shared by all heads (latent-cache kernels: vLLM, SGLang, "
                     f"FlashMLA); transformers' eager attention caches decompressed per-head K/V instead")
        kv_heads, head_dim, mla_rope = 1, mla_dim, rope
    if heads is None and mla_dim is None:
        raise UsageError(f"{name}: config has no num_attention_heads")
    kv_heads = _positive_int(kv_heads, "num_key_value_heads", name)
    if mla_dim is None and kv_heads > _positive_int(heads, "num_attention_heads", name):
        raise UsageError(f"{name}: num_key_value_heads {kv_heads} exceeds num_attention_heads {heads}; each KV head "
                         f"serves one or more query heads, so there are at most as many: check the config")
    if head_dim is None:
        raise UsageError(f"{name}: config has neither head_dim nor hidden_size to derive it from")
    head_dim = _positive_int(head_dim, "head_dim", name)

    windows: list[int | None] = [None] * layers
    holds_kv, chunked, hybrid = [True] * layers, [False] * layers, [False] * layers
    window = get("sliding_window")
    layer_types = get("layer_types") or _hybrid_layer_types(config, layers, name)
    indexer_dim = 0
    if mla_dim is not None and (model_type_of(config) in ("deepseek_v32", "glm_moe_dsa")
                                or "indexed_attention" in (layer_types or ())):
        indexer_dim = _positive_int(get("index_head_dim") or 128, "index_head_dim", name)
        notes.append(f"DSA: each layer also caches the lightning indexer's key, {indexer_dim} values per token")
        layer_types = [("full_attention" if kind == "indexed_attention" else kind) for kind in layer_types or ()]
    indexer_layers = _indexer_layers(config, layers) if indexer_dim else []
    if indexer_layers and not all(indexer_layers):
        notes.append(f"DSA: {indexer_layers.count(False)} of {layers} layers reuse an earlier layer's top-k and keep "
                     f"no indexer keys")
    model_type = str(get("model_type") or "")
    if layer_types:
        if len(layer_types) != layers:
            raise UsageError(f"{name}: layer_types has {len(layer_types)} entries for {layers} layers")
        for i, kind in enumerate(layer_types):
            if kind not in KNOWN_LAYER_TYPES:
                raise UsageError(f"{name}: layer type {kind!r} is not one the planner knows "
                                 f"({', '.join(sorted(KNOWN_LAYER_TYPES))})")
            holds_kv[i], hybrid[i] = kind in KV_LAYER_TYPES, kind in HYBRID_LAYER_TYPES
            if kind in ("sliding_attention", "hybrid_sliding"):
                if not window:
                    raise UsageError(f"{name}: layer_types has sliding layers but sliding_window is not set")
                windows[i] = int(window)
            elif kind == "chunked_attention" and get("attention_chunk_size"):
                windows[i], chunked[i] = int(get("attention_chunk_size")), True
        if not any(holds_kv):
            raise UsageError(f"{name}: no layer holds K/V (layer_types: {', '.join(sorted(set(layer_types)))}); "
                             f"there is no KV cache to plan")
        if not all(holds_kv):
            notes.append(f"{holds_kv.count(False)} of {layers} layers hold no K/V of their own (Mamba, "
                         f"linear-attention, MLP-only or shared-K/V layers: not in this plan); the cache is the "
                         f"other {sum(holds_kv)} layers'")
    elif window and get("use_sliding_window") is False:
        notes.append(f"sliding_window={window} is ignored: use_sliding_window is false")
    elif window:
        pattern = get("sliding_window_pattern")
        if pattern is None and model_type.startswith("gemma3"):
            pattern = 6
        elif pattern is None and model_type.startswith("gemma2"):
            pattern = 2
        if pattern and pattern > 1:
            windows = [None if (i + 1) % pattern == 0 else int(window) for i in range(layers)]
        elif get("use_sliding_window") and get("max_window_layers") is not None:  # Qwen2 with sliding on
            windows = [int(window) if i >= get("max_window_layers") else None for i in range(layers)]
        else:
            windows = [int(window)] * layers
            remark = " (Mistral-7B-v0.1; v0.2 and later set sliding_window to null)" if model_type == "mistral" else ""
            notes.append(f"every layer attends to a sliding window of {window} tokens{remark}: each holds at most "
                         f"{int(window) - 1} tokens, and a selection policy keeps its share of those")
    sliding = [w for w, kv in zip(windows, holds_kv) if w is not None and kv]
    if sliding and len(sliding) < sum(holds_kv):
        notes.append(f"hybrid attention: {len(sliding)} of {sum(holds_kv)} attention layers slide and hold at most "
                     f"their window less one token ({', '.join(str(w) for w in sorted(set(sliding)))}); selection "
                     f"policies act on the {sum(holds_kv) - len(sliding)} full-attention layers only (as kveval's "
                     f"cache does)")
    return ModelSpec(name=str(get("_name_or_path") or name), num_layers=layers, kv_heads=kv_heads,
                     head_dim=head_dim, windows=windows, num_attention_heads=heads, holds_kv=holds_kv, chunked=chunked,
                     hybrid=hybrid, mla_dim=mla_dim,
                     mla_rope=mla_rope, indexer_dim=indexer_dim, indexer_layers=indexer_layers,
                     model_type=model_type, storage=_storage_of(config, name),
                     num_parameters=get("num_parameters") or _estimate_parameters(config),
                     max_position=None if _grows_positions(config) else get("max_position_embeddings"), notes=notes,
                     weights=weights_of(config))


#: ``quantization_config.quant_method`` values whose weights are one byte each (FP8 checkpoints).
_FP8_METHODS = ("fp8", "fbgemm_fp8")


#: Bytes per parameter of an MXFP4 weight: 4 bits and a 1-byte UE8M0 scale per 32 values.
MXFP4_BYTES = 0.5 + 1 / 32


def expert_parameters(config: dict[str, Any]) -> int | None:
    """The routed experts' parameters of a DeepSeek-style MoE config: ``(num_hidden_layers - first_k_dense_replace)
    x n_routed_experts x 3 x hidden_size x moe_intermediate_size`` (gate, up and down projections); ``None`` where a
    field is missing."""
    get = config.get
    sizes = [get(k) for k in ("num_hidden_layers", "n_routed_experts", "hidden_size", "moe_intermediate_size")]
    if not all(is_whole(v) and v > 0 for v in sizes):
        return None
    layers, experts, hidden, inter = sizes
    return (layers - int(get("first_k_dense_replace") or 0)) * experts * 3 * hidden * inter


def weights_of(config: dict[str, Any]) -> Weights | None:
    """The weights' precision a ``config.json`` records where the planner knows it: an FP8 checkpoint
    (``quantization_config.quant_method`` fp8: 1 byte per parameter; its block scales and the layers it leaves in
    BF16, embeddings and norms, are not counted: about 0.3% more on DeepSeek-V3), its routed experts in MXFP4 where
    ``expert_dtype`` is ``fp4`` (DeepSeek-V4's checkpoints, as vLLM's ``DeepseekV4FP8Config`` reads that key in
    ``vllm/models/deepseek_v4/quant_config.py``: :data:`MXFP4_BYTES` each); ``None`` otherwise."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() not in _FP8_METHODS:
        return None
    fmt = quant.get("fmt") or "e4m3"
    block = quant.get("weight_block_size")
    scales = f", {'x'.join(map(str, block))} block scales" if isinstance(block, list) and block else ""
    fp4 = str(config.get("expert_dtype", "")).lower() == "fp4"
    return Weights(source=f"as an FP8 checkpoint stores them (quantization_config {quant['quant_method']} {fmt}{scales}"
                          + ("; routed experts MXFP4, 4.25 bits with their scales" if fp4 else "")
                          + "; its scales and BF16 layers, embeddings and norms, not counted)", per_param=1.0,
                   expert_parameters=expert_parameters(config), expert_per_param=MXFP4_BYTES if fp4 else None)


def _grows_positions(config: dict[str, Any]) -> bool:
    """Dynamic NTK RoPE: the model grows its base past ``max_position_embeddings``, which then limits nothing."""
    scaling = config.get("rope_scaling")
    return isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "dynamic"


def model_type_of(config: dict[str, Any]) -> str:
    return str(config.get("model_type") or "")


def _storage_of(config: dict[str, Any], name: str) -> dict[str, str]:
    storage = config.get("kv_storage") or {}
    if not isinstance(storage, dict):
        raise UsageError(f"{name}: kv_storage must map cache parts to storage formats")
    return {str(k): str(v) for k, v in storage.items()}


#: DeepSeek-V4's layer types, as transformers names them, and their short names here.
_V4_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
             "heavily_compressed_attention": "hca"}


def _v4_spec(config: dict[str, Any], name: str) -> ModelSpec:
    """DeepSeek-V4: ``layer_types`` (transformers' names) with ``compress_rates``, or ``compress_ratios`` (the
    published config.json's per-layer rates: 0 sliding only, 4 CSA, else HCA; an entry past the layers is the MTP
    layer's), else transformers' default pattern (2 HCA, then HCA/CSA alternating)."""
    get = config.get
    layers = _positive_int(get("num_hidden_layers", 43), "num_hidden_layers", name)
    if get("kv_source_layer_ids") is not None:
        return _v41_spec(config, name, layers)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128} | dict(get("compress_rates") or {})
    types = get("layer_types")
    if types is None and get("compress_ratios") is not None:
        ratios = list(get("compress_ratios"))[:layers]
        types = ["sliding_attention" if r == 0 else "compressed_sparse_attention" if r == 4
                 else "heavily_compressed_attention" for r in ratios]
        hca = {r for r in ratios if r not in (0, 4)}
        if len(hca) > 1:
            raise UsageError(f"{name}: compress_ratios has several HCA rates ({sorted(hca)}); give layer_types and "
                             f"compress_rates")
        rates["heavily_compressed_attention"] = hca.pop() if hca else rates["heavily_compressed_attention"]
    if types is None:
        types = (["heavily_compressed_attention"] * min(layers, 2)
                 + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(layers - 2)])
    if len(types) != layers:
        raise UsageError(f"{name}: {len(types)} layer types for {layers} layers")
    bad = sorted({t for t in types if t not in _V4_TYPES})
    if bad:
        raise UsageError(f"{name}: DeepSeek-V4 layer type {bad[0]!r} is not one of {', '.join(_V4_TYPES)}")
    head_dim = _positive_int(get("head_dim", 512), "head_dim", name)
    rope = get("qk_rope_head_dim")
    if rope is None:
        rope = int(head_dim * (get("partial_rotary_factor") or 64 / 512))
    window = _positive_int(get("sliding_window", 128), "sliding_window", name)
    shape = V4Shape(layers=[(_V4_TYPES[t], 0 if t == "sliding_attention" else _positive_int(rates[t], t, name))
                            for t in types],
                    window=window, rope=rope,
                    index_dim=_positive_int(get("index_head_dim", 128), "index_head_dim", name))
    notes = [f"DeepSeek-V4: every layer keeps its newest {window - 1} tokens' K=V entries (a sliding-only layer keeps "
             f"K and V as two tensors, as transformers' DynamicSlidingWindowLayer does); CSA and HCA layers add one "
             f"compressed entry per {' or '.join(str(r) for r in sorted({r for _, r in shape.layers if r}))} tokens, CSA also an "
             f"indexer entry; the open window waits in constant-size buffers (state)",
             "transformers' V4 cache keeps the window and the buffers as slices of its step's tensors: right after "
             "a prefill they pin storage of the whole prefill (its K and compressor projections) until the next "
             "step replaces them; planned here is what the cache holds, not that transient storage"]
    return ModelSpec(name=str(get("_name_or_path") or name), num_layers=layers,
                     kv_heads=_positive_int(get("num_key_value_heads", 1), "num_key_value_heads", name),
                     head_dim=head_dim, windows=[window] * layers, v4=shape, storage=_storage_of(config, name),
                     num_attention_heads=_optional_int(config, "num_attention_heads", name),
                     model_type="deepseek_v4", weights=weights_of(config),
                     num_parameters=get("num_parameters"), max_position=get("max_position_embeddings"), notes=notes)


def _layer_ids(config: dict[str, Any], key: str, layers: int, name: str) -> tuple[int, ...]:
    """``config[key]``: distinct layer indices below ``layers``, in order; refused in one line otherwise."""
    ids = config.get(key)
    if not isinstance(ids, list) or not all(is_whole(i) and 0 <= i < layers for i in ids) or len(set(ids)) != len(ids):
        raise UsageError(f"{name}: {key}={ids!r} must list distinct layer indices in 0..{layers - 1}")
    return tuple(sorted(ids))


def _v41_spec(config: dict[str, Any], name: str, layers: int) -> ModelSpec:
    """DeepSeek-V4.1 (``kv_source_layer_ids``): ``compress_ratios`` per layer (0: sliding window only; r >= 1: one
    compressed entry per r tokens, read through the lightning indexer's top-k: CSA; entries past the layers are the
    draft model's). Only ``kv_source_layer_ids`` store compressed KV and the indexer keys beside it; every other
    compressing layer reads the nearest source at or before it, and ``index_source_layer_ids`` run the indexer over
    that source's keys. Planned as the reference inference code holds the cache (:class:`V4Shape`), since transformers
    has no ``deepseek_v41``."""
    get = config.get
    ratios = get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < layers or not all(is_whole(r) and r >= 0 for r in ratios):
        raise UsageError(f"{name}: compress_ratios must give a whole number >= 0 for each of the {layers} layers")
    ratios = ratios[:layers]
    sources = _layer_ids(config, "kv_source_layer_ids", layers, name)
    index_sources = _layer_ids(config, "index_source_layer_ids", layers, name) if get("index_source_layer_ids") is not None else sources
    compressing = [i for i, r in enumerate(ratios) if r]
    if any(ratios[i] == 0 for i in sources) or (compressing and compressing[0] not in sources):
        raise UsageError(f"{name}: kv_source_layer_ids {list(sources)} must be compressing layers, the first of them "
                         f"layer {compressing[0] if compressing else '-'}: every compressing layer reads a source at "
                         f"or before it")
    for i in compressing:  # a reuser reads the nearest source before it, which must compress at its rate
        source = max(s for s in sources if s <= i)
        if ratios[source] != ratios[i]:
            raise UsageError(f"{name}: layer {i} (compress ratio {ratios[i]}) would reuse layer {source}'s entries "
                             f"(ratio {ratios[source]}); a layer reuses a source of its own ratio")
    head_dim = _positive_int(get("head_dim", 512), "head_dim", name)
    rope = get("qk_rope_head_dim")
    window = _positive_int(get("sliding_window", 128), "sliding_window", name)
    shape = V4Shape(layers=[("csa", r) if r else ("sliding", 0) for r in ratios], window=window,
                    rope=int(rope if rope is not None else 64), index_dim=_positive_int(get("index_head_dim", 128),
                                                                                  "index_head_dim", name),
                    kv_sources=sources, index_sources=index_sources, reference_layout=True)
    notes = [f"DeepSeek-V4.1: every layer keeps a ring of its newest {window} tokens' K=V entries; only layers "
             f"{', '.join(map(str, sources))} store compressed entries (one per "
             f"{' or '.join(str(r) for r in sorted({ratios[i] for i in sources}, reverse=True))} tokens) and indexer "
             f"keys, the {len(compressing) - len(sources)} other compressing layers reuse the nearest source's; "
             f"{len(index_sources)} layers ({', '.join(map(str, index_sources))}) run the indexer over those keys",
             "planned as the reference inference code holds the cache (transformers has no deepseek_v41): the "
             "compressors' pending tokens, a few entries a layer, are not planned"]
    return ModelSpec(name=str(get("_name_or_path") or name), num_layers=layers,
                     kv_heads=_positive_int(get("num_key_value_heads", 1), "num_key_value_heads", name),
                     head_dim=head_dim, windows=[window] * layers, v4=shape, storage=_storage_of(config, name),
                     num_attention_heads=_optional_int(config, "num_attention_heads", name),
                     model_type=str(get("model_type") or "deepseek_v41"), weights=weights_of(config),
                     num_parameters=get("num_parameters"), max_position=get("max_position_embeddings"), notes=notes)


#: Keys by which a ``config.json`` without ``layer_types`` says that some layers hold no K/V (Mamba, linear
#: attention, shared K/V): Qwen3-Next, LFM2, Zamba2/Jamba, Nemotron-H, MiniMax, Bamba, Gemma 3n; or that some
#: attend in chunks (Llama 4's attention_chunk_size).
_HYBRID_KEYS = ("attention_chunk_size", "full_attention_interval", "full_attn_idxs", "layers_block_type", "hybrid_override_pattern",
                "attn_type_list", "attn_layer_indices", "attn_layer_period", "linear_num_key_heads", "mamba_d_state",
                "mamba_n_heads", "num_kv_shared_layers", "kv_sharing_modes")


def _hybrid_layer_types(config: dict[str, Any], layers: int, name: str) -> list[str] | None:
    """Layer types of a hybrid ``config.json`` that names its layers another way, read as transformers (and so
    kveval's cache) reads them; ``None`` for a config with no sign of such layers. Refused where they cannot be
    read: planning every layer as attention would count K/V the model never holds."""
    if not any(config.get(key) is not None for key in _HYBRID_KEYS):
        return None
    try:
        from transformers import AutoConfig

        settings = {k: v for k, v in config.items() if k not in ("model_type", "num_parameters")}
        types = layer_types_of(AutoConfig.for_model(config["model_type"], **settings))
    except Exception:  # noqa: BLE001  (no model_type, one transformers does not know, a config it rejects)
        types = None
    indices = config.get("attn_layer_indices")
    period, offset = config.get("attn_layer_period"), config.get("attn_layer_offset")
    if types is None and isinstance(indices, list):  # Bamba's
        types = ["full_attention" if i in indices else "mamba" for i in range(layers)]
    elif types is None and is_whole(period) and period > 0 and is_whole(offset):  # Jamba's
        types = ["full_attention" if i % period == offset else "mamba" for i in range(layers)]
    if types is None:
        raise UsageError(f"{name}: a hybrid config ({', '.join(k for k in _HYBRID_KEYS if config.get(k) is not None)}) "
                         f"whose layers transformers cannot read here; give its layer_types (one per layer: "
                         f"full_attention, sliding_attention, linear_attention, mamba, ...)")
    return types


def layer_types_of(config) -> list[str]:
    """A transformers config's layer types as its cache builds them (shared-K/V layers as ``"dummy"``)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return list(types)


def _estimate_parameters(config: dict[str, Any]) -> int | None:
    """Dense decoder (Llama-like, gated MLP) parameter count, or ``None`` when the config does not allow it."""
    get = config.get
    if any(get(k) for k in ("num_local_experts", "n_routed_experts", "num_experts", "kv_lora_rank")):
        return None  # MoE / MLA: too many variants to guess
    layers, hidden, heads, inter, vocab = (get("num_hidden_layers"), get("hidden_size"), get("num_attention_heads"),
                                           get("intermediate_size"), get("vocab_size"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, hidden, heads, inter, vocab)):
        return None
    kv = get("num_key_value_heads") or heads
    hd = get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * hd + 2 * hidden * kv * hd
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def gguf_spec(path: Path) -> ModelSpec:
    """A ``.gguf`` file's :class:`ModelSpec`, its weights at the size its tensors are stored in."""
    config, stored, arch = read_gguf(path)
    spec = spec_from_config(config, str(path))
    spec.weights = Weights(source=f"as {path.name} stores them ({stored.describe})", total=stored.bytes)
    spec.origin = (f"{path.name}: GGUF metadata of a {arch} model ({stored.parameters:,} parameters, "
                   f"{stored.file_type or 'mixed types'})")
    return spec


def preset_names() -> list[str]:
    return sorted(PRESETS)


def load_model_spec(model: "str | dict | ModelSpec | Any") -> ModelSpec:
    """A :class:`ModelSpec` from a preset name, ``config.json`` path or folder, Hub id, dict or ``PretrainedConfig``."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return spec_from_config(model)
    if not isinstance(model, (str, Path)):
        if hasattr(model, "to_dict"):  # a transformers PretrainedConfig
            text = model.get_text_config() if hasattr(model, "get_text_config") else model
            config = text.to_dict()
            config.setdefault("_name_or_path", getattr(model, "_name_or_path", "") or type(model).__name__)
            config["layer_types"] = layer_types_of(model)  # as the cache reads them: properties, shared K/V
            return spec_from_config(config, config["_name_or_path"])
        raise UsageError(f"cannot plan for a {type(model).__name__}; give a preset name, a config.json path, a Hub id or a dict")
    name = str(model).strip()
    if not name:
        raise UsageError(f"empty model name; give a preset ({', '.join(preset_names())}), a config.json path or a Hub id")
    if preset_key(name) in PRESET_KEYS:
        preset = PRESET_KEYS[preset_key(name)]
        spec = spec_from_config(dict(PRESETS[preset]), preset)
        spec.name = preset
        return spec
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_file():
        raise UsageError(f"{path}: no such GGUF file")
    if is_gguf(path):
        return gguf_spec(path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UsageError(f"{name}: folder has no config.json")
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"{path}: not a readable config.json ({str(exc).splitlines()[0]})") from None
        if not isinstance(config, dict):
            raise UsageError(f"{path}: config.json must hold a JSON object")
        return spec_from_config(config, str(path))
    if "/" not in name or name.startswith((".", "/", "~")) or name.endswith(".json"):
        raise UsageError(f"unknown model {name!r}: not a preset ({', '.join(preset_names())}), an existing "
                         f"config.json, folder or .gguf file, or a Hub id (owner/name)")
    if name.lower() in HUB_PRESETS:
        preset = HUB_PRESETS[name.lower()]
        spec = load_model_spec(preset)
        spec.origin = (f"{name} planned as preset {preset} (kveval's excerpt of its config.json: no download; give "
                       f"a config.json path for another revision)")
        return spec
    if not hub_cached(name):
        offline = hub_offline()
        if offline:
            raise UsageError(f"cannot read the config of {name!r}: the Hub is out of reach ({offline}) and it is not "
                             f"in the local Hub cache; fix: download it once with `hf download {name} config.json` "
                             f"while online, or give a local config.json, a .gguf or a preset "
                             f"({', '.join(preset_names())})")
    try:
        from transformers import AutoConfig

        try:  # a cached config first: no network round trip (offline, the Hub client retries for ~30 s)
            config = AutoConfig.from_pretrained(name, local_files_only=True)
        except OSError:
            config = AutoConfig.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001  (offline, not cached, no such repo, gated, unknown architecture)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"cannot read the config of {name!r} ({first[:160]}); fix: download it once with "
                         f"`huggingface-cli download {name} config.json` (or `hf download ...`) while online, or "
                         f"pass a local config.json path or a preset") from None
    return load_model_spec(config)


__all__ = ["HUB_PRESETS", "MXFP4_BYTES", "ModelSpec", "PRESETS", "V4Shape", "Weights", "expert_parameters", "gguf_spec", "load_model_spec",
           "preset_names", "spec_from_config", "weights_of"]
