"""vLLM 0.33's TurboQuant KV caches as presets: ``vllm(kv_cache_dtype=turboquant_k8v4 | turboquant_4bit_nc |
turboquant_k3v4_nc | turboquant_3bit_nc)``.

The reference is vLLM 0.33's own code, run here (``tests/vllm_triton_reference.py``) where ``KVEVAL_VLLM_SOURCE``
names an unpacked vLLM 0.33.0 wheel and triton is importable: its config (``TurboQuantConfig``: slot sizes), its
Lloyd-Max solver and Hadamard matrix, its fused store kernels (``triton_turboquant_store``: the cache's bytes) and
its dequant kernel (``_tq_full_dequant_kv``: K in the rotated space and V, float16), the kernels run by Triton's
interpreter. One substitution: the interpreter's float32 -> FP8 conversion drops the rounding's carry, so that one
conversion is the GPU's ``cvt.rn.satfinite`` (``vllm_triton_reference._gpu_fp8_store``). Elsewhere the reference's
outputs on ``_rows()`` are pinned by sha256 digests taken from those runs.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import vllm_triton_reference as vllm_ref
from cache_runs import assert_one_batch_equals_batch_size_one, context_then_steps, random_ids, random_prompts
from kveval.errors import PolicySpecError, UnsupportedModelError, UsageError
from kveval.planner.memory import plan
from kveval.policies.spec import parse_policy
from kveval.stores.engine import EngineCodec, FirstChunkRawStore, TurboQuantSide
from kveval.tensors import turboquant_vllm as tq
from tiny_models import Tok, tiny_model

pytestmark = pytest.mark.usefixtures("calibration_cache")

PRESETS = tuple(tq.PRESETS)
REFERENCE_MISSING = vllm_ref.available()
#: vLLM's ``slot_size_aligned`` at head_dim 64 and 32, from ``TurboQuantConfig`` (key + value, rounded to even).
SLOT = {"turboquant_k8v4": (100, 52), "turboquant_4bit_nc": (70, 38), "turboquant_k3v4_nc": (62, 34),
        "turboquant_3bit_nc": (54, 30)}


def _rows(seed: int = 0, dim: int = 64) -> torch.Tensor:
    """``[T=40, H=3, D]`` rows with heavy-tailed channels and the edge cases: an all-zero row, one outlier past FP8's
    range, a row far below the others, an all-negative row, a constant row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 3, dim, generator=g) * torch.exp(torch.randn(1, 1, dim, generator=g))
    x[0, 0] = 0
    x[1, 0, 5] = 1e4
    x[2, 1] *= 1e-9
    x[3, 2] = -x[3, 2].abs()
    x[4, 0, :] = 0.5
    return x


def _digest(*tensors: torch.Tensor) -> str:
    data = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    return hashlib.sha256(data).hexdigest()[:16]


def _slot(key: torch.Tensor, value: torch.Tensor, preset: str) -> torch.Tensor:
    """kveval's bytes of one slot a token and head, ``[T, H, slot]``: the two sides of the store, side by side."""
    layout = tq.TurboQuantLayout.of(preset, key.shape[-1])
    return torch.cat([TurboQuantSide(layout, "key").encode(key), TurboQuantSide(layout, "value").encode(value)], -1)


def _interpreter_sum(squares: torch.Tensor) -> torch.Tensor:
    """``tl.sum`` as Triton's interpreter computes it (``np.sum``, pairwise, float32)."""
    return torch.from_numpy(np.sum(squares.numpy(), axis=-1, keepdims=True))


def _read(slot: torch.Tensor, preset: str, dim: int, square_sum=_interpreter_sum) -> tuple[torch.Tensor, torch.Tensor]:
    """What the dequant kernel writes, from kveval's reads: K (MSE keys: in the rotated space) and V, float16; the
    norm correction's sum in the interpreter's order (``square_sum=None``: torch's, kveval's own)."""
    layout = tq.TurboQuantLayout.of(preset, dim)
    k, v = slot[..., :layout.key_bytes], slot[..., layout.key_bytes:]
    keys = tq.decode_keys(k, layout) if layout.key_fp8 else tq.rotated_keys(k, layout, square_sum)
    return keys.half(), TurboQuantSide(layout, "value").decode(v, dim).half()


