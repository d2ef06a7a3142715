"""LagKV: score each partition of the context against the next one, from keys and values alone."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.base import RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState


@dataclass
class LagKVPolicy(RatioSelectionPolicy):
    """LagKV (Liang et al. 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important").

    After ``sink`` tokens, the context is cut into partitions of ``lag`` tokens. Each partition's keys (and values)
    are min-max normalised per channel by the range of the *next* partition, the lag reference; a token's score is
    the standard deviation over channels of that normalised vector, softmaxed within its partition, keys' and
    values' scores averaged, then ranked within the partition (rank / ``lag``), so every partition keeps the same
    share. The sinks and the last partition (plus the remainder), which have no reference, always stay. A context
    shorter than ``sink + 2 x lag`` falls back to recency, as kvpress's ``LagKVPress`` does. Per KV head; reads
    keys and values, no attention.

    Attributes
    ----------
    sink : int
        First tokens always kept.
    lag : int
        Partition size in tokens.
    """

    name = "lagkv"
    description = "LagKV: score partitions by keys/values normalised by the next partition's range, per KV head"
    supports_decode_budget = False
    reads_values = True
    sink: int = 4
    lag: int = 128

    def __post_init__(self):
        super().__post_init__()
        if self.sink < 0:
            raise PolicySpecError(f"lagkv: sink={self.sink} must be a number of tokens >= 0")
        if self.lag < 1:
            raise PolicySpecError(f"lagkv: lag={self.lag} must be a positive number of tokens")

    def scores(self, state: ScoringState) -> torch.Tensor:
        keys, values = state.keys.float(), state.values.float()
        heads, n, _ = keys.shape
        sink, lag = min(self.sink, n), self.lag
        if n < self.sink + 2 * lag:  # too short for a reference: recency
            scores = torch.ones(heads, n, device=keys.device)
            scores[:, sink:] = torch.arange(n - sink, device=keys.device) / max(1, n - sink)
            return scores
        end = sink + (n - sink) // lag * lag
        score = (_partition_scores(keys[:, sink:end], lag) + _partition_scores(values[:, sink:end], lag)) / 2
        ranked = score.argsort(dim=-1).argsort(dim=-1).float() / lag
        ones = torch.ones(heads, 1, device=keys.device)
        return torch.cat([ones.expand(-1, sink), ranked.reshape(heads, -1), ones.expand(-1, n - end + lag)], dim=-1)


def _partition_scores(states: torch.Tensor, lag: int) -> torch.Tensor:
    """``[heads, partitions - 1, lag]``: each partition but the last normalised by the next one's per-channel range,
    its std over channels softmaxed within the partition."""
    heads, m, d = states.shape
    parts = states.reshape(heads, m // lag, lag, d)
    reference, scored = parts[:, 1:], parts[:, :-1]
    low, high = reference.amin(dim=-2, keepdim=True), reference.amax(dim=-2, keepdim=True)
    # A channel constant over the reference partition divides by zero in the reference's rule (NaN scores); kveval
    # divides by at least 1e-6 there, so such a channel adds its distance from the constant, scaled.
    return ((scored - low) / (high - low).clamp(min=1e-6)).std(dim=-1).softmax(dim=-1)
