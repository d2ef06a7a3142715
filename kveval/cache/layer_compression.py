"""Scoring and compression of a :class:`~kveval.cache.layers.CompressedLayer`: what a selection policy observes after
attention, and what it keeps.

After each attention, :class:`LayerCompression` accumulates the attention mass (or the queries) a selection scores
with, compresses the rows the prefill just filled (each keeps the selection's budget, then the stores seal
together), and keeps a decode budget row by row where the batch cannot (:mod:`kveval.cache.buffered_decode` keeps it
otherwise). :func:`score_key` names the scores a policy reads, so that one prefill computes each once.
"""

from __future__ import annotations

import torch

from kveval.cache.rows import RowState, seal_rows
from kveval.tensors.block_probabilities import AttentionProbabilities, attention_mass
from kveval.tensors.scoring_state import ScoringState


def score_key(selection) -> tuple | None:
    """Which attention mass ``selection`` scores with: ``(kind, window)``, or ``None`` when it needs none.

    Policies with equal keys read the same scores (SnapKV and PyramidKV at one
    window, every H2O, every TOVA), so a shared prefill computes each key once.
    """
    needs = "none" if selection is None else selection.attention
    if needs == "none":
        return None
    return needs, (selection.window if needs == "window" else None)


def shared_by_group(scores: torch.Tensor, store) -> torch.Tensor:
    """``scores`` (``[kv_heads, n]``) averaged over each group of heads that keeps one set of tokens
    (a store's :attr:`~kveval.stores.base.TokenStore.head_groups`: kveval.stores.latent's groups of KV heads), so every
    head of a group picks the same ones."""
    group = store.head_groups
    if group == 1:
        return scores
    return scores.reshape(-1, group, scores.shape[1]).mean(dim=1).repeat_interleave(group, dim=0)


