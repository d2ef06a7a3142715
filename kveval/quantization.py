"""Integer and FP8 quantization of K/V blocks, with real bit packing.

Conventions
-----------
Tensors are ``[heads, tokens, head_dim]`` for one sequence in one layer.

* ``axis="token"``: each token's ``head_dim`` values are split into groups of
  ``group`` channels; each group has its own scale (and zero point).
* ``axis="channel"``: each channel is quantized over groups of ``group``
  consecutive tokens (KIVI's key scheme); the token count must be a multiple of
  ``group`` (the caller keeps the remainder in full precision).

Integers are stored unsigned in ``uint8``; 4-bit values are packed two per
byte and 2-bit values four per byte. Scales and zero points are float16.
Symmetric quantization has no zero point; its codes are offset by
``2**(bits-1)`` so they are unsigned too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class QuantizedBlock:
    """A quantized ``[heads, tokens, head_dim]`` tensor; ``nbytes`` counts every stored byte."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, int, int]
    bits: int
    axis: str
    group: int
    fp8: str | None = None

    @property
    def nbytes(self) -> int:
        total = self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
        if self.zero is not None:
            total += self.zero.numel() * self.zero.element_size()
        return total

    @property
    def tokens(self) -> int:
        return self.shape[1]


def _grouped(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """View ``[H, T, D]`` so that each quantization group is the last dimension."""
    heads, tokens, dim = x.shape
    if axis == "token":
        return x.reshape(heads, tokens, dim // group, group)
    # [H, T/G, G, D] -> [H, T/G, D, G]: groups of tokens per channel
    return x.reshape(heads, tokens // group, group, dim).transpose(-1, -2)


def _grouped_shape(shape: tuple[int, int, int], axis: str, group: int) -> torch.Size:
    heads, tokens, dim = shape
    return torch.Size((heads, tokens, dim // group, group) if axis == "token" else (heads, tokens // group, dim, group))


def _ungrouped(g: torch.Tensor, axis: str, shape: tuple[int, int, int]) -> torch.Tensor:
    if axis == "token":
        return g.reshape(shape)
    return g.transpose(-1, -2).reshape(shape)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (``uint8``) into a flat byte tensor, ``8 // bits`` codes per byte."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat
    per_byte = 8 // bits
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % per_byte)).reshape(-1, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
    return (flat << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`pack`: codes of the given ``shape``."""
    if bits != 8:
        shifts = torch.arange(8 // bits, device=packed.device, dtype=torch.uint8) * bits
        packed = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(-1)
    return packed[: shape.numel()].reshape(shape)


def quantize(x: torch.Tensor, bits: int, axis: str, group: int, symmetric: bool = False) -> QuantizedBlock:
    """Quantize ``x`` (``[H, T, D]``) to ``bits`` in {2, 4, 8} integers, packed."""
    g = _grouped(x.float(), axis, group)
    if symmetric:
        levels = 2 ** (bits - 1) - 1
        scale = (g.abs().amax(dim=-1, keepdim=True) / levels).clamp(min=1e-8).to(SCALE_DTYPE)
        codes = (torch.round(g / scale.float()).clamp(-levels, levels) + 2 ** (bits - 1)).to(torch.uint8)
        zero = None
    else:
        levels = 2**bits - 1
        lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / levels).clamp(min=1e-8).to(SCALE_DTYPE)
        zero = lo.to(SCALE_DTYPE)
        codes = torch.round((g - zero.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return QuantizedBlock(pack(codes, bits), scale, zero, tuple(x.shape), bits, axis, group)


def quantize_fp8(x: torch.Tensor, fmt: str, axis: str, group: int) -> QuantizedBlock:
    """Scale groups to the FP8 range and cast (``fmt`` in ``e4m3``, ``e5m2``)."""
    dtype = FP8_FORMATS[fmt]
    g = _grouped(x.float(), axis, group)
    scale = (g.abs().amax(dim=-1, keepdim=True) / torch.finfo(dtype).max).clamp(min=1e-12).to(SCALE_DTYPE)
    data = (g / scale.float()).to(dtype)
    return QuantizedBlock(data, scale, None, tuple(x.shape), 8, axis, group, fp8=fmt)


def dequantize(block: QuantizedBlock, dtype: torch.dtype) -> torch.Tensor:
    """Reconstruct ``[H, T, D]`` in ``dtype``."""
    if block.fp8 is not None:
        g = block.data.float() * block.scale.float()
    else:
        codes = unpack(block.data, block.bits, _grouped_shape(block.shape, block.axis, block.group)).float()
        if block.zero is None:
            g = (codes - 2 ** (block.bits - 1)) * block.scale.float()
        else:
            g = codes * block.scale.float() + block.zero.float()
    return _ungrouped(g, block.axis, block.shape).to(dtype)
