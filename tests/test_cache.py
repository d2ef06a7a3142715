"""The compressed cache on tiny random models: exactness, measured bytes, budgets, batching."""

import pytest
import torch
from transformers import DynamicCache

from kveval.cache.compressed import CompressedCache
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate

from tiny_models import Tok, tiny_gemma3, tiny_llama

SELECTION = ["h2o(ratio=0.5)", "snapkv(ratio=0.5,window=4,kernel=3)", "pyramidkv(ratio=0.5,window=4)",
             "tova(ratio=0.5)", "knorm(ratio=0.5)", "random(ratio=0.5)"]


def _prefill_and_decode(model, cache, ids, steps):
    logits = [model(ids, cache=cache, position_ids=torch.arange(ids.shape[1])[None]).logits]
    nxt = logits[0][:, -1:].argmax(-1)
    for step in range(steps):
        out = model(nxt, cache=cache, position_ids=torch.tensor([[ids.shape[1] + step]])).logits
        logits.append(out)
        nxt = out[:, -1:].argmax(-1)
    return logits


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_none_is_identical_to_plain_transformers(make):
    model, reference = make(), make(attn="sdpa")
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # kv_dtype equal to the compute dtype: nothing is rounded, so nothing may differ.
        ours = _prefill_and_decode(model, CompressedCache(model, parse_policy("none"), kv_dtype=model.dtype), ids, 6)
        theirs = _prefill_and_decode(reference, DynamicCache(config=reference.config), ids, 6)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_int8_close_to_baseline_at_half_the_16bit_bytes():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids, cache=CompressedCache(model, parse_policy("none"))).logits
        cache = CompressedCache(model, parse_policy("quant(bits=8,group=16)"))
        _prefill_and_decode(model, cache, ids, 1)
        # Measure a decode step against the quantized prefill.
        q8 = model(ids[:, :1], cache=cache, position_ids=torch.tensor([[65]])).logits
        base_cache = CompressedCache(model, parse_policy("none"))
        _prefill_and_decode(model, base_cache, ids, 1)
        ref = model(ids[:, :1], cache=base_cache, position_ids=torch.tensor([[65]])).logits
    assert base.shape[1] == 64
    assert (q8 - ref).abs().max().item() < 2e-2  # stated tolerance for int8 on this model
    stats = cache.stats()
    # The model computes in fp32; bytes are stated against its deployment cache dtype, bf16 by default.
    assert stats.kv_dtype == "bfloat16"
    # 16 int8 codes + fp16 scale + fp16 zero per group of 16: (16 + 4) / 32 of 16-bit.
    assert stats.kv_bytes == stats.nominal_bytes * 20 / 32


def test_int4_packed_bytes_match_arithmetic_exactly():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(model, parse_policy("quant(bits=4,group=8)"))
    with torch.no_grad():
        model(ids, cache=cache)
    layers, heads, dim, tokens = 2, 2, 16, 100
    groups = dim // 8
    per_token_head = 2 * (dim // 2 + groups * (2 + 2))  # K and V: packed nibbles + fp16 scale and zero per group
    assert cache.stats().kv_bytes == layers * heads * tokens * per_token_head


def test_kivi_keys_per_channel_with_residual():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(3))
    cache = CompressedCache(model, parse_policy("kivi(bits=2,group=8,residual=10)"))
    with torch.no_grad():
        model(ids, cache=cache)
    store = cache.layers[0].rows[0].store
    # Keys: 40 aged tokens = 5 whole groups of 8 quantized; values: all 40 aged tokens quantized per token.
    assert store.k.block.tokens == 40 and store.k.block.units == 5 and store.k.block.axis == "channel"
    assert store.v.block.axis == "token" and store.v.block.units == 40 and store.k.tail.shape[1] == 10
    assert store.k.block.data.numel() == 2 * 40 * 16 // 4  # four 2-bit codes per byte
    assert store.k.tail.dtype == torch.bfloat16  # the residual window is held in the deployment dtype


def test_window_holds_exactly_its_size():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    cache = CompressedCache(model, parse_policy("window(64)"))
    with torch.no_grad():
        _prefill_and_decode(model, cache, ids, 3)
    assert cache.stats().kept_tokens == [[64], [64]]
    positions = cache.layers[0].rows[0].positions[0]
    assert positions.tolist() == list(range(203 - 64, 203))  # original positions kept (RoPE not re-based)


