"""Engine presets (llamacpp, vllm, sglang, trtllm): codes and values bit for bit, bytes, and the engine's pool.

llama.cpp's types are checked against the ``gguf`` package's reference quantizers (``gguf.quants``, a port of
``ggml/src/ggml-quants.c``). The per-tensor FP8/INT8 presets against references written here from the engines'
sources, named at each test; the FP8 reference decodes the format from its bit layout, not through torch's cast.
"""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kveval.commands import main as cli
from kveval.errors import PolicySpecError
from kveval.planner.engines import llamacpp_plan, vllm_plan
from kveval.planner.memory import plan
from kveval.policies.spec import parse_policy
from kveval.stores.engine import EngineStore
from kveval.tensors.engine_formats import (
    fp8_saturating,
    fp8_torch_cast,
    ggml_dequantize,
    ggml_quantize,
    int8_saturating,
)

from cache_runs import (
    assert_one_batch_equals_batch_size_one,
    assert_shared_prefill_equals_own_runs,
    context_then_steps,
    random_ids,
    random_prompts,
)
from tiny_models import Tok, tiny_model

gguf = pytest.importorskip("gguf")
GGUF_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")

pytestmark = pytest.mark.usefixtures("calibration_cache")

REPO = Path(__file__).resolve().parent.parent


