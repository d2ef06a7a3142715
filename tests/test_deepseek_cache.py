"""DeepSeek V3.2 and V4 through their own cache layers, mirrored part by part (kveval.cache.native_layers).

Tiny random configs (tests/tiny_models.py NATIVE_ARCHITECTURES): V3.2 with a 16-wide latent, an 8-wide RoPE key and
16-wide indexer keys choosing 8 tokens; V4 with a window of 8, CSA every 4 tokens (16-wide indexer, top 3) and HCA
every 16; GLM's MoE-DSA as V3.2, its second layer reusing the first's top-k. ``none`` equals the model's own eager forward with transformers' own cache, through prefill, a question
in one forward and decode steps (pending tokens at every forward's end, windows closed by decode steps, CSA's
overlap carried across calls); every part's bytes equal the count by hand; quantization codes every part below
the native cache; a selection on V3.2's latent takes the indexer keys with it; batch 3 gives each row's answers
alone; what cannot be expressed is refused in one line.
"""

import json
import math
import re

import pytest
import torch
from transformers import DynamicCache

from kveval.cache.compressed import CompressedCache
from kveval.cache.exactness import measure_exactness
from kveval.errors import PolicySpecError, UnsupportedModelError
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate

from tiny_models import Tok, tiny_model

FP32 = torch.float32
NATIVE = ["deepseek_v32", "deepseek_v4", "glm_moe_dsa"]


def _ids(n, seed):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _three_calls(model, cache, context=21, question=6, steps=18):
    """Prefill ``context`` tokens, a question of ``question`` tokens in one forward, then ``steps`` greedy steps; the
    logits of every forward. 21 and 27 leave pending tokens in both compressors; the steps close windows."""
    ids = _ids(context + question, 0)
    out = [model(ids[:, :context], cache=cache, position_ids=torch.arange(context)[None]).logits,
           model(ids[:, context:], cache=cache, position_ids=torch.arange(context, context + question)[None]).logits]
    nxt, n = out[-1][:, -1:].argmax(-1), context + question
    for step in range(steps):
        out.append(model(nxt, cache=cache, position_ids=torch.tensor([[n + step]])).logits)
        nxt = out[-1][:, -1:].argmax(-1)
    return out


@pytest.mark.parametrize("name", NATIVE)
def test_none_is_the_models_own_forward_across_calls(name):
    model, reference = tiny_model(name), tiny_model(name, attn="eager")
    cache = CompressedCache(model, parse_policy("none"), kv_dtype=FP32)
    ours, theirs = _three_calls(model, cache), _three_calls(reference, DynamicCache(config=reference.config))
    difference = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    # V4 attends through the model's own eager function (its sinks): the same bits. V3.2 through SDPA: its rounding.
    assert difference == 0.0 if name == "deepseek_v4" else difference <= 1e-5
    stats = cache.stats()
    assert stats.kv_bytes == stats.nominal_bytes and stats.parts == stats.nominal_parts


def test_v4_holds_what_its_own_cache_holds():
    """After the three calls (45 tokens), kveval's parts are the model's own cache's tensors."""
    model, reference = tiny_model("deepseek_v4"), tiny_model("deepseek_v4", attn="eager")
    cache, own = CompressedCache(model, parse_policy("none"), kv_dtype=FP32), DynamicCache(config=reference.config)
    _three_calls(model, cache), _three_calls(reference, own)
    for i in (1, 2):
        mine, theirs = cache.layers[i], own.layers[i]
        for name, part in mine.entry_parts.items():
            assert mine.entry_count[name] == theirs.entry_count[name]
            torch.testing.assert_close(mine.parts[part][0].read(1, "cpu"), theirs.compressed_kv[name], atol=0, rtol=0)
            torch.testing.assert_close(mine.read_state(f"buffer_kv/{name}"), theirs.buffer_kv[name], atol=0, rtol=0)
    torch.testing.assert_close(cache.layers[1].read_state("overlap_kv/indexer"), own.layers[1].overlap_kv["indexer"])


