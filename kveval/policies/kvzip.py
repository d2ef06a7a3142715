"""KVzip: score each context KV pair by the attention it receives while the model repeats the context.

The rule is kvpress 0.5.5's ``KVzipPress`` (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with
Context Reconstruction"). The reconstruction forwards are run by :mod:`kveval.cache.reconstruction` between the
context's prefill and its compression; this module holds the policy and its two pure steps, the score of one
reconstruction forward in one layer (:func:`reconstruction_scores`) and the budget over every layer at once
(:func:`kvzip_keep`), each testable on tensors alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError, UnsupportedModelError, UsageError
from kveval.policies.base import SelectionPolicy, check_ratio, ratio_keep_count
from kveval.tensors.scoring_state import ScoringState


@dataclass
class KVzipPolicy(SelectionPolicy):
    """KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"), as
    kvpress 0.5.5's ``KVzipPress``.

    After the context's prefill, the model is made to repeat it: for each chunk of up to ``chunk`` context tokens
    (after the chat template's head), a forward over the uncompressed cache feeds ``"\\n\\nRepeat the previous
    context exactly."`` (later chunks: ``"\\n\\nRepeat the part of the previous context exactly, starting with"`` and
    the previous chunk's last 8 tokens), the chat template's assistant turn, then the chunk itself. None of those
    tokens is kept. A context token's score, per KV head, is the largest attention probability any of those
    queries, from any query head of the KV head's group, gives it; the softmax runs over the first ``sink`` tokens,
    the chunk and the reconstruction tokens only (causal among the latter). The first ``sink`` tokens always stay;
    the chat template's head after them scores 0. Then ``int(ratio x slots)`` of the scored slots (tokens x KV heads)
    go, the lowest-scored over every selecting layer and head at once (``layerwise=false``, kvpress's default:
    layers and heads keep different counts, the total is the ratio), or within each layer (``layerwise=true``).
    Heads keep different counts (stored apart, measured exactly). Query-agnostic: ``--mode context`` only.
    The reconstruction costs about two to three prefills; the time to first token counts it.
    FastKVzip (trained gates from the hub) and KVzip+'s normalisation are not offered.

    Attributes
    ----------
    ratio : float
        Fraction of the context's KV pairs removed, over all layers and heads (``compression_ratio``).
    layerwise : bool
        The same fraction in every layer (kvpress's ``layerwise=True``) instead of one budget over all layers.
    sink : int
        First tokens always kept, and in every reconstruction softmax (``n_sink``).
    chunk : int
        Context tokens each reconstruction forward repeats (``chunk_size``).
    """

    name = "kvzip"
    description = ("KVzip (Kim et al. 2025; kvpress KVzipPress): keep the KV pairs the model attends to most while "
                   "repeating the context (one top-k over all layers)")
    supports_decode_budget = False
    reconstructs = True
    ratio: float | None = None
    layerwise: bool = False
    sink: int = 4
    chunk: int = 2048

    def __post_init__(self):
        if self.ratio is None:
            raise PolicySpecError("kvzip: give ratio= (fraction of the context's KV pairs removed, 0 <= ratio < 1)")
        check_ratio(self.name, self.ratio)
        if self.sink < 0:
            raise PolicySpecError(f"kvzip: sink={self.sink} must be a number of tokens >= 0")
        if self.chunk < 1:
            raise PolicySpecError(f"kvzip: chunk={self.chunk} must be a positive number of tokens")

    @property
    def per_head_budgets(self) -> bool:
        return True

    def mla_refusal(self, model_name: str) -> UnsupportedModelError:
        """The one-line refusal of a model that caches an MLA latent (checked on its config before the weights load,
        and by the cache): the reconstruction's queries do not meet a latent head for head."""
        return UnsupportedModelError(f"{self.spec()}: {model_name} caches an MLA latent, which the reconstruction's "
                                     f"queries do not meet head for head; use a policy that scores the cache itself, "
                                     f"e.g. knorm or snapkv")

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        """The mean over layers and heads (what the planner sizes): each layer's own count comes from the scores."""
        return ratio_keep_count(self.ratio, n_tokens)

    def scores(self, state: ScoringState) -> torch.Tensor:
        """The reconstruction's scores of this layer, ``-inf`` where the budget over all layers evicts."""
        if state.attention is None:
            raise UsageError(f"{self.spec()}: its scores come from the reconstruction forwards that "
                             f"kveval.runner.generation.generate runs after the prefill; this cache had none")
        return state.attention

    def choose(self, scores: torch.Tensor, keep: int, state: ScoringState, stable: bool = False) -> list[torch.Tensor]:
        """Each head keeps what :func:`kvzip_keep` kept (its finite scores), whatever ``keep`` says."""
        return [row.isfinite().nonzero().flatten() for row in scores]


def reconstruction_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float, chunk: torch.Tensor) -> torch.Tensor:
    """One reconstruction forward's scores of a chunk in one layer, as kvpress's ``score_kvzip``.

    ``query``: the reconstruction tokens' queries as attention reads them (after RoPE), ``[heads, q, d]``;
    ``keys``: ``[kv_heads, s + c + q, d]``, the first ``s`` tokens' keys (the sinks), the chunk's ``c`` and the ``q``
    reconstruction tokens' own (in order); ``chunk``: the columns of the chunk (``s .. s + c``). Returns
    ``[kv_heads, c]``: per KV head and chunk token, the largest softmax probability over every query and every query
    head of the group, the softmax taken over those ``s + c + q`` keys, causal among the last ``q``.
    """
    heads, q_len, d = query.shape
    kv_heads, width, _ = keys.shape
    group = heads // kv_heads
    q = query.float().reshape(kv_heads, group, q_len, d)
    logits = torch.einsum("hgqd,hkd->hgqk", q, keys.float()) * scaling
    own = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).triu(1)  # a query never sees a later one
    logits[..., width - q_len:] = logits[..., width - q_len:].masked_fill(own, float("-inf"))
    probabilities = logits.softmax(dim=-1)
    return probabilities[..., chunk].amax(dim=(1, 2))


