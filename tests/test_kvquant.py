"""kvquant (KVQuant, Hooper et al. 2024) on tiny random models, and one short check on both embedded models."""

import pytest
import torch

from kveval.cache.compressed import CompressedCache
from kveval.errors import PolicySpecError, UnsupportedModelError
from kveval.modeling.rope import ROTATE_HALF_ROPE, rope_hook
from kveval.policies.spec import parse_policy
from kveval.stores.kvquant import KVQuantCodec, KVQuantStore

from cache_runs import (
    assert_one_batch_equals_batch_size_one,
    assert_one_line_error,
    assert_shared_prefill_equals_own_runs,
    context_then_steps,
    random_ids,
    random_prompts,
)
from tiny_models import Tok, tiny_gemma3, tiny_llama, tiny_model

EXACT = torch.float32  # kv_dtype of the arithmetic tests: outliers and sinks not rounded to bf16

pytestmark = pytest.mark.usefixtures("calibration_cache")


def _logits(model, spec, context, steps, kv_dtype=EXACT):
    """Prefill ``context``, then one token at a time; the last position's logits of every forward, and the cache."""
    logits, cache = context_then_steps(model, spec, context, steps, kv_dtype)
    return torch.cat([o[0, -1:] for o in logits]), cache


def _codec(heads=2, dim=16, bits=4, k=2):
    levels = torch.linspace(-1, 1, 2**bits)
    return KVQuantCodec(bits, torch.zeros(heads, dim), torch.full((heads, dim), 2.0), levels, levels.clone(), k)


