"""Quantization policies: integer (``quant``, ``kivi``) and FP8 (``fp8``).

K and V are configured separately because keys are more sensitive than values
(KIVI, Liu et al. 2024): keys have outlier *channels*, so per-channel key
quantization keeps those channels on their own scale, while values are best
quantized per token. The most recent ``residual`` tokens stay in full precision;
older tokens are quantized in whole groups as they age out of the residual.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass

from kveval.errors import PolicySpecError
from kveval.policies.base import Placement, PlannedCoding, QuantizationPolicy
from kveval.tensors.quant_format import TensorQuant
# Stores, calibration and the model's hooks import torch: imported inside the methods that run a policy on a model.

AXES = ("token", "channel")
#: How a quantizer codes the DSA indexer's keys (DeepSeek V3.2, GLM MoE-DSA, DeepSeek V4's CSA layers; other models
#: have none): ``same`` as the other parts of the cache, ``native`` kept in the cache dtype, ``fp8`` as DeepSeek serves
#: them, e4m3 with one float scale per 128 values (per key where it is narrower). See docs/methods.md.
INDEXER_CODINGS = ("same", "native", "fp8")


@dataclass
class GroupedQuantizationPolicy(QuantizationPolicy):
    """Quantizers that code K and V in groups with per-group scales (``quant``, ``kivi``, ``fp8``): each declares its
    :class:`TensorQuant` for K and V, and the full-precision residual window. They code the parts of a model's own
    cache layer as K (:meth:`part_codes`)."""

    placements = frozenset({Placement.PARTS})

    @property
    @abstractmethod
    def key_quant(self) -> TensorQuant:
        """How K is coded."""

    @property
    @abstractmethod
    def value_quant(self) -> TensorQuant:
        """How V is coded."""

    def planned_coding(self) -> PlannedCoding:
        return PlannedCoding(self.key_quant, self.value_quant, residual=self.residual_tokens)

    def part_codes(self, model, layer_idx: int, part: str, width: int, kv_dtype, stride: int):
        """K's coding (the parts are keys), its per-token groups fitted to the part's own width, and the residual
        window counted in entries."""
        from kveval.stores.quantized import QuantizedSequence

        return QuantizedSequence(self.key_quant.fitted(width), self.residual_tokens, kv_dtype)

    @property
    def residual_tokens(self) -> int:
        return self.residual

    def check_group_and_residual(self) -> None:
        if self.indexer not in INDEXER_CODINGS:
            raise PolicySpecError(f"{self.name}: indexer={self.indexer!r} must be one of {', '.join(INDEXER_CODINGS)}")
        if not isinstance(self.group, int) or self.group < 1:
            raise PolicySpecError(f"{self.name}: group={self.group!r} must be a positive integer")
        if not isinstance(self.residual, int) or self.residual < 0:
            raise PolicySpecError(f"{self.name}: residual={self.residual!r} must be a number of tokens >= 0")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if a per-token group does not divide ``head_dim``."""
        for which, q in (("k", self.key_quant), ("v", self.value_quant)):
            if q.axis == "token" and head_dim % q.group:
                raise PolicySpecError(f"{self.spec()}: {which} group={q.group} does not divide head_dim={head_dim}; pick a divisor of {head_dim}")

    def fit_widths(self, widths: dict[str, int], label: str) -> None:
        """Make per-token groups divide ``widths``: numbers per token of K and V, each a ``label`` (``rank``, ``head_dim``).

        An unset ``group`` becomes the largest divisor of the width(s) not above
        its default; an explicit one that does not divide them raises.
        """
        per_token = {kind: widths[kind] for kind, q in (("k", self.key_quant), ("v", self.value_quant))
                     if q.axis == "token" and widths.get(kind)}
        if not per_token:
            return
        width = math.gcd(*per_token.values())
        if width % self.group == 0:
            return
        if self.is_given("group"):
            kind, bad = next((k, w) for k, w in per_token.items() if w % self.group)
            raise PolicySpecError(f"{self.spec()}: per-token quantization group={self.group} does not divide the {kind} "
                                  f"{label} {bad}; pick a group that divides {bad}")
        self.group = max(d for d in range(1, min(self.group, width) + 1) if width % d == 0)

    def make_store(self, inner, model, layer_idx: int):
        """A :class:`kveval.stores.quantized.QuantizedStore` in place of ``inner``, the dense store it replaces (same dtypes)."""
        from kveval.stores.quantized import QuantizedStore

        return QuantizedStore(self.key_quant, self.value_quant, self.residual_tokens, inner.kv_dtype, inner.compute_dtype)


