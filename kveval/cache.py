"""A KV cache that compresses what it holds, built on transformers' ``Cache`` API.

:class:`CompressedCache` is a ``transformers.Cache`` whose layers
(:class:`CompressedLayer`) keep, for every sequence of the batch separately,
a token store (:mod:`kveval.storage`) plus each kept token's original position.
It plugs into any causal LM through ``model(..., cache=cache)`` when the model
was loaded with ``attn_implementation="kveval"`` (see :mod:`kveval.attention`).

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
alone; the padded batch given to attention carries a mask built from each
kept token's original position, so padding and eviction always agree and a
batch gives the answers of batch size 1. Input padding is declared with
:meth:`CompressedCache.set_input_mask` (the :mod:`kveval.generation` driver
does this); padding tokens are never stored.

Hybrid models. Which cache layer each model layer gets comes from
:func:`kveval.architectures.cache_layer_plan` (unknown layer types are refused).
Sliding-window layers (Gemma 2/3, gpt-oss, Mistral) keep only the model's own
window, as the model's native cache does. Selection policies apply to
full-attention layers only, since sliding layers are already bounded and
evicting inside the window would compound two policies; quantization and
low-rank structure apply to every attention layer. Linear-attention and Mamba
layers (Qwen3-Next, Bamba, Jamba, ...) keep their conv and recurrent states in
transformers' own ``LinearAttentionLayer``, exactly as the model's own cache
does; they are never compressed, and their constant per-sequence bytes are
reported apart from the per-token K/V bytes (:attr:`CacheStats.state_bytes`).

MLA (DeepSeek V2/V3): the cache receives the normed latent and the shared RoPE
key (one "KV head" each) and stores those; see :mod:`kveval.architectures`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, LinearAttentionLayer

from kveval import architectures
from kveval.policies import PolicyStack, ScoringState, parse_policy
from kveval.storage import DenseStore, deployment_kv_dtype, dtype_name, parse_kv_dtype

_PAD_POSITION = 2**62  # slot position of padding in a stacked batch: never visible to any query
_QUERY_CHUNK = 1024  # queries scored at once when a policy needs every query's attention


@dataclass
class RowState:
    """One sequence in one layer: its store, the original position of every kept token, and policy scores."""

    store: object
    positions: torch.Tensor  # [kv_heads, tokens], int64
    attention: torch.Tensor | None = None  # [kv_heads, tokens], accumulated as the policy asks
    tokens_seen: int = 0  # real tokens ever appended (the uncompressed length)
    compressed: bool = False


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
        Tokens held per attention layer (outer) and sequence (inner), per KV head.
    kv_dtype : str
        The cache dtype full-precision tokens are stored in and ``nominal_bytes`` counts (``"bfloat16"``).
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
                + (f", plus {self.state_bytes:,} B of linear-attention/SSM state" if self.state_bytes else ""))


class CompressedLayer(CacheLayerMixin):
    """One layer of a :class:`CompressedCache`; stores each sequence of the batch separately."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int, sliding_window: int | None = None,
                 chunked: bool = False):
        super().__init__()
        self.cache, self.layer_idx, self.sliding_window = cache, layer_idx, sliding_window
        self.is_sliding = sliding_window is not None
        # Chunked attention (Llama 4): stored like a sliding layer (the model's own cache does so), but a
        # query sees only the tokens of its own chunk of ``sliding_window`` positions.
        self.chunked = chunked and self.is_sliding
        self.selection = None if self.is_sliding else cache.policy.selection
        self.rows: list[RowState] = []
        self.columns_seen = 0  # input columns processed, padding included (what DynamicLayer would report)
        self.contiguous = True  # every row holds every column: the model's own causal mask is exact
        self._query_positions: torch.Tensor | None = None
        self._slot_positions: torch.Tensor | None = None
        self.token_elements = 0  # K and V elements per token, all heads: what the model's own cache layer holds

    # --- transformers CacheLayerMixin interface -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        heads = key_states.shape[1]
        self.token_elements = heads * key_states.shape[-1] + value_states.shape[1] * value_states.shape[-1]
        self.rows = [RowState(self.cache.new_store(self.layer_idx, key_states.dtype),
                              torch.empty(heads, 0, dtype=torch.long, device=self.device))
                     for _ in range(key_states.shape[0])]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs=None, **extra):
        """Store the new tokens and return the padded batch of kept K/V, ``[B, kv_heads, slots, head_dim]``.

        Also places the mask this layer's attention must use in ``kwargs`` (the
        attention module passes the same dict on to the attention function).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, heads, q_len, _ = key_states.shape
        real = self.cache.input_real(batch, q_len, key_states.device)
        positions = self._new_positions(kwargs, real)
        for b, row in enumerate(self.rows):
            keep = real[b]
            if self.is_sliding and row.positions.shape[1]:
                self._trim_to_window(row, int(positions[b][keep].min()) if keep.any() else None)
            if keep.any():
                new_positions = positions[b][keep].unsqueeze(0).expand(heads, -1)
                row.store.append(key_states[b][:, keep], value_states[b][:, keep])
                row.positions = torch.cat([row.positions, new_positions], dim=1)
                row.tokens_seen += int(keep.sum())
                if row.compressed:
                    row.store.seal()
        self.columns_seen += q_len
        if not bool(real.all()):
            self.contiguous = False
        keys, values, slot_positions = self._stacked()
        self._query_positions = positions
        self._slot_positions = slot_positions
        if kwargs is not None:
            kwargs["kveval_layer"] = self
            kwargs["kveval_mask"] = None if self.contiguous else self.allowed_mask(positions, heads_of_query=None)
        return keys, values

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.columns_seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.rows, self.columns_seen, self.contiguous, self.is_initialized = [], 0, True, False

    # --- positions and masks --------------------------------------------------------------------
    def _new_positions(self, kwargs, real: torch.Tensor) -> torch.Tensor:
        """Original positions of the incoming tokens, ``[B, q]``: ``position_ids`` if given, else each row's count."""
        given = None if kwargs is None else kwargs.get("position_ids")
        if given is not None:
            return given.to(torch.long).expand(real.shape[0], -1)
        starts = torch.tensor([row.tokens_seen for row in self.rows], device=real.device)
        return starts[:, None] + real.long().cumsum(dim=1) - 1

    def _trim_to_window(self, row: RowState, first_new_position: int | None) -> None:
        """Sliding layers: drop tokens no upcoming query can see (the model's own window)."""
        if first_new_position is None:
            return
        visible = row.positions[0] > first_new_position - self.sliding_window
        if not bool(visible.all()):
            index = visible.nonzero().squeeze(1).unsqueeze(0).expand(row.positions.shape[0], -1)
            self._select(row, index)

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-pad the rows' kept tokens into one batch; padding slots get an invisible position."""
        kvs = [row.store.keys_values() for row in self.rows]
        if len(self.rows) == 1:
            return kvs[0][0][None], kvs[0][1][None], self.rows[0].positions[None]
        slots = max(k.shape[1] for k, _ in kvs)
        keys = kvs[0][0].new_zeros(len(self.rows), kvs[0][0].shape[0], slots, kvs[0][0].shape[2])
        values = kvs[0][1].new_zeros(len(self.rows), kvs[0][1].shape[0], slots, kvs[0][1].shape[2])
        positions = torch.full((len(self.rows), keys.shape[1], slots), _PAD_POSITION, dtype=torch.long, device=keys.device)
        for b, ((k, v), row) in enumerate(zip(kvs, self.rows)):
            n = k.shape[1]
            if n:
                keys[b, :, slots - n:], values[b, :, slots - n:] = k, v
                positions[b, :, slots - n:] = row.positions
        return keys, values, positions

    def allowed_mask(self, query_positions: torch.Tensor, heads_of_query: int | None) -> torch.Tensor:
        """Boolean ``[B, heads, q, slots]``: a query sees a kept token at or before its position (and inside the window or chunk).

        ``heads`` is 1 when every KV head keeps the same tokens, else the number
        of query heads (``heads_of_query``) or KV heads (when ``None``).
        """
        slots = self._slot_positions
        if bool((slots == slots[:, :1]).all()):
            slots = slots[:, :1]
        key_pos, query_pos = slots[:, :, None, :], query_positions[:, None, :, None]
        allowed = key_pos <= query_pos
        if self.chunked:
            allowed &= key_pos // self.sliding_window == query_pos // self.sliding_window
        elif self.is_sliding:
            allowed &= key_pos > query_pos - self.sliding_window
        allowed |= ~allowed.any(dim=-1, keepdim=True)  # padding queries: attend somewhere rather than produce NaN
        if heads_of_query is not None and allowed.shape[1] > 1:
            allowed = allowed.repeat_interleave(heads_of_query // allowed.shape[1], dim=1)
        return allowed

    # --- scoring and compression ----------------------------------------------------------------
    def after_attention(self, query: torch.Tensor, keys: torch.Tensor, probabilities) -> None:
        """Called by the attention function once this layer's output is computed.

        ``probabilities(query, keys, allowed)`` gives the model's own attention
        probabilities ``[B, query_heads, q, slots]`` (softcapped, sink-diluted, ...)
        under a boolean mask; selection policies score with them.
        """
        policy = self.selection
        needs = policy.attention if policy is not None else "none"
        if needs != "none" and (needs in ("all", "last") or not all(r.compressed for r in self.rows)):
            self._observe(query, keys, probabilities, needs, getattr(policy, "window", 1))
        if self.is_sliding:
            # Like the model's own sliding layer: keep only what the next query can still see.
            for row in self.rows:
                if row.positions.shape[1]:
                    self._trim_to_window(row, int(row.positions.max()) + 1)
        if self.cache.defer_compression:
            return
        for b, row in enumerate(self.rows):
            if not row.compressed:
                self.compress_row(row, self.cache.protected(b))
            elif policy is not None and policy.decode_budget is not None and row.store.length > policy.decode_budget:
                self._evict_to(row, policy.decode_budget, protect_last=1)

    def _observe(self, query, keys, probabilities, needs: str, window: int) -> None:
        """Accumulate, per row, the attention mass each kept token received from the queries the policy asks for.

        The mass is averaged over the query heads that read each stored head:
        the GQA group of a KV head, or every head for a store with one shared
        head (MLA's latent), whose tokens are then kept or dropped for all heads at once.
        """
        q_len = query.shape[2]
        real = self.cache.input_real(query.shape[0], q_len, query.device)
        if needs == "window":
            first = max(0, q_len - window)
        elif needs == "last":
            first = q_len - 1
        else:
            first = 0
        mass = None
        for start in range(first, q_len, _QUERY_CHUNK):
            stop = min(q_len, start + _QUERY_CHUNK)
            allowed = self.allowed_mask(self._query_positions[:, start:stop], heads_of_query=query.shape[1])
            probs = probabilities(query[:, :, start:stop], keys, allowed)
            probs = probs * real[:, None, start:stop, None]  # padding queries contribute nothing
            stored_heads = self._slot_positions.shape[1]
            groups = query.shape[1] // stored_heads
            part = probs.reshape(probs.shape[0], stored_heads, groups, *probs.shape[2:]).mean(dim=2).sum(dim=2)
            mass = part if mass is None else mass + part
        slots = mass.shape[-1]
        for b, row in enumerate(self.rows):
            n = row.store.length
            row_mass = mass[b, :, slots - n:]
            if needs == "all" and row.attention is not None:
                previous = torch.nn.functional.pad(row.attention, (0, n - row.attention.shape[1]))
                row.attention = previous + row_mass
            else:
                row.attention = row_mass

    def scoring_state(self, row: RowState, seed: int) -> ScoringState:
        keys, _ = row.store.keys_values()
        return ScoringState(keys=keys, positions=row.positions, attention=row.attention,
                            layer_idx=self.layer_idx, num_layers=self.cache.num_layers, seed=seed)

    def compress_row(self, row: RowState, protect_last: int = 0, policy=None) -> None:
        """Prefill compression of one row: keep the selection's budget of context tokens, then seal the store."""
        policy = policy or self.selection
        if policy is not None:
            n = row.store.length
            candidates = n - min(protect_last, n)
            keep = policy.keep_count(candidates, self.layer_idx, self.cache.num_layers)
            if keep < candidates:
                scores = policy.scores(self.scoring_state(row, self.cache.seed_for(self.rows.index(row))))
                chosen = scores[:, :candidates].topk(keep, dim=1).indices.sort(dim=1).values
                protected = torch.arange(candidates, n, device=chosen.device).expand(chosen.shape[0], -1)
                self._select(row, torch.cat([chosen, protected], dim=1))
        row.store.seal()
        row.compressed = True

    def _evict_to(self, row: RowState, budget: int, protect_last: int) -> None:
        """Decode phase: keep the ``budget`` best-scored tokens (the newest ``protect_last`` always)."""
        n = row.store.length
        scores = self.selection.scores(self.scoring_state(row, self.cache.seed_for(self.rows.index(row)))).clone()
        scores[:, n - protect_last:] = float("inf")
        index = scores.topk(budget, dim=1).indices.sort(dim=1).values
        self._select(row, index)
        row.store.seal()

    def _select(self, row: RowState, index: torch.Tensor) -> None:
        row.store.select(index)
        row.positions = row.positions.gather(1, index)
        if row.attention is not None:
            row.attention = row.attention.gather(1, index)
        self.contiguous = False

    # --- measurement ----------------------------------------------------------------------------
    def nominal_tokens(self, row: RowState) -> int:
        # A sliding layer of the model's own cache holds the last window - 1 tokens between forwards.
        return row.tokens_seen if not self.is_sliding else min(row.tokens_seen, self.sliding_window - 1)


class CompressedHybridLayer(LinearAttentionLayer, CompressedLayer):
    """A layer with both a linear-attention/Mamba state and attention (Falcon-H1's parallel heads).

    The state is transformers' own ``LinearAttentionLayer`` code, kept exactly;
    the attention tokens are a :class:`CompressedLayer`, compressed by the policy.
    Mirrors transformers' ``LinearAttentionAndFullAttentionLayer``.
    """

    is_compileable = False

    def __init__(self, cache: "CompressedCache", layer_idx: int, sliding_window: int | None = None, number_of_states: int = 1):
        CompressedLayer.__init__(self, cache, layer_idx, sliding_window)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # ``update`` passes K and V positionally; the state updates pass keywords only.
        if len(args) == 2 and not kwargs:
            CompressedLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        CompressedLayer.reset(self)


class CompressedCache(Cache):
    """A ``transformers.Cache`` that applies a compression policy and measures what it holds.

    Parameters
    ----------
    model : PreTrainedModel
        The model the cache serves (its config gives layers, heads, sliding layers, dtype).
        Load it with ``attn_implementation="kveval"`` (:func:`kveval.models.load_model` does).
    policy : str or PolicyStack
        A spec such as ``"snapkv(ratio=0.5)+kivi(bits=4)"``; ``"none"`` keeps everything.
    seed : int
        Base seed for the ``random`` control policy (row ``b`` uses ``seed + b``).
    defer_compression : bool
        Store the prefill uncompressed with the policy's scores and compress only
        through :meth:`compressed_copy` (one prefill, many budgets).
    kv_dtype : str or torch.dtype, optional
        The deployment's cache dtype: full-precision tokens are stored in it and
        nominal bytes count it, whatever dtype the model computes in. Default:
        :func:`kveval.storage.deployment_kv_dtype` (the checkpoint's 16-bit dtype, else bfloat16).
    """

    def __init__(self, model, policy: "str | PolicyStack" = "none", seed: int = 0, defer_compression: bool = False,
                 kv_dtype: "str | torch.dtype | None" = None):
        self.kv_dtype = deployment_kv_dtype(model) if kv_dtype is None else parse_kv_dtype(kv_dtype)
        config = model.config.get_text_config()
        plans = architectures.check_supported(model.config)
        self.policy = parse_policy(policy)
        self.num_layers = config.num_hidden_layers
        self.head_dim, value_dim = architectures.cache_head_dims(model.config)
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.seed, self.defer_compression = seed, defer_compression
        self.model = model
        if self.policy.quantization is not None and self.policy.structure is None:
            # With a structure policy the quantizer sees coefficients, checked against their rank by that policy.
            for dim in sorted({self.head_dim, value_dim}):
                self.policy.quantization.check_head_dim(dim)
        self._input_mask: torch.Tensor | None = None
        self._column_mask: torch.Tensor | None = None
        self._protect_last: list[int] | None = None
        super().__init__(layers=[self._new_layer(i, plan) for i, plan in enumerate(plans)])

    def _new_layer(self, layer_idx: int, plan: "architectures.LayerPlan"):
        """Attention layers are compressed; state layers are transformers' own; others hold nothing."""
        if plan.kind == architectures.ATTENTION:
            return CompressedLayer(self, layer_idx, plan.sliding_window, chunked=plan.chunked)
        if plan.kind == architectures.HYBRID:
            return CompressedHybridLayer(self, layer_idx, plan.sliding_window, plan.number_of_states)
        if plan.kind == architectures.STATE:
            return LinearAttentionLayer(number_of_states=plan.number_of_states)
        return DummyLayer()

    @property
    def attention_layers(self) -> list["CompressedLayer"]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    @property
    def state_layers(self) -> list[LinearAttentionLayer]:
        return [layer for layer in self.layers if isinstance(layer, LinearAttentionLayer)]

    # --- what the driver declares before a forward pass -----------------------------------------
    def set_input_mask(self, mask: torch.Tensor | None) -> None:
        """Declare which input tokens of the next forward are real (``[B, q]``, 1 = real, 0 = padding)."""
        self._input_mask = None if mask is None else mask.bool()
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

    def protected(self, b: int) -> int:
        return 0 if self._protect_last is None else self._protect_last[b]

    def seed_for(self, b: int) -> int:
        return self.seed + b

    # --- store construction ---------------------------------------------------------------------
    def new_store(self, layer_idx: int, dtype: torch.dtype):
        """An empty store for one sequence of layer ``layer_idx``, holding ``kv_dtype`` and computing in ``dtype``."""
        store = DenseStore(self.kv_dtype, dtype)
        for representation in (self.policy.quantization, self.policy.structure):  # innermost first
            if representation is not None:
                store = representation.make_store(store, self.model, layer_idx)
        return store

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
        finally:
            for layer, rows in zip(self.attention_layers, saved):
                layer.rows = rows
        for layer, rows in zip(clone.attention_layers, saved):
            layer.rows = [copy.deepcopy(rows[i], dict(memo)) for i in index]
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

    # --- one prefill, many budgets ---------------------------------------------------------------
    def compressed_copy(self, policy: "str | PolicyStack") -> "CompressedCache":
        """A copy of this deferred, uncompressed cache, compressed with ``policy``.

        ``policy`` must use the same scores as this cache's policy (same selection
        policy and parameters except ``ratio``/``budget``), so the prefill is run
        once for many budgets.
        """
        import copy

        if not self.defer_compression:
            raise ValueError("compressed_copy needs a cache built with defer_compression=True")
        target = parse_policy(policy)
        clone = copy.copy(self)
        clone.policy, clone.defer_compression = target, False
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
            new.selection = None if layer.is_sliding else target.selection
            new.rows = [RowState(copy.deepcopy(r.store), r.positions.clone(),
                                 None if r.attention is None else r.attention.clone(), r.tokens_seen, False)
                        for r in layer.rows]
            for b, row in enumerate(new.rows):
                new.compress_row(row, clone.protected(b))
            clone.layers.append(new)
        return clone

    # --- measurement ----------------------------------------------------------------------------
    def stats(self, row: int | None = None) -> CacheStats:
        """Measured and nominal bytes, and kept tokens per layer, for the batch or one of its rows."""
        kv = index = nominal = 0
        kept = []
        for layer in self.attention_layers:
            rows = layer.rows if row is None else layer.rows[row:row + 1]
            per_token = layer.token_elements * self.kv_dtype.itemsize
            for r in rows:
                kv += r.store.nbytes
                index += r.positions.numel() * r.positions.element_size()
                if r.attention is not None:
                    index += r.attention.numel() * r.attention.element_size()
                nominal += layer.nominal_tokens(r) * per_token
            kept.append([r.store.length for r in rows])
        first = self.attention_layers[0].rows if self.attention_layers else []
        seen = [r.tokens_seen for r in (first if row is None else first[row:row + 1])]
        return CacheStats(kv, nominal, index, seen, kept, self._state_bytes(row), dtype_name(self.kv_dtype))

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
    the RoPE key). Linear-attention / Mamba layers hold no per-token K/V. ``dtype``: the cache dtype, default
    the model's deployment dtype (:func:`kveval.storage.deployment_kv_dtype`).
    """
    attention_layers = sum(p.holds_tokens for p in architectures.cache_layer_plan(model.config))
    element = (deployment_kv_dtype(model) if dtype is None else parse_kv_dtype(dtype)).itemsize
    return attention_layers * sum(architectures.cache_widths(model.config)) * element


__all__ = ["CacheStats", "CompressedCache", "CompressedLayer", "nominal_bytes_per_token"]
