"""Integer and FP8 quantization of K/V blocks, with real bit packing.

Conventions
-----------
Tensors are ``[heads, tokens, head_dim]`` for one sequence in one layer.

* ``axis="token"``: each token's ``head_dim`` values are split into groups of
  ``group`` channels; each group has its own scale (and zero point).
* ``axis="channel"``: each channel is quantized over groups of ``group``
  consecutive tokens (KIVI's key scheme); the token count must be a multiple of
  ``group`` (the caller keeps the remainder in full precision).

A block is stored in *units*, dimension 1 of every tensor it holds: a unit is
one token (``axis="token"``) or one group of ``group`` tokens
(``axis="channel"``), the smallest piece that can be dropped or kept without
touching the others. Eviction gathers whole units (:func:`gather_units`) and
never re-encodes them.

Integers are stored unsigned in ``uint8``; 4-bit values are packed two per
byte and 2-bit values four per byte, within each unit (a unit whose code count
is not a multiple of ``8 // bits`` is padded to a whole byte). Scales and zero
points are float16. Symmetric quantization has no zero point; its codes are
offset by ``2**(bits-1)`` so they are unsigned too.

Block-scaled float formats (``mx``: NVFP4, MXFP4, MXFP8; :mod:`kveval.tensors.microscaling`, torchao's numerics) are
held in the same units: ``data`` the element codes of each unit (E2M1 two a byte, E4M3 one a byte, in each block's
order along its axis), ``scale`` the one-byte E4M3/E8M0 block scales, and NVFP4's FP32 per-tensor scale in
``global_scale`` (shared by every unit; the sequence that fixed it counts its 4 bytes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kveval.tensors.microscaling import (
    FORMATS as MX_FORMATS,
    MicroscaledRows,
    decode_rows,
    encode_rows,
    nvfp4_global_scale,
)
from kveval.tensors.quant_format import TensorQuant  # re-exported: codes are made from it here

SCALE_DTYPE = torch.float16
#: The smallest scale: float16's smallest positive value (subnormal, exact). A smaller one rounds to 0 in float16,
#: and the codes of a group of zeros (or of one value) became 0/0: NaN, read back as NaN in FP8.
MIN_SCALE = 2.0**-24
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class QuantizedBlock:
    """A quantized ``[heads, tokens, head_dim]`` tensor; ``nbytes`` counts every stored byte.

    ``data`` is ``[heads, units, bytes per unit]`` (integers, packed) or the
    grouped FP8 values ``[heads, units, ...]``; ``scale`` and ``zero`` are
    ``[heads, units, ...]``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, int, int]
    bits: int
    axis: str
    group: int
    fp8: str | None = None
    #: A block-scaled format's name (``nvfp4``, ``mxfp4``, ``mxfp8``), ``None`` for integers and FP8.
    mx: str | None = None
    #: NVFP4's FP32 per-tensor scale (a 0-dim float32 tensor) the blocks were coded against; not counted in
    #: :attr:`nbytes`: one per sequence and stream, counted there (:class:`kveval.stores.quantized.QuantizedSequence`).
    global_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        total = self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
        if self.zero is not None:
            total += self.zero.numel() * self.zero.element_size()
        return total

    @property
    def tokens(self) -> int:
        return self.shape[1]

    @property
    def unit(self) -> int:
        """Tokens per unit: 1 for per-token groups, ``group`` for per-channel groups."""
        return 1 if self.axis == "token" else self.group

    @property
    def units(self) -> int:
        return self.shape[1] // self.unit


