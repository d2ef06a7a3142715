"""CUR: keep the tokens with the largest approximate leverage scores of keys and values."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.base import RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState

LEVERAGE = ("key", "value", "kv_avg", "kv_product")


@dataclass
class CURPolicy(RatioSelectionPolicy):
    """CurDKV (Sengupta et al. 2025, "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition").

    A token's leverage is the squared L2 norm of its key (``k2``) and of its value (``v2``), each normalised to sum
    to 1 within consecutive blocks of ``local_window`` tokens (the local approximation); ``leverage`` combines them
    (``kv_product``: ``k2 * v2``, the default, as kvpress's ``CURPress``), then normalises over the head. The first
    ``sink`` tokens always stay. Per KV head; reads keys and values, no attention. The random-projection variant
    (kvpress's ``use_random_leverage``) is not offered: it draws an unseeded matrix.

    Attributes
    ----------
    sink : int
        First tokens always kept (attention sinks).
    leverage : str
        ``key``, ``value``, ``kv_avg`` (mean) or ``kv_product``.
    local_window : int
        Tokens per normalisation block; 0 normalises over the whole head instead.
    """

    name = "cur"
    description = "CurDKV: keep tokens with the largest key x value leverage (local blocks), per KV head"
    supports_decode_budget = False
    reads_values = True
    sink: int = 4
    leverage: str = "kv_product"
    local_window: int = 16

    def __post_init__(self):
        super().__post_init__()
        if self.sink < 0:
            raise PolicySpecError(f"cur: sink={self.sink} must be a number of tokens >= 0")
        if self.leverage not in LEVERAGE:
            raise PolicySpecError(f"cur: leverage={self.leverage!r} must be one of {', '.join(LEVERAGE)}")
        if self.local_window < 0:
            raise PolicySpecError(f"cur: local_window={self.local_window} must be >= 0 tokens (0: no local blocks)")

    def scores(self, state: ScoringState) -> torch.Tensor:
        k2 = _local(state.keys.float().square().sum(dim=-1), self.local_window)
        v2 = _local(state.values.float().square().sum(dim=-1), self.local_window)
        scores = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[self.leverage]
        scores = scores / scores.sum(dim=-1, keepdim=True)
        scores[..., :self.sink] = float("inf")
        return scores


def _local(norms: torch.Tensor, window: int) -> torch.Tensor:
    """``norms`` (``[heads, n]``) divided by their sum over each block of ``window`` consecutive tokens."""
    if not window:
        return norms
    n = norms.shape[-1]
    padded = torch.nn.functional.pad(norms, (0, (window - n % window) % window)).reshape(*norms.shape[:-1], -1, window)
    return (padded / padded.sum(dim=-1, keepdim=True)).reshape(*norms.shape[:-1], -1)[..., :n]
