"""KV shared across layers: ``share`` (CLA/YOCO-style reading of an earlier layer's K/V) and ``minicache`` (adjacent
layers merged by SLERP), on tiny models: what each reading layer's attention receives, bytes planned == measured,
batch 3 == batch 1, MiniCache's merge against the paper's equations, the stacks and the refusals, and the
architecture matrix."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cache_runs import assert_one_batch_equals_batch_size_one, assert_one_line_error, context_then_steps, random_ids
from tiny_models import ARCHITECTURES, NATIVE_ARCHITECTURES, Tok, tiny_gemma3, tiny_model

import kveval.cache.attention as attention
from kveval.cache.compressed import CompressedCache
from kveval.cache.exactness import prefill_and_decode
from kveval.errors import PolicySpecError, UnsupportedModelError, UsageError
from kveval.planner.memory import plan
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt
from kveval.runner.runspec import RunSpec
from kveval.stores.merged import merge_streams, slerp_merge


@pytest.fixture
def attended(monkeypatch):
    """Every attention call's ``(layer, keys, values)`` as the kernel received them, in call order."""
    seen = []
    own = attention.attention_kernel

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def attend(self, module, query, key, value, *args):
            seen.append((module.layer_idx, key.clone(), value.clone()))
            return self.kernel.attend(module, query, key, value, *args)

        def __getattr__(self, name):
            return getattr(self.kernel, name)

    monkeypatch.setattr(attention, "attention_kernel", lambda module, kwargs: Recording(own(module, kwargs)))
    return seen


def _llama4():
    return tiny_model("llama", num_hidden_layers=4)


def _by_layer(seen) -> dict[int, list]:
    out: dict[int, list] = {}
    for layer, keys, values in seen:
        out.setdefault(layer, []).append((keys, values))
    return out


@pytest.mark.parametrize("spec", ["share(groups=2)", "share(map=3:1)",
                                  "snapkv(ratio=0.5)+share(groups=2)+quant(bits=8,group=32)",
                                  "h2o(ratio=0.5,decode_budget=24)+share(groups=3,start=1)"])
def test_a_reading_layer_attends_to_exactly_its_sources_kv(attended, spec):
    """Prefill and 4 decode steps: each reading layer's attention receives its source's K/V, equal to the bit; in
    the decode steps those are the source's stored (compressed) tokens plus the new one."""
    model = _llama4()
    _, cache = context_then_steps(model, spec, random_ids(40, 1), random_ids(4, 2), kv_dtype="bfloat16")
    assert cache.reused
    by_layer = _by_layer(attended)
    for reader, source in cache.reused.items():
        assert len(by_layer[reader]) == len(by_layer[source]) == 5
        for (k, v), (sk, sv) in zip(by_layer[reader], by_layer[source]):
            assert torch.equal(k, sk) and torch.equal(v, sv), (spec, reader, source)
    # after the last step the source holds what its next read will be: its stored tokens
    for reader, source in cache.reused.items():
        stored_keys, _ = cache.layers[source].rows[0].store.keys_values()
        assert by_layer[reader][-1][0][0, :, :stored_keys.shape[1]].shape == stored_keys.shape


def test_a_reading_layer_reads_its_source_where_quantized_layers_decode_from_codes(attended):
    """Decoding from codes (a GPU's default), a quantized layer's K/V are dequantized into a scratch every layer
    shares: the reading layer still receives its source's, not the scratch's next tenant."""
    model = _llama4()
    cache = CompressedCache(model, parse_policy("share(groups=2)+kivi(bits=2,group=32,residual=4)"),
                            quantized_decode="codes")
    ids, steps = random_ids(40, 1), random_ids(6, 2)
    with torch.no_grad():
        model(ids, cache=cache, position_ids=torch.arange(40)[None])
        for i in range(6):
            model(steps[:, i:i + 1], cache=cache, position_ids=torch.tensor([[40 + i]]))
    by_layer = _by_layer(attended)
    for reader, source in cache.reused.items():
        assert all(torch.equal(k, sk) and torch.equal(v, sv)
                   for (k, v), (sk, sv) in zip(by_layer[reader], by_layer[source], strict=True))


