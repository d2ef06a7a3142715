"""What kveval knows about model architectures, in one place.

Two questions are answered here and nowhere else:

1. **Which cache layer does each model layer get?** :func:`cache_layer_plan`
   reads ``config.layer_types`` the way transformers' own ``DynamicCache`` does
   (:func:`transformers.cache_utils.get_layer_types_and_kwargs`) and maps every
   entry to a :class:`LayerPlan`: compressed attention (full or sliding),
   constant-size state (linear attention / Mamba conv + recurrent states, kept by
   transformers' own ``LinearAttentionLayer``), the model's own cache layer mirrored
   part by part (DeepSeek V3.2 / GLM MoE-DSA's ``indexed_attention``, every layer of
   DeepSeek V4: :mod:`kveval.cache.native_layers`), or nothing (MLP-only layers,
   KV-sharing consumers). A layer type kveval does not know is refused with
   :class:`~kveval.errors.UnsupportedModelError`, never treated as plain attention.

2. **How is attention computed exactly?** :func:`attention_kernel` picks, per
   attention module call, the kernel that reproduces the model's own attention
   over the kept tokens: transformers' SDPA when SDPA can express the module's
   attention, otherwise the model's *own* eager attention function (the
   ``eager_attention_forward`` of the module's modeling file), called with
   kveval's mask. The variants SDPA cannot express are listed in
   :data:`EAGER_VARIANTS` (logit softcapping: Gemma 2; learned attention sinks:
   gpt-oss). Selection policies score tokens with the same kernel's attention
   probabilities, so they see softcapped / sink-diluted probabilities exactly as
   the model computes them (with sinks, a query's probabilities over the kept
   tokens sum to less than 1: the sink's share is nobody's).

MLA (DeepSeek V2/V3 and every config with ``kv_lora_rank``): transformers 5.x
already passes the normed latent ``c_KV`` (``[B, 1, T, kv_lora_rank]``) and the
shared RoPE key (``[B, 1, T, qk_rope_head_dim]``) to ``Cache.update`` and expands
them to per-head K/V after the cache (``expand_kv``), so kveval caches exactly
the latent with no wrapper: the store sees one "KV head" whose "keys" are the
latent and whose "values" are the RoPE key. Selection scores are averaged over
all query heads, so a token is kept or dropped for every head at once.
:func:`mla_dims` checks that the attention modules really do this; a config with
``kv_lora_rank`` whose modules do not is refused.

The rotary embedding each model applies to its keys (a hook to undo it, and where its angles depend on the
sequence length) is read in :mod:`kveval.modeling.rope`.

No policy imports this module: policies never know which architecture they run on.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from kveval.errors import UnsupportedModelError
from kveval.modeling.layer_types import (
    ATTENTION_LAYER_TYPES,
    EMPTY_LAYER_TYPES,
    HYBRID_LAYER_TYPES,
    KNOWN_LAYER_TYPES,
    NATIVE_LAYER_TYPES,
    NATIVE_MODEL_TYPES,
    STATE_LAYER_TYPES,
)
from kveval.tensors.block_probabilities import SINK_SLOT_STEP

#: The name kveval's attention function is registered under (``attn_implementation="kveval"``).
KVEVAL_ATTENTION = "kveval"

ATTENTION = "attention"
STATE = "state"
HYBRID = "hybrid"  # attention and a state in the same layer (Falcon-H1)
NATIVE = "native"  # the model's own cache layer, its parts mirrored (DeepSeek V3.2 / V4: kveval.cache.native_layers)
NONE = "none"



@dataclass(frozen=True)
class LayerPlan:
    """What the cache holds for one model layer.

    Attributes
    ----------
    kind : str
        ``"attention"`` (per-token K/V, compressed by the policy), ``"state"``
        (constant-size conv/recurrent states, kept exactly), ``"hybrid"`` (both
        in one layer) or ``"none"``.
    layer_type : str
        The ``config.layer_types`` entry it came from.
    sliding_window : int or None
        Attention layers: the model's window (tokens), ``None`` for full attention;
        for chunked attention (Llama 4), the chunk size.
    chunked : bool
        Chunked attention: a query sees the earlier tokens of its own chunk only.
    number_of_states : int
        State layers: how many conv/recurrent state pairs the layer keeps.
    """

    kind: str
    layer_type: str
    sliding_window: int | None = None
    number_of_states: int = 1
    chunked: bool = False

    @property
    def holds_tokens(self) -> bool:
        """Whether the layer keeps per-token K/V (what policies compress)."""
        return self.kind in (ATTENTION, HYBRID, NATIVE)


def architecture_name(config) -> str:
    """A readable name: the first entry of ``config.architectures``, else ``config.model_type``."""
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else getattr(config, "model_type", type(config).__name__)


def cache_layer_plan(config) -> list[LayerPlan]:
    """One :class:`LayerPlan` per model layer; raises :class:`UnsupportedModelError` for unknown layer types."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    except (AttributeError, TypeError, ValueError) as exc:  # pragma: no cover - exotic configs
        raise UnsupportedModelError(f"{architecture_name(config)}: cannot read its cache layer types ({exc})") from exc
    plans = []
    native = is_native(config)
    for kind, kwargs in zip(layer_types, layer_kwargs):
        if native and kind in NATIVE_LAYER_TYPES | {"sliding_attention"}:
            # DeepSeek V4: every layer keeps a window of K=V entries (its own cache layer's window); V3.2: none.
            window = getattr(text, "sliding_window", None) if getattr(text, "model_type", "") == "deepseek_v4" else None
            plans.append(LayerPlan(NATIVE, kind, sliding_window=window or None))
        elif kind in ATTENTION_LAYER_TYPES:
            window = kwargs.get("sliding_window") if kind != "full_attention" else None
            plans.append(LayerPlan(ATTENTION, kind, sliding_window=window or None, chunked=kind == "chunked_attention"))
        elif kind in STATE_LAYER_TYPES | HYBRID_LAYER_TYPES:
            plans.append(LayerPlan(STATE if kind in STATE_LAYER_TYPES else HYBRID, kind,
                                   sliding_window=kwargs.get("sliding_window") or None,
                                   number_of_states=kwargs.get("number_of_states", 1)))
        elif kind in EMPTY_LAYER_TYPES:
            plans.append(LayerPlan(NONE, kind))
        else:
            known = sorted(KNOWN_LAYER_TYPES | NATIVE_LAYER_TYPES)
            raise UnsupportedModelError(
                f"{architecture_name(config)}: cache layer type {kind!r} is not supported by kveval "
                f"(known: {', '.join(known)}); it would not be evaluated exactly, so it is refused")
    return plans


