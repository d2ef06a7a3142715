"""Block-scaled floating-point formats (NVFP4, MXFP4, MXFP8), code for code as torchao 0.18 codes them.

The reference is ``torchao.prototype.mx_formats`` 0.18.0, whose eager (CPU) path is the numerics every test here
is pinned to; the file and function of each rule is named where it is implemented. Rows go in as ``[..., D]``
float32 and are cut into blocks of ``block`` consecutive values along the last dimension; K/V tensors
``[H, T, D]`` are blocked along channels within a token (``axis="token"``) or along tokens within a channel
(``axis="channel"``) by :func:`encode_kv`.

Element and scale codings
-------------------------
* **E2M1** (FP4): sign, 2 exponent bits, 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Coding is round
  to nearest, ties to the even code, saturating at 6 (``custom_fp_utils._f32_to_floatx_unpacked``); the sign bit
  is kept for values that round to 0 (-0.0 and small negatives code as 0x8). Two codes a byte, element ``2i`` in
  the low nibble and ``2i + 1`` in the high one (``kernels.pack_uint4``), as OCP MX and NVIDIA lay them out.
* **E4M3** (``float8_e4m3fn``): torch's cast, round to nearest even, after a clamp to +-448.
* **E8M0** (UE8M0): a biased power of two, ``2**(e - 127)``; 255 is NaN. Two ways to choose it from a block's
  largest magnitude ``amax`` (``mx_tensor.to_mx``, ``ScaleCalculationMode``):

  - ``floor`` (torchao's default, the OCP MX v1.0 rule): ``e = exponent(amax) - emax_elem`` with
    ``emax_elem`` = 2 for E2M1 and 8 for E4M3, clamped to [-127, 128], biased. A block whose largest value's
    mantissa is past the element's largest (6 = 1.5 * 4 for E2M1, 448 = 1.75 * 256 for E4M3) saturates: OCP's
    "clipping". Values are divided by ``max(2**(e - 127), 2**-126)`` (torchao clamps the divisor to the smallest
    normal float32) but read back with ``2**(e - 127)``: an all-zero block codes ``e = 0`` either way.
  - ``rceil`` (cuBLAS's rule for UE8M0, what Blackwell's ``cvt.rp.satfinite.ue8m0x2.f32`` computes):
    ``e = ceil(log2(amax / elem_max))`` clamped to [-127, 127], biased; values are multiplied by
    ``2**(127 - e)`` (by 1 where ``e == 0``), then clamped to +-``elem_max``. The CPU path computes ``log2`` in
    float32, which rounds ``log2`` of a value just past a power of two down to the power, so ``ceil`` can land one
    below the hardware's: torchao's eager numerics (followed here) and the PTX instruction can differ on such
    blocks, and the clamp then saturates their largest value.

Formats
-------
* ``nvfp4``: E2M1, blocks of 16, an E4M3 scale per block (``nvfp4_tensor.nvfp4_quantize``). Without a global
  scale: ``s = e4m3(clamp(amax / 6, 2**-6, 448))``, values ``x * (1 / s)``. With the per-tensor FP32 global scale
  ``g`` (``per_tensor_amax_to_scale``: ``g = amax_tensor / (448 * 6)``): ``s = e4m3(clamp(amax / 6 / g, 2**-6,
  448))``, values ``x * ((1 / g) / s)``; both clamped to +-6 and coded E2M1. Read back as ``code * (g * s)``.
  The block scale never goes below E4M3's smallest normal ``2**-6``: torchao clamps it there, so a subnormal
  E4M3 scale is never produced (a block far below the others codes to zeros, or to the smallest values).
* ``mxfp4``: E2M1, blocks of 32, an E8M0 scale per block.
* ``mxfp8``: E4M3 elements, blocks of 32, an E8M0 scale per block.
* ``fp4_mx_block16``: SGLang's FP4 KV cache (``--kv-cache-dtype fp4_mx_block16``; SGLang 0.5.23,
  ``python/sglang/srt/layers/quantization/kvfp4_tensor.py``, ``FP4MXBlock16KVQuantizeUtil.batched_quantize``):
  E2M1, blocks of 16, an E8M0 scale per block chosen as ``ceil(log2(max(amax / 6, 1e-10)))`` (no clamp to
  [-127, 127]: the floor of 1e-10 keeps it above -34), values divided by ``2**e``, and its own E2M1 rounding
  (:func:`sglang_e2m1_codes`): magnitudes at a midpoint round *up* (``abs >= bound``), and the sign bit is
  ``value < 0``, so -0.0 codes as 0 where torchao codes 8. Read back as ``value * 2**(e - 127)``.

* ``nvfp4_4over6``: NVFP4's layout with "Four over Six" adaptive block scales, as fouroversix 1.0.5's PyTorch
  reference codes it (``fouroversix/quantize/pytorch/reference.py``, ``quantize_to_fp4`` with ``DataType.nvfp4``,
  ``ScaleRule.mse``, round to nearest; :func:`encode_nvfp4_4over6`). The stored FP32 is the tensor's ``amax``; block
  scales use E4M3 up to 256 (not 448), so that a block can also take the scale of ``amax_block / 4``: each block is
  coded both ways (``s6 = e4m3(amax_block / 6 * (1536 / amax))`` and ``s4 = e4m3(that * 1.5)``, no floor, so E4M3
  subnormals and 0 occur), values ``x * (1 / ((1 / (1536 / amax)) * s))`` rounded to E2M1 with ``torch.round``
  (ties to even) on the grids of step 0.5, 1 and 2, and the candidate with the smaller squared error of
  ``value * s * amax / 1536`` is kept (ties keep the /6 one). Read back as ``(value * s) * amax / 1536``. Where a
  subnormal scale rounds down by more than E2M1's headroom the reference's rounding reaches 8, which its bfloat16
  bit-trick packer stores as code 8 (-0): followed here, bit for bit.

A row whose length is not a multiple of the block is refused: torchao asserts it (``to_mx``: "the last dimension
... must be divisible by block_size"; ``nvfp4_quantize``: "K dim must be divisible by block_size"), and vLLM's
NVFP4 cache sizes a head as ``head_size // 2 + head_size // 16`` bytes (``vllm/utils/torch_utils.py``,
``nvfp4_kv_cache_full_dim``), which only holds whole blocks. Neither engine pads.

Bytes stored per row of ``D`` values: ``D * bits / 8`` codes + ``D / block`` one-byte scales (+ 4 bytes per
global scale, counted once per tensor that shares it): NVFP4 ``D/2 + D/16`` (72 bytes for D = 128), MXFP4
``D/2 + D/32`` (68), MXFP8 ``D + D/32`` (132).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kveval.lazy import torch

from kveval.errors import UsageError
from kveval.tensors.mx_format import (  # re-exported: the formats and their bytes are torch-free
    AXES, E2M1, E2M1_MAX, E4M3, E4M3_MAX, FORMATS, FOUROVERSIX_SCALE_MAX, FP4_MX_BLOCK16, GLOBAL_SCALE_BYTES, MXFP4,
    MXFP8, NVFP4, NVFP4_4OVER6, ElementCoding, MicroscalingFormat, bytes_per_token_head,
)

#: E4M3's smallest normal value (``torch.finfo(torch.float8_e4m3fn).tiny``): torchao's floor for NVFP4 block scales.
E4M3_TINY = 2.0**-6
E8M0_BIAS = 127
E8M0_NAN = 255
#: float32's smallest normal value: torchao's floor for the E8M0 divisor (``F32_MIN_NORMAL``).
F32_MIN_NORMAL = 2.0**-126
#: The E2M1 magnitudes, by code (sign bit clear).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Midpoints between consecutive E2M1 magnitudes: a tie goes to the even code (ties at 0.25, 1.25, 2.5 and 5 go
#: down to codes 0, 2, 4, 6; those at 0.75, 1.75 and 3.5 go up to 2, 4, 6).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class ScaleRule(Enum):
    """How an E8M0 block scale is chosen from the block's largest magnitude (torchao's ``ScaleCalculationMode``)."""

    FLOOR = "floor"
    RCEIL = "rceil"




# --- element codings ---------------------------------------------------------------------------------------
def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> 4-bit E2M1 codes (``uint8``, sign in bit 3): round to nearest, ties to even, saturating at 6.
    The sign bit is the input's, so -0.0 and negatives that round to zero code as 8 (as torchao's cast does)."""
    a = x.float().abs()
    magnitude = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        # code i+1 is above midpoint i; a tie rounds up only when i+1 is the even code
        magnitude += ((a >= mid) if i % 2 else (a > mid)).to(torch.uint8)
    return magnitude | (torch.signbit(x).to(torch.uint8) << 3)


