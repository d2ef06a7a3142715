"""The low-rank structure policy on tiny random models (and one short check on SmolLM2)."""

import pytest
import torch

import kveval.calibration.kv as calibration
from kveval.cache.compressed import CompressedCache
from kveval.policies.spec import parse_policy
from kveval.stores.lowrank import LowRankStore

from cache_runs import (
    assert_one_batch_equals_batch_size_one,
    assert_one_line_error,
    context_then_question,
    context_then_steps,
    logit_errors,
    prefill,
    random_ids,
    random_prompts,
)
from tiny_models import Tok, tiny_gemma3, tiny_llama

FULL_RANK_TOLERANCE = 1e-4  # max |logit difference| at rank = head_dim (float32 rounding of x B B^T only)
EXACT = torch.float32  # kv_dtype of the tests on projection arithmetic: coefficients not rounded to the deployment's bf16


pytestmark = pytest.mark.usefixtures("calibration_cache")  # every test calibrates into its own folder


@pytest.mark.parametrize("make, head_dim", [(tiny_llama, 16), (tiny_gemma3, 32)])
def test_full_rank_reproduces_uncompressed_logits(make, head_dim):
    model = make()
    context, steps = random_ids(40, 0), random_ids(6, 1)
    base, _ = context_then_steps(model, "none", context, steps, EXACT)
    ours, cache = context_then_steps(model, f"lowrank(rank={head_dim})", context, steps, EXACT)
    for a, b in zip(ours, base):
        assert (a - b).abs().max().item() < FULL_RANK_TOLERANCE
    assert all(isinstance(row.store, LowRankStore) for layer in cache.layers for row in layer.rows)


def test_lower_rank_moves_logits_further_from_baseline():
    specs = [f"lowrank(rank={rank})" for rank in (16, 8, 4, 2)]
    errors = logit_errors(tiny_llama(), specs, random_ids(48, 2), random_ids(16, 3), EXACT)
    assert errors[0] < 1e-10
    assert errors == sorted(errors) and len(set(errors)) == 4, errors


def test_bytes_per_token_are_the_rank_arithmetic():
    model = tiny_llama()  # 2 layers, 2 KV heads, head_dim 16, float32 compute, bf16 deployment cache
    layers, heads, tokens = 2, 2, 64
    cases = {
        "lowrank(k_rank=8,v_rank=4)": (8 + 4) * 2,  # coefficients in the deployment's cache dtype (bf16)
        "lowrank(rank=16)": (16 + 16) * 2,
        "lowrank(k_rank=8,v_rank=4)+quant(bits=8,group=4)": (8 + 2 * 4) + (4 + 1 * 4),  # codes + fp16 scale/zero per group
        "lowrank(k_rank=8,v_rank=4)+quant(bits=4,group=4)": (4 + 2 * 4) + (2 + 1 * 4),  # two codes per byte
    }
    for spec, per_token_head in cases.items():
        stats = prefill(model, spec, random_ids(tokens, 4)).stats()
        assert stats.kv_bytes == layers * heads * tokens * per_token_head, spec
        assert stats.bytes_per_token == layers * heads * per_token_head, spec


def test_gemma_sliding_layers_get_bases_and_bytes_follow_kept_tokens():
    model = tiny_gemma3()  # 4 layers (3 sliding, window 16), 1 KV head, head_dim 32
    policy = parse_policy("lowrank(k_rank=12,v_rank=6)")
    logits, cache = context_then_question(model, policy, random_ids(40, 5), random_ids(8, 6))
    assert torch.isfinite(logits).all()
    assert policy.structure.ranks(model) == {"k": [[12]] * 4, "v": [[6]] * 4}
    stats = cache.stats()
    kept = [row[0] for row in stats.kept_tokens]
    assert kept[3] == 48 and all(k < 48 for k in kept[:3])  # sliding layers hold only their window
    assert stats.kv_bytes == sum(kept) * (12 + 6) * 1 * 2  # bf16 coefficients
    assert policy.structure.basis_bytes(model) == 4 * 4 * 32 * (12 + 6)  # layers x float32 x head_dim x ranks


