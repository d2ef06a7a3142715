"""TensorRT-LLM / ModelOpt INT8 and FP8 KV caches as the ``trtllm`` engine preset (the engines' shared contract:
:mod:`kveval.policies.engines`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kveval.policies.base import check_calib_tokens
from kveval.policies.engines import EnginePolicy, check_engine_choice


#: Why TensorRT-LLM's NVFP4 KV cache is refused (one line).
TRTLLM_NVFP4_UNPINNED = ("TensorRT-LLM writes it with a compiled kernel no package here ships the source of, and "
                         "nvidia-modelopt 0.47 only exports its global scale (amax / (6 * 448), which TensorRT-LLM's "
                         "kernels take x6 per SGLang) and fake-quantizes with block scales clamped to [2**-9, 448]")


@dataclass
class TrtllmPolicy(EnginePolicy):
    """TensorRT-LLM with a ModelOpt-calibrated KV cache: INT8 or FP8, one scale per layer shared by K and V.

    Follows ``modelopt/torch/export/quant_utils.py`` (``get_scaling_factor``: ``amax / maxbound``, 127 for INT8 and
    448 for FP8; ``get_kv_cache_scaling_factor``: FP8 scales at least 1.0) and
    ``modelopt/torch/export/model_config_utils.py`` (``kv_cache_scaling_factor = max(k, v)``, one per layer, for
    TensorRT-LLM). The cache write multiplies by the float32 reciprocal and rounds to nearest even, saturating
    (INT8: ``cvt.rni.sat.s8.f32``; FP8: the ``__nv_fp8_e4m3`` constructor, ``__NV_SATFINITE``).

    Attributes
    ----------
    kv_cache_dtype : str
        ``int8`` or ``fp8``.
    calib_tokens : int, optional
        Tokens of the calibration text the amax is taken over (default 2048).
    """

    name = "trtllm"
    serving_engine: ClassVar[str] = "trtllm"
    description = "TensorRT-LLM/ModelOpt KV cache: int8 or fp8, amax-calibrated scale per layer shared by K and V"
    engine: ClassVar[str] = "TensorRT-LLM (ModelOpt)"
    follows: ClassVar[str] = ("modelopt/torch/export/quant_utils.py get_scaling_factor, get_kv_cache_scaling_factor; "
                              "modelopt/torch/export/model_config_utils.py kv_cache_scaling_factor")
    needs_calibration: ClassVar[bool] = True
    kv_cache_dtype: str = "int8"
    calib_tokens: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check_engine_choice(self.name, "kv_cache_dtype", self.kv_cache_dtype, ("int8", "fp8"),
                            {"nvfp4": TRTLLM_NVFP4_UNPINNED})
        check_calib_tokens(self.name, self.calib_tokens, None)

    def layer_scales(self, model, layer_idx: int) -> tuple[float | None, float | None]:
        import torch

        amax = self.amax(model)
        k, v = amax["k"][layer_idx], amax["v"][layer_idx]
        if k is None:
            return None, None
        bound = 127.0 if self.kv_cache_dtype == "int8" else 448.0
        ks, vs = (torch.tensor(a, dtype=torch.float32) / bound for a in (k, v))
        if self.kv_cache_dtype == "fp8":
            ks, vs = ks.clamp(min=1.0), vs.clamp(min=1.0)
        shared = float(torch.maximum(ks, vs))
        return shared, shared

    def codec(self, model, layer_idx: int):
        from kveval.stores.engine import EngineCodec, Fp8Side, Int8Side

        scale, _ = self.layer_scales(model, layer_idx)
        side = Int8Side(scale) if self.kv_cache_dtype == "int8" else Fp8Side("e4m3", scale, "reciprocal")
        return EngineCodec(side, side)
