"""The cache dtypes kveval stores full-precision tokens in, by name, readable without torch.

:mod:`kveval.stores.base` maps the names to ``torch`` dtypes; the analysis commands (gate, report, the deployment
decision), which never load torch, read a run's ``kv_dtype`` and its bytes per value here.
"""

from __future__ import annotations

#: Every spelling a user may give -> the canonical name a run records (``run.json``'s ``kv_dtype``).
CACHE_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                     "half": "float16", "float32": "float32", "fp32": "float32"}
#: Canonical name -> bytes per value.
CACHE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

__all__ = ["CACHE_DTYPE_BYTES", "CACHE_DTYPE_NAMES"]
