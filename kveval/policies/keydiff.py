"""KeyDiff: keep the keys least like the layer's average key direction."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.policies.base import RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState


@dataclass
class KeyDiffPolicy(RatioSelectionPolicy):
    """KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference").

    A token's score is minus the cosine similarity of its key to the anchor, the mean of the head's unit-normalised
    keys: distinctive keys stay, keys that point where most keys point go. Needs no attention (works with the
    fastest kernels), per KV head. As kvpress's ``KeyDiffPress`` scores the whole prefill at once; the paper's
    block-wise iterative eviction (kvpress's ``BlockPress``) is not done. Scores come from the prefill only.
    """

    name = "keydiff"
    description = "KeyDiff: drop keys most similar to the mean key direction, per KV head"
    supports_decode_budget = False

    def scores(self, state: ScoringState) -> torch.Tensor:
        keys = state.keys.float()
        anchor = torch.nn.functional.normalize(keys, p=2, dim=-1).mean(dim=-2, keepdim=True)
        return -torch.nn.functional.cosine_similarity(keys, anchor, dim=-1)
