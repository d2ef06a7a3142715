"""Sliding window and StreamingLLM: keep the most recent tokens (and the first few).

Positions (RoPE): kveval keeps every token's *original* position. Keys are
cached after RoPE, so an evicted gap simply disappears from attention; new
tokens get the next position of the uncompressed sequence (their distance to a
kept token is its true distance). StreamingLLM (Xiao et al. 2024) instead
re-assigns positions inside the cache so that generation can run past the
trained context length; kveval evaluates quality *within* the trained length,
where original positions are the faithful choice (as in kvpress).
"""

from dataclasses import dataclass

import torch

from kveval.policies.base import ScoringState, SelectionPolicy, register_policy


@register_policy
@dataclass
class WindowPolicy(SelectionPolicy):
    """Keep the ``size`` most recent tokens, at prefill and after every decoding step.

    Attributes
    ----------
    size : int
        Tokens kept per layer (and per sequence).
    """

    name = "window"
    description = "sliding window: keep the `size` most recent tokens"
    size: int = 256

    def __post_init__(self):
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"window: size={self.size!r} must be a positive number of tokens")

    @property
    def decode_budget(self) -> int:
        return self.size

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        return min(self.size, n_tokens)

    def scores(self, state: ScoringState) -> torch.Tensor:
        return state.positions.float()


@register_policy
@dataclass
class StreamingPolicy(SelectionPolicy):
    """StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks").

    Keep the first ``sink`` tokens (attention sinks) plus the ``window`` most
    recent ones, at prefill and after every decoding step.

    Attributes
    ----------
    sink : int
        Initial tokens always kept.
    window : int
        Most recent tokens kept.
    """

    name = "streaming"
    description = "StreamingLLM: the first `sink` tokens plus the `window` most recent"
    sink: int = 4
    window: int = 252

    def __post_init__(self):
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"streaming: sink={self.sink!r} must be a number of tokens >= 0")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"streaming: window={self.window!r} must be a positive number of tokens")

    @property
    def decode_budget(self) -> int:
        return self.sink + self.window

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        return min(self.sink + self.window, n_tokens)

    def scores(self, state: ScoringState) -> torch.Tensor:
        positions = state.positions.float()
        # Sinks outrank everything; among the rest, recency decides.
        return torch.where(positions < self.sink, positions.max() + 1 + positions, positions)