def test_streaming_keeps_sinks_and_recent_tokens_with_original_positions():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(5))
    cache = CompressedCache(model, parse_policy("streaming(sink=4,window=20)"))
    with torch.no_grad():
        _prefill_and_decode(model, cache, ids, 5)
    positions = cache.layers[1].rows[0].positions[0].tolist()
    assert positions == [0, 1, 2, 3] + list(range(105 - 20, 105))


def test_streaming_position_handling_matches_a_cache_that_never_saw_the_gap():
    """After eviction a new token attends to kept tokens at their true distances (RoPE is applied before caching)."""
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = CompressedCache(model, parse_policy("streaming(sink=2,window=5)"))
        model(ids, cache=cache, position_ids=torch.arange(30)[None])
        out = model(ids[:, :1], cache=cache, position_ids=torch.tensor([[30]])).logits
        # Reference: full cache, but the new token may only see the kept positions.
        full = CompressedCache(model, parse_policy("none"))
        model(ids, cache=full, position_ids=torch.arange(30)[None])
        keep = torch.tensor([0, 1, 25, 26, 27, 28, 29])
        for layer in full.layers:
            layer._select(layer.rows[0], keep.expand(layer.rows[0].positions.shape[0], -1))
        ref = model(ids[:, :1], cache=full, position_ids=torch.tensor([[30]])).logits
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("spec", SELECTION)
def test_ratio_zero_equals_none(spec):
    model = tiny_llama()
    prompts = [Prompt(list(range(1, 60)), [3, 4, 5])]
    zero = spec.replace("ratio=0.5", "ratio=0")
    assert generate(model, Tok(), prompts, parse_policy(zero), max_new_tokens=8)[0].token_ids == \
        generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=8)[0].token_ids


@pytest.mark.parametrize("spec", SELECTION)
def test_kept_tokens_follow_the_budget(spec):
    model = tiny_llama()
    cache = CompressedCache(model, parse_policy(spec))
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(7)), cache=cache)
    policy = parse_policy(spec).selection
    for i, layer in enumerate(cache.layers):
        row = layer.rows[0]
        assert row.positions.shape == (2, policy.keep_count(80, i, 2))  # every KV head holds its budget
        assert (row.positions.diff(dim=1) > 0).all()  # tokens stay in order


def test_snapkv_selects_per_kv_head():
    model = tiny_llama()
    cache = CompressedCache(model, parse_policy("snapkv(ratio=0.75,window=4,kernel=1)"))
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(8)), cache=cache)
    positions = cache.layers[1].rows[0].positions
    assert not torch.equal(positions[0], positions[1])


def test_random_is_reproducible_and_seeded():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 80), generator=torch.Generator().manual_seed(9))
    kept = []
    for seed in (0, 0, 1):
        cache = CompressedCache(model, parse_policy(f"random(ratio=0.5,seed={seed})"))
        with torch.no_grad():
            model(ids, cache=cache)
        kept.append(cache.layers[0].rows[0].positions)
    assert torch.equal(kept[0], kept[1]) and not torch.equal(kept[0], kept[2])


@pytest.mark.parametrize("spec", ["h2o(ratio=0.5,decode_budget=40)", "tova(ratio=0.5,decode_budget=40)",
                                  "knorm(ratio=0.5,decode_budget=40)", "random(ratio=0.5,decode_budget=40)", "window(40)"])
def test_decode_budget_bounds_the_cache_while_generating(spec):
    model = tiny_llama()
    result = generate(model, Tok(), [Prompt(list(range(1, 61)))], parse_policy(spec), max_new_tokens=30)[0]
    assert len(result.token_ids) == 30
    assert max(max(layer) for layer in result.stats.kept_tokens) == 40


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("spec", ["none", "window(16)", "streaming(sink=2,window=14)", "kivi(bits=2,group=4,residual=8)",
                                  "quant(bits=4,group=8)", "snapkv(ratio=0.5,window=4)+kivi(bits=4,group=8,residual=4)"]
                         + SELECTION + ["h2o(ratio=0.5,decode_budget=30)", "tova(ratio=0.5,decode_budget=30)"])
@pytest.mark.parametrize("mode", ["context", "query"])
def test_batch_of_four_equals_batch_of_one(make, spec, mode):
    model = tiny_llama() if make is tiny_llama else tiny_gemma3()
    g = torch.Generator().manual_seed(10)
    prompts = [Prompt(torch.randint(1, 128, (n,), generator=g).tolist(), torch.randint(1, 128, (q,), generator=g).tolist())
               for n, q in [(37, 5), (64, 3), (20, 7), (51, 4)]]
    one = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=10, mode=mode, batch_size=1)
    four = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=10, mode=mode, batch_size=4)
    assert [r.token_ids for r in one] == [r.token_ids for r in four]
    assert [r.stats.kv_bytes for r in one] == [r.stats.kv_bytes for r in four]


