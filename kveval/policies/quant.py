"""Quantization policies: integer (``quant``, ``kivi``) and FP8 (``fp8``).

K and V are configured separately because keys are more sensitive than values
(KIVI, Liu et al. 2024): keys have outlier *channels*, so per-channel key
quantization keeps those channels on their own scale, while values are best
quantized per token. The most recent ``residual`` tokens stay in full precision;
older tokens are quantized in whole groups as they age out of the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.policies.base import RepresentationPolicy, register_policy

AXES = ("token", "channel")


@dataclass(frozen=True)
class TensorQuant:
    """How one of K or V is quantized. ``fp8`` is ``None`` for integers."""

    bits: int
    axis: str
    group: int
    symmetric: bool = False
    fp8: str | None = None


@dataclass
class QuantizationPolicy(RepresentationPolicy):
    """Common interface: per-tensor settings and the full-precision residual window."""

    family = "quantization"

    @property
    def key_quant(self) -> TensorQuant:
        raise NotImplementedError

    @property
    def value_quant(self) -> TensorQuant:
        raise NotImplementedError

    @property
    def residual_tokens(self) -> int:
        return self.residual

    def check_group_and_residual(self) -> None:
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"{self.name}: group={self.group!r} must be a positive integer")
        if not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"{self.name}: residual={self.residual!r} must be a number of tokens >= 0")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if a per-token group does not divide ``head_dim``."""
        for which, q in (("k", self.key_quant), ("v", self.value_quant)):
            if q.axis == "token" and head_dim % q.group:
                raise ValueError(f"{self.spec()}: {which} group={q.group} does not divide head_dim={head_dim}; pick a divisor of {head_dim}")


def _check_bits(name: str, key: str, bits) -> None:
    if bits not in (2, 4, 8):
        raise ValueError(f"{name}: {key}={bits!r} is not supported; use 2, 4 or 8")


@register_policy
@dataclass
class QuantPolicy(QuantizationPolicy):
    """Integer K/V quantization with packed storage.

    Attributes
    ----------
    bits : int
        Bit width for K and V (2, 4 or 8) unless ``k_bits``/``v_bits`` are given.
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

    def __post_init__(self):
        _check_bits(self.name, "bits", self.bits)
        for key in ("k_bits", "v_bits"):
            if getattr(self, key) is not None:
                _check_bits(self.name, key, getattr(self, key))
        for key in ("k_axis", "v_axis"):
            if getattr(self, key) not in AXES:
                raise ValueError(f"{self.name}: {key}={getattr(self, key)!r} must be one of {', '.join(AXES)}")
        self.check_group_and_residual()

    @property
    def key_quant(self) -> TensorQuant:
        return TensorQuant(self.k_bits or self.bits, self.k_axis, self.group, self.symmetric)

    @property
    def value_quant(self) -> TensorQuant:
        return TensorQuant(self.v_bits or self.bits, self.v_axis, self.group, self.symmetric)


@register_policy
@dataclass
class KiviPolicy(QuantizationPolicy):
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

    def __post_init__(self):
        _check_bits(self.name, "bits", self.bits)
        self.check_group_and_residual()

    @property
    def key_quant(self) -> TensorQuant:
        return TensorQuant(self.bits, "channel", self.group)

    @property
    def value_quant(self) -> TensorQuant:
        return TensorQuant(self.bits, "token", self.group)


@register_policy
@dataclass
class Fp8Policy(QuantizationPolicy):
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

    def __post_init__(self):
        if self.format not in ("e4m3", "e5m2"):
            raise ValueError(f"fp8: format={self.format!r} must be e4m3 or e5m2")
        if self.axis not in AXES:
            raise ValueError(f"fp8: axis={self.axis!r} must be one of {', '.join(AXES)}")
        self.check_group_and_residual()

    @property
    def key_quant(self) -> TensorQuant:
        return TensorQuant(8, self.axis, self.group, fp8=self.format)

    @property
    def value_quant(self) -> TensorQuant:
        return TensorQuant(8, self.axis, self.group, fp8=self.format)
