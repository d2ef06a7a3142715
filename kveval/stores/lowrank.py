"""The low-rank store: K/V kept as their coefficients on calibrated per-head bases (:mod:`kveval.calibration.kv`).

MLA (DeepSeek-V2) shrinks the KV cache by caching a low-dimensional latent;
post-training methods (Palu, Eigen Attention, LoRC) approximate this on an
existing model by projecting K and V onto a few principal directions. Here,
per layer and KV head, keys and values each get an orthonormal basis
``B`` (``[head_dim, r]``); a token is stored as its ``r`` coefficients
``c = x B`` and read back as ``x_hat = c B^T``. As with quantization, tokens
are encoded when the cache seals them: the prefill's own attention is exact,
and everything that attends to the cache afterwards (question, generated
tokens) sees the reconstruction. The bases are per model, held in float32, and
are not counted in the cache's per-token bytes.

Keys are projected AFTER RoPE
------------------------------
Transformers' attention modules rotate the keys before ``cache.update``, so the
cache (and this store) only ever sees post-RoPE keys. Projecting them there
needs no modeling-code edit, and the coefficients reconstruct exactly the keys
attention uses, so the calibration is done on post-RoPE keys too. The cost:
RoPE rotates each channel pair by a position-dependent angle, which spreads a
pre-RoPE direction over its rotation plane, so post-RoPE keys are less low-rank
than pre-RoPE keys (why MLA uses a decoupled RoPE part and Palu/LoRC project
pre-RoPE). And the basis only covers the angles the calibration positions
(0 .. ``calib_tokens``) reached: slowly rotating pairs at positions far beyond
the calibration length may be reconstructed less well. Pre-RoPE projection
would require re-applying RoPE at read time from stored positions, i.e. a change
inside the attention module. Values carry no RoPE, so the question does not
arise for them.

Calibration
-----------
One forward pass over a calibration text (``kveval/data/calibration.txt`` by
default, at most ``calib_tokens`` tokens) in transformers' own cache layers
(plain ``DynamicLayer`` s for attention, sliding layers too, so every layer
keeps the whole pass; the model's own state layers for Mamba and linear
attention); the stored post-RoPE K/V of every attention layer are read from it. The calibration does
not go through kveval's own cache, so this module depends on the stores only. Per layer and KV
head, an *uncentered* PCA: eigendecomposition of ``X^T X / T`` (float64), so a
token's reconstruction is ``c B^T`` with no mean term. The full
eigendecomposition is cached on disk under ``cache_dir() / "calibration"``,
keyed by the model's identity (name, architecture fields, dtype and a hash of a
few K/V projection weights) and the calibration text's SHA-256, so every rank
or energy reuses one calibration and a changed text is calibrated again.

Models without a known tokenizer (random test models) are calibrated on the
text's UTF-8 bytes modulo the vocabulary size.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from kveval.stores.base import BatchFamily, DenseStore, TokenStore
from kveval.stores.quantized import QuantizedStore


# --- the store ---------------------------------------------------------------------------------
@dataclass
class _Part:
    """Contiguous KV heads with the same K and V ranks, stored in one inner store."""

    heads: slice
    inner: object
    key_basis: torch.Tensor  # [h, D, r_k], float32
    value_basis: torch.Tensor  # [h, D, r_v], float32
    bases_t: tuple | None = field(default=None, repr=False, compare=False)  # see transposed()

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bases as contiguous ``[h, r, D]`` (what :func:`reconstruct` multiplies by), made once per device."""
        if self.bases_t is None or self.bases_t[0].device != self.key_basis.device:
            self.bases_t = (self.key_basis.transpose(-1, -2).contiguous(), self.value_basis.transpose(-1, -2).contiguous())
        return self.bases_t


_RECONSTRUCT_TOKENS = 256  # at most this many tokens per elementwise product in reconstruct ...
_RECONSTRUCT_ELEMENTS = 1 << 24  # ... and at most this many elements (64 MiB) in its [..., T, r, D] temporary