def test_stacking_selection_and_quantization_shows_both_effects():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 128), generator=torch.Generator().manual_seed(11))
    measured = {}
    for spec in ["none", "snapkv(ratio=0.5,window=4)", "kivi(bits=4,group=8,residual=0)", "snapkv(ratio=0.5,window=4)+kivi(bits=4,group=8,residual=0)"]:
        cache = CompressedCache(model, parse_policy(spec))
        with torch.no_grad():
            model(ids, cache=cache)
        measured[spec] = cache.stats().kv_bytes
    assert measured["snapkv(ratio=0.5,window=4)"] == measured["none"] / 2
    stacked = measured["snapkv(ratio=0.5,window=4)+kivi(bits=4,group=8,residual=0)"]
    assert stacked == pytest.approx(measured["kivi(bits=4,group=8,residual=0)"] / 2, rel=0.01)


def test_gemma_sliding_layers_keep_their_window_and_selection_applies_to_full_layers():
    model = tiny_gemma3(sliding_window=16)
    cache = CompressedCache(model, parse_policy("window(8)"))
    with torch.no_grad():
        _prefill_and_decode(model, cache, torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(12)), 2)
    kept = [k[0] for k in cache.stats().kept_tokens]
    assert kept == [15, 15, 15, 8]  # sliding layers: window - 1, as the model's own cache; full layer: the policy's


def test_query_mode_keeps_the_question():
    model = tiny_llama()
    prompt = Prompt(list(range(1, 81)), [90, 91, 92, 93, 94, 95])
    result = generate(model, Tok(), [prompt], parse_policy("knorm(ratio=0.5)"), max_new_tokens=1, mode="query")[0]
    assert result.stats.kept_tokens[0][0] == 40 + 6


@pytest.mark.parametrize("spec, message", [
    ("bogus(1)", "unknown policy 'bogus'"),
    ("snapkv(ratio=1.5)", "out of range"),
    ("window(size=-3)", "positive"),
    ("quant(bits=3)", "use 2, 4 or 8"),
    ("quant(k_axis=diagonal)", "k_axis"),
    ("window(8)+streaming(sink=1,window=2)", "two selection policies"),
    ("kivi(bits=4)+quant(bits=8)", "two quantization policies"),
    ("window(size=8", "cannot parse"),
    ("snapkv(ratio=0.5,speed=3)", "no parameter 'speed'"),
])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_policy(spec)


def test_group_that_does_not_divide_head_dim_is_refused():
    with pytest.raises(ValueError, match="does not divide head_dim=16"):
        CompressedCache(tiny_llama(), parse_policy("quant(bits=4,group=5)"))


@pytest.mark.parametrize("mode", ["context", "query"])
def test_one_prefill_for_many_ratios_equals_separate_runs(mode):
    from kveval.runner.generation import generate_many

    model = tiny_llama()
    g = torch.Generator().manual_seed(13)
    prompts = [Prompt(torch.randint(1, 128, (n,), generator=g).tolist(), torch.randint(1, 128, (q,), generator=g).tolist())
               for n, q in [(37, 5), (64, 3), (20, 7)]]
    specs = [parse_policy(f"snapkv(ratio={r},window=4)").spec for r in (0.25, 0.5, 0.9)]
    shared = generate_many(model, Tok(), prompts, [parse_policy(p) for p in specs], max_new_tokens=8, mode=mode, batch_size=2)
    for spec in specs:
        alone = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=8, mode=mode)
        assert [r.token_ids for r in shared[spec]] == [r.token_ids for r in alone]
        assert [r.stats.kv_bytes for r in shared[spec]] == [r.stats.kv_bytes for r in alone]


