"""Outlier-aware K/V quantization after KVQuant (``kvquant``).

Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM Inference
with KV Cache Quantization": keys quantized per channel before RoPE, values per
token, a calibrated non-uniform codebook per layer, dense-and-sparse outliers
and the attention-sink token in full precision. The store and the calibration
live in :mod:`kveval.stores.kvquant`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from kveval.errors import PolicySpecError
from kveval.policies.base import Need, Placement, PlannedCoding, QuantizationPolicy, check_calib_tokens
from kveval.policies.quant import INDEXER_CODINGS
from kveval.values import is_real, is_whole
# Stores, calibration and the model's hooks import torch: imported inside the methods that run a policy on a model.

KVQUANT_BITS = (2, 3, 4, 8)


@dataclass
class KVQuantPolicy(QuantizationPolicy):
    """KVQuant (Hooper et al. 2024): pre-RoPE per-channel keys, per-token values, nuq codebooks, sparse outliers.

    Attributes
    ----------
    bits : int
        Code width for K and V: 2, 3 or 4 (the paper's nuq2/3/4), or 8.
    outliers : float
        Fraction of each K/V vector kept exactly as sparse outliers (value in
        ``kv_dtype`` plus its channel index), ``0 <= outliers <= 1``; the paper
        uses 0.01. Per vector, ``ceil(outliers * head_dim)`` entries.
    pre_rope : bool
        Quantize keys before RoPE (un-rotated at their position, rotated back
        when read). Needs the architecture's RoPE hook
        (:func:`kveval.modeling.rope.rope_hook`); ``false`` quantizes post-RoPE keys.
    nuq : bool
        Non-uniform per-layer codebook learned by k-means on the calibration
        text; ``false``: uniform levels.
    sink : int
        Tokens at original positions ``0 .. sink-1`` kept in ``kv_dtype`` (attention sink).
    residual : int
        Most recent tokens kept in ``kv_dtype`` (0 in the paper).
    calibration : str, optional
        Path to a UTF-8 calibration text; default the shipped ``kveval/data/calibration.txt``.
    calib_tokens : int, optional
        Tokens of the calibration text used (default 2048, at most the model's positions).
    indexer : str
        DeepSeek V3.2/V4 only: how the indexer's keys are coded
        (:data:`~kveval.policies.quant.INDEXER_CODINGS`; ``same``: as KVQuant codes keys, calibrated on them).

    Notes
    -----
    The cache's ``nbytes`` counts per-token tensors: packed codes, outlier
    values and indices, the values' float16 ranges, sink and residual tokens.
    Codebooks and per-channel key ranges are per model: :meth:`codebook_bytes`.

    On DeepSeek V3.2 and V4 (:mod:`kveval.cache.native_layers`), the store's part (V3.2's latent and RoPE key, as
    on V2/V3; V4's sliding window of K=V entries, keys alone) is coded as above, post-RoPE (``pre_rope=false``:
    kveval has no RoPE hook for them), and every other part (the indexer's keys, V4's CSA and HCA entries) as KVQuant
    codes keys, with per-channel ranges and a codebook calibrated on that part's own entries in the calibration
    pass (:meth:`part_codes`).
    """

    name = "kvquant"
    placements = frozenset({Placement.PARTS})  # every part, with a codec calibrated on it (:meth:`part_codes`)
    description = "KVQuant: pre-RoPE per-channel keys, per-token values, calibrated nuq codebook, sparse outliers, sink"
    bits: int = 4
    outliers: float = 0.01
    pre_rope: bool = True
    nuq: bool = True
    sink: int = 1
    residual: int = 0
    calibration: str | None = None
    calib_tokens: int | None = None
    indexer: str = "same"

    def __post_init__(self):
        if self.indexer not in INDEXER_CODINGS:
            raise PolicySpecError(f"{self.name}: indexer={self.indexer!r} must be one of {', '.join(INDEXER_CODINGS)}")
        if self.bits not in KVQUANT_BITS:
            raise PolicySpecError(f"{self.name}: bits={self.bits!r} is not supported; use 2, 3, 4 or 8")
        if not is_real(self.outliers) or not 0 <= self.outliers <= 1:
            raise PolicySpecError(f"{self.name}: outliers={self.outliers!r} must be the fraction of each vector kept "
                                  f"exactly, 0 <= outliers <= 1 (the paper uses 0.01)")
        self.outliers = float(self.outliers)
        for key in ("sink", "residual"):
            value = getattr(self, key)
            if not is_whole(value) or value < 0:
                raise PolicySpecError(f"{self.name}: {key}={value!r} must be a number of tokens >= 0")
        check_calib_tokens(self.name, self.calib_tokens, self.calibration)
        if self.calibration is not None:
            from pathlib import Path

            path = Path(str(self.calibration)).expanduser()
            if not path.is_file() or path.stat().st_size == 0:
                raise PolicySpecError(f"{self.name}: calibration file {str(path)!r} is missing or empty")
        self._models: dict[int, tuple[weakref.ref, object, dict]] = {}

    # --- what the stack and the cache ask of a quantizer ---------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        """Any head_dim works: codes are packed per vector."""

    def fit_widths(self, widths: dict[str, int], label: str) -> None:
        """Any head width fits; refuse a structure's coefficients (``label`` other than ``head_dim``): the
        codebooks and key ranges are calibrated on K/V heads."""
        if label == "head_dim":
            return
        raise PolicySpecError(f"{self.spec()}: quantizes K/V heads with codebooks calibrated on them, not a structure's "
                              f"{label} coefficients; use quant(...) or kivi(...) under a structure policy")

    @property
    def needs(self) -> frozenset[Need]:
        """A calibration pass (codebooks, key ranges), and with ``pre_rope`` the model's RoPE hook."""
        return frozenset({Need.CALIBRATION, Need.ROPE_HOOK} if self.pre_rope else {Need.CALIBRATION})

    def planned_coding(self) -> PlannedCoding:
        """Codes sized per token (:meth:`coded_bytes`), the ``sink`` and ``residual`` tokens in the cache dtype."""
        return PlannedCoding(token_bytes=self.coded_bytes, residual=self.residual, sink=self.sink,
                             label=f"kvquant{self.bits}")

    @property
    def residual_tokens(self) -> int:
        return self.residual

    def bytes_per_token(self, head_dim: int, kv_itemsize: int) -> float:
        """Bytes one encoded token holds per KV head and layer, K and V together (sink/residual tokens aside)."""
        return sum(self.coded_bytes(head_dim, head_dim, kv_itemsize))

    def coded_bytes(self, key_dim: int, value_dim: int, kv_itemsize: int) -> tuple[int, int]:
        """Bytes one encoded token holds per KV head and layer, ``(K, V)``, for keys and values of these widths (an
        MLA latent and its RoPE key differ): packed codes and sparse outliers each, and the values' float16 lo and hi."""
        from kveval.stores.kvquant import index_dtype, outlier_count

        def part(dim: int) -> int:
            sparse = outlier_count(dim, self.outliers) * (kv_itemsize + index_dtype(dim).itemsize)
            return math.ceil(dim * self.bits / 8) + sparse

        return part(key_dim), part(value_dim) + 2 * 2

    # --- calibration ----------------------------------------------------------------------------
    @property
    def settings(self):
        from kveval.stores.kvquant import KVQuantSettings

        return KVQuantSettings(self.bits, self.outliers, self.pre_rope, self.nuq)

    @property
    def tokens(self) -> int:
        from kveval.calibration.kv import DEFAULT_CALIB_TOKENS

        return self.calib_tokens or DEFAULT_CALIB_TOKENS

    def calibration_text(self):
        from kveval.calibration.kv import read_calibration_text

        return read_calibration_text(self.calibration)

    def calibration_for(self, model):
        """The model's :class:`kveval.stores.kvquant.KVQuantCalibration` (memory, then disk, else computed once)."""
        entry = self._models.get(id(model))
        if entry is not None and entry[0]() is model:
            return entry[1]
        from kveval.calibration.kv import load_or_calibrate

        if self.pre_rope:
            from kveval.modeling.rope import rope_hook

            rope_hook(model, 0)  # refuse a model without a RoPE hook before the calibration pass
        calibration = load_or_calibrate(model, self.calibration_text(), self.tokens, self.settings)
        self._models[id(model)] = (weakref.ref(model), calibration, {})
        return calibration

    def prepare(self, model) -> None:
        """Calibrate ahead of the first forward pass (refuses ``pre_rope=true`` on a model without a RoPE hook)."""
        self.calibration_for(model)

    def run_info(self, model) -> dict:
        calibration = self.calibration_for(model)
        return {"calibration_id": self.calibration_text().calibration_id(self.tokens),
                "calibration_tokens_used": calibration.tokens, "model_key": calibration.model_key[:16],
                "cache_file": str(calibration.path), "codebook_bytes": calibration.nbytes()}

    def codebook_bytes(self, model) -> int:
        """Per-model bytes (float32) of every layer's K and V codebooks and per-channel key ranges; not per token."""
        return self.calibration_for(model).nbytes()

    # --- the store ------------------------------------------------------------------------------
    def codec(self, model, layer_idx: int):
        """Layer ``layer_idx``'s :class:`kveval.stores.kvquant.KVQuantCodec` (memoized per model: stores share it)."""
        calibration = self.calibration_for(model)
        codecs = self._models[id(model)][2]
        if layer_idx not in codecs:
            rope = None
            if self.pre_rope:
                from kveval.modeling.rope import rope_hook

                rope = rope_hook(model, layer_idx)
            codecs[layer_idx] = calibration.codec(layer_idx, rope)
        return codecs[layer_idx]

    def make_store(self, inner, model, layer_idx: int):
        """A :class:`kveval.stores.kvquant.KVQuantStore` in place of ``inner``, the dense store it replaces (same dtypes)."""
        from kveval.stores.kvquant import KVQuantStore

        return KVQuantStore(self.codec(model, layer_idx), self.sink, self.residual, inner.kv_dtype, inner.compute_dtype)

    def part_codes(self, model, layer_idx: int, part: str, width: int, kv_dtype, stride: int):
        """A :class:`kveval.stores.kvquant.KVQuantPart`: keys alone, coded with the codec calibrated on the part's
        entries in layer ``layer_idx`` (``sink``: entries whose window holds a token below it stay in the cache
        dtype; ``residual``: the newest entries)."""
        from kveval.stores.kvquant import KVQuantPart

        calibration = self.calibration_for(model)
        return KVQuantPart(calibration.part_codec(layer_idx, part), self.sink, self.residual, kv_dtype, stride)