def test_share_with_every_layer_its_own_source_is_none_bit_for_bit():
    model = _llama4()
    base, base_cache = context_then_steps(model, "none", random_ids(40, 1), random_ids(3, 2))
    for spec in ("share(groups=1)", "share(groups=1,start=2)"):
        logits, cache = context_then_steps(model, spec, random_ids(40, 1), random_ids(3, 2))
        assert cache.reused == {}
        assert all(torch.equal(a, b) for a, b in zip(logits, base))
        assert cache.stats().kv_bytes == base_cache.stats().kv_bytes


def test_sharing_changes_the_answers_and_halves_the_bytes():
    """Training-free sharing is lossy (the reading layers' own K/V are discarded), and 2 of 4 layers hold nothing."""
    model = _llama4()
    base, base_cache = context_then_steps(model, "none", random_ids(40, 1), random_ids(3, 2))
    logits, cache = context_then_steps(model, "share(groups=2)", random_ids(40, 1), random_ids(3, 2))
    assert cache.reused == {1: 0, 3: 2}
    assert not torch.equal(logits[0], base[0])
    stats = cache.stats()
    assert stats.kv_bytes * 2 == stats.nominal_bytes == base_cache.stats().kv_bytes
    assert stats.kept_tokens == [[43], [0], [43], [0]]


@pytest.mark.parametrize("spec", ["share(groups=2)", "share(map=3:1;2:0)", "share(groups=3,start=1)+kivi(bits=2,group=32)",
                                  "snapkv(ratio=0.5)+share(groups=2)+quant(bits=8,group=32)",
                                  "knorm(ratio=0.3,adaptive=true)+share(groups=2)",
                                  "minicache", "minicache(start=0,retain=0.2)", "minicache(t=0.3,retain=0)",
                                  "minicache(start=0)+kivi(bits=4,group=32,residual=8)",
                                  "minicache(retain=0.2)+quant(bits=8,group=32)", "minicache(start=0)+mxfp8",
                                  "window(ratio=0.5)+minicache(start=0)+kivi(bits=2,group=16)",
                                  "streaming(sink=2,ratio=0.3)+minicache(retain=0.1)"])
@pytest.mark.parametrize("dtype, size", [("bfloat16", 2), ("float32", 4)])
def test_planned_equals_measured(spec, dtype, size):
    model = _llama4()
    _, cache = context_then_steps(model, spec, random_ids(40, 1), random_ids(3, 2), kv_dtype=dtype)
    stats = cache.stats()
    planned = plan(model.config, 40, policy=parse_policy(spec), new_tokens=3, dtype_bytes=size)
    assert (planned.sequence_bytes, planned.baseline_sequence_bytes) == (stats.kv_bytes, stats.nominal_bytes), spec
    assert stats.kv_bytes < stats.nominal_bytes
    readers = [layer for layer in planned.layers if layer.kind.startswith("reads")]
    assert len(readers) == len(cache.reused) and all(layer.bytes == 0 for layer in readers)


def test_bytes_per_token_count_what_each_layer_stores():
    """SmolLM2-135M (30 layers, 3 KV heads x 64, bf16: 768 B per layer and token): share(groups=2) stores 15
    layers; minicache(retain=0) pairs layers 15-29 into 7 pairs of one direction (64) and two magnitudes per head, K
    and V, beside 16 whole layers."""
    shared = plan("smollm2-135m", 4096, policy=parse_policy("share(groups=2)"))
    merged = plan("smollm2-135m", 4096, policy=parse_policy("minicache(retain=0)"))
    assert shared.bytes_per_token == 15 * 768 and shared.sequence_bytes == 15 * 768 * 4096
    assert merged.bytes_per_token == 16 * 768 + 7 * 2 * 3 * (64 + 2) * 2
    assert merged.sequence_bytes == merged.bytes_per_token * 4096


