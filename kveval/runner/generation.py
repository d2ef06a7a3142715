"""Greedy generation under a compression policy: the one driver every kveval command uses.

A prompt is a *context* and a *question* (token ids). In ``mode="context"``
(query-agnostic, the default) the context is prefilled and compressed before
the question is seen, as a cached prefix, a long system prompt or an earlier
chat turn is in deployment; the question is then appended to the compressed
cache. In ``mode="query"`` (query-aware) context and question are prefilled
together; the question's tokens are kept and the context is compressed with
the question in view.

Batches are left-padded; padding is declared to the cache, which never stores
it, so every row gets exactly the tokens it would get alone. A row that has
finished (EOS or a stop string) is fed nothing while the others go on, so its
cache, and the bytes measured for it, stop growing exactly where they would at
batch size 1.

Rows whose contexts are the same token ids (a long system prompt shared by several requests) share one
prefix in ``context`` mode: the context is prefilled and compressed once, then each row continues from its
own copy of the compressed cache (:mod:`kveval.runner.prefixes`, :meth:`CompressedCache.fork_rows`), never seeing
another row's tokens. The answers are those of one prefill per row, bit for bit; each result reports the
prefix's bytes (:attr:`GenerationResult.prefix_stats`) so that a shared prefix is counted once.

Cache bytes are measured against ``kv_dtype``, the deployment's cache dtype
(default: the checkpoint's, see :func:`kveval.dtypes.deployment_kv_dtype`),
whatever dtype the model computes in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kveval.cache import reconstruction
from kveval.cache.compressed import CacheStats, CompressedCache
from kveval.cache.native_layers import rows_alone
from kveval.dtypes import cache_kv_dtype
from kveval.errors import UsageError
from kveval.modeling.architectures import row_query_temperatures
from kveval.modeling.rope import check_rope_batch, reset_rope_lengths, rope_switches
from kveval.policies.base import PolicyStack, require_stack
from kveval.probes.prompts import encode_text
from kveval.runner.prefixes import plan_prefixes, serve_prefixes
from kveval.runner.runspec import MODES, check_mode
from kveval.tensors.batch_buffer import uploaded
from kveval.values import is_whole



@dataclass
class Prompt:
    """Token ids of one prompt, split where compression happens in ``context`` mode."""

    context: list[int]
    question: list[int] = field(default_factory=list)
    #: ``(start, end)`` token positions (in ``context + question``) whose retention the result reports
    #: (:attr:`GenerationResult.watched_kept`): a probe's target needle.
    watched: tuple[tuple[int, int], ...] = ()

    @property
    def length(self) -> int:
        return len(self.context) + len(self.question)


@dataclass
class GenerationResult:
    """One row's output.

    Attributes
    ----------
    text : str
        Decoded generation (special tokens removed; stop strings cut).
    token_ids : list of int
        Generated ids, EOS excluded.
    logprobs : list of float
        Natural-log probability of each generated token under the compressed model.
    stats : CacheStats
        Cache size of this row once generation ended.
    prefill_seconds : float
        Time to first token of the batch (its prefill forwards).
    decode_tokens_per_second : float
        Generated tokens of this row divided by the batch's decode time.
    decode_seconds : float
        The batch's decode time (after the first token), seconds.
    watched_kept : float or None
        Share of the slots of the prompt's :attr:`Prompt.watched` tokens the cache held once the prompt was in
        (compressed, before the first answer token), over attention layers and KV heads
        (:meth:`CompressedCache.span_retention`); ``None`` when the prompt watches nothing.
    peak_kv_bytes : int
        The most K/V bytes this row's cache held between forwards from the prompt's end (compressed) to the end
        of decoding (:meth:`CompressedCache.kv_bytes`, in the deployment's ``kv_dtype`` as ``stats.kv_bytes``):
        at least ``stats.kv_bytes``; read after every step where the bytes may peak in between
        (:attr:`CompressedCache.peaks_between_steps`), else after the prompt and at the end.
    prefix_stats : CacheStats or None
        ``context`` mode: the size of the compressed context alone, measured once it was prefilled and compressed
        and before the question came (rows sharing one context share one prefix, and these stats). ``stats``
        less these bytes is what the row's request (question and answer) added. ``None`` in ``query`` mode.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    stats: CacheStats
    prefill_seconds: float
    decode_tokens_per_second: float
    decode_seconds: float = 0.0
    watched_kept: float | None = None
    peak_kv_bytes: int = 0
    prefix_stats: CacheStats | None = None


def encode_prompt(tokenizer, context: str, question: str = "", chat: bool | None = None) -> Prompt:
    """Tokenize a prompt as context and question, exactly as the probes do (:func:`kveval.probes.prompts.encode_text`).

    The chat template is applied when the tokenizer has one (unless
    ``chat=False``) to the user message ``context + "\n\n" + question``; its
    head belongs to the context, its tail (the assistant turn) to the question.
    """
    return Prompt(*encode_text(tokenizer, context, question, chat))


def _left_pad(rows: list[list[int]], pad_id: int, seen: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, width]`` ids and real-token mask of ``rows``, and ``seen`` as ``[B, 1]``: built on the
    host and copied to ``device`` once (on a GPU each copy from the host also waits for the device)."""
    width = max(len(r) for r in rows)
    table = torch.tensor([[pad_id] * (width - len(r)) + list(r) + [0] * (width - len(r)) + [1] * len(r) + [s]
                          for r, s in zip(rows, seen)], dtype=torch.long).to(device)
    return table[:, :width], table[:, width:2 * width].bool(), table[:, 2 * width:]


def forward_rows(model, cache: CompressedCache, rows: list[list[int]], seen: list[int], pad_id: int,
                 logits_to_keep: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One left-padded forward pass that appends ``rows[b]`` to row ``b`` of ``cache``.

    ``seen[b]`` (tokens row ``b`` has processed so far) is advanced in place.
    Returns the logits of the last ``logits_to_keep`` columns (0: all) ``[B, columns, vocab]``
    and the real-token mask ``[B, width]``.

    Attention masks padding; a linear-attention or Mamba state does not (transformers zeroes a padded input, and
    the state still decays over it). So on a model with such layers, a forward that would pad a row whose state
    already holds tokens runs once per length of the rows' new tokens, each row in the one with no padding for it
    (:func:`_forward_by_length`), and rows a forward gives nothing keep their states: each row's state sees its
    own tokens alone, as at batch size 1. The logits of each row's tokens are where the padded forward puts them.
    """
    width = max((len(r) for r in rows), default=0)
    if cache.state_layers and any(s and 0 < len(r) < width for r, s in zip(rows, seen)):
        return _forward_by_length(model, cache, rows, seen, pad_id, logits_to_keep)
    idle = [b for b, r in enumerate(rows) if not r] if cache.state_layers else []
    with _states_kept(cache, idle):
        return _forward(model, cache, rows, seen, pad_id, logits_to_keep)


def _forward_by_length(model, cache: CompressedCache, rows: list[list[int]], seen: list[int], pad_id: int,
                       logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_rows` as one forward per length of the rows' new tokens (longest first): rows of that length
    get theirs, unpadded; the others nothing, and keep their states. Logits and mask as the one padded forward
    gives them (columns of padding: zeros)."""
    width = max(len(r) for r in rows)
    columns = width if logits_to_keep == 0 else min(logits_to_keep, width)
    logits = None
    for length in sorted({len(r) for r in rows if r}, reverse=True):
        members = [b for b, r in enumerate(rows) if len(r) == length]
        part, _ = forward_rows(model, cache, [r if len(r) == length else [] for r in rows], seen, pad_id,
                               logits_to_keep)
        if logits is None:
            logits = part.new_zeros(len(rows), columns, part.shape[-1])
        logits[members, columns - part.shape[1]:] = part[members]
    return logits, _left_pad(rows, pad_id, seen, logits.device)[1]


@contextlib.contextmanager
def _states_kept(cache: CompressedCache, idle: list[int]):
    """Rows ``idle`` of ``cache``'s linear-attention and Mamba states as they are now, written back after the
    block, even on an error: a forward that gives them nothing would advance them over padding."""
    if not idle:
        yield
        return
    kept = []
    for layer in cache.state_layers:
        for states in (layer.conv_states, layer.recurrent_states):
            for key, held in states.items():
                if held is not None:
                    index = uploaded(tuple(idle), held.device)  # once per device and set of rows, not per state
                    kept.append((states, key, index, held.index_select(0, index)))
    try:
        yield
    finally:
        for states, key, index, rows in kept:
            states[key].index_copy_(0, index, rows.to(states[key].dtype))


def _forward(model, cache: CompressedCache, rows: list[list[int]], seen: list[int], pad_id: int,
             logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One left-padded forward pass (:func:`forward_rows`, whose state-layer cases are settled)."""
    # A dynamic NTK RoPE grows its base to the longest forward since its last reset, so a batch (or a policy
    # continuing a shared prefill) would inherit the base of forwards run before it. Reset before every forward:
    # within a batch the forwards only grow, so the base each gets is the one it gets without resets.
    reset_rope_lengths(model)
    check_rope_batch(model, seen, [max(s + len(r), 1) for r, s in zip(rows, seen)], [bool(r) for r in rows])
    ids, mask, start = _left_pad(rows, pad_id, seen, model.device)
    position_ids = (start + mask.long().cumsum(dim=1) - 1).clamp(min=0)
    width = ids.shape[1]
    cache.set_input_mask(mask, runs=([len(r) for r in rows], [slice(width - len(r), width) for r in rows]),
                         positions=position_ids)
    try:  # Generation needs the last column only: skip the [B, width, vocab] projection of the rest.
        with row_query_temperatures(model):  # Llama 4: scaled by each row's positions, not by the padded length
            logits = model(input_ids=ids, position_ids=position_ids, cache=cache, use_cache=True,
                           logits_to_keep=logits_to_keep, attention_mask=cache.model_attention_mask()).logits  # None unless state layers skip padding
    finally:
        cache.input_positions = None  # declared for this forward only
    for b, r in enumerate(rows):
        seen[b] += len(r)
    return logits, mask


def row_limits(max_new_tokens: "int | Sequence[int]", rows: int) -> list[int]:
    """Each of ``rows`` prompts' limit of new tokens: one integer for all, or one per prompt.

    A batch of items whose answers differ in length (probe families) gives each row its own limit, so that a row
    decodes in any batch exactly as alone: given the batch's longest limit, it would answer with more tokens and
    hold more of them in its cache."""
    def valid(n) -> bool:
        return is_whole(n) and n >= 1

    if valid(max_new_tokens):
        return [max_new_tokens] * rows
    if isinstance(max_new_tokens, (list, tuple)) and len(max_new_tokens) == rows and all(map(valid, max_new_tokens)):
        return list(max_new_tokens)
    raise UsageError(f"max_new_tokens={max_new_tokens!r} must be an integer of at least 1, or a list of one such "
                     f"integer per prompt ({rows})")


def check_batch_size(batch_size) -> None:
    """Refuse a batch size that is not a whole number of at least 1 (one line)."""
    if not is_whole(batch_size) or batch_size < 1:
        raise UsageError(f"batch_size={batch_size!r} must be an integer of at least 1")


def check_request(model, prompts: list[Prompt], max_new_tokens: "int | Sequence[int]", mode: str, batch_size: int) -> None:
    """Refuse a generation request that cannot run as asked (one line naming the fix); shared by every entry point."""
    if mode not in MODES:
        raise UsageError(f"mode={mode!r}; use 'context' (compress before the question) or 'query' (compress with it)")
    check_batch_size(batch_size)
    limits = row_limits(max_new_tokens, len(prompts))
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if any(switch.dynamic for switch in rope_switches(model)):
        limit = None  # dynamic NTK grows its base past that length: what it is for
    for p, new_tokens in zip(prompts, limits):
        if limit and p.length + new_tokens > limit:
            raise UsageError(f"prompt of {p.length} tokens + {new_tokens} new tokens exceeds the model's {limit} positions; use a shorter context")
        if not p.context:
            raise UsageError("a prompt needs at least one context token")
    _check_rope_batches(model, prompts, limits, mode, batch_size)


def _check_rope_batches(model, prompts: list[Prompt], limits: list[int], mode: str, batch_size: int) -> None:
    """Refuse, before any forward, what :func:`~kveval.modeling.rope.check_rope_batch` would refuse on the way:
    a row crossing a longrope's switch after its first forward, or a batch (``batch_size`` prompts at a time, in
    order, as every entry point makes them) whose rows a length-dependent RoPE turns otherwise together than
    alone. A batch agrees where every forward stays under the switch, where every row's first forward is past a
    longrope's, or where every prompt has the same shape (its rows then grow alike; a row that finishes early
    reads nothing more)."""
    switches = rope_switches(model)
    if not switches:
        return
    starts = [len(p.context) if mode == "context" else p.length for p in prompts]
    ends = [p.length + n - 1 for p, n in zip(prompts, limits)]  # the last token generated is never fed
    for switch in switches:
        for p, start, end in zip(prompts, starts, ends):
            if switch.crosses(start, end):
                raise switch.crossing(start, end)
        for first in range(0, len(prompts), batch_size):
            rows = prompts[first:first + batch_size]
            shapes = {(len(p.context), len(p.question)) if mode == "context" else p.length for p in rows}
            batch_starts, batch_ends = starts[first:first + batch_size], ends[first:first + batch_size]
            if (len(rows) < 2 or len(shapes) == 1 or max(batch_ends) <= switch.positions
                    or (not switch.dynamic and min(batch_starts) > switch.positions)):
                continue
            raise switch.refusal(min(batch_starts), max(batch_ends))


@torch.no_grad()
def generate(model, tokenizer, prompts: list[Prompt], policy: "PolicyStack | None" = None, max_new_tokens: int = 32,
             mode: str = "context", batch_size: int = 1, stop: list[str] | None = None,
             seed: "int | Sequence[int]" = 0, kv_dtype: "torch.dtype | None" = None,
             quantized_decode: str = "auto") -> list[GenerationResult]:
    """Greedy decoding of ``prompts`` with ``policy`` applied at prefill and during decoding.

    Parameters
    ----------
    model, tokenizer
        From :func:`kveval.runner.models.load_model` (any causal LM loaded with ``attn_implementation="kveval"``).
    prompts : list of Prompt
        Token ids; see :func:`encode_prompt` for plain text.
    policy : PolicyStack or None
        The compression policy, parsed at the edge (``None``: uncompressed).
    max_new_tokens : int or list of int
        Generation stops at EOS, a stop string, or this many tokens (one limit for all, or one per prompt).
    mode : {"context", "query"}
        Compress the context before the question is seen, or with it.
    batch_size : int
        Rows per forward pass; results do not depend on it (bit for bit on a CPU; on CUDA, whose bf16 kernels
        change with the batch's shape, as far as transformers' own batches match its batch 1).
    stop : list of str, optional
        Stop strings; the text is cut before the first one.
    seed : int or sequence of int
        Seed of the ``random`` control policy: row ``i`` of the whole list uses ``seed + i``, or ``seed[i]``
        given one per prompt (from each item, so that its choices do not depend on what it is batched with).
    kv_dtype : str or torch.dtype, optional
        The deployment's cache dtype (``"bfloat16"``, ``"float16"``, ``"float32"``): full-precision
        tokens are stored in it and ratios are stated against it. Default: the checkpoint's.
    quantized_decode : {"auto", "buffer", "codes"}
        How quantized layers decode (memory against speed; the results are the same): see
        :class:`~kveval.cache.compressed.CompressedCache`.
    """
    check_request(model, prompts, max_new_tokens, mode, batch_size)
    limits = row_limits(max_new_tokens, len(prompts))
    policy = require_stack(policy, "generate")
    check_mode(policy, mode)
    batch_size = forward_batch_size(model, batch_size)
    results = []
    for first in range(0, len(prompts), batch_size):
        results += _generate_batch(model, tokenizer, prompts[first:first + batch_size], policy,
                                   limits[first:first + batch_size], mode, stop or [],
                                   batch_seeds(seed, first, batch_size), kv_dtype, quantized_decode)
    return results


def forward_batch_size(model, batch_size: int) -> int:
    """The rows a forward takes: ``batch_size``, or 1 for models whose own cache layers kveval mirrors (DeepSeek
    V3.2/V4: :func:`~kveval.cache.native_layers.rows_alone`), whose compressor windows and indexer mask are laid
    over the batch's columns, so that a padded row would pool its padding. Each row then gets exactly its answer
    alone, whatever ``batch_size`` asked."""
    return 1 if rows_alone(model) else batch_size


def batch_seeds(seed: "int | Sequence[int]", first: int, size: int) -> "int | list[int]":
    """The ``random`` control's seeds of the batch starting at row ``first``: ``seed + first`` (its rows then use
    ``seed + first + b``) or, given one seed per row, theirs."""
    return seed + first if isinstance(seed, int) else list(seed[first:first + size])


def row_seeds(seed: "int | Sequence[int]", rows: int) -> list[int]:
    """Each of ``rows`` rows' seed: ``seed + b``, or ``seed[b]`` given one per row (as :meth:`CompressedCache.seed_for`)."""
    return [seed + b for b in range(rows)] if isinstance(seed, int) else list(seed[:rows])


def eos_ids(model, tokenizer) -> set[int]:
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | (set(configured) if isinstance(configured, list) else {configured})
    ids.discard(None)
    return ids


def prefill_prompts(model, cache: CompressedCache, prompts: list[Prompt], mode: str, pad_id: int):
    """Run the prompt through ``cache``; return the next-token logits ``[B, vocab]`` and tokens seen per row.

    In ``context`` mode only the contexts are prefilled: the question is appended by :func:`_continue`.
    """
    seen = [0] * len(prompts)
    if mode == "query":
        cache.set_protected([len(p.question) for p in prompts])
        rows = [p.context + p.question for p in prompts]
    else:
        rows = [p.context for p in prompts]
    logits, _ = forward_rows(model, cache, rows, seen, pad_id)
    return logits[:, -1].float(), seen


def _continue(model, tokenizer, cache: CompressedCache, prompts: list[Prompt], mode: str, last_logits, seen,
              max_new_tokens: "int | Sequence[int]", stop: list[str], started: float,
              prefixes: "list[CacheStats] | None" = None) -> list[GenerationResult]:
    """Append the question (``context`` mode) to the compressed cache, then decode greedily, each row up to its
    own limit (:func:`row_limits`). ``prefixes``: each row's prefix stats (:func:`serve_prefixes`)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seen = list(seen)
    if mode == "context" and any(p.question for p in prompts):
        logits, mask = forward_rows(model, cache, [p.question for p in prompts], seen, pad_id)
        last_logits = torch.where(mask[:, -1:], logits[:, -1].float(), last_logits)
    prefill_seconds = time.perf_counter() - started
    watched_kept = [cache.span_retention(b, p.watched) if p.watched else None for b, p in enumerate(prompts)]
    eos = eos_ids(model, tokenizer)
    batch = len(prompts)
    limits = row_limits(max_new_tokens, batch)
    tokens = [[] for _ in range(batch)]
    logprobs = [[] for _ in range(batch)]
    done = [False] * batch
    decode_started = time.perf_counter()
    # The bytes after the prompt where they may fall later (shrinks_while_decoding), and after every step where they
    # may peak in between (peaks_between_steps); else the end is the peak.
    peaks = [cache.kv_bytes(b) if cache.shrinks_while_decoding else 0 for b in range(batch)]
    stepwise = cache.peaks_between_steps
    for _ in range(max(limits)):
        log_probs = torch.log_softmax(last_logits, dim=-1)
        next_ids = log_probs.argmax(dim=-1, keepdim=True)
        # One read from the device per step, not two per row (float64 holds every id and float32 exactly).
        chosen, chosen_logprobs = torch.cat([next_ids.double(), log_probs.gather(1, next_ids).double()], dim=1).T.tolist()
        chosen = [int(token) for token in chosen]
        for b in range(batch):
            if done[b]:
                continue
            token = chosen[b]
            if token in eos:
                done[b] = True
                continue
            tokens[b].append(token)
            logprobs[b].append(chosen_logprobs[b])
            if len(tokens[b]) == limits[b] or (stop and any(s in tokenizer.decode(tokens[b], skip_special_tokens=True)
                                                            for s in stop)):
                done[b] = True
        if all(done):  # a row at its limit is done: its last token is never fed back, as alone
            break
        # Finished rows get nothing (an all-padding row, never stored): their cache stays as at batch size 1.
        logits, _ = forward_rows(model, cache, [[] if done[b] else [chosen[b]] for b in range(batch)], seen, pad_id)
        last_logits = logits[:, -1].float()
        if stepwise:
            peaks = [max(peak, cache.kv_bytes(b)) for b, peak in enumerate(peaks)]
    decode_seconds = max(time.perf_counter() - decode_started, 1e-9)
    results = []
    for b in range(batch):
        text = tokenizer.decode(tokens[b], skip_special_tokens=True)
        for s in stop:
            text = text.split(s)[0]
        stats = cache.stats(row=b)
        results.append(GenerationResult(text, tokens[b], logprobs[b], stats, prefill_seconds,
                                        len(tokens[b]) / decode_seconds, decode_seconds, watched_kept[b],
                                        max(stats.kv_bytes, peaks[b]), None if prefixes is None else prefixes[b]))
    return results


def _generate_batch(model, tokenizer, prompts, policy, max_new_tokens, mode, stop, seed, kv_dtype, quantized_decode="auto"):
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seeds = row_seeds(seed, len(prompts))
    plan = plan_prefixes(prompts, mode, seeds, policy.reads_row_seed)
    cache = CompressedCache(model, policy, seed=plan.pick(seeds), kv_dtype=kv_dtype, quantized_decode=quantized_decode)
    started = time.perf_counter()
    last_logits, seen = prefill_prompts(model, cache, plan.pick(prompts), mode, pad_id)
    if cache.awaiting_reconstruction:  # KVzip: the reconstruction forwards, counted in the time to first token
        reconstruct_and_compress(model, tokenizer, cache, [p.context for p in plan.pick(prompts)], pad_id)
    cache, last_logits, seen, prefixes = serve_prefixes(model, cache, plan, last_logits, seen, mode)
    return _continue(model, tokenizer, cache, prompts, mode, last_logits, seen, max_new_tokens, stop, started, prefixes)


def reconstruct_and_compress(model, tokenizer, cache: CompressedCache, contexts: list[list[int]], pad_id: int) -> None:
    """KVzip's reconstruction forwards over every row's context (``contexts[b]``, what row ``b`` prefilled), then the
    compression its prefill deferred (:mod:`kveval.cache.reconstruction`). Each row alone, each chunk on a copy of
    the row that is then dropped: the rows never hold the reconstruction's tokens, and a batch keeps batch 1's."""
    policy = cache.policy.selection
    head, suffix = reconstruction.chat_split(tokenizer)
    first, later = reconstruction.prompt_ids(tokenizer)
    for b, context in enumerate(contexts):
        n, scores = len(context), {}
        for start, end, ids in reconstruction.repeat_inputs(context, head, suffix, policy.chunk, first, later):
            fork = cache.fork_rows([b])
            fork.observer = reconstruction.ReconstructionObserver(n, start, end, policy.sink, scores)
            forward_rows(model, fork, [ids], [n], pad_id)
        reconstruction.mark_kept(cache, b, n, scores)
    reconstruction.compress_reconstructed(cache)


def can_share_prefill(model, kv_dtype: "torch.dtype | None" = None) -> bool:
    """Whether one prefill can serve every policy bit-exactly on ``model`` with cache dtype ``kv_dtype``.

    A derived cache re-reads the prefill's ``kv_dtype`` tokens through the
    compute dtype (:meth:`CompressedCache.derive`); that is lossless when the
    model computes in float32/float64 or in ``kv_dtype`` itself, not across two
    different 16-bit dtypes (bfloat16 compute, float16 cache).
    """
    kv = cache_kv_dtype(model, kv_dtype)
    if rows_alone(model):  # its native layers' parts and states are built as each policy's prefill goes
        return False
    return model.dtype == kv or model.dtype in (torch.float32, torch.float64)


@torch.no_grad()
def generate_each(model, tokenizer, prompts: list[Prompt], policies: list, max_new_tokens: "int | Sequence[int]" = 32,
                  mode: str = "context", stop: list[str] | None = None, seed: "int | Sequence[int]" = 0,
                  kv_dtype: "torch.dtype | None" = None) -> Iterator[tuple[PolicyStack, list[GenerationResult]]]:
    """One batch (all ``prompts`` in one forward pass) under each policy in turn, from one prefill.

    The prefill runs once, uncompressed, keeping every attention score the
    policies need; then, one policy at a time, its cache is derived
    (:meth:`CompressedCache.derive`), the question appended and the answer
    decoded, and the cache released before the next: memory holds the shared
    prefill plus one policy's cache. Yields ``(policy, results)`` as each policy
    finishes, in the order given, so a caller can write them before the next
    starts. Results equal :func:`generate`'s for the same batch. Without
    :func:`can_share_prefill`, or for one policy, each policy runs its own prefill; so does a policy whose cache
    codes tokens on arrival (:attr:`PolicyStack.prefills_alone`: an engine's).
    ``prefill_seconds`` of every result counts the shared prefill as its own. Prompts of one context share one
    row of the prefill and continue from copies of it (:func:`plan_prefixes`, :func:`serve_prefixes`).
    """
    stacks = [require_stack(p, "generate_each") for p in policies]
    sharing = [s for s in stacks if not s.prefills_alone]  # an engine's cache attends over its codes from the start
    if len(sharing) < 2 or not can_share_prefill(model, kv_dtype):
        for stack in stacks:
            yield stack, _generate_batch(model, tokenizer, prompts, stack, max_new_tokens, mode, stop or [], seed, kv_dtype)
        return
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started = time.perf_counter()
    seeds = row_seeds(seed, len(prompts))
    plan = plan_prefixes(prompts, mode, seeds, any(s.reads_row_seed for s in sharing))
    shared = CompressedCache(model, PolicyStack(), seed=plan.pick(seeds), defer_compression=True, kv_dtype=kv_dtype,
                             scores_for=sharing)
    last_logits, seen = prefill_prompts(model, shared, plan.pick(prompts), mode, pad_id)
    shared.drop_batch_buffers()  # only its rows are read from now on: one cache in memory less
    shared_seconds = time.perf_counter() - started
    for stack in stacks:
        if stack.prefills_alone:
            yield stack, _generate_batch(model, tokenizer, prompts, stack, max_new_tokens, mode, stop or [], seed, kv_dtype)
            continue
        own_start = time.perf_counter() - shared_seconds
        cache, logits, rows_seen, prefixes = serve_prefixes(model, shared.derive(stack), plan, last_logits, seen, mode)
        results = _continue(model, tokenizer, cache, prompts, mode, logits, rows_seen, max_new_tokens, stop or [],
                            own_start, prefixes)
        del cache  # released before the next policy's cache is derived
        yield stack, results


@torch.no_grad()
def generate_many(model, tokenizer, prompts: list[Prompt], policies: list, max_new_tokens: "int | Sequence[int]" = 32,
                  mode: str = "context",
                  batch_size: int = 1, stop: list[str] | None = None, seed: "int | Sequence[int]" = 0,
                  kv_dtype: "torch.dtype | None" = None) -> dict[str, list[GenerationResult]]:
    """Generate under several policies with one prefill per batch for all of them (:func:`generate_each`).

    Results are identical to separate :func:`generate` calls, and the request
    is checked as :func:`generate` checks it. Returns ``{policy spec: results}``.
    """
    check_request(model, prompts, max_new_tokens, mode, batch_size)
    limits = row_limits(max_new_tokens, len(prompts))
    batch_size = forward_batch_size(model, batch_size)
    stacks = list({s.spec: s for s in (require_stack(p, "generate_each") for p in policies)}.values())
    for stack in stacks:
        check_mode(stack, mode)
    out = {s.spec: [] for s in stacks}
    for first in range(0, len(prompts), batch_size):
        for stack, results in generate_each(model, tokenizer, prompts[first:first + batch_size], stacks,
                                            limits[first:first + batch_size], mode, stop,
                                            batch_seeds(seed, first, batch_size), kv_dtype):
            out[stack.spec] += results
    return out