# --- bytes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_codes_pack_into_a_least_significant_bit_first_stream(bits):
    """The codes' layout, bit by bit, for every width (4 and 2 bits take a whole-code path): code i's bit j is bit
    i * bits + j of the vector's stream, byte k holding its bits 8k..8k+7; the last byte is zero-padded."""
    from kveval.tensors.quantization import pack_bits, unpack_bits

    generator = torch.Generator().manual_seed(bits)
    for n in (1, 3, 8, 13, 64):
        codes = torch.randint(0, 2**bits, (2, 3, n), dtype=torch.uint8, generator=generator)
        stream = [(int(c) >> j) & 1 for c in codes.reshape(-1, n)[4] for j in range(bits)]
        stream += [0] * (-len(stream) % 8)
        expected = [sum(bit << j for j, bit in enumerate(stream[k:k + 8])) for k in range(0, len(stream), 8)]
        packed = pack_bits(codes, bits)
        assert packed.shape == (2, 3, -(-n * bits // 8)) and packed.dtype == torch.uint8
        assert packed.reshape(-1, packed.shape[-1])[4].tolist() == expected
        assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_bytes_are_codes_outliers_ranges_sinks_and_residual():
    # 2 heads, head_dim 16, 4 bits, 2 outliers a vector, float32: per encoded token and head
    # K: 8 code bytes + 2 x (4 + 1) outlier bytes = 18; V: the same + float16 lo and hi = 22; 40 together.
    store = KVQuantStore(_codec(), sink=1, residual=2, kv_dtype=torch.float32)
    store.append(torch.randn(2, 10, 16), torch.randn(2, 10, 16))
    store.seal()
    sink, residual, body = 1 * 2 * (2 * 16 * 4), 2 * 2 * (2 * 16 * 4), 7 * 2 * 40
    assert store.nbytes == sink + residual + body == 1328
    assert parse_policy("kvquant(bits=4,outliers=0.125)").quantization.bytes_per_token(16, 4) == 40
    assert parse_policy("kvquant(bits=3,outliers=0.125)").quantization.bytes_per_token(16, 4) == 2 * (6 + 10) + 4


def test_cache_bytes_on_a_model_follow_the_arithmetic():
    model = tiny_llama()  # 2 layers, 2 KV heads, head_dim 16
    _, cache = _logits(model, "kvquant(bits=3)", random_ids(40, 0), random_ids(6, 1))  # outliers=0.01: 1 a vector
    per_token = 2 * (6 + 1 * (4 + 1)) + 4
    assert cache.stats().kv_bytes == 2 * 2 * (1 * 2 * 16 * 4 + 45 * per_token)
    policy = cache.policy.quantization
    assert policy.codebook_bytes(model) == 2 * 4 * (2 * 8 + 2 * 2 * 16)  # per layer: 2 codebooks of 8, K ranges


# --- full precision and error -----------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_every_entry_an_outlier_equals_none_bit_for_bit(make):
    model = make()
    context, steps = random_ids(40, 0), random_ids(6, 1)
    base, _ = _logits(model, "none", context, steps)
    post, _ = _logits(model, "kvquant(outliers=1.0,pre_rope=false,sink=0)", context, steps)
    assert torch.equal(post, base)
    pre, _ = _logits(model, "kvquant(outliers=1.0,sink=0)", context, steps)  # un-rotated, rotated back: fp32 rounding only
    assert (pre - base).abs().max().item() < 1e-5


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_error_falls_as_bits_rise(make):
    model = make()
    context, steps = random_ids(48, 2), random_ids(6, 3)
    base, _ = _logits(model, "none", context, steps)
    errors = [(_logits(model, f"kvquant(bits={b})", context, steps)[0] - base).abs().mean().item() for b in (2, 3, 4, 8)]
    assert errors[0] > errors[1] > errors[2] > errors[3] > 0


def test_reconstruction_error_falls_as_bits_rise_and_outliers_are_exact():
    x = torch.randn(2, 64, 16) * 0.5
    x[0, 5, 3] = 40.0  # an outlier: kept exactly, and it does not widen its token's value range
    errors = []
    for bits in (2, 3, 4):
        store = KVQuantStore(_codec(bits=bits, k=1), sink=0, residual=0, kv_dtype=torch.float32)
        store.append(x, x)
        store.seal()
        keys, values = store.keys_values()
        assert keys[0, 5, 3] == values[0, 5, 3] == 40.0
        errors.append((values - x).pow(2).mean().item())
    assert errors[0] > errors[1] > errors[2]


# --- pre-RoPE -----------------------------------------------------------------------------------
def test_rope_round_trip_is_exact_in_float32():
    hook = rope_hook(tiny_llama(), 0)
    x = torch.randn(2, 300, 16)
    positions = torch.stack([torch.arange(300), torch.arange(1000, 1300)])
    assert (hook.unrotate(hook.rotate(x, positions), positions) - x).abs().max().item() < 1e-6
    assert (hook.rotate(hook.unrotate(x, positions), positions) - x).abs().max().item() < 1e-6


def test_rope_angles_sized_by_a_host_bound_read_no_device_and_equal_the_angles_sized_by_reading():
    """A batched decode step knows a bound above its positions on the host (the columns seen): the table of angles
    grows to it without reading the largest position (a wait per layer and step on a GPU), and the angles are
    those of a table sized by reading."""
    from kveval.runner.device_waits import OpCounter

    model = tiny_llama()
    positions = torch.tensor([[3, 700, 1299]])
    reading, bounded = rope_hook(model, 0), rope_hook(model, 0)
    with OpCounter(model) as counter:
        cos, sin = bounded.cos_sin(positions, bound=2048)  # a table larger than reading would make
    assert counter.counts["waits"] == 0 and bounded._cos.shape[0] >= 2048
    expected = reading.cos_sin(positions)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])


def _layer0_keys(model, token=7, n=24):
    seen = {}
    layer = CompressedCache(model, parse_policy("none"), kv_dtype=EXACT)
    with torch.no_grad():
        model(torch.full((1, n), token), cache=layer, position_ids=torch.arange(n)[None])
    seen["keys"] = layer.layers[0].rows[0].store.keys_values()[0]
    return seen["keys"]