def test_sliding_and_full_layers_never_share():
    """Gemma 3's sliding and full layers: groups= groups each kind apart; map= across kinds is refused in one line
    before a forward, and the planner refuses it too."""
    model = tiny_model("gemma3", num_hidden_layers=6, sliding_window=16,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                    "full_attention", "sliding_attention"])
    cache = CompressedCache(model, parse_policy("share(groups=2)"))
    assert cache.reused == {1: 0, 5: 3, 4: 2}
    for spec in ("share(groups=2)", "share(groups=2)+quant(bits=8,group=32)", "minicache(start=0)"):
        _, cache = context_then_steps(model, spec, random_ids(40, 1), random_ids(20, 2), kv_dtype="float32")
        planned = plan(model.config, 40, policy=parse_policy(spec), new_tokens=20, dtype_bytes=4)
        assert planned.sequence_bytes == cache.stats().kv_bytes, spec
    message = "layers 2 and 1 are of different kinds"
    assert_one_line_error(lambda: CompressedCache(model, parse_policy("share(map=2:1)")), PolicySpecError, message)
    assert_one_line_error(lambda: plan(model.config, 40, policy=parse_policy("share(map=2:1)")), PolicySpecError, message)
    assert_one_line_error(lambda: RunSpec.parse("share(map=2:1)").for_model(model.config), PolicySpecError, message)
    assert_one_line_error(lambda: RunSpec.parse("share(map=9:1)").for_model(model.config), PolicySpecError,
                          "layer 9 holds no K/V of its own on this model")
    # every layer slides: no pair of full layers for MiniCache
    sliding = tiny_gemma3(layer_types=["sliding_attention"] * 4)
    assert_one_line_error(lambda: CompressedCache(sliding, parse_policy("minicache")), PolicySpecError, "no pair to merge")


def test_batch_of_three_gives_the_answers_and_bytes_of_batch_one():
    model = _llama4()
    prompts = [Prompt(random_ids(n, 10 + n)[0].tolist(), list(range(5, 5 + q))) for n, q in ((40, 3), (27, 1), (33, 4))]
    for spec in ("snapkv(ratio=0.5)+share(groups=2)+kivi(bits=4,group=32,residual=8)", "minicache(start=0,retain=0.1)",
                 "minicache(start=0,retain=0.1)+kivi(bits=4,group=32,residual=4)",
                 "window(ratio=0.4)+minicache(start=0)+quant(bits=8,group=32)"):
        assert_one_batch_equals_batch_size_one(model, Tok(), prompts, spec, max_new_tokens=5)


# --- MiniCache's merge, against the paper's equations ------------------------------------------------------------
def test_slerp_merge_follows_the_papers_equations_on_a_hand_made_case():
    """x = (2, 0), y = (0, 3): directions 90 degrees apart (angular distance 1/2). SLERP at t = 1/2 gives the unit
    bisector (sin(pi/4) / sin(pi/2) on each), and each layer restores its magnitude times it."""
    x = torch.tensor([[[2.0, 0.0], [1.0, 1.0]]])
    y = torch.tensor([[[0.0, 3.0], [2.0, 2.0]]])
    e, nx, ny, distance = slerp_merge(x, y, 0.5)
    half = math.sqrt(0.5)
    assert torch.allclose(e[0, 0], torch.tensor([half, half]))
    assert torch.allclose(e[0, 1], torch.tensor([half, half]))  # the same direction: parallel, e is it
    assert torch.allclose(nx[0], torch.tensor([2.0, math.sqrt(2)])) and torch.allclose(ny[0], torch.tensor([3.0, math.sqrt(8)]))
    assert torch.allclose(distance[0], torch.tensor([0.5, 0.0]), atol=1e-3)  # arccos near 1: float32's sqrt(eps)
    # t = 1/4: weights sin(3/4 omega) / sin(omega), sin(1/4 omega) / sin(omega) with omega = pi/2
    e, *_ = slerp_merge(x[:, :1], y[:, :1], 0.25)
    assert torch.allclose(e[0, 0], torch.tensor([math.sin(3 * math.pi / 8), math.sin(math.pi / 8)]))
    assert torch.allclose(e.norm(dim=-1), torch.ones(1, 1))


