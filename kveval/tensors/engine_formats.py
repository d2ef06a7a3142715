"""Serving engines' KV-cache storage formats, code for code: llama.cpp's ggml blocks and per-tensor FP8/INT8.

Every format codes each token's head row alone (``[..., D]`` in, codes per row out), so eviction gathers rows
and never re-encodes. Encoders take float32 rows (what the engines quantize: llama.cpp's K/V are float32 before
``ggml_set_rows``; vLLM's kernels convert each value to float before dividing by the scale) and return the bytes
the engine stores; decoders return float32.

llama.cpp (``ggml/src/ggml-quants.c``, ``quantize_row_*_ref`` and ``dequantize_row_*``; the ``gguf`` package's
``gguf.quants`` is a bit-exact numpy port of the same functions, which the tests compare against):

* ``q8_0``: blocks of 32, ``d = amax / 127`` (float32), ``id = 1 / d`` (0 when ``d == 0``), codes
  ``roundf(x * id)`` (half away from zero) as int8; stored: float16 ``d`` then 32 codes (34 bytes).
* ``q4_0``: ``max`` = the value of largest magnitude (the first such), ``d = max / -8``, codes
  ``min(15, trunc(x * id + 8.5))``, read back as ``(q - 8) * d``; float16 ``d`` + 16 bytes (values ``j`` and
  ``j + 16`` share byte ``j``, low nibble first): 18 bytes.
* ``q4_1``: ``d = (max - min) / 15``, codes ``min(15, trunc((x - min) * id + 0.5))``, read back as
  ``q * d + m``; float16 ``d`` and ``m`` + 16 bytes: 20 bytes.
* ``q5_0``/``q5_1``: as ``q4_0``/``q4_1`` with 32 levels (``max / -16`` with offset 16.5; ``/ 31``); the fifth
  bits of the 32 codes form a little-endian ``uint32`` ``qh`` stored before the nibbles: 22 and 24 bytes.
* ``f16``/``bf16``: the row cast (round to nearest even).

Per-tensor FP8 and INT8 (one float32 scale per layer for K, one for V):

* ``saturating`` FP8 (vLLM, ``csrc/quantization/fp8/nvidia/quant_utils.cuh``, ``scaled_vec_conversion<uint8_t,
  float>``): ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)``, round to nearest even, values past the
  format's largest finite value clamped to it.
* ``torch-cast`` FP8 (SGLang, ``python/sglang/srt/mem_cache/memory_pool.py``, ``MHATokenToKVPool.set_kv_buffer``):
  ``cache_k.div_(k_scale)`` in the model dtype, then ``cache_k.to(fp8)``: the quotient is rounded to the model dtype
  first (two roundings), then torch's own cast, whatever it does past the format's range in the torch that runs it
  (c10's conversion gave NaN past 464 for e4m3fn; torch 2.13 on a CPU saturates e4m3fn, and e5m2 gives inf).
* INT8 (TensorRT-LLM): ``x * (1 / scale)`` in float32, then ``cvt.rni.sat.s8.f32``: round to nearest even,
  saturate to ``[-128, 127]``.
"""

from __future__ import annotations

import torch

