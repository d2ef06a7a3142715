"""Models as the memory planner sees them: their cache-relevant shape (:class:`ModelSpec`), read from a named
preset (:data:`PRESETS`: ``config.json`` excerpts of well-known models), a local ``config.json`` or a folder holding
one, a Hugging Face Hub id (``transformers.AutoConfig``; offline only when cached), a ``dict`` or a
``PretrainedConfig``. No weights are loaded. :mod:`kveval.planner.memory` plans bytes from a :class:`ModelSpec`.
"""

from __future__ import annotations

from kveval.errors import UsageError

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kveval.modeling.layer_types import KNOWN_LAYER_TYPES, KV_LAYER_TYPES
from kveval.values import is_whole

# ----------------------------------------------------------------------------------------------
# presets: config.json excerpts (the fields the planner reads) of well-known models

PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "_name_or_path": "meta-llama/Llama-2-7b-hf", "model_type": "llama", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096, "intermediate_size": 11008,
        "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "num_parameters": 6_738_415_616,
    },
    "llama-3.1-8b": {
        "_name_or_path": "meta-llama/Llama-3.1-8B", "model_type": "llama", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "num_parameters": 8_030_261_248,
    },
    "mistral-7b": {
        "_name_or_path": "mistralai/Mistral-7B-v0.1", "model_type": "mistral", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
        "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096, "tie_word_embeddings": False,
        "num_parameters": 7_241_732_096,
    },
    "qwen2.5-7b": {
        "_name_or_path": "Qwen/Qwen2.5-7B", "model_type": "qwen2", "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584, "intermediate_size": 18944,
        "vocab_size": 152064, "max_position_embeddings": 131072, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
        "num_parameters": 7_615_616_512,
    },
    "gemma-3-27b": {
        "_name_or_path": "google/gemma-3-27b-pt", "model_type": "gemma3_text", "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376,
        "intermediate_size": 21504, "vocab_size": 262208, "max_position_embeddings": 131072,
        "sliding_window": 1024, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "num_parameters": 27_432_406_640,  # with the vision tower, as the Hub lists it
    },
    "gemma3-270m": {
        "_name_or_path": "google/gemma-3-270m", "model_type": "gemma3_text", "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640,
        "intermediate_size": 2048, "vocab_size": 262144, "max_position_embeddings": 32768,
        "sliding_window": 512, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "num_parameters": 268_098_176,
    },
    "smollm2-135m": {
        "_name_or_path": "HuggingFaceTB/SmolLM2-135M", "model_type": "llama", "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536,
        "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "num_parameters": 134_515_008,
    },
    "deepseek-v3": {
        "_name_or_path": "deepseek-ai/DeepSeek-V3", "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
        "max_position_embeddings": 163840, "n_routed_experts": 256,
        "num_parameters": 671_026_419_200,  # weights ship in FP8 (1 byte per parameter)
    },
}

_ALIASES = {"gemma3-27b": "gemma-3-27b", "gemma-3-270m": "gemma3-270m", "llama2-7b": "llama-2-7b",
            "llama3.1-8b": "llama-3.1-8b", "mistral-7b-v0.1": "mistral-7b", "smollm2": "smollm2-135m",
            "deepseek-v3-671b": "deepseek-v3"}



def _key(name: str) -> str:
    return re.sub(r"[-_.\s]", "", name.lower())


_PRESET_KEYS = {_key(n): n for n in PRESETS} | {_key(a): n for a, n in _ALIASES.items()}


# ----------------------------------------------------------------------------------------------
# the model as the planner sees it

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
    holds_kv: list[bool] = field(default_factory=list)
    #: ``chunked[i]``: layer ``i``'s window is an attention chunk (Llama 4), where no selection acts.
    chunked: list[bool] = field(default_factory=list)
    mla_dim: int | None = None
    mla_rope: int = 0
    num_parameters: int | None = None
    max_position: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def describe(self) -> str:
        if self.mla_dim is not None:
            text = f"{self.num_layers} layers, MLA latent {self.mla_dim} values per token and layer"
        else:
            text = f"{self.num_layers} layers, {self.kv_heads} KV heads x head_dim {self.head_dim}"
        sliding = sorted({w for w, kv in zip(self.windows, self.holds_kv) if w is not None and kv})
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


def spec_from_config(config: dict[str, Any], name: str = "config") -> ModelSpec:
    """Read a ``config.json``-style dict (multimodal configs: their ``text_config``)."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        outer = config
        config = dict(config["text_config"])
        config.setdefault("num_parameters", outer.get("num_parameters"))
    for key, minimum in (("hidden_size", 1), ("num_attention_heads", 1), ("head_dim", 1), ("sliding_window", 0),
                         ("sliding_window_pattern", 0), ("max_window_layers", 0), ("attention_chunk_size", 0),
                         ("max_position_embeddings", 1), ("qk_rope_head_dim", 0)):
        _optional_int(config, key, name, minimum)  # "4096" where a count goes: one line naming the key, not a TypeError
    get = config.get
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
    if head_dim is None:
        raise UsageError(f"{name}: config has neither head_dim nor hidden_size to derive it from")
    head_dim = _positive_int(head_dim, "head_dim", name)

    windows: list[int | None] = [None] * layers
    holds_kv, chunked = [True] * layers, [False] * layers
    window = get("sliding_window")
    layer_types = get("layer_types") or _hybrid_layer_types(config, layers, name)
    model_type = str(get("model_type") or "")
    if layer_types:
        if len(layer_types) != layers:
            raise UsageError(f"{name}: layer_types has {len(layer_types)} entries for {layers} layers")
        for i, kind in enumerate(layer_types):
            if kind not in KNOWN_LAYER_TYPES:
                raise UsageError(f"{name}: layer type {kind!r} is not one the planner knows "
                                 f"({', '.join(sorted(KNOWN_LAYER_TYPES))})")
            holds_kv[i] = kind in KV_LAYER_TYPES
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
                     head_dim=head_dim, windows=windows, holds_kv=holds_kv, chunked=chunked, mla_dim=mla_dim,
                     mla_rope=mla_rope,
                     num_parameters=get("num_parameters") or _estimate_parameters(config),
                     max_position=None if _grows_positions(config) else get("max_position_embeddings"), notes=notes)


def _grows_positions(config: dict[str, Any]) -> bool:
    """Dynamic NTK RoPE: the model grows its base past ``max_position_embeddings``, which then limits nothing."""
    scaling = config.get("rope_scaling")
    return isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "dynamic"


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
    if _key(name) in _PRESET_KEYS:
        preset = _PRESET_KEYS[_key(name)]
        spec = spec_from_config(dict(PRESETS[preset]), preset)
        spec.name = preset
        return spec
    path = Path(name).expanduser()
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
                         f"config.json or folder, or a Hub id (owner/name)")
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


__all__ = ["ModelSpec", "PRESETS", "load_model_spec", "preset_names", "spec_from_config"]
