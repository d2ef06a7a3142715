"""vLLM 0.33's per-token-head KV caches (``--kv-cache-dtype int8_per_token_head | fp8_per_token_head |
int4_per_token_head``), read from vLLM's own Python/Triton sources (its kernels cannot run here).

Every token's head row ``[D]`` gets one float32 scale, computed dynamically when the row is written (no checkpoint
or calibration scale is involved).

* ``int8`` / ``fp8`` (``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``,
  ``_reshape_cache_per_token_head``): ``scale = max(amax / QUANT_MAX, 1e-6)`` with ``QUANT_MAX`` 127 (int8) or
  448 (fp8 e4m3 on CUDA; 240 on ROCm's fnuz, not modelled), values ``x * (1 / scale)``; int8 adds +-0.5 (half away
  from zero), clamps to ``[-128, 127]`` and truncates on the store; fp8 clamps to +-448 and the store rounds to
  nearest even. Stored: D codes + a float32 scale: ``D + 4`` bytes per token and head. Read back as
  ``code * scale``.
* ``int4`` (``vllm/v1/attention/ops/int4_per_token_head.py``, ``reshape_and_cache_int4``,
  ``_reshape_cache_int4_kernel``): the row is first rotated, ``single_rht``: random signs ``d1`` (a fixed
  ``torch.bernoulli`` draw seeded ``0x9E3779B9``), then an unnormalized Walsh-Hadamard transform in blocks of ``b``
  = the largest power of two dividing D, computed in float32 and cast back to the model dtype. Then asymmetric
  4-bit: ``scale = max((max - min) / 15, 1e-6)``, zero point ``zp = clamp(round_half_away(-min / scale), 0, 15)``,
  codes ``clamp(round_half_away(x * (1 / scale) + zp), 0, 15)``, even elements in the low nibble; the zero point
  is hidden in the scale's 4 low mantissa bits (``(bits(scale) & ~15) | zp``), so the scale read back is the
  stored one with those bits cleared. Stored: ``D / 2 + 4`` bytes per token and head. Read back (inside the
  attention kernel) as ``(code - zp) * scale`` in the rotated space; the rotation is undone on the output, which
  is the same as reading K/V back as ``single_rht((code - zp) * scale, inverse=True) / b``.

The GPU's Triton division ``/`` and the Hadamard kernels (hadacore, in bfloat16, on sm_80+) may round differently
from the float32 CPU arithmetic here; what is pinned is vLLM's CPU fallback (its PyTorch butterfly).
"""

from __future__ import annotations

from kveval.lazy import torch

from kveval.errors import UsageError

PER_TOKEN_HEAD_KINDS = ("int8", "fp8", "int4")
SCALE_FLOOR = 1e-6
#: ``_get_rht_signs``'s seed for rotation round 0.
RHT_SEED = 0x9E3779B9
#: Bytes of the float32 scale stored per token and head.
SCALE_BYTES = 4


def bytes_per_token_head(kind: str, head_dim: int) -> int:
    """Bytes one token of one head stores: codes and the float32 scale."""
    if kind not in PER_TOKEN_HEAD_KINDS:
        raise UsageError(f"unknown per-token-head kind {kind!r} (one of {', '.join(PER_TOKEN_HEAD_KINDS)})")
    if kind == "int4" and head_dim % 2:
        raise UsageError(f"int4_per_token_head packs two values a byte; a head dimension of {head_dim} is odd")
    return (head_dim // 2 if kind == "int4" else head_dim) + SCALE_BYTES


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """``(v >= 0 ? v + 0.5 : v - 0.5)`` truncated toward zero, as the kernels' ``.to(tl.int32)`` does."""
    return torch.where(v >= 0, v + 0.5, v - 0.5).trunc()


def quantize_int8_fp8(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., D]`` -> (codes ``[..., D]`` ``uint8`` (int8 two's complement or e4m3 bits), scales ``[...]``
    float32)."""
    x = x.float()
    largest = 127.0 if kind == "int8" else torch.finfo(torch.float8_e4m3fn).max
    scale = torch.clamp(x.abs().amax(dim=-1) / largest, min=SCALE_FLOOR)
    q = x * (1.0 / scale).unsqueeze(-1)
    if kind == "int8":
        q = torch.where(q >= 0, q + 0.5, q - 0.5).clamp(-128.0, 127.0).trunc()
        return q.to(torch.int8).view(torch.uint8), scale
    if kind != "fp8":
        raise UsageError(f"quantize_int8_fp8 codes int8 or fp8, not {kind!r}")
    return q.clamp(-largest, largest).to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_int8_fp8(codes: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    values = codes.view(torch.int8 if kind == "int8" else torch.float8_e4m3fn).float()
    return values * scale.unsqueeze(-1)


def rht_signs(dim: int) -> torch.Tensor:
    """``_get_rht_signs(dim, 0)``: a fixed vector of +-1.0 (float32)."""
    generator = torch.Generator(device="cpu").manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((dim,), 0.5), generator=generator) - 1.0


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """vLLM's PyTorch butterfly (``fast_hadamard_transform``'s third tier): the unnormalized transform of the last
    dimension, a power of two."""
    d = x.shape[-1]
    h = 1
    while h < d:
        xv = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([xv[..., 0, :] + xv[..., 1, :], xv[..., 0, :] - xv[..., 1, :]], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rht_block(dim: int) -> int:
    """The rotation's block: the largest power of two dividing ``dim`` (``largest_power_of_2_divisor``)."""
    return dim & -dim


def single_rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``single_rht``: ``H (d1 * x)`` (forward) or ``d1 * (H x)`` (inverse), block-diagonal in blocks of
    :func:`rht_block`; float32 in, float32 out."""
    d = x.shape[-1]
    block = rht_block(d)
    if block < d:
        lead = x.shape[:-1]
        return single_rht(x.reshape(*lead, d // block, block), inverse).reshape(*lead, d)
    signs = rht_signs(d).to(x.device)
    return _hadamard(x) * signs if inverse else _hadamard(x * signs)


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., D]`` in the model's dtype -> (packed codes ``[..., D / 2]`` ``uint8``, scales ``[...]`` float32
    with the zero point in their 4 low mantissa bits), as ``reshape_and_cache_int4`` stores them."""
    bytes_per_token_head("int4", x.shape[-1])
    rotated = single_rht(x.float()).to(x.dtype).float()
    lo, hi = rotated.amin(dim=-1), rotated.amax(dim=-1)
    scale = torch.clamp((hi - lo) / 15.0, min=SCALE_FLOOR)
    zp = _round_half_away(-lo / scale).clamp(0.0, 15.0)
    q = _round_half_away(rotated * (1.0 / scale).unsqueeze(-1) + zp.unsqueeze(-1)).clamp(0.0, 15.0).to(torch.uint8)
    packed = (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)
    stored = ((scale.view(torch.int32) & -16) | zp.to(torch.int32)).view(torch.float32)
    return packed, stored


def dequantize_int4(packed: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """K/V rows as attention over the INT4 cache sees them: ``(code - zp) * scale`` rotated back (``single_rht``
    inverse, divided by the rotation's norm ``b``), float32."""
    bits = stored.view(torch.int32)
    zp = (bits & 0xF).float()
    scale = (bits & -16).view(torch.float32)
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
    rotated = (q - zp.unsqueeze(-1)) * scale.unsqueeze(-1)
    return single_rht(rotated, inverse=True) / rht_block(q.shape[-1])
