"""NVFP4, MXFP4 and MXFP8 (kveval.tensors.microscaling) bit for bit against torchao 0.18's reference quantizers.

Where torchao is installed (the ``test`` extra pins it) the codes, block scales and decoded values are compared with
``torchao.prototype.mx_formats`` directly. Where it is not, the same comparisons run against digests and small
tables pinned here: they were produced once by running torchao 0.18.0 on torch 2.13.0 (CPU) through
:func:`_reference` below (``python -c 'import tests.test_microscaling as t; t._print_pins()'`` in an environment
with torchao), and the small tables were checked by hand against the E2M1/E4M3/E8M0 rules in the module docstring.
"""

import hashlib

import pytest
import torch

from kveval.errors import UsageError
from kveval.tensors.microscaling import (
    E2M1_VALUES,
    FORMATS,
    MXFP4,
    MXFP8,
    NVFP4,
    ScaleRule,
    bytes_per_token_head,
    decode_kv,
    decode_rows,
    e2m1_codes,
    encode_sglang_fp4_mx_block16,
    e2m1_values,
    e8m0_values,
    encode_kv,
    encode_nvfp4_4over6,
    encode_rows,
    nvfp4_global_scale,
    pack_e2m1,
    sglang_e2m1_codes,
    unpack_e2m1,
)

try:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize
except ImportError:  # the pinned digests below still check every case
    to_mx = None


