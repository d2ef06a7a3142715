"""vLLM 0.33's own Triton cache writers for the per-token-head KV caches, run on the CPU by Triton's interpreter.

vLLM's kernels need a GPU, but Triton's interpreter (``TRITON_INTERPRET=1``) runs the same ``@triton.jit`` source
with numpy on the CPU. This module reads the kernels' source from an unpacked vLLM 0.33.0 wheel (the folder holding
``vllm/``, named by ``KVEVAL_VLLM_SOURCE``) without importing vLLM (its package needs CUDA builds), writes them to a
module of their own, and launches them as vLLM's wrappers do (``triton_reshape_and_cache_flash_per_token_head_quant``,
``_run_reshape_kernel``). ``triton`` is imported from the environment, or from ``KVEVAL_TRITON_PATH``.

The interpreter computes in IEEE float32 (division rounded, where the GPU's Triton ``/`` may be approximate), and
its float32 -> FP8 store conversion loses the carry into the exponent (124.3 stores as 64): so the FP8 kernel is
run with a float32 cache, which holds the kernel's clamped values exactly, and those are cast to E4M3 as the GPU's
store does (round to nearest even, ``cvt.rn.satfinite``).
"""

from __future__ import annotations

import ast
import contextlib
import math
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = os.environ.get("KVEVAL_VLLM_SOURCE")
PER_TOKEN_HEAD = "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py"
INT4 = "vllm/v1/attention/ops/int4_per_token_head.py"


def available() -> str | None:
    """Why the reference cannot run here, or ``None`` when it can."""
    if not SOURCE or not (Path(SOURCE) / PER_TOKEN_HEAD).is_file():
        return "KVEVAL_VLLM_SOURCE does not name an unpacked vLLM 0.33 wheel"
    if os.environ.get("KVEVAL_TRITON_PATH"):
        sys.path.insert(0, os.environ["KVEVAL_TRITON_PATH"])
    os.environ["TRITON_INTERPRET"] = "1"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (KVEVAL_TRITON_PATH can name a folder holding it)"
    return None


def _load(relative: str, names: set[str], name: str) -> dict:
    """The named top-level functions of a vLLM source file, decorators kept, as a module of their own (the
    interpreter reads a kernel's source from its file)."""
    text = (Path(SOURCE) / relative).read_text()
    parts = ["import torch\nimport triton\nimport triton.language as tl\n"]
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            decorators = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in node.decorator_list)
            parts.append(decorators + ast.get_source_segment(text, node) + "\n")
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text("\n\n".join(parts))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()[:3]]