# --- vLLM's own code, run here --------------------------------------------------------------------------------
#: sha256 (16 hex digits) of vLLM 0.33.0's store kernel's cache bytes, and of its dequant kernel's K and V, on
#: ``_rows(0)`` (K) and ``_rows(1)`` (V) at head_dim 64 and 128; triton 3.9.0's interpreter, torch 2.13.0 (CPU).
PINNED_STORE = {"turboquant_k8v4-64": "963cc4f4a6e18521", "turboquant_k8v4-128": "58d73f81a5f62730",
                "turboquant_4bit_nc-64": "7cbfd70ce5fbeddb", "turboquant_4bit_nc-128": "39c65a416d37fe4b",
                "turboquant_k3v4_nc-64": "706fc9806c353f7a", "turboquant_k3v4_nc-128": "abf960370a2e5ed0",
                "turboquant_3bit_nc-64": "c89991a503b250d3", "turboquant_3bit_nc-128": "26447adb860c1d08"}
PINNED_DEQUANT = {"turboquant_k8v4-64": "ac4335cac49014ab", "turboquant_k8v4-128": "dc009e7e5cec188d",
                  "turboquant_4bit_nc-64": "b9e61bab14c051b7", "turboquant_4bit_nc-128": "40070e5a7c7bc247",
                  "turboquant_k3v4_nc-64": "a81930e997c302fc", "turboquant_k3v4_nc-128": "75d41f750ffcb8a0",
                  "turboquant_3bit_nc-64": "a3e72a1bfbb6bafd", "turboquant_3bit_nc-128": "4342a42b614a791f"}


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("preset", PRESETS)
def test_codes_and_reads_match_the_pinned_vllm_kernels(preset, dim):
    key, value = _rows(0, dim), _rows(1, dim)
    slot = _slot(key, value, preset)
    assert slot.shape[-1] == tq.TurboQuantLayout.of(preset, dim).slot_bytes
    assert _digest(slot) == PINNED_STORE[f"{preset}-{dim}"]
    assert _digest(*_read(slot, preset, dim)) == PINNED_DEQUANT[f"{preset}-{dim}"]


@pytest.mark.parametrize("preset", PRESETS)
def test_slot_sizes_are_vllms(preset):
    assert [tq.TurboQuantLayout.of(preset, d).slot_bytes for d in (64, 32)] == list(SLOT[preset])


@pytest.mark.skipif(REFERENCE_MISSING is not None, reason=f"vLLM's code cannot run: {REFERENCE_MISSING}")
@pytest.mark.parametrize("preset", PRESETS)
def test_setup_is_vllms(preset):
    """Slot sizes, Lloyd-Max centroids and midpoints, the Hadamard matrix: vLLM's own functions, bit for bit."""
    for dim in (32, 64, 128, 256):
        setup = vllm_ref.turboquant_setup(preset, dim)
        cfg, layout = setup["config"], tq.TurboQuantLayout.of(preset, dim)
        assert (cfg.key_packed_size, cfg.value_packed_size, cfg.slot_size_aligned) == (
            layout.key_bytes, layout.value_bytes, layout.slot_bytes)
        assert torch.equal(setup["PiT"], tq.hadamard(dim))
        assert torch.equal(setup["centroids"], tq.centroids(dim, cfg.centroid_bits))
        assert torch.equal(setup["midpoints"], tq.midpoints(dim, cfg.centroid_bits))
    assert [vllm_ref.turboquant_config(preset, d).slot_size_aligned for d in (64, 32)] == list(SLOT[preset])


