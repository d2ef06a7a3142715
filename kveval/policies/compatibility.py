"""What a policy stack may run on a model's own cache layers, checked from the policy's declared capabilities
(:class:`~kveval.policies.base.Placement`, :class:`~kveval.policies.base.Need`) before any weights load. Torch-free,
below both the cache (:mod:`kveval.cache.native_layers`) and the memory planner, which ask here and name no policy.

DeepSeek V3.2 (and GLM's MoE-DSA models) and DeepSeek V4 keep more than per-token K/V: an MLA latent with the DSA
indexer's keys, or V4's sliding window, compressed CSA/HCA entries and their indexer keys. On those caches a
selection must declare the placement it acts on (:attr:`~kveval.policies.base.Placement.LATENT`,
:attr:`~kveval.policies.base.Placement.ENTRIES`, and where layers share an indexer's top-k
:attr:`~kveval.policies.base.Placement.SAME_TOKENS_EVERY_LAYER`), a quantizer that it codes their parts
(:attr:`~kveval.policies.base.Placement.PARTS`); everything else is refused in one line naming what it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.errors import UnsupportedModelError
from kveval.policies.base import Need, Placement, PlannedCoding
from kveval.policies.registry import supporting
from kveval.tensors.quant_format import TensorQuant

#: DeepSeek's serving format of the indexer's keys: e4m3 with one scale per this many values.
INDEXER_FP8_GROUP = 128
#: The model types whose cache layers gather the indexer's scores (:mod:`kveval.cache.native_layers`).
INDEXER_MODEL_TYPES = frozenset({"deepseek_v4"})
_MODEL_NAMES = {"deepseek_v4": "DeepSeek V4", "deepseek_v32": "DeepSeek V3.2", "glm_moe_dsa": "GLM MoE-DSA"}


def _names(placement: Placement, family: str) -> list[str]:
    """The registered policies of ``family`` that declare ``placement``, in registry order."""
    return supporting(placement, family)


def _shares_indexer(config: dict) -> bool:
    """Whether some layer of a GLM MoE-DSA config reuses an earlier layer's top-k (``indexer_types`` "shared", or the
    ``index_topk_pattern`` / ``index_topk_freq`` it is made from)."""
    if config.get("indexer_types") is not None:
        return "shared" in config["indexer_types"]
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return "S" in pattern if isinstance(pattern, str) else "shared" in pattern
    return int(config.get("index_topk_freq") or 1) > 1


def check_policy(config, stack) -> None:
    """Refuse, in one line, a policy kveval's layers for these models cannot apply exactly: a quantizer that does not
    code their parts (:attr:`Placement.PARTS`), any structure; on V4 a selection that does not act on the compressed
    entries (:attr:`Placement.ENTRIES`) by ``ratio``; on V3.2 and GLM MoE-DSA one that does not act on the latent
    (:attr:`Placement.LATENT`), or, where a layer reuses another's top-k, keep the same tokens in every layer; on
    every model but V4, a selection scored by the model's indexer. ``config``: a transformers config or a dict."""
    if not isinstance(config, dict):
        config = config.get_text_config(decoder=True).to_dict()
    model_type = config.get("model_type", "")
    selection = stack.selection
    if model_type not in INDEXER_MODEL_TYPES:
        refuse_model_indexer(stack, f"a {model_type or 'this'} model")
    if model_type not in _MODEL_NAMES:
        refuse_indexer_term(stack, f"a {model_type or 'this'} model")
    name = _MODEL_NAMES.get(model_type)
    if name is None:
        return
    v4 = model_type == "deepseek_v4"
    parts = "window, CSA/HCA entries and indexer" if v4 else "latent and indexer keys"
    if selection is not None and v4:
        _check_entry_selection(selection, name)
        selection = None  # checked: the V3.2 rules below are the latent's
    if selection is not None and (not selection.supports(Placement.LATENT) or selection.per_head_budgets):
        if Need.QUERIES in selection.needs:
            why = ("scores with the prefill's queries, which on this model attend only to the indexer's top-k that "
                   "kveval's scoring does not fold in")
        elif selection.needs:
            why = ("scores with attention probabilities, which on this model hold the indexer's top-k that kveval's "
                   "scoring does not fold in")
        elif selection.per_head_budgets:
            why = "budgets heads apart, where the latent is one head for all"
        else:
            why = "is not one of the selections checked on it (the latent stands for every head's keys and values at once)"
        raise UnsupportedModelError(
            f"{selection.spec()}: {why}; on {name}'s latent use one of "
            f"{', '.join(_names(Placement.LATENT, 'selection'))}")
    if (selection is not None and not selection.supports(Placement.SAME_TOKENS_EVERY_LAYER)
            and _shares_indexer(config)):
        raise UnsupportedModelError(
            f"{selection.spec()}: some of this {name} model's layers reuse an earlier layer's top-k slots, which "
            f"name the same tokens only where every layer keeps the same ones; use "
            f"{' or '.join(_names(Placement.SAME_TOKENS_EVERY_LAYER, 'selection'))}")
    def quantizers() -> str:  # named only in a refusal: listing them imports every policy module
        return ", ".join(_names(Placement.PARTS, "quantization"))

    if stack.structure is not None and not stack.structure.supports(Placement.PARTS):
        what = ("layers reading one another's K/V are not mirrored there" if Need.CROSS_LAYER in stack.structure.needs
                else "kveval has no low-rank basis for its parts")
        raise UnsupportedModelError(
            f"{stack.structure.spec()}: {name}'s cache ({parts}) is already the model's own compressed form; "
            f"{what}: evaluate a quantization ({quantizers()})")
    quantization = stack.quantization
    if quantization is not None and not quantization.supports(Placement.PARTS):
        raise UnsupportedModelError(
            f"{quantization.spec()}: kveval codes {name}'s parts ({parts}) with {quantizers()} only; use one of those")
    if quantization is not None:
        quantization.check_part_widths(*_part_widths(config, v4, quantization.indexer == "same"))
    if quantization is not None and Need.ROPE_HOOK in quantization.needs:
        raise UnsupportedModelError(
            f"{quantization.spec()}: keys before RoPE need kveval's RoPE hook, which {name} has none of (its "
            f"{'entries carry RoPE on their last dims' if v4 else 'latent carries no RoPE, its RoPE key is apart'}); "
            f"use {quantization.spec()[:-1]},pre_rope=false)")