def test_random_scores_are_the_documented_hash():
    """Each score is lowbias32(lowbias32(head hash ^ position) ^ step hash) / 2**32, from the policy seed, the
    sequence's seed, the layer, the KV head and the newest position held, as the policy's doc says: written here in
    plain Python integers, so that a change of the hash (which would move every committed random run) or of how
    its parts are cached across steps, layers or seeds is seen."""
    from kveval.tensors.scoring_state import ScoringState

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    def expected(seed, row_seed, layer, head, position, newest):
        row = mix(row_seed ^ mix(mix(seed) ^ layer))
        return mix(mix(mix(row ^ head) ^ position) ^ mix(row ^ newest)) / 2**32

    policy = parse_policy("random(ratio=0.5,seed=5)").selection
    positions = torch.tensor([[[0, 3, 9, 2**33 + 1], [1, 4, 8, 11]], [[5, 6, 7, 12], [0, 2, 13, -1]]])  # [rows, heads, slots]
    for layer in (0, 3, 3):  # the same layer twice: what is made once must give the same
        for seeds in ((7, 2**40 + 3), (9, 7)):
            got = policy.scores(ScoringState(keys=None, positions=positions, attention=None, layer_idx=layer,
                                             num_layers=8, seed=seeds))
            for b in range(2):
                newest = int(positions[b].max()) & 0xFFFFFFFF
                for h in range(2):
                    for t in range(4):
                        p = int(positions[b, h, t]) & 0xFFFFFFFF
                        assert got[b, h, t].item() == expected(5, int(seeds[b]) & 0xFFFFFFFF, layer, h, p, newest)
    one = policy.scores(ScoringState(keys=None, positions=positions[0], attention=None, layer_idx=2, num_layers=8, seed=11))
    assert one[1, 2].item() == expected(5, 11, 2, 1, 8, 2**33 + 1 & 0xFFFFFFFF)


def test_random_scores_are_uniform_and_independent_of_the_batch():
    """The control's scores: uniform on [0, 1), different per head, per step and per sequence seed, and the same
    for a sequence scored alone or in a batch (what lets a batch keep its decode budget at once)."""
    from kveval.tensors.scoring_state import ScoringState

    policy = parse_policy("random(ratio=0.5,seed=5)").selection
    positions = torch.arange(2000).expand(4, -1)

    def scores(positions, seed, layer=3):
        return policy.scores(ScoringState(keys=None, positions=positions, attention=None, layer_idx=layer,
                                          num_layers=8, seed=seed))

    alone = scores(positions, 7)
    assert alone.shape == (4, 2000) and bool(((alone >= 0) & (alone < 1)).all())
    assert abs(float(alone.mean()) - 0.5) < 0.02 and abs(float((alone < 0.25).double().mean()) - 0.25) < 0.02
    assert abs(float(torch.corrcoef(alone)[0, 1])) < 0.1  # heads draw apart
    assert not torch.equal(alone, scores(positions, 8)) and not torch.equal(alone, scores(positions, 7, layer=4))
    assert not torch.equal(alone[:, :1000], scores(positions[:, :1000], 7))  # the next step draws again
    batch = torch.stack([positions, positions.masked_fill(positions > 1500, -1)])
    together = scores(batch, (7, 8))  # a batch: one seed per row
    assert torch.equal(together[0], alone)
    assert torch.equal(together[1][:, :1501], scores(positions[:, :1501], 8))


