"""Serving engines' KV-cache numerics as quantization policies: the contract they share (:class:`EnginePolicy`); one
file per engine: :mod:`kveval.policies.llamacpp`, :mod:`kveval.policies.vllm`, :mod:`kveval.policies.sglang`,
:mod:`kveval.policies.trtllm`.

Each reproduces what its engine stores for K and V, byte for byte: the codes, their scales, the rounding and the
saturation (the formats: :mod:`kveval.tensors.engine_formats`; the store, which codes every token on arrival as
the engines do: :mod:`kveval.stores.engine`). Per-tensor scales computed from data (vLLM's first batch,
ModelOpt's amax) come from kveval's calibration pass (:func:`kveval.calibration.kv.calibration_kv`) and are
recorded with the run (:meth:`EnginePolicy.run_info`). Of what the engines do beyond their cache, llama.cpp's
conversion of Q to the K type's ``vec_dot_type`` is emulated (:meth:`kveval.policies.llamacpp.LlamaCppPolicy.attended_query`); FP8 attention
kernels' own roundings (scales folded into the softmax scale, FP8 queries) are not: see ``docs/engines.md``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

from kveval.errors import PolicySpecError
from kveval.policies.base import Need, PlannedCoding, QuantizationPolicy
from kveval.values import is_real
# Stores, calibration and the model's hooks import torch: imported inside the methods that run a policy on a model.

#: NVFP4's block: 16 E2M1 values share an E4M3 scale (vLLM's and SGLang's NVFP4 caches).
NVFP4_BLOCK = 16


def check_engine_choice(name: str, key: str, value, allowed: Sequence[str], unpinned: Mapping[str, str],
                        kind: str | None = None) -> None:
    """Refuse ``key=value`` of the policy ``name`` where the engine offers it but kveval does not reproduce it
    (``unpinned``: value -> why) or where it is not one of ``allowed``. ``kind``: what the values are, where
    ``allowed`` and ``unpinned`` together are all the engine offers (e.g. "a llama.cpp cache type"), so that the
    message can say the value is not one."""
    choices = ", ".join(allowed)
    if value in unpinned:
        raise PolicySpecError(f"{name}: {key}={value} is not reproduced ({unpinned[value]}); use one of {choices}")
    if value not in allowed:
        raise PolicySpecError(f"{name}: {key}={value!r} is not {kind}; use one of {choices}" if kind else
                              f"{name}: {key}={value!r} must be one of {choices}")


def fp8_format(value: str) -> str:
    """The FP8 format an engine's FP8 cache dtype names (``fp8``, ``fp8_e4m3``: e4m3; ``fp8_e5m2``: e5m2), the value
    already checked (:func:`check_engine_choice`)."""
    return "e5m2" if value.endswith("e5m2") else "e4m3"


#: The smallest normal float32 and bfloat16 (2**-126): a scale below it is 0 or subnormal in the dtypes the scale is
#: applied in, and every value it dequantizes is 0 (``sglang(kv_scale=1e-45)`` answered nothing but dashes).
SMALLEST_SCALE = 2.0 ** -126


def check_positive_scale(name: str, key: str, value) -> None:
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