def sglang_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """SGLang's E2M1 coding (``FP4MXBlock16KVQuantizeUtil.batched_quantize``): the magnitude code counts the
    midpoints at or below ``abs(x)`` (ties round up, past 6 saturates), the sign bit is ``x < 0``."""
    a = x.float().abs()
    magnitude = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid in _E2M1_MIDPOINTS:
        magnitude += (a >= mid).to(torch.uint8)
    return magnitude | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes -> float32 (code 8 reads back as -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` 4-bit codes (``n`` even) -> ``[..., n / 2]`` bytes: element ``2i`` low nibble, ``2i + 1`` high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> ``float8_e4m3fn`` bits (``uint8``): clamped to +-448, then torch's round-to-nearest-even cast."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


def _element_codes(x: torch.Tensor, element: ElementCoding) -> torch.Tensor:
    """Scaled values -> stored code bytes: E2M1 packed two a byte (it saturates itself), E4M3 one a byte."""
    return pack_e2m1(e2m1_codes(x)) if element is E2M1 else e4m3_codes(x)


def _element_values(codes: torch.Tensor, element: ElementCoding) -> torch.Tensor:
    return e2m1_values(unpack_e2m1(codes)) if element is E2M1 else e4m3_values(codes)


# --- E8M0 scales -------------------------------------------------------------------------------------------
def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> float32 ``2**(e - 127)`` (``mx_tensor.get_fp_scale``): code 0 is ``2**-127``, a float32
    subnormal, and 255 is NaN. Built from the bits, so exact."""
    e = codes.to(torch.int32)
    normal = (e << 23).view(torch.float32)
    values = torch.where(e == 0, torch.tensor(2.0**-127, dtype=torch.float32, device=codes.device), normal)
    return torch.where(e == E8M0_NAN, torch.tensor(float("nan"), device=codes.device), values)


def _e8m0_floor(amax: torch.Tensor, element: ElementCoding) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP's rule (``to_mx``, ``ScaleCalculationMode.FLOOR``): codes, and the float32 divisor of the values."""
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127  # a subnormal amax counts as 2**-127
    unbiased = (exponent - element.largest_pow2).clamp(-E8M0_BIAS, E8M0_BIAS + 1)
    codes = torch.where(torch.isnan(amax), E8M0_NAN, unbiased + E8M0_BIAS).to(torch.uint8)
    divisor = (codes.to(torch.int32) << 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)
    return codes, divisor


def _e8m0_rceil(amax: torch.Tensor, element: ElementCoding) -> tuple[torch.Tensor, torch.Tensor]:
    """cuBLAS's rule as torchao's eager path computes it (``mx_tensor._to_mx_rceil``): codes, and the float32
    factor the values are multiplied by."""
    descale = amax / element.largest
    exponent = (torch.ceil(torch.log2(descale)).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    special = torch.where(torch.isinf(descale), 254, exponent)
    codes = torch.where(torch.isnan(descale), E8M0_NAN, special).to(torch.uint8)
    one = torch.ones_like(descale)
    factor = torch.where(codes == 0, one, torch.exp2(E8M0_BIAS - codes.to(torch.float32)))
    factor = torch.where(codes == 254, one * 2.0**-127, factor)
    return codes, torch.where(codes == E8M0_NAN, descale, factor)


# --- rows --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MicroscaledRows:
    """Rows ``[..., D]`` in a block-scaled format, as stored.

    ``codes``: ``[..., D * bits / 8]`` ``uint8``; ``scales``: ``[..., D / block]`` ``uint8`` (E4M3 or E8M0 bits);
    ``global_scale``: NVFP4's FP32 second level (a tensor broadcastable against ``[..., D / block]``: one element
    per tensor, or per head), ``None`` without one."""

    format: MicroscalingFormat
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    dim: int

    @property
    def nbytes(self) -> int:
        """Every stored byte: codes, block scales, and global scales (4 bytes each)."""
        extra = 0 if self.global_scale is None else self.global_scale.numel() * GLOBAL_SCALE_BYTES
        return self.codes.numel() + self.scales.numel() + extra


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """NVFP4's per-tensor scale from the tensor's largest magnitude (``nvfp4_tensor.per_tensor_amax_to_scale``):
    ``amax / (448 * 6)`` in float32, so that the block with the tensor's largest value gets scale 448."""
    return torch.as_tensor(amax).to(torch.float32) / (E4M3_MAX * E2M1_MAX)


def encode_rows(x: torch.Tensor, fmt: MicroscalingFormat, global_scale: torch.Tensor | None = None,
                rule: ScaleRule = ScaleRule.FLOOR) -> MicroscaledRows:
    """Code rows ``[..., D]`` (float32, or bfloat16 widened first as torchao does) in ``fmt``.

    ``global_scale``: NVFP4 only; ``None`` codes one level (E4M3 block scales of the raw values), as torchao does
    when no per-tensor scale is given. ``rule``: the E8M0 scale rule of the MX formats."""
    dim = x.shape[-1]
    fmt.check_length(dim)
    if global_scale is not None and not fmt.global_scale:
        raise UsageError(f"{fmt.name} has no global scale")
    blocks = x.float().reshape(*x.shape[:-1], dim // fmt.block, fmt.block)
    amax = blocks.abs().amax(dim=-1)
    if fmt.scale == "e4m3":  # nvfp4_tensor.nvfp4_quantize
        block_scale = amax / E2M1_MAX
        if global_scale is None:
            scale_codes = e4m3_codes(block_scale.clamp(min=E4M3_TINY))
            factor = 1.0 / e4m3_values(scale_codes)
        else:
            g = global_scale.to(torch.float32)
            scale_codes = e4m3_codes((block_scale / g).clamp(min=E4M3_TINY))
            factor = (1.0 / g) / e4m3_values(scale_codes)
        scaled = (blocks * factor.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    elif rule is ScaleRule.FLOOR:  # mx_tensor.to_mx
        scale_codes, divisor = _e8m0_floor(amax, fmt.element)
        scaled = blocks / divisor.unsqueeze(-1)
        if fmt.element is E4M3:
            scaled = scaled.clamp(-E4M3_MAX, E4M3_MAX)
    else:
        scale_codes, factor = _e8m0_rceil(amax, fmt.element)
        scaled = (blocks * factor.unsqueeze(-1)).clamp(-fmt.element.largest, fmt.element.largest)
    codes = _element_codes(scaled.reshape(x.shape), fmt.element)
    return MicroscaledRows(fmt, codes, scale_codes, None if global_scale is None else global_scale.to(torch.float32),
                           dim)


def encode_sglang_fp4_mx_block16(x: torch.Tensor) -> MicroscaledRows:
    """Rows ``[..., D]`` as SGLang's ``fp4_mx_block16`` KV cache codes them (see the module docstring); decoded by
    :func:`decode_rows`. Computed in float32 (SGLang computes in the KV dtype; pass float32 rows that the model dtype
    holds exactly, e.g. bfloat16 values widened, for its bits: its division by a power of two is then exact)."""
    dim = x.shape[-1]
    FP4_MX_BLOCK16.check_length(dim)
    blocks = x.float().reshape(*x.shape[:-1], dim // FP4_MX_BLOCK16.block, FP4_MX_BLOCK16.block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(torch.clamp(amax / E2M1_MAX, min=1e-10)))
    codes = pack_e2m1(sglang_e2m1_codes((blocks / torch.exp2(exponent)).reshape(x.shape)))
    return MicroscaledRows(FP4_MX_BLOCK16, codes, (exponent + E8M0_BIAS).squeeze(-1).to(torch.uint8), None, dim)


def _fouroversix_round(v: torch.Tensor) -> torch.Tensor:
    """fouroversix's ``fake_quantize_to_e2m1`` (round to nearest): ``torch.round`` on the grid of step 0.5 below 2,
    1 below 4, 2 above, no clamp (so values past 7 round to 8)."""
    a = v.abs()
    grid = torch.where(a < 2, torch.round(2 * a) / 2, torch.where(a < 4, torch.round(a), 2 * torch.round(a / 2)))
    return v.sign() * grid


def _fouroversix_codes(v: torch.Tensor) -> torch.Tensor:
    """fouroversix's ``quantize_bf16_to_unpacked_fp4``: E2M1 codes read off bfloat16 bits (exact for E2M1 values;
    8 carries into the sign bit, as there)."""
    bits = v.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    sign, exponent, mantissa = (bits >> 15) & 1, (bits >> 7) & 0xFF, bits & 0x7F
    zero = (exponent == 0) & (mantissa == 0)
    mantissa = torch.where((exponent == 126) & ((mantissa >> 6) & 1 == 0), 1, (mantissa >> 6) & 1)
    exponent = torch.where(zero, 0, exponent - 126)
    mantissa = torch.where(zero, 0, mantissa)
    return ((sign << 3) | (exponent << 1) | mantissa).to(torch.uint8)


def encode_nvfp4_4over6(x: torch.Tensor, amax: torch.Tensor | None = None) -> MicroscaledRows:
    """Rows ``[..., D]`` as fouroversix 1.0.5 codes NVFP4 with Four over Six block scales (see the module docstring);
    ``amax``: the tensor's largest magnitude (by default this tensor's, as the reference computes it)."""
    dim = x.shape[-1]
    NVFP4_4OVER6.check_length(dim)
    blocks = x.float().reshape(-1, NVFP4_4OVER6.block)
    amax = (x.abs().max().float() if amax is None else torch.as_tensor(amax, dtype=torch.float32)).reshape(())
    span = torch.tensor(E2M1_MAX * FOUROVERSIX_SCALE_MAX)
    block_max = blocks.abs().amax(dim=-1)
    if amax == 0:
        scale6 = torch.zeros_like(block_max)
    else:
        scale6 = block_max / torch.tensor(E2M1_MAX) * (span / amax)
    decode = 1 / (span / amax)
    candidates = []
    for scale_hp in (scale6, scale6 * 1.5):
        scale = scale_hp.to(torch.float8_e4m3fn).float().unsqueeze(-1)
        scaled = torch.where(scale != 0, blocks * (1 / (decode * scale)), 0)
        values = _fouroversix_round(scaled)
        error = ((values * scale * amax / span - blocks) ** 2).sum(dim=-1, keepdim=True)
        candidates.append((values, scale, error))
    (values6, scale6, error6), (values4, scale4, error4) = candidates
    four = error4 < error6
    values = torch.where(four, values4, values6).reshape(*x.shape[:-1], dim)
    scales = e4m3_codes(torch.where(four, scale4, scale6)).reshape(*x.shape[:-1], dim // NVFP4_4OVER6.block)
    return MicroscaledRows(NVFP4_4OVER6, pack_e2m1(_fouroversix_codes(values)), scales, amax, dim)


def block_scales(rows: MicroscaledRows) -> torch.Tensor:
    """Each block's scale as float32, the global scale folded in (NVFP4: ``g * s``, torchao's ``get_hp_scales``)."""
    if rows.format.scale == "ue8m0":
        return e8m0_values(rows.scales)
    scales = e4m3_values(rows.scales)
    return scales if rows.global_scale is None else rows.global_scale * scales


def decode_rows(rows: MicroscaledRows) -> torch.Tensor:
    """Rows back as float32: ``element value * block scale`` in float32 (``NVFP4Tensor.dequantize``,
    ``mx_tensor.to_dtype``); cast to the model's dtype after."""
    fmt = rows.format
    values = _element_values(rows.codes, fmt.element)
    lead = values.shape[:-1]
    if fmt is NVFP4_4OVER6:  # fouroversix's dequantize: (value * s) * amax / (6 * 256)
        blocks = values.reshape(*lead, rows.dim // fmt.block, fmt.block) * e4m3_values(rows.scales).unsqueeze(-1)
        return (blocks.reshape(*lead, rows.dim) * rows.global_scale / (E2M1_MAX * FOUROVERSIX_SCALE_MAX))
    blocks = values.reshape(*lead, rows.dim // fmt.block, fmt.block) * block_scales(rows).unsqueeze(-1)
    return blocks.reshape(*lead, rows.dim)


# --- K/V tensors -------------------------------------------------------------------------------------------


def _rows_view(x: torch.Tensor, axis: str) -> torch.Tensor:
    """``[H, T, D]`` as the rows that are blocked: ``[H, T, D]`` (token: channels within a token) or ``[H, D, T]``
    (channel: tokens within a channel, the caller keeping tokens past the last whole block in full precision)."""
    if axis not in AXES:
        raise UsageError(f"unknown block axis {axis!r} (one of {', '.join(AXES)})")
    return x if axis == "token" else x.transpose(-1, -2).contiguous()


def encode_kv(x: torch.Tensor, fmt: MicroscalingFormat, axis: str = "token", global_scale: torch.Tensor | None = None,
              rule: ScaleRule = ScaleRule.FLOOR) -> MicroscaledRows:
    """Code K or V ``[H, T, D]`` with blocks along ``axis``."""
    return encode_rows(_rows_view(x, axis), fmt, global_scale, rule)


def decode_kv(rows: MicroscaledRows, axis: str = "token") -> torch.Tensor:
    """Inverse of :func:`encode_kv`: ``[H, T, D]`` float32."""
    values = decode_rows(rows)
    return values if axis == "token" else values.transpose(-1, -2)
