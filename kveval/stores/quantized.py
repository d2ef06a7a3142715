"""The quantized store: K and V each held as coded blocks plus a full-precision tail (:class:`QuantizedSequence`),
per sequence and layer (:class:`QuantizedStore`), and a part of keys alone (:class:`KeysOnlySequence`).

The codes, scales and zero points are the bytes a deployment holds (:mod:`kveval.tensors.quantization`);
``nbytes`` counts them as stored. The interface these implement is :class:`kveval.stores.base.TokenStore`.
"""

from __future__ import annotations

import torch

from kveval.stores.base import BatchFamily, TokenStore, alive_order, alive_slots, gather_tokens, tensor_nbytes
from kveval.tensors.quantization import (
    QuantizedBlock,
    concat_blocks,
    dequantize,
    gather_units,
    mx_global_scale,
    quantize,
    quantize_fp8,
    quantize_mx,
    split_units,
    units_from,
)


def encode(quant, x: torch.Tensor, valid: torch.Tensor | None = None,
           global_scale: torch.Tensor | None = None) -> QuantizedBlock:
    """``x`` (``[H, T, D]`` in ``kv_dtype``) encoded as ``quant`` (a :class:`~kveval.tensors.quantization.TensorQuant`) says
    (``global_scale``: the per-tensor scale of a block-scaled format that has one, NVFP4's)."""
    if quant.mx is not None:
        return quantize_mx(x, quant.mx, quant.axis, quant.group, valid, global_scale)
    if quant.fp8 is not None:
        return quantize_fp8(x, quant.fp8, quant.axis, quant.group, valid)
    return quantize(x, quant.bits, quant.axis, quant.group, quant.symmetric, valid)


class KeysOnlySequence:
    """One row of a part of keys alone (``[1, n, width]`` each call: DeepSeek V3.2's indexer keys, V4's compressed
    entries) held in a :class:`TokenStore` as keys with values of width 0, with the sequence interface of
    :class:`QuantizedSequence` (what :class:`~kveval.cache.native_layers.PartSequence` holds). Subclasses build the
    store; :meth:`seal` is the store's."""

    def __init__(self, store: "TokenStore"):
        self.store = store

    @property
    def length(self) -> int:
        return self.store.length

    def append(self, x: torch.Tensor) -> None:
        self.store.append(x, x[..., :0])

    def seal(self) -> None:
        self.store.seal()

    def select(self, index: torch.Tensor) -> None:
        self.store.select(index)

    def materialize(self) -> torch.Tensor:
        return self.store.keys_values()[0]

    @property
    def nbytes(self) -> int:
        return self.store.nbytes