@pytest.mark.parametrize("heads, kv_heads, dim, q_len", [(9, 3, 64, 1), (9, 3, 64, 40), (4, 1, 32, 1), (8, 8, 16, 7)])
def test_sdpa_scoring_probabilities_are_the_softmax_of_the_masked_logits(heads, kv_heads, dim, q_len):
    """SDPA's scoring probabilities (one ``bmm`` of each KV head's query heads as one ``[groups * q]`` matrix, over
    a view of the buffer's keys) have the bits of ``softmax(masked(q k^T * scale))`` written with a 4-D ``matmul``
    of the same matrices; with the mask that sees every slot (:func:`every_slot_visible`, recognised and not
    applied) as with any other."""
    from kveval.modeling.architectures import SdpaKernel, every_slot_visible

    generator = torch.Generator().manual_seed(heads * dim + q_len)
    batch, width, capacity = 5, 77, 100
    keys = (torch.randn(batch, kv_heads, capacity, dim, generator=generator) * 2)[:, :, :width]  # strided, as a buffer's
    query = torch.randn(batch, heads, q_len, dim, generator=generator) * 2
    groups = heads // kv_heads
    logits = torch.matmul(query.reshape(batch, kv_heads, groups * q_len, dim), keys.transpose(-1, -2)) * dim ** -0.5
    logits = logits.view(batch, heads, q_len, width)
    masks = [torch.rand(batch, 1, q_len, width, generator=generator) > 0.3,
             torch.rand(batch, kv_heads, q_len, width, generator=generator) > 0.3]
    if q_len == 1:
        masks.append(every_slot_visible(batch, width, torch.device("cpu")))
    for mask in masks:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
        expected = torch.softmax(logits.masked_fill(~mask.repeat_interleave(heads // mask.shape[1], dim=1), float("-inf")), -1)
        got = SdpaKernel().probabilities(None, query, keys, mask, dim ** -0.5, {})
        assert torch.equal(got, expected)


@pytest.mark.parametrize("variant", ["sdpa 9/3x64", "sdpa 4/1x256", "sdpa 4/4x16", "gpt_oss", "gemma2"])
def test_scoring_by_blocks_of_visible_slots_is_bit_identical_to_one_call(variant):
    """Policies that score every prefill query (H2O, the deferred shared prefill) compute probabilities 32 queries
    at a time over the slots those queries may see; on a CPU that must equal one call over every slot, bit for bit,
    whatever the prefill's length, left padding or (after compression) slot layout, and through a model's eager
    function (gpt-oss's learned sinks, Gemma 2's softcapping) as through SDPA, else scores and so kept tokens would
    move with it."""
    import sys

    from kveval.modeling.architectures import EagerKernel, SdpaKernel
    from kveval.tensors.block_probabilities import SINK_SLOT_STEP, AttentionProbabilities, visible_probabilities

    from tiny_models import tiny_model

    if variant.startswith("sdpa"):  # "sdpa H/KVxD": query heads, KV heads, head width
        module, extra, kernel = None, {}, SdpaKernel()
        heads, rest = variant.split()[1].split("/")
        heads, (kv_heads, dim) = int(heads), map(int, rest.split("x"))
    else:  # a tiny model's first attention module, through its own eager function
        model = tiny_model(variant)
        module = next(m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj"))
        extra = {"softcap": 50.0} if variant == "gemma2" else {}
        heads, kv_heads, dim = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
        kernel = EagerKernel(sys.modules[type(module).__module__].eager_attention_forward)
    generator = torch.Generator().manual_seed(heads * dim)

    def probabilities(query, keys, allowed):
        with torch.no_grad():
            return kernel.probabilities(module, query, keys, allowed, dim ** -0.5, dict(extra))

    step = kernel.slot_step(module)
    assert step == (SINK_SLOT_STEP if variant == "gpt_oss" else 1)

    calls = []
    for q_len in (63, 64, 127, 128, 129, 191, 257, 300):
        batch, pad = 3, torch.tensor([0, 5, 70])
        query = torch.randn(batch, heads, q_len, dim, generator=generator) * 2
        keys = torch.randn(batch, kv_heads, q_len, dim, generator=generator) * 2
        slots = torch.arange(q_len)
        allowed = (slots[None, :] <= slots[:, None])[None, None] & (slots >= pad[:, None])[:, None, None, :]
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # padding queries see everything, as allowed_mask does
        for mask in (allowed, allowed.expand(-1, heads, -1, -1) & (torch.rand(batch, heads, q_len, q_len, generator=generator) > 0.2)
                     | torch.eye(q_len, dtype=torch.bool)):
            seen = []
            counted = AttentionProbabilities(lambda q, k, a: seen.append(k.shape[2]) or probabilities(q, k, a), step)
            blocked = visible_probabilities(counted, query, keys, mask, slots[None, :] >= pad[:, None])
            every = probabilities(query, keys, mask)
            real = (slots[None, :] >= pad[:, None])[:, None, :, None]
            assert torch.equal(blocked * real, every * real), q_len  # padding queries' probabilities are weighted 0
            assert torch.equal(blocked[0], every[0]) and torch.equal(blocked[2, :, 70:], every[2, :, 70:])
            calls.append(seen)
            # Summed over each KV head's query heads block by block (what scoring keeps): the same bits.
            by_kv_head = lambda p: p.reshape(batch, kv_heads, heads // kv_heads, *p.shape[2:]).sum(dim=2)  # noqa: E731
            reduced = visible_probabilities(AttentionProbabilities(probabilities, step), query, keys, mask,
                                            slots[None, :] >= pad[:, None], by_kv_head)
            assert reduced.shape == (batch, kv_heads, q_len, q_len)
            assert torch.equal(reduced * real, by_kv_head(every) * real), q_len
    # Blocks of 32 queries (the last one up to 63) over the slots their real queries see: exactly those for a
    # softmax over the slots alone, less multiples of 64 trailing slots where a sink column follows them.
    assert calls[0] == [63]
    if step == 1:
        assert calls[-2] == [32, 64, 96, 128, 160, 192, 224, 256, 300]
    else:
        assert calls[-2] == [44, 108, 108, 172, 172, 236, 236, 300, 300]  # 300 less 256, 192, ... trailing slots