@pytest.mark.parametrize("name", sorted({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3"}))
def test_unrotated_keys_are_the_models_pre_rope_keys(name):
    # Layer 0 sees one repeated token as the same embedding at every position: its pre-RoPE key is one vector,
    # so un-rotating the cached (post-RoPE) keys at their positions must give that vector everywhere.
    model = tiny_model(name)
    keys = _layer0_keys(model)
    positions = torch.arange(keys.shape[1]).expand(keys.shape[0], -1)
    pre = rope_hook(model, 0).unrotate(keys, positions)
    assert (pre - pre[:, :1]).abs().max().item() < 1e-5
    assert (keys - keys[:, :1]).abs().max().item() > 1e-2  # the cached keys themselves do rotate


def _length_dependent_rope(kind: str):
    """Tiny models whose RoPE angles change past 64 positions: Phi-3's longrope (short factors up to 64 positions,
    long ones past), Llama's dynamic NTK (its base grows past 64)."""
    if kind == "longrope":
        return tiny_model("phi3", hidden_size=128, max_position_embeddings=256, original_max_position_embeddings=64,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
                                           "long_factor": [3.0] * 16, "original_max_position_embeddings": 64})
    return tiny_model("llama", max_position_embeddings=64,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_a_rope_that_changes_with_the_length_is_unrotated_at_the_models_own_angles(kind):
    """Longrope and dynamic NTK rotate with other angles once a forward passes their original length (64 here).
    The table of angles grew by doubling from 256 positions, so a context of 24 tokens was unrotated at the long
    angles (and dynamic NTK's module, grown by the table, rotated the model's next forwards so too): pre-RoPE keys
    were wrong before any quantization. The table now stops at that length, and a position past it, where the
    model rotates earlier keys with other angles than later ones, is refused in one line."""
    model = _length_dependent_rope(kind)
    keys = _layer0_keys(model)
    positions = torch.arange(keys.shape[1]).expand(keys.shape[0], -1)
    hook = rope_hook(model, 0)
    for bound in (None, 64, 4096):
        pre = hook.unrotate(keys, positions) if bound is None else hook.unrotate(keys, positions, hook.cos_sin(positions, bound))
        assert (pre - pre[:, :1]).abs().max().item() < 1e-5, bound
    assert hook._cos.shape[0] == 64
    assert torch.equal(_layer0_keys(model), keys)  # the model's own rotation is as it was
    with pytest.raises(UnsupportedModelError, match="pre_rope=false"):
        hook.cos_sin(torch.tensor([[3, 64]]))
    with pytest.raises(UnsupportedModelError, match="pre_rope=false"):
        hook.cos_sin(torch.tensor([[3, 64]]), bound=65)
    # A calibration is one forward: past the length, its keys are unrotated at that forward's (long) angles.
    long_keys = _layer0_keys(model, n=100)
    cos, sin = hook.one_forward_cos_sin(100, "cpu")
    at = torch.arange(100).expand(long_keys.shape[0], -1)
    pre = hook.unrotate(long_keys, at, (cos[at], sin[at]))
    assert (pre - pre[:, :1]).abs().max().item() < 1e-5
    # Through the cache: contexts within the length run; one past it is one line naming the fix, and runs after.
    logits, cache = _logits(model, "kvquant(bits=4)", random_ids(40, 0), random_ids(4, 1))
    assert torch.isfinite(logits).all() and cache.stats().kv_bytes > 0
    assert_one_line_error(lambda: _logits(model, "kvquant(bits=4)", random_ids(70, 0), random_ids(2, 1)),
                          UnsupportedModelError, "use pre_rope=false")
    logits, cache = _logits(model, "kvquant(bits=4,pre_rope=false)", random_ids(70, 0), random_ids(2, 1))
    assert torch.isfinite(logits).all()


def test_gemma3_rope_follows_the_layer_type():
    model = tiny_gemma3()  # layer 0 sliding (local base), layer 3 full (global base)
    keys = _layer0_keys(model)
    positions = torch.arange(keys.shape[1]).expand(keys.shape[0], -1)
    wrong = rope_hook(model, 3)  # the global base is not what layer 0 used
    assert (wrong.unrotate(keys, positions) - wrong.unrotate(keys, positions)[:, :1]).abs().max().item() > 1e-3
    assert model.config.layer_types[0] != model.config.layer_types[3]


def test_pre_rope_is_refused_where_no_hook_exists():
    model = tiny_model("gpt_oss")
    assert model.config.model_type not in ROTATE_HALF_ROPE
    assert_one_line_error(lambda: _logits(model, "kvquant(bits=4)", random_ids(20, 0), random_ids(2, 1)),
                          UnsupportedModelError, "use pre_rope=false")
    logits, cache = _logits(model, "kvquant(bits=4,pre_rope=false)", random_ids(20, 0), random_ids(2, 1))
    assert torch.isfinite(logits).all() and cache.stats().kv_bytes > 0


# --- eviction, batches, shared prefill -----------------------------------------------------------
def test_eviction_keeps_kept_tokens_exactly_as_encoded():
    store = KVQuantStore(_codec(), sink=2, residual=3, kv_dtype=torch.float32)
    store.append(torch.randn(2, 12, 16), torch.randn(2, 12, 16))
    store.seal()
    keys, values = store.keys_values()
    before = store.nbytes
    index = torch.tensor([[0, 3, 4, 8, 10, 11], [1, 2, 5, 6, 7, 9]])  # head 0 keeps a sink, head 1 both
    store.select(index)
    kept_keys, kept_values = store.keys_values()
    assert torch.equal(kept_keys, keys.gather(1, index[..., None].expand(-1, -1, 16)))
    assert torch.equal(kept_values, values.gather(1, index[..., None].expand(-1, -1, 16)))
    assert store.length == 6 and store.nbytes < before


def _stores_to_seal(codec, seed):
    """Four stores of one layer as a batch leaves them before sealing: different lengths and original positions
    (left-padded rows, an eviction), a sink, evicted slots in a tail, and one with nothing due."""
    generator = torch.Generator().manual_seed(seed)
    stores = []
    for length, first, evict in ((30, 0, False), (17, 5, False), (25, 0, True), (3, 0, False)):
        store = KVQuantStore(codec, sink=2, residual=4, kv_dtype=torch.bfloat16, compute_dtype=torch.float32)
        store.append(torch.randn(2, length, 16, generator=generator) * 3, torch.randn(2, length, 16, generator=generator))
        if evict:  # heads keep different slots: the tail has dead slots when it seals
            keep = length - 6
            store.select(torch.stack([torch.randperm(length, generator=generator)[:keep].sort().values for _ in range(2)]))
        positions = first + torch.arange(store.length).expand(2, -1) * 2  # not the order of appending
        store.place_positions(positions)
        stores.append(store)
    return stores


def test_sealing_stores_together_encodes_each_exactly_as_alone():
    """``KVQuantStore.seal_all`` encodes the batch's due tokens in one call: every store then holds, bit for bit,
    what sealing it alone gives (codes, outliers, ranges, sinks, tail, positions, liveness), reads back the same
    K/V and counts the same bytes. Sealed twice (a decode step after the prefill), too."""
    codec = _codec(k=2)
    codec.rope = rope_hook(tiny_llama(), 0)  # pre-RoPE keys: encoded at their own positions
    alone, together = _stores_to_seal(codec, 3), _stores_to_seal(codec, 3)
    for round_ in range(2):
        for store in alone:
            store.seal()
        KVQuantStore.seal_all(together)
        for a, b in zip(alone, together):
            for mine, theirs in zip(a.segments, b.segments):
                assert mine.data.keys() == theirs.data.keys()
                for name in mine.data:
                    assert torch.equal(mine.data[name], theirs.data[name]), name
                assert (mine.alive is None) == (theirs.alive is None)
                assert mine.alive is None or torch.equal(mine.alive, theirs.alive)
            for x, y in zip(a.keys_values(), b.keys_values()):
                assert torch.equal(x, y)
            assert a.nbytes == b.nbytes and a.length == b.length
        if round_ == 0:  # three stores had tokens due (the short one none), encoded side by side
            assert [bool(s.body.data) for s in together] == [True, True, True, False]
        for a, b in zip(alone, together):  # the next step: one new token each
            new = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(a.length))
            a.append(new[:, :3], new[:, 3:])
            b.append(new[:, :3], new[:, 3:])


@pytest.mark.parametrize("bits,outliers,rope,nuq", [(4, 2, True, True), (3, 1, True, False), (2, 0, False, True),
                                                    (8, 16, True, True)])
def test_reading_an_encoding_at_once_equals_decoding_it(bits, outliers, rope, nuq):
    """``read_encoded`` (a batched decode step's encode-then-read, without packing) gives ``decode(encode(...))``
    bit for bit: codes, outliers (also every entry one), value ranges, and keys rotated back at their positions."""
    generator = torch.Generator().manual_seed(bits)
    levels = torch.linspace(-1, 1, 2**bits)
    if nuq:
        levels = (torch.rand(2**bits, generator=generator) * 2 - 1).sort().values
    codec = KVQuantCodec(bits, torch.randn(2, 16, generator=generator), torch.rand(2, 16, generator=generator) + 0.5,
                         levels, levels.flip(0).neg(), outliers, rope_hook(tiny_llama(), 1) if rope else None)
    keys, values = (torch.randn(2, 9, 16, generator=generator) * 2 for _ in range(2))
    positions = torch.tensor([[0, 1, 2, 7, 8, 30, 31, 32, 500]]).expand(2, -1)
    for kv_dtype, dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)):
        expected = codec.decode(codec.encode(keys, values, positions, kv_dtype), positions, dtype)
        got = codec.read_encoded(keys, values, positions, kv_dtype, dtype)
        for e, g in zip(expected, got):
            assert g.dtype == dtype and torch.equal(e, g)


