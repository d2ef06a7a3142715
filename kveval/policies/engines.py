"""Serving engines' KV-cache numerics as quantization policies: ``llamacpp``, ``vllm``, ``sglang``, ``trtllm``.

Each reproduces what its engine stores for K and V, byte for byte: the codes, their scales, the rounding and the
saturation (the formats: :mod:`kveval.tensors.engine_formats`; the store, which codes every token on arrival as
the engines do: :mod:`kveval.stores.engine`). Per-tensor scales computed from data (vLLM's first batch,
ModelOpt's amax) come from kveval's calibration pass (:func:`kveval.calibration.kv.calibration_kv`) and are
recorded with the run (:meth:`EnginePolicy.run_info`). Of what the engines do beyond their cache, llama.cpp's
conversion of Q to the K type's ``vec_dot_type`` is emulated (:meth:`LlamaCppPolicy.attended_query`); FP8 attention
kernels' own roundings (scales folded into the softmax scale, FP8 queries) are not: see ``docs/engines.md``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

from kveval.errors import PolicySpecError, UnsupportedModelError
from kveval.policies.base import Need, Placement, PlannedCoding, QuantizationPolicy, check_calib_tokens
from kveval.policies.compatibility import cache_shape
from kveval.policies.ds_records import DS_MLA_DTYPES, INDEXER_KV_DTYPES, RECORDS
from kveval.tensors import turboquant_vllm  # torch-free until a tensor is coded
from kveval.values import is_real
# Stores, calibration and the model's hooks import torch: imported inside the methods that run a policy on a model.

LLAMACPP_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
#: llama.cpp cache types kveval does not reproduce, and why (one line each).
LLAMACPP_UNPINNED = {"iq4_nl": "the gguf package has no reference quantizer to check it against bit for bit"}
#: vLLM's ``calculate_kv_scales`` divisors (``vllm/envs.py``: ``K_SCALE_CONSTANT``, ``V_SCALE_CONSTANT``).
VLLM_K_SCALE_CONSTANT, VLLM_V_SCALE_CONSTANT = 200, 100
FP8_LARGEST = {"e4m3": 448.0, "e5m2": 57344.0}


def _fp8_format(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise PolicySpecError(f"{name}: kv_cache_dtype={value!r} must be one of {', '.join(allowed)}")
    return "e5m2" if value.endswith("e5m2") else "e4m3"


#: The smallest normal float32 and bfloat16 (2**-126): a scale below it is 0 or subnormal in the dtypes the scale is
#: applied in, and every value it dequantizes is 0 (``sglang(kv_scale=1e-45)`` answered nothing but dashes).
SMALLEST_SCALE = 2.0 ** -126


def _positive_scale(name: str, key: str, value) -> None:
    if value is not None and (not is_real(value) or not value > 0):
        raise PolicySpecError(f"{name}: {key}={value!r} must be a positive number (the per-tensor dequantization scale)")
    if value is not None and value < SMALLEST_SCALE:
        raise PolicySpecError(f"{name}: {key}={value!r} is below the smallest normal bfloat16/float32 "
                              f"({SMALLEST_SCALE:.3g}): it dequantizes every value to 0; give a scale >= that")


@dataclass
class EnginePolicy(QuantizationPolicy):
    """What the engine presets share: per-token codes sized by :meth:`coded_bytes`, no residual, no sinks, and
    per-layer scales from the calibration pass where the preset calls for them."""

    codes_on_arrival: ClassVar[bool] = True
    calib_tokens = None  # tokens of the calibration pass (a dataclass field of the presets that calibrate)

    def __post_init__(self):
        self._models: dict[int, tuple[weakref.ref, dict]] = {}

    # --- what the stack and the cache ask of a quantizer -----------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        """Any head width codes (block formats refuse in :class:`LlamaCppPolicy`)."""

    def fit_widths(self, widths: dict[str, int], label: str) -> None:
        if label != "head_dim":
            raise PolicySpecError(f"{self.spec()}: an engine codes K/V heads, not a structure's {label} coefficients; "
                                  f"drop the structure policy")

    def planned_coding(self) -> PlannedCoding:
        """Codes sized per token by :meth:`coded_bytes`: no residual, no sinks."""
        return PlannedCoding(token_bytes=self.coded_bytes, label=self.name)

    @property
    def needs(self) -> frozenset[Need]:
        return frozenset({Need.CALIBRATION}) if self.needs_calibration else frozenset()

    def coded_bytes(self, key_dim: int, value_dim: int, kv_itemsize: int) -> tuple[int, int]:
        """Bytes the engine stores per token and KV head, ``(K, V)`` (scales inside ggml blocks included)."""
        return key_dim, value_dim  # one byte a value (FP8, INT8)

    def bytes_per_token(self, head_dim: int, kv_itemsize: int = 2) -> float:
        return sum(self.coded_bytes(head_dim, head_dim, kv_itemsize))

    # --- scales ----------------------------------------------------------------------------------
    needs_calibration: ClassVar[bool] = False

    def _state(self, model) -> dict:
        entry = self._models.get(id(model))
        if entry is None or entry[0]() is not model:
            entry = (weakref.ref(model), {})
            self._models[id(model)] = entry
        return entry[1]

    def amax(self, model) -> dict:
        """Per layer, the largest |K| and |V| of the calibration pass, in the model's deployment dtype
        (``{"k": [...], "v": [...], "tokens": T, "calibration_id": ...}``; ``None`` for a layer without K/V)."""
        state = self._state(model)
        if "amax" not in state:
            import torch

            from kveval.calibration.kv import DEFAULT_CALIB_TOKENS, KVAmax, load_or_calibrate, read_calibration_text
            from kveval.dtypes import deployment_kv_dtype

            text = read_calibration_text(None)
            tokens = self.calib_tokens or DEFAULT_CALIB_TOKENS
            found = load_or_calibrate(model, text, tokens, KVAmax)  # cached on disk like every calibration
            dtype = deployment_kv_dtype(model)

            def rounded(a):  # the amax of K in the deployment dtype (rounding is monotonic)
                return None if a is None else float(torch.tensor(a, dtype=torch.float32).to(dtype).float())

            state["amax"] = {"k": [rounded(a) for a in found.k], "v": [rounded(a) for a in found.v],
                             "tokens": found.tokens, "calibration_id": text.calibration_id(tokens),
                             "cache_file": str(found.path), "dtype": str(dtype).removeprefix("torch.")}
        return state["amax"]

    def layer_scales(self, model, layer_idx: int) -> tuple[float | None, float | None]:
        """Layer ``layer_idx``'s K and V dequantization scales (float32 values)."""
        return 1.0, 1.0

    def prepare(self, model) -> None:
        if self.needs_calibration:
            self.amax(model)

    def run_info(self, model) -> dict:
        info: dict = {"engine": self.engine, "follows": self.follows}
        layers = getattr(model.config.get_text_config(), "num_hidden_layers", 0)
        if self.has_scales:
            scales = [self.layer_scales(model, i) for i in range(layers)]
            info["k_scales"] = [k for k, _ in scales]
            info["v_scales"] = [v for _, v in scales]
            info["scale_bytes"] = 8 * layers  # a float32 K and V scale per layer, per model (not per token)
        if self.needs_calibration:
            amax = self.amax(model)
            info.update(calibration_id=amax["calibration_id"], calibration_tokens_used=amax["tokens"],
                        cache_file=amax["cache_file"], k_amax=amax["k"], v_amax=amax["v"], amax_dtype=amax["dtype"])
        return info

    engine: ClassVar[str] = ""
    follows: ClassVar[str] = ""
    has_scales: ClassVar[bool] = True

    # --- the store -------------------------------------------------------------------------------
    def codec(self, model, layer_idx: int):
        raise NotImplementedError

    def make_store(self, inner, model, layer_idx: int):
        """A :class:`kveval.stores.engine.EngineStore` in place of ``inner`` (computing in its dtype)."""
        from kveval.stores.engine import EngineStore

        return EngineStore(self.layer_codec(model, layer_idx), inner.compute_dtype)

    def layer_codec(self, model, layer_idx: int):
        """:meth:`codec`, built once per model and layer."""
        codecs = self._state(model).setdefault("codecs", {})
        if layer_idx not in codecs:
            codecs[layer_idx] = self.codec(model, layer_idx)
        return codecs[layer_idx]


