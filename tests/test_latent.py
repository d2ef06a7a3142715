"""The cross-head latent structure policy (``latent``) on tiny random models."""

import pytest
import torch
from test_lowrank import EXACT, FULL_RANK_TOLERANCE

from kveval.cache.compressed import CompressedCache
from kveval.policies.spec import parse_policy
from kveval.runner.runspec import RunSpec
from kveval.stores.base import DenseStore
from kveval.stores.latent import LatentStore

from cache_runs import (
    assert_one_batch_equals_batch_size_one,
    assert_one_line_error,
    assert_shared_prefill_equals_own_runs,
    context_then_question,
    logit_errors,
    prefill,
    random_ids,
    random_prompts,
)
from tiny_models import Tok, tiny_gemma3, tiny_llama

pytestmark = pytest.mark.usefixtures("calibration_cache")  # every test calibrates into its own folder


def test_bytes_per_token_are_the_coefficient_arithmetic():
    model = tiny_llama()  # 2 layers, 2 KV heads, head_dim 16, bf16 deployment cache
    layers, tokens = 2, 64
    per_layer = {  # bytes per token and layer
        "latent(rank=12)": (12 + 12) * 2,  # one group of 2 heads: 12 K + 12 V coefficients in bf16
        "latent(rank=8,group=1)": 2 * (8 + 8) * 2,  # two groups of one head each
        "latent(rank=6,rope_dims=4)": ((6 + 2 * 4) + 6) * 2,  # K: 6 coefficients + 4 RoPE dims of each of 2 heads
        "latent(rank=8,rope_dims=4)+quant(bits=8,group=8)": (16 + 2 * 4) + (8 + 1 * 4),  # codes + fp16 scale/zero per group
        "latent(rank=8)+quant(bits=4,group=8)": (4 + 1 * 4) + (4 + 1 * 4),  # two codes per byte
    }
    for spec, expected in per_layer.items():
        stats = prefill(model, spec, random_ids(tokens, 4)).stats()
        assert stats.kv_bytes == layers * tokens * expected, spec
        assert stats.bytes_per_token == layers * expected, spec
    # The bases are per model and reported apart: float32, (K: 2*(16-4) + V: 2*16) x rank per layer.
    assert parse_policy("latent(rank=6,rope_dims=4)").structure.basis_bytes(model) == layers * 4 * 6 * (2 * 12 + 2 * 16)


@pytest.mark.parametrize("make, spec", [
    (tiny_llama, "latent(rank=32)"),  # 2 heads x 16: the whole layer in one latent
    (tiny_llama, "latent(rank=16,group=1)"),
    (tiny_gemma3, "latent(rank=32)"),  # one KV head of 32, sliding layers included
])
def test_full_rank_reproduces_uncompressed_logits(make, spec):
    model = make()
    context, question = random_ids(40, 0), random_ids(8, 1)
    base, _ = context_then_question(model, "none", context, question, EXACT)
    ours, cache = context_then_question(model, spec, context, question, EXACT)
    assert (ours - base).abs().max().item() < FULL_RANK_TOLERANCE
    assert all(isinstance(row.store, LatentStore) for layer in cache.layers for row in layer.rows)


def test_lower_rank_moves_logits_further_from_baseline():
    specs = [f"latent(rank={rank})" for rank in (32, 16, 8, 4, 2)]
    errors = logit_errors(tiny_llama(), specs, random_ids(48, 2), random_ids(16, 3), EXACT)
    assert errors[0] < 1e-10
    assert errors == sorted(errors) and len(set(errors)) == 5, errors


def test_group_of_one_head_is_per_head_low_rank():
    """``latent(rank=r,group=1)`` is ``lowrank(rank=r)``: the same bases (one PCA per head), the same logits and bytes."""
    model = tiny_llama()
    context, question = random_ids(40, 5), random_ids(6, 6)
    latent, latent_cache = context_then_question(model, "latent(rank=6,group=1)", context, question)
    per_head, lowrank_cache = context_then_question(model, "lowrank(rank=6)", context, question)
    assert torch.allclose(latent, per_head, atol=1e-5)
    assert latent_cache.stats().kv_bytes == lowrank_cache.stats().kv_bytes


