"""The engines' per-head 4-bit and per-token-head KV caches as presets: vLLM's ``nvfp4`` and
``{int8,fp8,int4}_per_token_head``, SGLang's ``fp4_mx_block16``; and the flags refused in one line.

References that run here:

* vLLM's per-token-head writers are vLLM 0.33's own Triton kernels, run by Triton's interpreter
  (``tests/vllm_triton_reference.py``) where ``KVEVAL_VLLM_SOURCE`` names an unpacked vLLM 0.33.0 wheel and triton
  is importable; elsewhere their outputs on ``_rows()`` are pinned by sha256 digests taken from those runs.
* vLLM's ``nvfp4`` is written by FlashInfer 0.7.2.post1's ``nvfp4_append_quantize_block`` (CUDA, read, not run):
  torchao 0.18's ``nvfp4_quantize`` computes the same codes and scales wherever the two formulas coincide, i.e. a
  global scale that is a power of two (``amax / (6 g)`` and ``(amax / 6) / g`` then round alike) and blocks above
  torchao's ``2**-6`` floor of the E4M3 scale; below it FlashInfer stores subnormal scales, checked by hand here.
* SGLang's ``fp4_mx_block16`` coder is pinned against SGLang 0.5.23 in ``tests/test_microscaling.py``; here its
  preset is checked to store exactly those codes.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import vllm_triton_reference as vllm_ref
from cache_runs import assert_one_batch_equals_batch_size_one, context_then_steps, random_ids, random_prompts
from kveval.errors import PolicySpecError, UnsupportedModelError, UsageError
from kveval.planner.engines import vllm_plan
from kveval.planner.memory import plan
from kveval.policies.compatibility import check_policy
from kveval.policies.spec import parse_policy
from kveval.stores.engine import EngineStore, FlashinferNvfp4Side, PerTokenHeadSide, SglangFp4Side
from kveval.tensors import microscaling as ms
from kveval.tensors.engine_formats import flashinfer_nvfp4_encode
from kveval.tensors.per_token_head import quantize_int4, quantize_int8_fp8
from tiny_models import Tok, tiny_model

try:
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
except ImportError:
    nvfp4_quantize = None

pytestmark = pytest.mark.usefixtures("calibration_cache")

NEW_PRESETS = ("vllm(kv_cache_dtype=nvfp4)", "vllm(kv_cache_dtype=nvfp4,scales=checkpoint,k_scale=0.5,v_scale=0.125)",
               "vllm(kv_cache_dtype=int8_per_token_head)", "vllm(kv_cache_dtype=fp8_per_token_head)",
               "vllm(kv_cache_dtype=int4_per_token_head)", "sglang(kv_cache_dtype=fp4_mx_block16)")
#: Bytes per token and KV head of K (= of V) at head_dim D, as each engine sizes them.
ROW_BYTES = {"nvfp4": lambda d: d // 2 + d // 16, "int8_per_token_head": lambda d: d + 4,
             "fp8_per_token_head": lambda d: d + 4, "int4_per_token_head": lambda d: d // 2 + 4,
             "fp4_mx_block16": lambda d: d // 2 + d // 16}
REFERENCE_MISSING = vllm_ref.available()


def _dtype_of(spec: str) -> str:
    return spec.split("kv_cache_dtype=")[1].split(",")[0].rstrip(")")


def _rows(seed: int = 0) -> torch.Tensor:
    """``[T=40, H=3, D=64]`` rows with heavy-tailed channels and the edge cases: an all-zero row, one outlier,
    a row far below the others, an all-negative row, a constant row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 3, 64, generator=g) * torch.exp(torch.randn(1, 1, 64, generator=g) * 2)
    x[0, 0] = 0
    x[1, 0, 5] = 1e4
    x[2, 1] *= 1e-9
    x[3, 2] = -x[3, 2].abs()
    x[4, 0, :] = 0.5
    return x


def _digest(*tensors: torch.Tensor) -> str:
    data = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    return hashlib.sha256(data).hexdigest()[:16]


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


