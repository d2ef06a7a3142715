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

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kveval.stores.base import TokenStore, gather_tokens
from kveval.tensors import microscaling, per_token_head, turboquant_vllm
from kveval.tensors.engine_formats import (
    flashinfer_nvfp4_encode,
    fp8_decode,
    fp8_saturating,
    fp8_torch_cast,
    ggml_dequantize,
    ggml_quantize,
    int8_decode,
    int8_saturating,
)


class SideFormat(ABC):
    """How one of K or V is coded: token rows ``[..., D]`` (float32) in, the engine's bytes per row out, and back.

    Each engine format is one subclass; per-tensor scales (per layer) are the subclass's fields, per-token scales
    are inside the row bytes."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., D]`` float32 -> ``[..., row bytes]`` uint8, as the engine stores them."""

    @abstractmethod
    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        """``[..., row bytes]`` -> ``[..., dim]`` float32, as attention reads them."""


@dataclass(frozen=True)
class GgmlSide(SideFormat):
    """llama.cpp's ggml blocks of ``ggml_type`` (``x86``: q8_0 rounded as an x86 CPU build's SIMD ``from_float``)."""

    ggml_type: str
    x86: bool = False

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return ggml_quantize(x, self.ggml_type, self.x86)

    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        return ggml_dequantize(codes, self.ggml_type, dim)


@dataclass(frozen=True)
class Fp8Side(SideFormat):
    """Per-tensor FP8 (``scale`` float32), read back as ``code * scale``. ``write``: ``divide`` (vLLM: ``x / scale``,
    saturate), ``reciprocal`` (TensorRT-LLM: ``x * (1 / scale)``, saturate), ``torch-cast`` (SGLang: divided in
    ``model_dtype``, torch's cast; ``scale`` ``None``: no division)."""

    fp8: str = "e4m3"
    scale: float | None = 1.0
    write: str = "divide"
    model_dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.write not in ("divide", "reciprocal", "torch-cast"):
            raise ValueError(f"unknown FP8 cache write {self.write!r}")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.write == "divide":
            return fp8_saturating(x, self.scale, self.fp8)
        if self.write == "reciprocal":
            inverse = float(1 / torch.tensor(self.scale, dtype=torch.float32))
            return fp8_saturating(x * torch.tensor(inverse, dtype=torch.float32), 1.0, self.fp8)
        return fp8_torch_cast(x, self.scale, self.fp8, self.model_dtype or x.dtype)

    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        return fp8_decode(codes, 1.0 if self.scale is None else self.scale, self.fp8)


@dataclass(frozen=True)
class Int8Side(SideFormat):
    """TensorRT-LLM's per-tensor INT8."""

    scale: float

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return int8_saturating(x, self.scale)

    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        return int8_decode(codes, self.scale)


@dataclass(frozen=True)
class PerTokenHeadSide(SideFormat):
    """vLLM's ``{int8,fp8,int4}_per_token_head``: the codes then the row's float32 scale
    (:mod:`kveval.tensors.per_token_head`). ``model_dtype``: INT4's rotated row is cast back to it before coding."""

    kind: str
    model_dtype: torch.dtype | None = None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "int4":
            codes, scale = per_token_head.quantize_int4(x.to(self.model_dtype or x.dtype))
        else:
            codes, scale = per_token_head.quantize_int8_fp8(x, self.kind)
        return torch.cat([codes, scale.contiguous().unsqueeze(-1).view(torch.uint8)], dim=-1)

    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        data = codes[..., :-per_token_head.SCALE_BYTES]
        scale = codes[..., -per_token_head.SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)
        if self.kind == "int4":
            return per_token_head.dequantize_int4(data, scale)
        return per_token_head.dequantize_int8_fp8(data, scale, self.kind)


class MicroscaledSide(SideFormat):
    """A block-scaled FP4 row, ``[E2M1 codes | one-byte block scales]``, as vLLM lays out a head
    (``vllm/utils/torch_utils.py``, ``nvfp4_split_data_scale``); subclasses say how the engine codes it."""

    format: microscaling.MicroscalingFormat

    @abstractmethod
    def encode_rows(self, x: torch.Tensor) -> microscaling.MicroscaledRows:
        """Rows as the engine codes them."""

    def global_scale(self) -> torch.Tensor | None:
        return None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.encode_rows(x)
        return torch.cat([rows.codes, rows.scales], dim=-1)

    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        packed = dim * self.format.element.bits // 8
        rows = microscaling.MicroscaledRows(self.format, codes[..., :packed], codes[..., packed:],
                                            self.global_scale(), dim)
        return microscaling.decode_rows(rows)


