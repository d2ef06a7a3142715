"""The generation driver: per-row bytes that do not depend on the batch (EOS enabled), one request check."""

import pytest
import torch

from kveval.errors import UsageError
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate, generate_many
from kveval.dtypes import parse_kv_dtype

from tiny_models import Tok, tiny_gemma3, tiny_llama


def _prompts(seed=10):
    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(1, 128, (n,), generator=g).tolist(), torch.randint(1, 128, (q,), generator=g).tolist())
            for n, q in [(37, 5), (64, 3), (20, 7), (51, 4), (44, 2), (29, 6)]]


def _eos_that_stops_rows_at_different_steps(model, prompts, steps, spec="none"):
    """An id that ends at least two rows early, at different steps (chosen from the generations without EOS)."""
    free = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=steps)
    for token in sorted({t for r in free for t in r.token_ids[1:]}):
        firsts = [r.token_ids.index(token) for r in free if token in r.token_ids]
        if len(set(firsts)) >= 2 and min(firsts) >= 1 and len(firsts) < len(prompts):
            return token, firsts
    raise AssertionError("no token stops rows at different steps; pick other prompts")


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("spec", ["none", "kivi(bits=2,group=4,residual=8)", "h2o(ratio=0.5,decode_budget=30)",
                                  "snapkv(ratio=0.5,window=4)+quant(bits=4,group=8)"])
def test_rows_that_stop_early_measure_the_same_at_any_batch_size(make, spec):
    model = make()
    prompts = _prompts()
    eos, _ = _eos_that_stops_rows_at_different_steps(model, prompts, 12, spec)
    model.generation_config.eos_token_id = eos
    one = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=12, batch_size=1)
    four = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=12, batch_size=4)
    stopped = sorted(len(r.token_ids) for r in one if len(r.token_ids) < 12)
    assert len(set(stopped)) >= 2  # the batch holds rows that end at different steps
    assert [r.token_ids for r in four] == [r.token_ids for r in one]
    for a, b in zip(one, four):
        assert (b.stats.kv_bytes, b.stats.tokens_seen, b.stats.kept_tokens) == \
               (a.stats.kv_bytes, a.stats.tokens_seen, a.stats.kept_tokens)


def test_a_finished_row_stops_growing():
    model = tiny_llama()
    prompts = _prompts()
    eos, _ = _eos_that_stops_rows_at_different_steps(model, prompts, steps=12)
    model.generation_config.eos_token_id = eos
    results = generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=12, batch_size=len(prompts))
    for prompt, result in zip(prompts, results):
        # The prompt, then every generated token but the last one (nothing is fed after it); EOS is never fed.
        assert result.stats.tokens_seen == [prompt.length + max(0, len(result.token_ids) - (len(result.token_ids) == 12))]


@pytest.mark.parametrize("entry", ["generate", "generate_many"])
@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "Query"}, "mode='Query'"),
    ({"batch_size": 0}, "batch_size=0"),
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"prompts": [Prompt([])]}, "at least one context token"),
    ({"prompts": [Prompt(list(range(1, 1020)))]}, "exceeds the model's 1024 positions"),
])
def test_generate_many_checks_requests_as_generate_does(entry, kwargs, message):
    model = tiny_llama()
    request = {"prompts": [Prompt([1, 2, 3], [4])], "max_new_tokens": 8, **kwargs}
    policies = ["snapkv(ratio=0.25,window=4)", "snapkv(ratio=0.5,window=4)"]  # one shared prefill
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        if entry == "generate":
            generate(model, Tok(), policy=parse_policy(policies[0]), **request)
        else:
            generate_many(model, Tok(), policies=[parse_policy(p) for p in policies], **request)


def test_kv_dtype_reaches_every_result():
    model = tiny_llama()
    prompts = _prompts()[:2]
    policies = [parse_policy(p).spec for p in ("snapkv(ratio=0.25,window=4)", "snapkv(ratio=0.5,window=4)")]
    for kv_dtype, name in ((None, "bfloat16"), ("float16", "float16"), ("float32", "float32")):
        typed = parse_kv_dtype(kv_dtype)
        alone = generate(model, Tok(), prompts, parse_policy(policies[0]), max_new_tokens=4, kv_dtype=typed)
        shared = generate_many(model, Tok(), prompts, [parse_policy(p) for p in policies], max_new_tokens=4, kv_dtype=typed)
        assert {r.stats.kv_dtype for r in alone + shared[policies[0]] + shared[policies[1]]} == {name}
        assert [r.stats.kv_bytes for r in shared[policies[0]]] == [r.stats.kv_bytes for r in alone]