def is_native(config) -> bool:
    """Whether ``config``'s cache is mirrored part by part from the model's own cache layers
    (:data:`~kveval.modeling.layer_types.NATIVE_MODEL_TYPES`: DeepSeek V3.2, GLM MoE-DSA, DeepSeek V4)."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "model_type", None) in NATIVE_MODEL_TYPES


def check_supported(config) -> list[LayerPlan]:
    """Refuse a config kveval cannot cache exactly (unknown layer types, an MLA config it cannot recognise)."""
    plans = cache_layer_plan(config)
    if not any(p.holds_tokens for p in plans):
        raise UnsupportedModelError(f"{architecture_name(config)}: no attention layer, so there is no KV cache to compress")
    return plans


# --- MLA ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MlaDims:
    """Per-token cache widths of an MLA model (elements per layer)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    heads: int
    qk_nope_head_dim: int
    v_head_dim: int

    @property
    def latent_elements(self) -> int:
        """What kveval caches per token per layer: the normed latent and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def per_head_elements(self) -> int:
        """What a per-head cache would hold: K (nope + rope) and V for every head."""
        return self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


def mla_dims(config) -> MlaDims | None:
    """The MLA widths of a config with ``kv_lora_rank``, ``None`` for other models."""
    text = config.get_text_config(decoder=True)
    rank = getattr(text, "kv_lora_rank", None)
    if not rank:
        return None
    try:
        return MlaDims(rank, text.qk_rope_head_dim, text.num_attention_heads, text.qk_nope_head_dim, text.v_head_dim)
    except AttributeError as exc:
        raise UnsupportedModelError(f"{architecture_name(config)}: has kv_lora_rank but not the MLA fields ({exc})") from exc


def check_mla_modules(model) -> None:
    """Refuse an MLA config whose attention modules do not cache the latent (they must expand after ``Cache.update``)."""
    if mla_dims(model.config) is None:
        return
    for module in model.modules():
        if hasattr(module, "kv_a_proj_with_mqa") and not hasattr(module, "expand_kv"):
            raise UnsupportedModelError(
                f"{architecture_name(model.config)}: MLA attention ({type(module).__name__}) expands per-head K/V before "
                f"the cache, so kveval cannot cache the latent; upgrade transformers")


def cache_widths(config) -> tuple[int, int]:
    """Elements per token per attention layer of what reaches ``Cache.update``: (keys, values), all heads together.
    DeepSeek V4 stores one K=V tensor per entry: (head_dim, 0); MLA one latent and one RoPE key per token."""
    keys, values = cache_head_dims(config)
    if _keys_are_values(config) or mla_dims(config) is not None:
        return keys, values
    text = config.get_text_config(decoder=True)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return kv_heads * keys, kv_heads * values


def _keys_are_values(config) -> bool:
    """DeepSeek V4: its attention reads one tensor as K and V (``cache.update(kv, kv)``), which its cache holds once."""
    return getattr(config.get_text_config(decoder=True), "model_type", None) == "deepseek_v4"


def cache_head_dims(config) -> tuple[int, int]:
    """Width of one stored K and one stored V head (MLA: the latent and the RoPE key; DeepSeek V4: K=V, stored as K
    alone, so V has width 0)."""
    if _keys_are_values(config):
        return config.get_text_config(decoder=True).head_dim, 0
    mla = mla_dims(config)
    if mla is not None:
        return mla.kv_lora_rank, mla.qk_rope_head_dim
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return head_dim, head_dim


# --- attention kernels ----------------------------------------------------------------------------

#: Attention variants SDPA cannot express, each with the test that a module call uses it.
#: Modules that use one run through their model's own eager attention function.
EAGER_VARIANTS: dict[str, Callable[[torch.nn.Module, dict], bool]] = {
    "logit softcapping": lambda module, kwargs: kwargs.get("softcap") is not None,
    "learned attention sinks": lambda module, kwargs: isinstance(getattr(module, "sinks", None), torch.Tensor),
}


_EVERY_SLOT_VISIBLE: dict[tuple, torch.Tensor] = {}  # (batch, width, device) -> the mask; cleared past 64 shapes


def every_slot_visible(batch: int, width: int, device) -> torch.Tensor:
    """The boolean mask ``[batch, 1, 1, width]`` of one query per row that sees every slot: one tensor per shape
    and device, never written to, which kernels recognise (:func:`is_every_slot_visible`) to skip masking."""
    key = (batch, width, torch.device(device))
    mask = _EVERY_SLOT_VISIBLE.get(key)
    if mask is None:
        if len(_EVERY_SLOT_VISIBLE) >= 64:
            _EVERY_SLOT_VISIBLE.clear()
        mask = _EVERY_SLOT_VISIBLE[key] = torch.ones(batch, 1, 1, width, dtype=torch.bool, device=device)
    return mask


def is_every_slot_visible(allowed: torch.Tensor) -> bool:
    """Whether ``allowed`` is the mask :func:`every_slot_visible` made for its shape (a mask equal to it but made
    elsewhere is masked as any other)."""
    return (allowed.dim() == 4 and allowed.shape[1] == 1 and allowed.shape[2] == 1
            and allowed is _EVERY_SLOT_VISIBLE.get((allowed.shape[0], allowed.shape[3], allowed.device)))


@functools.lru_cache(maxsize=64)
def _nothing_masked(batch: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive mask ``[batch, 1, 1, width]`` (zeros) SDPA makes of :func:`every_slot_visible`: made once per
    shape, rather than by SDPA at every layer and step (the same bits)."""
    return torch.zeros(batch, 1, 1, width, dtype=dtype, device=device)


