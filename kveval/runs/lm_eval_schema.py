"""The keys kveval writes into lm-eval's ``results["config"]``, their meaning, and the one reader of them.

:class:`kveval.lm_eval.model.KVEvalLM` writes these keys through
:meth:`KVEvalLM.get_model_info` (lm-eval merges that dict into the
``config`` of ``results_<time>.json``); :func:`read_run_fields` is how every
kveval command (``compare``, ``gate``, ``report``) reads them back. Both sides
import the names below, so they cannot drift apart.

This module imports nothing heavy (no torch, no lm-eval).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# key -> meaning. Units: bytes are per cached context token, summed over layers, K and V.
POLICY = "kveval_policy"
COMPRESS = "kveval_compress"
KV_DTYPE = "kveval_kv_dtype"
NOMINAL_RATIO = "kveval_nominal_ratio"
NOMINAL_BYTES = "kveval_nominal_bytes_per_token"
MEASURED_BYTES = "kveval_measured_bytes_per_token"
INDEX_BYTES = "kveval_index_bytes_per_token"
UNCOMPRESSED_MEASURED_BYTES = "kveval_uncompressed_bytes_per_token_measured"
MEASURED_RATIO = "kveval_measured_ratio"
MEASURED_REQUESTS = "kveval_measured_requests"
MEASURED_TOKENS = "kveval_measured_tokens"
MODEL_IDENTITY = "kveval_model_identity"
QUESTION_MARKER = "kveval_question_marker"
SEED = "kveval_seed"
ROLLING = "kveval_loglikelihood_rolling"
VERSION = "kveval_version"
HARDWARE = "kveval_hardware"

KEYS: dict[str, str] = {
    POLICY: "canonical policy spec of the run (`none` for the baseline)",
    COMPRESS: "mode: `context` (compressed before the question is seen) or `query` (with it)",
    KV_DTYPE: "dtype of the full-precision tokens the cache holds; ratios are against an uncompressed cache of it",
    NOMINAL_RATIO: "fraction of context KV pairs the selection policy removes, or null",
    NOMINAL_BYTES: "bytes per token of the uncompressed cache of this model",
    MEASURED_BYTES: "measured K/V storage bytes per cached token, averaged over computed requests",
    INDEX_BYTES: "bytes per token of positions and scores that compression adds",
    UNCOMPRESSED_MEASURED_BYTES: "bytes per token an uncompressed cache would hold for the same requests",
    MEASURED_RATIO: "measured bytes / uncompressed bytes (0.5 = half the memory)",
    MEASURED_REQUESTS: "requests whose cache was measured (not answered from --use_cache)",
    MEASURED_TOKENS: "cached tokens measured over those requests",
    MODEL_IDENTITY: "the model's name, source (path or Hub id), revision and short hash",
    QUESTION_MARKER: "text that starts the question in each prompt, or null",
    SEED: "base seed of the random control",
    ROLLING: "how loglikelihood_rolling ran (uncompressed, stock HFLM)",
    VERSION: "kveval version",
    HARDWARE: "device, CPU instruction set or GPU, and torch version that computed the run (`compare` pairs no two that differ)",
}


@dataclass(frozen=True)
class RunFields:
    """What a results ``config`` says about the run, read through the schema."""

    policy: str
    mode: str
    ratio: float | None
    bytes_per_token: float | None
    nominal_bytes_per_token: float | None
    kv_dtype: str | None
    model_identity: dict
    hardware: str | None = None  # kveval.runner.evaluate.hardware_of; None in runs that predate it


def as_float(value: Any) -> float | None:
    """``value`` as a finite float, else ``None`` (results files hold numbers, strings and nulls alike)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def read_run_fields(config: dict, model_args: dict | None = None) -> RunFields:
    """Read kveval's keys from an lm-eval results ``config``.

    ``model_args`` (the run's parsed ``--model_args``) fills in what a run
    written without kveval's model type still says: ``policy=``,
    ``compress=``, ``kv_dtype=``.
    """
    model_args = model_args or {}

    def get(key: str, arg: str | None = None):
        value = config.get(key)
        if value in (None, "") and arg is not None:
            value = model_args.get(arg)
        return None if value in (None, "") else value

    identity = config.get(MODEL_IDENTITY)
    return RunFields(
        policy=str(get(POLICY, "policy") or "none"),
        mode=str(get(COMPRESS, "compress") or "context"),
        ratio=as_float(get(NOMINAL_RATIO)),
        bytes_per_token=as_float(get(MEASURED_BYTES)),
        nominal_bytes_per_token=as_float(get(NOMINAL_BYTES)),
        kv_dtype=get(KV_DTYPE, "kv_dtype"),
        model_identity=identity if isinstance(identity, dict) else {},
        hardware=get(HARDWARE),
    )


__all__ = ["COMPRESS", "HARDWARE", "INDEX_BYTES", "KEYS", "KV_DTYPE", "MEASURED_BYTES", "MEASURED_RATIO", "MEASURED_REQUESTS",
           "MEASURED_TOKENS", "MODEL_IDENTITY", "NOMINAL_BYTES", "NOMINAL_RATIO", "POLICY", "QUESTION_MARKER", "ROLLING",
           "RunFields", "as_float", "SEED", "UNCOMPRESSED_MEASURED_BYTES", "VERSION", "read_run_fields"]
