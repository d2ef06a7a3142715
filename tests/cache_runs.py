"""Shared helpers of the cache tests on tiny models: random inputs, compressed forwards, and the exactness checks.

Token ids are drawn from 1..127 (the tiny models' vocabulary of 128, 0 left out).
"""

import pytest
import torch

from kveval.cache.compressed import CompressedCache
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate, generate_many
from kveval.runner.runspec import RunSpec
from kveval.dtypes import parse_kv_dtype


def random_ids(n: int, seed: int) -> torch.Tensor:
    """``[1, n]`` random token ids, the same for the same seed."""
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def random_prompts(sizes, seed: int) -> list[Prompt]:
    """One prompt of random ids per ``(context, question)`` length pair, drawn in order from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(1, 128, (n,), generator=g).tolist(), torch.randint(1, 128, (q,), generator=g).tolist())
            for n, q in sizes]


def prefill(model, spec, ids: torch.Tensor, kv_dtype=None) -> CompressedCache:
    """The cache after one forward over ``ids`` (``[1, n]``) under ``spec``."""
    cache = CompressedCache(model, parse_policy(spec), kv_dtype=parse_kv_dtype(kv_dtype))
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


def context_then_steps(model, spec, context, steps, kv_dtype=None) -> tuple[list[torch.Tensor], CompressedCache]:
    """Prefill ``context`` (then compressed), then feed ``steps`` one token at a time; the logits of every forward."""
    cache = CompressedCache(model, parse_policy(spec), kv_dtype=parse_kv_dtype(kv_dtype))
    n = context.shape[1]
    with torch.no_grad():
        logits = [model(context, cache=cache, position_ids=torch.arange(n)[None]).logits]
        for i in range(steps.shape[1]):
            logits.append(model(steps[:, i:i + 1], cache=cache, position_ids=torch.tensor([[n + i]])).logits)
    return logits, cache


def context_then_question(model, spec, context, question, kv_dtype=None) -> tuple[torch.Tensor, CompressedCache]:
    """Prefill ``context`` (then compressed), then ``question`` in one forward; the question's logits."""
    cache = CompressedCache(model, parse_policy(spec), kv_dtype=parse_kv_dtype(kv_dtype))
    n, q = context.shape[1], question.shape[1]
    with torch.no_grad():
        model(context, cache=cache, position_ids=torch.arange(n)[None])
        logits = model(question, cache=cache, position_ids=torch.arange(n, n + q)[None]).logits
    return logits, cache


def logit_errors(model, specs, context, question, kv_dtype=None) -> list[float]:
    """Mean squared difference of each spec's question logits from the uncompressed cache's, in ``specs`` order."""
    base, _ = context_then_question(model, "none", context, question, kv_dtype)
    return [(context_then_question(model, spec, context, question, kv_dtype)[0] - base).pow(2).mean().item()
            for spec in specs]


def fingerprint(result):
    """Everything a generation result says about the answer and the cache, timings excluded."""
    s = result.stats
    return (result.text, result.token_ids, result.logprobs, s.kv_bytes, s.nominal_bytes, s.index_bytes, s.tokens_seen,
            s.kept_tokens, s.state_bytes, s.kv_dtype)


def assert_shared_prefill_equals_own_runs(model, tokenizer, prompts, specs, **kwargs) -> dict:
    """One prefill for every spec (``generate_many``) gives each spec's own ``generate`` results, exactly.

    Returns ``generate_many``'s results, keyed by canonical spec.
    """
    stacks = [parse_policy(s) for s in specs]
    kwargs = _typed(kwargs)
    shared = generate_many(model, tokenizer, prompts, stacks, **kwargs)
    for stack in stacks:
        alone = generate(model, tokenizer, prompts, stack, **kwargs)
        assert [fingerprint(r) for r in shared[stack.spec]] == [fingerprint(r) for r in alone], stack.spec
    return shared


def _typed(kwargs: dict) -> dict:
    """Generation keyword arguments with a dtype name parsed, as a command's edge would."""
    return {**kwargs, "kv_dtype": parse_kv_dtype(kwargs["kv_dtype"])} if "kv_dtype" in kwargs else kwargs


def assert_one_batch_equals_batch_size_one(model, tokenizer, prompts, spec, **kwargs) -> list:
    """All ``prompts`` in one batch give batch size 1's tokens, bytes and kept tokens.

    Log-probabilities are not compared: padding changes the float rounding of a
    batch. Returns the batch size 1 results.
    """
    stack, kwargs = parse_policy(spec), _typed(kwargs)
    one = generate(model, tokenizer, prompts, stack, batch_size=1, **kwargs)
    batch = generate(model, tokenizer, prompts, stack, batch_size=len(prompts), **kwargs)

    def held(r):
        return r.token_ids, r.stats.kv_bytes, r.stats.index_bytes, r.stats.kept_tokens

    assert [held(r) for r in one] == [held(r) for r in batch], spec
    return one


def assert_one_line_error(build, error: type[Exception], message: str) -> None:
    """``build()`` raises ``error`` matching ``message``, in one line (what the CLI prints)."""
    with pytest.raises(error, match=message) as info:
        build()
    assert "\n" not in str(info.value)


def specs_of(policies, mode: str = "context") -> list[RunSpec]:
    """Policy specs (or RunSpecs) as the RunSpecs :func:`kveval.runner.evaluate.evaluate_policies` takes, in order:
    a test's own edge, where a command would call :meth:`RunSpec.parse`."""
    return [p if isinstance(p, RunSpec) else RunSpec.parse(p, default_mode=mode) for p in policies]
