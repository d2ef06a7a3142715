"""ChunkKV: SnapKV scores pooled into chunks of consecutive tokens, whole chunks kept."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.snapkv import SnapKVPolicy
from kveval.tensors.ranking import top_slots
from kveval.tensors.scoring_state import ScoringState


@dataclass
class ChunkKVPolicy(SnapKVPolicy):
    """ChunkKV (Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
    Inference"), over SnapKV's scores as kvpress's ``ChunkKVPress(SnapKVPress())``.

    The context is cut into chunks of ``chunk`` tokens (the last may be shorter); a chunk's score is the mean over
    its tokens of SnapKV's scores summed over the layer's KV heads, and every head keeps the same best chunks, so
    phrases survive whole. kveval keeps the ratio's token count exactly (equal bytes with every other policy):
    whole chunks, then the first tokens of the next best chunk; kvpress keeps ``floor(chunks x (1 - ratio))``
    whole chunks. SnapKV's observation window scores its largest finite score here, as in kvpress (where kveval's
    SnapKV keeps it unconditionally).

    Attributes
    ----------
    chunk : int
        Tokens per chunk.
    """

    name = "chunkkv"
    description = "ChunkKV: SnapKV scores averaged over chunks of tokens; every head keeps the best chunks"
    head_shared_scores = True
    chunk: int = 20

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 1:
            raise PolicySpecError(f"chunkkv: chunk={self.chunk} must be a positive number of tokens")

    def scores(self, state: ScoringState) -> torch.Tensor:
        scores = super().scores(state).float()
        finite = scores.isfinite()
        scores = torch.where(finite, scores, scores[finite].max() if finite.any() else 0.0).sum(dim=0)
        n = scores.shape[-1]
        padded = torch.nn.functional.pad(scores, (0, (self.chunk - n % self.chunk) % self.chunk))
        sums = padded.reshape(-1, self.chunk).sum(dim=-1)
        lengths = torch.full_like(sums, self.chunk)
        lengths[-1] = n - self.chunk * (len(sums) - 1)
        per_token = (sums / lengths).repeat_interleave(self.chunk)[:n]
        return per_token.expand(state.positions.shape[-2], -1)

    def choose(self, scores, keep, state, stable=False):
        # Equal scores within a chunk, ranked in slot order: a partly kept chunk keeps its first tokens.
        return top_slots(scores, keep, dim=1, stable=True)