def _grouped(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """View ``[H, T, D]`` as ``[H, units, ..., group]``: each quantization group is the last dimension."""
    heads, tokens, dim = x.shape
    if axis == "token":
        return x.reshape(heads, tokens, dim // group, group)
    # [H, T/G, G, D] -> [H, T/G, D, G]: groups of tokens per channel
    return x.reshape(heads, tokens // group, group, dim).transpose(-1, -2)


def _grouped_shape(shape: tuple[int, int, int], axis: str, group: int) -> torch.Size:
    heads, tokens, dim = shape
    return torch.Size((heads, tokens, dim // group, group) if axis == "token" else (heads, tokens // group, dim, group))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes ``[H, U, ...]`` (``uint8``) per unit: ``[H, U, bytes]``, ``8 // bits`` codes a byte."""
    flat = codes.reshape(codes.shape[0], codes.shape[1], -1)
    if bits == 8:
        return flat
    return _pack_whole_codes(flat, bits)


def _pack_whole_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` codes of ``bits`` dividing 8 -> ``[..., ceil(n*bits/8)]``: code ``i`` in bits
    ``(i % per_byte) * bits`` onwards of byte ``i // per_byte`` (the last byte zero-padded)."""
    per_byte = 8 // bits
    flat = torch.nn.functional.pad(codes, (0, -codes.shape[-1] % per_byte)).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
    return (flat << shifts).sum(dim=-1, dtype=torch.uint8)


def _unpack_whole_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack_whole_codes`, padding included: ``[..., bytes]`` -> ``[..., bytes * 8 // bits]``."""
    shifts = torch.arange(8 // bits, device=packed.device, dtype=torch.uint8) * bits
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], -1)


@functools.lru_cache(maxsize=16)
def _byte_values(bits: int, offset: int, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]`` float32: the codes packed in each byte value (:func:`_pack_whole_codes`'s order), less
    ``offset``. Small integers, so exact in float32 (made once per width and device, never written to)."""
    per_byte = 8 // bits
    byte = torch.arange(256, dtype=torch.int32, device=device)[:, None]
    shifts = torch.arange(per_byte, dtype=torch.int32, device=device) * bits
    return (((byte >> shifts) & ((1 << bits) - 1)) - offset).float()


def _code_values(block: QuantizedBlock, offset: int) -> torch.Tensor:
    """Inverse of :func:`pack`, as float32 less ``offset``: ``[H, U, ...]`` in the block's grouped shape, a new tensor.

    Packed bytes are looked up in a table of the codes each byte value holds (:func:`_byte_values`): one gather
    in place of shifting, masking and converting each code, 2-5x faster on a CPU over a layer at decode.
    """
    shape = _grouped_shape(block.shape, block.axis, block.group)
    data = block.data
    if block.bits == 8:
        values = data.float() if not offset else data.float() - offset
    else:
        table = _byte_values(block.bits, offset, data.device)
        # int() first: it copies a strided slice (the rows' units of a capacity) while converting, one copy fewer
        values = table.index_select(0, data.int().reshape(-1)).view(*data.shape[:-1], -1)
    return values[..., :shape[2:].numel()].reshape(shape)


def _valid_grouped(valid: torch.Tensor | None, axis: str, group: int) -> torch.Tensor | None:
    """The ``[H, T]`` slot mask broadcast against the grouped view."""
    if valid is None:
        return None
    if axis == "token":
        return valid[:, :, None, None]
    return valid.reshape(valid.shape[0], -1, 1, group)


def _range(g: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each group over its valid slots (0 and 0 for a group without any)."""
    if valid is None:
        return torch.aminmax(g, dim=-1, keepdim=True)  # one reduction, the values of amin and amax
    lo = g.masked_fill(~valid, float("inf")).amin(dim=-1, keepdim=True)
    hi = g.masked_fill(~valid, float("-inf")).amax(dim=-1, keepdim=True)
    empty = ~valid.any(dim=-1, keepdim=True)
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


def _abs_max(g: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    a = g.abs()
    return (a if valid is None else a.masked_fill(~valid, 0.0)).amax(dim=-1, keepdim=True)


class _Levels(NamedTuple):
    """Integer quantization of a grouped tensor before packing: ``codes`` (float32 integers, before symmetric codes'
    unsigned offset), ``scale``/``zero`` as stored (``SCALE_DTYPE``; ``zero`` is ``None`` when symmetric). The
    codes were computed with their float32 values, to which a float32 operand promotes them exactly."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


def _levels(g: torch.Tensor, bits: int, symmetric: bool, mask: torch.Tensor | None) -> _Levels:
    """Scales, zero points and integer codes of the grouped float32 ``g`` (each group its last dimension)."""
    if symmetric:
        levels = 2 ** (bits - 1) - 1
        scale = (_abs_max(g, mask) / levels).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
        return _Levels(torch.round(g / scale).clamp(-levels, levels), scale, None)
    levels = 2**bits - 1
    lo, hi = _range(g, mask)
    scale = ((hi - lo) / levels).clamp(min=MIN_SCALE).to(SCALE_DTYPE)
    zero = lo.to(SCALE_DTYPE)
    return _Levels(torch.round((g - zero) / scale).clamp(0, levels), scale, zero)


def quantize(x: torch.Tensor, bits: int, axis: str, group: int, symmetric: bool = False,
             valid: torch.Tensor | None = None) -> QuantizedBlock:
    """Quantize ``x`` (``[H, T, D]``) to ``bits`` in {2, 4, 8} integers, packed.

    ``valid`` (``[H, T]`` bool, optional) marks the slots that hold tokens; the
    others (evicted slots inside a per-channel group) do not widen a group's range.
    """
    found = _levels(_grouped(x.float(), axis, group), bits, symmetric, _valid_grouped(valid, axis, group))
    codes = (found.codes + 2 ** (bits - 1) if symmetric else found.codes).to(torch.uint8)
    return QuantizedBlock(pack(codes, bits), found.scale, found.zero, tuple(x.shape), bits, axis, group)


def quantized_values(x: torch.Tensor, bits: int, axis: str, group: int, symmetric: bool, fp8: str | None,
                     dtype: torch.dtype, mx: str | None = None) -> torch.Tensor:
    """``x`` (``[H, T, D]``) as its quantization reads back in ``dtype``: the bits of
    ``dequantize(quantize(x, ...), dtype)`` (or of :func:`quantize_fp8`'s block), without packing codes or converting
    them back, which a decode step reading its new tokens back does not need (4-10 operations fewer per tensor).

    The float32 products and sums are those :func:`dequantize_into` computes, in the same order, from the same
    values (small integers are exact in float32 whether or not they went through ``uint8``, and zeros are +0.0).
    """
    if mx is not None:  # block-scaled formats without a per-tensor scale: their codes, read back
        return dequantize(quantize_mx(x, mx, axis, group), dtype)
    g = _grouped(x.float(), axis, group)
    if fp8 is not None:
        scale = _fp8_scale(g, fp8, None)
        values = _fp8_codes(g, scale, fp8).float().mul_(scale)
    else:
        found = _levels(g, bits, symmetric, None)
        # + 0.0: a code that rounded to -0.0 reads back as +0.0, as it does once stored in uint8
        values = found.codes.add_(0.0).mul_(found.scale)
        if found.zero is not None:
            values = values.add_(found.zero)
    if axis != "token":
        values = values.transpose(-1, -2)
    return values.reshape(x.shape).to(dtype)


def quantize_fp8(x: torch.Tensor, fmt: str, axis: str, group: int, valid: torch.Tensor | None = None) -> QuantizedBlock:
    """Scale groups to the FP8 range and cast (``fmt`` in ``e4m3``, ``e5m2``); ``valid`` as in :func:`quantize`."""
    g = _grouped(x.float(), axis, group)
    scale = _fp8_scale(g, fmt, _valid_grouped(valid, axis, group))
    return QuantizedBlock(_fp8_codes(g, scale, fmt), scale, None, tuple(x.shape), 8, axis, group, fp8=fmt)


def quantize_mx(x: torch.Tensor, fmt: str, axis: str, group: int, valid: torch.Tensor | None = None,
                global_scale: torch.Tensor | None = None) -> QuantizedBlock:
    """``x`` (``[H, T, D]``) in block-scaled format ``fmt`` (``nvfp4``, ``mxfp4``, ``mxfp8``), blocks of ``group`` (the
    format's block) along ``axis``, coded by :func:`kveval.tensors.microscaling.encode_rows` (torchao 0.18's
    numerics, the OCP ``floor`` rule for E8M0 scales). ``valid`` as in :func:`quantize`: evicted slots count as 0,
    so they do not widen a block's scale. ``global_scale``: NVFP4's FP32 per-tensor scale (``None``: one level)."""
    found = MX_FORMATS[fmt]
    if group != found.block:
        raise ValueError(f"{fmt} codes blocks of {found.block}, not {group}")
    g = _grouped(x.float(), axis, group)
    mask = _valid_grouped(valid, axis, group)
    if mask is not None:
        g = g.masked_fill(~mask, 0.0)
    rows = encode_rows(g, found, global_scale)
    heads, units = g.shape[:2]
    return QuantizedBlock(rows.codes.reshape(heads, units, -1), rows.scales.reshape(heads, units, -1), None,
                          tuple(x.shape), found.element.bits, axis, group, mx=fmt, global_scale=rows.global_scale)


def mx_global_scale(fmt: str, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor | None:
    """The per-tensor scale block-scaled format ``fmt`` codes ``x`` (``[H, T, D]``, its ``valid`` slots) against:
    NVFP4's ``amax / (448 * 6)`` in float32 (torchao's ``per_tensor_amax_to_scale``), ``None`` for a format without
    one. An all-zero tensor takes 1.0 (torchao's 0 would code 0 / 0; any positive scale codes its zeros)."""
    if not MX_FORMATS[fmt].global_scale:
        return None
    a = x.float().abs()
    amax = (a if valid is None else a.masked_fill(~valid[..., None], 0.0)).amax()
    return nvfp4_global_scale(amax) if amax > 0 else torch.tensor(1.0, dtype=torch.float32, device=x.device)


def _mx_values(block: QuantizedBlock) -> torch.Tensor:
    """A block-scaled block's values as float32, in the grouped layout ``[H, units, ..., group]``
    (:func:`kveval.tensors.microscaling.decode_rows`: element value x block scale, the global scale folded in)."""
    shape = _grouped_shape(block.shape, block.axis, block.group)
    found = MX_FORMATS[block.mx]
    code_bytes = block.group * found.element.bits // 8  # per block (an empty row, V4's V, has none)
    rows = MicroscaledRows(found, block.data.reshape(*shape[:-1], code_bytes), block.scale.reshape(*shape[:-1], 1),
                           block.global_scale, block.group)
    return decode_rows(rows)


def _fp8_scale(g: torch.Tensor, fmt: str, mask: torch.Tensor | None) -> torch.Tensor:
    """Each group's scale (``SCALE_DTYPE``): its largest magnitude over its valid slots at the format's largest value."""
    return (_abs_max(g, mask) / torch.finfo(FP8_FORMATS[fmt]).max).clamp(min=MIN_SCALE).to(SCALE_DTYPE)


def _fp8_codes(g: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``g / scale`` cast to the format, saturated at its largest value: a scale in float16's subnormal range rounds
    by up to a third, so the largest magnitude of its group can land past the format's range, where the cast gives
    inf in e5m2 (and NaN in e4m3 wherever its kernel does not saturate). Values in range keep their bits."""
    largest = torch.finfo(FP8_FORMATS[fmt]).max
    return (g / scale).clamp_(-largest, largest).to(FP8_FORMATS[fmt])


def dequantize(block: QuantizedBlock, dtype: torch.dtype) -> torch.Tensor:
    """Reconstruct ``[H, T, D]`` in ``dtype``."""
    return dequantize_into(block, torch.empty(block.shape, dtype=dtype, device=block.data.device))


def dequantize_into(block: QuantizedBlock, out: torch.Tensor) -> torch.Tensor:
    """Reconstruct the block into ``out`` (``[H, T, D]`` of any float dtype and strides, e.g. a view of a scratch
    shared by the layers) and return it.

    The float32 math is that of a separate product and sum (``codes x scale + zero``), rounded to ``out``'s dtype
    once at the end: the bits of ``dequantize(block, out.dtype)`` wherever it is written.
    """
    _, tokens, dim = block.shape
    if block.axis == "token":
        target = out.unflatten(2, (dim // block.group, block.group))
    else:  # the grouped layout [H, units, D, group] is the transpose of each unit's tokens
        target = out.unflatten(1, (tokens // block.group, block.group)).transpose(-1, -2)
    # Scales and zero points enter as stored: a float32 operand promotes them, exactly, inside the product and the
    # sum (the bits of converting them first, without a conversion kernel per tensor and step).
    if block.mx is not None:
        target.copy_(_mx_values(block))
    elif block.fp8 is not None:
        torch.mul(block.data.float(), block.scale, out=target)
    elif block.zero is None:
        torch.mul(_code_values(block, 2 ** (block.bits - 1)), block.scale, out=target)
    else:
        torch.add(_code_values(block, 0).mul_(block.scale), block.zero, out=target)
    return out


def _with_units(block: QuantizedBlock, fn, units: int) -> QuantizedBlock:
    """``block`` with ``fn`` applied to each stored tensor along the unit dimension, now holding ``units`` units."""
    heads, _, dim = block.shape
    return replace(block, data=fn(block.data), scale=fn(block.scale), zero=None if block.zero is None else fn(block.zero),
                   shape=(heads, units * block.unit, dim))


def _gather_dim1(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if x.dtype in FP8_FORMATS.values():  # no gather kernel for FP8 on CPU: move the same bytes as uint8
        return _gather_dim1(x.view(torch.uint8), index).view(x.dtype)
    return x.gather(1, index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


def gather_units(block: QuantizedBlock, index: torch.Tensor) -> QuantizedBlock:
    """Units ``index[h, j]`` of each head ``h`` (``index`` is ``[H, U']``): codes, scales and zero points as stored."""
    return _with_units(block, lambda t: _gather_dim1(t, index), index.shape[1])


def units_from(block: QuantizedBlock, first: int) -> QuantizedBlock:
    """Units ``first`` onwards of every head, as stored (views, no copy)."""
    return _with_units(block, lambda t: t[:, first:], block.units - first)


def split_units(block: QuantizedBlock, units: list[int]) -> list[QuantizedBlock]:
    """``block`` cut along its units into blocks of ``units[i]`` units each, in order (views, no copy)."""
    parts = [t.split(units, dim=1) if t is not None else [None] * len(units) for t in (block.data, block.scale, block.zero)]
    heads, _, dim = block.shape
    return [replace(block, data=data, scale=scale, zero=zero, shape=(heads, n * block.unit, dim))
            for n, data, scale, zero in zip(units, *parts)]


def concat_blocks(first: QuantizedBlock | None, second: QuantizedBlock) -> QuantizedBlock:
    """``second``'s units after ``first``'s (same encoding)."""
    if first is None:
        return second
    return replace(first, data=torch.cat([first.data, second.data], dim=1), scale=torch.cat([first.scale, second.scale], dim=1),
                   zero=None if first.zero is None else torch.cat([first.zero, second.zero], dim=1),
                   shape=(first.shape[0], first.shape[1] + second.shape[1], first.shape[2]))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit codes (``uint8``, any ``bits`` in 1..8) along the last dim: ``[..., n]`` -> ``[..., ceil(n*bits/8)]``.

    A bit stream, least significant bit first, so widths that do not divide 8
    (3 bits) waste at most the last byte's spare bits per vector. For widths that divide 8 that stream is
    :func:`pack`'s layout, built by whole codes (several times faster than bit by bit).
    """
    if 8 % bits == 0:
        return codes if bits == 8 else _pack_whole_codes(codes, bits)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(*codes.shape[:-1], -1)
    stream = torch.nn.functional.pad(stream, (0, -stream.shape[-1] % 8)).reshape(*codes.shape[:-1], -1, 8)
    return (stream << torch.arange(8, device=codes.device, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[..., bytes]`` -> ``[..., n]`` ``uint8`` codes."""
    if 8 % bits == 0:
        return packed[..., :n] if bits == 8 else _unpack_whole_codes(packed, bits)[..., :n]
    stream = ((packed.unsqueeze(-1) >> torch.arange(8, device=packed.device, dtype=torch.uint8)) & 1)
    stream = stream.reshape(*packed.shape[:-1], -1)[..., : n * bits].reshape(*packed.shape[:-1], n, bits)
    return (stream << torch.arange(bits, device=packed.device, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)
