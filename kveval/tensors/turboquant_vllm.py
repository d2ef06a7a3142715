"""vLLM 0.33's TurboQuant KV caches (``--kv-cache-dtype turboquant_k8v4 | turboquant_4bit_nc | turboquant_k3v4_nc |
turboquant_3bit_nc``), read from vLLM's own sources. Not the ``turboquant`` package's algorithm (QR rotation,
Beta-quantile centroids, a QJL residual): vLLM's has no QJL.

Presets (``vllm/model_executor/layers/quantization/turboquant/config.py``, ``TQ_PRESETS``): key bits 8 (FP8 keys)
or 3/4 (Lloyd-Max keys), value bits 4 or 3, and ``nc`` = norm correction (on for every preset but ``k8v4``).

K and V of one token and KV head share one slot (``TurboQuantConfig.slot_size_aligned``):
``[key | value | one pad byte when the sum is odd]``.

* Keys, 3/4 bits (``vllm/v1/attention/ops/triton_turboquant_store.py``, ``triton_turboquant_store`` then
  ``_tq_fused_store_mse``): ``norm = ||k||`` (float32), ``y = (k / (norm + 1e-8)) @ H`` with ``H`` the orthonormal
  Sylvester Hadamard matrix (``turboquant_attn.py``, ``_build_hadamard_cached``; the same for every layer, no random
  signs), each coordinate bucketized by binary search over the midpoints of the Lloyd-Max centroids for N(0, 1/D)
  (``centroids.py``, ``solve_lloyd_max``: 200 trapezoid iterations from a uniform start on +-3.5 sigma). Stored:
  the indices packed little-endian (4 bits: two a byte, even element low; 3 bits: 8 indices in 3 bytes), then
  ``norm`` as float16: ``ceil(D b / 8) + 2`` bytes.
* Keys, 8 bits (``_tq_fused_store_fp8``): ``k.to(float8e4nv)``, saturating round to nearest even (Hopper and later;
  Ampere/Ada store ``float8e4b15``, not modelled): ``D`` bytes.
* Values (``_store_quantized_value``): per row ``min``/``max``, ``scale = (max - min) / (2**b - 1)`` (at least
  ``1e-8``), codes ``clamp(int((v - min) / scale + 0.5), 0, 2**b - 1)`` packed as the keys' indices, then
  ``scale`` and ``min`` as float16: ``ceil(D b / 8) + 4`` bytes.

Read back as the decode kernel reads them (``triton_turboquant_decode.py``, ``_tq_decode_stage1``): values
``code * scale + min`` (the float16 scale and min, in float32); keys ``norm * c`` in the rotated space, ``c`` the
centroids of the indices, with norm correction divided by ``sqrt(sum c**2 + 1e-16)``. The kernel scores the query
rotated by ``H``; the key in the model's space is ``(norm * c) @ H`` (``H`` is symmetric and orthonormal), which is
what :func:`decode_keys` returns.

The GPU's Triton division ``/`` and fused multiply-adds may round differently from the IEEE float32 arithmetic here
(which is what Triton's interpreter computes); the head width must be a power of two (the Hadamard matrix) of at
least 8 (the 3-bit packing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from kveval.lazy import torch

#: vLLM 0.33's presets: (key bits, value bits, norm correction); key bits 8 = FP8 keys.
PRESETS = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
NORM_BYTES = 2  # the key's float16 norm
VALUE_META_BYTES = 4  # the value row's float16 scale and min
#: Boundary layers kept in the model dtype (``TurboQuantConfig.get_boundary_skip_layers``, ``n=2``).
BOUNDARY_LAYERS = 2


@dataclass(frozen=True)
class TurboQuantLayout:
    """One preset at head width ``dim``: the bytes of a key, a value, and the slot vLLM allocates per token and head."""

    dim: int
    key_bits: int
    value_bits: int
    norm_correction: bool

    @classmethod
    def of(cls, preset: str, dim: int) -> "TurboQuantLayout":
        return cls(dim, *PRESETS[preset])

    @property
    def key_fp8(self) -> bool:
        return self.key_bits == 8

    @property
    def key_bytes(self) -> int:
        """``TurboQuantConfig.key_packed_size``."""
        return self.dim if self.key_fp8 else math.ceil(self.dim * self.key_bits / 8) + NORM_BYTES

    @property
    def value_bytes(self) -> int:
        """``TurboQuantConfig.value_packed_size``."""
        return math.ceil(self.dim * self.value_bits / 8) + VALUE_META_BYTES

    @property
    def slot_bytes(self) -> int:
        """``TurboQuantConfig.slot_size_aligned``: key + value, rounded up to even."""
        s = self.key_bytes + self.value_bytes
        return s + s % 2

    @property
    def pad_bytes(self) -> int:
        return self.slot_bytes - self.key_bytes - self.value_bytes


def unsupported_dim(dim: int) -> str | None:
    """Why vLLM's TurboQuant cannot code heads of width ``dim``, or ``None``."""
    if dim < 8 or dim & (dim - 1):
        return (f"head_dim={dim} is not a power of two of at least 8 (TurboQuant's Hadamard rotation and 3-bit "
                f"packing need one)")
    return None