@functools.lru_cache(maxsize=16)
def _mask_addends(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0 and -inf as float32 0-dim tensors on ``device``, made once: ``torch.where`` would make tensors of numbers
    at every call, and copies a host tensor beside a mask on a GPU to the GPU (a copy that waits)."""
    return (torch.zeros((), dtype=torch.float32, device=device),
            torch.full((), float("-inf"), dtype=torch.float32, device=device))


class AttentionKernel(Protocol):
    """Computes one attention module's output over given K/V under a boolean mask, exactly as the model would."""

    def attend(self, module, query, key, value, allowed: torch.Tensor | None, dropout: float, scaling: float,
               kwargs: dict) -> torch.Tensor:
        """``allowed``: boolean ``[B, 1 or heads, q, k]`` (True = visible), or ``None`` for right-aligned causal."""

    def probabilities(self, module, query, key, allowed: torch.Tensor, scaling: float, kwargs: dict) -> torch.Tensor:
        """Attention probabilities ``[B, query_heads, q, k]`` (float32) the model gives each key.

        ``allowed`` is ``[B, h, q, k]``, ``h`` being 1, the KV heads or the query heads: a KV head's mask stands
        for every query head that reads it."""

    def slot_step(self, module) -> int:
        """The multiple of trailing slots a call of :meth:`probabilities` over fewer slots than the keys hold
        leaves out to keep its bits (see :class:`~kveval.tensors.block_probabilities.AttentionProbabilities`)."""


class SdpaKernel:
    """transformers' SDPA attention; scoring recomputes softmax(q k^T * scaling) in float32."""

    def attend(self, module, query, key, value, allowed, dropout, scaling, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if allowed is not None and is_every_slot_visible(allowed):  # SDPA would turn it into these zeros itself
            allowed = _nothing_masked(allowed.shape[0], allowed.shape[3], query.dtype, allowed.device)
        output, _ = sdpa_attention_forward(module, query, key, value, allowed, dropout=dropout, scaling=scaling, **kwargs)
        return output

    def probabilities(self, module, query, key, allowed, scaling, kwargs):
        # Each KV head's query heads as one [groups * q] matrix: no copy of K or of the mask per query head. One
        # bmm over [B * KV heads] matrices, the product matmul makes of these 4-D tensors (the same bits), in fewer ops.
        batch, heads, q_len, width = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        logits = torch.bmm(query.float().reshape(batch * kv_heads, groups * q_len, width),
                           key.float().reshape(batch * kv_heads, k_len, width).transpose(1, 2))
        logits = logits.mul_(scaling).view(batch, kv_heads, groups, q_len, k_len)  # in place: the logits are this call's
        if not is_every_slot_visible(allowed):  # masking nothing leaves the logits as they are
            if allowed.shape[1] == heads and groups > 1:
                allowed = allowed.view(batch, kv_heads, groups, q_len, -1)
            else:
                allowed = allowed.unsqueeze(2)  # [B, 1 or KV heads, 1, q, k]
            # Adding 0 or -inf: the bits of masked_fill_(~allowed, -inf) (x + 0 is x, and a -0 logit's exp is
            # a +0 one's), at a sixth of its time on a CPU, whose masked_fill_ over a broadcast mask is not vectorized.
            logits = logits.add_(torch.where(allowed, *_mask_addends(allowed.device)))
        return torch.softmax(logits, dim=-1).view(batch, heads, q_len, k_len)

    def slot_step(self, module) -> int:
        return 1  # a softmax over the slots alone: the same bits at any width


class EagerKernel:
    """The model's own ``eager_attention_forward``, given kveval's mask as the additive mask it expects."""

    def __init__(self, function):
        self.function = function

    def _call(self, module, query, key, value, allowed, dropout, scaling, kwargs):
        if allowed is None:
            allowed = causal_mask(query.shape[2], key.shape[2], kwargs.get("sliding_window"), query.device)
        if allowed.shape[1] not in (1, query.shape[1]):  # one row per KV head: the eager function adds per query head
            allowed = allowed.repeat_interleave(query.shape[1] // allowed.shape[1], dim=1)
        if allowed.dtype == torch.bool:
            additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
            allowed = additive.masked_fill(~allowed, torch.finfo(query.dtype).min)
        return self.function(module, query, key, value, allowed, dropout=dropout, scaling=scaling, **kwargs)

    def attend(self, module, query, key, value, allowed, dropout, scaling, kwargs):
        return self._call(module, query, key, value, allowed, dropout, scaling, kwargs)[0]

    def probabilities(self, module, query, key, allowed, scaling, kwargs):
        # The values do not change the probabilities: the keys stand in for them (any width works).
        return self._call(module, query, key, key, allowed, 0.0, scaling, kwargs)[1].float()

    def slot_step(self, module) -> int:
        return SINK_SLOT_STEP if EAGER_VARIANTS["learned attention sinks"](module, {}) else 1


def causal_mask(q_len: int, k_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """Boolean ``[1, 1, q, k]``: query ``i`` is the token at key index ``k_len - q_len + i`` (right-aligned)."""
    query_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    key_pos = torch.arange(k_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window:
        allowed &= key_pos > query_pos - sliding_window
    return allowed[None, None]


_SDPA = SdpaKernel()
_EAGER: dict[str, EagerKernel] = {}


def eager_variant(module, kwargs: dict) -> str | None:
    """Name of the first :data:`EAGER_VARIANTS` entry this module call uses, else ``None``."""
    for name, uses in EAGER_VARIANTS.items():
        if uses(module, kwargs):
            return name
    return None


def attention_kernel(module, kwargs: dict) -> AttentionKernel:
    """The kernel that computes this module call's attention exactly (see the module docstring)."""
    variant = eager_variant(module, kwargs)
    if variant is None:
        return _SDPA
    modeling = type(module).__module__
    if modeling not in _EAGER:
        function = getattr(sys.modules.get(modeling), "eager_attention_forward", None)
        if function is None:
            raise UnsupportedModelError(f"{type(module).__name__} uses {variant}, which SDPA cannot express, and its "
                                        f"modeling file {modeling} has no eager_attention_forward to compute it exactly")
        _EAGER[modeling] = EagerKernel(function)
    return _EAGER[modeling]


# --- Llama 4's query temperature ------------------------------------------------------------------

@dataclass(frozen=True)
class QueryTemperature:
    """Llama 4's temperature tuning (arXiv 2501.19399) of its layers without RoPE: the query at position ``p`` is
    scaled by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` in float32, then cast back to its dtype.

    transformers takes ``p`` from the cache's length (``get_seq_length``), which in a left-padded batch counts the
    row's padding: a row padded across a multiple of ``floor_scale`` (8,192 in Llama 4) is scaled as a longer row
    is, so batch N gave other answers than batch 1. :func:`row_query_temperatures` takes the scaling over for a
    forward whose positions are declared, and :meth:`apply` scales each row by its own positions, elementwise as
    transformers does (the same bits as the row alone)."""

    attn_scale: float
    floor_scale: float

    def apply(self, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``query`` ``[B, heads, q, head_dim]`` scaled at ``positions`` (``[B, q]``, each row's own)."""
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (query * scales[:, None, :, None]).to(query.dtype)


#: Attention modules whose query temperature kveval applies during the current forward.
_TAKEN_TEMPERATURES: "weakref.WeakKeyDictionary[torch.nn.Module, QueryTemperature]" = weakref.WeakKeyDictionary()
_TUNING_MODULES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _tuned_modules(model) -> list:
    """The attention modules of ``model`` that tune their queries' temperature (Llama 4's layers without RoPE) and
    whose attention is kveval's, which alone scales them again (:func:`kveval.cache.attention.kveval_attention`)."""
    config = model.config.get_text_config(decoder=True)
    layers = getattr(config, "no_rope_layers", None)
    if not getattr(config, "attn_temperature_tuning", False) or layers is None or all(layers):
        return []  # most models: nothing to look for in every forward
    if model not in _TUNING_MODULES:
        _TUNING_MODULES[model] = tuple(
            module for module in model.modules()
            if hasattr(module, "attn_temperature_tuning") and not getattr(module, "use_rope", True)
            and hasattr(module, "attn_scale") and hasattr(module, "floor_scale"))
    return [module for module in _TUNING_MODULES[model] if module.attn_temperature_tuning
            and getattr(getattr(module, "config", None), "_attn_implementation", None) == KVEVAL_ATTENTION]


@contextlib.contextmanager
def row_query_temperatures(model):
    """During one forward whose positions the driver declares to the cache, kveval's attention scales the
    queries of ``model``'s temperature-tuned modules by each row's positions (:class:`QueryTemperature`), and
    the modules do not: their flag is off for the forward and given back after it, even on an error, so the same
    model under another cache runs as transformers runs it. The one place kveval changes a module's state."""
    modules = _tuned_modules(model)
    flags = [module.attn_temperature_tuning for module in modules]
    for module in modules:
        _TAKEN_TEMPERATURES[module] = QueryTemperature(module.attn_scale, module.floor_scale)
        module.attn_temperature_tuning = False
    try:
        yield
    finally:
        for module, flag in zip(modules, flags):
            module.attn_temperature_tuning = flag
            _TAKEN_TEMPERATURES.pop(module, None)


@contextlib.contextmanager
def own_query_temperatures(model):
    """For a forward kveval runs inside one it drives, declaring no positions (a policy calibrating on its first
    use: DuoAttention's retrieval heads, lowrank's and latent's bases): the modules whose temperature
    :func:`row_query_temperatures` took over scale their own queries, as outside kveval's forwards (kveval's
    attention refuses a taken temperature without declared positions); taken over again afterwards, even on an
    error."""
    taken = [(module, _TAKEN_TEMPERATURES[module]) for module in _TUNING_MODULES.get(model, ())
             if module in _TAKEN_TEMPERATURES]
    for module, _ in taken:
        del _TAKEN_TEMPERATURES[module]
        module.attn_temperature_tuning = True
    try:
        yield
    finally:
        for module, temperature in taken:
            module.attn_temperature_tuning = False
            _TAKEN_TEMPERATURES[module] = temperature


def taken_query_temperature(module) -> QueryTemperature | None:
    """The temperature kveval applies to ``module``'s queries in this forward, if it took it over."""
    return _TAKEN_TEMPERATURES.get(module) if _TAKEN_TEMPERATURES else None


__all__ = ["ATTENTION", "AttentionKernel", "EAGER_VARIANTS", "EagerKernel", "HYBRID", "KVEVAL_ATTENTION",
           "LayerPlan", "MlaDims", "NATIVE", "NONE", "QueryTemperature", "STATE", "SdpaKernel", "architecture_name",
           "attention_kernel", "cache_head_dims", "cache_layer_plan", "cache_widths", "causal_mask",
           "check_mla_modules", "check_supported", "is_native", "eager_variant", "mla_dims", "own_query_temperatures",
           "row_query_temperatures", "taken_query_temperature"]
