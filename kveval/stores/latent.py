"""Cross-head latent K/V (MLA-style): one calibrated basis per group of KV heads, and the store of its coefficients.

DeepSeek's MLA caches one latent vector per token shared by all heads;
post-training methods approximate it on an existing model. Palu (Chang et al.
2024, "Palu: Compressing KV-Cache with Low-Rank Projection") calls the choice
of how many heads share a projection per-head (M-LRD), group-head (G-LRD) or
joint-head (J-LRD) low-rank decomposition; MHA2MLA (Ji et al. 2025, "Towards
Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in Any
Transformer-based LLMs") projects all heads jointly and keeps a few RoPE
frequencies of each head out of the latent (partial RoPE, as MLA's decoupled
RoPE key). Here, per layer and group of ``g`` KV heads, a token's keys are
concatenated to ``g * head_dim`` numbers and projected onto ``r`` directions of
one basis; values likewise. ``g = 1`` is per-head low rank (:mod:`kveval.stores.lowrank`).

What is calibrated, and how it differs from the papers
--------------------------------------------------------
Palu and MHA2MLA factor the K/V projection *weights* (SVD, pre-RoPE, then
fine-tune or fuse the up-projection into attention). kveval does not touch the
model: like :mod:`kveval.stores.lowrank` it projects what the cache receives (post-RoPE
keys, values) onto the leading directions of an uncentered PCA of those
tensors on the shipped calibration text (the same pass, :func:`kveval.calibration.kv.calibration_kv`).
One pass serves every group size and RoPE split: :class:`CrossHeadCalibration`
keeps, per layer, the second moment ``X^T X / T`` of all KV heads' keys
concatenated (``[H*D, H*D]``, float64), and of values; a group's basis is the
eigendecomposition of its diagonal block.

RoPE dimensions kept at full rank (``rope_dims=d``)
---------------------------------------------------
MHA2MLA keeps, per head, the RoPE frequencies that contribute most to the
attention scores (its 2-norm criterion, ``|q_i| |k_i|`` per frequency pair)
and removes RoPE from the others, which a fine-tune then absorbs. kveval
cannot remove RoPE (no fine-tune, no change inside attention) and its
calibration sees keys only, so the choice here is: per layer and KV head, the
``d/2`` rotation pairs whose keys hold the most energy (mean of ``k_i^2 + k_j^2``
over the calibration tokens; a rotation keeps this norm, so post-RoPE keys give
the pre-RoPE ranking). A pair is ``(i, i + D/2)``, the ``rotate_half``
convention of the transformers models (Llama, Gemma, Qwen, Mistral, ...). Those
``d`` dimensions are stored as they are (in the cache dtype, or quantized with
the coefficients); the other ``D - d`` dimensions of each head go through the
latent. The energy criterion keeps the dimensions a low-rank basis would
reconstruct worst in absolute terms only when they are also the rotating, hard
to compress ones; it is a proxy for MHA2MLA's query-aware score.

Bytes
-----
Per token, layer and group: ``r + g*d`` key numbers and ``r`` value numbers,
in the cache dtype or quantized by a stacked quantization policy. The bases
(float32, ``g*(D-d) x r`` for K and ``g*D x r`` for V per group and layer) are
per model, reported apart (:meth:`kveval.policies.latent.LatentPolicy.basis_bytes`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch

from kveval.calibration.kv import CALIBRATION_VERSION, CalibrationText, calibration_kv, load_versioned, save_atomic
from kveval.errors import UsageError
from kveval.stores.lowrank import CoefficientStore, reconstruct


@dataclass(frozen=True)
class LatentLayout:
    """One layer's projection for groups of ``group`` KV heads.

    ``order`` (``[H, D]``) lists each head's dimensions as the store lays them
    out: the ``D - d`` latent dimensions first, then the ``d`` RoPE dimensions
    kept at full rank (``None`` when ``d = 0``: the natural order);
    ``inverse`` undoes it. ``key_basis`` is ``[G, g*(D-d), r]`` and
    ``value_basis`` ``[G, g*D, r]``, float32 with orthonormal columns.
    """

    group: int
    rope_dims: int
    key_basis: torch.Tensor
    value_basis: torch.Tensor
    order: torch.Tensor | None
    inverse: torch.Tensor | None

    @property
    def groups(self) -> int:
        return self.key_basis.shape[0]

    @property
    def rank(self) -> int:
        return self.key_basis.shape[-1]

    def to(self, device) -> "LatentLayout":
        moved = [None if t is None else t.to(device) for t in (self.key_basis, self.value_basis, self.order, self.inverse)]
        return LatentLayout(self.group, self.rope_dims, *moved)

    @cached_property
    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bases as contiguous ``[G, r, g*n]`` (what :func:`~kveval.stores.lowrank.reconstruct` multiplies by)."""
        return self.key_basis.transpose(-1, -2).contiguous(), self.value_basis.transpose(-1, -2).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes of the bases (per model, not per token)."""
        return sum(t.numel() * t.element_size() for t in (self.key_basis, self.value_basis))


@dataclass
class CrossHeadCalibration:
    """Per layer, the uncentered second moments of all KV heads' keys (and values) concatenated.

    ``moments[kind][layer]`` is ``[H*D, H*D]`` float64 for ``kind`` in ``"k"``, ``"v"``;
    head ``h``'s dimension ``i`` is row ``h*D + i``. ``None`` (and ``heads[layer]``
    ``None``) for a layer without K/V (a hybrid model's Mamba or linear-attention layers).
    """

    moments: dict[str, list[torch.Tensor | None]]
    heads: list[int | None]  # KV heads per layer
    tokens: int
    text_sha256: str
    model_key: str
    path: Path | None = None
    _layouts: dict = field(default_factory=dict, repr=False)
    KIND: ClassVar[str] = "crosshead"  # its own cache file, next to the per-head calibration

    @property
    def num_layers(self) -> int:
        return len(self.heads)

    @property
    def kv_layers(self) -> list[int]:
        """The layers that hold K/V (every layer, except a hybrid model's state layers)."""
        return [layer for layer, heads in enumerate(self.heads) if heads is not None]

    def num_heads(self, layer: int) -> int:
        return self.heads[layer]

    def head_dim(self, layer: int) -> int:
        """Key dimensions per head."""
        return self.moments["k"][layer].shape[0] // self.heads[layer]

    def value_dim(self, layer: int) -> int:
        """Value dimensions per head (the key's, except on models such as DeepSeek's MLA)."""
        return self.moments["v"][layer].shape[0] // self.heads[layer]

    # --- the protocol of kveval.calibration.kv.load_or_calibrate ----------------------------------------
    @classmethod
    def calibrate(cls, model, text: CalibrationText, tokens: int, model_key: str = "") -> "CrossHeadCalibration":
        kv, used = calibration_kv(model, text, tokens)
        moments = {"k": [], "v": []}
        for pair in kv:
            for kind, x in zip(("k", "v"), pair or (None, None)):
                flat = None if x is None else x.double().permute(1, 0, 2).reshape(x.shape[1], -1)  # [T, H*D]
                moments[kind].append(None if flat is None else flat.T @ flat / max(1, flat.shape[0]))
        return cls(moments, [None if pair is None else pair[0].shape[0] for pair in kv], used, text.sha256, model_key)

    def save(self, path: Path) -> None:
        save_atomic({"version": CALIBRATION_VERSION, "kind": self.KIND, "tokens": self.tokens, "heads": self.heads,
                     "text_sha256": self.text_sha256, "model_key": self.model_key, "moments": self.moments}, path)

    @classmethod
    def load(cls, path: Path) -> "CrossHeadCalibration | None":
        payload = load_versioned(path, CALIBRATION_VERSION)
        if payload is None or payload.get("kind") != cls.KIND:
            return None
        return cls(payload["moments"], list(payload["heads"]), payload["tokens"], payload["text_sha256"],
                   payload["model_key"], path)

    # --- what the store needs ---------------------------------------------------------------------
    def pair_energy(self, layer: int) -> torch.Tensor:
        """``[H, D/2]``: mean key energy of each rotation pair ``(i, i + D/2)`` of each head."""
        heads, dim = self.heads[layer], self.head_dim(layer)
        diagonal = self.moments["k"][layer].diagonal().reshape(heads, dim)
        return diagonal[:, : dim // 2] + diagonal[:, dim // 2:]

    def rope_dimensions(self, layer: int, rope_dims: int) -> torch.Tensor:
        """``[H, rope_dims]``: per head, the dimensions of its ``rope_dims/2`` most energetic pairs, ascending."""
        half = self.head_dim(layer) // 2
        pairs = self.pair_energy(layer).topk(rope_dims // 2, dim=1).indices
        return torch.cat([pairs, pairs + half], dim=1).sort(dim=1).values

    def _orders(self, layer: int, rope_dims: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Each head's dimensions, latent ones first then RoPE ones (``[H, D]``), and the inverse permutation."""
        if not rope_dims:
            return None, None
        heads, dim = self.heads[layer], self.head_dim(layer)
        rope = self.rope_dimensions(layer, rope_dims)
        is_rope = torch.zeros(heads, dim, dtype=torch.bool).scatter_(1, rope, True)
        latent = torch.arange(dim).expand(heads, -1)[~is_rope].reshape(heads, dim - rope_dims)
        order = torch.cat([latent, rope], dim=1)
        return order, order.argsort(dim=1)

    def _group_basis(self, kind: str, layer: int, group: int, rank: int, dims: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eigenvalues ``[G, g*len]`` (descending) and the leading ``rank`` eigenvectors ``[G, g*len, rank]`` of each group.

        ``dims`` (``[H, len]``) are the dimensions of each head that enter the latent.
        """
        heads, dim = self.heads[layer], self.moments[kind][layer].shape[0] // self.heads[layer]
        moment = self.moments[kind][layer]
        values, vectors = [], []
        for start in range(0, heads, group):
            rows = torch.cat([h * dim + dims[h] for h in range(start, start + group)])
            eigenvalues, eigenvectors = torch.linalg.eigh(moment[rows][:, rows])
            values.append(eigenvalues.flip(-1).clamp(min=0))
            vectors.append(eigenvectors.flip(-1)[:, :rank].float())
        return torch.stack(values), torch.stack(vectors).contiguous()

    def _latent_dims(self, kind: str, layer: int, rope_dims: int) -> torch.Tensor:
        """``[H, n]``: the dimensions of each head's keys (``kind="k"``) or values that enter the latent."""
        if kind == "v":
            return torch.arange(self.value_dim(layer)).expand(self.heads[layer], -1)
        order, _ = self._orders(layer, rope_dims)
        dim = self.head_dim(layer)
        return torch.arange(dim).expand(self.heads[layer], -1) if order is None else order[:, : dim - rope_dims]

    def layout(self, layer: int, group: int, rank: int, rope_dims: int, device=None) -> LatentLayout:
        """The layer's :class:`LatentLayout` (memoized: every store of the layer shares its tensors)."""
        key = (layer, group, rank, rope_dims, str(device))
        if key not in self._layouts:
            order, inverse = self._orders(layer, rope_dims)
            _, key_basis = self._group_basis("k", layer, group, rank, self._latent_dims("k", layer, rope_dims))
            _, value_basis = self._group_basis("v", layer, group, rank, self._latent_dims("v", layer, 0))
            self._layouts[key] = LatentLayout(group, rope_dims, key_basis, value_basis, order, inverse).to(device)
        return self._layouts[key]

    def energy_kept(self, kind: str, layer: int, group: int, rank: int, rope_dims: int = 0) -> float:
        """Fraction of the layer's calibration energy (K or V, all heads) kept by rank ``rank`` and the RoPE dimensions."""
        dims = self._latent_dims(kind, layer, rope_dims)
        eigenvalues, _ = self._group_basis(kind, layer, group, rank, dims)
        total = float(self.moments[kind][layer].diagonal().sum())
        kept = float(eigenvalues[:, :rank].sum()) + (total - float(eigenvalues.sum()))  # RoPE dims: all their energy
        return kept / total if total > 0 else 1.0


class LatentStore(CoefficientStore):
    """Keeps each token as ``r`` coefficients per group of KV heads for K (plus its RoPE dimensions) and for V.

    A :class:`kveval.stores.lowrank.CoefficientStore` over one inner store that holds
    ``[G, T, r + g*d]`` key and ``[G, T, r]`` value numbers (``G`` groups of
    ``g`` heads, ``d`` RoPE dimensions per head). The heads of a group share
    their tokens: :attr:`head_groups` tells the cache layer to score and select
    them together, and :meth:`select` refuses an index that differs inside a group.
    """

    def __init__(self, inner, layout: LatentLayout):
        super().__init__([inner])
        self.layout = layout

    @property
    def head_groups(self) -> int:
        """KV heads that keep the same tokens (the cache averages their scores before selecting)."""
        return self.layout.group

    def _layout_on(self, device) -> LatentLayout:
        if self.layout.key_basis.device != device:
            self.layout = self.layout.to(device)
        return self.layout

    def _to_groups(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H, T, n]`` -> ``[..., G, T, g*n]``: a token's heads of one group side by side."""
        *lead, heads, tokens, n = x.shape
        g = self.layout.group
        return x.reshape(*lead, heads // g, g, tokens, n).transpose(-3, -2).reshape(*lead, heads // g, tokens, g * n)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., G, T, g*n]`` -> ``[..., H, T, n]`` (inverse of :meth:`_to_groups`)."""
        *lead, groups, tokens, width = x.shape
        g = self.layout.group
        return x.reshape(*lead, groups, tokens, g, width // g).transpose(-3, -2).reshape(*lead, groups * g, tokens, width // g)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layout = self._layout_on(keys.device)
        dtype, keys, values = keys.dtype, keys.float(), values.float()
        if layout.order is not None:
            keys = keys.gather(-1, layout.order[:, None, :].expand(keys.shape))
        latent_width = keys.shape[-1] - layout.rope_dims
        ck = torch.matmul(self._to_groups(keys[..., :latent_width]), layout.key_basis)
        if layout.rope_dims:
            ck = torch.cat([ck, self._to_groups(keys[..., latent_width:])], dim=-1)
        cv = torch.matmul(self._to_groups(values), layout.value_basis)
        return [(ck.to(dtype), cv.to(dtype))]

    def decode(self, coefficients: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        (ck, cv), = coefficients
        layout = self._layout_on(ck.device)
        dtype, rank = ck.dtype, layout.rank
        key_t, value_t = layout.transposed
        keys = self._to_heads(reconstruct(ck[..., :rank].float(), key_t))
        if layout.rope_dims:
            keys = torch.cat([keys, self._to_heads(ck[..., rank:].float())], dim=-1)
            keys = keys.gather(-1, layout.inverse[:, None, :].expand(keys.shape))
        values = self._to_heads(reconstruct(cv.float(), value_t))
        return keys.to(dtype), values.to(dtype)

    def same_code(self, other: CoefficientStore) -> bool:
        if type(other) is not LatentStore:
            return False
        mine, theirs = self.layout, other.layout
        return (mine is theirs or (
            mine.group == theirs.group and mine.rope_dims == theirs.rope_dims
            and all(a is b or (a is not None and b is not None and torch.equal(a, b))
                    for a, b in zip((mine.key_basis, mine.value_basis, mine.order), (theirs.key_basis, theirs.value_basis, theirs.order)))))

    def select(self, index: torch.Tensor) -> None:
        g = self.layout.group
        grouped = index.reshape(index.shape[0] // g, g, index.shape[1])
        if not bool((grouped == grouped[:, :1]).all()):
            raise UsageError(f"latent: the {g} KV heads of a group share their tokens; "
                             "select the same tokens in every head of a group")
        super().select(index)

    def inner_index(self, i: int, index: torch.Tensor) -> torch.Tensor:
        g = self.layout.group
        return index[::g]  # one row per group (select checked that the group's rows agree)

    def __deepcopy__(self, memo) -> "LatentStore":
        # The layout (bases) is per model and read-only: copies share it; coefficients and pending tokens are copied.
        clone = LatentStore(copy.deepcopy(self.inners[0], memo), self.layout)
        clone.unsealed = copy.deepcopy(self.unsealed, memo)
        return clone


__all__ = ["CrossHeadCalibration", "LatentLayout", "LatentStore"]