def _kv(seed: int = 0) -> torch.Tensor:
    """``[4, 24, 128]`` float32 K/V-like rows: heavy-tailed channels (a log-normal spread of channel scales, as
    real keys have), and rows with the cases the rounding and scale rules disagree on."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 24, 128, generator=g) * torch.exp(torch.randn(1, 1, 128, generator=g) * 2)
    x[0, 0] = 0  # all-zero blocks
    x[0, 1, 5] = 1000.0  # one outlier in a block
    x[0, 2] *= 1e-30  # scales far below the others' (NVFP4's E4M3 floor)
    x[0, 3] *= 1e-42  # float32 subnormals: E8M0 code 0
    x[0, 4, :32] = torch.tensor(E2M1_VALUES * 4) * 0.5 + 0.125
    x[0, 5] = -0.0
    # E2M1 midpoints (ties), values past 6 in a block whose scale is 1, their negatives
    x[1, 0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, 7.0,
                                 -0.25, -0.75, -2.5, -3.5, -5.0, 6.0])
    x[1, 1, :32] = 7.0  # MX floor: amax 7 = 1.75 * 4, past E2M1's 6 -> saturates
    return x


#: (format, E8M0 rule, global scale) cases; the NVFP4 global scales: none (one level), the tensor's own
#: (``per_tensor_amax_to_scale``), and a fixed one far too small for some blocks (their E4M3 scales saturate).
CASES = [
    ("nvfp4", None, None),
    ("nvfp4", None, "amax"),
    ("nvfp4", None, 1e-3),
    ("mxfp4", "floor", None),
    ("mxfp4", "rceil", None),
    ("mxfp8", "floor", None),
    ("mxfp8", "rceil", None),
]
CASE_IDS = [f"{f}-{r or ('one-level' if g is None else g)}" for f, r, g in CASES]


def _global(x: torch.Tensor, spec) -> torch.Tensor | None:
    if spec is None:
        return None
    return nvfp4_global_scale(x.abs().amax()) if spec == "amax" else torch.tensor(spec, dtype=torch.float32)


def _ours(x: torch.Tensor, fmt: str, rule, spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = encode_rows(x.reshape(-1, x.shape[-1]), FORMATS[fmt], _global(x, spec), ScaleRule(rule or "floor"))
    return rows.codes, rows.scales, decode_rows(rows)


def _reference(x: torch.Tensor, fmt: str, rule, spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's codes (``uint8``), block scales (``uint8`` bits) and decoded float32 values of the rows of ``x``."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if fmt == "nvfp4":
        gs = _global(x, spec)
        scales, codes = nvfp4_quantize(rows, 16, gs)
        values = NVFP4Tensor.to_nvfp4(rows, per_tensor_scale=gs).dequantize(torch.float32)
        return codes.view(torch.uint8), scales.view(torch.uint8), values
    element = torch.float4_e2m1fn_x2 if fmt == "mxfp4" else torch.float8_e4m3fn
    scales, codes = to_mx(rows, element, 32, ScaleCalculationMode(rule))
    values = to_dtype(codes, scales, element, 32, torch.float32)
    return codes.view(torch.uint8), scales.view(torch.uint8), values


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _print_pins() -> None:  # pragma: no cover - run by hand where torchao is installed
    for case, name in zip(CASES, CASE_IDS):
        print(f'    "{name}": {tuple(_digest(t) for t in _reference(_kv(), *case))},')


#: sha256 (first 16 hex digits) of torchao 0.18.0's codes, block scales and decoded float32 values on ``_kv()``.
PINNED = {
    "nvfp4-one-level": ("bdf7ce2405216226", "845815ddb5167bce", "c1cefe177fec833c"),
    "nvfp4-amax": ("a08f98b280bcfa1c", "eb2fa57049061876", "1df43345a26ba53a"),
    "nvfp4-0.001": ("b3ef2f0e54481c20", "721a24132245fc7a", "70093a6445170bf0"),
    "mxfp4-floor": ("78a22d1523ed13c5", "53c6df416b53628c", "6b52e4c427c136fc"),
    "mxfp4-rceil": ("4d4700ff18142104", "ad2e9226358d915f", "c8c25df956858690"),
    "mxfp8-floor": ("da6b133dbb5a9eac", "752859935ecbeb02", "0eb23dd29be6869c"),
    "mxfp8-rceil": ("a2e74166dcb4004e", "b5a0e3cb310d768e", "c64faee26da47459"),
}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_codes_scales_and_values_match_the_pinned_reference(case):
    codes, scales, values = _ours(_kv(), *case)
    assert (_digest(codes), _digest(scales), _digest(values)) == PINNED[CASE_IDS[CASES.index(case)]]


@pytest.mark.skipif(to_mx is None, reason="torchao is not installed; the pinned digests check the same cases")
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_codes_scales_and_values_are_torchao_bit_for_bit(case, seed):
    x = _kv(seed)
    for ours, reference in zip(_ours(x, *case), _reference(x, *case)):
        assert ours.dtype == reference.dtype
        assert torch.equal(ours.contiguous().view(torch.uint8), reference.contiguous().view(torch.uint8))


# --- hand-checked cases ------------------------------------------------------------------------------------
def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates_keeping_the_sign():
    x = torch.tensor([0.25, 0.2501, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, 7.0, 1e30,
                      -0.0, -0.25, -0.75, -2.5, -3.5, -5.0, -7.0])
    # ties at 0.25, 1.25, 2.5, 5 go down to the even codes 0, 2, 4, 6; at 0.75, 1.75, 3.5 up to 2, 4, 6
    assert e2m1_codes(x).tolist() == [0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7, 8, 8, 10, 12, 14, 14, 15]
    assert e2m1_values(torch.arange(16, dtype=torch.uint8)).tolist() == list(E2M1_VALUES) + [-v for v in E2M1_VALUES]


def test_e2m1_packs_element_2i_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 4, 15, 8]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0x43, 0x8F]]
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)


def test_e8m0_reads_back_powers_of_two_code_zero_subnormal_and_255_nan():
    values = e8m0_values(torch.tensor([0, 1, 127, 130, 254, 255], dtype=torch.uint8))
    assert values[:5].tolist() == [2.0**-127, 2.0**-126, 1.0, 8.0, 2.0**127]
    assert values[5].isnan()


def test_all_zero_blocks_code_zeros_with_the_smallest_scales():
    zeros = torch.zeros(2, 64)
    one_level = encode_rows(zeros, NVFP4)
    two_level = encode_rows(zeros, NVFP4, nvfp4_global_scale(torch.tensor(10.0)))
    for rows in (one_level, two_level):  # E4M3's smallest normal, 2**-6 (0x08): torchao's floor
        assert rows.scales.unique().tolist() == [0x08] and rows.codes.unique().tolist() == [0]
        assert torch.equal(decode_rows(rows), zeros)
    for fmt in (MXFP4, MXFP8):
        for rule in ScaleRule:
            rows = encode_rows(zeros, fmt, rule=rule)
            assert rows.scales.unique().tolist() == [0] and rows.codes.unique().tolist() == [0]
            assert torch.equal(decode_rows(rows), zeros)


def test_one_outlier_takes_its_block_scale_and_zeroes_the_rest_of_the_block():
    block = torch.ones(1, 16)
    block[0, 0] = 1000.0
    rows = encode_rows(block, NVFP4)
    # 1000 / 6 = 166.7 -> E4M3 160 (1.25 * 2**7: 0b0_1110_010); 1000 / 160 = 6.25 -> saturates to 6; 1 / 160 -> 0
    assert rows.scales.tolist() == [[0x72]]
    assert unpack_e2m1(rows.codes).tolist() == [[7] + [0] * 15]
    assert decode_rows(rows).tolist() == [[960.0] + [0.0] * 15]
    # the next block has its own scale: ones -> 1 / 6 -> E4M3 0.171875 (1.375 * 2**-3), 1 / 0.171875 = 5.8 -> 6
    two = torch.cat([block, torch.ones(1, 16)], dim=1)
    assert decode_rows(encode_rows(two, NVFP4))[0, 16:].tolist() == [6 * 0.171875] * 16


def test_values_past_the_element_range_saturate():
    sevens = torch.full((1, 32), 7.0)
    # MX floor: amax 7 = 1.75 * 2**2 -> scale 2**(2 - 2) = 1 (code 127); 7 saturates to E2M1's 6
    rows = encode_rows(sevens, MXFP4)
    assert rows.scales.tolist() == [[127]] and rows.codes.unique().tolist() == [0x77]
    assert decode_rows(rows).unique().tolist() == [6.0]
    # rceil picks the scale that fits: ceil(log2(7 / 6)) = 1 -> 2 (code 128); 7 / 2 = 3.5 -> ties to 4 -> 8
    rows = encode_rows(sevens, MXFP4, rule=ScaleRule.RCEIL)
    assert rows.scales.tolist() == [[128]] and decode_rows(rows).unique().tolist() == [8.0]
    # NVFP4 with a global scale too small for the block: its E4M3 scale saturates at 448, then the values at 6
    rows = encode_rows(torch.full((1, 16), 100.0), NVFP4, torch.tensor(1e-3))
    assert rows.scales.tolist() == [[0x7E]]  # 448
    assert decode_rows(rows).unique().tolist() == [(torch.tensor(1e-3) * 448.0 * 6.0).item()]  # 6 * (g * s), float32


def test_subnormal_blocks_and_scales():
    # float32 subnormals: E8M0 code 0 (2**-127) under either rule, coded as zeros
    tiny = torch.full((1, 32), 1e-42)
    for fmt in (MXFP4, MXFP8):
        for rule in ScaleRule:
            rows = encode_rows(tiny, fmt, rule=rule)
            assert rows.scales.tolist() == [[0]] and torch.equal(decode_rows(rows), torch.zeros(1, 32))
    # a small normal block keeps its exact power of two: 2**-120 -> scale 2**-122 (code 5), element 4
    rows = encode_rows(torch.full((1, 32), 2.0**-120), MXFP4)
    assert rows.scales.tolist() == [[5]] and decode_rows(rows).unique().tolist() == [2.0**-120]
    # NVFP4's E4M3 block scale stops at 2**-6 (0x08), never subnormal (0x01-0x07): a block of 1e-6 codes zeros
    rows = encode_rows(torch.full((1, 16), 1e-6), NVFP4)
    assert rows.scales.tolist() == [[0x08]] and decode_rows(rows).unique().tolist() == [0.0]
    for case in CASES[:3]:
        _, scales, _ = _ours(_kv(), *case)
        magnitude = scales & 0x7F
        assert not ((magnitude > 0) & (magnitude < 0x08)).any()


@pytest.mark.parametrize("fmt,dim", [(NVFP4, 72), (MXFP4, 48), (MXFP8, 80)])
def test_a_row_that_is_not_whole_blocks_is_refused(fmt, dim):
    with pytest.raises(UsageError, match=f"blocks of {fmt.block} values; a row of {dim}"):
        encode_rows(torch.ones(2, dim), fmt)
    with pytest.raises(UsageError, match=f"a row of {dim}"):
        bytes_per_token_head(fmt, dim)
    if to_mx is not None:  # the reference refuses it too
        with pytest.raises(AssertionError, match="divisible by block_size"):
            if fmt is NVFP4:
                nvfp4_quantize(torch.ones(2, dim), 16)
            else:
                to_mx(torch.ones(2, dim), torch.float8_e4m3fn, 32)


def test_channel_blocks_run_along_tokens_and_refuse_a_partial_block():
    x = _kv()[:, :, :64]  # [4, 24, 64]
    with pytest.raises(UsageError, match="a row of 24"):
        encode_kv(x, MXFP4, axis="channel")
    x = torch.cat([x, x[:, :8]], dim=1)  # 32 tokens
    rows = encode_kv(x, MXFP4, axis="channel")
    direct = encode_rows(x.transpose(-1, -2).contiguous(), MXFP4)
    assert torch.equal(rows.codes, direct.codes) and torch.equal(rows.scales, direct.scales)
    assert rows.codes.shape == (4, 64, 16) and rows.scales.shape == (4, 64, 1)
    assert torch.equal(decode_kv(rows, "channel"), decode_rows(direct).transpose(-1, -2))
    with pytest.raises(UsageError, match="unknown block axis"):
        encode_kv(x, MXFP4, axis="head")


def test_stored_bytes_are_codes_block_scales_and_global_scales():
    assert [bytes_per_token_head(f, 128) for f in (NVFP4, MXFP4, MXFP8)] == [72, 68, 132]
    assert bytes_per_token_head(NVFP4, 64) == 36 == 64 // 2 + 64 // 16  # vLLM's nvfp4_kv_cache_full_dim(64)
    x = _kv()
    rows = encode_kv(x, NVFP4, global_scale=nvfp4_global_scale(x.abs().amax()))
    assert rows.nbytes == 4 * 24 * 72 + 4  # one FP32 global scale for the tensor
    assert encode_kv(x, NVFP4).nbytes == 4 * 24 * 72
    assert encode_kv(x, MXFP8).nbytes == 4 * 24 * 132
    channel = encode_kv(torch.cat([x, x[:, :8]], dim=1), MXFP4, axis="channel")
    assert channel.nbytes == 4 * 32 * bytes_per_token_head(MXFP4, 128, axis="channel") == 4 * 32 * 68
    assert bytes_per_token_head(MXFP4, 72, axis="channel") == 72 / 2 + 72 / 32  # channels need not be whole blocks


def test_a_global_scale_is_refused_by_formats_without_one():
    with pytest.raises(UsageError, match="mxfp4 has no global scale"):
        encode_rows(torch.ones(1, 32), MXFP4, torch.tensor(1.0))


# --- SGLang's fp4_mx_block16 -------------------------------------------------------------------------------
#: SGLang 0.5.23's ``FP4MXBlock16KVQuantizeUtil.batched_quantize`` and ``batched_dequantize`` (float32 out) on
#: ``_kv()``: packed codes, scales, values, sha256 first 16 hex digits. Generated once by running those two
#: functions' source from the sglang 0.5.23 wheel (``python/sglang/srt/layers/quantization/kvfp4_tensor.py``,
#: without the ``torch.compile`` decorator, which does not change eager numerics) on torch 2.13.0's CPU build;
#: sglang itself does not import without its GPU dependencies.
SGLANG_PINNED = ("41c784e3c0caa9be", "7981909ba4d4af0c", "5f16bbc172e09ca7")


def test_sglang_fp4_mx_block16_matches_the_pinned_reference():
    rows = encode_sglang_fp4_mx_block16(_kv())
    assert rows.scales.shape == (4, 24, 8) and rows.nbytes == 4 * 24 * (64 + 8)
    assert (_digest(rows.codes), _digest(rows.scales), _digest(decode_rows(rows))) == SGLANG_PINNED


def test_sglang_rounds_e2m1_ties_up_and_drops_the_sign_of_negative_zero():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.0, -0.1, -0.25, 0.0, 1.0, 2.0, 3.0, 6.0])
    assert sglang_e2m1_codes(x).tolist() == [1, 2, 3, 4, 5, 6, 7, 7, 0, 8, 9, 0, 2, 4, 5, 7]
    assert e2m1_codes(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 8, 0, 2, 4, 5, 7]  # torchao: ties to even
    # the reference's output on this block (amax 7 -> ceil(log2(7 / 6)) = 1, scale 2 = code 128)
    rows = encode_sglang_fp4_mx_block16(x[None])
    assert rows.codes.tolist() == [[16, 33, 67, 101, 128, 8, 33, 83]] and rows.scales.tolist() == [[128]]
    assert decode_rows(rows).tolist() == [[0.0, 1.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 0.0, -0.0, -0.0, 0.0, 1.0, 2.0, 3.0,
                                           6.0]]
    with pytest.raises(UsageError, match="blocks of 16 values; a row of 24"):
        encode_sglang_fp4_mx_block16(torch.ones(1, 24))


# --- fouroversix's nvfp4_4over6 ----------------------------------------------------------------------------
#: fouroversix 1.0.5's PyTorch reference (``fouroversix/quantize/pytorch/reference.py``, ``quantize_to_fp4`` with
#: its defaults: nvfp4, ``ScaleRule.mse``, round to nearest; scales unswizzled) and its ``dequantize`` to float32,
#: on ``_kv()`` as ``[96, 128]`` rows: packed codes, E4M3 scales, values (sha256, first 16 hex digits). Generated
#: once by running the v1.0.5 tag's Python source on torch 2.13.0 (CPU): its sdist does not build without CUDA, so it
#: cannot be a test dependency.
FOUROVERSIX_PINNED = ("9a1c9846258b6405", "e82d1dc86e15c71f", "574cdb8ef3883053")


def test_nvfp4_4over6_matches_the_pinned_fouroversix_reference():
    x = _kv().reshape(-1, 128)
    rows = encode_nvfp4_4over6(x)
    assert rows.global_scale.item() == x.abs().max().item() and rows.nbytes == 96 * 72 + 4
    assert (_digest(rows.codes), _digest(rows.scales), _digest(decode_rows(rows))) == FOUROVERSIX_PINNED


def test_nvfp4_4over6_keeps_the_max_over_6_scale_on_a_tie_and_reads_back_through_amax():
    # amax 4: 1536 / 4 = 384; /6 scale 4 / 6 * 384 = 256 (0x78), /4 scale 384: both code [4, 1, 1, -1] exactly,
    # so the errors tie and /6 stays: 4 -> 6 (code 7), 1 -> 1.5 (3), -1 -> -1.5 (0xB); (6 * 256) * 4 / 1536 = 4
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([4.0, 1.0, 1.0, -1.0])
    rows = encode_nvfp4_4over6(x)
    assert rows.codes.tolist() == [[0x37, 0xB3, 0, 0, 0, 0, 0, 0]] and rows.scales.tolist() == [[0x78]]
    assert decode_rows(rows).tolist() == x.tolist()
    zeros = encode_nvfp4_4over6(torch.zeros(2, 16))  # amax 0: scales 0, codes 0, values 0
    assert zeros.scales.unique().tolist() == [0] and zeros.codes.unique().tolist() == [0]
    assert torch.equal(decode_rows(zeros), torch.zeros(2, 16))


def test_nvfp4_4over6_follows_the_reference_where_a_subnormal_scale_overflows_e2m1():
    # amax 1536: block 2 (0.0175 each) gets the /6 scale 0.0175 / 6 = 0.0029 -> E4M3 subnormal 2**-9 (code 1),
    # 0.0175 / 2**-9 = 8.96 -> the reference rounds it to 8, which its bfloat16 packer stores as code 8 (-0):
    # the block reads back as -0 (the /4 candidate, 4 * 2**-8, ties on error and loses)
    x = torch.zeros(1, 32)
    x[0, 0] = 1536.0
    x[0, 16:] = 0.0175
    rows = encode_nvfp4_4over6(x)
    assert rows.codes.tolist() == [[7] + [0] * 7 + [0x88] * 8] and rows.scales.tolist() == [[120, 1]]
    values = decode_rows(rows)
    assert values[0, 0].item() == 1536.0 and values[0, 1:].abs().max().item() == 0.0
    assert torch.signbit(values[0, 16:]).all()
