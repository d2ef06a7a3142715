"""Random eviction: the control every selection policy must beat."""

from dataclasses import dataclass

import torch

from kveval.policies.base import RatioSelectionPolicy, ScoringState, register_policy

_LOW32 = 0xFFFFFFFF


def _times(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``x < 2**32`` in int64, without overflow: the high half multiplied apart."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + (((high * constant) & 0xFFFF) << 16)) & _LOW32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" finalizer: xorshift-multiply rounds), elementwise on int64 < 2**32."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


@register_policy
@dataclass
class RandomPolicy(RatioSelectionPolicy):
    """Keep a random subset of tokens, per KV head; reproducible for a given seed.

    A token's score is a hash of ``seed``, the sequence's seed, the layer, the KV head, the token's position and
    the newest position held, uniform in ``[0, 1)``: runs repeat exactly, decoding steps differ, and a token's
    score does not depend on the batch around its sequence, so a batch is scored at once (integer operations:
    the same on any device).
    """

    name = "random"
    description = "random eviction (seeded control)"
    seed: int = 0

    batch_scores = True

    def scores(self, state: ScoringState) -> torch.Tensor:
        positions = state.positions  # [..., heads, tokens], -1 on padding
        device = positions.device
        seeds = torch.as_tensor(state.seed, device=device).reshape(-1, *([1] * (positions.dim() - 1)))
        base = _mix(_mix(torch.tensor(self.seed & _LOW32, device=device)) ^ (seeds & _LOW32))
        base = _mix(base ^ state.layer_idx)
        heads = torch.arange(positions.shape[-2], device=device)[:, None]
        newest = positions.amax(dim=(-2, -1), keepdim=True)
        hashed = _mix(_mix(_mix(base ^ heads) ^ (positions & _LOW32)) ^ (newest & _LOW32))
        return (hashed.double() / 2**32).reshape(positions.shape)  # float64: every 32-bit hash apart, no ties
