"""The cache dtype (``kv_dtype``): its names, its bytes per value, how a user's spelling is read and which dtype a
model is deployed with. Its one home.

The names and bytes need no torch: the analysis commands (gate, report, the deployment decision) read a run's
``kv_dtype`` and size its cache here. The functions that hand out ``torch.dtype`` objects import torch when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kveval.errors import UsageError

if TYPE_CHECKING:
    import torch

#: Every spelling a user may give -> the canonical name a run records (``run.json``'s ``kv_dtype``).
CACHE_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                     "half": "float16", "float32": "float32", "fp32": "float32"}
#: Canonical name -> bytes per value.
CACHE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: The cache dtype when neither the user nor the checkpoint names a 16-bit one (GGUF originals are bfloat16).
DEFAULT_KV_DTYPE_NAME = "bfloat16"
_SIXTEEN_BIT_NAMES = ("bfloat16", "float16")


def _torch():
    import torch  # imported on call, not at the top: the analysis commands import this module and never load torch

    return torch


def kv_dtypes() -> dict[str, torch.dtype]:
    """Every spelling of :data:`CACHE_DTYPE_NAMES` -> its ``torch.dtype``."""
    torch = _torch()
    return {alias: getattr(torch, name) for alias, name in CACHE_DTYPE_NAMES.items()}


def default_kv_dtype() -> torch.dtype:
    """:data:`DEFAULT_KV_DTYPE_NAME` as a ``torch.dtype``."""
    return getattr(_torch(), DEFAULT_KV_DTYPE_NAME)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _is_sixteen_bit(dtype) -> bool:
    return dtype in tuple(getattr(_torch(), name) for name in _SIXTEEN_BIT_NAMES)


def parse_kv_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The one reader of a cache dtype a user gives: a name (``bf16``, ``bfloat16``, ``fp16``, ``float16``, ``fp32``,
    ``float32``) or a ``torch.dtype``; ``None``, ``auto`` or ``default`` is ``None``, the model's deployment dtype
    (:func:`deployment_kv_dtype`). Anything else is a :class:`~kveval.errors.UsageError`."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto", "none", "default")):
        return None
    known = kv_dtypes()
    if isinstance(value, _torch().dtype):
        if value not in known.values():
            raise UsageError(f"kv_dtype={value} is not a cache dtype; use bfloat16, float16 or float32")
        return value
    name = str(value).strip().lower().removeprefix("torch.")
    if name not in known:
        raise UsageError(f"kv_dtype={value!r} is not a cache dtype; use one of {', '.join(known)}")
    return known[name]


def cache_kv_dtype(model, kv_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``model``'s cache holds tokens in: ``kv_dtype`` (parsed at the edge by :func:`parse_kv_dtype`), or
    the deployment dtype when ``None``. A string here is a caller's bug: nothing below the edge parses one."""
    if kv_dtype is None:
        return deployment_kv_dtype(model)
    if not isinstance(kv_dtype, _torch().dtype) or kv_dtype not in kv_dtypes().values():
        raise TypeError(f"kv_dtype={kv_dtype!r}: pass a cache torch.dtype or None; parse user input with parse_kv_dtype")
    return kv_dtype


def deployment_kv_dtype(model) -> torch.dtype:
    """The cache dtype ``model`` is deployed with, whatever dtype it computes in here.

    ``model.kveval_kv_dtype`` when :func:`kveval.runner.models.load_model` recorded it
    (the checkpoint's dtype, read before loading in float32 on a CPU); else the
    model's own dtype when it is a 16-bit float; else bfloat16.
    """
    recorded = getattr(model, "kveval_kv_dtype", None)
    if recorded is not None:
        return parse_kv_dtype(recorded)
    dtype = getattr(model, "dtype", None)
    return dtype if _is_sixteen_bit(dtype) else default_kv_dtype()


def deployment_dtype_name(model) -> str:
    """The KV dtype ``model`` is deployed with (what an unset ``kv_dtype`` means), e.g. ``"bfloat16"``."""
    return dtype_name(deployment_kv_dtype(model))


def checkpoint_kv_dtype(config) -> torch.dtype:
    """Cache dtype for a checkpoint with this config: its ``dtype`` when a 16-bit float, else bfloat16."""
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = kv_dtypes().get(declared.removeprefix("torch."))
    return declared if _is_sixteen_bit(declared) else default_kv_dtype()


__all__ = ["CACHE_DTYPE_BYTES", "CACHE_DTYPE_NAMES", "DEFAULT_KV_DTYPE_NAME", "cache_kv_dtype", "checkpoint_kv_dtype",
           "default_kv_dtype", "deployment_dtype_name", "deployment_kv_dtype", "dtype_name", "kv_dtypes",
           "parse_kv_dtype"]