class LayerCompression:
    """Scoring and compression of a cache layer's rows (a mixin of :class:`~kveval.cache.layers.CompressedLayer`).

    Needs of the layer: the attributes annotated below; :meth:`~kveval.cache.layers.CompressedLayer.allowed_mask`;
    of :class:`~kveval.cache.layer_rows.LayerRows` ``rows``, ``_select`` and ``_trim_rows_to_window``; of
    :class:`~kveval.cache.layer_decode.LayerDecode` ``_settle_compressed_rows``.
    """

    cache: "CompressedCache"
    layer_idx: int
    is_sliding: bool
    takes_selection: bool
    selection: object  # SelectionPolicy or None
    _decode: "BufferedDecode | None"
    _buffer: "BatchBuffer | None"
    _buffer_only_step: bool
    _query_positions: "torch.Tensor | None"
    _slot_positions: "torch.Tensor | None"
    _mask: "torch.Tensor | None"
    contiguous: bool
    shared_read: "SharedRead | None"

    def hide_evicted(self, attention_mask, query: torch.Tensor, key: torch.Tensor):
        """The mask attention runs under, given the one it was handed (the model's, or the layer's own): a layer that
        hands the model slots it no longer holds (DeepSeek V4's evicted entries, kept at their numbers: see
        :class:`~kveval.cache.native_layers.HcaLayer`) hides them here. Default: unchanged."""
        return attention_mask

    def after_attention(self, query: torch.Tensor, keys: torch.Tensor, probabilities: AttentionProbabilities) -> None:
        """Called by the attention function once this layer's output is computed.

        ``probabilities(query, keys, allowed)`` gives the model's own attention
        probabilities ``[B, query_heads, q, slots]`` (softcapped, sink-diluted, ...)
        under a boolean mask; selection policies score with them. Decode budgets that
        may wait (:class:`~kveval.cache.decode_evictions.DeferredEvictions`) are kept once the
        forward's last attention layer has run. What later layers read of this one's (:attr:`shared_read`) is copied
        first: compression may change the tensors its attention read in place.
        """
        if self.shared_read is not None:
            self.shared_read = self.shared_read.detached()
        self._score_and_compress(query, keys, probabilities)
        if self.layer_idx == self.cache.last_attention_layer and self.cache.evictions.pending:
            self.cache.evictions.flush()

    def _score_and_compress(self, query: torch.Tensor, keys: torch.Tensor,
                            probabilities: AttentionProbabilities) -> None:
        if self._buffer_only_step:  # the batch at once (see _batched_decode): scores, then any budget
            decode = self._decode
            mass = None if decode.accumulates is None else self._mass(query, keys, probabilities, score_key(self.selection))
            if decode.after_attention(self._buffer, mass, self.cache.evictions):
                self.contiguous = False  # tokens were dropped: the model's own mask no longer lines up
            return
        policy = self.selection
        needs = policy.attention if policy is not None else "none"
        if self.cache.defer_compression:
            # One prefill for many policies: keep every score they need, compress nothing (derived later).
            for key in (self.cache.score_keys if self.takes_selection else []):
                self._observe(query, keys, probabilities, key)
        elif needs != "none" and (not all(r.compressed for r in self.rows)
                                  or (needs in ("all", "last", "queries") and policy.decode_budget is not None)):
            # Compressed rows are scored again only under a decode budget: without one nothing ranks them again.
            self._observe(query, keys, probabilities, score_key(policy))
        if self.is_sliding:  # like the model's own sliding layer: keep only what the next query can still see
            self._trim_rows_to_window(self.rows, None)
        if self.cache.defer_compression:
            return
        rows = self.rows
        fresh = [b for b, row in enumerate(rows) if not row.compressed]
        evicted = []
        if policy is not None and policy.decode_budget is not None:
            # A row this forward gave no token (its sequence ended) keeps its cache, as alone (spared_rows).
            given = self.cache.input_counts(len(rows), query.shape[2])[0]
            for row, count in zip(rows, given):
                if row.compressed and count and row.store.length > policy.decode_limit:
                    self._evict_to(row, policy.decode_budget, protect_last=1)
                    evicted.append(row)
        seal_rows(evicted)
        if fresh:
            self.compress_rows([rows[b] for b in fresh], [self.cache.protected(b) for b in fresh])
            self._settle_compressed_rows()
            if self.layer_idx in self.cache.merged:  # the later layer of a merged pair (MiniCache)
                self.cache.merge_rows(self, fresh)

    def _observe(self, query, keys, probabilities: AttentionProbabilities, key: tuple) -> None:
        """Accumulate, per row, the attention mass each kept token received from the queries ``key`` names.

        ``key`` is a :func:`score_key`. The mass goes to ``row.attention``; in a
        deferred prefill, to ``row.scores[key]`` (and to ``row.attention`` too
        when it is the cache's own policy's key).

        The mass is averaged over the query heads that read each stored head:
        the GQA group of a KV head, or every head for a store with one shared
        head (MLA's latent), whose tokens are then kept or dropped for all heads at once.
        """
        needs = key[0]
        if needs == "queries":  # the queries themselves, per row: its real columns (a prefill's)
            real = self.cache.input_real(query.shape[0], query.shape[2], query.device)
            recent = self.selection.kept_queries if self.selection is not None else None
            for b, row in enumerate(self.rows):
                queries, positions = query[b][:, real[b]], self._query_positions[b][real[b]]
                if recent is not None:  # a window of the most recent queries, this forward's appended
                    if row.queries is not None:
                        queries = torch.cat([row.queries, queries], dim=1)
                        positions = torch.cat([row.query_positions, positions])
                    queries, positions = queries[:, -recent:], positions[-recent:]
                row.queries, row.query_positions = queries, positions
            return
        mass = self._mass(query, keys, probabilities, key)
        deferred, own = self.cache.defer_compression, score_key(self.selection)
        for b, row in enumerate(self.rows):
            n = row.store.length
            row_mass = mass[b, :, :n]  # the buffer holds row b's tokens in its first n slots
            before = (row.scores or {}).get(key) if deferred else row.attention
            if needs == "all" and before is not None:
                row_mass = torch.nn.functional.pad(before, (0, n - before.shape[1])) + row_mass
            if deferred:
                row.scores = {**(row.scores or {}), key: row_mass}
            if not deferred or key == own:
                row.attention = row_mass

    def _mass(self, query, keys, probabilities: AttentionProbabilities, key: tuple) -> torch.Tensor:
        """``[B, stored heads, slots]``: the attention mass each slot received from this forward's queries that
        ``key`` names, summed over them, averaged over the query heads reading each stored head (0 on padding)."""
        needs, window = key
        q_len = query.shape[2]
        real = self.cache.input_real(query.shape[0], q_len, query.device)
        all_real = self.cache.input_counts(query.shape[0], q_len)[1]
        if needs == "window":
            first = max(0, q_len - window)
        elif needs == "last":
            first = q_len - 1
        else:
            first = 0

        def allowed(start: int, stop: int) -> torch.Tensor:
            if start == 0 and stop == q_len and self._mask is not None:
                return self._mask
            return self.allowed_mask(self._query_positions[:, start:stop])

        return attention_mass(probabilities, query, keys, real, all_real, first, self._slot_positions.shape[1], allowed)

    def scoring_state(self, row: RowState, seed: int, reads_keys: bool = True, reads_values: bool = False) -> ScoringState:
        """What a policy scores ``row`` on; its keys only where the policy may read them (``reads_keys``: else
        ``None``, and the row's keys and values are not copied to the compute dtype for nothing), its values only
        where it declares it reads them (``reads_values``)."""
        keys, values = row.store.keys_values() if reads_keys or reads_values else (None, None)
        padding = row.padding
        positions = row.positions if padding is None else row.positions.masked_fill(padding, -1)
        return ScoringState(keys=keys if reads_keys else None, positions=positions, attention=row.attention,
                            layer_idx=self.layer_idx, num_layers=self.cache.num_layers, seed=seed,
                            model=self.cache.model, values=values if reads_values else None, queries=row.queries,
                            query_positions=row.query_positions)

    def _scores(self, row: RowState, policy) -> tuple[torch.Tensor, ScoringState]:
        """The policy's scores of ``row`` (``-inf`` on padding slots, a fresh tensor) and the state they came from."""
        # Policies whose scores stack across layers read positions and attention alone (never keys).
        state = self.scoring_state(row, self.cache.seed_for(self.rows.index(row)), not policy.scores_stack_layers,
                                   policy.reads_values)
        scores = policy.scores(state).clone()
        scores = shared_by_group(scores, row.store)
        padding = row.padding
        if padding is not None:
            scores[padding] = float("-inf")
        return scores, state

    def compress_rows(self, rows: list[RowState], protect_last: list[int], policy=None) -> None:
        """Prefill compression of ``rows``: each keeps the selection's budget of context tokens (its last
        ``protect_last[i]`` tokens always), then their stores seal together (:func:`seal_rows`)."""
        policy = policy or self.selection
        if policy is not None:
            for row, protect in zip(rows, protect_last):
                self._keep_budget(row, protect, policy)
        seal_rows(rows)
        rescored = policy is not None and policy.decode_budget is not None
        for row in rows:
            row.compressed = True
            if not (rescored and policy.kept_queries is not None):  # else the recent queries score the decode budget
                row.queries = row.query_positions = None
            if not rescored and not self.cache.defer_compression:
                row.attention = None  # no decode budget: these scores rank nothing again
        self._decode = None

    def _keep_budget(self, row: RowState, protect_last: int, policy) -> None:
        """Keep ``policy``'s budget of ``row``'s context tokens, and its last ``protect_last`` tokens."""
        n = row.store.length
        candidates = n - min(protect_last, n)
        keep = policy.keep_count(candidates, self.layer_idx, self.cache.num_layers)
        if keep < candidates or ((policy.thresholded or policy.reconstructs) and candidates):
            scores, state = self._scores(row, policy)
            chosen = policy.choose(scores[:, :candidates], keep, state)
            protected = torch.arange(candidates, n, device=scores.device)
            if isinstance(chosen, list):
                chosen = [torch.cat([c, protected]) for c in chosen]
            else:
                chosen = torch.cat([chosen, protected.expand(chosen.shape[0], -1)], dim=1)
            self._select(row, chosen)

    def _evict_to(self, row: RowState, budget: int, protect_last: int) -> None:
        """Decode phase: keep the ``budget`` best-scored tokens (the newest ``protect_last`` always), ranked stably as
        the batched decode ranks them (:func:`~kveval.tensors.ranking.best_first`); the caller seals."""
        n = row.store.length
        scores, state = self._scores(row, self.selection)
        scores[:, n - protect_last:] = float("inf")
        self._select(row, self.selection.choose(scores, budget, state, stable=True))


__all__ = ["LayerCompression", "score_key", "shared_by_group"]
