"""Key-norm: drop the keys with the largest L2 norm."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.policies.base import Placement, RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState


@dataclass
class KnormPolicy(RatioSelectionPolicy):
    """Key-norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression").

    Keys with a low L2 norm attract high attention, so each KV head keeps its
    lowest-norm keys. Needs no attention scores (works with the fastest attention).
    """

    name = "knorm"
    #: Scores a key by itself: an MLA latent (for every head at once) or a V4 entry alike.
    placements = frozenset({Placement.LATENT, Placement.ENTRIES})
    description = "key-norm: drop the keys with the largest L2 norm, per KV head"

    batch_scores = True

    def scores(self, state: ScoringState) -> torch.Tensor:
        return -state.keys.float().norm(dim=-1)