def test_rope_dimensions_are_the_most_energetic_pairs_and_stay_exact():
    model = tiny_llama()
    policy = parse_policy("latent(rank=4,rope_dims=4)").structure
    calibration = policy.calibration_for(model)
    energy = calibration.pair_energy(0)  # [2 heads, 8 pairs]
    chosen = calibration.rope_dimensions(0, 4)  # [2 heads, 4 dims]: 2 pairs (i, i + 8) per head
    for h in range(2):
        pairs = sorted(int(d) for d in chosen[h] if d < 8)
        assert sorted(int(d) - 8 for d in chosen[h] if d >= 8) == pairs
        assert pairs == sorted(energy[h].topk(2).indices.tolist())
    store = policy.make_store(DenseStore(torch.float32, torch.float32), model, 0)
    keys, values = torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    store.append(keys, values)
    store.seal()
    k, _ = store.keys_values()
    kept = chosen[:, None, :].expand(-1, 10, -1)
    assert torch.equal(k.gather(-1, kept), keys.gather(-1, kept))  # RoPE dims stored as they are
    assert not torch.allclose(k, keys, atol=1e-2)  # the rest went through a rank-4 latent
    # At rank 2 x (16 - 4) the latent holds every other key dimension: keys come back whole (values, rank 24 of 32, do not).
    full = parse_policy("latent(rank=24,rope_dims=4)").structure.make_store(DenseStore(torch.float32, torch.float32), model, 0)
    full.append(keys, values)
    full.seal()
    k, v = full.keys_values()
    assert torch.allclose(k, keys, atol=1e-5) and not torch.allclose(v, values, atol=1e-2)


def test_selection_keeps_one_set_of_tokens_per_group():
    model = tiny_llama()
    for spec in ("snapkv(ratio=0.5,window=4)+latent(rank=8)", "h2o(ratio=0.5,decode_budget=30)+latent(rank=8)+quant(bits=8,group=8)"):
        logits, cache = context_then_question(model, spec, random_ids(48, 7), random_ids(4, 8))
        assert torch.isfinite(logits).all()
        for layer in cache.layers:
            positions = layer.rows[0].positions
            assert torch.equal(positions[0], positions[1]), spec  # both heads of the group keep the same tokens
        kept = [row[0] for row in cache.stats().kept_tokens]
        assert all(k < 52 for k in kept), spec
    # The same selection on per-head low rank lets the heads disagree (the averaging is what makes them agree).
    _, cache = context_then_question(model, "snapkv(ratio=0.5,window=4)+latent(rank=8,group=1)", random_ids(48, 7), random_ids(4, 8))
    assert any(not torch.equal(layer.rows[0].positions[0], layer.rows[0].positions[1]) for layer in cache.layers)


def test_selected_and_quantized_bytes_follow_kept_tokens():
    model = tiny_llama()
    _, cache = context_then_question(model, "snapkv(ratio=0.5,window=4)+latent(rank=8)+quant(bits=8,group=8)", random_ids(48, 9), random_ids(4, 10))
    stats = cache.stats()
    assert stats.kv_bytes == sum(row[0] for row in stats.kept_tokens) * ((8 + 4) + (8 + 4))


def test_store_refuses_different_tokens_inside_a_group():
    model = tiny_llama()
    store = parse_policy("latent(rank=8)").structure.make_store(DenseStore(torch.float32, torch.float32), model, 0)
    store.append(torch.randn(2, 6, 16), torch.randn(2, 6, 16))
    with pytest.raises(ValueError, match="share their tokens"):
        store.select(torch.tensor([[0, 1, 2], [0, 1, 3]]))
    store.select(torch.tensor([[0, 2, 5], [0, 2, 5]]))
    store.seal()
    assert store.length == 3 and store.keys_values()[0].shape == (2, 3, 16)


def test_gemma_sliding_layers_and_bytes():
    model = tiny_gemma3()  # 4 layers (3 sliding, window 16), 1 KV head of 32
    logits, cache = context_then_question(model, "latent(rank=12,rope_dims=4)", random_ids(40, 11), random_ids(8, 12))
    assert torch.isfinite(logits).all()
    kept = [row[0] for row in cache.stats().kept_tokens]
    assert kept[3] == 48 and all(k < 48 for k in kept[:3])
    assert cache.stats().kv_bytes == sum(kept) * ((12 + 4) + 12) * 2