@dataclass
class LlamaCppPolicy(EnginePolicy):
    """llama.cpp's ``--cache-type-k`` / ``--cache-type-v``: ggml blocks of 32 values along each token's head row.

    Follows ``ggml/src/ggml-quants.c`` (``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref``,
    ``quantize_row_q4_1_ref``, ``quantize_row_q5_0_ref``, ``quantize_row_q5_1_ref`` and the matching
    ``dequantize_row_*``), checked bit for bit against the ``gguf`` package's numpy port (``gguf.quants``).

    Attributes
    ----------
    k, v : str
        Cache types of K and V: ``f16`` (llama.cpp's default), ``bf16``, ``f32``, ``q8_0``, ``q5_1``, ``q5_0``,
        ``q4_1``, ``q4_0``. Block types need a head width that is a multiple of 32, as llama.cpp does.
    quantize_q : bool
        Round Q as ggml's Q.K takes it (default ``true``): converted to the K type's ``vec_dot_type``
        (``q8_0`` for a ``q8_0``/``q4_0``/``q5_0`` K, ``q8_1`` for ``q4_1``/``q5_1``, ``f16``/``bf16`` for those),
        as the CPU flash attention (``ggml/src/ggml-cpu/ops.cpp``, ``q_to_vec_dot``) and ``ggml_mul_mat`` both do;
        ``false``: K/V codes alone.
    cpu : bool
        llama.cpp on an x86 CPU (AVX) build: ``q8_0`` codes (of K, V and Q) as its SIMD ``quantize_row_q8_0`` gives
        them (``id = 127 / amax``, halves rounded to even), not the reference function's (``1 / d``, ``roundf``),
        which CUDA's copy kernels follow. Default ``false``.
    """

    name = "llamacpp"
    serving_engine: ClassVar[str] = "llamacpp"
    description = "llama.cpp cache types (--cache-type-k/-v): q8_0, q5_1, q5_0, q4_1, q4_0, f16, bf16 ggml blocks"
    engine: ClassVar[str] = "llama.cpp"
    follows: ClassVar[str] = "ggml/src/ggml-quants.c quantize_row_<type>_ref / dequantize_row_<type>"
    has_scales: ClassVar[bool] = False
    k: str = "f16"
    v: str = "f16"
    quantize_q: bool = True
    cpu: bool = False

    def __post_init__(self):
        super().__post_init__()
        for key in ("k", "v"):
            value = getattr(self, key)
            if value in LLAMACPP_UNPINNED:
                raise PolicySpecError(f"{self.name}: {key}={value} is not reproduced ({LLAMACPP_UNPINNED[value]}); "
                                      f"use one of {', '.join(LLAMACPP_TYPES)}")
            if value not in LLAMACPP_TYPES:
                raise PolicySpecError(f"{self.name}: {key}={value!r} is not a llama.cpp cache type; use one of "
                                      f"{', '.join(LLAMACPP_TYPES)}")

    def check_head_dim(self, head_dim: int) -> None:
        for key in ("k", "v"):
            kind = getattr(self, key)
            if kind.startswith("q") and head_dim % 32:
                raise PolicySpecError(f"{self.spec()}: {key}={kind} codes blocks of 32 values and head_dim={head_dim} "
                                      f"is not a multiple of 32 (llama.cpp refuses it too); use f16 or bf16")

    def attended_query(self, query):
        if not self.quantize_q:
            return query
        from kveval.tensors.engine_formats import ggml_query

        return ggml_query(query, self.k, self.cpu)

    def coded_bytes(self, key_dim: int, value_dim: int, kv_itemsize: int) -> tuple[int, int]:
        from kveval.tensors.engine_formats import ggml_row_bytes

        return ggml_row_bytes(self.k, key_dim), ggml_row_bytes(self.v, value_dim)

    def codec(self, model, layer_idx: int):
        from kveval.stores.engine import EngineCodec, GgmlSide

        return EngineCodec(GgmlSide(self.k, self.cpu), GgmlSide(self.v, self.cpu))


