"""How one of K or V is quantized (:class:`TensorQuant`), torch-free: the memory planner and the policies' checks
size codes from it without a model; :mod:`kveval.tensors.quantization` codes tensors with it."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.tensors.mx_format import FORMATS as MX_FORMATS, GLOBAL_SCALE_BYTES, MicroscalingFormat


@dataclass(frozen=True)
class TensorQuant:
    """How one of K or V is quantized. ``fp8`` is ``None`` for integers; ``mx`` names a block-scaled float format
    (:data:`kveval.tensors.mx_format.FORMATS`: ``nvfp4``, ``mxfp4``, ``mxfp8``), whose ``group`` is its block and
    whose ``bits`` its element's (one-byte block scales, and NVFP4's FP32 global scale per sequence: see
    :attr:`global_scale_bytes`)."""

    bits: int
    axis: str
    group: int
    symmetric: bool = False
    fp8: str | None = None
    mx: str | None = None

    @classmethod
    def microscaled(cls, fmt: str, axis: str) -> "TensorQuant":
        """The coding of block-scaled format ``fmt`` (a name in :data:`~kveval.tensors.mx_format.FORMATS`) with blocks
        along ``axis``: ``token`` (channels within a token) or ``channel`` (tokens within a channel)."""
        found = MX_FORMATS[fmt]
        return cls(found.element.bits, axis, found.block, mx=fmt)

    @property
    def format(self) -> MicroscalingFormat | None:
        """The block-scaled format (``None`` for integers and FP8 with float16 group scales)."""
        return None if self.mx is None else MX_FORMATS[self.mx]

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale (+ zero point) per group: one for a block-scaled format's E4M3/E8M0 scale, two for a
        float16 scale (FP8, symmetric integers), four for a float16 scale and zero point."""
        if self.mx is not None:
            return 1
        return 2 if (self.fp8 is not None or self.symmetric) else 4

    @property
    def global_scale_bytes(self) -> int:
        """Bytes of the per-tensor scales a sequence holding any token stores once for this stream (NVFP4's FP32
        second level, :data:`~kveval.tensors.mx_format.GLOBAL_SCALE_BYTES`); 0 for the others."""
        fmt = self.format
        return GLOBAL_SCALE_BYTES if fmt is not None and fmt.global_scale else 0

    def fitted(self, width: int) -> "TensorQuant":
        """This coding for vectors of ``width`` numbers: a per-token group that does not divide it becomes the
        largest divisor of ``width`` below it (per-channel groups count tokens: unchanged). A block-scaled format's
        block is the format's: unchanged (a width it does not divide is refused before the weights load)."""
        if self.axis != "token" or width % self.group == 0 or self.mx is not None:
            return self
        group = max(d for d in range(1, min(self.group, width) + 1) if width % d == 0)
        return TensorQuant(self.bits, self.axis, group, self.symmetric, self.fp8)

    @property
    def label(self) -> str:
        """As a storage column prints it: ``int4/64``, ``int2/32ch`` (per channel), ``fp8-e4m3/128``."""
        kind = self.mx or (f'fp8-{self.fp8}' if self.fp8 else f'int{self.bits}')
        return f"{kind}/{self.group}{'ch' if self.axis == 'channel' else ''}"


__all__ = ["TensorQuant"]
