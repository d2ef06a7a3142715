"""SnapKV: score the context by the attention of an observation window of the last queries."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.base import RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState


@dataclass
class SnapKVPolicy(RatioSelectionPolicy):
    """SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

    Scores are the attention the last ``window`` queries of the prefill pay to
    each token, smoothed by pooling over ``kernel`` neighbouring tokens so that
    whole phrases survive; each KV head keeps its own top tokens. The
    observation window itself is always kept. In query-agnostic mode the
    window is the end of the context; in query-aware mode it is the question.

    GQA/MQA: attention probabilities are averaged over the query heads that
    share a KV head, then summed over the window's queries.

    Scores come from the prefill only, so ``decode_budget`` is not supported.

    Attributes
    ----------
    window : int
        Observation window: number of last prefill queries whose attention is used.
    kernel : int
        Pooling width in tokens (odd); 1 disables pooling.
    pooling : str
        ``"max"`` or ``"avg"``.
    """

    name = "snapkv"
    description = "SnapKV: keep tokens the last `window` queries attend to, pooled, per KV head"
    attention = "window"
    supports_decode_budget = False
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.window, int) or self.window < 1:
            raise PolicySpecError(f"{self.name}: window={self.window!r} must be a positive number of queries")
        if not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise PolicySpecError(f"{self.name}: kernel={self.kernel!r} must be a positive odd number of tokens")
        if self.pooling not in ("max", "avg"):
            raise PolicySpecError(f"{self.name}: pooling={self.pooling!r} must be max or avg")

    def scores(self, state: ScoringState) -> torch.Tensor:
        scores = state.attention.unsqueeze(0)
        if self.kernel > 1:
            pool = torch.nn.functional.max_pool1d if self.pooling == "max" else torch.nn.functional.avg_pool1d
            scores = pool(scores, self.kernel, stride=1, padding=self.kernel // 2)
        scores = scores.squeeze(0).clone()
        scores[:, -self.window:] = float("inf")
        return scores