# --- vLLM's per-token-head caches vs vLLM's own Triton kernels ----------------------------------------------
#: sha256 (16 hex digits) of vLLM 0.33.0's kernels' (codes, scales) on ``_rows()`` (int4: on ``_rows()`` in that
#: dtype), run by triton 3.9.0's interpreter on torch 2.13.0 (CPU).
PINNED = {"int8": "9b2ebc26c67b3b82", "fp8": "552360dfb8b49fb2", "int4-float32": "7f6ae0beadd4012a",
          "int4-bfloat16": "56119bd2cac1378f"}


def _kveval_per_token_head(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int4(x) if kind == "int4" else quantize_int8_fp8(x, kind)


@pytest.mark.parametrize("case", list(PINNED))
def test_per_token_head_codes_and_scales_match_the_pinned_vllm_kernels(case):
    kind, _, dtype = case.partition("-")
    x = _rows().to(getattr(torch, dtype or "float32"))
    assert _digest(*_kveval_per_token_head(x, kind)) == PINNED[case]


@pytest.mark.skipif(REFERENCE_MISSING is not None, reason=f"vLLM's kernels cannot run: {REFERENCE_MISSING}")
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
def test_per_token_head_is_vllms_kernel_bit_for_bit_on_random_and_real_kv(kind, smollm2_kv):
    cases = [_rows(1), _rows(2).to(torch.bfloat16), torch.randn(5, 2, 48).to(torch.bfloat16)]  # 48: RHT in blocks of 16
    cases += [t for layer in smollm2_kv[::10] for t in layer]
    for x in cases:
        if kind != "int4":
            x = x.float()
        codes, scales = _kveval_per_token_head(x, kind)
        ref_codes, ref_scales = vllm_ref.int4_per_token_head(x) if kind == "int4" else vllm_ref.per_token_head(x, kind)
        assert torch.equal(codes, ref_codes)
        assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))


def test_per_token_head_store_reads_back_code_times_scale():
    """The store's row is [codes | float32 scale]: D + 4 bytes (int8/fp8), D / 2 + 4 (int4), and reads back the
    codes' values times the scale (int4: rotated back)."""
    x = _rows().transpose(0, 1).contiguous()  # [H, T, D]
    for kind, width in (("int8", 68), ("fp8", 68), ("int4", 36)):
        side = PerTokenHeadSide(kind, torch.float32)
        raw = side.encode(x)
        assert raw.shape == (3, 40, width) and raw.dtype == torch.uint8
        codes, scales = _kveval_per_token_head(x, kind)
        assert torch.equal(raw[..., :-4], codes) and torch.equal(raw[..., -4:].contiguous().view(torch.float32)[..., 0], scales)
        back = side.decode(raw, 64)
        if kind == "int8":
            assert torch.equal(back, codes.view(torch.int8).float() * scales.unsqueeze(-1))
        assert (back - x).abs().amax(-1).le(x.abs().amax(-1) * (0.6 if kind == "int4" else 0.07) + 1e-5).all()