def _check_bits(name: str, key: str, bits) -> None:
    if bits not in (2, 4, 8):
        raise PolicySpecError(f"{name}: {key}={bits!r} is not supported; use 2, 4 or 8")


@dataclass
class QuantPolicy(GroupedQuantizationPolicy):
    """Integer K/V quantization with packed storage.

    Attributes
    ----------
    bits : int
        Bit width for K and V (2, 4 or 8) unless ``k_bits``/``v_bits`` are given.
    indexer : str
        DeepSeek V3.2/V4 only: how the indexer's keys are coded (:data:`INDEXER_CODINGS`).
    k_bits, v_bits : int, optional
        Separate bit widths for keys and values.
    k_axis, v_axis : str
        ``"token"`` (a scale per group of channels of one token) or
        ``"channel"`` (a scale per channel over a group of tokens).
    group : int
        Group size in values (channels for ``token``, tokens for ``channel``).
    residual : int
        Most recent tokens kept in full precision.
    symmetric : bool
        Symmetric (scale only) instead of asymmetric (scale and zero point).
    """

    name = "quant"
    description = "integer K/V quantization (2/4/8 bits, per-token or per-channel, groups, residual window)"
    bits: int = 8
    k_bits: int | None = None
    v_bits: int | None = None
    k_axis: str = "token"
    v_axis: str = "token"
    group: int = 64
    residual: int = 0
    symmetric: bool = False
    indexer: str = "same"

    def __post_init__(self):
        _check_bits(self.name, "bits", self.bits)
        for key in ("k_bits", "v_bits"):
            if getattr(self, key) is not None:
                _check_bits(self.name, key, getattr(self, key))
        for key in ("k_axis", "v_axis"):
            if getattr(self, key) not in AXES:
                raise PolicySpecError(f"{self.name}: {key}={getattr(self, key)!r} must be one of {', '.join(AXES)}")
        self.check_group_and_residual()

    @property
    def key_quant(self) -> TensorQuant:
        return TensorQuant(self.k_bits or self.bits, self.k_axis, self.group, self.symmetric)

    @property
    def value_quant(self) -> TensorQuant:
        return TensorQuant(self.v_bits or self.bits, self.v_axis, self.group, self.symmetric)


@dataclass
class KiviPolicy(GroupedQuantizationPolicy):
    """KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

    Keys per channel, values per token, asymmetric integers with group size
    ``group``, and the ``residual`` most recent tokens in full precision.

    Attributes
    ----------
    bits : int
        2 or 4 (the paper's settings; 8 is allowed for comparison).
    group : int
        Group size (tokens for keys, channels for values); the paper uses 32.
    residual : int
        Full-precision recent tokens; the paper uses 128.
    """

    name = "kivi"
    description = "KIVI: keys per-channel, values per-token, 2/4 bits, full-precision residual window"
    bits: int = 2
    group: int = 32
    residual: int = 128
    indexer: str = "same"

    def __post_init__(self):
        _check_bits(self.name, "bits", self.bits)
        self.check_group_and_residual()

    @property
    def key_quant(self) -> TensorQuant:
        return TensorQuant(self.bits, "channel", self.group)

    @property
    def value_quant(self) -> TensorQuant:
        return TensorQuant(self.bits, "token", self.group)


@dataclass
class Fp8Policy(GroupedQuantizationPolicy):
    """FP8 K/V (``e4m3`` or ``e5m2``) with a float16 scale per group.

    Attributes
    ----------
    format : str
        ``"e4m3"`` (more mantissa) or ``"e5m2"`` (more range).
    axis : str
        ``"token"`` or ``"channel"`` for both K and V.
    group : int
        Group size (channels for ``token``, tokens for ``channel``).
    residual : int
        Most recent tokens kept in full precision.
    """

    name = "fp8"
    description = "FP8 K/V (e4m3 or e5m2) with per-token or per-channel scales"
    format: str = "e4m3"
    axis: str = "token"
    group: int = 64
    residual: int = 0
    indexer: str = "same"

    def __post_init__(self):
        if self.format not in ("e4m3", "e5m2"):
            raise PolicySpecError(f"fp8: format={self.format!r} must be e4m3 or e5m2")
        if self.axis not in AXES:
            raise PolicySpecError(f"fp8: axis={self.axis!r} must be one of {', '.join(AXES)}")
        self.check_group_and_residual()

    @property
    def key_quant(self) -> TensorQuant:
        return TensorQuant(8, self.axis, self.group, fp8=self.format)

    @property
    def value_quant(self) -> TensorQuant:
        return TensorQuant(8, self.axis, self.group, fp8=self.format)
