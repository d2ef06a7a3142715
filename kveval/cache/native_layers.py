"""kveval's cache layers for models whose own cache layers hold more than per-token K/V: DeepSeek V3.2 (and GLM's
MoE-DSA models) and DeepSeek V4. Each mirrors transformers' own layer method for method, so the model's code runs
unchanged against it, and keeps every part apart so that each is measured (and coded) on its own.

===============================  =====================================================  =================================
layer type                       transformers' layer                                    parts (per token / per entry)
===============================  =====================================================  =================================
``indexed_attention`` (V3.2,     ``DynamicIndexedLayer``: latent + RoPE key (through    ``latent``, ``indexer``
GLM MoE-DSA)                     ``update``) and the DSA indexer's keys
                                 (``update_indexer``)
``sliding_attention`` (V4)       ``DynamicSlidingWindowLayer``: the last                ``window``
                                 ``sliding_window - 1`` K=V entries
``heavily_compressed_attention``  ``DeepseekV4HCACache``: the window, one entry per     ``window``, ``hca``; state:
(V4)                             ``compress_rates[hca]`` tokens, and the tokens         pending tokens
                                 waiting for their window (``buffer_kv/gate``)
``compressed_sparse_attention``  ``DeepseekV4CSACache``: the window, one entry per      ``window``, ``csa``, ``indexer``;
(V4)                             ``compress_rates[csa]`` tokens for attention and one   state: pending tokens and the
                                 for the indexer, the pending tokens and the last       overlap
                                 window's overlap half (``overlap_kv/gate``)
===============================  =====================================================  =================================

The latent and the window are a :class:`~kveval.cache.layers.CompressedLayer`'s token store (V4's K=V entries are
stored once, as keys with values of width 0: its attention reads ``cache.update(kv, kv)[0]``). The compressed
entries and the indexer's keys are :class:`PartSequence` s, one per row, held in the cache dtype (in a 16-bit
model transformers' own V4 layers keep the float32 its norms return; a deployment stores them in its cache dtype,
and so does kveval, whose self-check tolerance for 16-bit models covers that rounding). The pending tokens and the overlap are
constant-size state, kept as the model hands them (a tensor in the compute dtype held in the cache dtype, as a
deployment computing in it holds it) and counted in ``state_bytes``, apart from the per-token bytes.

Exactness. These layers return what the model's own layers return, in the same layout: the window's entries
(``get_mask_sizes`` mirrors the sliding layer's), the latent, the entries emitted so far. Attention then runs under
the model's own mask (with the compressor's block bias and the indexer's top-k folded in by the model's code), so
kveval puts no mask of its own (``kveval_mask`` is ``None``). That layout is the model's as long as a row holds
every token it saw: a forward with padding is refused (:class:`~kveval.errors.UnsupportedModelError`), and
kveval's drivers run such models' rows one at a time (:func:`rows_alone`), since the compressor's windows and the
indexer's mask are laid over the batch's columns, where a padded row would pool its padding.

Compression. On V3.2's latent, a selection that acts on it (:attr:`~kveval.policies.base.Placement.LATENT`) keeps a
token's latent and indexer key together (:class:`IndexedLayer`). On V4, one that acts on the compressed entries
(:attr:`~kveval.policies.base.Placement.ENTRIES`) removes the fraction
``ratio`` of each CSA/HCA layer's compressed entries at the prefill (a CSA entry's indexer key with it), the sliding
window left as the model defines it; the entries keep their numbers, as the model's block masks and indexer need
(:class:`HcaLayer`). Quantization codes every part: the window or latent as any store (K's coding for the entries,
which are keys), the compressed entries and the indexer's keys as the quantizer codes a part of keys alone (its
``part_codes``: K's grouped coding, or KVQuant with a codec calibrated on that part), and the indexer per its own
term (``indexer=fp8``: e4m3 with one scale per 128 values, as DeepSeek serves it; ``indexer=native``: the cache
dtype). Each forward attends its own new entries as they come, then they are coded (a compressed row's new entries
are coded as they arrive, as its latent's tokens are). Refused before any weights load, from what each policy
declares (:func:`kveval.policies.compatibility.check_policy`):
selections that score with attention (the model's carries the indexer's top-k), per-head budgets, token budgets on
V4's entries, structure, keys before RoPE (no RoPE hook for these models), and codecs that code no parts.
"""