def test_the_most_divergent_tokens_are_kept_apart_whole():
    """Three tokens; the second's two directions are opposite (distance 1): with one kept apart, it is restored
    exactly in both layers, the others as magnitude x merged direction. The earlier layer holds the directions and
    the slots once."""
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [3.0, 4.0]]])
    y = torch.tensor([[[2.0, 0.0], [0.0, -5.0], [4.0, 3.0]]])
    first, second = merge_streams(x, y, 0.5, 1, torch.float32)
    assert first.slots.tolist() == [[1]] and first.directions.shape == (1, 2, 2)
    restored_x, restored_y = first.restored(torch.float32), second.restored(torch.float32)
    assert torch.equal(restored_x[0, 1], x[0, 1]) and torch.equal(restored_y[0, 1], y[0, 1])
    bisector = torch.tensor([7.0, 7.0]) / math.sqrt(98)  # SLERP at 1/2 of (3,4)/5 and (4,3)/5
    assert torch.allclose(restored_x[0, 2], 5 * bisector) and torch.allclose(restored_y[0, 2], 5 * bisector)
    assert torch.allclose(restored_x[0, 0], x[0, 0]) and torch.allclose(restored_y[0, 0], y[0, 0])
    assert first.nbytes == 4 * (2 * 2 + 2 + 2 + 1) and second.nbytes == 4 * (2 + 2)


def test_minicache_keeping_every_token_apart_answers_as_none():
    model = _llama4()
    base, _ = context_then_steps(model, "none", random_ids(40, 1), random_ids(3, 2))
    whole, _ = context_then_steps(model, "minicache(retain=1)", random_ids(40, 1), random_ids(3, 2))
    merged, cache = context_then_steps(model, "minicache(start=0)", random_ids(40, 1), random_ids(3, 2))
    assert all(torch.equal(a, b) for a, b in zip(whole, base))
    assert torch.equal(merged[0], base[0]) and not torch.equal(merged[1], base[1])  # merged after the prefill
    assert cache.merged == {1: 0, 3: 2}


# --- MiniCache stacked with quantization ---------------------------------------------------------------------------
def test_minicache_merges_the_full_precision_prefill_then_codes_it():
    """MiniCache + KIVI as the paper stacks them: the pair's prefill is merged in full precision (the uncompressed
    prefill's K/V, equal to the bit to a run without any policy), then the directions and retained tokens are coded
    by the quantizer; merging the quantizer's dequantized tokens instead gives other K/V."""
    from kveval.stores.base import DenseStore
    from kveval.stores.quantized import QuantizedStore
    from kveval.stores.merged import merge_stores

    model, spec = _llama4(), "minicache(start=2,retain=0.1)+kivi(bits=4,group=16,residual=4)"
    ids = random_ids(40, 1)
    _, cache = context_then_steps(model, spec, ids, random_ids(0, 2), kv_dtype="bfloat16")
    _, dense = context_then_steps(model, "none", ids, random_ids(0, 2), kv_dtype="bfloat16")
    _, coded = context_then_steps(model, "kivi(bits=4,group=16,residual=4)", ids, random_ids(0, 2), kv_dtype="bfloat16")
    assert cache.merged == {3: 2}
    quant = cache.policy.quantization

    def quantized(dtype):
        return QuantizedStore(quant.key_quant, quant.value_quant, quant.residual_tokens, torch.bfloat16, dtype)

    def merged_from(layers):
        stores = []
        for layer in (2, 3):
            store = DenseStore(torch.bfloat16, torch.float32)
            store.append(*layers[layer].rows[0].store.keys_values())
            stores.append(store)
        return merge_stores(*stores, 0.5, 4, quantized)

    expected, from_codes = merged_from(dense.layers), merged_from(coded.layers)
    for layer, want, other in zip((2, 3), expected, from_codes):
        got = cache.layers[layer].rows[0].store
        assert isinstance(got.directions, QuantizedStore) and got.directions is cache.layers[2].rows[0].store.directions
        assert all(torch.equal(a, b) for a, b in zip(got.keys_values(), want.keys_values())), layer
        assert not torch.equal(got.keys_values()[0], other.keys_values()[0]), layer


