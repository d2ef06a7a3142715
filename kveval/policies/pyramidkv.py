"""PyramidKV: SnapKV scores with layer budgets that shrink with depth."""

from __future__ import annotations

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
    schedule : str
        ``paper`` (the default: the formula above, the total held exactly) or ``kvpress``, KVCache-Factory's
        schedule as kvpress's ``PyramidKVPress`` runs it: from ``2 x average - average / beta`` down to
        ``average / beta``, but the first layer keeps at most ``n - window`` (the last then ``2 x average`` less
        that), each layer's count rounded, and every layer the average where the last would keep fewer than
        ``window``.
    """

    name = "pyramidkv"
    description = "PyramidKV: SnapKV scores, budgets shrinking linearly with depth (same total)"
    beta: float = 20.0
    schedule: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        if not self.beta > 1:
            raise PolicySpecError(f"pyramidkv: beta={self.beta!r} must be > 1")
        if self.schedule not in ("paper", "kvpress"):
            raise PolicySpecError(f"pyramidkv: schedule={self.schedule!r} must be paper or kvpress")

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        if self.schedule == "kvpress":
            return self._kvpress_count(n_tokens, layer_idx, num_layers)
        average = super().keep_count(n_tokens, layer_idx, num_layers)
        if num_layers == 1 or average >= n_tokens:  # nothing to move between layers
            return average
        smallest = average / self.beta
        largest = 2 * average - smallest
        budget = largest - (largest - smallest) * layer_idx / (num_layers - 1)
        return max(1, min(n_tokens, math.ceil(budget)))

    def _kvpress_count(self, n: int, layer_idx: int, num_layers: int) -> int:
        """``PyramidKVPress.get_layer_budget`` (kvpress 0.5.5), the average being ``(1 - ratio) x n`` (or ``budget``)."""
        average = (1 - self.ratio) * n if self.budget is None else min(self.budget, n)
        smallest = average / self.beta
        largest = 2 * average - smallest
        if largest >= n - self.window:
            largest = n - self.window
            smallest = 2 * average - largest
        if not n >= largest >= smallest >= self.window:
            return max(1, min(n, round(average)))
        steps = (largest - smallest) / (num_layers - 1) if num_layers > 1 else 0.0
        return max(1, min(n, round(largest - layer_idx * steps)))