@dataclass(frozen=True)
class FlashinferNvfp4Side(MicroscaledSide):
    """vLLM's ``nvfp4`` as FlashInfer writes it (:func:`~kveval.tensors.engine_formats.flashinfer_nvfp4_encode`),
    with the layer's per-tensor ``global_scale`` (vLLM's ``k_scale``/``v_scale``)."""

    scale: float = 1.0
    format = microscaling.NVFP4

    def global_scale(self) -> torch.Tensor:
        return torch.tensor(self.scale, dtype=torch.float32)

    def encode_rows(self, x: torch.Tensor) -> microscaling.MicroscaledRows:
        return flashinfer_nvfp4_encode(x, self.scale)


@dataclass(frozen=True)
class SglangFp4Side(MicroscaledSide):
    """SGLang's ``fp4_mx_block16`` (:func:`~kveval.tensors.microscaling.encode_sglang_fp4_mx_block16`)."""

    format = microscaling.FP4_MX_BLOCK16

    def encode_rows(self, x: torch.Tensor) -> microscaling.MicroscaledRows:
        return microscaling.encode_sglang_fp4_mx_block16(x)


@dataclass(frozen=True)
class TurboQuantSide(SideFormat):
    """vLLM's ``turboquant_*`` key (``part="key"``: Lloyd-Max indices and a float16 norm, or FP8) or value (uniform
    codes, float16 scale and min, then the slot's pad byte when K + V is odd) of one token and head
    (:mod:`kveval.tensors.turboquant_vllm`)."""

    layout: turboquant_vllm.TurboQuantLayout
    part: str

    def __post_init__(self):
        if self.part not in ("key", "value"):
            raise ValueError(f"a TurboQuant slot holds a key and a value, not {self.part!r}")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.part == "key":
            return turboquant_vllm.encode_keys(x, self.layout)
        codes = turboquant_vllm.encode_values(x, self.layout)
        return torch.nn.functional.pad(codes, (0, self.layout.pad_bytes))

    def decode(self, codes: torch.Tensor, dim: int) -> torch.Tensor:
        if self.part == "key":
            return turboquant_vllm.decode_keys(codes, self.layout)
        return turboquant_vllm.decode_values(codes[..., :self.layout.value_bytes], self.layout)


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


class FirstChunkRawStore(EngineStore):
    """An engine cache whose first prefill chunk attends over the raw K/V it has just written (vLLM's TurboQuant:
    ``TurboQuantAttentionImpl._prefill_attention`` runs flash attention on the chunk's own K/V, and only later
    queries read the codes). Tokens wait, in ``kv_dtype``, until :meth:`seal` codes them (the cache seals after the
    prefill's attention and after every later append, before its attention, as vLLM stores before it attends)."""

    def __init__(self, codec: EngineCodec, compute_dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None):
        super().__init__(codec, compute_dtype)
        self.kv_dtype = kv_dtype
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # [H, t, D] each, in kv_dtype

    @property
    def coded_length(self) -> int:
        return super().length

    @property
    def length(self) -> int:
        return self.coded_length + (0 if self.pending is None else self.pending[0].shape[1])

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.compute_dtype is None:
            self.compute_dtype = keys.dtype
        self.dims = (keys.shape[-1], values.shape[-1])
        dtype = self.kv_dtype or keys.dtype
        keys, values = keys.to(dtype), values.to(dtype)
        if self.pending is not None:
            keys, values = torch.cat([self.pending[0], keys], dim=1), torch.cat([self.pending[1], values], dim=1)
        self.pending = (keys.contiguous(), values.contiguous())

    def seal(self) -> None:
        """Code the waiting tokens (what attention reads of them changes from here: :meth:`changed_from`)."""
        if self.pending is None:
            return
        keys, values = self.pending
        self.pending = None
        self._read = min(self._read, self.coded_length)
        super().append(keys, values)

    def select(self, index: torch.Tensor) -> None:
        coded = self.coded_length
        if self.pending is None or not coded:
            if self.pending is None:
                super().select(index)
            else:
                self.pending = (gather_tokens(self.pending[0], index), gather_tokens(self.pending[1], index))
            self._read = 0
            return
        counts = (index < coded).sum(dim=1)
        if not bool((counts == counts[0]).all()):
            raise TypeError("a selection across coded and waiting tokens must keep as many of each in every head")
        n = int(counts[0])
        waiting = index[:, n:] - coded
        pending = (gather_tokens(self.pending[0], waiting), gather_tokens(self.pending[1], waiting))
        super().select(index[:, :n])
        self.pending = pending

    def keys_values_from(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        coded = self.coded_length
        parts = []
        if self.k is not None and start < coded:
            parts.append(super().keys_values_from(start))
        if self.pending is not None:
            skip = max(0, start - coded)
            parts.append(tuple(t[:, skip:].to(self.compute_dtype) for t in self.pending))
        if not parts:
            return super().keys_values_from(start)
        if len(parts) == 1:
            return parts[0]
        return torch.cat([parts[0][0], parts[1][0]], dim=1), torch.cat([parts[0][1], parts[1][1]], dim=1)

    @property
    def nbytes(self) -> int:
        waiting = 0 if self.pending is None else sum(t.numel() * t.element_size() for t in self.pending)
        return super().nbytes + waiting