def _rows(seed: int = 0) -> torch.Tensor:
    """``[3, 40, 64]`` float32 rows with the cases rounding rules disagree on: zeros, constant blocks, ties for the
    largest magnitude, negative maxima, wide and tiny ranges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 40, 64, generator=g) * torch.rand(3, 40, 1, generator=g).mul(8)
    x[0, 0] = 0
    x[0, 1, :32] = 1.5
    x[0, 2, :32] = torch.linspace(-4, 4, 32)  # +4 and -4 tie: the first wins
    x[0, 3, 7] = -50
    x[0, 4] *= 1e-6
    x[1, 5, :32] = torch.arange(32) - 15.5
    return x


def _gguf(kind: str):
    return getattr(gguf.GGMLQuantizationType, kind.upper())


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_ggml_codes_and_values_are_gguf_reference_bit_for_bit(kind):
    x = _rows()
    reference = gguf.quants.quantize(x.reshape(-1, 64).numpy(), _gguf(kind))
    codes = ggml_quantize(x, kind)
    assert codes.shape == (3, 40, reference.shape[-1])
    np.testing.assert_array_equal(codes.reshape(-1, reference.shape[-1]).numpy(), reference)
    values = ggml_dequantize(codes, kind, 64).reshape(-1, 64).numpy()
    expected = gguf.quants.dequantize(reference, _gguf(kind)).astype(np.float32)
    np.testing.assert_array_equal(values.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("kind", ("f16", "bf16"))
def test_ggml_half_types_are_the_gguf_cast(kind):
    x = _rows(1)
    reference = gguf.quants.quantize(x.reshape(-1, 64).numpy(), _gguf(kind))
    np.testing.assert_array_equal(ggml_quantize(x, kind).reshape(-1, 128).numpy(), reference.view(np.uint8).reshape(-1, 128))


def test_ggml_rounding_rules_are_pinned():
    """q8_0 rounds halves away from zero (roundf), not to even; q4_0 truncates x/d + 8.5. Rows whose scaled values
    land on halves: a round-half-even q8_0 or a rounding q4_0 gives other codes, and this test fails."""
    x = torch.zeros(1, 1, 32)
    x[0, 0, :4] = torch.tensor([127.0, 0.5, 1.5, 2.5])  # d = 1, id = 1
    codes = ggml_quantize(x, "q8_0")[0, 0, 2:6].view(torch.int8).tolist()
    assert codes == [127, 1, 2, 3]  # round half to even would give 127, 0, 2, 2
    y = torch.zeros(1, 1, 32)
    y[0, 0, :3] = torch.tensor([-8.0, 2.5, -2.5])  # d = max / -8 = 1, id = 1: trunc(2.5 + 8.5) = 11, trunc(-2.5 + 8.5) = 6
    nibbles = ggml_quantize(y, "q4_0")[0, 0, 2:5]
    assert [int(nibbles[0]) & 15, int(nibbles[1]) & 15, int(nibbles[2]) & 15] == [0, 11, 6]


# --- per-tensor FP8 / INT8: references from the engines' sources -------------------------------------------
def _fp8_table(fmt: str) -> torch.Tensor:
    """Every finite value of the format by code (NaN where none), from its bit layout (OCP FP8: e4m3fn bias 7,
    no infinities, S.1111.111 NaN; e5m2 bias 15, IEEE-like)."""
    exp_bits, man_bits, bias = (4, 3, 7) if fmt == "e4m3" else (5, 2, 15)
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> man_bits) & ((1 << exp_bits) - 1), code & ((1 << man_bits) - 1)
        if fmt == "e4m3" and e == 15 and m == 7 or fmt == "e5m2" and e == 31:
            values.append(math.nan)
        elif e == 0:
            values.append(sign * m / (1 << man_bits) * 2.0 ** (1 - bias))
        else:
            values.append(sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias))
    return torch.tensor(values, dtype=torch.float64)


def _fp8_reference(q: torch.Tensor, fmt: str, saturate: bool) -> torch.Tensor:
    """Round the magnitude to the nearest finite value, ties to the even code (the even mantissa), keep the sign.
    ``saturate``: ``__NV_SATFINITE`` (vLLM's ``scaled_vec_conversion``): past the largest value, the largest.
    Else torch's cast (c10's ``fp8e4m3fn_from_fp32_value``): a magnitude that rounds past the largest value is
    NaN (e4m3fn: above 464, where the next step would be the NaN pattern) or inf (e5m2: from 59392, a tie that
    rounds to the even inf pattern)."""
    table = _fp8_table(fmt)[:128]
    finite = ~table.isnan()
    codes, vals = torch.arange(128)[finite], table[finite]
    a = q.double().abs().flatten()
    dist = (a[:, None] - vals[None, :]).abs()
    ties = dist == dist.min(dim=1, keepdim=True).values
    even = ties & (codes % 2 == 0)
    chosen = torch.where(even.any(dim=1), (even * codes).amax(dim=1), (ties * codes).amax(dim=1))
    largest = vals.max()
    half_step = (largest - vals[vals < largest].max()) / 2
    if saturate:
        chosen = torch.where(a > largest, codes[vals.argmax()], chosen)
    elif fmt == "e4m3":
        chosen = torch.where(a > largest + half_step, torch.tensor(0x7F), chosen)
    else:
        chosen = torch.where(a >= largest + half_step, torch.tensor(0x7C), chosen)
    return (chosen | torch.signbit(q.flatten()).long() * 0x80).to(torch.uint8)


@pytest.mark.parametrize("fmt", ("e4m3", "e5m2"))
def test_vllm_fp8_divides_by_the_scale_and_saturates(fmt):
    """csrc/quantization/fp8/nvidia/quant_utils.cuh, scaled_vec_conversion<uint8_t, float>:
    __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, fmt)."""
    scale = 0.0371
    x = _rows(2)[:, :8] * 4
    x[0, 0, :4] = torch.tensor([1e6, -1e6, 460 * scale, 0.0])
    codes = fp8_saturating(x, scale, fmt)
    q = x / torch.tensor(scale, dtype=torch.float32)
    assert torch.equal(codes.flatten(), _fp8_reference(q, fmt, saturate=True))
    assert int(codes[0, 0, 0]) == (0x7E if fmt == "e4m3" else 0x7B)  # the largest finite value, not NaN/inf


def test_sglang_fp8_rounds_twice_through_the_model_dtype():
    """python/sglang/srt/mem_cache/memory_pool.py, MHATokenToKVPool.set_kv_buffer: cache_k.div_(k_scale) in the
    model dtype, then cache_k.to(float8_e4m3fn). The quotient is rounded to bfloat16 first: 1.0625 + 2**-12 becomes
    the tie 1.0625, which rounds to even (1.0), where vLLM's single rounding of the float32 quotient gives 1.125."""
    x = _rows(3)[:, :8].clamp(-400, 400)
    x[0, 0, 0] = 1.0625 + 2.0**-12
    codes = fp8_torch_cast(x, None, "e4m3", torch.bfloat16)
    assert torch.equal(codes.flatten(), _fp8_reference(x.to(torch.bfloat16).float(), "e4m3", saturate=False))
    assert int(codes[0, 0, 0]) == 0x38 and int(fp8_saturating(x, 1.0, "e4m3")[0, 0, 0]) == 0x39
    scaled = fp8_torch_cast(x, 0.3, "e4m3", torch.bfloat16)
    assert torch.equal(scaled.flatten(), _fp8_reference((x.to(torch.bfloat16) / 0.3).float(), "e4m3", saturate=False))