def per_token_head(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``_reshape_cache_per_token_head`` on rows ``x [T, H, D]``: (codes ``[T, H, D]`` uint8, scales ``[T, H]``)."""
    import triton

    kernel = _load(PER_TOKEN_HEAD, {"_reshape_cache_per_token_head"}, "vllm_per_token_head")["_reshape_cache_per_token_head"]
    tokens, heads, dim = x.shape
    bound = (127.0, -128.0) if kind == "int8" else (448.0, -448.0)  # _PER_TOKEN_HEAD_QUANT_PARAMS
    cache = torch.zeros(tokens, 1, heads, dim, dtype=torch.int8 if kind == "int8" else torch.float32)
    other = torch.zeros_like(cache)
    scales, other_scales = torch.zeros(tokens, 1, heads), torch.zeros(tokens, 1, heads)
    kernel[(tokens, heads)](x, x, cache, other, scales, other_scales, torch.arange(tokens),
                            x.stride(0), x.stride(1), x.stride(0), x.stride(1),
                            *_strides(cache, other, scales, other_scales),
                            block_size=1, head_size=dim, head_size_v=dim,
                            HEAD_SIZE_PADDED=triton.next_power_of_2(dim), QUANT_MAX=bound[0], QUANT_MIN=bound[1],
                            IS_INT_QUANT=kind == "int8")
    codes = cache[:, 0].view(torch.uint8) if kind == "int8" else cache[:, 0].to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scales[:, 0]


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``reshape_and_cache_int4``'s ``single_rht(key.float()).to(key.dtype)``, vLLM's PyTorch path (the CPU tier of
    ``fast_hadamard_transform``)."""
    functions = _load(INT4, {"single_rht", "fast_hadamard_transform", "_get_rht_signs"}, "vllm_rht")
    functions.update(_hadacore_available=lambda: False, _RHT_SIGNS_CACHE={},
                     largest_power_of_2_divisor=lambda n: n & -n)
    return functions["single_rht"](x.float()).to(x.dtype)


def int4_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reshape_and_cache_int4`` on rows ``x [T, H, D]`` in the model dtype: (packed ``[T, H, D / 2]``, stored
    scales ``[T, H]`` float32 with the zero point in their low bits)."""
    import triton

    kernel = _load(INT4, {"pack_int4_nibbles", "_reshape_cache_int4_kernel"}, "vllm_int4")["_reshape_cache_int4_kernel"]
    x = rotate(x)
    tokens, heads, dim = x.shape
    cache = torch.zeros(tokens, 1, heads, dim // 2, dtype=torch.uint8)
    other = torch.zeros_like(cache)
    scales, other_scales = torch.zeros(tokens, 1, heads), torch.zeros(tokens, 1, heads)
    names = ("stride_kc_blk", "stride_kc_slot", "stride_kc_head", "stride_vc_blk", "stride_vc_slot", "stride_vc_head",
             "stride_ks_blk", "stride_ks_slot", "stride_ks_head", "stride_vs_blk", "stride_vs_slot", "stride_vs_head")
    kernel[(tokens, heads)](
        key_ptr=x, value_ptr=x, key_cache_ptr=cache, value_cache_ptr=other, k_scale_cache_ptr=scales,
        v_scale_cache_ptr=other_scales, slot_mapping_ptr=torch.arange(tokens), stride_key_tok=x.stride(0),
        stride_key_head=x.stride(1), stride_val_tok=x.stride(0), stride_val_head=x.stride(1),
        **dict(zip(names, _strides(cache, other, scales, other_scales))), block_size=1, head_size=dim,
        head_size_v=dim, PACKED_HEAD_PADDED=triton.next_power_of_2(dim // 2))
    return cache[:, 0], scales[:, 0]


# --- TurboQuant (``--kv-cache-dtype turboquant_*``) -----------------------------------------------------------
TQ_STORE = "vllm/v1/attention/ops/triton_turboquant_store.py"
TQ_DECODE = "vllm/v1/attention/ops/triton_turboquant_decode.py"
TQ_CENTROIDS = "vllm/model_executor/layers/quantization/turboquant/centroids.py"
TQ_CONFIG = "vllm/model_executor/layers/quantization/turboquant/config.py"
TQ_BACKEND = "vllm/v1/attention/backends/turboquant_attn.py"


def turboquant_config(preset: str, dim: int):
    """vLLM's ``TurboQuantConfig.from_cache_dtype(preset, dim)``."""
    config = _load_classes(TQ_CONFIG, {"TQ_PRESETS", "TurboQuantConfig"}, "vllm_tq_config")["TurboQuantConfig"]
    return config.from_cache_dtype(preset, dim)


def _load_classes(relative: str, names: set[str], name: str) -> dict:
    """Like :func:`_load`, for classes and assignments too (``TQ_PRESETS``, ``TurboQuantConfig``)."""
    text = (Path(SOURCE) / relative).read_text()
    parts = ["from __future__ import annotations\nimport functools, math, logging\nimport torch\nfrom dataclasses import dataclass\n"
             "logger = logging.getLogger(__name__)\n"]
    for node in ast.parse(text).body:
        label = getattr(node, "name", None) or (isinstance(node, (ast.Assign, ast.AnnAssign)) and
                                                 ast.get_source_segment(text, node).split(":")[0].split("=")[0].strip())
        if label in names:
            decorators = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in getattr(node, "decorator_list", []))
            parts.append(decorators + ast.get_source_segment(text, node) + "\n")
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text("\n\n".join(parts))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return vars(module)


