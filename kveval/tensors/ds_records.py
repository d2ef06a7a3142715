"""DeepSeek's per-token cache records as vLLM 0.33 writes them: ``fp8_ds_mla``, ``nvfp4_ds_mla`` and V4.1's.

vLLM packs a DeepSeek cache token (an MLA latent with its RoPE key, a V4 entry, an indexer key) into one opaque
record of bytes, quantized on arrival with a scale per tile chosen from the tile's largest magnitude. The layouts
and rules here are read from vLLM 0.33.0's source (``pip download vllm==0.33.0 --no-deps``); each codec names the
file and function it follows. Its kernels are Triton (and CUDA) code that does not run on a CPU, so the tests pin
these codecs to a line-by-line transcription of those kernels and to the layouts, not to vLLM running.

Records (bytes per token, or per entry on V4), and the vLLM 0.33.0 code that writes them:

* V3.2 ``fp8_ds_mla``, 656: the 512-value latent in e4m3, 4 tiles of 128 with a float32 power of two each (16 B),
  then the 64 RoPE dims in bfloat16 (128 B). ``models/deepseek_v32/common/kernels.py`` ``_fused_norm_rope_kernel``
  (``MLA_CACHE_DS_MLA``); the layout note in ``v1/attention/backends/mla/flashmla_sparse.py``.
* V3.2 ``nvfp4_ds_mla``, 352: the latent in E2M1 (256 B) with an e4m3 scale per 16 (32 B, byte-permuted), the RoPE
  dims in unscaled e4m3 (64 B). The same kernel (``MLA_CACHE_NVFP4``).
* V4 ``fp8_ds_mla``, 584: the 448 NoPE dims of an entry in e4m3, 7 tiles of 64 with a UE8M0 scale each and a pad
  byte, the 64 RoPE dims in bfloat16. ``models/deepseek_v4/common/ops/fused_compress_quant_cache.py``
  (``_fused_kv_compress_norm_rope_insert_sparse_attn``), the window's and the compressed entries' alike.
* The indexer's keys, FP8, 132: 128 e4m3 and one float32 power of two. ``kernels.py`` ``_fp8_ue8m0_quantize``
  (V3.2); ``_fused_kv_compress_norm_rope_insert_indexer_attn`` (V4).
* V4.1's window, MXFP8, 528: all 512 dims (RoPE too) in e4m3 with a UE8M0 scale per 32.
  ``models/deepseek_v41/common/ops/fused_compress_quant_cache.py`` ``_rope_quant_insert_mxfp8_kernel``.
* V4.1's compressed entry, NVFP4, 288: all 512 dims in E2M1 with an e4m3 scale per 16 (``_rope_quant_insert_nvfp4_
  kernel``).
* V4.1's indexer keys, MXFP4, 68: 128 E2M1 with a UE8M0 scale per 32 (``models/deepseek_v41/common/ops/
  indexer_k_store.py``, ``USE_FP4``).

Rules, as the kernels compute them (float32 throughout):

* **Power-of-two FP8 tiles** (:class:`Fp8Tiles`): ``s = 2**ceil(log2(t))`` with ``t`` the tile's largest magnitude
  over 448, floored at ``1e-4`` (V3.2's latent floors ``t``; the indexers and V4 floor the magnitude before the
  division); values ``x / s`` (exact: ``s`` is a power of two), clamped to +-448, cast to e4m3 round to nearest
  even. The scale is stored as a float32 (V3.2, the indexer) or as a UE8M0 byte ``e + 127`` clamped to [0, 255]
  (V4, V4.1). V4's kernels round their input to bfloat16 first (``quant_input = normed.to(tl.bfloat16)``).
* **NVFP4 tiles** (:class:`Nvfp4Tiles`): ``s = e4m3(max(amax / 6, 2**-9))`` (saturating at 448), values ``x *
  (1 / s)`` (V3.2) or ``div_rn(x, s)`` (V4.1), coded E2M1 round to nearest even saturating at 6, two a byte with
  the even element in the low nibble. No per-tensor scale. V3.2 stores scale ``i`` at byte ``8 * (i & 3) + (i >> 2)``
  (FlashMLA's ``nvfp4_sf_byte``); V4.1 in order.
* **MXFP4 tiles** (:class:`Mxfp4Tiles`): ``e = ceil(log2(max(amax, 6 * 2**-126) / 6))`` clamped to [-127, 127],
  values ``x * 2**-e`` (of the input rounded to bfloat16) coded E2M1 as above, the scale a UE8M0 byte ``e + 127``.

Where kveval can differ from the GPU: ``ceil(log2(t))`` is computed exactly here (from ``t``'s bits); the GPU's
``log2`` is approximate, and can put a ``t`` within a few ulps above a power of two one exponent lower (the clamp
then saturates that tile's largest value). V3.2's NVFP4 multiplies by Triton's ``1.0 / s``, which uses the GPU's
approximate division; here the reciprocal is exact, which can move a value that sits exactly on an E2M1 rounding
midpoint. Both need a value within a few ulps of a boundary.

Byte order: kveval keeps a token's latent (with its scales) and its RoPE key in two rows (K's and V's, as the cache
holds MLA), and a V4 entry's codes, scales and RoPE dims in one row; the bytes are the engine's, the order within
a token is not (vLLM puts V3.2's NVFP4 RoPE before the scales and V4's scales in a region of their own per page).
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.errors import UsageError
from kveval.lazy import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: The floor the FP8 kernels put under a tile's largest magnitude (or under V3.2's scale): ``1e-4``.
FP8_FLOOR = 1e-4
#: The floor the NVFP4 kernels put under a block scale before its e4m3 cast: e4m3's smallest subnormal.
NVFP4_SCALE_FLOOR = 2.0**-9
#: The floor V4.1's MXFP4 indexer puts under a block's largest magnitude: 6 x float32's smallest normal.
MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126


def _f32(value: float):
    return torch.tensor(value, dtype=torch.float32)


def ceil_log2(t):
    """``ceil(log2(t))`` of positive float32 values, exactly (from the bits: ``frexp`` gives ``t = m * 2**e`` with
    ``m`` in [0.5, 1), so ``ceil(log2(t))`` is ``e - 1`` where ``m == 0.5`` and ``e`` otherwise)."""
    mantissa, exponent = torch.frexp(t)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.float32)


def _blocks(x, block: int, name: str):
    dim = x.shape[-1]
    if dim % block:
        raise UsageError(f"{name} codes blocks of {block} values; a row of {dim} is not a whole number of them")
    return x.float().reshape(*x.shape[:-1], dim // block, block)


def _bfloat16_rounded(x, yes: bool):
    return x.to(torch.bfloat16).float() if yes else x.float()


@dataclass(frozen=True)
class Fp8Tiles:
    """E4M3 tiles of ``tile`` values with a power-of-two scale each (see the module doc).

    ``floor``: ``"scale"`` (V3.2's latent: ``max(amax * (1/448), 1e-4)``) or ``"amax"`` (``max(amax, 1e-4)``, then
    over 448: ``divide`` for V3.2's indexer, ``div_rn``; else times ``float32(1/448)``). ``scale``: ``"float32"``
    (4 bytes a tile) or ``"ue8m0"`` (1 byte), ``pad`` zero bytes after the scales. ``bfloat16_input``: the kernel
    rounds its input to bfloat16 first."""

    tile: int
    floor: str = "amax"
    divide: bool = False
    scale: str = "float32"
    pad: int = 0
    bfloat16_input: bool = False

    def row_bytes(self, dim: int) -> int:
        return dim + dim // self.tile * (4 if self.scale == "float32" else 1) + self.pad

    def exponents(self, blocks):
        amax = blocks.abs().amax(dim=-1)
        if self.floor == "scale":
            t = torch.clamp(amax * _f32(1 / E4M3_MAX), min=FP8_FLOOR)
        else:
            amax = torch.clamp(amax, min=FP8_FLOOR)
            t = amax / _f32(E4M3_MAX) if self.divide else amax * _f32(1 / E4M3_MAX)
        return ceil_log2(t)

    def encode(self, x):
        from kveval.tensors.microscaling import e4m3_codes

        blocks = _blocks(_bfloat16_rounded(x, self.bfloat16_input), self.tile, "fp8_ds_mla")
        e = self.exponents(blocks)
        codes = e4m3_codes(torch.ldexp(blocks, -e.unsqueeze(-1))).flatten(-2)
        if self.scale == "float32":
            scales = torch.ldexp(torch.ones_like(e), e).contiguous().view(torch.uint8)
        else:
            scales = torch.clamp(e + 127, 0, 255).to(torch.uint8)
        pad = torch.zeros(*scales.shape[:-1], self.pad, dtype=torch.uint8, device=x.device)
        return torch.cat([codes, scales, pad], dim=-1)

    def scales(self, codes, dim: int):
        """The float32 scale of every tile of rows coded by :meth:`encode`."""
        n = dim // self.tile
        if self.scale == "float32":
            return codes[..., dim:dim + 4 * n].contiguous().view(torch.float32)
        e = codes[..., dim:dim + n].to(torch.float32) - 127
        return torch.ldexp(torch.ones_like(e), e)

    def decode(self, codes, dim: int):
        from kveval.tensors.microscaling import e4m3_values

        values = e4m3_values(codes[..., :dim].contiguous()).reshape(*codes.shape[:-1], dim // self.tile, self.tile)
        return (values * self.scales(codes, dim).unsqueeze(-1)).flatten(-2)


@dataclass(frozen=True)
class Nvfp4Tiles:
    """E2M1 blocks of 16 with an e4m3 scale each, no per-tensor scale (see the module doc). ``divide``: values
    ``div_rn(x, s)`` (V4.1) rather than ``x * (1 / s)`` (V3.2); ``permuted``: scale ``i`` at byte ``(n / 4) * (i %
    4) + i // 4`` of the ``n`` scales (V3.2's FlashMLA order)."""

    divide: bool = False
    permuted: bool = False
    bfloat16_input: bool = False
    block: int = 16

    def row_bytes(self, dim: int) -> int:
        return dim // 2 + dim // self.block

    def _order(self, n: int, device):
        i = torch.arange(n, device=device)
        return (n // 4) * (i % 4) + i // 4 if self.permuted else i

    def encode(self, x):
        from kveval.tensors.microscaling import e2m1_codes, e4m3_codes, e4m3_values, pack_e2m1

        blocks = _blocks(_bfloat16_rounded(x, self.bfloat16_input), self.block, "nvfp4_ds_mla")
        amax = blocks.abs().amax(dim=-1)
        scale_codes = e4m3_codes(torch.clamp(amax * _f32(1 / E2M1_MAX), min=NVFP4_SCALE_FLOOR))
        s = e4m3_values(scale_codes).unsqueeze(-1)
        scaled = blocks / s if self.divide else blocks * (1.0 / s)
        codes = pack_e2m1(e2m1_codes(scaled.flatten(-2)))
        n = scale_codes.shape[-1]
        stored = torch.empty_like(scale_codes)
        stored[..., self._order(n, x.device)] = scale_codes
        return torch.cat([codes, stored], dim=-1)

    def scales(self, codes, dim: int):
        from kveval.tensors.microscaling import e4m3_values

        n = dim // self.block
        return e4m3_values(codes[..., dim // 2:dim // 2 + n][..., self._order(n, codes.device)].contiguous())

    def decode(self, codes, dim: int):
        from kveval.tensors.microscaling import e2m1_values, unpack_e2m1

        values = e2m1_values(unpack_e2m1(codes[..., :dim // 2])).reshape(*codes.shape[:-1], dim // self.block,
                                                                          self.block)
        return (values * self.scales(codes, dim).unsqueeze(-1)).flatten(-2)


@dataclass(frozen=True)
class Mxfp4Tiles:
    """E2M1 blocks of 32 with a UE8M0 scale each, as V4's and V4.1's MXFP4 indexer caches (see the module doc); both
    kernels round their input to bfloat16 first (``new_even.to(tl.bfloat16)``)."""

    block: int = 32
    bfloat16_input: bool = True

    def row_bytes(self, dim: int) -> int:
        return dim // 2 + dim // self.block

    def encode(self, x):
        from kveval.tensors.microscaling import e2m1_codes, pack_e2m1

        blocks = _blocks(_bfloat16_rounded(x, self.bfloat16_input), self.block, "mxfp4")
        amax = torch.clamp(blocks.abs().amax(dim=-1), min=MXFP4_AMAX_FLOOR)
        e = torch.clamp(ceil_log2(amax * _f32(1 / E2M1_MAX)), -127, 127)
        codes = pack_e2m1(e2m1_codes(torch.ldexp(blocks, -e.unsqueeze(-1)).flatten(-2)))
        return torch.cat([codes, (e + 127).to(torch.uint8)], dim=-1)

    def scales(self, codes, dim: int):
        e = codes[..., dim // 2:dim // 2 + dim // self.block].to(torch.float32) - 127
        return torch.ldexp(torch.ones_like(e), e)

    def decode(self, codes, dim: int):
        from kveval.tensors.microscaling import e2m1_values, unpack_e2m1

        values = e2m1_values(unpack_e2m1(codes[..., :dim // 2])).reshape(*codes.shape[:-1], dim // self.block,
                                                                          self.block)
        return (values * self.scales(codes, dim).unsqueeze(-1)).flatten(-2)


@dataclass(frozen=True)
class Bfloat16Values:
    """Unquantized RoPE dims in bfloat16 (2 bytes a value): ``fp8_ds_mla``'s RoPE part."""

    def row_bytes(self, dim: int) -> int:
        return 2 * dim

    def encode(self, x):
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)

    def decode(self, codes, dim: int):
        return codes.contiguous().view(torch.bfloat16).float()


@dataclass(frozen=True)
class E4m3Values:
    """Unscaled e4m3 (1 byte a value, saturating at 448): V3.2 ``nvfp4_ds_mla``'s RoPE part."""

    def row_bytes(self, dim: int) -> int:
        return dim

    def encode(self, x):
        from kveval.tensors.microscaling import e4m3_codes

        return e4m3_codes(x)

    def decode(self, codes, dim: int):
        from kveval.tensors.microscaling import e4m3_values

        return e4m3_values(codes.contiguous())


@dataclass(frozen=True)
class Empty:
    """Nothing: V4's values (its K=V entries are stored once, as keys)."""

    def row_bytes(self, dim: int) -> int:
        return 0

    def encode(self, x):
        return torch.zeros(*x.shape[:-1], 0, dtype=torch.uint8, device=x.device)

    def decode(self, codes, dim: int):
        return torch.zeros(*codes.shape[:-1], dim, dtype=torch.float32, device=codes.device)


@dataclass(frozen=True)
class Split:
    """One row coded in consecutive segments: the first ``head`` values by ``first``, the rest by ``rest`` (V4's
    entry: 448 NoPE dims in FP8 tiles, then its 64 RoPE dims in bfloat16)."""

    head: int
    first: object
    rest: object

    def row_bytes(self, dim: int) -> int:
        return self.first.row_bytes(self.head) + self.rest.row_bytes(dim - self.head)

    def encode(self, x):
        return torch.cat([self.first.encode(x[..., :self.head]), self.rest.encode(x[..., self.head:])], dim=-1)

    def decode(self, codes, dim: int):
        cut = self.first.row_bytes(self.head)
        return torch.cat([self.first.decode(codes[..., :cut], self.head),
                          self.rest.decode(codes[..., cut:], dim - self.head)], dim=-1)


#: V3.2's latent (``fp8_ds_mla``): 4 tiles of 128, float32 scales, the floor on the scale.
V32_FP8_LATENT = Fp8Tiles(128, floor="scale", scale="float32")
#: V3.2's latent (``nvfp4_ds_mla``): NVFP4 without a global scale, scales in FlashMLA's order.
V32_NVFP4_LATENT = Nvfp4Tiles(divide=False, permuted=True)
#: V3.2's indexer keys (``_fp8_ue8m0_quantize``): one 128-value tile, ``div_rn``, a float32 scale.
V32_INDEXER = Fp8Tiles(128, floor="amax", divide=True, scale="float32")
#: V4's indexer keys, FP8 (``_fused_kv_compress_norm_rope_insert_indexer_attn``): bfloat16 input, times 1/448.
V4_INDEXER = Fp8Tiles(128, floor="amax", divide=False, scale="float32", bfloat16_input=True)
#: V4's entry (``fp8_ds_mla``, 584 B): 448 NoPE dims in 7 UE8M0 tiles of 64 and a pad byte, 64 bfloat16 RoPE dims.
V4_ENTRY = Split(448, Fp8Tiles(64, floor="amax", scale="ue8m0", pad=1, bfloat16_input=True), Bfloat16Values())
#: V4.1's window (MXFP8, 528 B): all 512 dims, UE8M0 per 32, from the bfloat16 latent.
V41_WINDOW = Fp8Tiles(32, floor="amax", scale="ue8m0", bfloat16_input=True)
#: V4.1's compressed entry (NVFP4, 288 B): all 512 dims, e4m3 per 16, ``div_rn``, from the bfloat16 latent.
V41_ENTRY = Nvfp4Tiles(divide=True, permuted=False, bfloat16_input=True)
#: V4.1's indexer keys (MXFP4, 68 B), and V4's under ``indexer_kv_dtype=mxfp4``
#: (``models/deepseek_v4/common/ops/fused_compress_quant_cache.py``
#: ``_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn``: the same rule).
V41_INDEXER = Mxfp4Tiles()
V4_MXFP4_INDEXER = V41_INDEXER

__all__ = ["Bfloat16Values", "E4m3Values", "Empty", "Fp8Tiles", "Mxfp4Tiles", "Nvfp4Tiles", "Split", "V32_FP8_LATENT",
           "V32_INDEXER", "V32_NVFP4_LATENT", "V41_ENTRY", "V41_INDEXER", "V41_WINDOW", "V4_ENTRY", "V4_INDEXER",
           "V4_MXFP4_INDEXER", "ceil_log2"]