@pytest.mark.skipif(REFERENCE_MISSING is not None, reason=f"vLLM's code cannot run: {REFERENCE_MISSING}")
@pytest.mark.parametrize("preset", PRESETS)
def test_store_and_reads_are_vllms_kernels_bit_for_bit_on_random_and_real_kv(preset, smollm2_kv):
    """The cache's bytes (codes, norms, scales, mins, pad) equal the store kernel's; the reads equal the dequant
    kernel's float16 K (rotated) and V; on random rows, bfloat16 rows, and SmolLM2's K and V of every 6th layer.
    The norm correction's float32 sum is taken in the interpreter's order for the exact comparison (the GPU's is a
    thread tree neither reproduces); in kveval's own order the keys are within one float16 step."""
    cases = [(_rows(0, 64), _rows(1, 64)), (_rows(2, 128), _rows(3, 128)),
             (torch.randn(7, 2, 32).to(torch.bfloat16).float(), torch.randn(7, 2, 32).to(torch.bfloat16).float())]
    cases += [(k.float(), v.float()) for k, v in smollm2_kv[::6]]
    for key, value in cases:
        slot = _slot(key, value, preset)
        cache, _ = vllm_ref.turboquant_store(key, value, preset)
        assert torch.equal(slot, cache)
        k16, v16 = vllm_ref.turboquant_dequant(cache, preset)
        mine_k, mine_v = _read(slot, preset, key.shape[-1])
        assert torch.equal(mine_k.view(torch.int16), k16.view(torch.int16))
        assert torch.equal(mine_v.view(torch.int16), v16.view(torch.int16))
        own_k, _ = _read(slot, preset, key.shape[-1], square_sum=None)  # torch's order: at most 1 float16 step off
        assert torch.allclose(own_k.float(), k16.float(), rtol=2 ** -10, atol=0)


@pytest.mark.skipif(REFERENCE_MISSING is not None, reason=f"vLLM's code cannot run: {REFERENCE_MISSING}")
def test_the_pinned_digests_are_the_kernels_outputs():
    for preset in PRESETS:
        for dim in (64, 128):
            cache, _ = vllm_ref.turboquant_store(_rows(0, dim), _rows(1, dim), preset)
            assert _digest(cache) == PINNED_STORE[f"{preset}-{dim}"]
            assert _digest(*vllm_ref.turboquant_dequant(cache, preset)) == PINNED_DEQUANT[f"{preset}-{dim}"]


@pytest.fixture(scope="module")
def smollm2_kv():
    """SmolLM2-135M's K and V of every layer on a short prompt, ``[T, H, D]`` bfloat16 (skipped without it)."""
    from kveval.runner.models import load_model

    try:
        model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="bfloat16")
    except Exception as exc:  # the embedded model is an optional package
        pytest.skip(f"SmolLM2-135M is not available: {exc}")
    ids = tokenizer("The quick brown fox jumps over the lazy dog, and then it", return_tensors="pt").input_ids
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in cache.layers]


# --- the format's rules, by hand --------------------------------------------------------------------------------
def test_edge_rows_follow_the_kernels_source():
    """A zero key: norm 0, every coordinate in the centroid bucket of 0; a constant value row: scale floored at 1e-8,
    codes 0, read back as its min; FP8 keys past 448 saturate; 3-bit indices pack 8 to 3 bytes, little-endian."""
    layout = tq.TurboQuantLayout.of("turboquant_3bit_nc", 64)
    zero = tq.encode_keys(torch.zeros(1, 64), layout)
    assert zero[0, -2:].tolist() == [0, 0]  # float16 norm 0
    idx = tq.unpack(zero[:, :24], 3, 64)
    assert idx.eq(4).all()  # 0 >= the middle midpoint (0.0): the first centroid above it
    assert tq.decode_keys(zero, layout).eq(0).all()
    constant = tq.encode_values(torch.full((1, 64), 0.5), layout)
    assert constant[0, :24].eq(0).all() and tq.decode_values(constant, layout).eq(0.5).all()
    fp8 = tq.TurboQuantLayout.of("turboquant_k8v4", 64)
    big = torch.tensor([[1e4, -1e4] + [0.0] * 62])
    assert tq.decode_keys(tq.encode_keys(big, fp8), fp8)[0, :2].tolist() == [448.0, -448.0]
    codes = torch.arange(8).repeat(8).unsqueeze(0)
    packed = tq.pack(codes, 3)
    word = sum(int(c) << (3 * i) for i, c in enumerate(range(8)))
    assert packed[0, :3].tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert torch.equal(tq.unpack(packed, 3, 64), codes)
    assert torch.equal(tq.unpack(tq.pack(codes % 16, 4), 4, 64), codes % 16)