def _part_widths(config: dict, v4: bool, indexer: bool) -> tuple[dict[str, int], dict[str, int]]:
    """The widths of a V3.2 / GLM MoE-DSA / V4 cache's parts a quantizer codes, ``(as keys, as values)`` (see
    :meth:`~kveval.policies.base.QuantizationPolicy.check_part_widths`); ``indexer``: its keys coded by the quantizer."""
    keys: dict[str, int] = {}
    if v4:
        head = int(config.get("head_dim") or 512)
        keys.update({"window": head, "entries": head})
        values = {"window": head}
    else:
        keys["latent"] = int(config.get("kv_lora_rank") or 512)
        values = {"RoPE key": int(config.get("qk_rope_head_dim") or 64)}
    if indexer:
        keys["indexer"] = int(config.get("index_head_dim") or 128)
    return keys, values


def refuse_model_indexer(stack, model: str) -> None:
    """Refuse a selection scored by DeepSeek V4's own indexer (:attr:`Need.INDEXER`) on ``model``, which has none."""
    selection = stack.selection
    if selection is not None and Need.INDEXER in selection.needs:
        raise UnsupportedModelError(
            f"{selection.spec()}: scores with DeepSeek V4's lightning indexer over its compressed entries, which "
            f"{model} does not have; use a selection of its own (knorm, snapkv, ...)")


def has_indexer_keys(model_type: str) -> bool:
    """Whether a model's own cache holds a DSA indexer's keys (DeepSeek V3.2, GLM MoE-DSA, V4's CSA layers): what a
    quantizer's ``indexer=`` term codes."""
    return model_type in _MODEL_NAMES


def refuse_indexer_term(stack, model: str) -> None:
    """Refuse a quantizer's ``indexer=`` term (``native``, ``fp8``) on ``model``, which has no DSA indexer's keys for
    it to code: the parameter would do nothing."""
    quantization = stack.quantization
    if quantization is not None and quantization.indexer != "same":
        raise UnsupportedModelError(
            f"{quantization.spec()}: indexer={quantization.indexer} codes the DSA indexer's keys, which {model} does "
            f"not have; drop indexer=")


def _check_entry_selection(selection, name: str) -> None:
    """Refuse, in one line, a selection V4's compressed entries cannot take (:attr:`Placement.ENTRIES`, by ``ratio``)."""
    if not selection.supports(Placement.ENTRIES) or selection.per_head_budgets:
        if selection.needs - {Need.INDEXER}:
            why = ("scores with attention, which over V4's compressed entries is the model's indexer's top-k per "
                   "query, not folded into kveval's scores")
        elif selection.per_head_budgets:
            why = "budgets heads apart, where each compressed entry is one K=V vector for every head"
        else:
            why = "is not one of the selections checked on V4's compressed entries"
        raise UnsupportedModelError(
            f"{selection.spec()}: {why}; on {name}'s CSA/HCA entries use one of "
            f"{', '.join(_names(Placement.ENTRIES, 'selection'))} with ratio=")
    if selection.nominal_ratio is None or selection.decode_budget is not None:
        raise UnsupportedModelError(
            f"{selection.spec()}: on {name} a selection removes the fraction ratio= of each CSA/HCA layer's "
            f"compressed entries at the prefill (the sliding window stays the model's); token counts (size, window, "
            f"budget, decode_budget) do not map onto entries of several tokens: give ratio= alone")