def test_batches_give_the_tokens_and_bytes_of_batch_size_one():
    model, prompts = tiny_llama(), random_prompts([(12, 3), (20, 3), (7, 3)], seed=20)
    for spec in ("kvquant(bits=4)", "snapkv(ratio=0.5)+kvquant(bits=2,residual=2)"):
        assert_one_batch_equals_batch_size_one(model, Tok(), prompts, spec, max_new_tokens=4)


def test_stacked_with_snapkv_holds_fewer_bytes_and_a_shared_prefill_equals_its_own():
    model = tiny_gemma3()  # sliding window 16 < context: the derived store must get the tokens' real positions
    specs = ["kvquant(bits=4)", "snapkv(ratio=0.5)+kvquant(bits=4)"]
    shared = assert_shared_prefill_equals_own_runs(model, Tok(), random_prompts([(40, 3)], seed=5), specs,
                                                   max_new_tokens=4, kv_dtype=EXACT)
    assert shared[specs[1]][0].stats.kv_bytes < shared[specs[0]][0].stats.kv_bytes


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_an_mla_latents_narrower_rope_key_decodes_from_its_codes(bits):
    """On MLA (a tiny DeepSeek V3 with a 32-wide latent as keys and an 8-wide RoPE key as values) the values were
    unpacked at the latent's width: at 3 bits the decode from codes (a GPU's default, ``quantized_decode="codes"``)
    raised, and the values' outliers were counted at the latent's width (4 of 8 at outliers=0.1, not 1). Codes and
    buffer give the same logits, and each coded token holds the bytes its own widths say."""
    model = tiny_model("deepseek_v3", qk_rope_head_dim=8, head_dim=8)  # head_dim: the RoPE width in its config
    context, steps = random_ids(40, 1), random_ids(4, 2)
    spec = f"kvquant(bits={bits},outliers=0.1,pre_rope=false,calib_tokens=96,sink=0)"
    runs = {}
    for mode in ("buffer", "codes"):
        cache = CompressedCache(model, parse_policy(spec), kv_dtype=EXACT, quantized_decode=mode)
        n = context.shape[1]
        with torch.no_grad():
            logits = [model(context, cache=cache, position_ids=torch.arange(n)[None]).logits[0, -1]]
            for i in range(steps.shape[1]):
                logits.append(model(steps[:, i:i + 1], cache=cache, position_ids=torch.tensor([[n + i]])).logits[0, -1])
        runs[mode] = (torch.stack(logits), cache.stats().kv_bytes)
    assert torch.equal(runs["buffer"][0], runs["codes"][0]) and runs["buffer"][1] == runs["codes"][1]
    # Per token and layer: latent codes (32 x bits) and 4 outliers (4 B value, 1 B index each); RoPE key codes
    # (8 x bits) and 1 outlier, and its float16 lo and hi.
    per_token = (32 * bits // 8 + 4 * 5) + (8 * bits // 8 + 1 * 5 + 4)
    assert runs["codes"][1] == model.config.num_hidden_layers * (40 + 4) * per_token


def test_per_head_budgets_are_refused_in_one_line():
    # HeadwiseStore gives each KV head its own store, which cannot tell which head's calibration it holds.
    assert_one_line_error(lambda: _logits(tiny_llama(), "snapkv(ratio=0.5,adaptive=true)+kvquant(bits=4)",
                                          random_ids(20, 0), random_ids(2, 1)), PolicySpecError, "per-head budgets")


# --- parameters ---------------------------------------------------------------------------------
def test_fits_any_head_dim_as_runs_and_sweeps_fit_it():
    stack = parse_policy("snapkv(ratio=0.5)+kvquant(bits=3)")
    stack.fit_groups(256)
    assert stack.spec == "snapkv(ratio=0.5)+kvquant(bits=3)"


@pytest.mark.parametrize("spec, message", [
    ("kvquant(bits=5)", "use 2, 3, 4 or 8"),
    ("kvquant(outliers=1.5)", "0 <= outliers <= 1"),
    ("kvquant(outliers=x)", "is not a number"),
    ("kvquant(sink=-1)", ">= 0"),
    ("kvquant(residual=2.5)", "is not an integer"),
    ("kvquant(calibration=/no/such/file.txt)", "missing or empty"),
    ("lowrank(rank=8)+kvquant", "not a structure's rank coefficients"),
])
def test_bad_parameters_are_one_policy_spec_error(spec, message):
    assert_one_line_error(lambda: parse_policy(spec), PolicySpecError, message)


# --- embedded models ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_embedded_models_generate_with_a_quarter_of_the_bytes(name, monkeypatch):
    monkeypatch.delenv("KVEVAL_CACHE")  # the real cache: dequantized weights (and this calibration) live there
    from kveval.runner.generation import encode_prompt, generate
    from kveval.runner.models import load_model

    model, tokenizer = load_model(name)
    prompt = encode_prompt(tokenizer, "The pass key is 71432. Remember it. 71432 is the pass key. " * 8 + "What is the pass key?")
    none, = generate(model, tokenizer, [prompt], parse_policy("none"), max_new_tokens=6)
    ours, = generate(model, tokenizer, [prompt], parse_policy("kvquant(bits=4,calib_tokens=256)"), max_new_tokens=6)
    assert ours.token_ids and ours.stats.kv_bytes < none.stats.kv_bytes / 3
    assert parse_policy("kvquant(bits=4,calib_tokens=256)").quantization.codebook_bytes(model) > 0
