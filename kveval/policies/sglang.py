"""SGLang's ``--kv-cache-dtype`` as the ``sglang`` engine preset (the engines' shared contract:
:mod:`kveval.policies.engines`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kveval.errors import PolicySpecError
from kveval.policies.engines import (NVFP4_BLOCK, EnginePolicy, check_engine_choice, check_positive_scale,
                                     fp8_format)


#: SGLang 0.5.23's cache dtypes kveval does not reproduce, and why (one line each).
SGLANG_UNPINNED = {
    "fp4_e2m1": "SGLang 0.5.23 has no fp4_e2m1 (python/sglang/srt/mem_cache/kv_cache_dtype.py); its MX-style FP4 "
                "cache is --kv-cache-dtype fp4_mx_block16",
    "nvfp4": "SGLang 0.5.23 writes it with FlashInfer's compiled nvfp4_kv_quantize / fp4_quantize "
             "(NVFP4KVQuantizeUtil.quantize), whose rounding and use of the x6 global scale could not be pinned",
}
SGLANG_DTYPES = ("fp8_e4m3", "fp8_e5m2", "fp4_mx_block16")


@dataclass
class SglangPolicy(EnginePolicy):
    """SGLang 0.5.23's ``--kv-cache-dtype fp8_e4m3|fp8_e5m2|fp4_mx_block16``.

    FP8: one per-tensor scale for K and V, torch's own cast. Follows
    ``python/sglang/srt/layers/quantization/kv_cache.py`` (``BaseKVCacheMethod``: one checkpoint ``kv_scale`` copied
    to K and V; none: no scale) and ``python/sglang/srt/mem_cache/memory_pool.py``
    (``MHATokenToKVPool.set_kv_buffer``: ``cache_k.div_(k_scale)`` in the model dtype, then ``cache_k.to(fp8)``,
    torch's own cast: two roundings, and past the range whatever the running torch's cast gives).

    ``fp4_mx_block16``: E2M1 in blocks of 16 with a UE8M0 scale each, computed as each token is written, no
    per-tensor scale. Follows ``python/sglang/srt/layers/quantization/kvfp4_tensor.py``
    (``FP4MXBlock16KVQuantizeUtil.batched_quantize``), used by ``FP4MXBlock16KVCacheMethod``
    (``fp4_kv_cache_quant_method.py``); rules in :func:`kveval.tensors.microscaling.encode_sglang_fp4_mx_block16`.
    Bytes per token and head: ``D / 2 + D / 16``. ``fp4_e2m1`` and ``nvfp4`` are refused (:data:`SGLANG_UNPINNED`).

    Attributes
    ----------
    kv_cache_dtype : str
        ``fp8_e4m3``, ``fp8_e5m2`` or ``fp4_mx_block16``.
    kv_scale : float, optional
        FP8: the checkpoint's scale, used for K and V; none: the values are cast as they are (a scale of 1.0).
    """

    name = "sglang"
    serving_engine: ClassVar[str] = "sglang"
    description = ("SGLang KV cache: fp8 (one per-tensor scale for K and V, divided in the model dtype, torch's cast) "
                   "or fp4_mx_block16 (E2M1, a UE8M0 scale per 16)")
    engine: ClassVar[str] = "SGLang"
    kv_cache_dtype: str = "fp8_e4m3"
    kv_scale: float | None = None

    def __post_init__(self):
        super().__post_init__()
        dtype = self.kv_cache_dtype
        check_engine_choice(self.name, "kv_cache_dtype", dtype, SGLANG_DTYPES, SGLANG_UNPINNED)
        if dtype == "fp4_mx_block16":
            self.format = dtype
            if self.kv_scale is not None:
                raise PolicySpecError(f"{self.name}: kv_cache_dtype=fp4_mx_block16 has no per-tensor scale "
                                      f"(a UE8M0 scale per 16 values); drop kv_scale=")
        else:
            self.format = fp8_format(dtype)
        check_positive_scale(self.name, "kv_scale", self.kv_scale)

    @property
    def follows(self) -> str:  # type: ignore[override]
        if self.kv_cache_dtype == "fp4_mx_block16":
            return ("python/sglang/srt/layers/quantization/kvfp4_tensor.py FP4MXBlock16KVQuantizeUtil.batched_quantize; "
                    "python/sglang/srt/layers/quantization/fp4_kv_cache_quant_method.py FP4MXBlock16KVCacheMethod")
        return ("python/sglang/srt/mem_cache/memory_pool.py MHATokenToKVPool.set_kv_buffer; "
                "python/sglang/srt/layers/quantization/kv_cache.py")

    @property
    def has_scales(self) -> bool:  # type: ignore[override]
        return self.kv_cache_dtype != "fp4_mx_block16"

    def check_head_dim(self, head_dim: int) -> None:
        if self.kv_cache_dtype == "fp4_mx_block16" and head_dim % NVFP4_BLOCK:
            raise PolicySpecError(f"{self.spec()}: fp4_mx_block16 codes blocks of {NVFP4_BLOCK} values and head_dim="
                                  f"{head_dim} is not a multiple of {NVFP4_BLOCK}; use fp8_e4m3")

    def coded_bytes(self, key_dim: int, value_dim: int, kv_itemsize: int) -> tuple[int, int]:
        if self.kv_cache_dtype == "fp4_mx_block16":
            return tuple(d // 2 + d // NVFP4_BLOCK for d in (key_dim, value_dim))
        return key_dim, value_dim

    def layer_scales(self, model, layer_idx: int) -> tuple[float | None, float | None]:
        return self.kv_scale, self.kv_scale

    def codec(self, model, layer_idx: int):
        from kveval.dtypes import deployment_kv_dtype
        from kveval.stores.engine import EngineCodec, Fp8Side, SglangFp4Side

        if self.kv_cache_dtype == "fp4_mx_block16":
            return EngineCodec(SglangFp4Side(), SglangFp4Side())
        side = Fp8Side(self.format, self.kv_scale, "torch-cast", deployment_kv_dtype(model))
        return EngineCodec(side, side)
