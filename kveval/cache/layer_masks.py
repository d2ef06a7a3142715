"""The boolean masks attention reads over a layer's kept slots (True = visible), made from positions or lengths.

A :class:`~kveval.cache.layers.CompressedLayer` builds them once per forward, on the device, once its kept
tokens no longer line up with the input columns (compression, padding, a decode budget): from the slots'
original positions in general (:func:`positions_mask`), and in a decode step from the rows' lengths alone where
that is all the mask depends on (:func:`visible_prefix`, :func:`held_slots`).
"""

from __future__ import annotations

import torch

from kveval.modeling.architectures import every_slot_visible
from kveval.tensors.batch_buffer import PAD_POSITION, slot_range, uploaded


def visible_prefix(lengths: tuple[int, ...], width: int, device) -> torch.Tensor:
    """``[B, 1, 1, width]`` boolean: slot ``s`` of row ``b`` is visible where ``s < lengths[b]`` (never written to)."""
    if all(n == width for n in lengths):
        return every_slot_visible(len(lengths), width, device)
    return slot_range(width, device) < uploaded(lengths, device)[:, None, None, None]


def held_slots(positions: torch.Tensor) -> torch.Tensor:
    """``[B, H, 1, width]`` boolean of the slots whose ``positions`` (``[B, H, width]``) are not padding's."""
    return (positions != PAD_POSITION).unsqueeze(2)


def positions_mask(slot_positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int | None,
                   chunked: bool, heads_share: bool = False) -> torch.Tensor:
    """Boolean ``[B, heads, q, slots]``: a query (``query_positions``, ``[B, q]``) sees a kept token
    (``slot_positions``, ``[B, H, slots]``, padding's position on empty slots) at or before its position, and
    inside the ``sliding_window`` (or, ``chunked``, in its own chunk of that many positions).

    ``heads`` is 1 when every KV head keeps the same tokens, else the number of stored KV heads; kernels
    broadcast it over the query heads that read each. ``heads_share``: the caller knows they do (no policy
    selected tokens per head), so the device is not read to find out."""
    slots = slot_positions
    if heads_share or bool((slots == slots[:, :1]).all()):
        slots = slots[:, :1]
    key_pos, query_pos = slots[:, :, None, :], query_positions[:, None, :, None]
    allowed = key_pos <= query_pos
    if chunked:
        allowed &= key_pos // sliding_window == query_pos // sliding_window
    elif sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    allowed |= ~allowed.any(dim=-1, keepdim=True)  # padding queries: attend somewhere rather than produce NaN
    return allowed


__all__ = ["held_slots", "positions_mask", "visible_prefix"]
