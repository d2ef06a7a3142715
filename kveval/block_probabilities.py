"""Attention probabilities for scoring, computed a block of queries at a time over only the slots the block sees.

Policies that score every prefill query (H2O, a deferred shared prefill) need the
model's attention probabilities, which fused attention kernels do not return:
:func:`visible_probabilities` computes them again, in blocks, with the bits of one
call over every slot (see its docstring), and reduces each block as it comes so
the whole ``[B, heads, q, slots]`` tensor is never held.
"""

from __future__ import annotations

import torch

_QUERY_BLOCK = 64  # queries whose probabilities are computed together, over only the slots they may see
# A block's probabilities leave out a multiple of this many trailing slots: a column the model's softmax appends
# after the slots (gpt-oss's learned sink) then falls in the same lane and unrolled accumulator of a vectorized
# sum (vectors of up to 16 floats, unrolled 4 times) as over every slot. Blocks cut at other widths changed its
# probabilities by one float32 ulp.
_SLOT_ALIGN = 64


def visible_probabilities(probabilities, query: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor,
                          real: torch.Tensor, reduce=None) -> torch.Tensor:
    """``probabilities(query, keys, allowed)`` (``[B, query heads, q, slots]``), computed :data:`_QUERY_BLOCK`
    queries at a time (the last block up to twice that) over only the slots up to the last one a query of the
    block may see (leaving out a multiple of :data:`_SLOT_ALIGN` slots). ``real`` (``[B, q]``, any dtype): the queries that count;
    padding queries, which see every slot rather than none, do not widen a block, and their probabilities (over
    the block's slots only) are for weighting by 0.

    The slots beyond get probability 0 either way (a masked logit's ``exp`` is exactly 0), and each query's
    softmax sums the same visible logits in the same order: on a CPU the result is bit-identical to one call over
    every slot, through SDPA's kernel and through a model's eager function (softcapping, learned sinks), which
    ``tests/test_cache.py`` checks, at about 0.55-0.75x the time of a causal prefill's scoring, which grows as the
    square of its length. Elsewhere any rounding difference is the same for every path of kveval (row by row, in
    batch, shared prefill): they all score through this function.

    ``reduce``: applied to each block's probabilities as they come, a reduction within each query and slot (the
    sum over the query heads that read one stored head), so that the whole ``[B, query heads, q, slots]`` tensor
    is never held; it gives per block the bits it gives over the whole.
    """
    q_len = query.shape[2]
    blocks = q_len // _QUERY_BLOCK
    if blocks < 2:
        probs = probabilities(query, keys, allowed)
        return probs if reduce is None else reduce(probs)
    seen = (allowed & real.bool()[:, None, :, None]).flatten(0, 1).any(dim=0)  # [q, slots]: seen by a real query
    probs = None
    for start in range(0, blocks * _QUERY_BLOCK, _QUERY_BLOCK):
        # The last block takes the remainder: a matmul of a few query rows rounded differently on a CPU.
        stop = q_len if start + 2 * _QUERY_BLOCK > q_len else start + _QUERY_BLOCK
        columns = seen[start:stop].any(dim=0).nonzero()
        needed = int(columns[-1]) + 1 if len(columns) else keys.shape[2]
        width = keys.shape[2] - (keys.shape[2] - needed) // _SLOT_ALIGN * _SLOT_ALIGN
        block = probabilities(query[:, :, start:stop], keys[:, :, :width], allowed[:, :, start:stop, :width])
        if reduce is not None:
            block = reduce(block)
        if probs is None:
            probs = block.new_zeros(*block.shape[:2], q_len, keys.shape[2])
        probs[:, :, start:stop, :width] = block
    return probs


__all__ = ["visible_probabilities"]