#: vLLM 0.33's ``--kv-cache-dtype`` values kveval codes (``vllm/config/cache.py``, ``CacheDType``), by how the cache
#: holds them: per-tensor FP8, one scale per token and head, NVFP4 blocks.
VLLM_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")
VLLM_PER_TOKEN_HEAD = {"int8_per_token_head": "int8", "fp8_per_token_head": "fp8", "int4_per_token_head": "int4"}
VLLM_NVFP4 = ("nvfp4",)
VLLM_TURBOQUANT = tuple(turboquant_vllm.PRESETS)
VLLM_DTYPES = VLLM_FP8 + tuple(VLLM_PER_TOKEN_HEAD) + VLLM_NVFP4 + VLLM_TURBOQUANT
#: vLLM 0.33 cache dtypes kveval does not reproduce, and what could not be pinned (one line each).
VLLM_UNPINNED = {
    "nvfp4_4over6": ("vLLM 0.33 writes it only with its compiled SM100 kernel (torch.ops._C_cache_ops."
                     "reshape_and_cache_flash; FlashInfer's slot-mapping writer has no scale search), whose global "
                     "scale and rounding no source here shows; fouroversix's reference scales by a whole tensor's amax"),
}
#: Bytes of the float32 scale vLLM stores with each token's head row in the per-token-head caches.
PER_TOKEN_HEAD_SCALE_BYTES = 4
#: NVFP4's block: 16 E2M1 values share an E4M3 scale.
NVFP4_BLOCK = 16