def test_minicache_with_a_quantizer_leaves_the_other_layers_as_the_quantizer_alone():
    """Layers 0 and 1 (before the merged pair 2-3) hold exactly what the quantizer alone stores, after the prefill
    and every decode step; the pair holds fewer bytes than under either policy alone."""
    model, quantizer = _llama4(), "kivi(bits=4,group=16,residual=4)"
    ids, steps = random_ids(40, 1), random_ids(6, 2)
    _, alone = context_then_steps(model, quantizer, ids, steps, kv_dtype="bfloat16")
    _, merged = context_then_steps(model, "minicache(start=2)", ids, steps, kv_dtype="bfloat16")
    _, both = context_then_steps(model, f"minicache(start=2)+{quantizer}", ids, steps, kv_dtype="bfloat16")
    assert both.merged == {3: 2}
    for layer in (0, 1):
        a, b = alone.layers[layer].rows[0].store, both.layers[layer].rows[0].store
        assert type(a) is type(b) and a.nbytes == b.nbytes
        assert all(torch.equal(x, y) for x, y in zip(a.keys_values(), b.keys_values())), layer
    pair = [sum(cache.layers[i].rows[0].store.nbytes for i in (2, 3)) for cache in (alone, merged, both)]
    assert pair[2] < pair[0] and pair[2] < pair[1], pair
    # the decode tokens are coded as KIVI codes them: of 6 appended, V (per token) holds the 4 newest whole and codes
    # 2; K (per channel, groups of 16 tokens) waits for a whole group past the residual
    tail = both.layers[3].rows[0].store.tail
    assert tail.length == 6 and (tail.v.tail.shape[1], tail.v.block.tokens) == (4, 2)
    assert tail.k.tail.shape[1] == 6 and tail.k.block is None


def test_minicache_with_a_quantizer_planned_equals_measured_over_a_long_decode():
    """Per-channel keys (groups of 8 tokens) and a residual of 4 through 21 decode steps: the merged directions,
    retained tokens and each layer's decode tokens coded as three stores of the quantizer, as the planner sizes them."""
    model = _llama4()
    for spec in ("minicache(start=0,retain=0.15)+kivi(bits=2,group=8,residual=4)",
                 "window(ratio=0.3)+minicache(start=0)+quant(bits=4,k_axis=channel,group=8,residual=3)"):
        _, cache = context_then_steps(model, spec, random_ids(37, 1), random_ids(21, 2), kv_dtype="bfloat16")
        planned = plan(model.config, 37, policy=parse_policy(spec), new_tokens=21, dtype_bytes=2)
        assert planned.sequence_bytes == cache.stats().kv_bytes, spec
        assert [layer.bytes for layer in planned.layers] == [
            sum(row.store.nbytes for row in layer.rows) for layer in cache.attention_layers], spec


# --- stacks and refusals -------------------------------------------------------------------------------------------
def test_the_stacks_the_family_contract_allows():
    for spec in ("snapkv(ratio=0.5)+share(groups=2)", "quant(bits=8)+share(groups=2)", "knorm(ratio=0.5)+share(map=3:2)+kivi(bits=2)"):
        stack = parse_policy(spec)
        assert stack.structure.name == "share" and stack.prefills_alone and parse_policy(stack.spec).spec == stack.spec
    for spec in ("minicache+quant(bits=8)", "minicache+kivi(bits=4)", "window(ratio=0.5)+minicache+fp8",
                 "streaming(ratio=0.5)+minicache(start=2)+mxfp8"):
        stack = parse_policy(spec)
        assert stack.structure.name == "minicache" and stack.prefills_alone and parse_policy(stack.spec).spec == stack.spec
    for spec, why in (("snapkv(ratio=0.5)+minicache", "keeps each layer's own tokens"),
                      ("h2o(ratio=0.5)+minicache+kivi(bits=4)", "keeps each layer's own tokens"),
                      ("window(size=64)+minicache", "evicts while decoding"),
                      ("streaming(sink=4,window=60)+minicache", "evicts while decoding"),
                      ("minicache+kvquant(bits=4)", "codes sized per token"), ("minicache+vllm", "as they arrive"),
                      ("minicache+fp4(format=nvfp4)", "per tensor")):
        assert_one_line_error(lambda: parse_policy(spec), PolicySpecError, f"minicache does not stack with .*{why}")
    for spec, message in (("share", "give groups="), ("share(groups=2,map=1:0)", "give groups="),
                          ("share(map=1:2)", "runs after it"), ("share(map=2:1;1:0)", "stores nothing"),
                          ("share(map=2)", "is not READER:SOURCE"), ("share(map=1:0,start=3)", "start= acts only"),
                          ("minicache(t=2)", "between 0 and 1")):
        assert_one_line_error(lambda: parse_policy(spec), PolicySpecError, message)


