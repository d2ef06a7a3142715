"""Expected Attention: score each key by the attention future queries are expected to pay it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError, UnsupportedModelError
from kveval.modeling.rope import rope_hook
from kveval.policies.base import RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState


@dataclass
class ExpectedAttentionPolicy(RatioSelectionPolicy):
    """Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from
    Future Queries Distribution"), as kvpress's ``ExpectedAttentionPress``.

    The prefill's queries (after the first ``sink``) are taken back before RoPE; their mean ``mu`` and covariance
    ``S`` per query head are moved by the mean RoPE rotation ``R`` of the next ``future`` positions (after the
    context). A key's score is ``softmax_k(k . R mu / sqrt(d) + k^T R S R^T k / 2d)`` over the non-sink keys (the
    expected ``exp(q . k / sqrt(d))`` of a Gaussian query, normalised), averaged over the query heads sharing the KV
    head, times the value's L2 norm (``vnorm``) after adding ``epsilon``. The ``sink`` first tokens always stay.
    Query-agnostic: no question is needed. Declares ``attention = "queries"``: the cache hands it the prefill's
    queries, and it prefills alone (a shared prefill keeps attention mass, not queries).

    Models kveval has no RoPE hook for (no RoPE, or another layout: kveval/modeling/architectures.py
    ``ROTATE_HALF_ROPE``) take the statistics of the queries as attention reads them, with no rotation: the rule
    for a position-free attention. An MLA cache (a latent, not per-head keys) is refused.

    Attributes
    ----------
    future : int
        Future positions whose RoPE rotations are averaged (kvpress's ``n_future_positions``).
    sink : int
        First tokens always kept and left out of the statistics and of the softmax (``n_sink``).
    covariance : bool
        Use the covariance term (``use_covariance``).
    vnorm : bool
        Rescale by the value norm (``use_vnorm``).
    epsilon : float
        Added to the scores before the value-norm rescaling.
    """

    name = "expected_attention"
    description = "Expected Attention: keep keys future queries (Gaussian, RoPE-averaged) are expected to attend to"
    attention = "queries"
    supports_decode_budget = False
    reads_values = True
    future: int = 512
    sink: int = 4
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.future < 1:
            raise PolicySpecError(f"expected_attention: future={self.future} must be a positive number of positions")
        if self.sink < 0:
            raise PolicySpecError(f"expected_attention: sink={self.sink} must be a number of tokens >= 0")

    def scores(self, state: ScoringState) -> torch.Tensor:
        keys, values, queries = state.keys.float(), state.values.float(), state.queries.float()
        kv_heads, n, d = keys.shape
        heads = queries.shape[0]
        if queries.shape[-1] != d or heads % kv_heads:
            raise UnsupportedModelError(f"{self.spec()}: the queries ({heads} heads x {queries.shape[-1]}) do not meet "
                                        f"the cached keys ({kv_heads} x {d}) head for head (an MLA latent cache); "
                                        f"use a policy that scores the cache itself, e.g. knorm or snapkv")
        sink = min(self.sink, n - 1)
        mu, cov = query_statistics(queries, state.query_positions, state.model, state.layer_idx, sink, self.future,
                                   d, self.covariance)
        group = heads // kv_heads
        k = keys[:, sink:].repeat_interleave(group, dim=0)  # [heads, n - sink, d]
        logits = torch.einsum("hnd,hd->hn", k, mu) / math.sqrt(d)
        if cov is not None:
            logits = logits + torch.einsum("hni,hij,hnj->hn", k, cov, k) / d / 2
        scores = logits.softmax(dim=-1).reshape(kv_heads, group, -1).mean(dim=1)
        if self.vnorm:
            scores = (scores + self.epsilon) * values[:, sink:].norm(dim=-1)
        return torch.cat([torch.full((kv_heads, sink), float("inf"), device=scores.device), scores], dim=-1)


def query_statistics(queries: torch.Tensor, positions: torch.Tensor, model, layer_idx: int, sink: int, future: int,
                     width: int, covariance: bool) -> "tuple[torch.Tensor, torch.Tensor | None]":
    """Mean ``[heads, d]`` and covariance ``[heads, d, d]`` (or ``None``) of ``queries`` (``[heads, n, d]``, after
    RoPE at ``positions``, ``[n]``) from the ``sink``-th on, taken before RoPE and moved by the mean rotation of the
    ``future`` positions after the last: ``R mu`` and ``R S R^T``. Unrotated where the model has no RoPE hook or the
    queries are not ``width`` wide."""
    heads, n, d = queries.shape
    hook = None
    if d == width and model is not None:
        try:
            hook = rope_hook(model, layer_idx)
        except UnsupportedModelError:
            hook = None
    if hook is not None:
        queries = hook.unrotate(queries, positions.expand(heads, -1))
    tail = queries[:, sink:]
    mu = tail.mean(dim=1)
    cov = None
    if covariance:
        centered = tail - mu[:, None]
        cov = torch.einsum("hni,hnj->hij", centered, centered) / tail.shape[1]
    if hook is None:
        return mu, cov
    start = int(positions.max()) + 1
    ahead = torch.arange(start, start + future, device=queries.device)
    basis = torch.eye(d, device=queries.device)[None].expand(future, d, d)  # row i: e_i, rotated at each position
    rotation = hook.rotate(basis, ahead[:, None].expand(future, d)).mean(dim=0).T  # mean of R(p): column i is R e_i
    mu = mu @ rotation.T
    if cov is not None:
        cov = rotation @ cov @ rotation.T
    return mu, cov
