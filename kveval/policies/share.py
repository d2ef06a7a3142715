"""KV shared across layers (``share``): named layers, or groups of adjacent layers, attend to a source layer's K/V and
store nothing of their own.

The training-free reading of cross-layer attention (CLA: Brandon et al. 2024, "Reducing Transformer Key-Value Cache
Size with Cross-Layer Attention") and YOCO's reuse of one cache by later layers (Sun et al. 2024, "You Only Cache
Once"): those train the model to read another layer's cache; here a pretrained model is made to, its reusing layers'
own K/V projections computed and discarded. What kveval measures is what that costs without training.

``share(groups=2)``: every two adjacent attention layers of one kind (same sliding window, same chunking) read the
first's K/V; ``share(groups=2,start=12)`` from layer 12 on (the deeper layers, as MiniCache merges the deeper half);
``share(map=3:2;4:2)``: layers 3 and 4 read layer 2's. Layers of different kinds (Gemma 3's sliding and full layers)
hold different tokens and never share: ``groups=`` groups each kind's layers apart, in order, and ``map=`` refuses a
pair of two kinds in one line before the weights load.

A reusing layer attends to exactly what its source layer's attention read in the same forward: the source's stored
(compressed) K/V plus the forward's new tokens, and, in the prefill, the uncompressed prefill as every kveval layer
does before it compresses. It holds 0 bytes. Stacks with selection (which acts on the source layers: the reusing
layers read what they keep) and quantization (which codes the source layers' K/V). A reusing layer changes what the
prefill computes, so a stack with ``share`` prefills alone (:attr:`~kveval.policies.base.Need.CROSS_LAYER`). No
calibration is used.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kveval.errors import PolicySpecError
from kveval.policies.base import Need, PlannedWidths, StructurePolicy
from kveval.values import is_whole


def parse_layer_map(name: str, text: str) -> dict[int, int]:
    """``"3:2;4:2"`` as ``{3: 2, 4: 2}`` (reusing layer -> source layer), refused in one line where malformed."""
    pairs: dict[int, int] = {}
    for item in filter(None, (part.strip() for part in str(text).split(";"))):
        reuser, sep, source = item.partition(":")
        if not sep or not reuser.strip().isdigit() or not source.strip().isdigit():
            raise PolicySpecError(f"{name}: map={text!r}: {item!r} is not READER:SOURCE (layer numbers, pairs joined by "
                                  f"';', e.g. map=3:2;4:2)")
        reuser_idx, source_idx = int(reuser), int(source)
        if reuser_idx in pairs:
            raise PolicySpecError(f"{name}: map={text!r} names layer {reuser_idx} twice; give each reading layer one source")
        if source_idx >= reuser_idx:
            raise PolicySpecError(f"{name}: map={text!r}: layer {reuser_idx} cannot read layer {source_idx}, which runs "
                                  f"after it (or is itself); a source is an earlier layer")
        pairs[reuser_idx] = source_idx
    if not pairs:
        raise PolicySpecError(f"{name}: map={text!r} names no layer; give READER:SOURCE pairs, e.g. map=3:2;4:2")
    for reuser_idx, source_idx in pairs.items():
        if source_idx in pairs:
            raise PolicySpecError(f"{name}: map={text!r}: layer {source_idx} reads layer {pairs[source_idx]} and stores "
                                  f"nothing, so layer {reuser_idx} cannot read it; name {pairs[source_idx]} as its source")
    return pairs


def describe_kind(kind: Hashable) -> str:
    """A layer kind as the cache and the planner give it, ``(window, chunked)``, in words."""
    if isinstance(kind, tuple) and len(kind) == 2:
        window, chunked = kind
        return "full attention" if window is None else f"{window}-token {'chunks' if chunked else 'window'}"
    return str(kind)


@dataclass
class SharePolicy(StructurePolicy):
    """Layers that read an earlier layer's K/V and store nothing (cross-layer attention, without training).

    Attributes
    ----------
    groups : int, optional
        From layer ``start`` on, each kind's attention layers in groups of this many adjacent ones (in layer
        order), each group reading its first layer's K/V. ``groups=1``: every layer its own source (``none``).
    map : str, optional
        Instead of ``groups``: ``READER:SOURCE`` pairs joined by ``;`` (``map=3:2;4:2``), layer numbers of the model.
        A source is an earlier layer of the same kind that stores its own K/V.
    start : int
        With ``groups``: the first layer grouped (default 0; the layers before it store their own K/V).
    """

    name = "share"
    description = "KV shared across layers: groups of adjacent layers read the first's K/V and store nothing (CLA/YOCO)"
    keeps_head_widths = True
    groups: int | None = None
    map: str | None = None
    start: int = 0

    def __post_init__(self):
        if (self.groups is None) == (self.map is None):
            raise PolicySpecError(f"{self.name}: give groups= (adjacent layers reading the first's K/V) or map= "
                                  f"(READER:SOURCE pairs, e.g. map=3:2;4:2), one of them")
        if self.groups is not None and (not is_whole(self.groups) or self.groups < 1):
            raise PolicySpecError(f"{self.name}: groups={self.groups!r} must be a positive integer (layers per group)")
        if not is_whole(self.start) or self.start < 0:
            raise PolicySpecError(f"{self.name}: start={self.start!r} must be a layer number, 0 or more")
        self._pairs = parse_layer_map(self.name, self.map) if self.map is not None else None

    def check_given(self) -> None:
        if self.map is not None and self.is_given("start"):
            raise PolicySpecError(f"{self.name}: start= acts only with groups=; map= names every reading layer itself")

    @property
    def needs(self) -> frozenset[Need]:
        return frozenset({Need.CROSS_LAYER})

    def reused_layers(self, layer_kinds: Sequence[Hashable | None]) -> dict[int, int]:
        """Reading layer -> the layer whose K/V it reads, for a model whose layer ``i`` is of kind ``layer_kinds[i]``
        (``None``: it holds no K/V). Refuses (:class:`PolicySpecError`, one line) a map naming a layer without K/V,
        past the model, or a pair of two kinds."""
        if self._pairs is None:
            out: dict[int, int] = {}
            members: dict[Hashable, list[int]] = {}
            for i, kind in enumerate(layer_kinds):
                if kind is not None and i >= self.start:
                    members.setdefault(kind, []).append(i)
            for layers in members.values():
                for first in range(0, len(layers), self.groups):
                    group = layers[first:first + self.groups]
                    out.update({i: group[0] for i in group[1:]})
            return dict(sorted(out.items()))
        for reader, source in self._pairs.items():
            for layer in (reader, source):
                if layer >= len(layer_kinds) or layer_kinds[layer] is None:
                    raise PolicySpecError(f"{self.spec()}: layer {layer} holds no K/V of its own on this model "
                                          f"({len(layer_kinds)} layers); name attention layers")
            if layer_kinds[reader] != layer_kinds[source]:
                raise PolicySpecError(f"{self.spec()}: layers {reader} and {source} are of different kinds "
                                      f"({describe_kind(layer_kinds[reader])}, {describe_kind(layer_kinds[source])}), "
                                      f"which hold different tokens; share within one kind")
        return dict(self._pairs)

    def planned_widths(self, kv_heads: int, k_width: int, v_width: int, mla: bool = False) -> PlannedWidths:
        """A storing layer's streams are the model's own; the reading layers hold none (:meth:`reused_layers`)."""
        return PlannedWidths(kv_heads, k_width, v_width)

    def make_store(self, inner, model, layer_idx: int):
        """A storing layer keeps its tokens as the inner store does (reading layers get no store)."""
        return inner


__all__ = ["SharePolicy", "describe_kind", "parse_layer_map"]
