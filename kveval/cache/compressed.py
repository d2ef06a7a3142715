"""A KV cache that compresses what it holds, built on transformers' ``Cache`` API.

:class:`CompressedCache` is a ``transformers.Cache`` whose layers
(:class:`CompressedLayer`) keep, for every sequence of the batch separately,
a token store (:mod:`kveval.stores.base`) plus each kept token's original position.
It plugs into any causal LM through ``model(..., cache=cache)`` when the model
was loaded with ``attn_implementation="kveval"`` (see :mod:`kveval.cache.attention`).

Life of a sequence
------------------
1. The first forward pass is the *prefill*. Keys and values are stored in full
   precision; each layer's attention function lets the selection policy observe
   the attention it needs, then the layer *compresses*: the selection policy
   keeps its budget of tokens (per KV head), and the store encodes them
   (low-rank, quantized).
2. Every later forward pass appends tokens, which are encoded as they age out of
   the full-precision residual; policies with a decode budget evict after each
   step so the cache never holds more than the budget.

Batches: rows are stored separately and compressed exactly as they would be
alone. What attention reads is one padded tensor per layer
(:class:`kveval.tensors.batch_buffer.BatchBuffer`), updated in place from the first slot
a row's store changed, never re-stacked; its mask comes from each kept token's
original position, so padding and eviction always agree and a batch gives the
answers of batch size 1. Decode steps that do the same to every row (nothing
evicts or scores any more, dense or quantized rows) are one batched write to
that tensor (:mod:`kveval.cache.buffered_decode`), and the rows' stores catch up
later. Input padding is declared with :meth:`CompressedCache.set_input_mask`
(the :mod:`kveval.runner.generation` driver does this); padding tokens are never stored.

Hybrid models. Which cache layer each model layer gets comes from
:func:`kveval.modeling.architectures.cache_layer_plan` (unknown layer types are refused).
Sliding-window layers (Gemma 2/3, gpt-oss, Mistral) keep only the model's own
window, as the model's native cache does. Where some layers attend fully, selection
policies apply to those alone, since sliding layers are already bounded; where every
layer slides (Mistral-7B-v0.1, Phi-3-mini-4k), they select among the ``window - 1``
tokens each layer holds, and the window goes on trimming what they kept
(:func:`kveval.modeling.layer_types.selection_slides`). Quantization and low-rank structure
apply to every attention layer. Linear-attention and Mamba
layers (Qwen3-Next, Bamba, Jamba, ...) keep their conv and recurrent states in
transformers' own ``LinearAttentionLayer``, exactly as the model's own cache
does; they are never compressed, and their constant per-sequence bytes are
reported apart from the per-token K/V bytes (:attr:`CacheStats.state_bytes`).

MLA (DeepSeek V2/V3): the cache receives the normed latent and the shared RoPE
key (one "KV head" each) and stores those; see :mod:`kveval.modeling.architectures`.

DeepSeek V3.2, GLM MoE-DSA and DeepSeek V4 keep cache layers of their own (the DSA indexer's keys, V4's compressed
entries, pending tokens and overlap): :mod:`kveval.cache.native_layers` mirrors them part by part, and
:meth:`CompressedCache.stats` reports each part (:attr:`CacheStats.parts`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

from kveval.cache import native_layers
from kveval.cache.coded_rows import SharedScratch
from kveval.cache.decode_evictions import DeferredEvictions
from kveval.cache.layers import CompressedHybridLayer, CompressedLayer, score_key
from kveval.cache.rows import RowState
from kveval.cache.shared_layers import ReadingLayer
from kveval.calibration import retrieval_heads
from kveval.errors import UnsupportedModelError, UsageError
from kveval.modeling import architectures
from kveval.modeling.layer_types import selecting_layers
from kveval.policies.base import PolicyStack, require_stack
from kveval.policies.compatibility import cache_shape, check_cache
from kveval.dtypes import cache_kv_dtype, dtype_name
from kveval.policies.snapkv import SnapKVPolicy
from kveval.stores.base import DenseStore
from kveval.tensors.batch_buffer import real_runs


@dataclass
class CacheStats:
    """Measured cache size for one batch.

    Attributes
    ----------
    kv_bytes : int
        Bytes of the K/V storage tensors the cache holds (codes, scales, zero
        points, full-precision tokens), summed over layers and sequences.
    nominal_bytes : int
        Bytes the model's uncompressed cache would hold for the same tokens in
        the deployment's cache dtype ``kv_dtype`` (sliding layers: at most window - 1
        tokens, what the model's own cache holds between forwards).
    index_bytes : int
        Bookkeeping that compression adds: original positions and policy scores.
    tokens_seen : list of int
        Real tokens processed per sequence.
    kept_tokens : list of list of int
        Tokens held per attention layer (outer) and sequence (inner), per KV head
        (the rounded mean over heads when heads keep different counts: ``adaptive=true``, ``duo``).
    kv_dtype : str
        The cache dtype full-precision tokens are stored in and ``nominal_bytes`` counts (``"bfloat16"``).
    parts : dict of str to int
        Models whose own cache layers hold several parts (DeepSeek V3.2: ``latent``, ``indexer``; V4: ``window``,
        ``csa``, ``hca``, ``indexer``; :mod:`kveval.cache.native_layers`): the measured bytes of each, summing to
        ``kv_bytes``; empty for other models. ``nominal_parts``: the same parts as the model's own cache holds
        them in ``kv_dtype``, summing to ``nominal_bytes``.
    state_bytes : int
        Constant-size per-sequence states of linear-attention / Mamba layers
        (conv and recurrent states), kept exactly and counted apart: they are
        in neither ``kv_bytes`` nor ``nominal_bytes``.
    """

    kv_bytes: int
    nominal_bytes: int
    index_bytes: int
    tokens_seen: list[int]
    kept_tokens: list[list[int]] = field(default_factory=list)
    state_bytes: int = 0
    kv_dtype: str = ""
    parts: dict[str, int] = field(default_factory=dict)
    nominal_parts: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Measured / uncompressed bytes (0.25 means a quarter of the memory)."""
        return self.kv_bytes / self.nominal_bytes if self.nominal_bytes else 1.0

    @property
    def bytes_per_token(self) -> float:
        """Measured K/V bytes per processed token, all layers."""
        return self.kv_bytes / max(1, sum(self.tokens_seen))

    @property
    def nominal_bytes_per_token(self) -> float:
        return self.nominal_bytes / max(1, sum(self.tokens_seen))

    def summary(self) -> str:
        return (f"cache: measured {self.kv_bytes:,} B, uncompressed {self.nominal_bytes:,} B ({self.kv_dtype}), "
                f"ratio {self.ratio:.3f} ({1 / self.ratio if self.ratio else float('inf'):.2f}x smaller), "
                f"{self.bytes_per_token:,.0f} B/token"
                + (f" ({', '.join(f'{k} {v:,} B' for k, v in self.parts.items())})" if self.parts else "")
                + (f", plus {self.state_bytes:,} B of constant-size state" if self.state_bytes else ""))