def boundary_layers(num_layers: int, hybrid: bool = False) -> frozenset[int]:
    """Layers vLLM keeps in the model dtype under every TurboQuant preset: the first and last ``min(2, L // 2)`` of
    a dense model's ``num_hidden_layers``; none in a hybrid (attention + Mamba/linear) model."""
    n = min(BOUNDARY_LAYERS, num_layers // 2)
    if hybrid or n <= 0:
        return frozenset()
    return frozenset(range(n)) | frozenset(range(num_layers - n, num_layers))


def _gaussian_pdf(x: float, sigma2: float) -> float:
    return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))


def _trapz(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    result = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        result += f(a + i * h)
    return result * h


@lru_cache(maxsize=32)
def centroids(dim: int, bits: int) -> "torch.Tensor":
    """``solve_lloyd_max(dim, bits)``'s centroids (float32, sorted), the same Python float arithmetic as vLLM's."""
    n_levels, sigma2 = 2 ** bits, 1.0 / dim
    sigma = math.sqrt(sigma2)

    def pdf(x):
        return _gaussian_pdf(x, sigma2)

    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(200):
        edges = [lo * 3] + [(c[i] + c[i + 1]) / 2.0 for i in range(n_levels - 1)] + [hi * 3]
        new = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num = _trapz(lambda x: x * pdf(x), a, b)
            den = _trapz(pdf, a, b)
            new.append(num / den if den > 1e-15 else c[i])
        if max(abs(new[i] - c[i]) for i in range(n_levels)) < 1e-10:
            break
        c = new
    return torch.tensor(c, dtype=torch.float32)


def midpoints(dim: int, bits: int) -> "torch.Tensor":
    c = centroids(dim, bits).sort().values
    return (c[:-1] + c[1:]) / 2


@lru_cache(maxsize=8)
def hadamard(dim: int) -> "torch.Tensor":
    """``_build_hadamard_cached``: the Sylvester Hadamard matrix over ``sqrt(dim)``, float32."""
    h = torch.tensor([[1.0]])
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


def pack(codes: "torch.Tensor", bits: int) -> "torch.Tensor":
    """Codes ``[..., D]`` (int) -> bytes ``[..., ceil(D bits / 8)]``, little-endian (the store kernel's packing)."""
    c = codes.to(torch.int32)
    if bits == 4:
        pairs = c.unflatten(-1, (-1, 2))
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    groups = c.unflatten(-1, (-1, 8))
    word = (groups << (torch.arange(8, dtype=torch.int32) * 3)).sum(-1)
    return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1).flatten(-2).to(torch.uint8)


