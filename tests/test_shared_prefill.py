"""One prefill for every policy of a sweep: each policy's results equal a separate run's, bit for bit.

Exactness is checked at two levels: :func:`generate_many` against one
:func:`generate` per policy (tokens, log-probabilities, every byte count and
kept-token count), and :func:`evaluate_policies` with all policies in one call
against one call per policy (every field of every item record except timings).
"""

import gc
import json
import weakref
from dataclasses import replace

import pytest
import torch
from test_run_folders import CharTok, _items

import kveval.runner.generation as generation
from kveval.cache.compressed import CompressedCache
from kveval.policies.spec import parse_policy
from kveval.runner.evaluate import evaluate_policies
from kveval.runner.generation import Prompt, can_share_prefill, generate_many
from kveval.dtypes import parse_kv_dtype

from cache_runs import assert_shared_prefill_equals_own_runs, fingerprint, random_prompts, specs_of
from tiny_models import ARCHITECTURES, Tok, tiny_gemma3, tiny_llama, tiny_model

#: Every policy family, several scores per kind (two SnapKV windows, PyramidKV sharing one), stacks.
POLICIES = [
    "none", "window(size=24)", "streaming(sink=2,window=12)", "h2o(ratio=0.5)", "h2o(ratio=0.5,decode_budget=30)",
    "snapkv(ratio=0.5,window=4)", "snapkv(ratio=0.25,window=8)", "pyramidkv(ratio=0.5,window=4)", "tova(ratio=0.5)",
    "knorm(ratio=0.5)", "random(ratio=0.5)", "quant(bits=4,group=8)", "kivi(bits=2,group=4,residual=8)", "fp8(group=8)",
    "lowrank(k_rank=8,v_rank=4)", "snapkv(ratio=0.5,window=4)+kivi(bits=4,group=4,residual=8)",
    "tova(ratio=0.5,decode_budget=30)+quant(bits=8,group=8)", "lowrank(k_rank=8,v_rank=4)+quant(bits=8,group=4)",
]
#: Timings differ between runs; everything else in an item record must not.
TIMINGS = ("ttft_s", "decode_tokens_per_s")

pytestmark = pytest.mark.usefixtures("calibration_cache")  # low-rank calibrates into each test's own folder


def _prompts(seed=21):
    return random_prompts([(47, 5), (64, 3), (30, 7)], seed)


