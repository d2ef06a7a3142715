"""How one of K or V is quantized (:class:`TensorQuant`), torch-free: the memory planner and the policies' checks
size codes from it without a model; :mod:`kveval.tensors.quantization` codes tensors with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorQuant:
    """How one of K or V is quantized. ``fp8`` is ``None`` for integers."""

    bits: int
    axis: str
    group: int
    symmetric: bool = False
    fp8: str | None = None

    def fitted(self, width: int) -> "TensorQuant":
        """This coding for vectors of ``width`` numbers: a per-token group that does not divide it becomes the
        largest divisor of ``width`` below it (per-channel groups count tokens: unchanged)."""
        if self.axis != "token" or width % self.group == 0:
            return self
        group = max(d for d in range(1, min(self.group, width) + 1) if width % d == 0)
        return TensorQuant(self.bits, self.axis, group, self.symmetric, self.fp8)

    @property
    def label(self) -> str:
        """As a storage column prints it: ``int4/64``, ``int2/32ch`` (per channel), ``fp8-e4m3/128``."""
        return f"{f'fp8-{self.fp8}' if self.fp8 else f'int{self.bits}'}/{self.group}{'ch' if self.axis == 'channel' else ''}"


__all__ = ["TensorQuant"]