def test_norm_correction_keeps_the_keys_norm():
    """``nc``: the read key's norm is the stored float16 norm (the centroid vector re-normalized); k8v4 has none."""
    x = _rows(4, 64).reshape(-1, 64)[5:]
    for preset in PRESETS[1:]:
        layout = tq.TurboQuantLayout.of(preset, 64)
        back = tq.decode_keys(tq.encode_keys(x, layout), layout)
        assert torch.allclose(back.norm(dim=-1), x.norm(dim=-1).half().float(), rtol=1e-5)


def test_compression_hurts_in_the_expected_order():
    """Fewer bits lose more: keys k8 < 4 < 3 bits, values 4 < 3 bits; every preset loses something."""
    x = _rows(5, 64).reshape(-1, 64)[5:]
    error = {}
    for preset in PRESETS:
        layout = tq.TurboQuantLayout.of(preset, 64)
        k = (tq.decode_keys(tq.encode_keys(x, layout), layout) - x).pow(2).mean().item()
        v = (tq.decode_values(tq.encode_values(x, layout), layout) - x).pow(2).mean().item()
        error[preset] = (k, v)
        assert k > 0 and v > 0
    assert error["turboquant_k8v4"][0] < error["turboquant_4bit_nc"][0] < error["turboquant_k3v4_nc"][0]
    assert error["turboquant_k3v4_nc"][1] < error["turboquant_3bit_nc"][1]
    layout = tq.TurboQuantLayout.of("turboquant_4bit_nc", 64)
    g = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    relative = (tq.decode_keys(tq.encode_keys(g, layout), layout) - g).norm(dim=-1) / g.norm(dim=-1)
    assert 0.05 < relative.mean() < 0.15 and relative.max() < 0.2  # 4-bit Lloyd-Max on N(0, 1/D): about 0.09
    tiny = x.new_full((1, 64), 1e-9)  # its norm underflows float16: the key reads back as 0, as vLLM's would
    assert tq.decode_keys(tq.encode_keys(tiny, layout), layout).eq(0).all()


# --- the presets on a model -------------------------------------------------------------------------------------
def _six_layers():
    """A tiny Llama with 6 layers (vLLM keeps 0, 1, 4 and 5 in the model dtype), 2 KV heads of width 32."""
    return tiny_model("llama", num_hidden_layers=6)


@pytest.mark.parametrize("preset", PRESETS)
def test_planned_equals_measured_with_the_boundary_layers_in_the_model_dtype(preset):
    model = _six_layers()
    spec = f"vllm(kv_cache_dtype={preset})"
    logits, cache = context_then_steps(model, spec, random_ids(20, 3), random_ids(3, 4), "float32")
    coded, native = 2 * 23 * 2 * SLOT[preset][1], 4 * 23 * 2 * (32 + 32) * 4  # 2 layers coded; 4 in float32
    assert cache.stats().kv_bytes == coded + native
    planned = plan(model.config, 23, 1, parse_policy(spec), 4)
    assert planned.sequence_bytes == cache.stats().kv_bytes
    assert all(torch.isfinite(out).all() for out in logits)
    stores = [type(layer.rows[0].store).__name__ for layer in cache.layers]
    assert stores[2:4] == ["FirstChunkRawStore"] * 2 and "FirstChunkRawStore" not in stores[:2] + stores[4:]


def test_the_first_chunk_attends_raw_and_later_tokens_read_the_codes():
    """vLLM's TurboQuant prefill attends over the chunk's raw K/V: its logits equal the uncompressed model's; the
    decode steps read the codes, and differ."""
    model = _six_layers()
    context, steps = random_ids(20, 3), random_ids(3, 4)
    base, _ = context_then_steps(model, "none", context, steps, "float32")
    tq_logits, cache = context_then_steps(model, "vllm(kv_cache_dtype=turboquant_3bit_nc)", context, steps, "float32")
    assert torch.equal(base[0], tq_logits[0])
    assert not torch.equal(base[1], tq_logits[1])
    store = cache.layers[2].rows[0].store
    assert store.pending is None and store.coded_length == 23