@pytest.mark.parametrize("mode", ["context", "query"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_every_policy_from_one_prefill_equals_its_own_run(make, mode):
    shared = assert_shared_prefill_equals_own_runs(make(), Tok(), _prompts(), POLICIES, max_new_tokens=6, mode=mode,
                                                   batch_size=2, seed=5)
    # The comparison can fail: policies really differ from one another in what they keep.
    assert len({repr([fingerprint(r)[3:] for r in results]) for results in shared.values()}) > len(POLICIES) // 2


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_shares_its_prefill_exactly(name):
    """Sliding and chunked layers, MLA latents, linear-attention/Mamba states (copied per policy), sinks, softcaps."""
    specs = ["none", "h2o(ratio=0.5,decode_budget=40)", "snapkv(ratio=0.5,window=4)+kivi(bits=4,group=4,residual=8)"]
    assert_shared_prefill_equals_own_runs(tiny_model(name), Tok(), _prompts(8), specs, max_new_tokens=4, batch_size=3)


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_exact_in_every_cache_dtype(kv_dtype):
    specs = ["snapkv(ratio=0.5,window=4)+kivi(bits=4,group=4,residual=8)", "h2o(ratio=0.5)", "lowrank(k_rank=8,v_rank=4)"]
    assert_shared_prefill_equals_own_runs(tiny_llama(), Tok(), _prompts(4), specs, max_new_tokens=5, kv_dtype=kv_dtype)


def test_the_prefill_keeps_only_the_scores_present_policies_need():
    model = tiny_llama()
    policies = ["snapkv(ratio=0.5,window=4)", "pyramidkv(ratio=0.3,window=4)", "snapkv(ratio=0.5,window=8)", "h2o(ratio=0.5)",
                "quant(bits=8,group=8)", "knorm(ratio=0.5)", "random(ratio=0.5)"]
    cache = CompressedCache(model, parse_policy("none"), defer_compression=True, scores_for=[parse_policy(p) for p in policies])
    assert cache.score_keys == [("window", 4), ("window", 8), ("all", None)]
    with torch.no_grad():
        model(torch.arange(1, 30)[None], cache=cache)
    for layer in cache.attention_layers:
        assert set(layer.rows[0].scores) == {("window", 4), ("window", 8), ("all", None)}
        assert layer.rows[0].store.length == 29  # nothing compressed yet
    no_scores = CompressedCache(model, parse_policy("none"), defer_compression=True, scores_for=[parse_policy("quant(bits=8,group=8)"), parse_policy("knorm(ratio=0.5)"), parse_policy("none")])
    assert no_scores.score_keys == []
    with pytest.raises(ValueError, match="scores_for"):
        no_scores.derive(parse_policy("tova(ratio=0.5)"))


def test_one_policy_cache_at_a_time(monkeypatch):
    """Each derived cache is released before the next is derived: memory holds the prefill plus one policy."""
    alive: list[weakref.ref] = []
    derive = CompressedCache.derive

    def watched(self, policy):
        gc.collect()
        assert all(ref() is None for ref in alive), "a previous policy's cache is still held"
        cache = derive(self, policy)
        alive.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(CompressedCache, "derive", watched)
    specs = ["none", "h2o(ratio=0.5)", "kivi(bits=2,group=4,residual=8)", "snapkv(ratio=0.5,window=4)"]
    shared = generate_many(tiny_llama(), Tok(), _prompts(), [parse_policy(p) for p in specs], max_new_tokens=4, batch_size=3)
    assert len(alive) == len(specs) and all(len(r) == 3 for r in shared.values())


def test_mixed_sixteen_bit_dtypes_fall_back_to_one_prefill_per_policy(monkeypatch):
    model = tiny_llama()
    assert can_share_prefill(model, parse_kv_dtype("bfloat16")) and can_share_prefill(model.to(torch.bfloat16), parse_kv_dtype("bfloat16"))
    assert not can_share_prefill(model, parse_kv_dtype("float16"))  # bfloat16 compute cannot hold every float16 value
    monkeypatch.setattr(CompressedCache, "derive", lambda *a: pytest.fail("derived across 16-bit dtypes"))
    assert_shared_prefill_equals_own_runs(model, Tok(), _prompts()[:2], ["none", "snapkv(ratio=0.5,window=4)"],
                                          max_new_tokens=3, kv_dtype="float16")


# --- kveval eval / sweep: run folders ----------------------------------------------------------------

EVAL_POLICIES = ["none", "quant(bits=4,group=8)", "snapkv(ratio=0.5,window=4)", "h2o(ratio=0.5)+kivi(bits=4,group=4,residual=8)",
                 "streaming(sink=2,window=12)", "random(ratio=0.5)"]


def _eval_items():
    return _items("the pass key is 42. " * 3, n=3) + [
        replace(item, id=f"other-{i}") for i, item in enumerate(_items("a note: the key is 7. then filler text follows. " * 2, n=2))]


def _records(run_dir):
    """Item records of a run folder as dicts, timings removed, in file order."""
    out = []
    for line in (run_dir / "items.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in TIMINGS:
            record["metrics"].pop(key)
        out.append(record)
    return out


@pytest.mark.parametrize("mode", ["context", "query"])
def test_a_sweep_call_writes_what_separate_calls_write(tmp_path, mode):
    model, items = tiny_llama(), _eval_items()
    together = evaluate_policies(model, CharTok(), items, specs_of(EVAL_POLICIES, mode=mode), tmp_path / "together", "org/M", batch_size=2)
    for policy, run_dir in zip(EVAL_POLICIES, together):
        (alone,) = evaluate_policies(model, CharTok(), items, specs_of([policy], mode=mode), tmp_path / "alone", "org/M", batch_size=2)
        assert _records(run_dir) == _records(alone), policy
        assert len(_records(run_dir)) == len(items)


class _Killed(Exception):
    pass


class _KillAfter:
    """A progress bar that kills the run after ``n`` written (item, policy) pairs."""

    def __init__(self, n):
        self.left = n

    def update(self, k):
        if k == 0:
            return
        self.left -= k
        if self.left <= 0:
            raise _Killed


def test_a_sweep_killed_between_policies_of_one_prefill_resumes_without_recomputing(tmp_path, monkeypatch):
    model, items = tiny_llama(), _eval_items()
    reference = evaluate_policies(model, CharTok(), items, specs_of(EVAL_POLICIES), tmp_path / "reference", "org/M", batch_size=2)
    asked: list[tuple[str, ...]] = []
    real = generation.generate_each

    def recording(model, tokenizer, prompts, policies, *args, **kwargs):
        for stack, results in real(model, tokenizer, prompts, policies, *args, **kwargs):
            asked.append((stack.spec, tuple(tuple(p.context + p.question) for p in prompts)))
            yield stack, results

    monkeypatch.setattr(generation, "generate_each", recording)
    # 2 items per batch: killed once the first prefill's 2nd policy has written both its items.
    with pytest.raises(_Killed):
        evaluate_policies(model, CharTok(), items, specs_of(EVAL_POLICIES), tmp_path / "run", "org/M", batch_size=2, progress=_KillAfter(4))
    first = list(asked)
    assert len(first) == 2
    asked.clear()
    dirs = evaluate_policies(model, CharTok(), items, specs_of(EVAL_POLICIES), tmp_path / "run", "org/M", batch_size=2)
    # Nothing finished is computed again: the first batch reruns only the policies not written for both items.
    assert not set(first[:2]) & set(asked)
    assert len(asked) == len(EVAL_POLICIES) * 3 - 2  # batches of 2, 2 and 1 items, each policy once, less the 2 done
    for run_dir, expected in zip(dirs, reference):
        records = _records(run_dir)
        assert sorted(r["id"] for r in records) == sorted(item.id for item in items)  # none lost, none twice
        assert sorted(records, key=lambda r: r["id"]) == sorted(_records(expected), key=lambda r: r["id"])


# --- the embedded models (slow: run under the heavy lock) --------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, mode", [("smollm2-135m", "context"), ("gemma3-270m", "query")])
def test_embedded_model_from_one_prefill_equals_its_own_runs(name, mode):
    from kveval.probes import encode_item, generate_items
    from kveval.runner.models import load_model

    model, tokenizer = load_model(name)
    items = generate_items("passkey", tokenizer, 320, 2, seed=0)
    prompts = [Prompt(*encode_item(tokenizer, item)) for item in items]
    policies = ("none", "kivi(bits=4)", "snapkv(ratio=0.5)+quant(bits=8)", "h2o(ratio=0.5)", "streaming(sink=4,window=60)")
    if name == "gemma3-270m":  # the slowest model on a CPU: the three that cover quantization, selection and a stack
        policies = policies[:3]
    assert_shared_prefill_equals_own_runs(model, tokenizer, prompts, policies, max_new_tokens=8, mode=mode, batch_size=2)