@dataclass(frozen=True)
class CacheShape:
    """What one token (on V4, one entry) of a model's cache holds, read before the weights load: what a quantizer
    packing a serving engine's per-token record is checked against (:meth:`QuantizationPolicy.check_cache`).

    ``kind``: ``heads`` (per-head K/V), ``mla`` (DeepSeek V2/V3's latent and RoPE key, dense attention),
    ``indexed_mla`` (V3.2's and GLM MoE-DSA's latent and RoPE key with the DSA indexer's keys) or ``v4`` (K=V
    entries, their RoPE dims last). ``width``: the head width, the latent's, or V4's entry's; ``rope``: the RoPE
    key's width (V4: the RoPE dims of an entry); ``indexer``: the indexer key's width (0: none)."""

    model: str
    kind: str
    width: int
    rope: int = 0
    indexer: int = 0


def cache_shape(config) -> CacheShape:
    """The :class:`CacheShape` of a config (a transformers config or its dict)."""
    if not isinstance(config, dict):
        config = config.get_text_config(decoder=True).to_dict()
    model_type = config.get("model_type", "")
    model = _MODEL_NAMES.get(model_type) or config.get("_name_or_path") or model_type or "this model"
    if model_type == "deepseek_v4":
        return CacheShape(model, "v4", int(config["head_dim"]), int(config.get("qk_rope_head_dim") or 0),
                          int(config.get("index_head_dim") or 0))
    if config.get("kv_lora_rank"):
        indexed = model_type in _MODEL_NAMES
        return CacheShape(model, "indexed_mla" if indexed else "mla", int(config["kv_lora_rank"]),
                          int(config.get("qk_rope_head_dim") or 0),
                          int(config.get("index_head_dim") or 0) if indexed else 0)
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
    return CacheShape(model, "heads", int(head_dim))


def check_cache(shape: CacheShape, stack) -> None:
    """Refuse, in one line, a quantizer that cannot code a cache of ``shape`` (its
    :meth:`~kveval.policies.base.QuantizationPolicy.check_cache`)."""
    if stack.quantization is not None:
        stack.quantization.check_cache(shape)


def indexer_coding(quantization, part: str, width: int) -> "tuple[bool, TensorQuant | None]":
    """Whether the quantizer's ``indexer`` term (``native``, ``fp8``) decides how ``part`` (``width`` values per
    entry) is coded rather than the quantizer itself, and that coding (``None``: the cache dtype). The cache and the
    memory planner both ask here."""
    if part != "indexer" or quantization.indexer == "same":
        return False, None
    return True, (TensorQuant(8, "token", INDEXER_FP8_GROUP, fp8="e4m3").fitted(width)
                  if quantization.indexer == "fp8" else None)


def part_coding(quantization, part: str, width: int) -> PlannedCoding:
    """How ``part`` (``width`` values an entry) of a model's own cache layer is coded under ``quantization``, as the
    planner sizes it: its ``indexer`` term's coding for the indexer's keys (:func:`indexer_coding`), else K's coding
    of the quantizer's :meth:`~kveval.policies.base.QuantizationPolicy.planned_coding` fitted to the width (keys
    alone: ``value`` unset); ``PlannedCoding()`` (the cache dtype) without a quantizer."""
    if quantization is None:
        return PlannedCoding()
    planned = quantization.planned_part_coding(part, width)
    if planned is not None:
        return planned
    own, coded = indexer_coding(quantization, part, width)
    if own:
        return PlannedCoding(coded)
    coding = quantization.planned_coding()
    if not coding.grouped:
        return PlannedCoding(token_bytes=coding.token_bytes, residual=coding.residual, sink=coding.sink,
                             label=coding.label)
    return PlannedCoding(coding.key.fitted(width), residual=coding.residual)


__all__ = ["CacheShape", "INDEXER_FP8_GROUP", "INDEXER_MODEL_TYPES", "cache_shape", "check_cache", "check_policy",
           "indexer_coding", "part_coding", "refuse_model_indexer"]
