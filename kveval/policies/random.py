"""Random eviction: the control every selection policy must beat."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kveval.lazy import torch

from kveval.policies.base import Placement, RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState

_LOW32 = 0xFFFFFFFF


def _times(x, constant: int):
    """``x * constant mod 2**32`` for ``0 <= x < 2**32`` (an int64 tensor or an int), without int64 overflow: a
    constant of ``2**31`` or more is taken as ``constant - 2**32``, the same modulo ``2**32``."""
    return (x * (constant - 2**32 if constant >= 2**31 else constant)) & _LOW32


def _mix(x):
    """A 32-bit integer hash (the "lowbias32" finalizer: xorshift-multiply rounds), elementwise on int64 tensors
    or ints in ``[0, 2**32)``; a bijection, so distinct inputs never tie."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


@dataclass
class RandomPolicy(RatioSelectionPolicy):
    """Keep a random subset of tokens, per KV head; reproducible for a given seed.

    A token's score is a hash of ``seed``, the sequence's seed, the layer, the KV head, the token's position and
    the newest position held, uniform in ``[0, 1)``: runs repeat exactly, decoding steps differ, and a token's
    score does not depend on the batch around its sequence, so a batch is scored at once (integer operations:
    the same on any device).
    """

    name = "random"
    #: Scores from the row's seed alone: an MLA latent (for every head at once) or a V4 entry alike.
    placements = frozenset({Placement.LATENT, Placement.ENTRIES})
    description = "random eviction (seeded control)"
    seed: int = 0

    batch_scores = True
    reads_row_seed = True

    def scores(self, state: ScoringState) -> torch.Tensor:
        positions = state.positions  # [..., heads, tokens], -1 on padding
        rows, heads = _row_and_head_hashes(self.seed, state.seed, state.layer_idx, positions.shape[-2], positions.dim(),
                                           positions.device)
        step = _mix(rows ^ (positions.amax(dim=(-2, -1), keepdim=True) & _LOW32))  # the newest position held
        hashed = _mix(_mix(heads ^ (positions & _LOW32)) ^ step)
        return hashed.double() / 2**32  # float64: every 32-bit hash apart, so no ties


@functools.lru_cache(maxsize=256)
def _row_and_head_hashes(seed: int, seeds: "int | tuple[int, ...]", layer_idx: int, heads: int, dims: int, device):
    """The hashes of each row (``[rows, 1, 1]``, or ``[1, 1]`` for one sequence's ``[heads, tokens]``) and of each
    of its KV heads (``[rows, heads, 1]``) that a layer's scores start from: the same at every decode step, so made
    once (about 20 small tensor ops fewer per layer and step)."""
    seed_layer = _mix(_mix(seed & _LOW32) ^ layer_idx)
    row_seeds = torch.tensor(seeds, device=device).reshape(-1, *([1] * (dims - 1))) & _LOW32
    rows = _mix(row_seeds ^ seed_layer)
    return rows, _mix(rows ^ torch.arange(heads, device=device)[:, None])