class QuantizedSequence:
    """One of K or V: quantized units of older tokens plus a full-precision tail in ``kv_dtype``.

    ``seal`` quantizes the slots that have aged out of the ``residual`` most
    recent ones: all of them for per-token groups, whole groups of ``group``
    slots for per-channel groups (the remainder waits in the tail). Each token
    is encoded once, from full precision.

    Eviction (:meth:`select`) never re-encodes. Slots are marked dead in
    ``alive`` (``[H, slots]``, ``None`` when all are alive); a unit (a token, or
    a per-channel group) is dropped once it is dead in its head, and heads keep
    their own units, gathered as stored (codes, scales and zero points). Since
    the stored tensors are rectangular over heads, a head that holds fewer live
    units than another keeps dead ones as padding; a per-channel group with a
    single live slot keeps all its bytes. ``nbytes`` counts all of that: it is
    what such a layout really holds.

    A block-scaled format with a per-tensor scale (NVFP4's FP32 second level) fixes it at the first seal that finds
    tokens held, from their largest magnitude (the prefill's K or V of the layer, the residual window included:
    :func:`~kveval.tensors.quantization.mx_global_scale`), and codes every later token against it (a larger value
    saturates its block's E4M3 scale at 448, then E2M1's 6). Its 4 bytes count in :attr:`nbytes` from then on.
    """

    def __init__(self, quant, residual: int, kv_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None):
        self.quant, self.residual = quant, residual
        self.global_scale: torch.Tensor | None = None  # a block-scaled format's per-tensor scale, fixed at the first seal
        self.kv_dtype, self.compute_dtype = kv_dtype, compute_dtype
        self.block: QuantizedBlock | None = None
        self.alive: torch.Tensor | None = None  # [H, block slots]
        self.tail: torch.Tensor | None = None  # [H, R, D] in kv_dtype
        self.tail_alive: torch.Tensor | None = None  # [H, R]
        self.count = 0  # live tokens per head
        self.read = 0  # leading live slots unchanged since mark_read (see TokenStore.changed_from)

    @property
    def unit(self) -> int:
        return 1 if self.quant.axis == "token" else self.quant.group

    @property
    def sealed_slots(self) -> int:
        return 0 if self.block is None else self.block.tokens

    @property
    def tail_slots(self) -> int:
        return 0 if self.tail is None else self.tail.shape[1]

    def _alive_all(self) -> torch.Tensor | None:
        """``[H, sealed + tail slots]`` liveness, ``None`` when every slot is alive."""
        if self.alive is None and self.tail_alive is None:
            return None
        heads, device = self._heads_device()
        parts = [a if a is not None else torch.ones(heads, n, dtype=torch.bool, device=device)
                 for a, n in ((self.alive, self.sealed_slots), (self.tail_alive, self.tail_slots))]
        return torch.cat(parts, dim=1)

    def _heads_device(self) -> tuple[int, torch.device]:
        """The heads and device of what is held (the block's, else the tail's)."""
        if self.block is not None:
            return self.block.shape[0], self.block.scale.device
        return self.tail.shape[0], self.tail.device

    @property
    def length(self) -> int:
        return self.count

    def append(self, x: torch.Tensor) -> None:
        if self.compute_dtype is None:
            self.compute_dtype = x.dtype
        if self.kv_dtype is not None:
            x = x.to(self.kv_dtype)
        self.tail = x if self.tail is None else torch.cat([self.tail, x], dim=1)
        self.count += x.shape[1]
        if self.tail_alive is not None:
            self.tail_alive = torch.cat([self.tail_alive, self.tail_alive.new_ones(x.shape[0], x.shape[1])], dim=1)

    @property
    def scaled_per_tensor(self) -> bool:
        """Whether the coding has a per-tensor scale fixed from this sequence's first tokens (NVFP4's): its codes then
        depend on the sequence's own tokens beyond each block, and it is sealed apart from other rows."""
        return self.quant.global_scale_bytes > 0

    def _fix_global_scale(self) -> None:
        """At the first seal that finds tokens held: the per-tensor scale from their largest magnitude."""
        if self.scaled_per_tensor and self.global_scale is None and self.tail is not None and self.tail.numel():
            self.global_scale = mx_global_scale(self.quant.mx, self.tail, self.tail_alive)

    def seal(self) -> None:
        self._fix_global_scale()
        due = self._take_aged()
        if due is not None:
            self._hold_encoded(encode(self.quant, *due, self.global_scale), due[1])

    @staticmethod
    def seal_many(sequences: "list[QuantizedSequence]") -> None:
        """:meth:`seal` each of ``sequences`` (one layer's rows, K or V), with one encoding for the aged slots of
        those that evicted none, side by side: a group (of tokens, or of ``group`` tokens per channel) never spans
        two sequences, since each one's aged slots are whole units, and min, max, rounding and division are exact,
        so each gets the bits of its own encoding."""
        together: dict[tuple, list] = {}
        for sequence in sequences:
            if sequence.scaled_per_tensor:  # its own per-tensor scale: sealed alone
                sequence.seal()
                continue
            due = sequence._take_aged()
            if due is None:
                continue
            old, valid = due
            if valid is not None:  # evicted slots inside its units: encoded alone
                sequence._hold_encoded(encode(sequence.quant, old, valid), valid)
            else:
                together.setdefault((sequence.quant, old.dtype, old.shape[0], old.shape[2]), []).append((sequence, old))
        for (quant, *_), group in together.items():
            olds = [old for _, old in group]
            encoded = encode(quant, torch.cat(olds, dim=1) if len(olds) > 1 else olds[0])
            blocks = split_units(encoded, [old.shape[1] // sequence.unit for sequence, old in group]) if len(olds) > 1 else [encoded]
            for (sequence, _), block in zip(group, blocks):
                sequence._hold_encoded(block, None)

    def _take_aged(self) -> "tuple[torch.Tensor, torch.Tensor | None] | None":
        """Take the slots that left the residual window, whole units, out of the tail: ``(tokens, valid)``
        (``valid``: which of them are alive, ``None`` for all), or ``None`` when there are none."""
        if self.tail is None:
            return None
        aged = self.tail.shape[1] - self.residual
        aged = (aged // self.unit) * self.unit
        if aged <= 0:
            return None
        # The aged slots now read back dequantized. With every slot alive they follow the block's tokens; otherwise
        # where they stand among the live slots is not worth working out: everything counts as changed.
        plain = self.alive is None and self.tail_alive is None
        self.read = min(self.read, self.sealed_slots) if plain else 0
        old, self.tail = self.tail[:, :aged], self.tail[:, aged:]
        valid = None
        if self.tail_alive is not None:
            valid, self.tail_alive = self.tail_alive[:, :aged], self.tail_alive[:, aged:]
        return old, valid

    def _hold_encoded(self, new: QuantizedBlock, valid: "torch.Tensor | None") -> None:
        """Append ``new``, the encoding of the slots :meth:`_take_aged` took (``valid``: which were alive)."""
        if self.alive is not None or valid is not None:
            def everyone(slots: int) -> torch.Tensor:
                return torch.ones(new.shape[0], slots, dtype=torch.bool, device=new.scale.device)

            self.alive = torch.cat([self.alive if self.alive is not None else everyone(self.sealed_slots),
                                    valid if valid is not None else everyone(new.tokens)], dim=1)
        self.block = concat_blocks(self.block, new)
        self._compact()

    def materialize(self, start: int = 0) -> torch.Tensor:
        """The held tokens from live slot ``start`` on, ``[H, length - start, D]``, in the compute dtype.

        With every slot alive only the units holding slots ``start`` onwards are dequantized.
        """
        alive = self._alive_all()
        skip = 0  # slots of `everything` before `start`
        block = self.block
        if alive is None and block is not None and start:
            first_unit = min(start, block.tokens) // block.unit
            block = units_from(block, first_unit) if first_unit < block.units else None
            skip = first_unit * self.unit
        parts = [] if block is None else [dequantize(block, self.compute_dtype)]
        if self.tail is not None:
            parts.append(self.tail.to(self.compute_dtype))
        if not parts:
            heads, dim = self.block.shape[0], self.block.shape[2]
            return torch.empty(heads, 0, dim, dtype=self.compute_dtype, device=self.block.scale.device)
        everything = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if alive is None:
            return everything[:, start - skip:]
        live = everything[alive].reshape(everything.shape[0], -1, everything.shape[2])  # every head: `length` live slots
        return live[:, start:]

    def select(self, index: torch.Tensor) -> None:
        alive = self._alive_all()
        if alive is None:
            alive = torch.ones(index.shape[0], self.sealed_slots + self.tail_slots, dtype=torch.bool, device=index.device)
        slots = alive_slots(alive).gather(1, index)
        kept = torch.zeros_like(alive).scatter_(1, slots, True)
        self.alive, self.tail_alive = kept[:, :self.sealed_slots], kept[:, self.sealed_slots:]
        self.count = index.shape[1]
        self.read = 0
        self._compact()

    def keep_last(self, count: int) -> None:
        """:meth:`select` of each head's last ``count`` tokens, the same units, alive slots and tail, with no
        device read where every slot is alive: the units before the first kept token are dropped (a per-channel
        group cut by it stays, its earlier slots dead), then the tail's slots before it."""
        heads, device = self._heads_device()
        if self.alive is not None or self.tail_alive is not None:
            self.select(torch.arange(self.count - count, self.count, device=device).expand(heads, -1))
            return
        drop, sealed = self.count - count, self.sealed_slots
        if drop >= sealed:
            self.block = None
            if drop > sealed:  # a copy, as select's gather makes: the dropped slots are freed
                self.tail = self.tail[:, drop - sealed:].clone(memory_format=torch.contiguous_format)
        elif drop:
            first, cut = divmod(drop, self.unit)
            if first:  # the units select keeps, gathered as it gathers them (an index made, nothing read)
                units = torch.arange(first, self.block.units, device=device).expand(heads, -1)
                self.block = gather_units(self.block, units)
            if cut:
                self.alive = torch.ones(heads, self.sealed_slots, dtype=torch.bool, device=device)
                self.alive[:, :cut] = False
        self.count, self.read = count, 0

    def _compact(self) -> None:
        """Drop units dead in their head (gathering each head's live units first) and tail slots likewise."""
        if self.alive is not None:
            heads, unit = self.alive.shape[0], self.unit
            live_units = self.alive.reshape(heads, -1, unit).any(dim=-1)
            keep = int(live_units.sum(dim=1).max())
            if keep < live_units.shape[1]:
                order = alive_order(live_units, keep)
                self.block = gather_units(self.block, order) if keep else None
                self.alive = self.alive.reshape(heads, -1, unit).gather(1, order[..., None].expand(-1, -1, unit)).reshape(heads, -1)
            if bool(self.alive.all()):
                self.alive = None
        if self.tail_alive is not None:
            keep = int(self.tail_alive.sum(dim=1).max())
            if keep < self.tail_alive.shape[1]:
                order = alive_order(self.tail_alive, keep)
                self.tail, self.tail_alive = gather_tokens(self.tail, order), self.tail_alive.gather(1, order)
            if bool(self.tail_alive.all()):
                self.tail_alive = None

    @property
    def nbytes(self) -> int:
        scales = 0 if self.global_scale is None else self.quant.global_scale_bytes
        return (0 if self.block is None else self.block.nbytes) + tensor_nbytes(self.tail) + scales


class QuantizedStore(TokenStore):
    """Keys and values each in a :class:`QuantizedSequence` (K and V may differ in bits, axis, group)."""

    batch_family = BatchFamily.QUANTIZED

    def __init__(self, key_quant, value_quant, residual: int, kv_dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype | None = None):
        self.kv_dtype = kv_dtype
        self.k = QuantizedSequence(key_quant, residual, kv_dtype, compute_dtype)
        self.v = QuantizedSequence(value_quant, residual, kv_dtype, compute_dtype)
        if self.k.scaled_per_tensor or self.v.scaled_per_tensor:
            # A per-tensor scale of each row's own (NVFP4's): the batched decode, which codes a layer's rows as one
            # tensor, has none per row; such rows decode one by one, with the bits each gets alone.
            self.batch_family = BatchFamily.NONE

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.k.compute_dtype

    @property
    def length(self) -> int:
        return self.k.length

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.k.append(keys)
        self.v.append(values)

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.materialize(), self.v.materialize()

    def changed_from(self) -> int:
        return min(self.k.read, self.v.read)

    def mark_read(self) -> None:
        self.k.read = self.v.read = self.length

    def keys_values_from(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.materialize(start), self.v.materialize(start)

    def select(self, index: torch.Tensor) -> None:
        self.k.select(index)
        self.v.select(index)

    def keep_last(self, index: torch.Tensor) -> None:
        """``index`` must be each head's last ``index.shape[1]`` slots (the contract of
        :meth:`TokenStore.keep_last`): only its width is read."""
        self.k.keep_last(index.shape[1])
        self.v.keep_last(index.shape[1])

    @classmethod
    def seal_all(cls, stores: "list[QuantizedStore]") -> None:
        """Seal one layer's rows: their keys' aged slots encoded together, then their values' (:meth:`QuantizedSequence.seal_many`)."""
        QuantizedSequence.seal_many([store.k for store in stores])
        QuantizedSequence.seal_many([store.v for store in stores])

    def seal(self) -> None:
        self.k.seal()
        self.v.seal()

    def every_slot_alive(self) -> bool:
        return all(side.alive is None and side.tail_alive is None for side in (self.k, self.v))

    def residual_intact(self) -> bool:
        return self.k.tail_alive is None and self.v.tail_alive is None

    def encodes_on_arrival(self) -> bool:
        return all(side.unit == 1 and side.residual == 0 and side.tail_alive is None for side in (self.k, self.v))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
