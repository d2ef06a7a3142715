"""The uncompressed baseline."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.policies.base import Policy


@dataclass
class NoCompression(Policy):
    """Keep every token in the model's own dtype; the baseline every run is compared with."""

    name = "none"
    family = "none"
    description = "uncompressed baseline: every token, full precision"
