"""H2O: heavy hitters plus recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.base import RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState


@dataclass
class H2OPolicy(RatioSelectionPolicy):
    """H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs").

    A token's score is the attention it has accumulated from every query so
    far (prefill and decoding); the ``recent`` most recent tokens are always
    kept. Scores keep accumulating while decoding, so with ``decode_budget`` the
    cache keeps the heavy hitters of the whole generation.

    GQA/MQA: attention probabilities are averaged over the query heads that
    share a KV head, then summed over queries.

    Attributes
    ----------
    recent : int
        Most recent tokens always kept (part of the budget).
    mean : bool
        Rank by the *mean* attention a token received, its sum divided by the number of queries that could see it
        (``newest - position + 1`` under causal attention), as kvpress's ``ObservedAttentionPress`` does; the H2O
        paper (the default, ``false``) ranks by the sum, which favours early tokens.
    """

    name = "h2o"
    description = "H2O: keep tokens with the most accumulated attention plus a recent window"
    attention = "all"
    recent: int = 16
    mean: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.recent, int) or self.recent < 0:
            raise PolicySpecError(f"h2o: recent={self.recent!r} must be a number of tokens >= 0")

    batch_scores = True
    scores_stack_layers = True

    def scores(self, state: ScoringState) -> torch.Tensor:
        newest = state.positions.max(dim=-1, keepdim=True).values
        attention = state.attention
        if self.mean:
            attention = attention / (newest - state.positions + 1).clamp(min=1)
        return torch.where(state.positions > newest - self.recent, float("inf"), attention)
