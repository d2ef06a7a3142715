"""MiniCache (``minicache``): adjacent layers' K/V merged by SLERP of their directions, each layer's magnitudes kept,
the most divergent tokens kept apart (Liu et al. 2024, "MiniCache: KV Cache Compression in Depth Dimension for Large
Language Models").

From layer ``start`` on (by default the deeper half, as the paper merges), the full-attention layers pair up in
order, ``(l-1, l)``; at the end of the prefill each pair's tokens are merged per KV head and per K/V: one unit
direction per token (the SLERP at ``t`` of the two layers' directions), each layer's magnitude of it, and the
``retain`` fraction of tokens whose two directions are furthest apart (angular distance) kept whole in both layers.
Each layer then reads its tokens back as magnitude times direction (:mod:`kveval.stores.merged` has the equations).
The paper keeps apart the tokens whose distance passes a threshold set relative to the range of distances; here
``retain`` is the fraction kept apart, so that the bytes are known before the run (the planner sizes them). Tokens
generated after the prefill are held in full in each layer (the paper merges them too, as they come). Sliding and
chunked layers hold different tokens from step to step and are never paired. No calibration is used.

Bytes per KV head and per K/V of a pair of ``n`` prefill tokens, ``r`` of them kept apart: the earlier layer holds
the ``n - r`` shared directions, its ``n - r`` magnitudes, its ``r`` tokens and their ``r`` slots (int32), the later
its ``n - r`` magnitudes and ``r`` tokens; the magnitudes in the cache dtype, directions and tokens as coded below.

Stacks with quantization as the paper stacks MiniCache with KIVI (merge first, then quantize): the pair's layers
hold their prefill uncoded until the merge, then the shared directions (one store for the pair) and each layer's
retained tokens are coded by the stack's quantizer, each as one store of it codes a prefill (groups, residual
window); the magnitudes stay in the cache dtype, the slots int32. Tokens generated after the prefill go to one more
such store per layer, coded as the quantizer codes decode tokens. The layers outside the pairs are the quantizer's
alone. Refused: a quantizer whose codes are sized per token (KVQuant's, an engine's) or made as tokens arrive, and
one scaled per tensor from a layer's prefill (NVFP4's), which a merged layer's decode tokens no longer share.

Stacks with a selection only where every layer keeps the same tokens (it declares
:attr:`~kveval.policies.base.Placement.SAME_TOKENS_EVERY_LAYER`: ``window``, ``streaming``, which score by position)
and only at the prefill (``ratio=``, no decode budget: merged tokens are held for two layers at once, and nothing
evicts them); other selections keep each layer's own tokens, which a pair cannot merge: refused at the spec.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from kveval.errors import PolicySpecError
from kveval.policies.base import Need, Placement, PlannedWidths, Policy, StructurePolicy
from kveval.values import is_real, is_whole

#: Bytes of a kept-apart token's slot number (int32).
SLOT_BYTES = 4


@dataclass
class MiniCachePolicy(StructurePolicy):
    """Merge adjacent full-attention layers' K/V from ``start`` on: a shared direction, per-layer magnitudes.

    Attributes
    ----------
    start : int, optional
        The first layer paired (a layer number of the model); default the first of the deeper half of its
        full-attention layers.
    t : float
        SLERP's interpolation parameter, ``0 <= t <= 1``: 0 takes the earlier layer's direction, 1 the later's.
    retain : float
        Fraction of each pair's prefill tokens (per KV head, per K/V) kept apart, whole in both layers: those whose
        two directions are furthest apart. ``0 <= retain <= 1``.
    """

    name = "minicache"
    description = "MiniCache: adjacent layers' K/V merged by SLERP of directions, magnitudes kept per layer"
    keeps_head_widths = True
    stacks_with = frozenset({"selection", "quantization"})
    start: int | None = None
    t: float = 0.5
    retain: float = 0.05

    def __post_init__(self):
        if self.start is not None and (not is_whole(self.start) or self.start < 0):
            raise PolicySpecError(f"{self.name}: start={self.start!r} must be a layer number, 0 or more")
        for key in ("t", "retain"):
            value = getattr(self, key)
            if not is_real(value) or not 0 <= value <= 1:
                raise PolicySpecError(f"{self.name}: {key}={value!r} must be between 0 and 1")
            setattr(self, key, float(value))

    @property
    def needs(self) -> frozenset[Need]:
        return frozenset({Need.CROSS_LAYER})

    def retained(self, tokens: int) -> int:
        """Tokens of a pair's ``tokens`` kept apart per head and per K/V: ``round(retain * tokens)``."""
        return min(tokens, int(self.retain * tokens + 0.5))

    def merged_layers(self, layer_kinds: Sequence[Hashable | None]) -> dict[int, int]:
        """Later layer -> the earlier layer it is merged with: full-attention layers (kind ``(None, False)``: no
        window, no chunks) from ``start`` on, in pairs. Refuses a model with no pair there."""
        full = [i for i, kind in enumerate(layer_kinds) if kind == (None, False)]
        start = full[len(full) // 2] if self.start is None and full else self.start or 0
        paired = [i for i in full if i >= start]
        pairs = {paired[j + 1]: paired[j] for j in range(0, len(paired) - 1, 2)}
        if not pairs:
            raise PolicySpecError(f"{self.spec()}: this model has {len(paired)} full-attention layer(s) from layer "
                                  f"{start} on, no pair to merge; give an earlier start= (sliding, chunked and hybrid layers "
                                  f"are never merged)")
        return pairs

    def merged_bytes(self, tokens: int, new_tokens: int, heads: int, width: int, dtype_bytes: int,
                     coded: "Callable[[int], int] | None" = None) -> tuple[int, int]:
        """Bytes of one stream (K or V: ``heads`` KV heads of rows ``width`` wide) in the earlier and the later layer
        of a pair, after ``tokens`` prefill tokens were merged and ``new_tokens`` appended; ``coded(n)``: the bytes
        of ``n`` tokens of the stream in one store of the stack's quantizer (default: in the cache dtype). The
        directions, each layer's retained tokens and its appended tokens are three such stores."""
        if coded is None:
            def coded(n: int) -> int:
                return heads * n * width * dtype_bytes
        r = self.retained(tokens)
        merged = tokens - r
        own = heads * merged * dtype_bytes + coded(r) + coded(new_tokens)
        return own + coded(merged) + heads * r * SLOT_BYTES, own

    def stack_refusal(self, other: Policy) -> str | None:
        """A selection that may keep different tokens in the two layers of a pair, or evicts while decoding; a
        quantizer whose codes are not grouped per K/V head, are made as tokens arrive, or scale per tensor."""
        if other.family == "selection":
            if not other.supports(Placement.SAME_TOKENS_EVERY_LAYER):
                return (f"{other.name} keeps each layer's own tokens, and a merged pair's two layers must hold the "
                        f"same ones; select by position (window(ratio=...), streaming(ratio=...))")
            if other.decode_budget is not None:
                return (f"{other.name} evicts while decoding, and a merged pair's tokens are held for two layers at "
                        f"once; give ratio= (the prefill's selection alone)")
            return None
        coding = other.planned_coding()
        if other.codes_on_arrival or not coding.grouped:
            return (f"{other.name} codes tokens {'as they arrive' if other.codes_on_arrival else 'with codes sized per token'},"
                    f" and the merge codes directions and retained tokens as grouped K/V codes; use a grouped quantizer "
                    f"(quant, kivi, fp8)")
        if coding.key.global_scale_bytes or coding.value.global_scale_bytes:
            return (f"{other.name} scales each layer per tensor from its prefill, which a merged layer's decode tokens "
                    f"no longer share; use a quantizer scaled per group")
        return None

    def planned_widths(self, kv_heads: int, k_width: int, v_width: int, mla: bool = False) -> PlannedWidths:
        """Layers outside the pairs store the model's own streams (the pairs: :meth:`merged_bytes`)."""
        return PlannedWidths(kv_heads, k_width, v_width)

    def make_store(self, inner, model, layer_idx: int):
        """Tokens arrive as the inner store holds them; the cache merges a pair's at the end of the prefill."""
        return inner

    def merge_stores(self, first, second, coded=None):
        """The stores of one sequence in a pair's earlier and later layer, merged and coded by ``coded(compute_dtype)``
        (:mod:`kveval.stores.merged`)."""
        from kveval.stores.merged import merge_stores  # torch: imported where a model runs, never to plan

        return merge_stores(first, second, self.t, self.retained(first.length), coded)


__all__ = ["MiniCachePolicy"]