def test_sglang_past_the_range_is_whatever_torchs_cast_does():
    """SGLang calls torch's cast; what it gives past 448 depends on the torch build (c10's conversion gave NaN;
    torch 2.13 on a CPU saturates e4m3fn): the preset calls the same cast, so it matches the torch it runs on."""
    x = torch.tensor([500.0, -1e6, 460.0])
    assert torch.equal(fp8_torch_cast(x, None, "e4m3", torch.bfloat16),
                       x.to(torch.bfloat16).to(torch.float8_e4m3fn).view(torch.uint8))


def test_trtllm_int8_rounds_half_to_even_and_saturates():
    """TensorRT-LLM's cuda_cast<int8_t, float> is cvt.rni.sat.s8.f32 of x * (1 / scale)."""
    x = torch.tensor([2.5, 3.5, -2.5, 127.6, -200.0, 0.49]) * 0.5
    codes = int8_saturating(x, 0.5).view(torch.int8).tolist()
    assert codes == [2, 4, -2, 127, -128, 0]


# --- the presets on a tiny model's cache --------------------------------------------------------------------
def _capture(monkeypatch):
    """Every (store, keys, values) appended, in order: the K/V each store was given, before coding."""
    seen = []
    original = EngineStore.append

    def append(self, keys, values):
        seen.append((self, keys.detach().clone(), values.detach().clone()))
        original(self, keys, values)

    monkeypatch.setattr(EngineStore, "append", append)
    return seen


@pytest.mark.parametrize("k,v", [("q8_0", "q4_0"), ("q4_1", "q5_1"), ("q5_0", "q8_0"), ("f16", "bf16")])
def test_llamacpp_cache_holds_gguf_codes_of_the_models_keys_and_values(k, v, monkeypatch):
    """On a tiny model's real K/V (every layer, prefill and decode), each store holds exactly gguf's bytes."""
    seen = _capture(monkeypatch)
    model = tiny_model("llama")  # head_dim 32
    _, cache = context_then_steps(model, f"llamacpp(k={k},v={v})", random_ids(20, 1), random_ids(3, 2), "float32")
    by_store = {}
    for store, keys, values in seen:
        by_store.setdefault(id(store), (store, [], []))[1].append(keys)
        by_store[id(store)][2].append(values)
    assert len(by_store) == 2  # two layers, one row
    for store, keys, values in by_store.values():
        for raw, parts, kind in ((store.k, keys, k), (store.v, values, v)):
            rows = torch.cat(parts, dim=1).float().reshape(-1, 32).numpy()
            reference = gguf.quants.quantize(rows, _gguf(kind))
            np.testing.assert_array_equal(raw.reshape(reference.shape[0], -1).numpy(), reference.view(np.uint8).reshape(reference.shape[0], -1))
    # measured bytes: 2 layers x 2 KV heads x 23 tokens x (K row + V row)
    row = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "f16": 64, "bf16": 64}
    assert cache.stats().kv_bytes == 2 * 2 * 23 * (row[k] + row[v])


@pytest.mark.parametrize("spec", ["vllm", "vllm(kv_cache_dtype=fp8_e5m2,scales=checkpoint,k_scale=0.5,v_scale=0.25)",
                                  "vllm(scales=dynamic)", "sglang", "sglang(kv_scale=0.1)", "trtllm",
                                  "trtllm(kv_cache_dtype=fp8)"])
def test_per_tensor_presets_measure_one_byte_a_value_and_read_back_their_codes(spec, monkeypatch):
    seen = _capture(monkeypatch)
    model = tiny_model("llama")
    logits, cache = context_then_steps(model, spec, random_ids(20, 3), random_ids(3, 4), "float32")
    assert cache.stats().kv_bytes == 2 * 2 * 23 * (32 + 32)
    assert all(torch.isfinite(out).all() for out in logits)
    store, keys, _ = seen[0]
    held, _ = store.keys_values()
    assert torch.equal(held[:, :20], store.codec.key.decode(store.codec.key.encode(keys.float()), 32))


