"""MiniCache's merged stores: two adjacent layers' prefill tokens held as one shared direction per token plus each
layer's magnitudes, the most divergent tokens kept apart (Liu et al. 2024, "MiniCache: KV Cache Compression in Depth
Dimension for Large Language Models").

For one KV head and one of K/V, layer ``l-1``'s token ``x`` and layer ``l``'s token ``y``:

- directions ``u = x / ||x||``, ``w = y / ||y||``, angle ``omega = arccos(u . w)``;
- the merged direction is their SLERP, ``e = sin((1 - t) omega) / sin(omega) u + sin(t omega) / sin(omega) w``
  (a unit vector; where ``sin(omega)`` is 0 the two directions agree and ``e = (1 - t) u + t w``);
- each layer restores its token as its own magnitude times ``e``: ``||x|| e`` and ``||y|| e``;
- the ``retained`` tokens of largest angular distance ``omega / pi`` (per head) are not merged: each layer keeps
  its own, with their slots (int32) held once for the pair.

:func:`slerp_merge` is the arithmetic; :class:`MergedStore` holds one layer's part. The pair's shared tensors (the
directions, the retained slots) are counted in the earlier layer's bytes alone.

Coding: the directions (K's and V's, shared) and each layer's retained tokens are held in stores the stack's
quantizer makes (``coded(compute_dtype)``: a :class:`~kveval.stores.base.DenseStore` in the cache dtype without one, else e.g. a
:class:`~kveval.stores.quantized.QuantizedStore`, with its groups and residual window), each coded once, whole, right
after the merge, from the full-precision prefill; the magnitudes stay in the cache dtype and the slots in int32.
Tokens appended after the merge (decoding) are held per layer in one more such store, coded as the quantizer codes
any layer's decode tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kveval.lazy import torch
from kveval.stores.base import DenseStore, TokenStore, tensor_nbytes

#: Below this ``sin(omega)`` the SLERP weights are those of the linear interpolation (the directions agree).
_PARALLEL = 1e-6


def slerp_merge(x: "torch.Tensor", y: "torch.Tensor", t: float):
    """Merge ``x`` (layer ``l-1``) and ``y`` (layer ``l``), ``[H, n, D]`` each, in float32: returns the merged unit
    directions ``e`` (``[H, n, D]``), the magnitudes ``||x||`` and ``||y||`` (``[H, n]``) and the angular distance
    ``omega / pi`` in [0, 1] (``[H, n]``). A zero vector's direction is taken as zero (its magnitude restores it)."""
    x, y = x.float(), y.float()
    nx, ny = x.norm(dim=-1), y.norm(dim=-1)
    u = x / nx.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    w = y / ny.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    omega = torch.arccos((u * w).sum(dim=-1).clamp(-1.0, 1.0))
    sin = torch.sin(omega)
    parallel = sin < _PARALLEL
    safe = torch.where(parallel, torch.ones_like(sin), sin)
    a = torch.where(parallel, torch.full_like(sin, 1 - t), torch.sin((1 - t) * omega) / safe)
    b = torch.where(parallel, torch.full_like(sin, t), torch.sin(t * omega) / safe)
    return a.unsqueeze(-1) * u + b.unsqueeze(-1) * w, nx, ny, omega / torch.pi


@dataclass
class MergedStream:
    """One layer's part of one of K/V for a merged pair: the pair's ``directions`` (``[H, n - r, D]``) and retained
    ``slots`` (``[H, r]`` int32, increasing), this layer's ``magnitudes`` of the merged tokens (``[H, n - r]``) and
    its ``retained`` tokens (``[H, r, D]``); ``owns_shared``: whether this layer's bytes count the shared tensors."""

    directions: "torch.Tensor"
    magnitudes: "torch.Tensor"
    slots: "torch.Tensor"
    retained: "torch.Tensor"
    owns_shared: bool

    def restored(self, dtype) -> "torch.Tensor":
        """``[H, n, D]``: magnitude times direction at the merged slots, the layer's own token at the retained ones."""
        heads, merged, dim = self.directions.shape
        n = merged + self.slots.shape[1]
        out = torch.empty(heads, n, dim, dtype=torch.float32, device=self.directions.device)
        apart = torch.zeros(heads, n, dtype=torch.bool, device=out.device)
        apart.scatter_(1, self.slots.long(), True)
        out[~apart] = (self.directions.float() * self.magnitudes.float().unsqueeze(-1)).reshape(-1, dim)
        out[apart] = self.retained.float().reshape(-1, dim)
        return out.to(dtype)

    @property
    def nbytes(self) -> int:
        own = tensor_nbytes(self.magnitudes) + tensor_nbytes(self.retained)
        return own + (tensor_nbytes(self.directions) + tensor_nbytes(self.slots) if self.owns_shared else 0)


