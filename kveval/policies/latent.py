"""Cross-head latent K/V (``latent``): r coefficients per token for a whole group of KV heads, MLA-style.

Palu (Chang et al. 2024, "Palu: Compressing KV-Cache with Low-Rank Projection")
shares one low-rank projection across a group of heads (its group-head
decomposition); MHA2MLA (Ji et al. 2025, "Towards Economical Inference: Enabling
DeepSeek's Multi-Head Latent Attention in Any Transformer-based LLMs") across
all heads, with a few RoPE dimensions per head kept out of the latent. Here the
basis is an uncentered PCA of the group's concatenated post-RoPE keys (and of
its values) on the calibration text; see :mod:`kveval.stores.latent` for the details
and how they differ from the papers. ``latent(rank=r,group=1)`` is per-head low
rank (``lowrank(rank=r)`` up to the calibration file); on a model with one KV
head (Gemma-3-270M) every group is that one head.

Stacks with quantization (the coefficients and RoPE dimensions are quantized:
``latent(rank=64)+quant(bits=8)``) and with selection: the heads of a group keep
the same tokens, chosen by their scores averaged over the group.
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.errors import PolicySpecError
from kveval.policies.base import PlannedWidths
from kveval.policies.lowrank import CalibratedPolicy
# Stores, calibration and the model's hooks import torch: imported inside the methods that run a policy on a model.


@dataclass
class LatentPolicy(CalibratedPolicy):
    """Project the keys (after RoPE) and values of each group of KV heads onto one calibrated basis per layer.

    Attributes
    ----------
    rank : int
        Coefficients kept per token and group, for K and for V
        (``1 <= rank <= group * (head_dim - rope_dims)``).
    group : int, optional
        KV heads sharing a basis; must divide the KV heads. Default: all of them
        (one latent per layer, as MLA).
    rope_dims : int
        Key dimensions per head kept at full rank, outside the latent: the
        ``rope_dims/2`` rotation pairs with the most key energy on the
        calibration text (even, at most head_dim). Default 0.
    calibration, calib_tokens
        As for ``lowrank``: the calibration text (default the shipped one) and
        the tokens of it used (default 2048).

    Notes
    -----
    Per token, layer and group the cache holds ``rank + group*rope_dims`` key
    numbers and ``rank`` value numbers (in the cache dtype, or quantized by a
    stacked quantization policy); the bases are per model (:meth:`basis_bytes`).
    At full rank (``rank = group*head_dim``, ``rope_dims=0``) it reproduces
    ``none`` up to float32 rounding of ``x B B^T``.
    """

    name = "latent"
    family = "structure"
    description = "cross-head latent K/V (MLA-style): one calibrated basis per group of KV heads (Palu, MHA2MLA)"
    rank: int | None = None
    group: int | None = None
    rope_dims: int = 0
    calibration: str | None = None
    calib_tokens: int | None = None

    def __post_init__(self):
        if self.rank is None:
            raise PolicySpecError(f"{self.name}: give rank= (coefficients per token and group of KV heads)")
        for key in ("rank", "group"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise PolicySpecError(f"{self.name}: {key}={value} must be a positive integer")
        if self.rope_dims < 0 or self.rope_dims % 2:
            raise PolicySpecError(f"{self.name}: rope_dims={self.rope_dims} must be an even number >= 0 "
                                  "(RoPE rotates dimensions in pairs)")
        self.check_calibration_params()
        self._kv_heads: int | None = None  # set by check_shape

    def calibration_kind(self) -> type:
        from kveval.stores.latent import CrossHeadCalibration

        return CrossHeadCalibration

    # --- the model's shape ------------------------------------------------------------------------
    def group_size(self, heads: int) -> int:
        """KV heads per group for a layer of ``heads`` KV heads (refusing a group that does not divide them)."""
        group = heads if self.group is None else self.group
        if heads % group:
            raise PolicySpecError(f"{self.spec()}: group={group} does not divide the {heads} KV heads; "
                                  f"use a divisor of {heads}")
        return group

    def check_layer(self, heads: int, head_dim: int, value_dim: int | None = None) -> int:
        """Validate rank and rope_dims against one layer's shape (``value_dim``: when V heads differ from K's); its group size."""
        group = self.group_size(heads)
        if self.rope_dims > head_dim:
            raise PolicySpecError(f"{self.spec()}: rope_dims={self.rope_dims} exceeds head_dim={head_dim}")
        limit = group * (head_dim - self.rope_dims)
        if self.rank > limit:
            raise PolicySpecError(f"{self.spec()}: rank={self.rank} exceeds group x (head_dim - rope_dims) = "
                                  f"{group} x ({head_dim} - {self.rope_dims}) = {limit}; use at most {limit}")
        if value_dim is not None and self.rank > group * value_dim:
            raise PolicySpecError(f"{self.spec()}: rank={self.rank} exceeds group x value head dim = {group} x {value_dim}; "
                                  f"use at most {group * value_dim}")
        return group

    def _check_calibrated_layer(self, calibration, layer: int) -> int:
        return self.check_layer(calibration.num_heads(layer), calibration.head_dim(layer), calibration.value_dim(layer))

    def widths(self, group: int) -> dict[str, int]:
        """Numbers per token and group: K (coefficients, then RoPE dimensions) and V."""
        return {"k": self.rank + group * self.rope_dims, "v": self.rank}

    def stored_widths(self, head_dim: int) -> dict[str, int] | None:
        """Numbers per token of K and V the quantizer sees; ``None`` while the group size is unknown
        (``rope_dims > 0``, no ``group=``, and no :meth:`check_shape` yet)."""
        group = self.group or self._kv_heads
        if self.rope_dims and group is None:
            return None
        return self.widths(group or 1)

    def planned_widths(self, kv_heads: int, k_width: int, v_width: int, mla: bool = False) -> PlannedWidths:
        if mla:  # one group of the one latent "head"
            self.check_layer(1, k_width, v_width or None)
            widths = self.widths(1)
            return PlannedWidths(1, widths["k"], widths["v"] if v_width else 0)
        self.check_shape(kv_heads, k_width)
        group = self.group_size(kv_heads)
        widths = self.widths(group)
        return PlannedWidths(kv_heads // group, widths["k"], widths["v"])

    def model_widths(self, kv_heads: int, head_dim: int) -> None:
        """Widths are per group of KV heads, not per head: :meth:`check_shape` checks them against the model."""
        self.check_shape(kv_heads, head_dim)
        return None

    def check_shape(self, kv_heads: int, head_dim: int) -> None:
        """Check this policy against a model's KV heads and head_dim (before it loads) and remember the head count.

        :class:`kveval.runner.runspec.RunSpec` calls it on its own copy of the policy, so
        :meth:`stored_widths` then knows the group size and an unset quantization
        group adapts to ``rank + group*rope_dims``. Returns ``None``: the widths
        are per group of heads, not per head, so the runner's per-head check does not apply.
        """
        self.check_layer(kv_heads, head_dim)
        self._kv_heads = kv_heads

    def basis_bytes(self, model) -> int:
        """Bytes of the per-model bases (float32, every layer and group, K and V): not part of the per-token bytes."""
        calibration = self.calibration_for(model)
        total = 0
        for layer in calibration.kv_layers:
            self._check_calibrated_layer(calibration, layer)
            heads = calibration.num_heads(layer)
            widths = (calibration.head_dim(layer) - self.rope_dims) + calibration.value_dim(layer)
            total += 4 * heads * self.rank * widths  # (heads / group) bases of group x width rows each
        return total

    # --- the store --------------------------------------------------------------------------------
    def prepare(self, model) -> None:
        """Calibrate and validate every layer before the first forward pass."""
        calibration = self.calibration_for(model)
        for layer in calibration.kv_layers:
            self._check_calibrated_layer(calibration, layer)

    def run_info(self, model) -> dict:
        """The calibration (as ``lowrank`` records it) and the bases' bytes, paid once per model."""
        return {**super().run_info(model), "basis_bytes": self.basis_bytes(model)}

    def make_store(self, inner, model, layer_idx: int):
        """A :class:`kveval.stores.latent.LatentStore` over ``inner`` (a dense or quantized store of the coefficients)."""
        from kveval.stores.latent import LatentStore
        from kveval.stores.lowrank import per_token_groups

        calibration = self.calibration_for(model)
        group = self._check_calibrated_layer(calibration, layer_idx)
        widths = self.widths(group)
        for kind, size in per_token_groups(inner).items():
            if size and widths[kind] % size:
                raise PolicySpecError(f"{self.spec()}: per-token quantization group={size} does not divide the {kind} "
                                      f"width {widths[kind]} (rank + group x rope_dims for K, rank for V); "
                                      f"pick a group that divides {widths[kind]}")
        return LatentStore(inner, calibration.layout(layer_idx, group, self.rank, self.rope_dims, model.device))


__all__ = ["LatentPolicy"]