from __future__ import annotations

import copy

import torch

from kveval.cache.layers import CompressedLayer
from kveval.errors import UnsupportedModelError
from kveval.modeling.architectures import is_native
from kveval.modeling.layer_types import NATIVE_ENTRY_PARTS, NATIVE_STORE_PARTS
from kveval.policies.base import Need
from kveval.policies.compatibility import check_policy, indexer_coding, refuse_model_indexer
from kveval.policies.indexer import index_shares
from kveval.stores.quantized import QuantizedSequence
from kveval.tensors.scoring_state import ScoringState

def rows_alone(model) -> bool:
    """Whether kveval's drivers run ``model``'s rows one at a time (its native layers take no padding)."""
    return is_native(model.config)


def part_codes(cache, layer_idx: int, part: str, width: int, stride: int):
    """How one row of ``part`` (``width`` values per entry, one entry per ``stride`` tokens) of layer ``layer_idx``
    is coded under the cache's quantizer (one that codes these parts: :attr:`~kveval.policies.base.Placement.PARTS`): its ``part_codes``, or for the indexer's
    keys its ``indexer`` term (:func:`indexer_coding`); ``None``: kept in the cache dtype."""
    quantization = cache.policy.quantization
    if quantization is None:
        return None
    own, quant = indexer_coding(quantization, part, width)
    if own:
        return None if quant is None else QuantizedSequence(quant, 0, cache.kv_dtype)
    return quantization.part_codes(cache.model, layer_idx, part, width, cache.kv_dtype, stride)


class PartSequence:
    """One row's entries of one part (``[1, n, width]`` each time): dense in the cache dtype, or ``coded`` (a
    sequence of :func:`part_codes`)."""

    def __init__(self, coded, kv_dtype: torch.dtype):
        self.kv_dtype = kv_dtype
        self.coded = coded
        self.dense: torch.Tensor | None = None
        self.compute_dtype: torch.dtype | None = None
        self.appended = 0  # entries ever appended: what the model's own cache holds (nothing evicted)

    @property
    def length(self) -> int:
        if self.coded is not None:
            return self.coded.length
        return 0 if self.dense is None else self.dense.shape[1]

    def append(self, x: torch.Tensor, seal: bool) -> None:
        self.compute_dtype = self.compute_dtype or x.dtype
        self.appended += x.shape[1]
        if x.shape[1] == 0:
            return
        if self.coded is not None:
            self.coded.append(x)
            if seal:
                self.coded.seal()
        else:
            x = x.to(self.kv_dtype)
            self.dense = x.clone() if self.dense is None else torch.cat([self.dense, x], dim=1)

    def seal(self) -> None:
        if self.coded is not None:
            self.coded.seal()

    def select(self, index: torch.Tensor) -> None:
        """Keep entries ``index`` (``[1, n']``, increasing); coded entries are never re-encoded."""
        if self.coded is not None:
            self.coded.select(index)
        elif self.dense is not None:
            self.dense = self.dense[:, index[0]]

    def read(self, width: int, device) -> torch.Tensor:
        """Every entry, ``[1, n, width]`` in the dtype they came in."""
        if not self.length:
            return torch.zeros(1, 0, width, dtype=self.compute_dtype, device=device)
        if self.coded is not None:
            return self.coded.materialize()
        return self.dense.to(self.compute_dtype)

    @property
    def nbytes(self) -> int:
        if self.coded is not None:
            return self.coded.nbytes
        return 0 if self.dense is None else self.dense.numel() * self.dense.element_size()