def test_a_batch_of_three_gives_batch_size_ones_answers():
    assert_one_batch_equals_batch_size_one(_six_layers(), Tok(), random_prompts([(30, 3), (17, 2), (24, 2)], seed=6),
                                           "vllm(kv_cache_dtype=turboquant_4bit_nc)", max_new_tokens=3)


def test_a_store_reads_back_its_waiting_tokens_then_their_codes():
    layout = tq.TurboQuantLayout.of("turboquant_4bit_nc", 64)
    store = FirstChunkRawStore(EngineCodec(TurboQuantSide(layout, "key"), TurboQuantSide(layout, "value")),
                               torch.float32, torch.bfloat16)
    x = _rows(6, 64).transpose(0, 1).contiguous()
    store.append(x[:, :10], x[:, :10])
    keys, _ = store.keys_values()
    assert torch.equal(keys, x[:, :10].to(torch.bfloat16).float()) and store.nbytes == 2 * 3 * 10 * 64 * 2
    store.mark_read()
    store.seal()
    assert store.changed_from() == 0 and store.nbytes == 3 * 10 * 70
    keys, values = store.keys_values()
    raw = x[:, :10].to(torch.bfloat16).float()
    assert torch.equal(values, tq.decode_values(tq.encode_values(raw, layout), layout))
    assert torch.equal(keys, tq.decode_keys(tq.encode_keys(raw, layout), layout))
    store.mark_read()
    store.append(x[:, 10:12], x[:, 10:12])
    store.select(torch.tensor([[0, 4, 10]] * 3))
    assert store.length == 3 and store.coded_length == 2


# --- refusals and the planner -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [96, 40, 4])
def test_a_head_dim_the_hadamard_matrix_cannot_hold_is_refused(dim):
    with pytest.raises(PolicySpecError, match=f"head_dim={dim} is not a power of two") as info:
        parse_policy("vllm(kv_cache_dtype=turboquant_4bit_nc)").quantization.check_head_dim(dim)
    assert "\n" not in str(info.value)


def test_per_tensor_scales_are_refused():
    with pytest.raises(PolicySpecError, match="drop scales="):
        parse_policy("vllm(kv_cache_dtype=turboquant_k8v4,scales=checkpoint,k_scale=1,v_scale=1)")


def test_mla_models_are_refused_in_one_line_before_weights_load():
    from kveval.runner.runspec import RunSpec

    spec = "vllm(kv_cache_dtype=turboquant_k3v4_nc)"
    with pytest.raises(UsageError, match="no TurboQuant backend") as info:
        plan("deepseek-v3", 1000, policy=parse_policy(spec))
    assert "\n" not in str(info.value)
    config = tiny_model("deepseek_v3").config
    with pytest.raises(UnsupportedModelError, match="no TurboQuant backend") as info:
        RunSpec.parse(spec).for_model(config)
    assert "\n" not in str(info.value)
    RunSpec.parse("vllm(kv_cache_dtype=fp8)").for_model(config)  # the per-head FP8 cache still codes the latent


@pytest.mark.parametrize("preset", PRESETS)
def test_planner_bytes_per_token_on_smollm2(preset):
    """SmolLM2-135M: 30 layers x 3 KV heads at head_dim 64; layers 0, 1, 28, 29 in bfloat16."""
    p = plan("smollm2-135m", 1000, policy=parse_policy(f"vllm(kv_cache_dtype={preset})"))
    assert p.bytes_per_token == 26 * 3 * SLOT[preset][0] + 4 * 3 * 2 * 64 * 2


def test_memory_command_takes_a_turboquant_dtype(capsys):
    from kveval.commands import main as cli

    assert cli.main(["memory", "smollm2-135m", "--engine", "vllm", "--gpu-memory", "24GiB", "--max-model-len", "8k",
                     "--kv-cache-dtype", "turboquant_4bit_nc"]) == 0
    out = capsys.readouterr().out
    assert "vllm(kv_cache_dtype=turboquant_4bit_nc)" in out and f"{26 * 3 * 70 + 4 * 3 * 256:,}" in out