@pytest.mark.parametrize("spec", ["latent(rank=8)+quant(bits=8,group=8)", "snapkv(ratio=0.5,window=4)+latent(rank=12,rope_dims=2)"])
def test_batches_give_the_answers_of_batch_size_one(spec):
    prompts = random_prompts([(12, 3), (20, 3), (7, 3)], seed=20)
    one = assert_one_batch_equals_batch_size_one(tiny_llama(), Tok(), prompts, spec, max_new_tokens=4)
    assert len({r.stats.kv_bytes for r in one}) == 3  # per item: each prompt's own length


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_shared_prefill_equals_own_prefill(make):
    specs = ["latent(rank=8)", "snapkv(ratio=0.5,window=4)+latent(rank=8)+quant(bits=8,group=8)"]
    assert_shared_prefill_equals_own_runs(make(), Tok(), random_prompts([(30, 4), (45, 4)], seed=60), specs,
                                          max_new_tokens=4, batch_size=2)


@pytest.mark.parametrize("spec, message", [
    ("latent", "give rank="),
    ("latent(rank=0)", "positive integer"),
    ("latent(rank=4,group=0)", "positive integer"),
    ("latent(rank=4,rope_dims=3)", "even number"),
    ("latent(rank=4,rope_dims=-2)", "even number"),
    ("latent(rank=4,calib_tokens=1)", "at least 2"),
])
def test_bad_specs_name_the_problem(spec, message):
    assert_one_line_error(lambda: parse_policy(spec), ValueError, message)


@pytest.mark.parametrize("spec, message", [
    ("latent(rank=33)", "exceeds group x \\(head_dim - rope_dims\\) = 2 x \\(16 - 0\\) = 32"),
    ("latent(rank=17,group=1)", "use at most 16"),
    ("latent(rank=25,rope_dims=4)", "use at most 24"),
    ("latent(rank=4,group=3)", "group=3 does not divide the 2 KV heads"),
    ("latent(rank=4,rope_dims=18)", "rope_dims=18 exceeds head_dim=16"),
    ("latent(rank=6,rope_dims=2)+quant(bits=8,group=4)", "group=4 does not divide the k width 10"),
])
def test_parameters_are_checked_against_the_model(spec, message):
    model = tiny_llama()
    assert_one_line_error(lambda: CompressedCache(model, parse_policy(spec)).new_store(0, torch.float32), ValueError, message)


def test_run_spec_checks_the_model_shape_and_fits_quant_groups():
    """Before any weights load: widths per group may exceed head_dim; an unset quant group adapts to them."""
    assert RunSpec.parse("latent(rank=96)").for_model("smollm2-135m").policy.spec == "latent(rank=96)"  # 3 heads x 64
    fitted = RunSpec.parse("latent(rank=64,rope_dims=8)+quant(bits=8)").for_model("smollm2-135m").policy
    assert fitted.quantization.group == 8  # K width 64 + 3 x 8 = 88, V width 64: largest divisor <= 64 of both is 8
    with pytest.raises(ValueError, match="use at most 192"):
        RunSpec.parse("latent(rank=200)").for_model("smollm2-135m")
    with pytest.raises(ValueError, match="group=2 does not divide the 3 KV heads"):
        RunSpec.parse("latent(rank=8,group=2)").for_model("smollm2-135m")
    assert RunSpec.parse("latent(rank=128)").for_model("gemma3-270m").policy.spec == "latent(rank=128)"  # 1 head of 256


def test_memory_planner_counts_one_stream_per_group_and_matches_the_cache():
    from kveval.planner.memory import plan

    # SmolLM2: 30 layers, 3 KV heads x 64, bf16. One latent for 3 heads at rank 48 is lowrank(rank=16)'s bytes.
    assert plan("smollm2-135m", 10, policy=parse_policy("latent(rank=48)")).bytes_per_token == 30 * (48 + 48) * 2
    assert plan("smollm2-135m", 10, policy=parse_policy("lowrank(rank=16)")).bytes_per_token == 30 * (48 + 48) * 2
    p = plan("smollm2-135m", 10, policy=parse_policy("latent(rank=36,rope_dims=8)"))
    assert (p.key_bytes_per_token, p.value_bytes_per_token) == (30 * (36 + 3 * 8) * 2, 30 * 36 * 2)
    assert plan("smollm2-135m", 10, policy=parse_policy("latent(rank=48,group=1)")).bytes_per_token == 30 * 3 * (48 + 48) * 2
    q = plan("smollm2-135m", 10, policy=parse_policy("latent(rank=48)+quant(bits=8,group=16)"))  # 48 codes + 3 groups x 4 bytes
    assert q.bytes_per_token == 30 * 2 * (48 + 3 * 4)
    with pytest.raises(ValueError, match="use at most 192"):
        plan("smollm2-135m", 10, policy=parse_policy("latent(rank=193)"))
