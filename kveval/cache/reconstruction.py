"""The reconstruction pass of KVzip (:mod:`kveval.policies.kvzip`): between a context's prefill and its compression.

A cache whose selection ``reconstructs`` holds its prefill uncompressed (``defer_compression``) until the driver
step :func:`kveval.runner.generation.reconstruct_and_compress` has run. For each row alone and each chunk of its
context, the reconstruction prompt (:func:`repeat_inputs`) is fed through a copy of the row
(:meth:`CompressedCache.fork_rows`: the copy takes the reconstruction tokens and is dropped, the row never holds
them) while a :class:`ReconstructionObserver` scores the chunk in every selecting layer from the attention's own
queries and keys. Then the budget over every layer (:func:`mark_kept`, :func:`~kveval.policies.kvzip.kvzip_keep`)
marks what each head keeps, and every layer compresses as at the end of any prefill
(:func:`compress_reconstructed`). Each row is reconstructed alone, so a batch keeps the sets of batch size 1.
"""

from __future__ import annotations

import torch

from kveval.errors import UsageError
from kveval.policies.kvzip import kvzip_keep, reconstruction_scores

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
LATER_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PREVIOUS_TAIL = 8  # tokens of the previous chunk that a later prompt repeats (kvpress's prev_postfix_size)


def _encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # as kveval.probes.prompts.encode_parts


def prompt_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The ids of the first chunk's reconstruction prompt and of the later chunks'."""
    return _encode(tokenizer, FIRST_PROMPT), _encode(tokenizer, LATER_PROMPT)


def chat_split(tokenizer) -> tuple[int, list[int]]:
    """The chat template's head length in tokens and its assistant turn's ids, as kvpress's ``KVzipPress`` takes
    them: the template rendered around a dummy user message (``enable_thinking=False``), split at it; no template:
    no head and ``"\\n"``."""
    if getattr(tokenizer, "chat_template", None) is None:
        return 0, _encode(tokenizer, "\n")
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                             add_generation_prompt=True, tokenize=False, enable_thinking=False)
    if not isinstance(rendered, str) or separator not in rendered or dummy not in rendered:
        raise UsageError("kvzip: the tokenizer's chat template does not render the user message verbatim; "
                         "kveval cannot find its assistant turn for the reconstruction prompt")
    context, suffix = rendered.split(separator)[:2]
    return len(_encode(tokenizer, context.split(dummy)[0])), _encode(tokenizer, suffix)


def repeat_inputs(context: list[int], head: int, suffix: list[int], chunk: int, first: list[int],
                  later: list[int]) -> list[tuple[int, int, list[int]]]:
    """``(start, end, ids)`` per reconstruction forward: the chunk ``context[start:end]`` (after the template's
    ``head`` tokens, ``chunk`` at a time) and the ids fed to repeat it: the ``first`` prompt (later chunks: the
    ``later`` prompt and the previous chunk's last :data:`PREVIOUS_TAIL` tokens), the ``suffix`` (the assistant
    turn), then the chunk."""
    head = min(head, len(context))
    out = []
    for i, start in enumerate(range(head, len(context), chunk)):
        end = min(start + chunk, len(context))
        prompt = first if i == 0 else later + context[max(start - chunk, start - PREVIOUS_TAIL):start]
        out.append((start, end, prompt + suffix + context[start:end]))
    return out


class ReconstructionObserver:
    """Scores one reconstruction forward's chunk in every selecting layer (called by the attention function).

    ``scores[layer_idx]``: ``[kv_heads, n]`` by context position, the chunk's columns written as each layer runs.
    """

    def __init__(self, n: int, start: int, end: int, sink: int, scores: dict):
        self.n, self.start, self.end, self.sink, self.scores = n, start, end, sink, scores

    def __call__(self, layer, query: torch.Tensor, keys: torch.Tensor, scaling: float) -> None:
        if not layer.takes_selection:
            return
        positions = layer._slot_positions[0, 0]  # every head holds the same slots before compression
        q_len = query.shape[2]
        sink = min(self.sink, self.start)
        sinks = positions < sink
        chunk = (positions >= self.start) & (positions < self.end)
        repeat = (positions >= self.n) & (positions < self.n + q_len)
        columns = (sinks | chunk | repeat).nonzero().flatten()
        chunk_columns = chunk[columns].nonzero().flatten()
        scored = reconstruction_scores(query[0], keys[0][:, columns], scaling, chunk_columns)
        target = self.scores.setdefault(layer.layer_idx, torch.zeros(keys.shape[1], self.n, device=keys.device))
        target[:, positions[columns[chunk_columns]]] = scored


def mark_kept(cache, b: int, n: int, scores: dict) -> None:
    """Row ``b`` (``n`` context tokens) of every selecting layer gets its reconstruction scores by slot, ``-inf``
    where the budget over every layer (:func:`~kveval.policies.kvzip.kvzip_keep`) evicts: what
    :meth:`KVzipPolicy.choose` keeps. ``scores``: what the :class:`ReconstructionObserver` s wrote (a layer they never
    scored, all zeros)."""
    policy = cache.policy.selection
    layers = [layer for layer in cache.attention_layers if layer.takes_selection]
    held = [layer.rows[b].positions for layer in layers]
    by_slot = []
    for layer, positions in zip(layers, held):
        layer_scores = scores.get(layer.layer_idx)
        if layer_scores is None:
            layer_scores = torch.zeros(positions.shape[0], n, device=positions.device)
        by_slot.append(layer_scores.to(positions.device).gather(1, positions.clamp(0, n - 1)))
    kept = kvzip_keep(by_slot, held, policy.ratio, policy.sink, policy.layerwise)
    for layer, slot_scores, keep in zip(layers, by_slot, kept):
        layer.rows[b].attention = slot_scores.masked_fill(~keep, float("-inf"))


def compress_reconstructed(cache) -> None:
    """Compress every layer of ``cache`` as at the end of a prefill, once every row is marked (:func:`mark_kept`)."""
    cache.defer_compression = False
    cache.awaiting_reconstruction = False
    for layer in cache.attention_layers:
        rows = layer.rows
        layer.compress_rows(rows, [cache.protected(b) for b in range(len(rows))])
        layer.drop_buffer()
