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

Cache bytes are measured against ``kv_dtype``, the deployment's cache dtype
(default: the checkpoint's, see :func:`kveval.storage.deployment_kv_dtype`),
whatever dtype the model computes in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kveval.cache import CacheStats, CompressedCache
from kveval.errors import UsageError
from kveval.policies import PolicyStack, parse_policy

MODES = ("context", "query")


@dataclass
class Prompt:
    """Token ids of one prompt, split where compression happens in ``context`` mode."""

    context: list[int]
    question: list[int] = field(default_factory=list)

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
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    stats: CacheStats
    prefill_seconds: float
    decode_tokens_per_second: float


def encode_prompt(tokenizer, context: str, question: str = "", chat: bool | None = None) -> Prompt:
    """Tokenize a prompt as context and question, exactly as the probes do (:func:`kveval.prompts.encode_text`).

    The chat template is applied when the tokenizer has one (unless
    ``chat=False``) to the user message ``context + "\n\n" + question``; its
    head belongs to the context, its tail (the assistant turn) to the question.
    """
    from kveval.prompts import encode_text

    return Prompt(*encode_text(tokenizer, context, question, chat))


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        if r:
            ids[b, width - len(r):] = torch.tensor(r, dtype=torch.long, device=device)
            mask[b, width - len(r):] = True
    return ids, mask


def forward_rows(model, cache: CompressedCache, rows: list[list[int]], seen: list[int], pad_id: int,
                 logits_to_keep: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One left-padded forward pass that appends ``rows[b]`` to row ``b`` of ``cache``.

    ``seen[b]`` (tokens row ``b`` has processed so far) is advanced in place.
    Returns the logits of the last ``logits_to_keep`` columns (0: all) ``[B, columns, vocab]``
    and the real-token mask ``[B, width]``.
    """
    device = model.device
    ids, mask = _left_pad(rows, pad_id, device)
    start = torch.tensor(seen, device=device)[:, None]
    position_ids = (start + mask.long().cumsum(dim=1) - 1).clamp(min=0)
    cache.set_input_mask(mask)
    # Generation needs the last column only: skip the [B, width, vocab] projection of the rest.
    logits = model(input_ids=ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep,
                   attention_mask=cache.model_attention_mask()).logits  # None unless state layers must skip padding
    for b, r in enumerate(rows):
        seen[b] += len(r)
    return logits, mask


def check_request(model, prompts: list[Prompt], max_new_tokens: int, mode: str, batch_size: int) -> None:
    """Refuse a generation request that cannot run as asked (one line naming the fix); shared by every entry point."""
    if mode not in MODES:
        raise UsageError(f"mode={mode!r}; use 'context' (compress before the question) or 'query' (compress with it)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"batch_size={batch_size!r} must be an integer of at least 1")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UsageError(f"max_new_tokens={max_new_tokens!r} must be an integer of at least 1")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    for p in prompts:
        if limit and p.length + max_new_tokens > limit:
            raise UsageError(f"prompt of {p.length} tokens + {max_new_tokens} new tokens exceeds the model's {limit} positions; use a shorter context")
        if not p.context:
            raise UsageError("a prompt needs at least one context token")


@torch.no_grad()
def generate(model, tokenizer, prompts: list[Prompt], policy: "str | PolicyStack" = "none", max_new_tokens: int = 32,
             mode: str = "context", batch_size: int = 1, stop: list[str] | None = None, seed: int = 0,
             kv_dtype: "str | torch.dtype | None" = None) -> list[GenerationResult]:
    """Greedy decoding of ``prompts`` with ``policy`` applied at prefill and during decoding.

    Parameters
    ----------
    model, tokenizer
        From :func:`kveval.models.load_model` (any causal LM loaded with ``attn_implementation="kveval"``).
    prompts : list of Prompt
        Token ids; see :func:`encode_prompt` for plain text.
    policy : str or PolicyStack
        Compression policy spec.
    max_new_tokens : int
        Generation stops at EOS, a stop string, or this many tokens.
    mode : {"context", "query"}
        Compress the context before the question is seen, or with it.
    batch_size : int
        Rows per forward pass; results do not depend on it.
    stop : list of str, optional
        Stop strings; the text is cut before the first one.
    seed : int
        Seed of the ``random`` control policy (row ``i`` of the whole list uses ``seed + i``).
    kv_dtype : str or torch.dtype, optional
        The deployment's cache dtype (``"bfloat16"``, ``"float16"``, ``"float32"``): full-precision
        tokens are stored in it and ratios are stated against it. Default: the checkpoint's.
    """
    check_request(model, prompts, max_new_tokens, mode, batch_size)
    policy = parse_policy(policy)
    results = []
    for first in range(0, len(prompts), batch_size):
        results += _generate_batch(model, tokenizer, prompts[first:first + batch_size], policy, max_new_tokens, mode,
                                   stop or [], seed + first, kv_dtype)
    return results


def _eos_ids(model, tokenizer) -> set[int]:
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | (set(configured) if isinstance(configured, list) else {configured})
    ids.discard(None)
    return ids


def _prefill(model, cache: CompressedCache, prompts: list[Prompt], mode: str, pad_id: int):
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
              max_new_tokens: int, stop: list[str], started: float) -> list[GenerationResult]:
    """Append the question (``context`` mode) to the compressed cache, then decode greedily."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seen = list(seen)
    if mode == "context" and any(p.question for p in prompts):
        logits, mask = forward_rows(model, cache, [p.question for p in prompts], seen, pad_id)
        last_logits = torch.where(mask[:, -1:], logits[:, -1].float(), last_logits)
    prefill_seconds = time.perf_counter() - started
    eos = _eos_ids(model, tokenizer)
    batch = len(prompts)
    tokens = [[] for _ in range(batch)]
    logprobs = [[] for _ in range(batch)]
    done = [False] * batch
    decode_started = time.perf_counter()
    for step in range(max_new_tokens):
        log_probs = torch.log_softmax(last_logits, dim=-1)
        next_ids = log_probs.argmax(dim=-1)
        for b in range(batch):
            if done[b]:
                continue
            token = int(next_ids[b])
            if token in eos:
                done[b] = True
                continue
            tokens[b].append(token)
            logprobs[b].append(float(log_probs[b, token]))
            if stop and any(s in tokenizer.decode(tokens[b], skip_special_tokens=True) for s in stop):
                done[b] = True
        if all(done) or step == max_new_tokens - 1:
            break
        # Finished rows get nothing (an all-padding row, never stored): their cache stays as at batch size 1.
        logits, _ = forward_rows(model, cache, [[] if done[b] else [int(next_ids[b])] for b in range(batch)], seen, pad_id)
        last_logits = logits[:, -1].float()
    decode_seconds = max(time.perf_counter() - decode_started, 1e-9)
    results = []
    for b in range(batch):
        text = tokenizer.decode(tokens[b], skip_special_tokens=True)
        for s in stop:
            text = text.split(s)[0]
        results.append(GenerationResult(text, tokens[b], logprobs[b], cache.stats(row=b), prefill_seconds,
                                        len(tokens[b]) / decode_seconds))
    return results


def _generate_batch(model, tokenizer, prompts, policy, max_new_tokens, mode, stop, seed, kv_dtype):
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cache = CompressedCache(model, policy, seed=seed, kv_dtype=kv_dtype)
    started = time.perf_counter()
    last_logits, seen = _prefill(model, cache, prompts, mode, pad_id)
    return _continue(model, tokenizer, cache, prompts, mode, last_logits, seen, max_new_tokens, stop, started)


def shares_prefill(policies: list[PolicyStack]) -> bool:
    """Whether ``policies`` differ only in the selection's ratio/budget, so one prefill can serve them all."""
    def key(p: PolicyStack):
        sel = p.selection
        params = None if sel is None else (type(sel), tuple((k, v) for k, v in vars(sel).items() if k not in ("ratio", "budget")))
        return params, p.structure, p.quantization
    return len(policies) > 1 and policies[0].selection is not None and len({repr(key(p)) for p in policies}) == 1


@torch.no_grad()
def generate_many(model, tokenizer, prompts: list[Prompt], policies: list, max_new_tokens: int = 32, mode: str = "context",
                  batch_size: int = 1, stop: list[str] | None = None, seed: int = 0,
                  kv_dtype: "str | torch.dtype | None" = None) -> dict[str, list[GenerationResult]]:
    """Generate under several policies; one prefill serves all when they differ only in ratio/budget.

    The prefill is stored uncompressed with the policy's scores, and each
    budget's cache is derived from the same scores
    (:meth:`CompressedCache.compressed_copy`): results are identical to
    separate :func:`generate` calls, and the request is checked as :func:`generate` checks it.
    Returns ``{policy spec: results}``.
    """
    check_request(model, prompts, max_new_tokens, mode, batch_size)
    stacks = [parse_policy(p) for p in policies]
    if not shares_prefill(stacks):
        return {s.spec: generate(model, tokenizer, prompts, s, max_new_tokens, mode, batch_size, stop, seed, kv_dtype)
                for s in stacks}
    out = {s.spec: [] for s in stacks}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        started = time.perf_counter()
        deferred = CompressedCache(model, stacks[0], seed=seed + first, defer_compression=True, kv_dtype=kv_dtype)
        last_logits, seen = _prefill(model, deferred, batch, mode, pad_id)
        shared_seconds = time.perf_counter() - started
        for stack in stacks:
            own_start = time.perf_counter() - shared_seconds  # each result reports the shared prefill as its own
            cache = deferred.compressed_copy(stack)
            out[stack.spec] += _continue(model, tokenizer, cache, batch, mode, last_logits, seen, max_new_tokens, stop or [], own_start)
    return out