def test_energy_picks_the_smallest_rank_per_layer_and_head():
    model = tiny_llama()
    policy = parse_policy("lowrank(energy=0.9)").structure
    calibration = policy.calibration_for(model)
    ranks = policy.ranks(model)
    for kind in ("k", "v"):
        for layer, per_head in enumerate(ranks[kind]):
            kept = calibration.energy_kept(kind, layer, per_head)
            fewer = calibration.energy_kept(kind, layer, [r - 1 for r in per_head])
            assert all(k >= 0.9 - 1e-9 for k in kept) and all(f < 0.9 for f in fewer)
    _, cache = context_then_question(model, policy.spec(), random_ids(32, 7), random_ids(4, 8))
    expected = sum(36 * (k + v) * 2 for layer in range(2) for k, v in zip(ranks["k"][layer], ranks["v"][layer]))
    assert cache.stats().kv_bytes == expected
    # With per-token quantization, energy ranks are rounded up to whole groups.
    stack = parse_policy("lowrank(energy=0.9)+quant(bits=8,group=8)")
    assert all(r % 8 == 0 for kind in ("k", "v") for layer in stack.structure.ranks(model, stack)[kind] for r in layer)


def test_heads_with_different_ranks_are_stored_separately():
    keys, values = torch.randn(3, 10, 8), torch.randn(3, 10, 8)
    basis = torch.linalg.qr(torch.randn(8, 8)).Q
    layout = [(slice(0, 2), basis[:, :4].expand(2, 8, 4).contiguous(), basis[:, :2].expand(2, 8, 2).contiguous()),
              (slice(2, 3), basis[None], basis[None])]
    from kveval.stores.base import DenseStore

    store = LowRankStore.build(DenseStore(), layout)
    store.append(keys, values)
    store.seal()
    assert store.length == 10 and store.nbytes == 4 * 10 * (2 * (4 + 2) + (8 + 8))
    k, v = store.keys_values()
    assert torch.allclose(k[2], keys[2], atol=1e-5) and torch.allclose(v[2], values[2], atol=1e-5)
    projector = basis[:, :4] @ basis[:, :4].T
    assert torch.allclose(k[:2], keys[:2] @ projector, atol=1e-5)
    store.select(torch.tensor([[0, 3], [1, 2], [5, 9]]))
    k2, _ = store.keys_values()
    assert k2.shape == (3, 2, 8) and torch.allclose(k2[2], keys[2, [5, 9]], atol=1e-5)


