"""Random eviction: the control every selection policy must beat."""

from dataclasses import dataclass

import torch

from kveval.policies.base import RatioSelectionPolicy, ScoringState, register_policy


@register_policy
@dataclass
class RandomPolicy(RatioSelectionPolicy):
    """Keep a random subset of tokens, per KV head; reproducible for a given seed.

    The generator is seeded by ``seed``, the sequence's seed, the layer and
    the number of tokens held, so runs repeat exactly and decoding steps differ.
    """

    name = "random"
    description = "random eviction (seeded control)"
    seed: int = 0

    def scores(self, state: ScoringState) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash((self.seed, state.seed, state.layer_idx, state.keys.shape[1])) % 2**63)
        return torch.rand(state.keys.shape[:2], generator=generator).to(state.keys.device)
