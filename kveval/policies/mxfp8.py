"""MXFP8 as a KV-cache quantizer: ``mxfp8``, E4M3 values with an E8M0 (power of two) scale per 32 values, coded as
torchao 0.18 codes them (:mod:`kveval.tensors.microscaling`). The 8-bit member of the block-scaled formats
(:class:`kveval.policies.fp4.MicroscalingPolicy`), the control beside ``fp4``."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.policies.fp4 import MicroscalingPolicy


@dataclass
class Mxfp8Policy(MicroscalingPolicy):
    """MXFP8 (E4M3 elements, an E8M0 scale per 32; 8.25 bits a value) K/V; its parameters (``axis``, ``k_axis``,
    ``v_axis``, ``residual``, ``indexer``) as :class:`MicroscalingPolicy` says."""

    name = "mxfp8"
    description = "MXFP8 K/V: E4M3 values with an E8M0 scale per 32, per-token or per-channel blocks"
    axis: str = "token"
    k_axis: str | None = None
    v_axis: str | None = None
    residual: int = 0
    indexer: str = "same"

    @property
    def mx_format(self) -> str:
        return "mxfp8"
