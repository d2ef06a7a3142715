"""TOVA: keep the tokens the most recent query attends to."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.policies.base import RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState


@dataclass
class TOVAPolicy(RatioSelectionPolicy):
    """TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs").

    Scores are the attention of the most recent query only: at prefill the last
    prompt token, while decoding the newest token, so with ``decode_budget``
    the lowest-scored token is dropped at every step. As in the paper, the
    attention is averaged over all heads of the layer, so every KV head keeps
    the same tokens.
    """

    name = "tova"
    description = "TOVA: keep tokens the most recent query attends to (head-averaged)"
    attention = "last"
    head_shared_scores = True
    batch_scores = True
    scores_stack_layers = True

    def scores(self, state: ScoringState) -> torch.Tensor:
        return state.attention.mean(dim=-2, keepdim=True).expand_as(state.attention)
