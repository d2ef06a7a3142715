"""The model's own lightning indexer as the scorer: DeepSeek V4's CSA entries ranked by what its indexer picks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.base import Placement, SelectionPolicy, check_ratio, ratio_keep_count
from kveval.tensors.scoring_state import ScoringState


@dataclass
class IndexerPolicy(SelectionPolicy):
    """Evict DeepSeek V4's compressed CSA entries by the model's own lightning indexer (the DeepSeek-V4 report,
    §2.3.1, as transformers' ``DeepseekV4Indexer`` runs it: the scorer that picks each query's top-k entries).

    At the prefill, the last ``window`` queries' index scores ``sum_h w_(t,h) ReLU(q_(t,h) . K_s)`` over the entries
    each may see (entry ``s`` when ``s < (t + 1) // rate``) are turned into a distribution per query (softmax over
    those entries) and summed: an entry's score is the indexer's share of attention it would get from the end of
    the prompt, as SnapKV sums attention from its last queries. Each CSA layer keeps the best
    ``ceil((1 - ratio) x n)`` of its ``n`` entries made by the context (an entry's indexer key with it); HCA layers,
    which have no indexer, keep theirs, and the sliding window stays as the model defines it. Only on DeepSeek V4:
    elsewhere it is refused in one line.

    Attributes
    ----------
    ratio : float
        Fraction of each CSA layer's context entries removed, ``0 <= ratio < 1``.
    window : int
        Prefill queries (tokens) whose index scores rank the entries; 32 (8 CSA windows of 4 tokens).
    """

    name = "indexer"
    placements = frozenset({Placement.ENTRIES})  # V4's CSA entries, by the model's own indexer scores
    description = "DeepSeek V4: evict CSA entries by the model's own lightning indexer (last `window` queries)"
    attention: ClassVar[str] = "indexer"
    supports_decode_budget: ClassVar[bool] = False
    ratio: float = 0.5
    window: int = 32

    def __post_init__(self):
        check_ratio(self.name, self.ratio)
        if self.window < 1:
            raise PolicySpecError(f"{self.name}: window={self.window!r} must be a positive number of prefill queries")

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        return ratio_keep_count(self.ratio, n_tokens)

    def scores(self, state: ScoringState) -> torch.Tensor:
        """The indexer's summed shares (``state.attention``, gathered by the V4 cache layer), ``[1, entries]``."""
        return state.attention.float()


def index_shares(scores: torch.Tensor, positions: torch.Tensor, rate: int, window: int) -> torch.Tensor:
    """Each entry's summed share of the last ``window`` queries' indexer distribution.

    ``scores``: the indexer's ``[B, q, entries]`` scores for one forward; ``positions``: its queries' positions
    ``[B, q]``; ``rate``: tokens per entry. A query at position ``t`` sees entry ``s`` when ``s < (t + 1) // rate``
    (the model's own rule); a query that sees none adds nothing. Returns ``[B, entries]``.
    """
    scores, positions = scores[:, -window:].float(), positions[:, -window:]
    visible = (torch.arange(scores.shape[-1], device=scores.device)[None, None, :]
               < ((positions + 1) // rate)[..., None])
    shares = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.nan_to_num(shares, nan=0.0).sum(dim=1)