def merge_streams(x: "torch.Tensor", y: "torch.Tensor", t: float, r: int,
                  kv_dtype) -> "tuple[MergedStream, MergedStream]":
    """Layer ``l-1``'s and layer ``l``'s parts of one of K/V (``x``, ``y``: ``[H, n, D]``): the ``r`` tokens of
    largest angular distance per head kept apart (ties: the earlier token), the others merged; held in ``kv_dtype``."""
    e, nx, ny, distance = slerp_merge(x, y, t)
    heads, n, dim = x.shape
    slots = distance.sort(dim=1, descending=True, stable=True).indices[:, :r].sort(dim=1).values
    apart = torch.zeros(heads, n, dtype=torch.bool, device=x.device)
    apart.scatter_(1, slots, True)
    merged = ~apart

    def kept(z: "torch.Tensor", mask: "torch.Tensor", width: int) -> "torch.Tensor":
        return z[mask].reshape(heads, -1, width) if width else z[mask].reshape(heads, -1)

    directions = kept(e, merged, dim).to(kv_dtype)
    slots = slots.to(torch.int32)
    first = MergedStream(directions, kept(nx, merged, 0).to(kv_dtype), slots, kept(x, apart, dim).to(kv_dtype), True)
    second = MergedStream(directions, kept(ny, merged, 0).to(kv_dtype), slots, kept(y, apart, dim).to(kv_dtype), False)
    return first, second


def coded_tokens(coded: "Callable[[torch.dtype], TokenStore]", keys: "torch.Tensor", values: "torch.Tensor",
                 compute_dtype) -> TokenStore:
    """``keys`` and ``values`` (``[H, n, D]`` each) in a new store of ``coded(compute_dtype)``, sealed: coded as that
    store codes a prefill's tokens."""
    store = coded(compute_dtype)
    store.append(keys, values)
    store.seal()
    return store


def _restored(directions: "torch.Tensor", stream: MergedStream, retained: "torch.Tensor", dtype) -> "torch.Tensor":
    """``[H, n, D]``: :meth:`MergedStream.restored` with its directions and retained tokens as read back from their
    (coded) stores."""
    return MergedStream(directions, stream.magnitudes, stream.slots, retained, stream.owns_shared).restored(dtype)


class MergedStore(TokenStore):
    """One layer's tokens after MiniCache's merge: its prefill as K and V :class:`MergedStream` (magnitudes and slots;
    the directions, shared by the pair, and this layer's retained tokens each in a store of ``coded``), then a tail
    of ``coded`` holding the tokens appended since. Row by row (no batched decode); no selection acts on it (those
    that would are refused at the spec)."""

    def __init__(self, keys: MergedStream, values: MergedStream, directions: TokenStore,
                 coded: "Callable[[torch.dtype], TokenStore]", kv_dtype, compute_dtype):
        self.k, self.v, self.kv_dtype, self.compute_dtype = keys, values, kv_dtype, compute_dtype
        self.directions = directions  # the pair's, counted in the earlier layer (keys.owns_shared)
        self.retained = coded_tokens(coded, keys.retained, values.retained, compute_dtype)
        self.merged_length = keys.directions.shape[1] + keys.slots.shape[1]
        self.tail = coded(compute_dtype)
        # held in their stores alone: the raw tensors are dropped
        for stream in (keys, values):
            stream.directions = stream.retained = None

    @property
    def length(self) -> int:
        return self.merged_length + self.tail.length

    def append(self, keys: "torch.Tensor", values: "torch.Tensor") -> None:
        self.tail.append(keys, values)

    def select(self, index: "torch.Tensor") -> None:
        raise TypeError("MiniCache's merged tokens are held for two layers at once; no selection acts on them")

    def seal(self) -> None:
        """The tail's tokens that are due are coded (as the quantizer's store codes them)."""
        self.tail.seal()

    def keys_values(self) -> "tuple[torch.Tensor, torch.Tensor]":
        directions, retained = self.directions.keys_values(), self.retained.keys_values()
        keys, values = (_restored(d, stream, r, self.compute_dtype)
                        for d, stream, r in zip(directions, (self.k, self.v), retained))
        if self.tail.length:
            tail_keys, tail_values = self.tail.keys_values()
            keys, values = torch.cat([keys, tail_keys], dim=1), torch.cat([values, tail_values], dim=1)
        return keys, values

    @property
    def nbytes(self) -> int:
        own = sum(tensor_nbytes(stream.magnitudes) for stream in (self.k, self.v)) + self.retained.nbytes + self.tail.nbytes
        shared = sum(tensor_nbytes(stream.slots) for stream in (self.k, self.v)) + self.directions.nbytes
        return own + (shared if self.k.owns_shared else 0)


def merge_stores(first: TokenStore, second: TokenStore, t: float, retained: int,
                 coded: "Callable[[torch.dtype], TokenStore] | None" = None) -> "tuple[MergedStore, MergedStore]":
    """Two adjacent layers' stores of one sequence (layer ``l-1``'s, layer ``l``'s), holding the same tokens in full
    precision (not yet coded), as the two :class:`MergedStore` that replace them, ``retained`` tokens per head and per
    K/V kept apart; ``coded(compute_dtype)`` makes an empty store coded as the stack's quantizer codes K/V (``None``:
    a :class:`~kveval.stores.base.DenseStore` in the cache dtype)."""
    kx, vx = first.keys_values()
    ky, vy = second.keys_values()
    kv_dtype, compute = first.kv_dtype or kx.dtype, kx.dtype
    coded = coded or (lambda dtype: DenseStore(kv_dtype, dtype))
    k1, k2 = merge_streams(kx, ky, t, retained, kv_dtype)
    v1, v2 = merge_streams(vx, vy, t, retained, kv_dtype)
    directions = coded_tokens(coded, k1.directions, v1.directions, compute)
    return (MergedStore(k1, v1, directions, coded, kv_dtype, compute),
            MergedStore(k2, v2, directions, coded, kv_dtype, compute))


__all__ = ["MergedStore", "MergedStream", "coded_tokens", "merge_stores", "merge_streams", "slerp_merge"]
