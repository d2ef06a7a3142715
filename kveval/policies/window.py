"""Sliding window and StreamingLLM: keep the most recent tokens (and the first few).

Positions (RoPE): kveval keeps every token's *original* position. Keys are
cached after RoPE, so an evicted gap simply disappears from attention; new
tokens get the next position of the uncompressed sequence (their distance to a
kept token is its true distance). StreamingLLM (Xiao et al. 2024) instead
re-assigns positions inside the cache so that generation can run past the
trained context length; kveval evaluates quality *within* the trained length,
where original positions are the faithful choice (as in kvpress).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.base import Placement, SelectionPolicy, check_ratio, ratio_keep_count
from kveval.tensors.scoring_state import ScoringState

DEFAULT_WINDOW_SIZE = 256
DEFAULT_STREAMING_WINDOW = 252


@dataclass
class WindowPolicy(SelectionPolicy):
    """Keep the most recent tokens.

    With ``size`` the cache keeps the ``size`` most recent tokens at prefill and
    after every decoding step. With ``ratio`` (as every selection policy) the
    prefill keeps the most recent ``ceil((1 - ratio) * n)`` of its ``n`` context
    tokens and the cache then grows while decoding.

    Attributes
    ----------
    size : int, optional
        Tokens kept per layer (and per sequence); 256 unless ``ratio`` is given.
    ratio : float, optional
        Fraction of context KV pairs removed at prefill, ``0 <= ratio < 1``.
    """

    name = "window"
    #: Scores by position alone: on DeepSeek's own caches it keeps the same tokens in every layer, and entries alike.
    placements = frozenset({Placement.LATENT, Placement.SAME_TOKENS_EVERY_LAYER, Placement.ENTRIES})
    description = "sliding window: keep the `size` most recent tokens (or drop the fraction `ratio` at prefill)"
    size: int | None = None
    ratio: float | None = None

    def __post_init__(self):
        if self.size is not None and self.ratio is not None:
            raise PolicySpecError("window: give size= (tokens kept) or ratio= (fraction of context removed), not both")
        check_ratio(self.name, self.ratio)
        if self.ratio is None and self.size is None:
            self.size = DEFAULT_WINDOW_SIZE
        if self.size is not None and self.size < 1:
            raise PolicySpecError(f"window: size={self.size!r} must be a positive number of tokens")

    @property
    def decode_budget(self) -> int | None:
        return self.size

    batch_scores: ClassVar[bool] = True
    scores_stack_layers: ClassVar[bool] = True

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        if self.ratio is not None:
            return ratio_keep_count(self.ratio, n_tokens)
        return min(self.size, n_tokens)

    def scores(self, state: ScoringState) -> torch.Tensor:
        return state.positions.float()


class SinkWindowPolicy(SelectionPolicy):
    """Base of the policies that keep the first ``sink`` tokens plus the ``window`` most recent.

    Subclasses are dataclasses declaring the fields ``sink`` (int, tokens),
    ``window`` (int or ``None``: :attr:`default_window`) and ``ratio`` (float or
    ``None``); give ``window`` or ``ratio``, not both. With ``ratio`` the prefill
    keeps ``ceil((1 - ratio) x n)`` of its ``n`` context tokens and the cache then
    grows while decoding; otherwise it holds ``sink + window`` after every step.
    """

    default_window: ClassVar[int]
    batch_scores: ClassVar[bool] = True
    scores_stack_layers: ClassVar[bool] = True

    def check_sink_window(self) -> None:
        """Validate ``sink``/``window``/``ratio``; store the default window as ``None`` (one canonical spec)."""
        if self.window is not None and self.ratio is not None:
            raise PolicySpecError(f"{self.name}: give window= (recent tokens kept) or ratio= (fraction of context removed), not both")
        check_ratio(self.name, self.ratio)
        if self.sink < 0:
            raise PolicySpecError(f"{self.name}: sink={self.sink!r} must be a number of tokens >= 0")
        if self.window is not None and self.window < 1:
            raise PolicySpecError(f"{self.name}: window={self.window!r} must be a positive number of tokens")
        if self.window == self.default_window:
            self.window = None

    @property
    def recent(self) -> int | None:
        """Most recent tokens kept after every step (``None`` with ``ratio``)."""
        if self.ratio is not None:
            return None
        return self.window if self.window is not None else self.default_window

    @property
    def decode_budget(self) -> int | None:
        """Tokens held while decoding, ``sink + recent`` (``None`` with ``ratio``: the cache grows)."""
        return None if self.ratio is not None else self.sink + self.recent

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        if self.ratio is not None:
            return ratio_keep_count(self.ratio, n_tokens)
        return min(self.sink + self.recent, n_tokens)

    def scores(self, state: ScoringState) -> torch.Tensor:
        return sink_recency_scores(state.positions, self.sink)


@dataclass
class StreamingPolicy(SinkWindowPolicy):
    """StreamingLLM (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks").

    Keep the first ``sink`` tokens (attention sinks) plus the most recent ones.
    With ``window``, the ``window`` most recent, at prefill and after every
    decoding step. With ``ratio``, as kvpress's ``StreamingLLMPress``: the
    prefill keeps the first ``sink`` tokens plus the most recent
    ``keep - sink``, where ``keep = ceil((1 - ratio) * n)`` of its ``n`` context
    tokens (kvpress rounds down; kveval rounds up for every selection policy,
    so all of them keep the same count at one ratio); the cache then grows
    while decoding, as kvpress presses only the prefill.

    Attributes
    ----------
    sink : int
        Initial tokens always kept.
    window : int, optional
        Most recent tokens kept; 252 unless ``ratio`` is given.
    ratio : float, optional
        Fraction of context KV pairs removed at prefill, ``0 <= ratio < 1``.
    """

    name = "streaming"
    #: Scores by position alone: on DeepSeek's own caches it keeps the same tokens in every layer, and entries alike.
    placements = frozenset({Placement.LATENT, Placement.SAME_TOKENS_EVERY_LAYER, Placement.ENTRIES})
    description = "StreamingLLM: the first `sink` tokens plus the `window` most recent (or drop the fraction `ratio`)"
    default_window: ClassVar[int] = DEFAULT_STREAMING_WINDOW  # the default spec streaming(sink=4) keeps 256
    sink: int = 4
    window: int | None = None
    ratio: float | None = None

    def __post_init__(self):
        self.check_sink_window()


def sink_recency_scores(positions: torch.Tensor, sink: int) -> torch.Tensor:
    """StreamingLLM's order: the first ``sink`` positions outrank everything; among the rest, recency decides.

    Negative positions (padding slots of per-head budgets) rank lowest. Over a batch (``[rows, heads, tokens]``)
    the sinks' offset is the batch's largest position, which ranks each row's tokens as the row's own would.
    """
    positions = positions.float()
    return torch.where((positions >= 0) & (positions < sink), positions.max() + 1 + positions, positions)
