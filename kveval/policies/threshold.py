"""Threshold eviction (DMS / KVzap style): keep every KV pair whose score clears a threshold, whatever ratio that gives."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.base import SelectionPolicy, ratio_keep_count
from kveval.policies.cur import CURPolicy
from kveval.policies.keydiff import KeyDiffPolicy
from kveval.policies.knorm import KnormPolicy
from kveval.policies.lagkv import LagKVPolicy
from kveval.tensors.scoring_state import ScoringState

#: Scorers a threshold may read: policies scoring from keys (and values) alone, no attention, no hub weights.
SCORERS = {"knorm": KnormPolicy, "keydiff": KeyDiffPolicy, "cur": CURPolicy, "lagkv": LagKVPolicy}


@dataclass
class ThresholdPolicy(SelectionPolicy):
    """Keep what scores above ``threshold`` (after DMS, Łańcucki et al. 2025, and KVzap, NVIDIA 2026; as kvpress's
    ``DMSPress`` wraps a scorer press, dense prefill).

    Each KV head keeps every context token whose ``scorer`` score (that policy's own scale: ``keydiff`` minus a
    cosine in [-1, 1], ``knorm`` minus the key's L2 norm, ``cur`` a leverage that sums to 1 over the head, ``lagkv``
    a rank in [0, 1)) is above ``threshold``, plus its last ``window`` tokens (DMS's sliding window), and at least
    its best token. Heads keep different counts (stored apart, measured exactly), and the ratio reached differs
    per item: runs record it per item (``achieved_ratio``) and its spread in ``run.json``; the leaderboard shows
    ``~mean [min-max]``, and the planner sizes the policy at a run's achieved ratio. KVzap's and DMS's trained
    scorers need hub weights and are not offered; these scorers need none. Prefill only.

    Attributes
    ----------
    scorer : str
        One of ``knorm``, ``keydiff``, ``cur``, ``lagkv``, at its default parameters.
    threshold : float
        Tokens scoring at or below it are evicted (kvpress evicts below; equal scores go here).
    window : int
        Newest context tokens always kept (kvpress's ``sliding_window_size``, 128).
    """

    name = "threshold"
    description = "threshold: keep what a key/value scorer rates above `threshold` (DMS/KVzap style); ratio varies per item"
    supports_decode_budget = False
    thresholded = True
    scorer: str = "keydiff"
    threshold: float = 0.0
    window: int = 128

    def __post_init__(self):
        if self.scorer not in SCORERS:
            raise PolicySpecError(f"threshold: scorer={self.scorer!r} is not one of {', '.join(SCORERS)} "
                                  f"(scorers that read keys and values alone)")
        if self.window < 0:
            raise PolicySpecError(f"threshold: window={self.window} must be a number of tokens >= 0")
        self._scorer = SCORERS[self.scorer](ratio=0.0)
        self.reads_values = self._scorer.reads_values

    @property
    def per_head_budgets(self) -> bool:
        return True

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        """Every token is a candidate: the threshold, not a count, decides (:meth:`choose`)."""
        return n_tokens

    def planned_keep(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1,
                     achieved_ratio: float | None = None) -> int:
        """Tokens the planner sizes a layer of ``n_tokens`` context tokens at: a run's achieved ratio (measured, not
        asked for: the deployment decision reads it from run.json), or a refusal."""
        if achieved_ratio is None:
            raise PolicySpecError(f"{self.spec()}: a threshold's kept count depends on the scores; plan it at a run's "
                                  f"achieved ratio (the deployment gate reads it from run.json), or plan a ratio policy")
        return ratio_keep_count(achieved_ratio, n_tokens)

    def scores(self, state: ScoringState) -> torch.Tensor:
        return self._scorer.scores(state)

    def choose(self, scores: torch.Tensor, keep: int, state: ScoringState, stable: bool = False) -> list[torch.Tensor]:
        n = scores.shape[-1]
        kept = scores > self.threshold
        kept[:, max(0, n - self.window):] = True
        kept[torch.arange(scores.shape[0]), scores.argmax(dim=-1)] = True  # a head never holds nothing
        kept &= scores > float("-inf")  # padding slots
        return [row.nonzero().flatten() for row in kept]
