"""Low-rank K/V structure (``lowrank``): keep r coefficients per KV head instead of head_dim numbers.

The post-training counterpart of MLA (Palu, Eigen Attention, LoRC): per layer
and KV head, K and V are each projected onto their leading principal
directions, found by a calibration pass (uncentered PCA of post-RoPE keys and
of values; see :mod:`kveval.stores.lowrank` for why keys are projected after RoPE).
Stacked with a quantization policy the coefficients are quantized:
``lowrank(rank=16)+quant(bits=8,group=16)``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from kveval.errors import PolicySpecError
from kveval.policies.base import PlannedWidths, PolicyStack, StructurePolicy, check_calib_tokens
from kveval.values import is_real, is_whole
# Stores, calibration and the model's hooks import torch: imported inside the methods that run a policy on a model.


def _positive_int(name: str, key: str, value) -> None:
    if value is not None and (not is_whole(value) or value < 1):
        raise PolicySpecError(f"{name}: {key}={value!r} must be a positive integer")


class CalibratedPolicy(StructurePolicy):
    """Calibration shared by the projection policies (``lowrank``, ``latent``): text, cache, run record.

    A subclass declares the dataclass fields ``calibration`` (path or ``None``)
    and ``calib_tokens`` (int or ``None``), calls :meth:`check_calibration_params`
    from ``__post_init__``, and names its calibration class in
    :meth:`calibration_kind` (see :func:`kveval.calibration.kv.load_or_calibrate`).
    """

    calibration: str | None
    calib_tokens: int | None

    def calibration_kind(self) -> type:
        from kveval.calibration.kv import Calibration

        return Calibration

    def check_calibration_params(self) -> None:
        """Validate ``calib_tokens`` and the calibration file (one PolicySpecError line)."""
        check_calib_tokens(self.name, self.calib_tokens, self.calibration)
        if self.calibration is not None:
            from pathlib import Path

            path = Path(str(self.calibration)).expanduser()
            if not path.is_file():
                raise PolicySpecError(f"{self.name}: calibration file {str(path)!r} not found")
            if path.stat().st_size == 0:
                raise PolicySpecError(f"{self.name}: calibration file {str(path)!r} is empty")
        self._models: dict[int, tuple[weakref.ref, object]] = {}

    @property
    def tokens(self) -> int:
        from kveval.calibration.kv import DEFAULT_CALIB_TOKENS

        return self.calib_tokens or DEFAULT_CALIB_TOKENS

    def calibration_text(self):
        from kveval.calibration.kv import read_calibration_text

        return read_calibration_text(self.calibration)

    @property
    def calibration_id(self) -> str:
        """Which calibration this policy uses, for results: ``<text>:sha256=<16 hex>:tokens=<calib_tokens>``."""
        return self.calibration_text().calibration_id(self.tokens)

    def calibration_for(self, model):
        """The model's calibration (:meth:`calibration_kind`; from memory or disk, else computed once)."""
        entry = self._models.get(id(model))
        if entry is not None and entry[0]() is model:
            return entry[1]
        from kveval.calibration.kv import load_or_calibrate

        calibration = load_or_calibrate(model, self.calibration_text(), self.tokens, self.calibration_kind())
        self._models[id(model)] = (weakref.ref(model), calibration)
        return calibration

    def prepare(self, model) -> None:
        """Calibrate ahead of the first forward pass (optional: the first store calibrates otherwise)."""
        self.calibration_for(model)

    def run_info(self, model) -> dict:
        """What to record with results: calibration id, tokens really used, model key and cache file."""
        calibration = self.calibration_for(model)
        return {"calibration_id": self.calibration_id, "calibration_tokens_used": calibration.tokens,
                "model_key": calibration.model_key[:16], "cache_file": str(calibration.path)}


