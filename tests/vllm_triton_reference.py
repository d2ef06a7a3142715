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
