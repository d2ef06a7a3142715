"""Token stores: how one sequence's K/V are held in one layer.

A store holds ``[kv_heads, tokens, head_dim]`` keys and values for one
sequence. Every store offers the same operations, so selection, structure and
quantization compose: ``LowRankStore(inner=QuantizedStore(...))`` quantizes
low-rank coefficients.

``nbytes`` counts the tensors the store really holds (packed codes, scales,
zero points, full-precision residual tokens); nothing is simulated.
"""

from __future__ import annotations

import torch

from kveval.quantization import QuantizedBlock, dequantize, quantize, quantize_fp8


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[h, index[h, j], :]`` for ``x`` of shape ``[H, T, D]`` and ``index`` of shape ``[H, T']``."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


class DenseStore:
    """Keys and values in the model's dtype (the uncompressed representation)."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=1)
            self.values = torch.cat([self.values, values], dim=1)

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def select(self, index: torch.Tensor) -> None:
        self.keys, self.values = gather_tokens(self.keys, index), gather_tokens(self.values, index)

    def seal(self) -> None:
        """Nothing to encode: dense tokens stay as they are."""

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)


class QuantizedSequence:
    """One of K or V: quantized blocks of older tokens plus a full-precision tail.

    ``seal`` quantizes the tokens that have aged out of the ``residual`` most
    recent ones: all of them for per-token groups, whole groups of ``group``
    tokens for per-channel groups (the remainder waits in the tail).
    """

    def __init__(self, quant, residual: int, dtype: torch.dtype):
        self.quant, self.residual, self.dtype = quant, residual, dtype
        self.blocks: list[QuantizedBlock] = []
        self.tail: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return sum(b.tokens for b in self.blocks) + (0 if self.tail is None else self.tail.shape[1])

    def append(self, x: torch.Tensor) -> None:
        self.tail = x if self.tail is None else torch.cat([self.tail, x], dim=1)

    def seal(self) -> None:
        if self.tail is None:
            return
        aged = self.tail.shape[1] - self.residual
        if self.quant.axis == "channel":
            aged = (aged // self.quant.group) * self.quant.group
        if aged <= 0:
            return
        old, self.tail = self.tail[:, :aged], self.tail[:, aged:]
        q = self.quant
        if q.fp8 is not None:
            self.blocks.append(quantize_fp8(old, q.fp8, q.axis, q.group))
        else:
            self.blocks.append(quantize(old, q.bits, q.axis, q.group, q.symmetric))

    def materialize(self) -> torch.Tensor:
        parts = [dequantize(b, self.dtype) for b in self.blocks]
        if self.tail is not None:
            parts.append(self.tail)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def select(self, index: torch.Tensor) -> None:
        # Token groups of per-channel blocks span evicted tokens: rebuild from the kept values, re-quantized at the next seal.
        self.tail, self.blocks = gather_tokens(self.materialize(), index), []

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks) + _nbytes(self.tail)


class QuantizedStore:
    """Keys and values each in a :class:`QuantizedSequence` (K and V may differ in bits, axis, group)."""

    def __init__(self, key_quant, value_quant, residual: int, dtype: torch.dtype):
        self.k = QuantizedSequence(key_quant, residual, dtype)
        self.v = QuantizedSequence(value_quant, residual, dtype)

    @property
    def length(self) -> int:
        return self.k.length

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.k.append(keys)
        self.v.append(values)

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.materialize(), self.v.materialize()

    def select(self, index: torch.Tensor) -> None:
        self.k.select(index)
        self.v.select(index)

    def seal(self) -> None:
        self.k.seal()
        self.v.seal()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