@pytest.mark.parametrize("kv_dtype, item", [(FP32, 4), (torch.bfloat16, 2)])
def test_v4_bytes_per_part_are_the_count_by_hand(kv_dtype, item):
    model = tiny_model("deepseek_v4")
    cache = CompressedCache(model, parse_policy("none"), kv_dtype=kv_dtype)
    _three_calls(model, cache)  # 21 + 6 + 18 = 45 tokens
    stats = cache.stats()
    seen = 45
    assert stats.tokens_seen == [seen]
    assert stats.parts == {
        "window": 3 * 7 * 32 * item,  # every layer: the last window - 1 K=V entries of head_dim 32
        "csa": (seen // 4) * 32 * item,  # one entry per 4 tokens
        "indexer": (seen // 4) * 16 * item,  # and one indexer key of 16 per entry
        "hca": (seen // 16) * 32 * item,  # one entry per 16 tokens
    }
    assert stats.kv_bytes == sum(stats.parts.values())
    # State: the tokens waiting for their window (kv and gate: CSA 2 x 32 wide, its indexer 2 x 16, HCA 32), each
    # window's overlap half (4 x 32, 4 x 16), kv and gate, in the cache dtype (this model computes every one in its
    # own float32; a bfloat16 model's overlap gates carry its float32 bias, and are held so).
    csa_pending, hca_pending = seen % 4, seen % 16
    pending = (csa_pending * (64 + 32) + hca_pending * 32) * 2 * item
    overlap = (4 * 32 + 4 * 16) * 2 * item
    assert stats.state_bytes == pending + overlap


def test_v32_bytes_per_part_are_the_count_by_hand():
    model = tiny_model("deepseek_v32")
    cache = CompressedCache(model, parse_policy("none"), kv_dtype=torch.bfloat16)
    _three_calls(model, cache)
    stats = cache.stats()
    assert stats.parts == {"latent": 2 * 45 * (16 + 8) * 2, "indexer": 2 * 45 * 16 * 2} and stats.state_bytes == 0


KVQUANT = "kvquant(bits=4,pre_rope=false,calib_tokens=256)"


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("spec", ["fp8(group=8)", "kivi(bits=4,group=8,residual=0)", "quant(bits=4,group=8)",
                                  "quant(bits=8,group=8,indexer=fp8)", KVQUANT,
                                  "kvquant(bits=2,pre_rope=false,calib_tokens=256,indexer=fp8)"])
def test_quantization_codes_every_part_below_the_native_cache(name, spec):
    model = tiny_model(name)
    cache = CompressedCache(model, parse_policy(spec))
    logits = _three_calls(model, cache)
    stats = cache.stats()
    assert all(bool(torch.isfinite(x).all()) for x in logits)
    for part, measured in stats.parts.items():
        if part in ("window", "hca") and spec.startswith("kivi"):  # 7 and 2 entries: no whole group of 8 to code
            assert measured == stats.nominal_parts[part]
        else:
            assert 0 < measured < stats.nominal_parts[part], (part, stats.parts)


def test_the_indexer_takes_its_own_coding():
    """``indexer=fp8``: e4m3 with one float16 scale per 128 values (per 16-wide key here); ``indexer=native``: the cache
    dtype; the other parts as the quantizer says."""
    model = tiny_model("deepseek_v32")
    parts = {}
    for spec in ("quant(bits=4,group=8)", "quant(bits=4,group=8,indexer=fp8)", "quant(bits=4,group=8,indexer=native)"):
        cache = CompressedCache(model, parse_policy(spec), kv_dtype=torch.bfloat16)
        _three_calls(model, cache)
        parts[spec] = cache.stats().parts
    same, fp8, native = parts.values()
    assert same["latent"] == fp8["latent"] == native["latent"]
    assert fp8["indexer"] == 2 * 45 * (16 + 2) and native["indexer"] == 2 * 45 * 16 * 2
    assert same["indexer"] == 2 * 45 * (16 // 2 + 2 * 2 * 2)  # 4-bit codes, a bf16 scale and zero per 8 values
    with pytest.raises(PolicySpecError, match="indexer='int3' must be one of same, native, fp8"):
        parse_policy("quant(bits=4,indexer=int3)")


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("policy", ["none", "quant(bits=4,group=8)", KVQUANT])
def test_batch_of_three_gives_each_rows_answers_alone(name, policy):
    model = tiny_model(name)
    prompts = [Prompt(_ids(n, 10 + n)[0].tolist(), list(range(5, 5 + q))) for n, q in ((40, 3), (27, 1), (33, 4))]
    alone = [generate(model, Tok(), [p], parse_policy(policy), max_new_tokens=6)[0] for p in prompts]
    together = generate(model, Tok(), prompts, parse_policy(policy), max_new_tokens=6, batch_size=3)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert (a.stats.kv_bytes, a.stats.parts, a.stats.state_bytes) == (b.stats.kv_bytes, b.stats.parts, b.stats.state_bytes)


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("name, policy", [
    ("deepseek_v32", "window(size=20)+kvquant(bits=4,pre_rope=false,calib_tokens=256)"),
    ("glm_moe_dsa", "kvquant(bits=2,pre_rope=false,calib_tokens=256,indexer=fp8)"),
    ("deepseek_v4", "knorm(ratio=0.5)+kvquant(bits=4,pre_rope=false,calib_tokens=256)"),
])
def test_kvquant_in_a_batch_with_eos_gives_each_rows_answers_alone(name, policy):
    """Questions of 3, 1 and 4 tokens, EOS set to row 0's first token (it ends before any step, the others' steps
    must leave its cache alone): batch 3 gives each row's answers and bytes alone."""
    model = tiny_model(name)
    prompts = [Prompt(_ids(n, 10 + n)[0].tolist(), list(range(5, 5 + q))) for n, q in ((40, 3), (27, 1), (33, 4))]
    model.generation_config.eos_token_id = generate(model, Tok(), prompts[:1], parse_policy(policy),
                                                    max_new_tokens=1)[0].token_ids[0]
    alone = [generate(model, Tok(), [p], parse_policy(policy), max_new_tokens=6)[0] for p in prompts]
    assert alone[0].token_ids == [] and any(len(r.token_ids) > 1 for r in alone[1:])
    together = generate(model, Tok(), prompts, parse_policy(policy), max_new_tokens=6, batch_size=3)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert (a.stats.kv_bytes, a.stats.parts, a.stats.state_bytes) == (b.stats.kv_bytes, b.stats.parts,
                                                                          b.stats.state_bytes)


@pytest.mark.parametrize("name", NATIVE)
def test_the_calibration_pass_collects_every_part_the_cache_holds(name):
    """KVQuant calibrates each part on the entries the model's own cache layers hold after one forward over the
    calibration text (their windows made longer than the pass, so V4's window keeps every entry): bit for bit what
    kveval's own layers hold (of the window, its last entries), the latent with its RoPE key as V2/V3's."""
    from kveval.calibration.kv import calibration_kv_parts, read_calibration_text, tokenize_for

    model, text = tiny_model(name), read_calibration_text()
    pairs, parts, used = calibration_kv_parts(model, text, 100)
    cache = CompressedCache(model, parse_policy("none"), kv_dtype=FP32)
    with torch.no_grad():
        model(torch.tensor([tokenize_for(model, text.text)[:100]]), cache=cache)
    assert used == 100 and len(pairs) == len(parts) == len(cache.layers)
    for layer, (keys, values), others in zip(cache.layers, pairs, parts):
        held_keys, held_values = layer.rows[0].store.keys_values()
        assert keys.shape[1] == values.shape[1] == 100
        assert torch.equal(keys[:, 100 - held_keys.shape[1]:], held_keys)
        assert torch.equal(values[:, 100 - held_values.shape[1]:], held_values)
        assert set(others) == set(layer.parts)  # GLM's layer reusing another's top-k has no indexer keys
        for part, entries in others.items():
            assert torch.equal(entries, layer.parts[part][0].read(entries.shape[-1], "cpu"))
    if name == "deepseek_v4":
        assert [sorted(p) for p in parts] == [[], ["csa", "indexer"], ["hca"]]
        assert parts[1]["csa"].shape[1] == 25 and parts[2]["hca"].shape[1] == 6


@pytest.mark.usefixtures("calibration_cache")
def test_kvquant_codes_each_v4_part_with_the_codec_calibrated_on_it():
    """After a 45-token prefill (attended before it is coded, so every layer saw what ``none`` sees), each part holds
    KVQuant's coding of the model's own entries: the window's K=V entries with the layer's codec, the CSA and HCA
    entries and the indexer's keys each with the codec calibrated on that part (per-channel ranges, a 16-level
    codebook, one outlier per vector); entries whose window starts below ``sink`` (8) stay exact. Bytes: codes,
    outliers (a float32 value and a uint8 index), dense sink entries."""
    spec = "kvquant(bits=4,pre_rope=false,calib_tokens=256,sink=8)"
    model, ids = tiny_model("deepseek_v4"), _ids(45, 0)
    none = CompressedCache(model, parse_policy("none"), kv_dtype=FP32)
    coded = CompressedCache(model, parse_policy(spec), kv_dtype=FP32)
    with torch.no_grad():
        for cache in (none, coded):
            model(ids, cache=cache, position_ids=torch.arange(45)[None])
    calibration = coded.policy.quantization.calibration_for(model)

    def through(codec, entries, positions):
        data = codec.encode(entries, entries[..., :0], positions, FP32)
        decoded = codec.decode(data, positions, FP32)[0]
        return torch.where((positions < 8)[..., None], entries, decoded)

    for i in range(3):
        window = none.layers[i].rows[0].store.keys_values()[0]  # 7 entries, positions 38-44
        held = coded.layers[i].rows[0].store.keys_values()[0]
        assert torch.equal(held, through(calibration.codec(i), window, torch.arange(38, 45)[None]))
        for part, entries in none.layers[i].parts.items():
            entries = entries[0].read(none.layers[i].part_widths[part], "cpu")
            positions = torch.arange(entries.shape[1])[None] * none.layers[i].compress_rate
            expected = through(calibration.part_codec(i, part), entries, positions)
            assert torch.equal(coded.layers[i].parts[part][0].read(entries.shape[-1], "cpu"), expected), part
    coded_bytes = {32: 32 * 4 // 8 + 4 + 1, 16: 16 * 4 // 8 + 4 + 1}  # 4-bit codes, one outlier
    assert coded.stats().parts == {
        "window": 3 * 7 * coded_bytes[32],
        "csa": 2 * 32 * 4 + 9 * coded_bytes[32],  # 11 entries; those at tokens 0 and 4 stay float32
        "indexer": 2 * 16 * 4 + 9 * coded_bytes[16],
        "hca": 1 * 32 * 4 + 1 * coded_bytes[32],  # 2 entries; the one at token 0 stays
    }


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("name", NATIVE)
def test_kvquant_decodes_the_same_from_its_codes_as_from_its_buffer(name):
    """A GPU decodes quantized layers from their codes (``quantized_decode="codes"``), a CPU from a dequantized
    buffer: the same logits through prefill, a question and decode steps, and the same bytes."""
    runs = {}
    for mode in ("buffer", "codes"):
        model = tiny_model(name)
        cache = CompressedCache(model, parse_policy("kvquant(bits=3,pre_rope=false,calib_tokens=256)"), kv_dtype=FP32,
                                quantized_decode=mode)
        runs[mode] = (torch.cat([x[0, -1:] for x in _three_calls(model, cache)]), cache.stats().parts)
    assert torch.equal(runs["buffer"][0], runs["codes"][0]) and runs["buffer"][1] == runs["codes"][1]


def test_a_calibration_of_native_parts_is_saved_and_read_back(calibration_cache):
    """The parts' codecs go to disk with the layers' and come back the same; a file from before the values' width
    was recorded is calibrated again, not read at the latent's width."""
    import kveval.calibration.kv as calibration_kv
    from kveval.stores.kvquant import KVQuantCalibration

    model = tiny_model("deepseek_v4")
    policy = parse_policy(KVQUANT).quantization
    first = policy.calibration_for(model)
    again = KVQuantCalibration.load(first.path, policy.settings)
    assert [sorted(p) for p in again.parts] == [[], ["csa", "indexer"], ["hca"]] and again.nbytes() == first.nbytes()
    for layer, part in ((1, "csa"), (1, "indexer"), (2, "hca")):
        assert torch.equal(again.part_codec(layer, part).key_levels, first.part_codec(layer, part).key_levels)
    stale = torch.load(first.path, weights_only=True)
    for entry in stale["layers"]:
        del entry["value_dim"]
    torch.save(stale, first.path)
    assert KVQuantCalibration.load(first.path, policy.settings) is None
    calibration_kv.clear_memory_cache()
    assert parse_policy(KVQUANT).quantization.calibration_for(model).nbytes() == first.nbytes()


def test_a_calibration_shorter_than_a_compressed_window_is_refused_before_any_forward(calibration_cache):
    """10 calibration tokens close no HCA window (16 tokens): no entry to fit its codebook on. Refused in one line
    when the policy is prepared, before the first forward (it was a refusal inside the forward)."""
    from kveval.errors import UsageError

    policy = parse_policy("kvquant(bits=4,pre_rope=false,calib_tokens=10)").quantization
    with pytest.raises(UsageError, match="emitted no 'hca' entries in layer 2") as refused:
        policy.prepare(tiny_model("deepseek_v4"))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name", NATIVE)
def test_the_load_time_self_check_covers_them(name):
    from kveval.cache.exactness import probe_length, self_check

    model = tiny_model(name)
    # V4: past the window (8) and one HCA window (16), with tokens left pending
    assert probe_length(model.config) == (27 if name == "deepseek_v4" else 24)
    assert self_check(model).max_difference <= 1e-5
    result = measure_exactness(model, prefill=37, decode=6)
    assert result.exact and result.max_difference <= 1e-5


def test_a_padded_forward_is_refused():
    model = tiny_model("deepseek_v4")
    cache = CompressedCache(model, parse_policy("none"))
    cache.set_input_mask(torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(UnsupportedModelError, match="run its rows one at a time"), torch.no_grad():
        model(_ids(8, 0).view(2, 4), cache=cache, position_ids=torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]]))


REFUSALS = {
    "snapkv(ratio=0.5)": "scores with attention, which over V4's compressed entries is the model's indexer's top-k",
    "window(size=20)": "token counts (size, window, budget, decode_budget) do not map onto entries",
    "knorm(ratio=0.5,decode_budget=30)": "give ratio= alone",
    "keydiff(ratio=0.5)": "is not one of the selections checked on V4's compressed entries",
    "knorm(ratio=0.5,adaptive=true)": "budgets heads apart",
    "lowrank(rank=8)": "kveval has no low-rank basis for its parts",
    "kvquant(bits=4)": "keys before RoPE need kveval's RoPE hook, which DeepSeek V4 has none of (its entries carry "
                       "RoPE on their last dims); use kvquant(bits=4,pre_rope=false)",
    "llamacpp(k=q8_0,v=q8_0)": "with quant, kivi, fp8, fp4, mxfp8, kvquant only",
}
V32_REFUSALS = {
    "snapkv(ratio=0.5)": "scores with attention probabilities, which on this model hold the indexer's top-k",
    "h2o(ratio=0.5)+kivi(bits=4)": "scores with attention probabilities",
    "duo(heads=0.5)": "budgets heads apart",
    "expected_attention(ratio=0.5)": "scores with the prefill's queries",
    # key-only scorers kveval has not checked on a latent that stands for every head's keys and values at once
    "keydiff(ratio=0.5)": "is not one of the selections checked on it",
    "lagkv(ratio=0.5)": "is not one of the selections checked on it",
    "lowrank(rank=8)": "kveval has no low-rank basis for its parts",
    "kvquant(bits=2,sink=4)": "latent carries no RoPE, its RoPE key is apart); use kvquant(bits=2,sink=4,pre_rope=false)",
    # vLLM serves fp8 on V3.2's sparse MLA as its fp8_ds_mla record (tests/test_deepseek_records.py)
    "vllm(kv_cache_dtype=fp8)": "use vllm(kv_cache_dtype=fp8_ds_mla)",
}


@pytest.mark.parametrize("name, spec, message", [("deepseek_v4", spec, m) for spec, m in sorted(REFUSALS.items())]
                         + [("deepseek_v32", spec, m) for spec, m in sorted(V32_REFUSALS.items())]
                         + [("glm_moe_dsa", "knorm(ratio=0.5)", "reuse an earlier layer's top-k slots")]
                         + [(name, "indexer(ratio=0.5)", f"which a {name} model does not have")
                            for name in ("deepseek_v32", "llama")])
def test_what_cannot_be_expressed_is_refused_at_construction(name, spec, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        CompressedCache(tiny_model(name), parse_policy(spec))


LATENT_SELECTIONS = ["window(size=20)", "streaming(sink=4,window=16)", "knorm(ratio=0.5)", "random(ratio=0.5)",
                     "knorm(budget=12,decode_budget=16)+quant(bits=4,group=8)"]


@pytest.mark.parametrize("spec", LATENT_SELECTIONS)
@pytest.mark.parametrize("mode", ["context", "query"])
def test_v32_selects_on_its_latent_with_the_indexer_keys_alongside(spec, mode):
    """A token's latent and indexer key are kept or dropped together, for every head; below the native cache in
    both parts; batch 3 gives each row alone (row i's random seed is seed + i, as in the batch)."""
    model = tiny_model("deepseek_v32")
    prompts = [Prompt(_ids(n, 10 + n)[0].tolist(), list(range(5, 5 + q))) for n, q in ((40, 3), (27, 1), (33, 4))]
    alone = [generate(model, Tok(), [p], parse_policy(spec), max_new_tokens=6, mode=mode, seed=i)[0]
             for i, p in enumerate(prompts)]
    together = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=6, mode=mode, batch_size=3)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and a.stats.parts == b.stats.parts
    stats = alone[0].stats
    kept = stats.kept_tokens[0][0]
    if spec.startswith("window"):  # every layer keeps the same tokens: GLM's layers that reuse a top-k may select
        glm = tiny_model("glm_moe_dsa")
        assert ([r.token_ids for r in generate(glm, Tok(), prompts, parse_policy(spec), max_new_tokens=6, mode=mode,
                                                batch_size=3)]
                == [generate(glm, Tok(), [p], parse_policy(spec), max_new_tokens=6, mode=mode)[0].token_ids
                    for p in prompts])
    assert kept < stats.tokens_seen[0]
    assert stats.nominal_parts == {"latent": 2 * stats.tokens_seen[0] * 24 * 2, "indexer": 2 * stats.tokens_seen[0] * 16 * 2}
    if "quant" not in spec:
        assert stats.parts == {"latent": 2 * kept * 24 * 2, "indexer": 2 * kept * 16 * 2}
    assert all(0 < stats.parts[p] < stats.nominal_parts[p] for p in stats.parts)


def test_v32_keeps_the_indexer_keys_of_the_tokens_it_keeps():
    """After the context (whose forward every policy attends uncompressed), the kept tokens' indexer keys are the
    ones the uncompressed cache holds at those positions."""
    model = tiny_model("deepseek_v32")
    ids = _ids(40, 3)
    caches = {}
    for spec in ("none", "knorm(ratio=0.5)"):
        caches[spec] = CompressedCache(model, parse_policy(spec), kv_dtype=FP32)
        with torch.no_grad():
            model(ids, cache=caches[spec], position_ids=torch.arange(40)[None])
    for layer, full in zip(caches["knorm(ratio=0.5)"].layers, caches["none"].layers):
        positions = layer.rows[0].positions[0]
        assert positions.numel() == 20
        kept = layer.parts["indexer"][0].read(16, "cpu")[0]
        torch.testing.assert_close(kept, full.parts["indexer"][0].read(16, "cpu")[0, positions], atol=0, rtol=0)


V4_SELECTIONS = ["knorm(ratio=0.5)", "window(ratio=0.5)", "streaming(ratio=0.6,sink=4)", "random(ratio=0.7)",
                 "indexer(ratio=0.5,window=8)", "knorm(ratio=0.5)+quant(bits=4,group=8)"]


@torch.no_grad()
def _v4_selected_against_its_own_cache(spec, context=50, question=7, steps=10, index_topk=16):
    """On a tiny V4 whose indexer picks ``index_topk`` entries (16: all of them, so that ties in its scores, which
    its ReLU makes common on random weights and which top-k breaks by the entry's place, cannot choose between
    equals differently in the two numberings): kveval's cache under ``spec`` (the context in one forward, compressed; the question in one forward; greedy
    steps), and the reference: transformers' own cache and eager attention, the same context, then the entries
    kveval evicted removed from its lists (``compressed_kv``; the emitted count, which places later entries, left
    as it is) and every later token fed alone, where the numbering of entries cannot matter (a single query sees
    every entry its cache holds, and its indexer ranks those). The logits of every later token, both sides."""
    model = tiny_model("deepseek_v4", index_topk=index_topk)
    reference = tiny_model("deepseek_v4", attn="eager", index_topk=index_topk)
    cache, own = CompressedCache(model, parse_policy(spec), kv_dtype=FP32), DynamicCache(config=reference.config)
    ids = _ids(context + question, 5)
    model(ids[:, :context], cache=cache, position_ids=torch.arange(context)[None])
    reference(ids[:, :context], cache=own, position_ids=torch.arange(context)[None])
    for layer, theirs in zip(cache.layers, own.layers):
        kept = (getattr(layer, "kept_entries", None) or [None])[0]
        for name in getattr(layer, "entry_parts", {}):
            if kept is not None:
                theirs.compressed_kv[name] = theirs.compressed_kv[name][:, kept]
    ours = model(ids[:, context:], cache=cache, position_ids=torch.arange(context, context + question)[None]).logits[0]
    theirs = torch.cat([reference(ids[:, t:t + 1], cache=own, position_ids=torch.tensor([[t]])).logits[0]
                        for t in range(context, context + question)])
    ours, theirs, n = [ours], [theirs], context + question
    nxt = ours[-1][-1:].argmax(-1)[None]
    for step in range(steps):
        ours.append(model(nxt, cache=cache, position_ids=torch.tensor([[n + step]])).logits[0])
        theirs.append(reference(nxt, cache=own, position_ids=torch.tensor([[n + step]])).logits[0])
        nxt = ours[-1][-1:].argmax(-1)[None]
    return cache, own, torch.cat(ours), torch.cat(theirs)


@pytest.mark.parametrize("spec", V4_SELECTIONS[:5])
def test_v4_selects_entries_as_its_own_cache_without_them_attends(spec):
    """The question's forward (7 tokens, one of them closing a CSA window at 51, so a new entry the earlier
    question tokens must not see) and the decode steps equal the model's own cache with the evicted entries
    removed; the window stays whole; CSA's indexer keys leave with their entries."""
    cache, own, ours, theirs = _v4_selected_against_its_own_cache(spec)
    assert float((ours - theirs).abs().max()) <= 1e-5
    csa, hca = cache.layers[1], cache.layers[2]
    assert csa.kept_entries[0].numel() == math.ceil(12 * (1 - parse_policy(spec).selection.ratio))
    if spec.startswith("indexer"):  # HCA has no indexer: its entries stay
        assert hca.parts["hca"][0].length == hca.entry_count["compressor"]
    assert csa.parts["csa"][0].length == csa.parts["indexer"][0].length == own.layers[1].compressed_kv["compressor"].shape[1]
    assert hca.parts["hca"][0].length == own.layers[2].compressed_kv["compressor"].shape[1]
    assert cache.layers[0].rows[0].store.length == 7  # the sliding layer's window, as the model holds it


def test_v4_without_hiding_the_evicted_entries_differs():
    """The evicted entries, handed to the model as zeros at their numbers, must be hidden from attention: left
    visible, the same run gives other logits."""
    from kveval.cache.native_layers import HcaLayer

    hide = HcaLayer.hide_evicted
    try:
        HcaLayer.hide_evicted = lambda self, mask, query, key: mask
        _, _, ours, theirs = _v4_selected_against_its_own_cache("knorm(ratio=0.5)")
    finally:
        HcaLayer.hide_evicted = hide
    assert float((ours - theirs).abs().max()) > 1e-3


@torch.no_grad()
def test_v4_indexer_picks_its_top_k_among_the_entries_held():
    """With the tiny config's top 3 of up to 16 entries, every query's picks are held entries, the best-scored of
    them; without the scores' mask the indexer would pick evicted ones (scored 0 as zeros, above the negative
    scores of held ones)."""
    from kveval.cache.native_layers import HcaLayer

    model = tiny_model("deepseek_v4")
    indexer = model.model.layers[1].self_attn.compressor.indexer
    picks = []
    handle = indexer.register_forward_hook(lambda module, args, out: picks.append(out.clone()))
    try:
        for masked in (True, False):
            hide = HcaLayer.hide_evicted_scores
            if not masked:
                HcaLayer.hide_evicted_scores = lambda self, scores: scores
            try:
                picks.clear()
                cache = CompressedCache(model, parse_policy("knorm(ratio=0.5)"), kv_dtype=FP32)
                ids = _ids(66, 5)
                model(ids[:, :50], cache=cache, position_ids=torch.arange(50)[None])
                picks.clear()
                model(ids[:, 50:], cache=cache, position_ids=torch.arange(50, 66)[None])
            finally:
                HcaLayer.hide_evicted_scores = hide
            layer = cache.layers[1]
            evicted = sorted(set(range(12)) - set(layer.kept_entries[0].tolist()))
            chosen = set(picks[0][picks[0] >= 0].tolist())
            assert bool(chosen & set(evicted)) != masked, (masked, chosen, evicted)
    finally:
        handle.remove()


def test_index_shares_by_hand():
    """Two entries of 2 tokens each; queries at positions 1, 3 and 4 see 1, 2 and 2 entries (s < (t + 1) // 2);
    with window 2 only the last two count: softmax of (1, 3) twice, and (0.5, 0.5) from nothing else."""
    from kveval.policies.indexer import index_shares

    scores = torch.tensor([[[9.0, 9.0], [1.0, 3.0], [2.0, 2.0]]])
    positions = torch.tensor([[1, 3, 4]])
    shares = index_shares(scores, positions, rate=2, window=2)
    e = math.exp(2.0)
    torch.testing.assert_close(shares, torch.tensor([[1 / (1 + e) + 0.5, e / (1 + e) + 0.5]]))
    # a query that sees no entry adds nothing (position 0 with rate 2: none is closed)
    assert float(index_shares(scores[:, :1], torch.tensor([[0]]), rate=2, window=1).sum()) == 0.0


@torch.no_grad()
def test_v4_indexer_keeps_the_entries_its_own_indexer_favours():
    """``indexer(ratio=0.5,window=8)`` keeps, in CSA's layer, the 6 of 12 context entries with the largest summed
    shares of the model's own indexer scores over the context's last 8 queries (read here from transformers' own
    forward with its own cache); the question's entries and HCA's stay."""
    from kveval.policies.indexer import index_shares

    model, reference = tiny_model("deepseek_v4"), tiny_model("deepseek_v4", attn="eager")
    seen = []
    scorer = reference.model.layers[1].self_attn.compressor.indexer.scorer
    handle = scorer.register_forward_hook(lambda module, args, out: seen.append(out.clone()))
    try:
        reference(_ids(50, 5), cache=DynamicCache(config=reference.config), position_ids=torch.arange(50)[None])
    finally:
        handle.remove()
    shares = index_shares(seen[0], torch.arange(50)[None], rate=4, window=8)[0]
    cache = CompressedCache(model, parse_policy("indexer(ratio=0.5,window=8)"), kv_dtype=FP32)
    model(_ids(50, 5), cache=cache, position_ids=torch.arange(50)[None])
    kept = cache.layers[1].kept_entries[0]
    assert kept.tolist() == sorted(shares.topk(6).indices.tolist())
    assert cache.layers[2].kept_entries == [None] and cache.layers[2].parts["hca"][0].length == 3


@pytest.mark.parametrize("spec, mode", [(spec, mode) for i, spec in enumerate(V4_SELECTIONS)
                                        for mode in ("context", "query")[i % 2:][:1 + (i == 0)]])
def test_v4_selection_measures_fewer_entries_and_batch_three_is_each_alone(spec, mode):
    """CSA's and HCA's entries (and the indexer's) are below the native cache by the ratio; the window and the
    pending state are the model's; batch 3 = each row alone. The entries the context's tokens alone make are the
    candidates (query mode protects the question's), ``ceil((1 - ratio) x n)`` of them stay, and every later one."""
    model = tiny_model("deepseek_v4")
    prompts = [Prompt(_ids(n, 10 + n)[0].tolist(), list(range(5, 5 + q))) for n, q in ((60, 5), (41, 1), (49, 9))]
    alone = [generate(model, Tok(), [p], parse_policy(spec), max_new_tokens=6, mode=mode, seed=i)[0]
             for i, p in enumerate(prompts)]
    together = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=6, mode=mode, batch_size=3)
    none = generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=6, mode=mode, batch_size=3)
    ratio = parse_policy(spec).selection.ratio
    for prompt, a, b, full in zip(prompts, alone, together, none):
        assert a.token_ids == b.token_ids and a.stats.parts == b.stats.parts
        assert a.stats.nominal_parts == full.stats.nominal_parts and a.stats.state_bytes == full.stats.state_bytes
        assert a.stats.parts["window"] == (full.stats.parts["window"] if "quant" not in spec
                                           else full.stats.parts["window"] // 2)
        selected = ("csa", "indexer") if spec.startswith("indexer") else ("csa", "indexer", "hca")  # HCA: no indexer
        for part in selected:
            assert 0 < a.stats.parts[part] < full.stats.parts[part], (part, a.stats.parts, full.stats.parts)
        if "quant" not in spec:
            for part, rate in (("csa", 4), ("hca", 16))[:1 + ("hca" in selected)]:
                native, free = a.stats.tokens_seen[0] // rate, len(prompt.context) // rate
                held = a.stats.parts[part] * native // a.stats.nominal_parts[part]
                assert held == math.ceil(free * (1 - ratio)) + native - free, (part, held, native, free)


def test_the_indexer_selection_is_refused_before_another_models_weights_load(capsys, monkeypatch):
    from kveval.commands.main import main
    from kveval.runner import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    capsys.readouterr()
    assert main(["generate", "--model", "smollm2-135m", "--prompt", "w5", "--policy", "indexer(ratio=0.5)"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lightning indexer over its compressed entries, which smollm2-135m does not have" in err[0]


@pytest.mark.parametrize("spec", sorted(REFUSALS))
def test_the_cli_refuses_in_one_line_before_the_weights_load(tmp_path, capsys, monkeypatch, spec):
    from test_architectures import _save_with_tokenizer

    from kveval.commands.main import main
    from kveval.runner import models

    _save_with_tokenizer(tiny_model("deepseek_v4", attn="eager"), tmp_path)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7", "--policy", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and REFUSALS[spec] in err[0] and "DeepSeek V4" in err[0]


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("name,policy,parts", [
    ("deepseek_v32", "window(size=16)+fp8", {"latent", "indexer"}),  # a selection on V3.2's latent
    ("deepseek_v4", "fp8", {"window", "csa", "indexer", "hca"}),
    ("deepseek_v4", "knorm(ratio=0.5)+" + KVQUANT, {"window", "csa", "indexer", "hca"}),
])
def test_the_cli_shows_the_parts(tmp_path, capsys, name, policy, parts):
    from test_architectures import _save_with_tokenizer

    from kveval.commands.main import main

    _save_with_tokenizer(tiny_model(name, attn="eager"), tmp_path)
    prompt = " ".join(f"w{4 + i % 120}" for i in range(40))
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", prompt, "--raw", "--dtype", "float32",
                 "--device", "cpu", "--max-new-tokens", "3", "--policy", policy, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["parts"]) == parts
    assert out["kv_bytes"] == sum(out["parts"].values()) < out["nominal_bytes"] == sum(out["nominal_parts"].values())
    if name == "deepseek_v32":
        assert out["kept_tokens_per_layer"] == [16, 16]
    else:
        assert out["state_bytes"] > 0


def test_an_evaluation_reports_each_part_on_the_leaderboard(tmp_path):
    """A run over probe items on a tiny V4 records each part's bytes; the leaderboard shows them per token."""
    import csv

    from test_run_folders import CharTok, _items

    from kveval.report.leaderboard import build_report
    from kveval.runner.evaluate import evaluate_policies

    from cache_runs import specs_of

    items = _items("the pass key is 42. " * 3, n=3)
    dirs = evaluate_policies(tiny_model("deepseek_v4"), CharTok(), items, specs_of(["none", "quant(bits=4,group=8)"]),
                             tmp_path / "runs", "org/V4", batch_size=3)
    build_report(dirs, tmp_path / "report", n_resamples=100)
    board = (tmp_path / "report" / "leaderboard.md").read_text()
    assert "bytes/token by part" in board and "csa" in board and "state" in board
    assert "bytes/token by part" in (tmp_path / "report" / "leaderboard.html").read_text()
    rows = {r["policy"]: r for r in csv.DictReader(open(tmp_path / "report" / "leaderboard.csv"))}
    none, quant = rows["none"], rows["quant(bits=4,group=8)"]
    for part in ("window", "csa", "indexer", "hca"):
        assert 0 < float(quant[f"bytes_per_token[{part}]"]) < float(none[f"bytes_per_token[{part}]"])
    assert float(none["state_bytes"]) > 0


def test_lm_eval_loglikelihoods_equal_stock_hflm():
    """Through lm-eval (continuations sharing a context are scored on forked rows), ``none`` gives stock HFLM's
    log-likelihoods on a tiny V4 with a real vocabulary, at any batch size (its rows run one at a time)."""
    from lm_eval.models.huggingface import HFLM
    from test_lm_eval import PAIRS, ll_requests

    from kveval.lm_eval.model import KVEvalLM
    from kveval.modeling.sources import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    pairs = PAIRS + [(PAIRS[0][0], " and more words")]
    vocab = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id or 0}
    reference = HFLM(pretrained=tiny_model("deepseek_v4", attn="eager", **vocab), tokenizer=tokenizer,
                     batch_size=1).loglikelihood(ll_requests(pairs))
    for batch_size in (1, 3):
        lm = KVEvalLM(pretrained=tiny_model("deepseek_v4", **vocab), tokenizer=tokenizer, policy="none",
                      batch_size=batch_size, kv_dtype="float32")
        for (a, greedy_a), (b, greedy_b) in zip(lm.loglikelihood(ll_requests(pairs)), reference):
            assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


@pytest.mark.slow
def test_a_sweep_over_a_local_tiny_v4_folder_runs_to_a_report_and_a_gate(tmp_path, calibration_cache):
    """A user's path end to end: a V4 model folder (random weights, SmolLM2's shipped tokenizer) swept under three
    quantizations (KVQuant calibrated on the folder's own model, each part its own codebook) to a leaderboard that
    shows the parts and a gate that judges each run."""
    from kveval.commands.main import main
    from kveval.modeling.sources import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    folder = tmp_path / "tiny-v4"
    model = tiny_model("deepseek_v4", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id or 0,
                       max_position_embeddings=512)
    model.config._attn_implementation = "eager"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = tmp_path / "sweep.yaml"
    config.write_text(f"name: tiny-v4\nmodels: ['{folder}']\nbatch_size: 2\nkv_dtype: float32\n"
                      "policies: ['quant(bits=4,group=8)', 'fp8(group=16)', "
                      "'kvquant(bits=4,pre_rope=false,calib_tokens=256)']\n"
                      "probes: {families: [passkey], lengths: [160], depths: [0.5], n: 2}\n")
    out = tmp_path / "out"
    assert main(["sweep", str(config), "--out", str(out), "--quiet"]) in (0, 1, 3)  # a verdict, whichever
    board = (out / "report" / "leaderboard.md").read_text()
    assert "bytes/token by part" in board and "csa" in board and "hca" in board
    gate = json.loads((out / "gate" / "gate.json").read_text())
    judged = {c["name"].split("/", 1)[1].split("@")[0]: c["status"] for r in gate.get("results", [gate]) for c in r["candidates"]}
    assert judged.keys() == {"quant(bits=4,group=8)", "fp8(format=e4m3,group=16)",
                             "kvquant(bits=4,pre_rope=false,calib_tokens=256)"}
    assert set(judged.values()) <= {"PASS", "FAIL", "INCONCLUSIVE"}
    # KVQuant's per-model codebooks and ranges: the window's in every layer, and each CSA/HCA part's (2 + 3 parts,
    # 16 levels, 32 or 16 channels' centre and half-range each, float32)
    kvquant = next((out / "runs").glob("*/kvquant_*/run.json"))
    info = json.loads(kvquant.read_text())["extra"]
    assert info["codebook_bytes"] == 4 * (3 * (16 + 2 * 32) + 2 * (16 + 2 * 32) + (16 + 2 * 16))