# --- vLLM's nvfp4: FlashInfer's writer ----------------------------------------------------------------------
def _torchao_nvfp4(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    scales, codes = nvfp4_quantize(x.reshape(-1, x.shape[-1]).contiguous(), 16, torch.tensor(g))
    return codes.view(torch.uint8).reshape(*x.shape[:-1], -1), scales.view(torch.uint8).reshape(*x.shape[:-1], -1)


@pytest.mark.skipif(nvfp4_quantize is None, reason="torchao is not installed")
@pytest.mark.parametrize("g", [1.0, 0.25, 2.0 ** -10])
def test_nvfp4_is_torchao_where_flashinfers_formula_coincides(g, smollm2_kv):
    """A power-of-two global scale, blocks whose scale is at or above torchao's E4M3 floor: codes and scales equal."""
    cases = [_rows(3), _rows(4) * 100] + [t.float() for layer in smollm2_kv[::6] for t in layer]
    compared = 0
    for x in cases:
        rows = flashinfer_nvfp4_encode(x, g)
        codes, scales = _torchao_nvfp4(x, g)
        blocks = x.reshape(*x.shape[:-1], -1, 16).abs().amax(-1)
        above = blocks / (6 * g) >= ms.E4M3_TINY  # torchao clamps the others to 2**-6
        assert torch.equal(rows.scales[above], scales[above])
        pairs = above.repeat_interleave(8, dim=-1)
        assert torch.equal(rows.codes[pairs], codes[pairs])
        compared += int(above.sum())
    assert compared > 1000


def test_nvfp4_edge_blocks_follow_flashinfers_source():
    """page.cuh, nvfp4_append_quantize_block: an all-zero block stores scale 0 and codes 0; a small block gets a
    subnormal E4M3 scale (no floor); one outlier takes the scale and zeroes its neighbours; past 448 * 6 * g the
    scale saturates at 448 and the values at 6."""
    x = torch.zeros(1, 64)
    x[0, 16:32] = torch.linspace(-0.03, 0.03, 16)  # amax 0.03: sf = 0.005 = 2.56 * 2**-9 -> subnormal code 3
    x[0, 32] = 630.0  # outlier: sf = 105, E4M3 104; its neighbours (1 / 104) round to 0
    x[0, 33:48] = 1.0
    x[0, 48:64] = 10000.0  # past 448 * 6
    rows = flashinfer_nvfp4_encode(x, 1.0)
    assert rows.scales[0].tolist()[0] == 0 and rows.codes[0, :8].eq(0).all()
    assert rows.scales[0, 1].item() == 3  # E4M3 subnormal 3 * 2**-9 (torchao would store its floor, 2**-6 = 0x08)
    s = ms.e4m3_values(rows.scales[0, 2]).item()
    assert s == 104.0  # E4M3 steps by 8 between 64 and 128
    values = ms.decode_rows(rows)[0]
    assert values[32].item() == 6 * 104 and values[33:48].eq(0).all()
    assert rows.scales[0, 3].item() == 0x7E and values[48:64].eq(448 * 6).all()  # 448, saturated
    zero_g = flashinfer_nvfp4_encode(torch.ones(1, 16), 0.0)
    assert zero_g.scales.eq(0).all() and zero_g.codes.eq(0).all()  # g = 0: FlashInfer writes zeros


def test_nvfp4_store_layout_and_global_scale():
    """vLLM's head row is [D / 2 E2M1 bytes | D / 16 E4M3 scales]; values read back as code * (g * s)."""
    x = _rows(5).transpose(0, 1).contiguous()
    side = FlashinferNvfp4Side(0.125)
    raw = side.encode(x)
    rows = flashinfer_nvfp4_encode(x, 0.125)
    assert raw.shape[-1] == 36 and torch.equal(raw[..., :32], rows.codes) and torch.equal(raw[..., 32:], rows.scales)
    assert torch.equal(side.decode(raw, 64), ms.decode_rows(rows))


def test_sglang_fp4_mx_block16_store_holds_sglangs_codes():
    x = _rows(6).to(torch.bfloat16).float().transpose(0, 1).contiguous()
    raw = SglangFp4Side().encode(x)
    rows = ms.encode_sglang_fp4_mx_block16(x)
    assert raw.shape[-1] == 36 and torch.equal(raw, torch.cat([rows.codes, rows.scales], -1))
    assert torch.equal(SglangFp4Side().decode(raw, 64), ms.decode_rows(rows))


# --- the presets on a model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", NEW_PRESETS)
def test_planned_equals_measured_and_the_cache_reads_back_its_codes(spec):
    """A tiny Llama (2 layers, 2 KV heads, head_dim 32): 23 tokens measured = the planner's bytes."""
    model = tiny_model("llama")
    logits, cache = context_then_steps(model, spec, random_ids(20, 3), random_ids(3, 4), "float32")
    per_head = ROW_BYTES[_dtype_of(spec)](32)
    assert cache.stats().kv_bytes == 2 * 2 * 23 * 2 * per_head
    planned = plan(model.config, 23, 1, parse_policy(spec), 4)
    assert planned.sequence_bytes == cache.stats().kv_bytes
    assert all(torch.isfinite(out).all() for out in logits)


@pytest.mark.parametrize("spec", ["vllm(kv_cache_dtype=nvfp4)", "vllm(kv_cache_dtype=int4_per_token_head)",
                                  "sglang(kv_cache_dtype=fp4_mx_block16)"])
def test_a_batch_of_three_gives_batch_size_ones_answers(spec):
    model = tiny_model("llama")
    assert_one_batch_equals_batch_size_one(model, Tok(), random_prompts([(30, 3), (17, 2), (24, 2)], seed=6), spec,
                                           max_new_tokens=3)


def test_compression_hurts_in_the_expected_order():
    """On the same K/V: 4-bit codes lose more than the 8-bit ones of their family (heavy-tailed channels make FP8's
    relative steps beat INT8's uniform ones, so only like is compared with like)."""
    x = _rows(7).transpose(0, 1).contiguous()
    error = {}
    for name, side in (("int8", PerTokenHeadSide("int8")), ("fp8", PerTokenHeadSide("fp8")),
                       ("nvfp4", FlashinferNvfp4Side(1.0)), ("int4", PerTokenHeadSide("int4", torch.float32))):
        error[name] = (side.decode(side.encode(x), 64) - x).pow(2).mean().item()
    assert error["int8"] < error["int4"] and error["fp8"] < error["nvfp4"]


@pytest.mark.parametrize("spec,message", [
    ("vllm(kv_cache_dtype=nvfp4_4over6)", "compiled SM100 kernel"),
    ("sglang(kv_cache_dtype=fp4_e2m1)", "SGLang 0.5.23 has no fp4_e2m1.*fp4_mx_block16"),
    ("sglang(kv_cache_dtype=nvfp4)", "could not be pinned"),
    ("trtllm(kv_cache_dtype=nvfp4)", "not reproduced"),
    ("vllm(kv_cache_dtype=int8_per_token_head,scales=dynamic)", "drop scales="),
    ("vllm(kv_cache_dtype=nvfp4,scales=dynamic)", "computes none"),
    ("sglang(kv_cache_dtype=fp4_mx_block16,kv_scale=0.5)", "drop kv_scale="),
])
def test_unpinned_flags_are_refused_in_one_line(spec, message):
    with pytest.raises(PolicySpecError, match=message) as info:
        parse_policy(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec,dim", [("vllm(kv_cache_dtype=nvfp4)", 40), ("sglang(kv_cache_dtype=fp4_mx_block16)", 72),
                                      ("vllm(kv_cache_dtype=int4_per_token_head)", 33)])