def test_vllm_dynamic_scales_are_the_calibration_amax_over_vllms_constants():
    """vllm/attention/layer.py, Attention.calc_kv_scales: abs(key).max() / K_SCALE_CONSTANT (200), abs(value).max()
    / V_SCALE_CONSTANT (100), once; the calibration pass stands for the first batch and is recorded."""
    from kveval.calibration.kv import calibration_kv, read_calibration_text

    model = tiny_model("llama")
    policy = parse_policy("vllm(scales=dynamic,calib_tokens=64)").quantization
    info = policy.run_info(model)
    kv, used = calibration_kv(model, read_calibration_text(None), 64)
    assert used == 64 and info["calibration_tokens_used"] == 64
    for i, (keys, values) in enumerate(kv):
        k_amax, v_amax = keys.to(torch.bfloat16).abs().max().float(), values.to(torch.bfloat16).abs().max().float()
        assert info["k_scales"][i] == float(k_amax / torch.tensor(200.0))
        assert info["v_scales"][i] == float(v_amax / torch.tensor(100.0))


def test_trtllm_scale_is_one_per_layer_shared_by_k_and_v():
    """modelopt/torch/export/quant_utils.py get_scaling_factor (amax / 127) and model_config_utils.py
    (kv_cache_scaling_factor = max(k, v)); FP8 scales are at least 1.0 (get_kv_cache_scaling_factor)."""
    model = tiny_model("llama")
    int8 = parse_policy("trtllm(calib_tokens=64)").quantization.run_info(model)
    fp8 = parse_policy("trtllm(kv_cache_dtype=fp8,calib_tokens=64)").quantization.run_info(model)
    for i in range(2):
        amax = max(int8["k_amax"][i], int8["v_amax"][i])
        assert int8["k_scales"][i] == int8["v_scales"][i] == float(torch.tensor(amax) / 127)
        assert fp8["k_scales"][i] == max(1.0, float(torch.tensor(amax) / 448))
    from pathlib import Path

    assert Path(int8["cache_file"]).is_file() and int8["cache_file"] == fp8["cache_file"]  # one pass, kept on disk


def test_a_batch_gives_batch_size_ones_answers():
    model = tiny_model("llama")
    assert_one_batch_equals_batch_size_one(model, Tok(), random_prompts([(30, 3), (17, 2)], seed=6),
                                           "llamacpp(k=q8_0,v=q4_0)", max_new_tokens=3)


def test_a_sweeps_shared_prefill_gives_engine_presets_their_own_runs():
    """An engine codes the prompt as it prefills, so it cannot be derived from a shared uncompressed prefill: in a
    cell with other policies it prefills alone, and every policy's answers and bytes equal its own run's."""
    model = tiny_model("llama")
    assert_shared_prefill_equals_own_runs(model, Tok(), random_prompts([(30, 3), (17, 2)], seed=9),
                                          ["none", "llamacpp(k=q4_0,v=q4_0)", "quant(bits=4,group=32)", "vllm"],
                                          max_new_tokens=3)


def test_eviction_then_engine_codes_bytes():
    model = tiny_model("llama")
    _, cache = context_then_steps(model, "snapkv(ratio=0.5)+llamacpp(k=q8_0,v=q4_0)", random_ids(20, 5),
                                  random_ids(2, 6), "float32")
    assert cache.stats().kv_bytes == 2 * 2 * (10 + 2) * (34 + 18)


@pytest.mark.parametrize("spec,message", [
    ("llamacpp(k=iq4_nl)", "not reproduced"),
    ("llamacpp(k=q3_k)", "not a llama.cpp cache type"),
    ("vllm(scales=checkpoint)", "needs k_scale= and v_scale="),
    ("vllm(k_scale=0.1,v_scale=0.1)", "add scales=checkpoint"),
    ("vllm(kv_cache_dtype=int8)", "must be one of"),
    ("sglang(kv_scale=-1)", "positive"),
    ("trtllm(kv_cache_dtype=int4)", "must be one of int8, fp8"),
])
def test_bad_presets_are_one_line_errors(spec, message):
    with pytest.raises(PolicySpecError, match=message) as info:
        parse_policy(spec)
    assert "\n" not in str(info.value)