def reconstruct(coefficients: torch.Tensor, basis_t: torch.Tensor) -> torch.Tensor:
    """``[..., h, T, r]`` float32 coefficients times a contiguous ``[h, r, D]`` basis: ``[..., h, T, D]``.

    Elementwise products summed over the rank, not a matrix product: a matmul's blocking follows the matrix
    sizes, so a token reconstructed alone, with the rest of its row or with other rows could differ in the last
    bit; this way a token's K/V are the same whichever tokens and rows are reconstructed with it (a decode
    step's one new token, a whole row, a batch). Chunks of tokens bound the temporary.
    """
    basis = basis_t[:, None]  # [h, 1, r, D]
    tokens = coefficients.shape[-2]
    per_token = coefficients.numel() // max(1, tokens) * basis_t.shape[-1]  # temporary elements per token
    step = max(1, min(_RECONSTRUCT_TOKENS, _RECONSTRUCT_ELEMENTS // max(1, per_token)))
    chunks = [(coefficients[..., start:start + step, :, None] * basis).sum(dim=-2) for start in range(0, tokens, step)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)


class CoefficientStore(TokenStore):
    """Tokens kept as coefficients in inner stores, encoded when the cache seals them.

    The mechanics shared by :class:`LowRankStore` (per-head bases) and
    :class:`kveval.stores.latent.LatentStore` (one basis per group of heads):
    ``append(keys, values)`` holds the ``[H, T, D]`` tensors as they come
    (post-RoPE keys: the cache receives keys after RoPE) in a dense store in
    the inner stores' ``kv_dtype``; ``seal()`` encodes them (:meth:`encode`)
    and appends the coefficients to the inner stores (``DenseStore``, which holds
    them in its ``kv_dtype``, or a ``QuantizedStore`` that then quantizes them);
    ``keys_values()`` decodes them (:meth:`decode`), followed by any tokens not
    sealed yet. ``nbytes`` is the inner stores' bytes (plus unsealed tokens):
    the per-token coefficients only, never the per-model bases.

    Incremental reads (:meth:`changed_from`): a token's decoded K/V depend on its
    own coefficients alone, so once read they change only where an inner store
    says its coefficients changed (a quantizer sealing its residual) or when the
    token itself is sealed; a decode step re-decodes its new tokens, not the row.
    """

    batch_family = BatchFamily.COEFFICIENTS

    def __init__(self, inners: list):
        self.inners = inners
        self.kv_dtype = inners[0].kv_dtype
        self.unsealed = DenseStore(self.kv_dtype)  # [H, T, D] tokens appended but not encoded yet
        self._sealed_read = 0  # sealed tokens at the last mark_read: later ones were shown unsealed, or not at all

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[..., H, T, D]`` keys and values -> K and V coefficients for each inner store, in the inputs' dtype.

        Leading dims are rows of a batch (a batched decode step encodes every row's new token with the first
        row's store); a token's coefficients are the same encoded alone (one row, ``T = 1``) or in a batch."""
        raise NotImplementedError

    def decode(self, coefficients: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Coefficients of each inner store -> ``[..., H, T, D]`` keys and values, in the coefficients' dtype;
        a token's K/V depend on its own coefficients alone, bit for bit (:func:`reconstruct`)."""
        raise NotImplementedError

    def same_code(self, other: "CoefficientStore") -> bool:
        """Whether ``other`` encodes and decodes as this store does (same class and bases): a batch of such rows
        may be encoded by one of them."""
        raise NotImplementedError

    def inner_index(self, i: int, index: torch.Tensor) -> torch.Tensor:
        """The rows of a per-head ``select`` index (``[H, T']``) that inner store ``i`` keeps."""
        raise NotImplementedError

    @property
    def length(self) -> int:
        return self.inners[0].length + self.unsealed.length

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.unsealed.append(keys, values)

    def seal(self) -> None:
        if self.unsealed.length:
            for inner, (ck, cv) in zip(self.inners, self.encode(*self.unsealed.keys_values())):
                inner.append(ck, cv)
            self.unsealed = DenseStore(self.kv_dtype)
        for inner in self.inners:
            inner.seal()

    def coefficients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The stored (dequantized) coefficients of each inner store (sealed tokens only)."""
        return [inner.keys_values() for inner in self.inners]

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.inners[0].length:
            return self.unsealed.keys_values()
        keys, values = self.decode(self.coefficients())
        if self.unsealed.length:
            pending_keys, pending_values = self.unsealed.keys_values()
            keys = torch.cat([keys, pending_keys], dim=1)
            values = torch.cat([values, pending_values], dim=1)
        return keys, values

    def changed_from(self) -> int:
        return min([self._sealed_read] + [inner.changed_from() for inner in self.inners])

    def mark_read(self) -> None:
        self._sealed_read = self.inners[0].length
        for inner in self.inners:
            inner.mark_read()

    def keys_values_from(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        sealed = self.inners[0].length
        if start >= sealed:
            return self.unsealed.keys_values_from(start - sealed)
        keys, values = self.decode([inner.keys_values_from(start) for inner in self.inners])
        if self.unsealed.length:
            pending_keys, pending_values = self.unsealed.keys_values()
            keys = torch.cat([keys, pending_keys], dim=1)
            values = torch.cat([values, pending_values], dim=1)
        return keys, values

    def select(self, index: torch.Tensor) -> None:
        self._sealed_read = 0
        if self.unsealed.length and self.inners[0].length:
            self.seal()  # mixed sealed and unsealed tokens (the cache never selects then): encode first
        if self.unsealed.length:
            self.unsealed.select(index)
        else:
            for i, inner in enumerate(self.inners):
                inner.select(self.inner_index(i, index))

    @property
    def nbytes(self) -> int:
        return sum(inner.nbytes for inner in self.inners) + self.unsealed.nbytes


class LowRankStore(CoefficientStore):
    """Keeps each token's K and V as coefficients on per-head bases, in an inner store.

    A :class:`CoefficientStore` whose code is ``c = x B`` per KV head
    (``[H, T, r]`` coefficients) and whose reconstruction is ``c B^T``. Heads
    whose ranks differ (``energy=``) are kept in separate inner stores (parts).
    The bases are per model (see
    :meth:`kveval.policies.lowrank.LowRankPolicy.basis_bytes`).
    """

    def __init__(self, parts: list[_Part]):
        super().__init__([part.inner for part in parts])
        self.parts = parts

    @classmethod
    def build(cls, inner, layout: list[tuple[slice, torch.Tensor, torch.Tensor]]) -> "LowRankStore":
        """A store over ``layout`` (from :meth:`Calibration.layout`): the first run of heads uses ``inner``,
        the others empty copies of it."""
        if inner.length:
            raise ValueError("LowRankStore needs an empty inner store")
        return cls([_Part(heads, inner if i == 0 else copy.deepcopy(inner), kb, vb)
                    for i, (heads, kb, vb) in enumerate(layout)])

    @staticmethod
    def _basis_on(part: _Part, device) -> None:
        if part.key_basis.device != device:
            part.key_basis, part.value_basis = part.key_basis.to(device), part.value_basis.to(device)

    def project(self, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Coefficients ``x B`` of each part, ``[..., h, T, r]``, in the inputs' dtype (``[..., H, T, D]`` inputs:
        one row, or a batch of rows' new tokens, :class:`kveval.cache.buffered_decode.BufferedDecode`)."""
        out = []
        for part in self.parts:
            self._basis_on(part, keys.device)
            out.append((torch.matmul(keys[..., part.heads, :, :].float(), part.key_basis).to(keys.dtype),
                        torch.matmul(values[..., part.heads, :, :].float(), part.value_basis).to(values.dtype)))
        return out

    encode = project

    def decode(self, coefficients: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = [], []
        for part, (ck, cv) in zip(self.parts, coefficients):
            key_t, value_t = part.transposed()
            keys.append(reconstruct(ck.float(), key_t).to(ck.dtype))
            values.append(reconstruct(cv.float(), value_t).to(cv.dtype))
        keys = keys[0] if len(keys) == 1 else torch.cat(keys, dim=-3)
        values = values[0] if len(values) == 1 else torch.cat(values, dim=-3)
        return keys, values

    def inner_index(self, i: int, index: torch.Tensor) -> torch.Tensor:
        return index[self.parts[i].heads]

    def same_code(self, other: CoefficientStore) -> bool:
        return (type(other) is LowRankStore and len(other.parts) == len(self.parts)
                and all(p.heads == q.heads and torch.equal(p.key_basis, q.key_basis) and torch.equal(p.value_basis, q.value_basis)
                        for p, q in zip(self.parts, other.parts)))

    def __deepcopy__(self, memo) -> "LowRankStore":
        # Bases are per model and read-only: copies share them; coefficients and pending tokens are copied.
        clone = LowRankStore([_Part(p.heads, copy.deepcopy(p.inner, memo), p.key_basis, p.value_basis) for p in self.parts])
        clone.unsealed = copy.deepcopy(self.unsealed, memo)
        return clone


def per_token_groups(inner) -> dict[str, int | None]:
    """For a quantized inner store, the per-token group size of K and V (``None``: not per-token or not quantized)."""
    groups = {"k": None, "v": None}
    if isinstance(inner, QuantizedStore):
        for kind, seq in (("k", inner.k), ("v", inner.v)):
            if seq.quant.axis == "token":
                groups[kind] = seq.quant.group
    return groups


def round_up(rank: int, multiple: int | None, limit: int) -> int:
    """``rank`` rounded up to a multiple of ``multiple`` (at most ``limit``)."""
    if not multiple:
        return rank
    return min(limit, math.ceil(rank / multiple) * multiple)

