"""PyramidKV: SnapKV scores with layer budgets that shrink with depth."""

import math
from dataclasses import dataclass

from kveval.errors import PolicySpecError
from kveval.policies.snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling").

    Lower layers attend broadly and keep more tokens; higher layers focus and
    keep fewer. Per-layer budgets fall linearly from the first to the last
    layer, the last layer keeping ``1 / beta`` of the average budget, so the
    total over layers equals what ``ratio`` (or ``budget``) gives every layer
    under SnapKV. Scores are SnapKV's (observation window, pooling, per KV head).

    Attributes
    ----------
    beta : float
        Average budget / last layer's budget (> 1; larger = steeper pyramid).
    """

    name = "pyramidkv"
    description = "PyramidKV: SnapKV scores, budgets shrinking linearly with depth (same total)"
    beta: float = 20.0

    def __post_init__(self):
        super().__post_init__()
        if not self.beta > 1:
            raise PolicySpecError(f"pyramidkv: beta={self.beta!r} must be > 1")

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        average = super().keep_count(n_tokens, layer_idx, num_layers)
        if num_layers == 1 or average >= n_tokens:  # nothing to move between layers
            return average
        smallest = average / self.beta
        largest = 2 * average - smallest
        budget = largest - (largest - smallest) * layer_idx / (num_layers - 1)
        return max(1, min(n_tokens, math.ceil(budget)))