def test_block_types_refuse_a_head_dim_not_a_multiple_of_32():
    with pytest.raises(PolicySpecError, match="not a multiple of 32"):
        parse_policy("llamacpp(k=q4_0)").quantization.check_head_dim(48)


# --- bytes in the planner and the engine's pool -------------------------------------------------------------
@pytest.mark.parametrize("spec,per_token", [
    ("llamacpp(k=q8_0,v=q4_0)", 32 * 8 * (4 * 34 + 4 * 18)),  # llama-3.1-8b: 32 layers, 8 KV heads, 128 = 4 blocks
    ("llamacpp(k=q4_1,v=q5_0)", 32 * 8 * (4 * 20 + 4 * 22)),
    ("vllm", 32 * 8 * 256), ("sglang", 32 * 8 * 256), ("trtllm", 32 * 8 * 256),
])
def test_planner_sizes_presets_as_the_engine_stores_them(spec, per_token):
    p = plan("llama-3.1-8b", 1000, 1, parse_policy(spec))
    assert p.bytes_per_token == per_token and p.sequence_bytes == 1000 * per_token


def test_vllm_pool_arithmetic():
    """80 GiB x 0.9 - 16 GB of weights = 61,309,411,328 B; an fp8 block (16 tokens x 32 layers x 8 heads x 128 x K
    and V x 1 byte) is 1 MiB: 58,469 blocks; 32k tokens are 2,048 blocks: 28 sequences (64 allowed), and vLLM's
    "maximum concurrency" 58,469 / 2,048 = 28.55x (blocks / blocks a request takes)."""
    p = vllm_plan("llama-3.1-8b", "80GiB", gpu_memory_utilization=0.9, max_model_len=32768, max_num_seqs=64,
                  weights="16GB", presets=["none", "vllm(kv_cache_dtype=fp8)"])
    assert p.pool_bytes == 61_309_411_328
    bf16, fp8 = p.presets
    assert (fp8.blocks, fp8.sequences, fp8.concurrent) == (58_469, 28, 28)
    assert fp8.max_concurrency == pytest.approx(28.5493, abs=1e-4)
    assert (bf16.blocks, bf16.sequences) == (29_234, 14)
    odd = vllm_plan("llama-3.1-8b", "80GiB", max_model_len=1000, weights="16GB", presets=["vllm(kv_cache_dtype=fp8)"])
    assert odd.presets[0].sequences == 58_469 // 63 and odd.presets[0].max_concurrency == 58_469 / 63  # 1000 -> 63 blocks
    small = vllm_plan("llama-3.1-8b", "80GiB", max_model_len=32768, max_num_seqs=4, weights="16GB")
    assert [f.concurrent for f in small.presets] == [4, 4]