def _compact_views(row: RowState, memo: dict) -> dict:
    """``memo`` for deep-copying ``row``, with a compact copy of each tensor of the row that views a larger one.

    A row's tensors may be views of the batch's (its store's K/V of the batch buffer, its codes of the batch's
    codes, its positions of the packed prefill's); a deep copy of a view copies the whole storage under it, so
    each forked row would hold the whole batch. Only kveval's own objects and plain containers are walked (a store
    that shares read-only bases in its own ``__deepcopy__`` gets its inner stores compacted; a basis that is a
    view is cloned for nothing, a few kilobytes).
    """
    pending, walked = [row], set()
    while pending:
        obj = pending.pop()
        if id(obj) in walked or id(obj) in memo:
            continue
        walked.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not _spans_its_storage(obj):
                memo[id(obj)] = obj.clone()
        elif isinstance(obj, dict):
            pending.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            pending.extend(obj)
        elif type(obj).__module__.startswith("kveval.") and type(obj).__dictoffset__:  # its instances have a __dict__
            pending.extend(vars(obj).values())
    return memo


def _spans_its_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` reaches every byte of its storage (from its first; an expanded tensor counts once)."""
    if t.numel() == 0:
        return t.untyped_storage().nbytes() == 0
    extent = 1 + sum((n - 1) * step for n, step in zip(t.shape, t.stride()))
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == extent * t.element_size()


class CompressedCache(Cache):
    """A ``transformers.Cache`` that applies a compression policy and measures what it holds.

    Parameters
    ----------
    model : PreTrainedModel
        The model the cache serves (its config gives layers, heads, sliding layers, dtype).
        Load it with ``attn_implementation="kveval"`` (:func:`kveval.runner.models.load_model` does).
    policy : str or PolicyStack
        A spec such as ``"snapkv(ratio=0.5)+kivi(bits=4)"``; ``"none"`` keeps everything.
    seed : int or sequence of int
        Seed of the ``random`` control policy: row ``b`` uses ``seed + b``, or ``seed[b]`` given one per row
        (a row's own seed, from its item: then its choices do not depend on the batch it runs in).
    defer_compression : bool
        Store the prefill uncompressed with the scores of ``policy`` and of every
        policy of ``scores_for``, and compress nothing: each policy's cache is
        then derived with :meth:`derive` (one prefill, many policies).
    scores_for : list of str or PolicyStack, optional
        With ``defer_compression``: the other policies the prefill will serve;
        the attention scores they need are kept (each distinct one once).
    kv_dtype : str or torch.dtype, optional
        The deployment's cache dtype: full-precision tokens are stored in it and
        nominal bytes count it, whatever dtype the model computes in. Default:
        :func:`kveval.dtypes.deployment_kv_dtype` (the checkpoint's 16-bit dtype, else bfloat16).
    quantized_decode : {"auto", "buffer", "codes"}
        How a quantized layer decodes a batch (:mod:`kveval.cache.buffered_decode`). ``"buffer"`` keeps the layer's
        tokens dequantized, in the compute dtype, and dequantizes only the tokens that age out of the residual at
        each step: fast, but a second, dequantized copy of the cache. ``"codes"`` holds the codes alone and
        dequantizes the layer at every step into a scratch that all layers share: peak memory is the codes plus
        one layer's K/V, at the cost of a full dequantization per layer per step. ``"auto"``: codes on CUDA
        (memory is what a GPU runs out of), buffer elsewhere. The answers, bytes and kept tokens are the same.
    """

    QUANTIZED_DECODE_MODES = ("auto", "buffer", "codes")

    def __init__(self, model, policy: "PolicyStack | None" = None, seed: "int | Sequence[int]" = 0,
                 defer_compression: bool = False,
                 kv_dtype: "torch.dtype | None" = None, scores_for: "list[PolicyStack] | None" = None,
                 quantized_decode: str = "auto"):
        if quantized_decode not in self.QUANTIZED_DECODE_MODES:
            raise UsageError(f"quantized_decode={quantized_decode!r} is not a mode; use one of {', '.join(self.QUANTIZED_DECODE_MODES)}")
        self.quantized_decode = quantized_decode
        self.scratch = SharedScratch()  # what quantized layers held as codes dequantize into, one layer at a time
        self.kv_dtype = cache_kv_dtype(model, kv_dtype)
        config = model.config.get_text_config()
        plans = architectures.check_supported(model.config)
        self.policy = require_stack(policy, "CompressedCache")
        self.config = model.config
        self.num_layers = config.num_hidden_layers
        self.head_dim, value_dim = architectures.cache_head_dims(model.config)
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.seed = list(seed) if isinstance(seed, (list, tuple)) else seed
        #: KVzip (a selection that ``reconstructs``): the prefill stays uncompressed until
        #: :func:`kveval.runner.generation.reconstruct_and_compress` has scored it and compressed.
        self.awaiting_reconstruction = bool(self.policy.selection is not None and self.policy.selection.reconstructs)
        self.defer_compression = defer_compression or self.awaiting_reconstruction
        #: Called by the attention function with ``(layer, query, keys, scaling)`` (KVzip's reconstruction forwards).
        self.observer = None
        self.model = model
        served = [self.policy] + [require_stack(p, "CompressedCache(scores_for=...)") for p in (scores_for or [])]
        #: Layer index -> whether a selection acts on it (:func:`~kveval.modeling.layer_types.selecting_layers`: full layers,
        #: and sliding ones where every attention layer slides), for the layers holding tokens.
        held = [(i, plan) for i, plan in enumerate(plans) if plan.holds_tokens]
        self.selecting_layers = dict(zip((i for i, _ in held), selecting_layers(
            [plan.sliding_window for _, plan in held], [plan.chunked for _, plan in held])))
        for served_policy in served:  # refused before the prefill, not after it
            check_cache(cache_shape(model.config), served_policy)
            native_layers.check_policy(model.config, served_policy)
            self._check_representation(served_policy, value_dim)
            self._check_selection(served_policy, model.config)
        #: Attention scores a deferred prefill keeps (:func:`kveval.cache.layers.score_key`), each once.
        self.score_keys = [k for k in dict.fromkeys(score_key(p.selection) for p in served) if k is not None]
        self._input_mask: torch.Tensor | None = None
        self._input_counts: list[int] | None = None
        self._input_columns: list[slice | None] | None = None  # per row: its real columns, when contiguous
        self._input_runs: tuple[tuple[int, int], ...] | None = None  # every row's, when all are contiguous
        self.input_positions: torch.Tensor | None = None  # [B, q] the next forward's position_ids, where declared
        self._column_mask: torch.Tensor | None = None
        self._protect_last: list[int] | None = None
        #: Decode budgets of the current forward's layers, kept together after its last attention layer.
        self.evictions = DeferredEvictions()
        #: Reading layer -> the layer whose K/V it reads and stores nothing of its own (a structure across layers).
        self.reused, self.merged = self._cross_layers(plans)
        super().__init__(layers=[self._new_layer(i, plan) for i, plan in enumerate(plans)])
        #: The index of the last layer that runs attention in a forward (it keeps the deferred evictions).
        self.last_attention_layer = max((layer.layer_idx for layer in self.attention_layers), default=-1)

    def _check_representation(self, policy: PolicyStack, value_dim: int) -> None:
        """Refuse a quantizer whose groups do not divide the head dims (at construction, before any forward)."""
        if policy.quantization is not None and (policy.structure is None or policy.structure.keeps_head_widths):
            # With a structure policy the quantizer sees coefficients, checked against their rank by that policy.
            for dim in sorted({self.head_dim, value_dim}):
                policy.quantization.check_head_dim(dim)

    def _check_selection(self, policy: PolicyStack, config) -> None:
        """Refuse a selection policy where it has no layer to act on (:attr:`selecting_layers`): every attention
        layer is chunked (a query sees its own chunk only: a window's trim and a selection were never made to
        agree there)."""
        reconstructs = policy.selection is not None and policy.selection.reconstructs
        if reconstructs and architectures.mla_dims(config) is not None:
            raise policy.selection.mla_refusal(architectures.architecture_name(config))
        if policy.selection is not None and self.selecting_layers and not any(self.selecting_layers.values()):
            raise UnsupportedModelError(
                f"{architectures.architecture_name(config)}: every attention layer is chunked, and "
                f"{policy.selection.spec()} selects on full-attention or sliding-window layers only; evaluate a "
                f"quantization or low-rank policy")

    def _cross_layers(self, plans: "list[architectures.LayerPlan]") -> tuple[dict[int, int], dict[int, int]]:
        """The stack's structure's reading layers and merged pairs on this model
        (:meth:`~kveval.policies.base.StructurePolicy.reused_layers`, ``merged_layers``), whose attention layers are of
        one kind per window and chunking (a hybrid layer's state is its own: never read by another). Refused with a
        prefill shared by several policies, and with a selection scoring by reconstruction forwards (KVzip's),
        which score each layer's own queries."""
        structure = self.policy.structure
        if structure is None or not self.policy.cross_layer:
            return {}, {}
        kinds = [(plan.sliding_window, plan.chunked) if plan.kind == architectures.ATTENTION else None for plan in plans]
        reused = structure.reused_layers(kinds)
        merged = structure.merged_layers(kinds)
        if reused and self.awaiting_reconstruction:
            raise UsageError(f"{self.policy.spec}: {self.policy.selection.spec()} scores each layer by its own queries "
                             f"in reconstruction forwards, which reading layers do not keep; use a selection scored "
                             f"at the prefill")
        if self.defer_compression:
            raise UsageError(f"{self.policy.spec}: layers reading other layers' K/V change what the prefill computes; "
                             f"it cannot be one prefill shared by several policies: prefill it alone")
        return reused, merged

    def merge_rows(self, layer: CompressedLayer, rows: list[int]) -> None:
        """Rows ``rows`` of ``layer``, the later layer of a merged pair (:attr:`merged`), just compressed at the end
        of their prefill: merged with the earlier layer's (compressed in the same forward) by the structure, both
        holding their prefill uncoded (:meth:`new_store`), what the merge keeps then coded in stores of
        :meth:`coded_store`. Both layers' buffers are rebuilt from the merged stores at the next forward."""
        earlier = self.layers[self.merged[layer.layer_idx]]
        for b in rows:
            first, second = earlier.rows[b], layer.rows[b]
            if not torch.equal(first.positions, second.positions):
                raise RuntimeError(f"layers {earlier.layer_idx} and {layer.layer_idx} hold different tokens of row {b}; "
                                   f"they cannot be merged")
            first.store, second.store = self.policy.structure.merge_stores(
                first.store, second.store, functools.partial(self.coded_store, layer.layer_idx))
        earlier.rows, layer.rows = earlier.rows, layer.rows

    def _new_layer(self, layer_idx: int, plan: "architectures.LayerPlan"):
        """Attention layers are compressed, or read another's (:attr:`reused`); state layers are transformers' own;
        others hold nothing."""
        if layer_idx in self.reused:
            source = self.reused[layer_idx]
            last = max(i for i, s in self.reused.items() if s == source)
            return ReadingLayer(self, layer_idx, source, last_reader=layer_idx == last)
        if plan.kind == architectures.ATTENTION:
            return CompressedLayer(self, layer_idx, plan.sliding_window, chunked=plan.chunked)
        if plan.kind == architectures.NATIVE:
            return native_layers.native_layer(self, layer_idx, plan, self.config)
        if plan.kind == architectures.HYBRID:
            return CompressedHybridLayer(self, layer_idx, plan.sliding_window, plan.number_of_states)
        if plan.kind == architectures.STATE:
            return LinearAttentionLayer(number_of_states=plan.number_of_states)
        return DummyLayer()

    @property
    def attention_layers(self) -> list["CompressedLayer"]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    @property
    def reading_layers(self) -> list[ReadingLayer]:
        """The layers that read another layer's K/V and store nothing (:attr:`reused`)."""
        return [layer for layer in self.layers if isinstance(layer, ReadingLayer)]

    @property
    def state_layers(self) -> list[LinearAttentionLayer]:
        return [layer for layer in self.layers if isinstance(layer, LinearAttentionLayer)]

    # --- what the driver declares before a forward pass -----------------------------------------
    def set_input_mask(self, mask: torch.Tensor | None, runs: "tuple[list[int], list[slice | None]] | None" = None,
                       positions: torch.Tensor | None = None) -> None:
        """Declare which input tokens of the next forward are real (``[B, q]``, 1 = real, 0 = padding).

        ``runs``: what :func:`~kveval.tensors.batch_buffer.real_runs` gives for ``mask``, where the caller knows it
        (it built the mask on the host); else it is read from the device, once per forward. ``positions``: the
        ``position_ids`` the forward gives the model (``[B, q]``), for attention modules that do not pass them on
        to the cache (Llama 4's): the layers then need not count each row's tokens, and may decode on the batch
        buffer alone. Each row's positions must count its tokens (below the tokens it will have seen once this
        forward is in, as ``position_ids`` made from the mask are): the layers bound positions by the columns
        they have seen. Every call replaces what the last one declared."""
        self.input_positions = positions
        self._input_mask = None if mask is None else mask.bool()
        self._input_counts, self._input_columns = (None, None) if mask is None else runs or real_runs(self._input_mask)
        columns = self._input_columns or []
        self._input_runs = None if any(c is None for c in columns) else tuple((c.start, c.stop) for c in columns)
        if mask is not None:
            self._column_mask = self._input_mask if self._column_mask is None else torch.cat([self._column_mask, self._input_mask], 1)

    def model_attention_mask(self) -> torch.Tensor | None:
        """The 2D padding mask of every column so far, for models whose state layers must skip padding.

        Linear-attention and Mamba layers zero padded inputs only when the model
        receives this mask; attention layers ignore it (the cache's own mask
        governs them). ``None`` for models without state layers.
        """
        if not self.state_layers or self._column_mask is None:
            return None
        return self._column_mask.long()

    def set_protected(self, protect_last: list[int] | None) -> None:
        """Keep the last ``protect_last[b]`` tokens of row ``b``'s prefill out of selection (query-aware mode)."""
        self._protect_last = protect_last

    def input_real(self, batch: int, q_len: int, device) -> torch.Tensor:
        if self._input_mask is None:
            return torch.ones(batch, q_len, dtype=torch.bool, device=device)
        return self._input_mask.to(device)

    def input_counts(self, batch: int, q_len: int) -> tuple[list[int], bool]:
        """Real tokens per row in the next forward, and whether every input token is real."""
        if self._input_mask is None:
            return [q_len] * batch, True
        return self._input_counts, all(n == q_len for n in self._input_counts)

    def input_runs(self, batch: int, q_len: int) -> "tuple[tuple[int, int], ...] | None":
        """Every row's real input columns ``[start, stop)`` in the next forward (host-known: no device sync), or
        ``None`` where some row's are not contiguous."""
        if self._input_mask is None:
            return ((0, q_len),) * batch
        return self._input_runs

    def real_columns(self, b: int) -> "slice | torch.Tensor":
        """The columns of row ``b``'s real tokens in the next forward: a slice (a view, no device sync) where they
        are contiguous, as in the left-padded batches of :mod:`kveval.runner.generation`, else the row's boolean mask."""
        if self._input_mask is None:
            return slice(None)
        columns = self._input_columns[b]
        return self._input_mask[b] if columns is None else columns

    def protected(self, b: int) -> int:
        return 0 if self._protect_last is None else self._protect_last[b]

    def seed_for(self, b: int) -> int:
        return self.seed[b] if isinstance(self.seed, list) else self.seed + b

    def decodes_from_codes(self, device) -> bool:
        """Whether quantized layers on ``device`` decode from their codes (see ``quantized_decode``)."""
        if self.quantized_decode == "auto":
            return torch.device(device).type == "cuda"
        return self.quantized_decode == "codes"

    # --- store construction ---------------------------------------------------------------------
    def coded_store(self, layer_idx: int, dtype: torch.dtype):
        """An empty store for one sequence of layer ``layer_idx`` as the stack's quantizer codes it (a
        :class:`DenseStore` without one), holding ``kv_dtype`` and computing in ``dtype``."""
        store = DenseStore(self.kv_dtype, dtype)
        quantization = self.policy.quantization
        return store if quantization is None else quantization.make_store(store, self.model, layer_idx)

    def new_store(self, layer_idx: int, dtype: torch.dtype):
        """An empty store for one sequence of layer ``layer_idx``, holding ``kv_dtype`` and computing in ``dtype``:
        the quantizer's, then the structure's (innermost first). A merged pair's layers (:attr:`merged`) hold their
        prefill uncoded: the structure's merge codes what it keeps (:meth:`merge_rows`)."""
        paired = layer_idx in self.merged or layer_idx in self.merged.values()
        store = DenseStore(self.kv_dtype, dtype) if paired else self.coded_store(layer_idx, dtype)
        structure = self.policy.structure
        return store if structure is None else structure.make_store(store, self.model, layer_idx)

    # --- forking rows ----------------------------------------------------------------------------
    def fork_rows(self, index: list[int], memo: dict | None = None) -> "CompressedCache":
        """A new cache whose row ``j`` is an independent copy of row ``index[j]`` of this one.

        Attention rows, linear-attention/Mamba states and the padding history are
        all copied. ``memo`` maps objects that must stay shared (the model, its
        modules and parameters) to themselves; the model itself always is.
        """
        import copy

        memo = dict(memo or {})
        memo.setdefault(id(self.model), self.model)
        saved = [layer.rows for layer in self.attention_layers]
        for layer in self.attention_layers:
            layer.rows = []
        try:
            clone = copy.deepcopy(self, dict(memo))
            clone.seed = [self.seed_for(i) for i in index]  # each forked row keeps its source row's seed
        finally:
            for layer, rows in zip(self.attention_layers, saved):
                layer.rows = rows
        for layer, rows in zip(clone.attention_layers, saved):
            layer.rows = [copy.deepcopy(rows[i], _compact_views(rows[i], dict(memo))) for i in index]
            if isinstance(layer, native_layers.NativeLayer):
                layer.take_rows(index)
        picked = torch.tensor(index, dtype=torch.long)
        for layer in clone.state_layers:
            for states in (layer.conv_states, layer.recurrent_states):
                for key, t in states.items():
                    if t is not None:
                        states[key] = t.index_select(0, picked.to(t.device))
        if clone._column_mask is not None:
            clone._column_mask = clone._column_mask[picked.to(clone._column_mask.device)]
        clone.set_input_mask(None)
        clone.set_protected(None)
        return clone

    # --- one prefill, many policies -------------------------------------------------------------
    def derive(self, policy: "str | PolicyStack") -> "CompressedCache":
        """A new cache holding this deferred prefill compressed with ``policy``, exactly as its own prefill would be.

        Every policy compresses after the prefill's attention, so the prefill is
        the same for all: each row's tokens (stored in ``kv_dtype``, as any store
        holds them before it seals) go into a fresh store of ``policy``'s
        representation, the selection scores with the attention kept for it
        (``scores_for``), then the rows are compressed as :meth:`CompressedLayer.compress_rows`
        does at the end of a prefill. Nothing of this cache is modified (the copy
        may share tensors it never writes in place), so it can be decoded and
        released while this one serves the next policy. Bit-exact when the compute dtype holds every ``kv_dtype``
        value (float32, or the same dtype); see :func:`kveval.runner.generation.can_share_prefill`.
        """
        import copy

        if not self.defer_compression:
            raise ValueError("derive needs a cache built with defer_compression=True")
        target = require_stack(policy, "CompressedCache.derive")
        key = score_key(target.selection)
        if key is not None and key not in self.score_keys:
            raise ValueError(f"this prefill kept no {key[0]} attention for {target.spec}; pass it in scores_for")
        clone = copy.copy(self)
        clone.policy, clone.defer_compression, clone.score_keys = target, False, []
        clone.scratch = SharedScratch()
        clone._check_representation(target, architectures.cache_head_dims(self.model.config)[1])
        clone.layers = []
        for layer in self.layers:
            if not isinstance(layer, CompressedLayer):
                clone.layers.append(copy.deepcopy(layer))
                continue
            new = copy.copy(layer)
            if isinstance(layer, LinearAttentionLayer):  # hybrid: its own copy of the states
                for name in ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                             "is_recurrent_states_initialized", "conv_kernel_size"):
                    setattr(new, name, copy.deepcopy(getattr(layer, name)))
            new.cache = clone
            new.selection = target.selection if layer.takes_selection else None
            new.rows = [self._derived_row(new, row, key if layer.takes_selection else None) for row in layer.rows]
            new.compress_rows(new.rows, [clone.protected(b) for b in range(len(new.rows))])
            clone.layers.append(new)
        return clone

    def drop_batch_buffers(self) -> None:
        """Free every layer's batch buffer (what attention read). A deferred prefill is never attended again:
        :meth:`derive` reads the rows, so its buffers (a compute-dtype copy of the prefill) can go."""
        for layer in self.attention_layers:
            layer.drop_buffer()

    @staticmethod
    def _derived_row(layer: CompressedLayer, row: RowState, key: tuple | None) -> RowState:
        """``row``'s uncompressed tokens in a new store of the derived ``layer``'s policy, with the scores ``key`` names."""
        store = layer.new_store(layer.dtype)
        if row.store.length:
            # kv_dtype -> compute dtype -> kv_dtype: the same numbers a store of the policy's own prefill holds.
            store.append(*row.store.keys_values())
        scores = None if key is None else row.scores[key].clone()
        return RowState(store, row.positions.clone(), scores, row.tokens_seen, False)

    # --- measurement ----------------------------------------------------------------------------
    def stats(self, row: int | None = None) -> CacheStats:
        """Measured and nominal bytes, and kept tokens per layer, for the batch or one of its rows."""
        kv = index = nominal = state = 0
        kept, parts, nominal_parts = [], {}, {}
        for layer in self.layers:
            if isinstance(layer, ReadingLayer):  # holds nothing; the model's own cache holds what its source would
                source = layer.source
                numbers = range(len(source.rows)) if row is None else [row]
                per_token = source.token_elements * self.kv_dtype.itemsize
                nominal += sum(source.nominal_tokens(source.rows[b]) for b in numbers) * per_token
                kept.append([0 for _ in numbers])
                continue
            if not isinstance(layer, CompressedLayer):
                continue
            numbers = range(len(layer.rows)) if row is None else [row]
            per_token = layer.token_elements * self.kv_dtype.itemsize
            for b in numbers:
                r = layer.rows[b]
                index += r.index_bytes()
                if isinstance(layer, native_layers.NativeLayer):
                    for name, (measured, native) in layer.row_parts(b).items():
                        parts[name] = parts.get(name, 0) + measured
                        nominal_parts[name] = nominal_parts.get(name, 0) + native
                        kv, nominal = kv + measured, nominal + native
                    state += layer.row_state_bytes(b)
                else:
                    kv += r.store.nbytes
                    nominal += layer.nominal_tokens(r) * per_token
            kept.append([layer.rows[b].kept_tokens() for b in numbers])
        first = self.attention_layers[0].rows if self.attention_layers else []
        seen = [r.tokens_seen for r in (first if row is None else first[row:row + 1])]
        return CacheStats(kv, nominal, index, seen, kept, self._state_bytes(row) + state, dtype_name(self.kv_dtype),
                          parts, nominal_parts)

    def kv_bytes(self, row: int) -> int:
        """``stats(row=row).kv_bytes`` alone (no index bytes, no kept tokens): what a decode step's peak reads."""
        total = 0
        for layer in self.attention_layers:
            if isinstance(layer, native_layers.NativeLayer):
                total += sum(measured for measured, _ in layer.row_parts(row).values())
            else:
                total += layer.rows[row].store.nbytes
        return total

    @property
    def shrinks_while_decoding(self) -> bool:
        """Whether a row's K/V bytes may fall while it decodes, so that they may peak when the prompt is in rather
        than at the end: a decode budget evicts, a structure or quantization encodes its full-precision residual
        tokens. Without them (none, a selection at the prefill alone) bytes only grow and peak at the end, and are
        not read before it (reading makes a batched decode's rows catch up, kernels per row)."""
        policy = self.policy
        return (policy.structure is not None or policy.quantization is not None
                or (policy.selection is not None and policy.selection.decode_budget is not None))

    @property
    def peaks_between_steps(self) -> bool:
        """Whether a row's K/V bytes may peak between the prompt's end and the end of decoding, and are read after
        every step to find the peak: a decode budget compressed every ``decode_interval`` steps (above 1) grows
        past its budget and falls back. Such rows decode one by one, so the read costs no catch-up of a batched
        decode. Elsewhere the bytes grow, or grow to a decode budget and stay there, and peak after the prompt or
        at the end; a residual window's full-precision tokens (KIVI) fall as each group is encoded, so there the
        larger of those two is short of the true peak by at most one group's unencoded tokens."""
        selection = self.policy.selection
        return selection is not None and selection.decode_budget is not None and selection.decode_interval > 1

    def span_retention(self, row: int, spans: "Sequence[tuple[int, int]]") -> float | None:
        """Share of the slots of the tokens in ``spans`` that row ``row`` still holds, over every attention layer and
        KV head: 1.0 when each layer keeps every one of those tokens for every head, 0.0 when none is left anywhere.

        ``spans``: ``(start, end)`` original token positions of the row (end exclusive), as a probe's needle
        :attr:`~kveval.probes.item.Needle.span`. A sliding layer whose window has passed the span counts as not
        holding it, as the model's own cache does not. ``None`` when the spans are empty."""
        wanted = sorted({p for start, end in spans for p in range(start, end)})
        if not wanted or not self.attention_layers:
            return None
        held = slots = 0
        for layer in self.attention_layers:
            positions = layer.rows[row].positions
            target = torch.tensor(wanted, dtype=positions.dtype, device=positions.device)
            held += int(torch.isin(positions, target).sum())
            slots += positions.shape[0] * len(wanted)
        return held / slots

    def _state_bytes(self, row: int | None) -> int:
        """Bytes of the state layers' conv and recurrent states (one row's share when ``row`` is given)."""
        total = 0
        for layer in self.state_layers:
            for states in (layer.conv_states, layer.recurrent_states):
                for t in states.values():
                    if t is not None:
                        total += (t.numel() if row is None else t[row].numel()) * t.element_size()
        return total


def nominal_bytes_per_token(model, dtype: "str | torch.dtype | None" = None) -> int:
    """Uncompressed K/V bytes per token over all attention layers.

    2 x attention layers x kv_heads x head_dim x bytes per element; for MLA,
    (kv_lora_rank + qk_rope_head_dim) x attention layers x bytes (the latent and
    the RoPE key), plus DeepSeek V3.2's indexer key (``index_head_dim``). Linear-attention / Mamba layers hold no per-token K/V. ``dtype``: the cache dtype, default
    the model's deployment dtype (:func:`kveval.dtypes.deployment_kv_dtype`).
    """
    plans = architectures.cache_layer_plan(model.config)
    attention_layers = sum(p.holds_tokens for p in plans)
    element = cache_kv_dtype(model, dtype).itemsize
    text = model.config.get_text_config(decoder=True)
    indexer = 0
    if architectures.is_native(model.config) and not any(p.sliding_window for p in plans):
        # V3.2 / GLM MoE-DSA: an indexer key per token in each layer that runs its own indexer (GLM's "shared"
        # layers reuse another's top-k). V4's indexer keeps an entry per compression window, not per token.
        kinds = getattr(text, "indexer_types", None) or ["full"] * attention_layers
        indexer = sum(kind == "full" for kind in kinds) * (getattr(text, "index_head_dim", 0) or 0)
    return (attention_layers * sum(architectures.cache_widths(model.config)) + indexer) * element


def _retrieval_calibration_cache(model, window: int) -> CompressedCache:
    """The cache DuoAttention's calibration scores heads in: the attention of the last ``window`` queries (those that
    write the passkey's answer), kept unpooled, in the model's own dtype."""
    stack = PolicyStack(selection=SnapKVPolicy(ratio=0.5, window=window, kernel=1))
    return CompressedCache(model, stack, defer_compression=True, kv_dtype=model.dtype)


retrieval_heads.use_cache(_retrieval_calibration_cache)  # DuoAttention calibrates its retrieval heads through this

__all__ = ["CacheStats", "CompressedCache", "CompressedHybridLayer", "CompressedLayer", "nominal_bytes_per_token"]