def unpack(data: "torch.Tensor", bits: int, dim: int) -> "torch.Tensor":
    """Bytes -> codes ``[..., dim]`` int64 (the decode kernel's reads of two bytes at ``bit // 8``)."""
    d = data.to(torch.int32)
    bit = torch.arange(dim) * bits
    first = d[..., bit // 8]
    second = torch.nn.functional.pad(d, (0, 1))[..., bit // 8 + 1]
    return (((first | (second << 8)) >> (bit % 8)) & ((1 << bits) - 1)).long()


def _f16_bytes(x: "torch.Tensor") -> "torch.Tensor":
    return x.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def _f16_from(data: "torch.Tensor") -> "torch.Tensor":
    return data.contiguous().view(torch.float16).squeeze(-1).float()


def bucketize(y: "torch.Tensor", mids: "torch.Tensor", bits: int) -> "torch.Tensor":
    """``_tq_fused_store_mse``'s binary search: the number of midpoints ``<= y``, in ``bits`` steps."""
    n = 2 ** bits
    lo = torch.zeros(y.shape, dtype=torch.int64)
    hi = torch.full(y.shape, n - 1, dtype=torch.int64)
    for _ in range(bits):
        mid = (lo + hi) >> 1
        above = y >= mids[mid.clamp(max=n - 2)]
        lo, hi = torch.where(above, mid + 1, lo), torch.where(above, hi, mid)
    return lo.clamp(max=n - 1)


def encode_keys(x: "torch.Tensor", layout: TurboQuantLayout) -> "torch.Tensor":
    """Key rows ``[..., D]`` (float32) -> ``[..., key_bytes]`` uint8."""
    if layout.key_fp8:
        from kveval.tensors.engine_formats import fp8_saturating

        return fp8_saturating(x, 1.0, "e4m3")
    flat = x.float().reshape(-1, layout.dim)  # the launcher's [N * H, D] rows
    norms = flat.norm(dim=1, keepdim=True)
    y = (flat / (norms + 1e-8)) @ hadamard(layout.dim)
    idx = bucketize(y, midpoints(layout.dim, layout.key_bits), layout.key_bits)
    out = torch.cat([pack(idx, layout.key_bits), _f16_bytes(norms.squeeze(1))], dim=-1)
    return out.reshape(*x.shape[:-1], layout.key_bytes)


def rotated_keys(codes: "torch.Tensor", layout: TurboQuantLayout, square_sum=None) -> "torch.Tensor":
    """``norm * c`` (norm-corrected ``c`` where the preset says), in the rotated space, float32 ``[..., D]``.

    The correction's ``sum c**2`` is a float32 reduction whose order is the GPU's (a tree over threads): here
    torch's, which may differ in the last bit; ``square_sum`` (``[..., D] -> [..., 1]``) can fix another order."""
    packed = math.ceil(layout.dim * layout.key_bits / 8)
    c = centroids(layout.dim, layout.key_bits)[unpack(codes[..., :packed], layout.key_bits, layout.dim)]
    if layout.norm_correction:
        squares = c * c
        total = squares.sum(-1, keepdim=True) if square_sum is None else square_sum(squares)
        c = c * (1.0 / torch.sqrt(total + 1e-16))
    return _f16_from(codes[..., packed:packed + NORM_BYTES]).unsqueeze(-1) * c


def decode_keys(codes: "torch.Tensor", layout: TurboQuantLayout) -> "torch.Tensor":
    """``[..., key_bytes]`` -> keys ``[..., D]`` float32 in the model's space."""
    if layout.key_fp8:
        from kveval.tensors.engine_formats import fp8_decode

        return fp8_decode(codes, 1.0, "e4m3")
    return rotated_keys(codes, layout) @ hadamard(layout.dim)


def encode_values(x: "torch.Tensor", layout: TurboQuantLayout) -> "torch.Tensor":
    """Value rows ``[..., D]`` (float32) -> ``[..., value_bytes]`` uint8 (``_store_quantized_value``)."""
    v = x.float()
    top = 2 ** layout.value_bits - 1
    low, high = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    scale = (high - low) / float(top)
    scale = torch.where(scale > 1e-8, scale, torch.tensor(1e-8, dtype=torch.float32))
    q = ((v - low) / scale + 0.5).to(torch.int32).clamp(0, top)
    return torch.cat([pack(q, layout.value_bits), _f16_bytes(scale.squeeze(-1)), _f16_bytes(low.squeeze(-1))], dim=-1)


def decode_values(codes: "torch.Tensor", layout: TurboQuantLayout) -> "torch.Tensor":
    """``[..., value_bytes]`` -> values ``[..., D]`` float32: ``code * scale + min``."""
    packed = math.ceil(layout.dim * layout.value_bits / 8)
    q = unpack(codes[..., :packed], layout.value_bits, layout.dim).float()
    scale = _f16_from(codes[..., packed:packed + 2]).unsqueeze(-1)
    low = _f16_from(codes[..., packed + 2:packed + 4]).unsqueeze(-1)
    return q * scale + low
