"""Attention probabilities for scoring, computed a block of queries at a time over only the slots the block sees.

Policies that score every prefill query (H2O, a deferred shared prefill) need the
model's attention probabilities, which fused attention kernels do not return:
:func:`visible_probabilities` computes them again, in blocks, with the bits of one
call over every slot (see its docstring), and reduces each block as it comes so
the whole ``[B, heads, q, slots]`` tensor is never held. :func:`attention_mass` sums them into what scoring
keeps: each slot's mass from the queries a policy asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kveval.tensors.batch_buffer import slot_range


def _query_block(device: torch.device) -> int:
    """Queries whose probabilities are computed together, over only the slots they may see. A block's arithmetic
    grows with its area, its launches with the number of blocks: on a CPU, where the arithmetic dominates, blocks
    of 32 queries compute 0.6x the area of blocks of 64 at 256 prompt tokens (less of each lies beyond its causal
    diagonal); a GPU pays a launch per kernel, and keeps blocks of 64 (half the kernels)."""
    return 32 if device.type == "cpu" else 64


#: Where the model's softmax appends a column after the slots (gpt-oss's learned sink), a block's probabilities
#: leave out a multiple of this many trailing slots: the sink then falls in the same lane and unrolled accumulator
#: of a vectorized sum (vectors of up to 16 floats, unrolled 4 times) as over every slot. Blocks cut at other widths
#: changed its probabilities by one float32 ulp. A softmax over the slots alone gives the same bits at any width.
SINK_SLOT_STEP = 64


@dataclass(frozen=True)
class AttentionProbabilities:
    """The attention probabilities of one attention module call, for scoring.

    ``compute(query, keys, allowed)``: float32 ``[B, query heads, q, slots]``, ``allowed`` a boolean mask
    ``[B, 1 or heads, q, slots]``. ``slot_step``: a call over fewer slots than the keys hold leaves out a
    multiple of this many trailing ones, so that it keeps the bits of one call over every slot (1: any width;
    :data:`SINK_SLOT_STEP` where the model's softmax appends a column after the slots).
    """

    compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    slot_step: int = 1

    def __post_init__(self):
        if self.slot_step < 1:
            raise ValueError(f"slot_step must be at least 1, got {self.slot_step}")

    def __call__(self, query: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.compute(query, keys, allowed)


def visible_probabilities(probabilities: AttentionProbabilities, query: torch.Tensor, keys: torch.Tensor,
                          allowed: torch.Tensor, real: torch.Tensor, reduce=None) -> torch.Tensor:
    """``probabilities(query, keys, allowed)`` (``[B, query heads, q, slots]``), computed a block of queries at a
    time (:func:`_query_block`; the last block up to twice that) over only the slots up to the last one a query of
    the block may see (leaving out a multiple of ``probabilities.slot_step`` slots). ``real`` (``[B, q]``, any dtype):
    the queries that count; padding queries, which see every slot rather than none, do not widen a block, and
    their probabilities (over the block's slots only) are for weighting by 0. The blocks' widths are read from the
    device once per call, not once per block.

    The slots beyond get probability 0 either way (a masked logit's ``exp`` is exactly 0), and each query's
    softmax sums the same visible logits in the same order: on a CPU the result is bit-identical to one call over
    every slot, through SDPA's kernel and through a model's eager function (softcapping, learned sinks), which
    ``tests/test_cache.py`` checks, at about 0.5-0.6x the time of one call over every slot for a causal prefill of
    256 tokens and 0.35x at 1,024 (on a CPU; the code before, blocks of 64 cut at multiples of 64 slots and masked
    by ``masked_fill_``, took 20% and 28% more). Elsewhere any rounding difference is the same for every path of
    kveval (row by row, in batch, shared prefill): they all score through this function.

    ``reduce``: applied to each block's probabilities as they come, a reduction within each query and slot (the
    sum over the query heads that read one stored head), so that the whole ``[B, query heads, q, slots]`` tensor
    is never held; it gives per block the bits it gives over the whole.
    """
    q_len, size = query.shape[2], _query_block(query.device)
    blocks = q_len // size
    if blocks < 2:
        probs = probabilities(query, keys, allowed)
        return probs if reduce is None else reduce(probs)
    seen = (allowed & real.bool()[:, None, :, None]).flatten(0, 1).any(dim=0)  # [q, slots]: seen by a real query
    slots = keys.shape[2]
    # Per run of `size` queries (and the remainder), one past the last slot a real query of it sees (0 where none
    # does): one read for every block, and an integer per run and slot, not per query and slot.
    runs = seen[:blocks * size].view(blocks, size, slots).any(dim=1)
    if q_len > blocks * size:
        runs = torch.cat([runs, seen[blocks * size:].any(dim=0, keepdim=True)])
    ends = (torch.where(runs, slot_range(slots, seen.device), -1).amax(dim=1) + 1).tolist()
    step = probabilities.slot_step
    probs = None
    for start in range(0, blocks * size, size):
        # The last block takes the remainder: a matmul of a few query rows rounded differently on a CPU.
        stop = q_len if start + 2 * size > q_len else start + size
        needed = max(ends[start // size:-(-stop // size)]) or slots
        width = slots - (slots - needed) // step * step
        block = probabilities(query[:, :, start:stop], keys[:, :, :width], allowed[:, :, start:stop, :width])
        if reduce is not None:
            block = reduce(block)
        if probs is None:
            probs = block.new_zeros(*block.shape[:2], q_len, slots)
        probs[:, :, start:stop, :width] = block
    return probs


_QUERY_CHUNK = 1024  # queries scored at once when a policy needs every query's attention


def attention_mass(probabilities: AttentionProbabilities, query: torch.Tensor, keys: torch.Tensor, real: torch.Tensor,
                   all_real: bool, first: int, stored_heads: int, allowed) -> torch.Tensor:
    """``[B, stored heads, slots]``: the attention mass each slot received from queries ``first`` onward, summed
    over the real ones (``real``, ``[B, q]``; ``all_real``: every query is), averaged over the query heads reading
    each stored head. ``allowed(start, stop)``: the boolean mask of queries ``start`` to ``stop`` over the slots.
    Queries are scored :data:`_QUERY_CHUNK` at a time, each chunk through :func:`visible_probabilities`."""
    q_len = query.shape[2]
    groups = query.shape[1] // stored_heads

    def by_stored_head(probs):
        return probs.reshape(probs.shape[0], stored_heads, groups, *probs.shape[2:]).sum(dim=2)

    mass = None
    for start in range(first, q_len, _QUERY_CHUNK):
        stop = min(q_len, start + _QUERY_CHUNK)
        # Mean over the heads reading a stored head, then the sum over real queries (padding ones give nothing).
        part = visible_probabilities(probabilities, query[:, :, start:stop], keys, allowed(start, stop),
                                     real[:, start:stop], by_stored_head)
        if stop - start == 1:  # a decode step: the "sum" over one query is one product, by 1 where all are real
            part = part.squeeze(2) if all_real else part.squeeze(2) * real[:, None, start:stop].to(part.dtype)
            part = part / groups
        else:
            part = torch.matmul(real[:, None, None, start:stop].to(part.dtype), part).squeeze(2) / groups
        mass = part if mass is None else mass + part
    return mass


__all__ = ["SINK_SLOT_STEP", "AttentionProbabilities", "attention_mass", "visible_probabilities"]