def per_token_groups_of(quantization) -> dict[str, int | None]:
    """Per-token group sizes of K and V of a quantization policy or a whole stack (``None``: not per-token)."""
    if isinstance(quantization, PolicyStack):
        quantization = quantization.quantization
    coding = quantization.planned_coding() if quantization is not None else None
    if coding is None or not coding.grouped:
        return {"k": None, "v": None}
    return {kind: (q.group if q.axis == "token" else None) for kind, q in (("k", coding.key), ("v", coding.value))}


@dataclass
class LowRankPolicy(CalibratedPolicy):
    """Project each KV head's keys (after RoPE) and values onto a calibrated low-rank basis.

    Attributes
    ----------
    rank : int, optional
        Coefficients kept per token and KV head, for K and V (at most head_dim).
    energy : float, optional
        Instead of ``rank``: per layer, KV head and K/V, the smallest rank whose
        directions hold this fraction of the calibration energy (sum of squares),
        ``0 < energy <= 1``. Stacked with per-token quantization, the rank is
        rounded up to a multiple of the quantization group.
    k_rank, v_rank : int, optional
        Separate ranks for K and V; they override ``rank``/``energy`` for that
        tensor (give both when neither ``rank`` nor ``energy`` is given).
    calibration : str, optional
        Path to a UTF-8 calibration text; default the shipped
        ``kveval/data/calibration.txt``.
    calib_tokens : int, optional
        Tokens of the calibration text used (default 2048, at most the model's
        positions); also the positions the key basis has seen.

    Notes
    -----
    ``nbytes`` of the cache counts the per-token coefficients only. The bases
    are per model (float32, ``head_dim x rank`` per layer, head and K/V): see
    :meth:`basis_bytes`. :attr:`calibration_id` names the calibration text
    (its SHA-256) for results.
    """

    name = "lowrank"
    family = "structure"
    description = "low-rank K/V: per-head projection onto calibrated principal directions (post-RoPE keys)"
    rank: int | None = None
    energy: float | None = None
    k_rank: int | None = None
    v_rank: int | None = None
    calibration: str | None = None
    calib_tokens: int | None = None

    def __post_init__(self):
        for key in ("rank", "k_rank", "v_rank", "calib_tokens"):
            _positive_int(self.name, key, getattr(self, key))
        if self.rank is not None and self.energy is not None:
            raise PolicySpecError(f"{self.name}: give rank= or energy=, not both")
        if self.rank is None and self.energy is None and (self.k_rank is None or self.v_rank is None):
            raise PolicySpecError(f"{self.name}: give rank= (coefficients per head), energy= (fraction of variance kept, "
                             f"0 < energy <= 1), or both k_rank= and v_rank=")
        if self.energy is not None:
            if not is_real(self.energy) or not 0 < self.energy <= 1:
                raise PolicySpecError(f"{self.name}: energy={self.energy!r} must be a fraction of variance kept, 0 < energy <= 1")
            self.energy = float(self.energy)
        self.check_calibration_params()
        self._groups: dict[str, int | None] = {"k": None, "v": None}

    # --- ranks ----------------------------------------------------------------------------------
    def layer_ranks(self, model, layer_idx: int, groups: dict[str, int | None] | None = None) -> dict[str, list[int]]:
        """Per-head K and V ranks of one layer (``groups``: per-token quantization groups of K and V, if any)."""
        from kveval.stores.lowrank import round_up

        calibration = self.calibration_for(model)
        groups = self._groups if groups is None else groups
        head_dim, heads = calibration.head_dim(layer_idx), calibration.num_heads(layer_idx)
        ranks = {}
        for kind, fixed in (("k", self.k_rank), ("v", self.v_rank)):
            fixed = fixed if fixed is not None else self.rank
            if fixed is not None:
                if fixed > head_dim:
                    raise PolicySpecError(f"{self.spec()}: {kind} rank {fixed} exceeds head_dim={head_dim}; use at most {head_dim}")
                ranks[kind] = [fixed] * heads
            else:
                ranks[kind] = [round_up(r, groups[kind], head_dim)
                               for r in calibration.energy_ranks(kind, layer_idx, self.energy)]
            group = groups[kind]
            for r in ranks[kind]:
                if group and r % group:
                    raise PolicySpecError(f"{self.spec()}: per-token quantization group={group} does not divide the {kind} "
                                     f"rank {r} (it groups the low-rank coefficients); pick a group that divides {r}")
        return ranks

    def _groups_for(self, quantization) -> dict[str, int | None]:
        """Per-token group sizes of K and V from a quantization policy or a whole stack (default: as last used)."""
        return self._groups if quantization is None else per_token_groups_of(quantization)

    def ranks(self, model, quantization=None) -> dict[str, list[list[int] | None]]:
        """K and V ranks per layer and head (``None`` for a layer without K/V).

        ``quantization`` (the stacked quantization policy, or the whole
        ``PolicyStack``) matters for ``energy=``, whose ranks are rounded up to
        per-token groups; by default, as the last cache built with this policy
        object used them.
        """
        calibration = self.calibration_for(model)
        groups = self._groups_for(quantization)
        kv_layers = set(calibration.kv_layers)
        per_layer = [self.layer_ranks(model, i, groups) if i in kv_layers else None for i in range(calibration.num_layers)]
        return {kind: [None if r is None else r[kind] for r in per_layer] for kind in ("k", "v")}

    def basis_bytes(self, model, quantization=None) -> int:
        """Bytes of the per-model bases the stores hold (float32, ``head_dim x rank`` per layer, head, K and V).

        Not part of the cache's per-token bytes: they are paid once per model.
        ``quantization`` as in :meth:`ranks`.
        """
        calibration = self.calibration_for(model)
        ranks = self.ranks(model, quantization)
        return sum(4 * calibration.head_dim(layer) * (sum(ranks["k"][layer]) + sum(ranks["v"][layer]))
                   for layer in calibration.kv_layers)

    def planned_widths(self, kv_heads: int, k_width: int, v_width: int, mla: bool = False) -> PlannedWidths:
        k, v = (fixed if fixed is not None else self.rank for fixed in (self.k_rank, self.v_rank))
        if mla:
            if k is None or v is None:
                raise PolicySpecError(f"{self.spec()}: energy= ranks on an MLA latent come from calibration; plan "
                                      f"a rank= (measure energy= with kveval eval)")
            for which, r, width in (("latent", k, k_width), ("RoPE key", v, v_width)):
                if width and r > width:
                    raise PolicySpecError(f"{self.spec()}: rank {r} exceeds the MLA {which} width {width}")
            return PlannedWidths(kv_heads, k, v if v_width else 0)
        for which, r, width in (("k", k, k_width), ("v", v, v_width)):
            if r is not None and r > width:
                raise PolicySpecError(f"{self.spec()}: {which} rank {r} exceeds head_dim={width}")
        return PlannedWidths(kv_heads, k, v)

    def stored_widths(self, head_dim: int) -> dict[str, int] | None:
        """Coefficients per token and KV head of K and V; ``None`` for ``energy=`` (known after calibration)."""
        k, v = (fixed if fixed is not None else self.rank for fixed in (self.k_rank, self.v_rank))
        if k is None or v is None:
            return None
        return {"k": k, "v": v}

    # --- the store ------------------------------------------------------------------------------
    def make_store(self, inner, model, layer_idx: int):
        """A :class:`kveval.stores.lowrank.LowRankStore` over ``inner`` (see :meth:`wrap_store`)."""
        return self.wrap_store(inner, model, layer_idx)

    def wrap_store(self, inner, model, layer_idx: int):
        """A :class:`kveval.stores.lowrank.LowRankStore` over ``inner`` for one sequence in layer ``layer_idx``."""
        from kveval.stores.lowrank import LowRankStore, per_token_groups

        self._groups = per_token_groups(inner)
        ranks = self.layer_ranks(model, layer_idx, self._groups)
        calibration = self.calibration_for(model)
        return LowRankStore.build(inner, calibration.layout(layer_idx, ranks["k"], ranks["v"], model.device))