def kvzip_keep(scores: list[torch.Tensor], positions: list[torch.Tensor], ratio: float, sink: int,
               layerwise: bool) -> list[torch.Tensor]:
    """Which slots each selecting layer keeps, as kvpress's ``compress_post``.

    ``scores[l]``: layer ``l``'s reconstruction scores ``[kv_heads, n_l]`` of its held slots, ``positions[l]`` their
    positions. Slots at positions below ``sink`` score the highest score plus 1 (kept first); then ``int(ratio x
    slots)`` slots are evicted, the lowest-scored over every layer at once, or ``int(ratio x slots of the layer)``
    within each layer (``layerwise``); a head left with nothing (only possible with ``sink=0``) keeps its best slot,
    where kvpress would mask its every context key. Returns per layer a boolean ``[kv_heads, n_l]`` of kept slots.
    """
    if not scores:
        return []
    top = max(float(s.max()) for s in scores if s.numel()) + 1.0 if any(s.numel() for s in scores) else 1.0
    scores = [s.float().masked_fill(p < sink, top) for s, p in zip(scores, positions)]
    kept = [torch.ones_like(s, dtype=torch.bool) for s in scores]
    if layerwise:
        for s, k in zip(scores, kept):
            pruned = int(s.numel() * ratio)
            k.view(-1)[torch.topk(-s.reshape(-1), pruned).indices] = False
    else:
        flat = torch.cat([s.reshape(-1) for s in scores])
        mask = torch.ones_like(flat, dtype=torch.bool)
        mask[torch.topk(-flat, int(flat.numel() * ratio)).indices] = False
        kept = list(torch.split(mask, [s.numel() for s in scores]))
        kept = [k.reshape(s.shape) for k, s in zip(kept, scores)]
    for s, k in zip(scores, kept):  # a head never holds nothing (only sink=0 could leave it so)
        empty = ~k.any(dim=-1)
        if bool(empty.any()):
            k[empty, s[empty].argmax(dim=-1)] = True
    return kept