def test_a_head_dim_the_format_cannot_hold_is_refused(spec, dim):
    with pytest.raises(PolicySpecError, match=f"head_dim={dim}"):
        parse_policy(spec).quantization.check_head_dim(dim)
    with pytest.raises(UsageError, match="not a whole number of blocks"):
        flashinfer_nvfp4_encode(torch.ones(2, 40), 1.0)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "deepseek_v4"])
@pytest.mark.parametrize("spec", NEW_PRESETS[:1] + NEW_PRESETS[2:])
def test_per_head_presets_are_refused_on_latent_and_v4_caches_before_weights_load(model_type, spec):
    with pytest.raises(UnsupportedModelError) as info:
        check_policy({"model_type": model_type}, parse_policy(spec))
    assert "\n" not in str(info.value)


# --- the planner --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["nvfp4", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"])
def test_vllm_planner_sizes_the_new_dtypes(dtype):
    """llama-3.1-8b: 32 layers x 8 KV heads x (K + V) rows of head_dim 128."""
    p = vllm_plan("llama-3.1-8b", "80GiB", max_model_len=32768, weights="16GB",
                  presets=["none", f"vllm(kv_cache_dtype={dtype})"])
    fit = p.presets[1]
    per_token = 32 * 8 * 2 * ROW_BYTES[dtype](128)
    assert fit.bytes_per_token == per_token
    assert fit.blocks == p.pool_bytes // (16 * per_token)
    assert fit.blocks > p.presets[0].blocks


def test_memory_command_takes_kv_cache_dtype(capsys):
    from kveval.commands import main as cli

    assert cli.main(["memory", "smollm2-135m", "--engine", "vllm", "--gpu-memory", "24GiB", "--max-model-len", "8k",
                     "--kv-cache-dtype", "nvfp4"]) == 0
    out = capsys.readouterr().out
    assert "vllm(kv_cache_dtype=nvfp4)" in out and f"{30 * 3 * 2 * 36:,}" in out
    try:
        code = cli.main(["memory", "smollm2-135m", "--engine", "vllm", "--gpu-memory", "24GiB", "--max-model-len", "8k",
                         "--kv-cache-dtype", "nvfp4_4over6"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and "nvfp4_4over6 is not reproduced" in capsys.readouterr().err