def test_share_cannot_derive_from_a_shared_prefill_nor_score_by_reconstruction():
    model = _llama4()
    assert_one_line_error(lambda: CompressedCache(model, parse_policy("share(groups=2)"), defer_compression=True),
                          UsageError, "prefill it alone")
    assert_one_line_error(lambda: CompressedCache(model, parse_policy("kvzip(ratio=0.5)+share(groups=2)")),
                          UsageError, "reconstruction forwards")


@pytest.mark.parametrize("name", sorted(NATIVE_ARCHITECTURES))
@pytest.mark.parametrize("spec", ["share(groups=2)", "minicache(start=0)", "share(groups=2)+quant(bits=8,group=8)"])
def test_native_caches_refuse_them_in_one_line_before_the_weights_load(name, spec):
    """DeepSeek V3.2, GLM MoE-DSA and V4 keep their own cache layers (indexer keys, compressed entries), whose
    cross-layer reuse kveval does not mirror: refused from the config alone."""
    config = tiny_model(name).config
    message = "layers reading one another's K/V are not mirrored there"
    assert_one_line_error(lambda: RunSpec.parse(spec).for_model(config), UnsupportedModelError, message)
    assert_one_line_error(lambda: plan(config, 100, policy=parse_policy(spec)), ValueError, message)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_architecture_matrix(name):
    """Every architecture: share(groups=2) and minicache(start=0) (alone and with KIVI) run with finite logits, below the uncompressed
    cache wherever they pair layers, planned == measured; minicache is refused in
    one line where no two full-attention layers hold the same tokens."""
    model = tiny_model(name)
    for spec in ("share(groups=2)", "minicache(start=0)", "minicache(start=0)+kivi(bits=4,group=16,residual=4)"):
        try:
            cache = CompressedCache(model, parse_policy(spec), kv_dtype=torch.float32)
        except PolicySpecError as refused:
            assert spec.startswith("minicache") and "no pair to merge" in str(refused) and "\n" not in str(refused)
            continue
        with torch.no_grad():
            logits = prefill_and_decode(model, cache, random_ids(64, 1), 2)
        stats = cache.stats()
        assert all(bool(torch.isfinite(x).all()) for x in logits), spec
        assert (stats.kv_bytes < stats.nominal_bytes) == bool(cache.reused or cache.merged), spec
        planned = plan(model.config, 64, policy=parse_policy(spec), new_tokens=2, dtype_bytes=4)
        assert planned.sequence_bytes == stats.kv_bytes, spec


def test_the_planner_stays_torch_free():
    code = ("import sys; from kveval.planner.memory import plan; from kveval.policies.spec import parse_policy; "
            "p = plan('llama-3.1-8b', 4096, policy=parse_policy('snapkv(ratio=0.5)+share(groups=2)+quant(bits=8)')); "
            "m = plan('llama-3.1-8b', 4096, policy=parse_policy('window(ratio=0.5)+minicache+kivi(bits=4)')); "
            "assert p.sequence_bytes > 0 and m.sequence_bytes > 0; assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).parents[1]))


@pytest.mark.parametrize("spec", ["share(groups=2)", "minicache(start=0)", "share(groups=2)+quant(bits=8)"])
def test_the_planners_uncompressed_bytes_count_every_layer(spec):
    """The uncompressed bytes a token are the model's whatever the policy stores: a reading layer would hold its own
    K/V without compression (the planner once counted only the layers that store, halving the baseline)."""
    from kveval.planner.memory import plan

    none = plan("smollm2-135m", 512)
    shared = plan("smollm2-135m", 512, policy=parse_policy(spec))
    assert shared.baseline_bytes_per_token == none.baseline_bytes_per_token == 23040
    assert shared.bytes_per_token < none.bytes_per_token