def turboquant_setup(preset: str, dim: int) -> dict:
    """What ``TurboQuantAttentionImpl`` derives (``_ensure_on_device``), from vLLM's own code: the config, the
    Hadamard matrix, the centroids and midpoints."""
    cfg = turboquant_config(preset, dim)
    cents = _load_classes(TQ_CENTROIDS, {"_gaussian_pdf", "_trapz", "solve_lloyd_max"}, "vllm_tq_centroids")
    backend = _load_classes(TQ_BACKEND, {"_build_hadamard_cached"}, "vllm_tq_backend")
    hadamard = backend["_build_hadamard_cached"].__wrapped__(dim, "cpu")
    centroids = cents["solve_lloyd_max"](dim, cfg.centroid_bits)[0]
    c_sorted, _ = centroids.sort()
    return {"config": cfg, "PiT": hadamard, "centroids": centroids, "midpoints": (c_sorted[:-1] + c_sorted[1:]) / 2}


@contextlib.contextmanager
def _gpu_fp8_store():
    """The interpreter's float32 -> ``float8e4nv`` conversion (``_convert_float``) drops the rounding's carry into
    the exponent (1.99 stores as 1.0) and mis-rounds subnormals; for that conversion alone, use the GPU's
    ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even, clamped to +-448), as torch's cast of the clamped value
    computes it. Every other step of the kernel runs as the interpreter runs it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).clamp(-448.0, 448.0)
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)
        return original(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original


def turboquant_store(key: torch.Tensor, value: torch.Tensor, preset: str) -> tuple[torch.Tensor, dict]:
    """``triton_turboquant_store`` on rows ``[T, H, D]`` float32, one token a block: the cache ``[T, H, slot]``
    uint8 as vLLM's fused store kernel writes it, and the setup."""
    functions = _load(TQ_STORE, {"_store_quantized_value", "_tq_fused_store_fp8", "_tq_fused_store_mse",
                                 "triton_turboquant_store"}, "vllm_tq_store")
    functions.update(math=__import__("math"), _use_fp8_e4b15=lambda device=0: 0)  # Hopper+: float8e4nv
    tokens, heads, dim = key.shape
    setup = turboquant_setup(preset, dim)
    cfg = setup["config"]
    cache = torch.zeros(tokens, 1, heads, cfg.slot_size_aligned, dtype=torch.uint8)
    with _gpu_fp8_store():
        functions["triton_turboquant_store"](key, value, cache, torch.arange(tokens, dtype=torch.int32),
                                             setup["PiT"], setup["midpoints"], mse_bits=cfg.key_mse_bits,
                                             key_packed_size=cfg.key_packed_size,
                                             value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
    return cache[:, 0], setup


def turboquant_dequant(cache: torch.Tensor, preset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``_tq_full_dequant_kv`` on a cache ``[T, H, slot]`` (one token a block): K (MSE: in the rotated space) and V,
    ``[T, H, D]`` float16, as the continuation-prefill path reads them."""
    import triton

    kernel = _load(TQ_DECODE, {"_tq_full_dequant_kv"}, "vllm_tq_dequant")["_tq_full_dequant_kv"]
    tokens, heads, _ = cache.shape
    blocks = cache.unsqueeze(1)  # [T blocks, block_size 1, H, slot]
    dim = next(d for d in (8, 16, 32, 64, 128, 256, 512) if turboquant_config(preset, d).slot_size_aligned
               == cache.shape[-1])
    setup = turboquant_setup(preset, dim)
    cfg = setup["config"]
    k_out = torch.zeros(1, heads, tokens, dim, dtype=torch.float16)
    v_out = torch.zeros_like(k_out)
    table = torch.arange(tokens, dtype=torch.int32).unsqueeze(0)
    kernel[(tokens, heads)](blocks, table, setup["centroids"], k_out, v_out, *k_out.stride()[:3], *v_out.stride()[:3],
                            *blocks.stride()[:3], table.stride(0), HEAD_DIM=dim, BLOCK_SIZE=1, NUM_KV_HEADS=heads,
                            MSE_BYTES=math.ceil(dim * cfg.key_mse_bits / 8) if not cfg.key_fp8 else dim,
                            KPS=cfg.key_packed_size, VQB=cfg.effective_value_quant_bits,
                            VAL_DATA_BYTES=math.ceil(dim * cfg.effective_value_quant_bits / 8),
                            MSE_BITS=cfg.key_mse_bits, KEY_FP8=1 if cfg.key_fp8 else 0,
                            BLOCK_D=triton.next_power_of_2(dim), NORM_CORRECTION=1 if cfg.norm_correction else 0,
                            FP8_E4B15=0)
    return k_out[0].transpose(0, 1), v_out[0].transpose(0, 1)