def test_llamacpp_buffer_arithmetic():
    """--ctx-size 10000 pads to 10,240 cells; q8_0/q4_0 on llama-3.1-8b is 53,248 B a cell: 545,259,520 B."""
    p = llamacpp_plan("llama-3.1-8b", "24GiB", ctx_size=10000, parallel=4, weights="16GB",
                      presets=["llamacpp(k=q8_0,v=q4_0)"])
    (f,) = p.presets
    assert f.sequence_bytes == 10_240 * 53_248 and f.fits
    budget = 24 * 2**30 - 16 * 10**9
    slot = 2500
    assert f.sequences == max(n for n in range(1, 200) if -(-(n * slot) // 256) * 256 * 53_248 <= budget)


def test_memory_command_answers_in_engine_terms(capsys):
    assert cli.main(["memory", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "80GiB", "--gpu-memory-utilization",
                     "0.9", "--max-model-len", "32K", "--max-num-seqs", "64", "--weights", "16GB"]) == 0
    out = capsys.readouterr().out
    assert "KV pool    57.1 GiB" in out and "vllm(kv_cache_dtype=fp8)" in out and "28.55x" in out
    assert cli.main(["memory", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "80GiB", "--max-model-len", "32k",
                     "--gpu-memory-utilization", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kveval memory: error:") and "\n" not in err


def test_sliding_layers_hold_their_window_in_engine_codes():
    """Gemma 3 (tiny: 3 sliding layers of window 16, 1 full; 1 KV head of 32): 30 + 5 tokens, q8_0/q4_0 rows of
    34 + 18 bytes; each sliding layer holds 15 tokens, the full one 35."""
    from tiny_models import tiny_gemma3

    _, cache = context_then_steps(tiny_gemma3(), "llamacpp(k=q8_0,v=q4_0)", random_ids(30, 1), random_ids(5, 2),
                                  "float32")
    assert cache.stats().kv_bytes == (3 * 15 + 35) * (34 + 18)


def test_llamacpp_takes_q_in_the_k_types_vec_dot_type():
    """ggml converts Q to K's vec_dot_type before Q.K (ggml/src/ggml-cpu/ops.cpp, q_to_vec_dot; ggml_mul_mat):
    q8_0 for q8_0/q4_0/q5_0 K (and q8_1, the same codes and scale, for q4_1/q5_1), f16 for f16."""
    from kveval.tensors.engine_formats import ggml_query

    q = _rows(7)
    reference = gguf.quants.dequantize(gguf.quants.quantize(q.reshape(-1, 64).numpy(), _gguf("q8_0")), _gguf("q8_0"))
    for k in ("q8_0", "q4_0", "q5_0", "q4_1", "q5_1"):
        np.testing.assert_array_equal(ggml_query(q, k).reshape(-1, 64).numpy(), reference)
    assert torch.equal(ggml_query(q, "f16"), q.half().float())
    model, ids, steps = tiny_model("llama"), random_ids(20, 1), random_ids(3, 2)
    with_q, _ = context_then_steps(model, "llamacpp(k=q4_0,v=q4_0)", ids, steps, "float32")
    without, _ = context_then_steps(model, "llamacpp(k=q4_0,v=q4_0,quantize_q=false)", ids, steps, "float32")
    assert not torch.equal(with_q[0], without[0])
    f32_q, _ = context_then_steps(model, "llamacpp(k=f32,v=f32)", ids, steps, "float32")
    f32_plain, _ = context_then_steps(model, "llamacpp(k=f32,v=f32,quantize_q=false)", ids, steps, "float32")
    assert all(torch.equal(a, b) for a, b in zip(f32_q, f32_plain))


def test_x86_cpu_q8_0_rounds_halves_to_even_with_127_over_amax():
    """ggml/src/ggml-cpu/arch/x86/quants.c quantize_row_q8_0: id = 127 / amax and _mm256_round_ps(_MM_ROUND_NEAREST).
    On the row whose scaled values are halves it gives 0, 2, 2 where the reference gives 1, 2, 3."""
    x = torch.zeros(1, 1, 32)
    x[0, 0, :4] = torch.tensor([127.0, 0.5, 1.5, 2.5])
    assert ggml_quantize(x, "q8_0", x86=True)[0, 0, 2:6].view(torch.int8).tolist() == [127, 0, 2, 2]
    rows = _rows(8)
    amax = rows.reshape(3, 40, 2, 32).abs().amax(-1, keepdim=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax.numpy() == 0, np.float32(0), np.float32(127) / amax.numpy())  # 0 for a zero block
    expected = np.round(rows.reshape(3, 40, 2, 32).numpy() * inverse)  # numpy: half to even
    codes = ggml_quantize(rows, "q8_0", x86=True).reshape(3, 40, 2, 34)[..., 2:].view(torch.int8)
    np.testing.assert_array_equal(codes.numpy(), expected.astype(np.int8))
    model = tiny_model("llama")
    cpu, _ = context_then_steps(model, "llamacpp(k=q8_0,v=q8_0,cpu=true)", random_ids(20, 1), random_ids(2, 2), "float32")
    assert all(torch.isfinite(x).all() for x in cpu)


def test_gate_verdicts_join_the_engine_table(tmp_path, capsys):
    """kveval memory --engine ... --gate: each preset the gate judged on this model shows its verdict, derived again
    from the committed runs (a gate.json of verdicts alone, with no runs behind them, is refused: issue 65)."""
    import json
    import shutil

    sweep = tmp_path / "engines-equal-bytes"
    shutil.copytree(REPO / "results" / "engines-equal-bytes", sweep)
    assert cli.main(["memory", "smollm2-135m", "--engine", "llamacpp", "--gpu-memory", "4GiB", "--ctx-size", "8k",
                     "--parallel", "2", "--gate", str(sweep / "gate"), "--json"]) == 0
    rows = {f["preset"]: f["verdict"] for f in json.loads(capsys.readouterr().out)["presets"]}
    recorded = json.loads((sweep / "gate" / "gate.json").read_text())
    statuses = {c["name"]: c["status"] for r in recorded["results"] for c in r["candidates"]}
    for preset in ("llamacpp(k=q8_0,v=q8_0)", "llamacpp(k=q8_0,v=q4_0)", "llamacpp(k=q4_1,v=q4_1)",
                   "llamacpp(k=q4_0,v=q4_0)"):
        assert rows[preset] == statuses[f"smollm2-135m/{preset}"]
    assert rows["llamacpp(k=q4_0,v=q4_0)"] == "FAIL"
    assert rows["llamacpp(k=q5_0,v=q5_0)"] is None  # not judged on this model
    (sweep / "gate" / "gate.json").write_text(json.dumps({"results": [{"baseline": {"model": "smollm2-135m"},
                                                                        "candidates": []}]}))
    assert cli.main(["memory", "smollm2-135m", "--engine", "llamacpp", "--gpu-memory", "4GiB", "--ctx-size", "8k",
                     "--gate", str(sweep / "gate")]) == 2


def test_largest_parallel_is_the_largest_whose_buffer_fits():
    """The answer is the largest --parallel whose buffer fits: P fits and P + 1 does not."""
    specs = ["llamacpp(k=f16,v=f16)", "llamacpp(k=q4_0,v=q4_0)"]
    p = llamacpp_plan("smollm2-135m", "1GiB", ctx_size=4096, parallel=2, weights="300MB", presets=specs)
    for f, spec in zip(p.presets, specs):
        def need(n):
            return plan("smollm2-135m", -(-(n * 2048) // 256) * 256, 1, parse_policy(spec)).sequence_bytes
        assert need(f.sequences) <= p.pool_bytes < need(f.sequences + 1)


@pytest.mark.parametrize("spec", ["vllm", "vllm(scales=dynamic,calib_tokens=64)", "sglang(kv_scale=0.5)", "trtllm",
                                  "llamacpp(k=q8_0,v=q4_0,quantize_q=false,cpu=true)"])
def test_canonical_specs_name_the_cache_type_and_parse_back(spec):
    canonical = parse_policy(spec).spec
    assert canonical.split("(")[1].split("=")[0] in ("kv_cache_dtype", "k")  # the first parameter, always shown
    assert parse_policy(canonical).spec == canonical


@pytest.mark.parametrize("engine, preset, own", [
    ("vllm", "llamacpp(k=q4_0,v=q4_0)", "llamacpp's format"),
    ("llamacpp", "vllm(kv_cache_dtype=fp8)", "vllm's format"),
    ("llamacpp", "kivi(bits=4)", "llama.cpp has no such KV cache"),
    ("vllm", "snapkv(ratio=0.5)", "vLLM has no such KV cache"),
])
def test_the_engine_planner_sizes_only_what_the_engine_runs(engine, preset, own):
    """Issue 65: --engine vllm with a llama.cpp preset said "50 sequences fit" for a cache type vLLM does not have."""
    from kveval.errors import UsageError

    plan_of = {"vllm": lambda: vllm_plan("llama-3.1-8b", "80GiB", max_model_len=32768, presets=[preset]),
               "llamacpp": lambda: llamacpp_plan("llama-3.1-8b", "80GiB", ctx_size=32768, presets=[preset])}
    with pytest.raises(UsageError, match=re.escape(own)):
        plan_of[engine]()


def test_default_presets_the_model_cannot_hold_are_left_out_with_a_note(tmp_path):
    """Issue 65: head_dim 40 made the default q8_0 preset raise instead of showing the rows that apply."""
    config = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 320, "head_dim": 40, "max_position_embeddings": 131072, "vocab_size": 1000,
              "intermediate_size": 640}
    p = llamacpp_plan(config, "24GiB", ctx_size=32768)
    assert [f.preset for f in p.presets] == ["llamacpp(k=f16,v=f16)"]
    assert sum(" left out: " in n and "head_dim=40 is not a multiple of 32" in n for n in p.notes) == 6
    v = vllm_plan(config, "24GiB", max_model_len=1 << 20)
    assert any("--max-model-len 1,048,576 tokens exceeds the model's max_position_embeddings (131,072)" in n
               for n in v.notes)
