"""Block-scaled 4-bit floats as a KV-cache quantizer: ``fp4(format=nvfp4|mxfp4)``, and the base it shares with
``mxfp8`` (:class:`MicroscalingPolicy`).

E2M1 values (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) in blocks with a one-byte scale each: NVFP4 an E4M3 scale per 16
values and an FP32 per-tensor scale, MXFP4 an E8M0 (power of two) scale per 32. The codes are torchao 0.18's,
bit for bit (:mod:`kveval.tensors.microscaling`; ``docs/fp4-formats.md``). Blocks run along channels within a token
(``axis=token``, as the engines' FP4 caches) or along tokens within a channel (``axis=channel``, KIVI's key layout);
K and V separately (``k_axis``, ``v_axis``), and the ``residual`` newest tokens stay in the cache dtype, as KIVI's.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from kveval.errors import PolicySpecError
from kveval.policies.quant import AXES, GroupedQuantizationPolicy
from kveval.tensors.mx_format import FORMATS
from kveval.tensors.quant_format import TensorQuant

#: The 4-bit formats ``fp4(format=...)`` takes.
FP4_FORMATS = ("nvfp4", "mxfp4")


@dataclass
class MicroscalingPolicy(GroupedQuantizationPolicy):
    """A block-scaled float format for K and V (``fp4``, ``mxfp8``): the format's codes in blocks along ``axis`` (or
    ``k_axis`` / ``v_axis``), the ``residual`` newest tokens in the cache dtype.

    Along tokens (``token``) a head row is cut into blocks of the format's size: a head width that is not a multiple
    is refused in one line before the weights load, as the engines refuse it rather than pad. Along channels
    (``channel``) each channel's tokens are cut into blocks as they age out of the residual window; the tokens past
    the last whole block wait in the cache dtype, as KIVI's per-channel keys do (so at least ``block - 1`` of them
    are never coded until more arrive).

    Attributes
    ----------
    (declared by each subclass after its own, so that its spec leads with them)

    axis : str
        ``token`` (blocks of channels within a token) or ``channel`` (blocks of tokens within a channel), K and V.
    k_axis, v_axis : str, optional
        K's and V's own axes (default: ``axis``).
    residual : int
        Newest tokens kept in the cache dtype (KIVI's residual window).
    indexer : str
        DeepSeek V3.2/V4 only: how the indexer's keys are coded (``same``, ``native``, ``fp8``).

    A format with a per-tensor scale (NVFP4's FP32 second level) takes it per layer, K and V apart, and per sequence:
    ``amax / (448 * 6)`` of the tokens held at the first seal (the prefill's K or V of that layer, residual window
    included; torchao's ``per_tensor_amax_to_scale``), so the prefill's largest block gets the E4M3 block scale 448.
    Later tokens reuse it (a larger value saturates its block). Its 4 bytes count once per layer, K and V each, per
    sequence (:class:`kveval.stores.quantized.QuantizedSequence`). On a model's own cache layer (DeepSeek V3.2, V4) each
    part (V4's window, CSA/HCA entries, indexer keys; V3.2's latent, RoPE key, indexer keys) is a tensor of its own.
    """

    # Fields of every subclass (declared there, so that each orders its spec): axis, k_axis, v_axis, residual, indexer.
    axis = "token"
    k_axis = None
    v_axis = None

    @property
    @abstractmethod
    def mx_format(self) -> str:
        """The format's name in :data:`kveval.tensors.mx_format.FORMATS`."""

    def __post_init__(self):
        for key in ("axis", "k_axis", "v_axis"):
            value = getattr(self, key)
            if value is not None and value not in AXES:
                raise PolicySpecError(f"{self.name}: {key}={value!r} must be one of {', '.join(AXES)}")
        self.check_group_and_residual()

    def check_given(self) -> None:
        if self.is_given("axis") and self.is_given("k_axis") and self.is_given("v_axis"):
            raise PolicySpecError(f"{self.name}: axis= does nothing beside k_axis= and v_axis=; drop one of them")

    @property
    def group(self) -> int:
        """Values per block (the format's); read by the grouped quantizers' checks."""
        return FORMATS[self.mx_format].block

    @property
    def key_quant(self) -> TensorQuant:
        return TensorQuant.microscaled(self.mx_format, self.k_axis or self.axis)

    @property
    def value_quant(self) -> TensorQuant:
        return TensorQuant.microscaled(self.mx_format, self.v_axis or self.axis)

    def _refuse_width(self, which: str, width: int, label: str) -> None:
        raise PolicySpecError(
            f"{self.spec()}: {self.mx_format} codes blocks of {self.group} along each token, and the {which} {label} "
            f"{width} is not a whole number of blocks (the engines refuse it rather than pad); use "
            f"{'k_axis' if which == 'k' else 'v_axis' if which == 'v' else 'axis'}=channel (blocks of {self.group} "
            f"tokens), or a model whose widths are multiples of {self.group}")

    def check_head_dim(self, head_dim: int) -> None:
        for which, q in (("k", self.key_quant), ("v", self.value_quant)):
            if q.axis == "token" and head_dim % q.group:
                self._refuse_width(which, head_dim, "head_dim")

    def fit_widths(self, widths: dict[str, int], label: str) -> None:
        """A block is the format's: nothing adapts; a per-token width that is not whole blocks is refused."""
        for which, q in (("k", self.key_quant), ("v", self.value_quant)):
            width = widths.get(which)
            if width and q.axis == "token" and width % q.group:
                self._refuse_width(which, width, label)

    def check_part_widths(self, keys: dict[str, int], values: dict[str, int]) -> None:
        for widths, q, which in ((keys, self.key_quant, "k"), (values, self.value_quant, "v")):
            for part, width in widths.items():
                if q.axis == "token" and width % q.group:
                    self._refuse_width(which, width, f"{part} width")


@dataclass
class Fp4Policy(MicroscalingPolicy):
    """FP4 (E2M1) K/V in NVFP4 or MXFP4 blocks (see :class:`MicroscalingPolicy`).

    Attributes
    ----------
    format : str
        ``nvfp4``: an E4M3 scale per 16 values and an FP32 per-tensor scale (4.5 bits a value, + 4 bytes per layer
        and K/V); ``mxfp4``: an E8M0 scale per 32 values (4.25 bits a value).
    axis, k_axis, v_axis, residual, indexer
        As :class:`MicroscalingPolicy` says.
    """

    name = "fp4"
    description = "FP4 (E2M1) K/V in NVFP4 (E4M3 scale/16 + FP32 per tensor) or MXFP4 (E8M0 scale/32) blocks"
    format: str = "nvfp4"
    axis: str = "token"
    k_axis: str | None = None
    v_axis: str | None = None
    residual: int = 0
    indexer: str = "same"

    def __post_init__(self):
        if self.format not in FP4_FORMATS:
            raise PolicySpecError(f"{self.name}: format={self.format!r} must be one of {', '.join(FP4_FORMATS)}")
        super().__post_init__()

    @property
    def mx_format(self) -> str:
        return self.format
