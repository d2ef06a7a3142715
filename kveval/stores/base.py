"""Token stores: how one sequence's K/V are held in one layer.

A store holds ``[kv_heads, tokens, head_dim]`` keys and values for one
sequence. Every store implements :class:`TokenStore`, so selection, structure
and quantization compose: ``LowRankStore(inner=QuantizedStore(...))`` quantizes
low-rank coefficients. This module holds the interface and the dense store; the quantized store is
:mod:`kveval.stores.quantized`.

Two dtypes
----------
``kv_dtype`` is the dtype a deployment's cache holds (bfloat16 or float16 in
practice, see :func:`kveval.dtypes.deployment_kv_dtype`): every full-precision token a store
keeps (dense tokens, the residual window of a quantized store, low-rank
coefficients) is stored in it, on every device. ``compute_dtype`` is the dtype
the model computes in (float32 on a CPU); ``keys_values`` hands K/V to
attention in it. With ``kv_dtype == compute_dtype`` nothing is converted.

``nbytes`` counts the tensors the store really holds (packed codes, scales,
zero points, full-precision tokens); nothing is simulated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import ClassVar

import torch


def tensor_nbytes(t: torch.Tensor | None) -> int:
    """Bytes ``t`` holds (0 for ``None``)."""
    return 0 if t is None else t.numel() * t.element_size()


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[h, index[h, j], :]`` for ``x`` of shape ``[H, T, D]`` and ``index`` of shape ``[H, T']``."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def alive_order(alive: torch.Tensor, count: int) -> torch.Tensor:
    """``[H, count]``: per head, the indices of the first ``count`` True slots of ``alive`` (``[H, S]``), in order,
    followed by False slots when a head has fewer."""
    return torch.argsort((~alive).to(torch.int8), dim=1, stable=True)[:, :count]


def alive_slots(alive: torch.Tensor) -> torch.Tensor:
    """``[H, n]``: per head, the indices of the True slots of ``alive``, in order; every head must have ``n``."""
    return alive.nonzero()[:, 1].reshape(alive.shape[0], -1)


class BatchFamily(Enum):
    """Which batched decode step (:mod:`kveval.cache.buffered_decode`) may update a layer's rows holding a store, with
    the bits each row's own store would give: the representation whose tensor ops the batch repeats for every row,
    and so what the batch reads of such a store (named per member). A store of another representation keeps the
    default, :attr:`NONE`: its rows decode one by one, correctly, with nothing in the cache to edit."""

    NONE = "none"  #: row by row
    DENSE = "dense"  #: tokens held as they came, in ``kv_dtype`` (``keys``, ``values``; :meth:`TokenStore.load_buffer_row`)
    QUANTIZED = "quantized"  #: K and V each a :class:`~kveval.stores.quantized.QuantizedSequence`, ``k`` and ``v``
    KVQUANT = "kvquant"  #: one calibrated codec: ``codec``, ``sink``, ``residual``, the tail's slots ``tail.slots``
    #: coefficients on bases shared by the rows (:meth:`TokenStore.same_code`): ``inners``, ``unsealed``, ``encode``, ``decode``
    COEFFICIENTS = "coefficients"
    PER_HEAD = "per-head"  #: one inner store per KV head, ``heads``, each of a family of its own


class TokenStore(ABC):
    """One sequence's keys and values in one layer, ``[kv_heads, tokens, head_dim]``.

    Tokens arrive in the compute dtype through :meth:`append` and stay as they
    are until :meth:`seal` encodes the ones the store's representation encodes
    (the cache seals after the prefill's attention and after every later
    append). Every head holds the same number of tokens, :attr:`length`, unless
    the store says its heads hold their own (:attr:`ragged_heads`).

    The cache never asks which class a store is: what it needs to know, each
    store answers (the methods and attributes below the abstract ones, with
    defaults that suit a store that only implements the abstract ones).
    """

    #: The dtype full-precision tokens are held in (``None``: as they arrive).
    kv_dtype: "torch.dtype | None" = None
    #: The batched decode that may update rows of this store (:class:`BatchFamily`); the default decodes row by row.
    batch_family: ClassVar[BatchFamily] = BatchFamily.NONE
    #: Whether :meth:`append` keeps tensors of its own whatever it is given (a contiguous copy where a view is not
    #: one), so the cache may hand it views of a whole batch's tensor; else the cache copies a view first.
    copies_on_append: ClassVar[bool] = False
    #: Whether KV heads may hold different numbers of tokens (per-head budgets): :meth:`keys_values` then shows
    #: each head's tokens right-aligned after padding, and :meth:`select_heads` keeps a count per head.
    ragged_heads: ClassVar[bool] = False

    @property
    @abstractmethod
    def length(self) -> int:
        """Tokens held per KV head."""

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``[H, T, D]`` tokens after those held."""

    @abstractmethod
    def select(self, index: torch.Tensor) -> None:
        """Keep tokens ``index[h, j]`` of head ``h`` (``[H, T']``, increasing in ``j``); never re-encodes kept tokens."""

    def keep_last(self, index: torch.Tensor) -> None:
        """Keep slots ``index``, ``[H, count]``: each head's last ``count`` tokens (a sliding window's trim). This
        default is :meth:`select`; a store that knows it keeps a suffix may do it without reading the device."""
        self.select(index)

    @abstractmethod
    def seal(self) -> None:
        """Encode the tokens that are due (quantize what left the residual window, project onto a basis)."""

    @classmethod
    def seal_all(cls, stores: "list[TokenStore]") -> None:
        """Seal every store of ``stores`` (one layer's rows, all of this class). This default seals them one by
        one; a store whose encoding is per token overrides it to encode the batch's due tokens at once, with the
        same result bit for bit."""
        for store in stores:
            store.seal()

    @abstractmethod
    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held tokens as attention sees them, ``[H, length, D]`` each, in the compute dtype."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of every tensor the store holds for its tokens."""

    # --- incremental reads (the cache layer's batch buffer, kveval.tensors.batch_buffer) ------------------
    def changed_from(self) -> int:
        """The first slot whose value, as :meth:`keys_values` shows it, may differ from what it showed at the last
        :meth:`mark_read` (slots appended since count as changed). This default says every slot: a store that does
        not track its changes is read whole each time."""
        return 0

    def mark_read(self) -> None:
        """The reader now holds every slot as :meth:`keys_values` shows it."""

    def keys_values_from(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``start`` onwards of :meth:`keys_values`, ``[H, length - start, D]`` each."""
        keys, values = self.keys_values()
        return keys[:, start:], values[:, start:]

    # --- what the cache asks of a store (defaults: a store that only implements the abstract methods) ---------
    @property
    def head_groups(self) -> int:
        """How many consecutive KV heads keep one set of tokens (a latent shared by a group): a selection's scores
        are averaged over each group so that its heads pick the same tokens."""
        return 1

    def kept_tokens(self) -> int:
        """Tokens held per KV head, as measured (the rounded mean over heads where they hold their own counts)."""
        return self.length

    def place_positions(self, positions: torch.Tensor) -> None:
        """Before a seal: the original position of every held token (``[H, length]``, in held order), which only the
        cache knows (sliding trims, shared prefills). A store that encodes by position keeps them; this default
        needs none."""

    def select_heads(self, index: "list[torch.Tensor]") -> None:
        """Keep, in head ``h``, the slots ``index[h]`` (increasing; the heads' counts may differ): only a store whose
        heads hold their own counts (:attr:`ragged_heads`) can."""
        raise TypeError(f"{type(self).__name__} holds the same tokens count in every head; "
                        "per-head budgets need the layer's HeadwiseStore")

    def holds_dense(self) -> bool:
        """Whether every token is held as it came, in ``kv_dtype`` (per head or not), so that the store can take a
        batch buffer's row as it stands (:meth:`load_buffer_row`)."""
        return False

    def load_buffer_row(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Hold exactly a batch buffer's row: ``keys``/``values`` ``[H, n, D]`` in ``kv_dtype`` and their positions
        ``[H, n]`` (padding slots, before a head's own tokens, at the padding position). Only a store that
        :meth:`holds_dense` can."""
        raise TypeError(f"{type(self).__name__} does not hold its tokens as they came; it cannot load a buffer's row")

    def share_batch_row(self, keys: torch.Tensor, values: torch.Tensor, b: int, grown: bool) -> None:
        """Where the store holds its tokens as the batch buffer holds them (``keys``/``values`` ``[B, H, slots, D]``,
        its row ``b``, in ``kv_dtype``), hold views of that row rather than a copy (``grown``: the buffer's tensors
        were reallocated), so the cache is held once. This default keeps its own tensors."""

    def every_slot_alive(self) -> bool:
        """Whether no slot the store holds is dead (an evicted token kept as padding inside an encoded unit, or among
        the unencoded tokens): a batched decode can then encode and read its tokens as one block."""
        return True

    def residual_intact(self) -> bool:
        """Whether none of the tokens waiting to be encoded (a residual window) was evicted: a batched decode can
        then age them as the store would."""
        return True

    def encodes_on_arrival(self) -> bool:
        """Whether each token is encoded alone as soon as it is sealed (per-token groups, no residual window), so an
        eviction of any tokens drops whole encoded ones."""
        return False

    def same_code(self, other: "TokenStore") -> bool:
        """Whether ``other`` encodes and decodes as this store does (one codec, one set of bases): a batch of such
        rows may be encoded by one of them. This default says no."""
        return False


def seal_together(stores: "list[TokenStore]") -> None:
    """Seal every store of ``stores`` (one layer's rows): those of one class together, by its :meth:`TokenStore.seal_all`."""
    by_class: dict[type, list[TokenStore]] = {}
    for store in stores:
        by_class.setdefault(type(store), []).append(store)
    for cls, group in by_class.items():
        cls.seal_all(group)


class DenseStore(TokenStore):
    """Keys and values held as they are, in ``kv_dtype`` (the uncompressed representation).

    ``kv_dtype=None`` stores tokens in the dtype they arrive in; ``compute_dtype=None``
    hands them back in that dtype too.
    """

    batch_family = BatchFamily.DENSE
    copies_on_append = True  # append converts to a contiguous kv_dtype tensor: a copy wherever a view is not one

    def __init__(self, kv_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None):
        self.kv_dtype, self.compute_dtype = kv_dtype, compute_dtype
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._read = 0  # leading slots unchanged since mark_read (appends never change held slots)

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.compute_dtype is None:
            self.compute_dtype = keys.dtype
        # Contiguous, in kv_dtype: one copy at most (none for a contiguous tensor already in it).
        keys, values = (x.to(self.kv_dtype or x.dtype, memory_format=torch.contiguous_format) for x in (keys, values))
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=1)
            self.values = torch.cat([self.values, values], dim=1)

    def hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly ``keys`` and ``values`` (``[H, T, D]``, already in ``kv_dtype``; views are kept as views),
        in place of any tokens held, all of them read (a batch buffer holds them: see :class:`~kveval.tensors.batch_buffer.BatchBuffer`)."""
        self.keys, self.values = keys, values
        self.mark_read()

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            return self.keys, self.values
        return self.keys.to(self.compute_dtype), self.values.to(self.compute_dtype)

    def select(self, index: torch.Tensor) -> None:
        self.keys, self.values = gather_tokens(self.keys, index), gather_tokens(self.values, index)
        self._read = 0

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly ``keys`` and ``values`` (``[H, T, D]``, stored in ``kv_dtype``; no copy when already in it)."""
        self.keys, self.values, self._read = None, None, 0
        self.append(keys, values)

    def seal(self) -> None:
        """Nothing to encode: dense tokens stay as they are."""

    def holds_dense(self) -> bool:
        return True

    def load_buffer_row(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.load(keys, values)

    def share_batch_row(self, keys: torch.Tensor, values: torch.Tensor, b: int, grown: bool) -> None:
        if self.keys is not None and (grown or self.keys.data_ptr() != keys[b].data_ptr()):
            n = self.length  # the buffer's row is the store's tokens, then any not yet caught up
            self.keys, self.values = keys[b, :, :n], values[b, :, :n]

    def changed_from(self) -> int:
        return self._read

    def mark_read(self) -> None:
        self._read = self.length

    def keys_values_from(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, start:].to(self.compute_dtype), self.values[:, start:].to(self.compute_dtype)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.keys) + tensor_nbytes(self.values)