class NativeLayer(CompressedLayer):
    """A native cache layer: its store part (:attr:`store_part`) is the :class:`CompressedLayer`'s; the others are
    :class:`PartSequence` s per row, and the constant-size state is held in :attr:`states`."""

    store_part = "latent"

    def __init__(self, cache, layer_idx: int, sliding_window: int | None = None):
        super().__init__(cache, layer_idx, sliding_window)
        self.parts: dict[str, list[PartSequence]] = {}
        self.part_widths: dict[str, int] = {}
        self.states: dict[str, torch.Tensor] = {}  # what the model's own layer keeps between forwards, by name
        self.state_dtypes: dict[str, torch.dtype] = {}
        self.sealing = False  # the first forward has been attended: new entries are coded as they arrive

    # --- what attention reads, in the model's own layout ---------------------------------------------------------
    def update(self, key_states, value_states, *args, kwargs=None, **extra):
        real = self.cache.input_counts(key_states.shape[0], key_states.shape[2])[1]
        if not real:
            raise UnsupportedModelError(
                f"layer {self.layer_idx} ({type(self).__name__}): a padded batch would pool padding into the "
                f"model's compressed entries and indexer; run its rows one at a time (kveval's drivers do)")
        keys, values = super().update(key_states, value_states, *args, kwargs=kwargs, **extra)
        if kwargs is not None:
            kwargs["kveval_mask"] = None  # the model's own mask: this layer holds its layout
        return keys, values

    def _could_batch(self) -> bool:  # one row at a time, the plain path: the model's layout at every step
        return False

    def after_attention(self, query, keys, probabilities) -> None:
        super().after_attention(query, keys, probabilities)
        for rows in self.parts.values():
            for part in rows:
                part.seal()
        self.sealing = True

    # --- the parts ------------------------------------------------------------------------------------------------
    def append_part(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Append ``x`` (``[B, n, width]``) to part ``name`` of every row; all its entries, ``[B, total, width]``."""
        return torch.cat(self.append_part_rows(name, x), dim=0)

    def append_part_rows(self, name: str, x: torch.Tensor) -> list[torch.Tensor]:
        """Append ``x`` (``[B, n, width]``) to part ``name`` of every row; each row's entries held, ``[1, held, width]``."""
        rows = self.parts.get(name)
        if rows is None:
            width, stride = x.shape[-1], self.part_stride(name)
            rows = self.parts[name] = [PartSequence(part_codes(self.cache, self.layer_idx, name, width, stride),
                                                    self.cache.kv_dtype) for _ in range(x.shape[0])]
            self.part_widths[name] = width
        for b, part in enumerate(rows):
            part.append(x[b:b + 1], self.sealing)
        return [part.read(x.shape[-1], x.device) for part in rows]

    def part_stride(self, name: str) -> int:
        """Tokens per entry of part ``name``: 1 (a key per token, as V3.2's indexer's)."""
        return 1

    def hold_state(self, name: str, x: "torch.Tensor | None") -> None:
        """Keep ``x`` between forwards: in the cache dtype where the model computes it in its compute dtype (as a
        deployment computing in the cache dtype holds it), else as it is (V4's gates carry a float32 bias)."""
        self.state_dtypes[name] = x.dtype
        self.states[name] = (x.to(self.cache.kv_dtype) if x.dtype == self.dtype else x).clone()

    def read_state(self, name: str) -> "torch.Tensor | None":
        """State ``name`` in the dtype the model gave it, ``None`` before it was held."""
        x = self.states.get(name)
        return None if x is None else x.to(self.state_dtypes[name])

    # --- measurement ----------------------------------------------------------------------------------------------
    def row_parts(self, b: int) -> dict[str, tuple[int, int]]:
        """Row ``b``'s parts: ``{name: (measured bytes, bytes of the model's own cache in the cache dtype)}``."""
        row = self.rows[b]
        item = self.cache.kv_dtype.itemsize
        out = {self.store_part: (row.store.nbytes, self.nominal_tokens(row) * self.token_elements * item)}
        for name, rows in self.parts.items():
            part = rows[b]
            out[name] = (part.nbytes, part.appended * self.part_widths[name] * item)
        return out

    def take_rows(self, index: list[int]) -> None:
        """Keep row ``index[j]`` of the parts and states as row ``j`` (a forked cache's layer: see
        :meth:`~kveval.cache.compressed.CompressedCache.fork_rows`), each an independent copy."""
        self.parts = {name: [copy.deepcopy(rows[i]) for i in index] for name, rows in self.parts.items()}
        picked = torch.tensor(index, dtype=torch.long)
        self.states = {name: x.index_select(0, picked.to(x.device)) for name, x in self.states.items()}

    def row_state_bytes(self, b: int) -> int:
        return sum(x[b].numel() * x.element_size() for x in self.states.values())

    def reset(self) -> None:
        super().reset()
        self.parts, self.part_widths, self.states, self.state_dtypes, self.sealing = {}, {}, {}, {}, False


class IndexedLayer(NativeLayer):
    """``indexed_attention`` (DeepSeek V3.2, GLM MoE-DSA): transformers' ``DynamicIndexedLayer``. The latent and RoPE
    key are the store's (MLA: :mod:`kveval.modeling.architectures`), the indexer's keys part ``indexer``.

    A selection (one declaring :attr:`~kveval.policies.base.Placement.LATENT`) keeps a token's latent and its indexer key together, for every head at
    once. The layer then reports the slots it holds as its length (``get_seq_length``, ``get_mask_sizes``), so the
    model's own causal mask is laid over them: every held token before this forward's, which are causal among
    themselves, and the model's indexer picks its top-k among what is held. With nothing evicted that is the
    model's own layout, column for column."""

    store_part = NATIVE_STORE_PARTS["indexed_attention"]

    def __init__(self, cache, layer_idx: int):
        super().__init__(cache, layer_idx)
        self.indexer_position_ids = None  # GLM's multi-dimensional positions: never set for the models kveval runs

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """New indexer keys ``[B, n, index_head_dim]``; every key held, ``[B, total, index_head_dim]``."""
        return self.append_part("indexer", indexer_key_states)

    def _held(self) -> int:
        return self._rows[0].store.length if self._rows else 0

    def get_seq_length(self) -> int:
        return self._held()

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self._held() + query_length, 0

    def _select(self, row, index) -> None:
        super()._select(row, index)
        if isinstance(index, list):
            index = torch.stack(index)
        b = next(i for i, r in enumerate(self._rows) if r is row)
        for rows in self.parts.values():
            rows[b].select(index[:1])


class WindowLayer(NativeLayer):
    """DeepSeek V4's ``sliding_attention``: the last ``sliding_window - 1`` K=V entries between forwards
    (``DynamicSlidingWindowLayer``), stored once (as keys; values of width 0). No selection acts on it: the window
    stays as the model defines it (a selection acts on the compressed entries: :class:`HcaLayer`)."""

    store_part = NATIVE_STORE_PARTS["sliding_attention"]

    @property
    def takes_selection(self) -> bool:
        return False

    def update(self, key_states, value_states, *args, kwargs=None, **extra):
        keys, _ = super().update(key_states, key_states[..., :0], *args, kwargs=kwargs, **extra)
        return keys, keys

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        """As ``DynamicSlidingWindowLayer``: the window's entries and this forward's, from the column the window
        starts at."""
        seen, window = self.columns_seen, self.sliding_window
        held = window - 1 if seen >= window else seen
        return held + query_length, max(seen - window + 1, 0)


class HcaLayer(WindowLayer):
    """DeepSeek V4's ``heavily_compressed_attention`` (``DeepseekV4HCACache``): the window, the compressor's entries
    (part ``hca``) and its pending tokens (state ``buffer_kv/compressor``, ``buffer_gate/compressor``).

    A selection (one declaring :attr:`~kveval.policies.base.Placement.ENTRIES`) removes the fraction ``ratio`` of the entries a row's prefill emitted
    (:meth:`compress_rows`); entries that cover a protected token (a query-aware prompt's question) stay, and so do
    all later ones. The model numbers entries from the first: its compressor's block bias lets query ``t`` see entry
    ``w`` when ``w < (t + 1) // rate``, its indexer ranks entries by that number. So the layer hands the model every
    entry at its own number, an evicted one as zeros, and hides those (:meth:`hide_evicted`: the attention mask;
    :func:`install_indexer_masks`: the indexer's scores, so its top-k is chosen among the entries held). What is
    stored and measured is the held entries alone; attention and the indexer's top-k are the model's over them."""

    layer_type = "heavily_compressed_attention"
    entry_parts = NATIVE_ENTRY_PARTS[layer_type]

    def __init__(self, cache, layer_idx: int, sliding_window: int, config):
        super().__init__(cache, layer_idx, sliding_window)
        self.compress_rate = config.compress_rates[self.layer_type]
        self.entry_count = {name: 0 for name in self.entry_parts}
        #: Per row, after a selection: the entry numbers it kept of those emitted before it (``None``: every entry
        #: held), and how many were emitted then; every entry emitted since is held.
        self.kept_entries: list[torch.Tensor | None] = []
        self.entries_at_selection: list[int] = []

    # --- selection on the entries ---------------------------------------------------------------------------------
    def compress_rows(self, rows, protect_last, policy=None) -> None:
        super().compress_rows(rows, protect_last, policy)  # the window: sealed as it is (no selection acts on it)
        selection = self.cache.policy.selection
        if selection is None:
            return
        for row, protect in zip(rows, protect_last):
            b = next(i for i, r in enumerate(self._rows) if r is row)
            self._select_entries(b, row.tokens_seen - min(protect, row.tokens_seen), selection)

    def _select_entries(self, b: int, free_tokens: int, selection) -> None:
        """Keep ``selection``'s share of row ``b``'s entries that cover none of its last tokens after ``free_tokens``
        (an entry covers the tokens up to ``(w + 1) x rate``); the others stay."""
        while len(self.kept_entries) <= b:
            self.kept_entries.append(None)
            self.entries_at_selection.append(0)
        emitted = self.entry_count["compressor"]
        candidates = min(free_tokens // self.compress_rate, emitted)
        keep = selection.keep_count(candidates, self.layer_idx, self.cache.num_layers)
        attention = self._entry_attention(b, selection)
        if keep >= candidates or (Need.INDEXER in selection.needs and attention is None):
            return
        scored = self.parts[self.entry_parts["compressor"]][b]
        entries = scored.read(self.part_widths[self.entry_parts["compressor"]], self._device())[:, :candidates]
        positions = (torch.arange(candidates, device=entries.device) * self.compress_rate)[None]
        attention = None if attention is None else attention[:, :candidates]
        state = ScoringState(keys=entries, positions=positions, attention=attention, layer_idx=self.layer_idx,
                             num_layers=self.cache.num_layers, seed=self.cache.seed_for(b), model=self.cache.model)
        chosen = selection.choose(selection.scores(state), keep, state)[0]
        index = torch.cat([chosen, torch.arange(candidates, emitted, device=chosen.device)])
        for part in self.entry_parts.values():
            self.parts[part][b].select(index[None])
        self.kept_entries[b], self.entries_at_selection[b] = index, emitted

    def _entry_attention(self, b: int, selection) -> "torch.Tensor | None":
        """What an entry selection scores row ``b`` with beside the entries: the indexer's shares (``[1, entries]``,
        :class:`CsaLayer`); ``None`` here (HCA has no indexer: ``indexer`` leaves its entries)."""
        return None

    def part_stride(self, name: str) -> int:
        """One entry per ``compress_rate`` tokens."""
        return self.compress_rate

    def _device(self):
        return self._rows[0].positions.device if self._rows else "cpu"

    def _held_numbers(self, b: int, emitted: int) -> "torch.Tensor | None":
        """The numbers of the entries row ``b`` holds of the ``emitted`` so far; ``None`` when it holds them all."""
        kept = self.kept_entries[b] if b < len(self.kept_entries) else None
        if kept is None:
            return None
        return torch.cat([kept, torch.arange(self.entries_at_selection[b], emitted, device=kept.device)])

    def _evicted(self, emitted: int, device) -> "torch.Tensor | None":
        """``[B, emitted]``, true at the entries a row no longer holds; ``None`` when every row holds every entry."""
        if not any(k is not None for k in self.kept_entries):
            return None
        gone = torch.zeros(len(self._rows), emitted, dtype=torch.bool, device=device)
        for b in range(len(self._rows)):
            held = self._held_numbers(b, emitted)
            if held is not None:
                gone[b] = True
                gone[b, held.to(device)] = False
        return gone

    def hide_evicted(self, attention_mask, query, key):
        """The model's mask with the evicted entries (the last ``emitted`` key columns) hidden from every query."""
        emitted = self.entry_count["compressor"]
        gone = self._evicted(emitted, query.device)
        if gone is None:
            return attention_mask
        if attention_mask is None:
            attention_mask = query.new_zeros(query.shape[0], 1, query.shape[2], key.shape[2])
        columns = torch.zeros(attention_mask.shape[0], key.shape[2], dtype=torch.bool, device=query.device)
        columns[:, key.shape[2] - emitted:] = gone
        columns = columns[:, None, None, :]
        if attention_mask.dtype == torch.bool:
            return attention_mask & ~columns
        return attention_mask.masked_fill(columns, float("-inf"))

    def hide_evicted_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """The indexer's scores (``[B, q, emitted]``) with the evicted entries at ``-inf``: its top-k among the held."""
        gone = self._evicted(scores.shape[-1], scores.device)
        return scores if gone is None else scores.masked_fill(gone[:, None, :], float("-inf"))

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """As ``DeepseekV4HCACache.store_compression_weights``: the pending tokens then ``kv``/``gate``, cut at the
        last whole window; what follows waits. ``(chunk_kv, chunk_gate, first_window_position)``."""
        first_window_position = self.entry_count[name] * self.compress_rate
        pending_kv, pending_gate = self.read_state(f"buffer_kv/{name}"), self.read_state(f"buffer_gate/{name}")
        if pending_kv is not None and pending_kv.shape[1]:
            kv = torch.cat([pending_kv, kv], dim=1)
            gate = torch.cat([pending_gate, gate], dim=1)
        usable = (kv.shape[1] // self.compress_rate) * self.compress_rate
        self.hold_state(f"buffer_kv/{name}", kv[:, usable:])
        self.hold_state(f"buffer_gate/{name}", gate[:, usable:])
        return kv[:, :usable], gate[:, :usable], first_window_position

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """New entries ``[B, n, width]`` of series ``name``; every entry so far at its own number, ``[B, total,
        width]`` (an evicted one as zeros, hidden by :meth:`hide_evicted`)."""
        self.entry_count[name] += compressed.shape[1]
        emitted = self.entry_count[name]
        rows = self.append_part_rows(self.entry_parts[name], compressed)
        numbers = [self._held_numbers(b, emitted) for b in range(len(rows))]
        if all(n is None for n in numbers):
            return torch.cat(rows, dim=0)
        numbered = rows[0].new_zeros(len(rows), emitted, compressed.shape[-1])
        for b, (held, n) in enumerate(zip(rows, numbers)):
            numbered[b, slice(None) if n is None else n] = held[0]
        return numbered

    def take_rows(self, index: list[int]) -> None:
        super().take_rows(index)
        self.kept_entries = [self.kept_entries[i] if i < len(self.kept_entries) else None for i in index]
        self.entries_at_selection = [self.entries_at_selection[i] if i < len(self.entries_at_selection) else 0
                                     for i in index]

    def reset(self) -> None:
        super().reset()
        self.entry_count = {name: 0 for name in self.entry_parts}
        self.kept_entries, self.entries_at_selection = [], []


class CsaLayer(HcaLayer):
    """DeepSeek V4's ``compressed_sparse_attention`` (``DeepseekV4CSACache``): as :class:`HcaLayer` with entries
    ``csa``, plus the indexer's entries (part ``indexer``) and each series' overlap half (state ``overlap_kv/*``,
    ``overlap_gate/*``)."""

    layer_type = "compressed_sparse_attention"
    entry_parts = NATIVE_ENTRY_PARTS[layer_type]

    def __init__(self, cache, layer_idx: int, sliding_window: int, config):
        super().__init__(cache, layer_idx, sliding_window, config)
        self.index_shares: list[torch.Tensor] = []  # per row, under ``indexer``: its prefill's summed index shares

    def observe_index_scores(self, scores: torch.Tensor, positions: torch.Tensor) -> None:
        """The indexer's scores of one forward (``[B, q, entries]``, queries at ``positions``): under the ``indexer``
        selection, before the rows are compressed, each entry's summed share (:func:`index_shares`)."""
        selection = self.cache.policy.selection
        if selection is None or Need.INDEXER not in selection.needs or all(r.compressed for r in self._rows):
            return
        shares = index_shares(scores, positions.to(scores.device), self.compress_rate, selection.window)
        self.index_shares = [shares[b:b + 1] for b in range(shares.shape[0])]

    def _entry_attention(self, b: int, selection) -> "torch.Tensor | None":
        if Need.INDEXER not in selection.needs:
            return None
        return self.index_shares[b]

    def take_rows(self, index: list[int]) -> None:
        super().take_rows(index)
        self.index_shares = [self.index_shares[i] for i in index if i < len(self.index_shares)]

    def reset(self) -> None:
        super().reset()
        self.index_shares = []

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        """As ``DeepseekV4CSACache.update_overlap_state``: the prior call's last-window Ca half (``None`` at first),
        and this call's kept for the next."""
        prior_kv, prior_gate = self.read_state(f"overlap_kv/{name}"), self.read_state(f"overlap_gate/{name}")
        self.hold_state(f"overlap_kv/{name}", chunk_kv[:, -1, :, :head_dim])
        self.hold_state(f"overlap_gate/{name}", chunk_gate[:, -1, :, :head_dim])
        return prior_kv, prior_gate


def install_indexer_masks(model) -> None:
    """Let V4's indexers rank only the entries a :class:`CsaLayer` holds (idempotent).

    ``DeepseekV4Indexer`` scores every entry the cache hands it, at its own number, and takes its top-k; an entry
    the layer evicted is handed as zeros, which would score 0 and could take a top-k slot. Two forward hooks (no
    modeling code changed): one before each indexer notes the cache layer it is called with, one after its scorer
    sets the evicted entries' scores to ``-inf`` (:meth:`HcaLayer.hide_evicted_scores`). With nothing evicted, or
    with another cache, the scores pass unchanged."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    for module in model.modules():
        if not isinstance(module, DeepseekV4Indexer) or getattr(module, "kveval_masks", False):
            continue
        module.kveval_masks = True
        module.register_forward_pre_hook(_note_indexer_layer, with_kwargs=True)
        module.scorer.register_forward_hook(_hide_evicted_scores)


def _note_indexer_layer(module, args, kwargs) -> None:
    """Before ``DeepseekV4Indexer.forward(hidden_states, q_residual, position_ids, cache, layer_idx)``: note the
    :class:`CsaLayer` it reads on its scorer (``None`` for another cache)."""
    names = ("hidden_states", "q_residual", "position_ids", "cache", "layer_idx")
    given = {**dict(zip(names, args)), **kwargs}
    cache, layer_idx = given.get("cache"), given.get("layer_idx")
    layer = cache.layers[layer_idx] if cache is not None and layer_idx is not None else None
    module.scorer.kveval_layer = layer if isinstance(layer, CsaLayer) else None
    module.scorer.kveval_positions = given.get("position_ids")


def _hide_evicted_scores(module, args, output):
    """After the scorer: its scores to the layer (the ``indexer`` selection's), the evicted entries' at ``-inf``."""
    layer = getattr(module, "kveval_layer", None)
    if layer is None:
        return output
    layer.observe_index_scores(output, module.kveval_positions)
    return layer.hide_evicted_scores(output)


def native_layer(cache, layer_idx: int, plan, config) -> NativeLayer:
    """The :class:`NativeLayer` of one model layer (``plan``: its :class:`~kveval.modeling.architectures.LayerPlan`)."""
    text = config.get_text_config(decoder=True)
    if plan.layer_type == "indexed_attention":
        return IndexedLayer(cache, layer_idx)
    if plan.layer_type == "sliding_attention":
        return WindowLayer(cache, layer_idx, plan.sliding_window)
    if plan.layer_type == "heavily_compressed_attention":
        return HcaLayer(cache, layer_idx, plan.sliding_window, text)
    if plan.layer_type == "compressed_sparse_attention":
        install_indexer_masks(cache.model)
        return CsaLayer(cache, layer_idx, plan.sliding_window, text)
    raise UnsupportedModelError(f"layer {layer_idx}: native layer type {plan.layer_type!r} has no kveval layer")


# check_policy and refuse_model_indexer are re-exported: the cache and the runner check a stack here before loading.
__all__ = ["CsaLayer", "HcaLayer", "IndexedLayer", "NativeLayer", "PartSequence", "WindowLayer", "check_policy",
           "install_indexer_masks", "native_layer", "refuse_model_indexer", "part_codes", "rows_alone"]