GGML_BLOCK = 32
#: ggml cache type -> bytes per block of 32 values (``ggml_type_size``).
GGML_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "f16": 64, "bf16": 64, "f32": 128}
GGML_TYPES = tuple(GGML_BLOCK_BYTES)
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def ggml_row_bytes(kind: str, dim: int) -> int:
    """Bytes llama.cpp stores for one row of ``dim`` values of cache type ``kind`` (``dim`` a multiple of 32 for
    the block types)."""
    if kind in ("f16", "bf16", "f32"):
        return dim * GGML_BLOCK_BYTES[kind] // GGML_BLOCK
    return dim // GGML_BLOCK * GGML_BLOCK_BYTES[kind]


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: to nearest, halves away from zero (float32 in, float32 out; every step exact)."""
    a = v.abs()
    floored = a.floor()
    return torch.copysign(floored + (2 * (a - floored)).floor(), v)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1.0f / d : 0.0f`` in float32."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., 1]`` float32 -> ``[..., 2]`` bytes of its float16 (``GGML_FP32_TO_FP16``: round to nearest even)."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[..., 32]`` codes -> ``[..., 16]`` bytes: value ``j`` in the low nibble of byte ``j``, ``j + 16`` in the high."""
    return (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """``[..., 32]`` 5-bit codes -> ``[..., 4]``: their fifth bits as a little-endian ``uint32`` (bit ``j`` = code ``j``)."""
    bits = ((q >> 4) & 1).reshape(*q.shape[:-1], 4, 8).to(torch.int32)
    return (bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)


def _signed_max(b: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude of each block (the first one on ties), ``[..., 1]``."""
    return b.gather(-1, b.abs().argmax(dim=-1, keepdim=True))


def ggml_quantize(x: torch.Tensor, kind: str, x86: bool = False) -> torch.Tensor:
    """Rows ``[..., D]`` (float32) -> ``[..., row bytes]`` uint8, exactly as llama.cpp's reference quantizer
    (``quantize_row_<kind>_ref``) lays out ``D / 32`` blocks.

    ``x86``: ``q8_0`` as ggml's CPU ``from_float`` codes it on an x86 build with AVX (``ggml/src/ggml-cpu/arch/x86/
    quants.c``, ``quantize_row_q8_0``): ``id = 127 / amax`` rather than ``1 / d``, and ``_mm256_round_ps(...,
    _MM_ROUND_NEAREST)``, halves to even. The other types' CPU ``from_float`` is the reference function."""
    x = x.float()
    if kind == "f32":
        return x.contiguous().view(torch.uint8)
    if kind in ("f16", "bf16"):
        return x.to(torch.float16 if kind == "f16" else torch.bfloat16).contiguous().view(torch.uint8)
    if kind not in GGML_BLOCK_BYTES:
        raise ValueError(f"unknown ggml cache type {kind!r}")
    lead, dim = x.shape[:-1], x.shape[-1]
    b = x.reshape(*lead, dim // GGML_BLOCK, GGML_BLOCK)
    if kind == "q8_0":
        amax = b.abs().amax(dim=-1, keepdim=True)
        d = amax / 127
        if x86:
            inverse = torch.where(amax == 0, torch.zeros_like(amax), 127 / torch.where(amax == 0, torch.ones_like(amax), amax))
            q = torch.round(b * inverse).to(torch.int8).view(torch.uint8)  # torch.round: half to even
        else:
            q = _roundf(b * _inverse(d)).to(torch.int8).view(torch.uint8)
        parts = [_f16_bytes(d), q]
    elif kind in ("q4_0", "q5_0"):
        half = 8 if kind == "q4_0" else 16
        d = _signed_max(b) / -half
        q = (b * _inverse(d) + (half + 0.5)).trunc().clamp(0, 2 * half - 1).to(torch.uint8)
        parts = [_f16_bytes(d)] + ([_high_bits(q)] if kind == "q5_0" else []) + [_nibbles(q)]
    else:  # q4_1, q5_1
        levels = 15 if kind == "q4_1" else 31
        lo, hi = b.amin(dim=-1, keepdim=True), b.amax(dim=-1, keepdim=True)
        d = (hi - lo) / levels
        q = ((b - lo) * _inverse(d) + 0.5).trunc().clamp(0, levels).to(torch.uint8)
        parts = [_f16_bytes(d), _f16_bytes(lo)] + ([_high_bits(q)] if kind == "q5_1" else []) + [_nibbles(q)]
    return torch.cat(parts, dim=-1).reshape(*lead, -1)


def ggml_dequantize(raw: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    """``[..., row bytes]`` -> ``[..., dim]`` float32, as ``dequantize_row_<kind>`` reads it back."""
    raw = raw.contiguous()
    if kind == "f32":
        return raw.view(torch.float32)
    if kind in ("f16", "bf16"):
        return raw.view(torch.float16 if kind == "f16" else torch.bfloat16).float()
    lead = raw.shape[:-1]
    blocks = raw.reshape(*lead, dim // GGML_BLOCK, GGML_BLOCK_BYTES[kind])

    def f16(offset: int) -> torch.Tensor:
        return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()

    if kind == "q8_0":
        values = blocks[..., 2:].contiguous().view(torch.int8).float() * f16(0)
        return values.reshape(*lead, dim)
    minimum = kind in ("q4_1", "q5_1")
    start = 4 if minimum else 2
    five = kind in ("q5_0", "q5_1")
    nib = blocks[..., start + (4 if five else 0):]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).to(torch.int32)
    if five:
        qh = blocks[..., start:start + 4].to(torch.int32)
        bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
        q = q | (bits.reshape(*qh.shape[:-1], 32) << 4)
    d = f16(0)
    if minimum:
        values = q.float() * d + f16(2)
    else:
        values = (q - (16 if five else 8)).float() * d
    return values.reshape(*lead, dim)


#: ggml's ``vec_dot_type`` of each cache type (``ggml/src/ggml-cpu/ggml-cpu.c``, ``type_traits_cpu``): the type
#: ggml converts the other operand (Q) to before a dot product with rows of that type.
GGML_VEC_DOT_TYPE = {"q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1",
                     "f16": "f16", "bf16": "bf16", "f32": "f32"}


def ggml_query(q: torch.Tensor, k_type: str, x86: bool = False) -> torch.Tensor:
    """Rows ``[..., D]`` as a dot product with ``k_type`` rows takes them: converted to its ``vec_dot_type`` and read
    back in float32. ``q8_1``'s ``d`` and codes are ``q8_0``'s (``quantize_row_q8_1_ref``); its per-block sum, kept
    in float16 for the minimum term of ``q4_1``/``q5_1`` dot products, is not modelled (the exact sum is used)."""
    kind = GGML_VEC_DOT_TYPE[k_type]
    if kind == "f32":
        return q
    if kind in ("q8_0", "q8_1"):
        return ggml_dequantize(ggml_quantize(q.float(), "q8_0", x86), "q8_0", q.shape[-1]).to(q.dtype)
    return q.to(torch.float16 if kind == "f16" else torch.bfloat16).to(q.dtype)


# --- per-tensor FP8 / INT8 ---------------------------------------------------------------------------------
def fp8_saturating(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """vLLM's cache write: ``x / scale`` in float32, cast to FP8 with ``__NV_SATFINITE`` (round to nearest even,
    clamped to the largest finite value). Codes as ``uint8``."""
    dtype = FP8_DTYPES[fmt]
    largest = torch.finfo(dtype).max
    q = (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp(-largest, largest)
    return q.to(dtype).view(torch.uint8)


def fp8_torch_cast(x: torch.Tensor, scale: float | None, fmt: str, model_dtype: torch.dtype) -> torch.Tensor:
    """SGLang's cache write: ``x`` in the model dtype, divided in place by ``scale`` when one is set (the quotient
    rounded to the model dtype), then torch's own cast (past the range: whatever this torch's cast gives)."""
    y = x.to(model_dtype)
    if scale is not None:
        y = y / scale
    return y.to(FP8_DTYPES[fmt]).view(torch.uint8)


def fp8_decode(codes: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """``float(code) * scale`` in float32."""
    return codes.view(FP8_DTYPES[fmt]).float() * torch.tensor(scale, dtype=torch.float32)


def int8_saturating(x: torch.Tensor, scale: float) -> torch.Tensor:
    """TensorRT-LLM's INT8 cache write: ``x * (1 / scale)`` in float32, round to nearest even (``rni``),
    saturate to ``[-128, 127]``. Codes as ``uint8`` (two's complement)."""
    inverse = 1 / torch.tensor(scale, dtype=torch.float32)
    q = torch.round(x.float() * inverse).clamp(-128, 127)  # torch.round: half to even
    return q.to(torch.int8).view(torch.uint8)


def int8_decode(codes: torch.Tensor, scale: float) -> torch.Tensor:
    """``float(code) * scale`` in float32."""
    return codes.view(torch.int8).float() * torch.tensor(scale, dtype=torch.float32)


# --- NVFP4 as FlashInfer writes vLLM's cache ----------------------------------------------------------------
def flashinfer_nvfp4_encode(x: torch.Tensor, global_scale: float):
    """Rows ``[..., D]`` as vLLM 0.33's ``--kv-cache-dtype nvfp4`` cache holds them, following FlashInfer
    0.7.2.post1 (the version vLLM 0.33 pins), ``include/flashinfer/page.cuh``, ``nvfp4_append_quantize_block``
    (called by ``nvfp4_quantize_append_paged_kv_cache_with_slot_mapping``, vLLM's writer on SM 8x/9x/12x):

    * per block of 16: ``amax = max |x|`` (float32), ``sf = amax / (6 * g)`` (0 where ``amax`` or ``g`` is 0),
      stored as E4M3 by ``__nv_fp8_e4m3(sf)`` (round to nearest even, saturating at 448; no floor, so subnormal
      E4M3 scales occur, unlike torchao, which clamps them at ``2**-6``);
    * values ``x * (1 / (e4m3(sf) * g))`` (0 where the scale is 0), coded E2M1 by ``nvfp4_append_quantize_e2m1``:
      round to nearest with ties to the even code, past 5 to 6, the sign bit from ``signbit`` (torchao's rule,
      :func:`~kveval.tensors.microscaling.e2m1_codes`).

    ``g`` is the layer's ``k_scale``/``v_scale`` (the checkpoint's, else 1.0). Read back as ``code * (g * s)``
    (:func:`~kveval.tensors.microscaling.decode_rows`), the order of torchao's ``get_hp_scales``: the attention
    kernels that read the cache are compiled and their order of the two multiplications is not pinned."""
    from kveval.tensors import microscaling as ms

    dim = x.shape[-1]
    ms.NVFP4.check_length(dim)
    g = torch.tensor(global_scale, dtype=torch.float32)
    blocks = x.float().reshape(*x.shape[:-1], dim // ms.NVFP4.block, ms.NVFP4.block)
    amax = blocks.abs().amax(dim=-1)
    live = (amax > 0) & (g > 0)
    sf = torch.where(live, amax / (torch.tensor(ms.E2M1_MAX) * g), torch.zeros_like(amax))
    scale_codes = ms.e4m3_codes(sf)
    rounded = ms.e4m3_values(scale_codes)
    live = live & (rounded > 0)
    output = torch.where(live, 1.0 / torch.where(live, rounded * g, torch.ones_like(rounded)), torch.zeros_like(rounded))
    codes = ms.pack_e2m1(ms.e2m1_codes((blocks * output.unsqueeze(-1)).reshape(x.shape)))
    return ms.MicroscaledRows(ms.NVFP4, codes, scale_codes, g, dim)