def test_keys_are_projected_after_rope():
    """The store receives post-RoPE keys, and its reconstruction is exactly their projection on the basis."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_llama()
    ids = random_ids(24, 9)
    received, pre_rope = {}, {}
    original = LowRankStore.append

    def spy(self, keys, values):
        received.setdefault(id(self), (self, keys.clone()))
        return original(self, keys, values)

    parse_policy("lowrank(rank=6)").structure.prepare(model)  # calibrate first: its forward is not what we inspect
    attention = model.model.layers[0].self_attn
    hook = attention.k_proj.register_forward_hook(lambda mod, args, out: pre_rope.setdefault("k", out.detach()))
    LowRankStore.append = spy
    try:
        cache = CompressedCache(model, parse_policy("lowrank(rank=6)"), kv_dtype=EXACT)
        with torch.no_grad():
            model(ids, cache=cache, position_ids=torch.arange(24)[None])
    finally:
        LowRankStore.append = original
        hook.remove()
    store = cache.layers[0].rows[0].store
    keys = received[id(store)][1]  # [kv_heads, T, head_dim] as the cache got them
    raw = pre_rope["k"].view(1, 24, 2, 16).transpose(1, 2)
    cos, sin = model.model.rotary_emb(raw, torch.arange(24)[None])
    _, rotated = apply_rotary_pos_emb(raw, raw, cos, sin)
    assert torch.allclose(keys, rotated[0], atol=1e-6)  # post-RoPE ...
    assert not torch.allclose(keys, raw[0], atol=1e-2)  # ... not pre-RoPE
    basis = store.parts[0].key_basis  # [kv_heads, head_dim, 6], calibrated on post-RoPE keys
    reconstructed, _ = store.keys_values()
    assert torch.allclose(reconstructed, keys @ basis @ basis.transpose(-1, -2), atol=1e-5)


def test_calibration_is_cached_on_disk_and_invalidated_by_a_new_text(tmp_path, calibration_cache, monkeypatch):
    calls = []
    collect = calibration._collect_kv
    monkeypatch.setattr(calibration, "_collect_kv", lambda model, ids: calls.append(ids.shape[1]) or collect(model, ids))
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    model = tiny_llama()
    spec = f"lowrank(rank=8,calibration={text},calib_tokens=512)"

    first, _ = context_then_question(model, spec, random_ids(16, 10), random_ids(2, 11))
    assert calls == [512]
    files = list((calibration_cache / "calibration").glob("*.pt"))
    assert len(files) == 1
    id_before = parse_policy(spec).structure.calibration_id

    calibration.clear_memory_cache()  # a new process: only the disk cache is left
    again, _ = context_then_question(model, spec, random_ids(16, 10), random_ids(2, 11))
    assert calls == [512] and torch.equal(first, again)

    text.write_text("A completely different calibration text, about rivers and mountains. " * 20)
    changed = parse_policy(spec).structure
    changed.calibration_for(model)
    assert len(calls) == 2
    assert changed.calibration_id != id_before and "sha256=" in id_before and "calib.txt" in id_before
    assert len(list((calibration_cache / "calibration").glob("*.pt"))) == 2


@pytest.mark.parametrize("content", [b"junk", b"", b"\x80\x02}q\x00.", "not a tensor"])
def test_an_unreadable_calibration_file_reads_as_missing(tmp_path, content):
    """A damaged or foreign cache file is recalibrated over, never an error (load_or_compute treats None as missing)."""
    from fractions import Fraction

    path = tmp_path / "calibration.pt"
    if content == "not a tensor":  # a global the weights-only unpickler refuses
        torch.save({"version": calibration.CALIBRATION_VERSION, "spectra": Fraction(1, 2)}, path)
    else:
        path.write_bytes(content)
    assert calibration.load_versioned(path, calibration.CALIBRATION_VERSION) is None


def test_batches_give_the_answers_of_batch_size_one():
    assert_one_batch_equals_batch_size_one(tiny_llama(), Tok(), random_prompts([(12, 3), (20, 3), (7, 3)], seed=20),
                                           "lowrank(rank=4)+quant(bits=8,group=4)", max_new_tokens=4)


@pytest.mark.parametrize("spec, message", [
    ("lowrank", "give rank="),
    ("lowrank(rank=0)", "positive integer"),
    ("lowrank(rank=4,energy=0.5)", "not both"),
    ("lowrank(energy=0)", "0 < energy <= 1"),
    ("lowrank(energy=1.5)", "0 < energy <= 1"),
    ("lowrank(k_rank=4)", "k_rank= and v_rank="),
    ("lowrank(rank=4,calibration=/no/such/file.txt)", "not found"),
    ("lowrank(rank=4,calib_tokens=1)", "at least 2"),
])
def test_bad_specs_name_the_problem(spec, message):
    assert_one_line_error(lambda: parse_policy(spec), ValueError, message)


def test_rank_and_quant_group_are_checked_against_the_model():
    model = tiny_llama()
    with pytest.raises(ValueError, match="group=8 does not divide the k rank 12"):
        CompressedCache(model, parse_policy("lowrank(rank=12)+quant(bits=8,group=8)")).new_store(0, torch.float32)
    with pytest.raises(ValueError, match="exceeds head_dim=16"):
        CompressedCache(model, parse_policy("lowrank(rank=32)")).new_store(0, torch.float32)


@pytest.mark.slow
def test_smollm2_generates_with_fewer_bytes(monkeypatch):
    monkeypatch.delenv("KVEVAL_CACHE")  # the real cache: dequantized weights (and this calibration) live there
    from kveval.runner.generation import encode_prompt, generate
    from kveval.runner.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    prompt = encode_prompt(tokenizer, "The capital of France is Paris. What is the capital of France?")
    spec = "lowrank(rank=32)"  # at calib_tokens=256 this prompt gets an immediate EOS: a real answer, but no decode to check
    none, = generate(model, tokenizer, [prompt], parse_policy("none"), max_new_tokens=4)
    ours, = generate(model, tokenizer, [prompt], parse_policy(spec), max_new_tokens=4)
    assert ours.token_ids and ours.stats.kv_bytes < none.stats.kv_bytes
    assert ours.stats.bytes_per_token == pytest.approx(none.stats.bytes_per_token / 2)  # 32 of 64 dims
    assert parse_policy(spec).structure.basis_bytes(model) == 30 * 3 * 64 * (32 + 32) * 4


def test_tokenize_for_loads_a_models_tokenizer_once(monkeypatch):
    """Calibration probes tokenize many times (retrieval heads: once per filler sentence); each call reloading the
    tokenizer made Gemma-3-270M's duo calibration take minutes. A model kveval loaded carries its tokenizer
    (``kveval_tokenizer``, tested with the embedded models); another one loads its Hub tokenizer once."""
    import transformers

    from kveval.calibration.kv import tokenize_for

    loads = []

    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": [ord(c) % 7 for c in text]}

    def from_pretrained(path, *args, **kwargs):
        loads.append(path)
        return Tokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    model = tiny_llama()
    model.config._name_or_path = "some-model"
    assert tokenize_for(model, "abc") == tokenize_for(model, "abc") == [ord(c) % 7 for c in "abc"]
    assert loads == ["some-model"]
    bare = tiny_llama()
    bare.config._name_or_path = ""
    assert tokenize_for(bare, "ab") == [b % bare.config.vocab_size for b in b"ab"]  # no tokenizer at all: bytes


@pytest.mark.parametrize("spec", ["lowrank(k_rank=8,v_rank=4)", "lowrank(k_rank=8,v_rank=4)+quant(bits=4,group=4,residual=3)",
                                  "latent(rank=8)"])
def test_a_decode_step_decodes_its_new_tokens_only(spec, monkeypatch):
    """Once read, a token's K/V are re-decoded only when its coefficients change (sealed, or quantized out of the
    residual window): each step decodes its one new token, plus the ones a quantizer just sealed, never the row.
    What attention reads still equals the store's own reconstruction of every token."""
    from kveval.cache.layers import CompressedLayer
    from kveval.stores.lowrank import CoefficientStore

    decoded = []
    original = CoefficientStore.keys_values_from

    def counted(self, start):
        keys, values = original(self, start)
        decoded.append(keys.shape[1])
        return keys, values

    monkeypatch.setattr(CoefficientStore, "keys_values_from", counted)
    # The row-by-row steps (dense low-rank rows otherwise step for the batch: tests/test_buffered_decode.py).
    monkeypatch.setattr(CompressedLayer, "_batched_decode", lambda self: None)
    model, context = tiny_llama(), random_ids(40, 5)
    _, cache = context_then_steps(model, spec, context, random_ids(8, 6))
    per_step = decoded[-len(cache.layers):]  # the last step, one read per layer
    assert max(per_step) <= (4 if "quant" in spec else 1)  # 1 new token (+ 3 a quantizer sealed out of its residual)
    for layer in cache.layers:
        keys, values = layer.rows[0].store.keys_values()
        assert torch.allclose(layer._buffer.keys[0, :, :keys.shape[1]], keys, atol=1e-5)
        assert torch.allclose(layer._buffer.values[0, :, :values.shape[1]], values, atol=1e-5)


def test_a_token_reconstructs_the_same_alone_in_its_row_or_in_a_batch():
    """Reconstruction never depends on what is reconstructed with it: a decode step's one token, the whole row
    (a refresh, a shared prefill's derived cache) and a batch of rows give the same K/V bit for bit, which is
    what lets a batch step low-rank rows at once and a shared prefill equal each policy's own run."""
    from kveval.stores.lowrank import _RECONSTRUCT_TOKENS, reconstruct

    g = torch.Generator().manual_seed(3)
    basis_t = torch.randn(3, 32, 64, generator=g)
    tokens = _RECONSTRUCT_TOKENS + 40  # two chunks
    batch = torch.randn(4, 3, tokens, 32, generator=g).bfloat16().float()
    together = reconstruct(batch, basis_t)
    rows = torch.stack([reconstruct(row, basis_t) for row in batch])
    one_by_one = torch.cat([reconstruct(batch[:, :, t:t + 1], basis_t) for t in range(tokens)], dim=2)
    assert torch.equal(together, rows) and torch.equal(together, one_by_one)
    assert torch.allclose(together, batch @ basis_t, rtol=1e-4, atol=1e-4)  # and it is the product
