"""vLLM's ``--kv-cache-dtype`` as the ``vllm`` engine preset: per-tensor FP8, per-token-head INT8/FP8/INT4, NVFP4,
TurboQuant and DeepSeek's packed records (the engines' shared contract: :mod:`kveval.policies.engines`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kveval.errors import PolicySpecError, UnsupportedModelError
from kveval.policies.base import Placement, PlannedCoding, check_calib_tokens
from kveval.policies.compatibility import cache_shape
from kveval.policies.ds_records import DS_MLA_DTYPES, INDEXER_KV_DTYPES, RECORDS
from kveval.policies.engines import (NVFP4_BLOCK, EnginePolicy, check_engine_choice, check_positive_scale,
                                     fp8_format)
from kveval.tensors import turboquant_vllm  # torch-free until a tensor is coded


#: vLLM's ``calculate_kv_scales`` divisors (``vllm/envs.py``: ``K_SCALE_CONSTANT``, ``V_SCALE_CONSTANT``).
VLLM_K_SCALE_CONSTANT, VLLM_V_SCALE_CONSTANT = 200, 100
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
        check_engine_choice(self.name, "kv_cache_dtype", dtype, VLLM_DTYPES + DS_MLA_DTYPES, VLLM_UNPINNED)
        self.format = fp8_format(dtype) if dtype in VLLM_FP8 else dtype
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
            check_positive_scale(self.name, key, getattr(self, key))
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