@dataclass
class VllmPolicy(EnginePolicy):
    """vLLM 0.33's ``--kv-cache-dtype``: per-tensor FP8, per-token-head INT8/FP8/INT4, NVFP4, and DeepSeek's packed
    per-token records ``fp8_ds_mla|nvfp4_ds_mla`` (:mod:`kveval.policies.ds_records`).

    ``fp8|fp8_e4m3|fp8_e5m2``: per-tensor K and V scales, a saturating cast. Follows
    ``vllm/model_executor/layers/quantization/kv_cache.py`` (``BaseKVCacheMethod.process_weights_after_loading``:
    the checkpoint's ``k_scale``/``v_scale``, else 1.0 with a warning), ``vllm/attention/layer.py``
    (``Attention.calc_kv_scales``: ``abs(key).max() / K_SCALE_CONSTANT`` (200), ``abs(value).max() /
    V_SCALE_CONSTANT`` (100), once, on the first batch) and ``csrc/quantization/fp8/nvidia/quant_utils.cuh``
    (``scaled_vec_conversion<uint8_t, float>``: ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)``).

    ``int8_per_token_head|fp8_per_token_head|int4_per_token_head``: one float32 scale per token and KV head,
    computed when the token is written; the checkpoint's scales are ignored (``process_weights_after_loading``
    sets them to 1.0 for these). Follows ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``
    (``_reshape_cache_per_token_head``) and ``vllm/v1/attention/ops/int4_per_token_head.py``
    (``_reshape_cache_int4_kernel``, ``single_rht``); rules in :mod:`kveval.tensors.per_token_head`. Bytes per
    token and head: ``D + 4`` (INT8, FP8), ``D / 2 + 4`` (INT4).

    ``nvfp4``: E2M1 in blocks of 16 with an E4M3 scale each, computed when the token is written, under a per-layer
    FP32 global scale: ``k_scale``/``v_scale`` from the checkpoint, else 1.0 (vLLM 0.33 computes none). Follows
    ``vllm/v1/attention/backends/flashinfer.py`` (``FlashInferImpl.do_kv_cache_update``) and FlashInfer
    0.7.2.post1's ``include/flashinfer/page.cuh`` (``nvfp4_append_quantize_block``), the writer on SM 8x/9x/12x
    (:func:`kveval.tensors.engine_formats.flashinfer_nvfp4_encode`); SM100's compiled ``reshape_and_cache_flash``
    is not read. Bytes per token and head: ``D / 2 + D / 16`` (``vllm/utils/torch_utils.py``,
    ``nvfp4_kv_cache_full_dim``), plus the per-layer scales.

    ``turboquant_k8v4|turboquant_4bit_nc|turboquant_k3v4_nc|turboquant_3bit_nc``: keys rotated by a Hadamard
    matrix and coded per coordinate on Lloyd-Max centroids with a float16 norm (3 or 4 bits; ``nc``: the centroid
    vector re-normalized when read), or FP8 keys (``k8v4``); values in 4 or 3 uniform bits with a float16 scale and
    min; all computed per token and head as it is written, no per-tensor scale. The first prefill chunk attends over
    its raw K/V; later tokens read the codes. The first and last two layers stay in the model dtype (vLLM's boundary
    protection). Follows ``vllm/model_executor/layers/quantization/turboquant/config.py`` (``TQ_PRESETS``,
    ``get_boundary_skip_layers``), ``.../turboquant/centroids.py`` (``solve_lloyd_max``),
    ``vllm/v1/attention/ops/triton_turboquant_store.py`` (``triton_turboquant_store``), ``triton_turboquant_decode.py``
    (``_tq_decode_stage1``) and ``vllm/v1/attention/backends/turboquant_attn.py`` (``_build_hadamard_cached``,
    ``_prefill_attention``); rules in :mod:`kveval.tensors.turboquant_vllm`. Bytes per token and head: vLLM's slot,
    ``TurboQuantConfig.slot_size_aligned`` (K: ``D b_k / 8 + 2``, or ``D`` for FP8; V: ``D b_v / 8 + 4``; rounded up
    to even). Head widths must be powers of two; MLA models have no TurboQuant backend in vLLM and are refused.

    Attributes
    ----------
    kv_cache_dtype : str
        One of :data:`VLLM_DTYPES` (``fp8`` = ``fp8_e4m3`` on CUDA); those in :data:`VLLM_UNPINNED` are refused.
        On DeepSeek V3.2 and V4 alone, also ``fp8_ds_mla`` (V3.2: a 656-byte record a token, the 512-value latent
        in e4m3 with a power-of-two float32 scale per 128 and the 64 RoPE dims in bfloat16; V4: 584 bytes an entry,
        448 e4m3 NoPE dims with a UE8M0 scale per 64 and 64 bfloat16 RoPE dims, for the window and the CSA/HCA
        entries alike) or ``nvfp4_ds_mla`` (V3.2 only: 352 bytes, the latent in E2M1 with an e4m3 scale per 16 and
        the RoPE dims in unscaled e4m3). Their scales are computed per token and tile as the token is written (no
        calibration, no checkpoint scales); the DSA indexer's keys go to vLLM's FP8 indexer cache (132 bytes), or
        MXFP4 with ``indexer_kv_dtype=mxfp4`` on V4. Read from vLLM 0.33.0 (:mod:`kveval.tensors.ds_records` names
        the kernels); refused on per-head models, on V2/V3 (vLLM serves these dtypes on its sparse MLA backends
        only) and, for ``nvfp4_ds_mla``, on V4.
    scales : str
        Per-tensor scales (FP8, NVFP4): ``unit`` (1.0: vLLM's default for a checkpoint without scales), ``dynamic``
        (FP8 only: ``calculate_kv_scales`` from the first batch; here the calibration pass is that batch) or
        ``checkpoint`` (``k_scale``/``v_scale`` given, for every layer). Per-token-head caches take ``unit`` only.
    k_scale, v_scale : float, optional
        The checkpoint's scales, with ``scales=checkpoint``.
    calib_tokens : int, optional
        Tokens of the calibration text for ``scales=dynamic`` (default 2048).
    indexer_kv_dtype : str
        With ``fp8_ds_mla`` on DeepSeek V4: vLLM's ``attention_config.indexer_kv_dtype``, ``fp8`` (its default, 132
        bytes a key) or ``mxfp4`` (68 bytes, as DeepSeek serves V4).
    """

    name = "vllm"
    serving_engine: ClassVar[str] = "vllm"
    description = ("vLLM KV cache: fp8 (per-tensor scales), int8/fp8/int4_per_token_head (a scale per token and "
                   "head), nvfp4 (E2M1, E4M3 block scales, per-layer global scale); DeepSeek's fp8_ds_mla/nvfp4_ds_mla "
                   "records")
    engine: ClassVar[str] = "vLLM"
    kv_cache_dtype: str = "fp8"
    scales: str = "unit"
    k_scale: float | None = None
    v_scale: float | None = None
    calib_tokens: int | None = None
    indexer_kv_dtype: str = "fp8"

    def __post_init__(self):
        super().__post_init__()
        dtype = self.kv_cache_dtype
        if self.indexer_kv_dtype not in INDEXER_KV_DTYPES:
            raise PolicySpecError(f"{self.name}: indexer_kv_dtype={self.indexer_kv_dtype!r} must be one of "
                                  f"{', '.join(INDEXER_KV_DTYPES)}")
        self.records = RECORDS.get((dtype, self.indexer_kv_dtype))
        if self.indexer_kv_dtype != "fp8" and self.records is None:
            raise PolicySpecError(f"{self.name}: indexer_kv_dtype={self.indexer_kv_dtype} codes DeepSeek V4's indexer "
                                  f"keys beside kv_cache_dtype=fp8_ds_mla; give that, or drop indexer_kv_dtype")
        if self.records is not None:
            if self.scales != "unit" or self.k_scale is not None or self.v_scale is not None:
                raise PolicySpecError(f"{self.name}: kv_cache_dtype={dtype} computes its scales per "
                                      f"token and tile as it writes them; drop scales=, k_scale= and v_scale=")
            check_calib_tokens(self.name, self.calib_tokens, None)
            return
        if dtype in VLLM_UNPINNED:
            raise PolicySpecError(f"{self.name}: kv_cache_dtype={dtype} is not reproduced ({VLLM_UNPINNED[dtype]}); "
                                  f"use one of {', '.join(VLLM_DTYPES + DS_MLA_DTYPES)}")
        if dtype not in VLLM_DTYPES:
            raise PolicySpecError(f"{self.name}: kv_cache_dtype={dtype!r} must be one of "
                                  f"{', '.join(VLLM_DTYPES + DS_MLA_DTYPES)}")
        self.format = _fp8_format(self.name, dtype, VLLM_FP8) if dtype in VLLM_FP8 else dtype
        if self.scales not in ("unit", "dynamic", "checkpoint"):
            raise PolicySpecError(f"{self.name}: scales={self.scales!r} must be unit, dynamic or checkpoint")
        if dtype in VLLM_TURBOQUANT and self.scales != "unit":
            raise PolicySpecError(f"{self.name}: kv_cache_dtype={dtype} codes every token and head with scales of its "
                                  f"own (no per-tensor scale); drop scales=")
        if dtype in VLLM_PER_TOKEN_HEAD and self.scales != "unit":
            raise PolicySpecError(f"{self.name}: kv_cache_dtype={dtype} computes a scale per token and head as it "
                                  f"writes (vLLM ignores per-tensor scales for it); drop scales=")
        if dtype in VLLM_NVFP4 and self.scales == "dynamic":
            raise PolicySpecError(f"{self.name}: kv_cache_dtype={dtype} takes its global scales from the checkpoint "
                                  f"or 1.0 (vLLM 0.33 computes none); use scales=unit or scales=checkpoint")
        for key in ("k_scale", "v_scale"):
            _positive_scale(self.name, key, getattr(self, key))
        given = (self.k_scale is not None, self.v_scale is not None)
        if self.scales == "checkpoint" and not all(given):
            raise PolicySpecError(f"{self.name}: scales=checkpoint needs k_scale= and v_scale= (the checkpoint's scales)")
        if self.scales != "checkpoint" and any(given):
            raise PolicySpecError(f"{self.name}: k_scale/v_scale are the checkpoint's scales; add scales=checkpoint")
        check_calib_tokens(self.name, self.calib_tokens, None)

    @property
    def follows(self) -> str:  # type: ignore[override]
        if self.records is not None:
            return ("vllm/model_executor/models/deepseek_v32/common/kernels.py; "
                    "vllm/model_executor/models/deepseek_v4/common/ops/fused_compress_quant_cache.py "
                    "(kveval/tensors/ds_records.py names each kernel)")
        if self.kv_cache_dtype in VLLM_TURBOQUANT:
            return ("vllm/model_executor/layers/quantization/turboquant/config.py TQ_PRESETS, get_boundary_skip_layers; "
                    "turboquant/centroids.py solve_lloyd_max; vllm/v1/attention/ops/triton_turboquant_store.py "
                    "triton_turboquant_store; triton_turboquant_decode.py _tq_decode_stage1; "
                    "vllm/v1/attention/backends/turboquant_attn.py _build_hadamard_cached, _prefill_attention")
        if self.kv_cache_dtype in VLLM_PER_TOKEN_HEAD:
            return ("vllm/v1/attention/ops/triton_reshape_and_cache_flash.py _reshape_cache_per_token_head; "
                    "vllm/v1/attention/ops/int4_per_token_head.py _reshape_cache_int4_kernel, single_rht")
        if self.kv_cache_dtype in VLLM_NVFP4:
            return ("vllm/v1/attention/backends/flashinfer.py FlashInferImpl.do_kv_cache_update; flashinfer 0.7.2.post1 "
                    "include/flashinfer/page.cuh nvfp4_append_quantize_block; "
                    "vllm/model_executor/layers/quantization/kv_cache.py")
        return ("vllm/attention/layer.py Attention.calc_kv_scales; vllm/model_executor/layers/quantization/kv_cache.py; "
                "csrc/quantization/fp8/nvidia/quant_utils.cuh scaled_vec_conversion")

    @property
    def has_scales(self) -> bool:  # type: ignore[override]
        """Per-layer scales: none for the per-token-head and TurboQuant caches and DeepSeek's records (theirs are per
        token)."""
        return (self.records is None and self.kv_cache_dtype not in VLLM_PER_TOKEN_HEAD
                and self.kv_cache_dtype not in VLLM_TURBOQUANT)

    @property
    def codes_on_arrival(self) -> bool:  # type: ignore[override]
        """TurboQuant's first prefill chunk attends over its raw K/V (the store codes them after it)."""
        return self.kv_cache_dtype not in VLLM_TURBOQUANT

    def mla_refusal(self, model_name: str) -> str | None:
        if self.kv_cache_dtype in VLLM_TURBOQUANT:
            return (f"{self.spec()}: vLLM 0.33 has no TurboQuant backend for {model_name}'s MLA cache (TurboQuant is "
                    f"one of its per-head attention backends only); use kv_cache_dtype=fp8")
        return None

    def planned_coding(self) -> PlannedCoding:
        """Codes sized per token (DeepSeek's records: theirs); under TurboQuant the boundary layers in the model dtype."""
        if self.records is not None:
            return self.records.planned_coding()
        native = turboquant_vllm.boundary_layers if self.kv_cache_dtype in VLLM_TURBOQUANT else None
        return PlannedCoding(token_bytes=self.coded_bytes, label=self.name, native_layers=native)

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.scales == "dynamic"

    def check_head_dim(self, head_dim: int) -> None:
        dtype = self.kv_cache_dtype
        if dtype in VLLM_NVFP4 and head_dim % NVFP4_BLOCK:
            raise PolicySpecError(f"{self.spec()}: NVFP4 codes blocks of {NVFP4_BLOCK} values and head_dim={head_dim} "
                                  f"is not a multiple of {NVFP4_BLOCK} (vLLM sizes heads in whole blocks); use fp8")
        if dtype in VLLM_TURBOQUANT and turboquant_vllm.unsupported_dim(head_dim):
            raise PolicySpecError(f"{self.spec()}: {turboquant_vllm.unsupported_dim(head_dim)}; use fp8")
        if VLLM_PER_TOKEN_HEAD.get(dtype) == "int4" and head_dim % 2:
            raise PolicySpecError(f"{self.spec()}: int4_per_token_head packs two values a byte and head_dim="
                                  f"{head_dim} is odd; use int8_per_token_head")

    def coded_bytes(self, key_dim: int, value_dim: int, kv_itemsize: int) -> tuple[int, int]:
        """Bytes vLLM stores per token and KV head, ``(K, V)``: codes and, per token-head, the float32 scale or the
        NVFP4 block scales (per-layer scales are per model: :meth:`run_info`)."""
        dtype = self.kv_cache_dtype
        if dtype in VLLM_TURBOQUANT:  # one slot a token and head: [key | value | pad to even]
            layout = turboquant_vllm.TurboQuantLayout.of(dtype, key_dim)
            return layout.key_bytes, layout.value_bytes + layout.pad_bytes
        if dtype in VLLM_NVFP4:
            return tuple(d // 2 + d // NVFP4_BLOCK for d in (key_dim, value_dim))
        if dtype in VLLM_PER_TOKEN_HEAD:
            half = VLLM_PER_TOKEN_HEAD[dtype] == "int4"
            return tuple((d // 2 if half else d) + PER_TOKEN_HEAD_SCALE_BYTES for d in (key_dim, value_dim))
        return key_dim, value_dim

    # --- DeepSeek's records (fp8_ds_mla, nvfp4_ds_mla) ------------------------------------------------------------
    def supports(self, placement: Placement) -> bool:
        """The records code the parts of DeepSeek's own cache (:attr:`Placement.PARTS`); per-tensor FP8 does not."""
        return (self.records is not None and placement is Placement.PARTS) or super().supports(placement)

    def check_cache(self, shape) -> None:
        """The records' checks (:meth:`~kveval.policies.ds_records.DeepSeekRecords.check_cache`); per-tensor FP8 is
        refused on DeepSeek V3.2 and V4, whose sparse backends vLLM serves ``fp8`` on as ``fp8_ds_mla``
        (``mla_attention.py`` ``_canonicalize_sparse_mla_kv_cache_dtype``; ``deepseek_v4/attention.py``)."""
        if self.records is not None:
            self.records.check_cache(self.spec(), shape)
        elif shape.kind == "v4" and self.kv_cache_dtype not in VLLM_FP8:
            raise UnsupportedModelError(
                f"{self.spec()}: vLLM 0.33 refuses --kv-cache-dtype {self.kv_cache_dtype} on {shape.model}'s packed "
                f"cache (vllm/models/deepseek_v4/attention.py _resolve_dsv4_kv_cache_dtype: \"fp8_ds_mla layout only "
                f"supports fp8\"); use vllm(kv_cache_dtype=fp8_ds_mla)")
        elif shape.kind in ("indexed_mla", "v4"):
            raise UnsupportedModelError(
                f"{self.spec()}: vLLM 0.33 serves --kv-cache-dtype {self.kv_cache_dtype} on {shape.model}'s sparse "
                f"attention as its fp8_ds_mla record ("
                + ("DeepSeek V4's _resolve_dsv4_kv_cache_dtype" if shape.kind == "v4" else
                   "mla_attention.py _canonicalize_sparse_mla_kv_cache_dtype: every quantized dtype but nvfp4_ds_mla")
                + "); use vllm(kv_cache_dtype=fp8_ds_mla)")

    def planned_part_coding(self, part: str, width: int) -> PlannedCoding | None:
        return self.records.planned_part_coding(part, width) if self.records is not None else None

    def part_codes(self, model, layer_idx: int, part: str, width: int, kv_dtype, stride: int):
        if self.records is None:
            return super().part_codes(model, layer_idx, part, width, kv_dtype, stride)
        return self.records.sequence(part, width, v4=cache_shape(model.config).kind == "v4")

    def layer_scales(self, model, layer_idx: int) -> tuple[float | None, float | None]:
        import torch

        if self.kv_cache_dtype in VLLM_PER_TOKEN_HEAD or self.kv_cache_dtype in VLLM_TURBOQUANT:
            return None, None
        if self.scales == "unit":
            return 1.0, 1.0
        if self.scales == "checkpoint":
            return float(torch.tensor(self.k_scale, dtype=torch.float32)), float(torch.tensor(self.v_scale, dtype=torch.float32))
        amax = self.amax(model)
        k, v = amax["k"][layer_idx], amax["v"][layer_idx]
        if k is None:
            return None, None
        # abs(key).max() in the model dtype divided by a float32 tensor: a float32 quotient
        return (float(torch.tensor(k, dtype=torch.float32) / VLLM_K_SCALE_CONSTANT),
                float(torch.tensor(v, dtype=torch.float32) / VLLM_V_SCALE_CONSTANT))

    def codec(self, model, layer_idx: int):
        from kveval.dtypes import deployment_kv_dtype
        from kveval.stores.engine import EngineCodec, FlashinferNvfp4Side, Fp8Side, PerTokenHeadSide

        dtype = self.kv_cache_dtype
        if dtype in VLLM_TURBOQUANT:
            from kveval.modeling.architectures import cache_head_dims
            from kveval.stores.engine import TurboQuantSide

            layout = turboquant_vllm.TurboQuantLayout.of(dtype, cache_head_dims(model.config)[0])
            return EngineCodec(TurboQuantSide(layout, "key"), TurboQuantSide(layout, "value"))
        if dtype in VLLM_PER_TOKEN_HEAD:
            side = PerTokenHeadSide(VLLM_PER_TOKEN_HEAD[dtype], deployment_kv_dtype(model))
            return EngineCodec(side, side)
        k, v = self.layer_scales(model, layer_idx)
        if dtype in VLLM_NVFP4:
            return EngineCodec(FlashinferNvfp4Side(k), FlashinferNvfp4Side(v))
        return EngineCodec(Fp8Side(self.format, k), Fp8Side(self.format, v))

    def boundary_layers(self, model) -> frozenset[int]:
        """TurboQuant: the layers vLLM keeps in the model dtype (none for the other dtypes)."""
        if self.kv_cache_dtype not in VLLM_TURBOQUANT:
            return frozenset()
        from kveval.modeling.architectures import ATTENTION, cache_layer_plan

        config = model.config.get_text_config()
        hybrid = any(layer.kind != ATTENTION for layer in cache_layer_plan(config))
        return turboquant_vllm.boundary_layers(config.num_hidden_layers, hybrid)

    def make_store(self, inner, model, layer_idx: int):
        """DeepSeek's records: a :class:`~kveval.stores.records.RecordStore`. TurboQuant: ``inner`` (the model dtype)
        in a boundary layer, else a store whose first chunk attends raw. Else the engine store of :meth:`codec`."""
        if self.records is not None:
            from kveval.stores.records import RecordStore

            return RecordStore(self.records.engine_codec, inner.compute_dtype)
        if self.kv_cache_dtype not in VLLM_TURBOQUANT:
            return super().make_store(inner, model, layer_idx)
        if layer_idx in self.boundary_layers(model):
            return inner
        from kveval.stores.engine import FirstChunkRawStore

        return FirstChunkRawStore(self.layer_codec(model, layer_idx), inner.compute_dtype, inner.kv_dtype)

    def run_info(self, model) -> dict:
        info = super().run_info(model)
        if self.kv_cache_dtype in VLLM_TURBOQUANT:
            info["model_dtype_layers"] = sorted(self.boundary_layers(model))
        return info


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
        if dtype in SGLANG_UNPINNED:
            raise PolicySpecError(f"{self.name}: kv_cache_dtype={dtype} is not reproduced ({SGLANG_UNPINNED[dtype]}); "
                                  f"use one of {', '.join(SGLANG_DTYPES)}")
        if dtype == "fp4_mx_block16":
            self.format = dtype
            if self.kv_scale is not None:
                raise PolicySpecError(f"{self.name}: kv_cache_dtype=fp4_mx_block16 has no per-tensor scale "
                                      f"(a UE8M0 scale per 16 values); drop kv_scale=")
        else:
            self.format = _fp8_format(self.name, dtype, SGLANG_DTYPES[:2])
        _positive_scale(self.name, "kv_scale", self.kv_scale)

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
        if self.kv_cache_dtype == "nvfp4":
            raise PolicySpecError(f"{self.name}: kv_cache_dtype=nvfp4 is not reproduced ({TRTLLM_NVFP4_UNPINNED}); "
                                  f"use int8 or fp8")
        if self.kv_cache_dtype not in ("int8", "fp8"):
            raise PolicySpecError(f"{self.name}: kv_cache_dtype={self.kv_cache_dtype!r} must be int8 or fp8")
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
