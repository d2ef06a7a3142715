"""The store of a serving engine's KV cache: every token coded as the engine writes it, on arrival.

Engines quantize K and V as they write them into their cache and attend over what the cache holds, the prompt's
own tokens included (llama.cpp's ``ggml_set_rows`` then flash attention over the cache view; vLLM V1's
``reshape_and_cache_flash`` then attention over the paged cache). So :class:`EngineStore` encodes each token in
:meth:`append` (no full-precision residual, nothing waits for :meth:`seal`), and attention, the prefill's too,
reads the dequantized codes. Unlike kveval's own quantizers (:mod:`kveval.stores.base`), whose prefill attends
over full-precision K/V.

Codes are per token and KV head (``[H, T, row bytes]`` uint8, exactly the engine's bytes: ggml blocks with their
float16 scales, or one FP8/INT8 byte a value), so eviction gathers rows and never re-encodes. Per-tensor scales
are per layer, not per token: :class:`EngineCodec` holds them, and ``nbytes`` counts the per-token codes only
(the policy reports the scales' bytes per model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.stores.base import TokenStore, gather_tokens
from kveval.tensors.engine_formats import (
    fp8_decode,
    fp8_saturating,
    fp8_torch_cast,
    ggml_dequantize,
    ggml_quantize,
    int8_decode,
    int8_saturating,
)


@dataclass(frozen=True)
class SideFormat:
    """How one of K or V is coded.

    ``kind``: ``ggml`` (``ggml_type`` blocks), ``fp8-sat`` (vLLM: divide, saturate), ``fp8-sat-mul`` (TensorRT-LLM:
    multiply by the float32 reciprocal, saturate), ``fp8-cast`` (SGLang: divide in ``model_dtype``, torch's cast),
    ``int8`` (TensorRT-LLM). ``scale``: the per-tensor float32 scale (``None`` for SGLang without one: no division).
    """

    kind: str
    ggml_type: str = ""
    fp8: str = "e4m3"
    scale: float | None = 1.0
    model_dtype: torch.dtype | None = None
    x86: bool = False  # ggml on an x86 CPU build: q8_0 rounded as its SIMD from_float does

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "ggml":
            return ggml_quantize(x, self.ggml_type, self.x86)
        if self.kind == "fp8-sat":
            return fp8_saturating(x, self.scale, self.fp8)
        if self.kind == "fp8-sat-mul":
            inverse = float(1 / torch.tensor(self.scale, dtype=torch.float32))
            return fp8_saturating(x * torch.tensor(inverse, dtype=torch.float32), 1.0, self.fp8)
        if self.kind == "fp8-cast":
            return fp8_torch_cast(x, self.scale, self.fp8, self.model_dtype or x.dtype)
        if self.kind == "int8":
            return int8_saturating(x, self.scale)
        raise ValueError(f"unknown engine format {self.kind!r}")

    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        if self.kind == "ggml":
            return ggml_dequantize(codes, self.ggml_type, dim)
        if self.kind == "int8":
            return int8_decode(codes, self.scale)
        return fp8_decode(codes, 1.0 if self.scale is None else self.scale, self.fp8)


@dataclass(frozen=True)
class EngineCodec:
    """One layer's coding of K and V."""

    key: SideFormat
    value: SideFormat


class EngineStore(TokenStore):
    """One sequence's K and V in one layer, as the engine's cache holds them (see the module doc)."""

    def __init__(self, codec: EngineCodec, compute_dtype: torch.dtype | None = None):
        self.codec, self.compute_dtype = codec, compute_dtype
        self.k: torch.Tensor | None = None  # [H, T, key row bytes] uint8
        self.v: torch.Tensor | None = None
        self.dims: tuple[int, int] = (0, 0)
        self._read = 0

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.compute_dtype is None:
            self.compute_dtype = keys.dtype
        self.dims = (keys.shape[-1], values.shape[-1])
        k, v = self.codec.key.encode(keys.float()), self.codec.value.encode(values.float())
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)

    def select(self, index: torch.Tensor) -> None:
        self.k, self.v = gather_tokens(self.k, index), gather_tokens(self.v, index)
        self._read = 0

    def seal(self) -> None:
        """Nothing waits: every token was coded as it arrived."""

    def keys_values_from(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            return self.k, self.v
        keys = self.codec.key.decode(self.k[:, start:], self.dims[0])
        values = self.codec.value.decode(self.v[:, start:], self.dims[1])
        return keys.to(self.compute_dtype), values.to(self.compute_dtype)

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys_values_from(0)

    def changed_from(self) -> int:
        return self._read

    def mark_read(self) -> None:
        self._read = self.length

    @property
    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
