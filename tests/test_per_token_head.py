"""vLLM 0.33's per-token-head KV caches (kveval.tensors.per_token_head): codes, scales and values on rows worked out
by hand from vLLM's kernels (``_reshape_cache_per_token_head``, ``_reshape_cache_int4_kernel``, ``single_rht``).

vLLM's Triton kernels do not run on a CPU and vllm does not import without its GPU dependencies, so no live
reference runs here: every expected value below is derived in the comment beside it.
"""

import pytest
import torch

from kveval.errors import UsageError
from kveval.tensors.per_token_head import (
    bytes_per_token_head,
    dequantize_int4,
    dequantize_int8_fp8,
    quantize_int4,
    quantize_int8_fp8,
    rht_signs,
    single_rht,
)


def test_int8_rounds_half_away_from_zero_after_a_per_row_scale():
    # amax 127 -> scale 127 / 127 = 1; 127.5 clamps to 127; -63.5 - 0.5 = -64; +-0.25 +- 0.5 truncate to 0
    codes, scale = quantize_int8_fp8(torch.tensor([[127.0, -63.5, 0.25, -0.25, 0.0, -127.0]]), "int8")
    assert codes.view(torch.int8).tolist() == [[127, -64, 0, 0, 0, -127]] and scale.tolist() == [1.0]
    assert dequantize_int8_fp8(codes, scale, "int8").tolist() == [[127.0, -64.0, 0.0, 0.0, 0.0, -127.0]]


def test_a_zero_row_takes_the_scale_floor():
    codes, scale = quantize_int8_fp8(torch.zeros(2, 4), "int8")
    assert codes.unique().tolist() == [0] and torch.equal(scale, torch.full((2,), 1e-6))


def test_fp8_scales_each_row_to_448():
    # amax 896 -> scale 2: 448 (0x7E), 0.5 (0_0110_000 = 0x30), -1.5 (1_0111_100 = 0xBC), 0
    codes, scale = quantize_int8_fp8(torch.tensor([[896.0, 1.0, -3.0, 0.0]]), "fp8")
    assert codes.tolist() == [[0x7E, 0x30, 0xBC, 0x00]] and scale.tolist() == [2.0]
    assert dequantize_int8_fp8(codes, scale, "fp8").tolist() == [[896.0, 1.0, -3.0, 0.0]]


def test_rht_signs_are_vllms_fixed_draw_and_the_rotation_inverts():
    assert rht_signs(8).tolist() == [1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))  # 96 = 3 blocks of 32
    assert torch.allclose(single_rht(single_rht(x), inverse=True) / 32, x, atol=1e-6)
    # block-diagonal: the first block of 32 rotates alone
    assert torch.equal(single_rht(x)[:, :32], single_rht(x[:, :32]))


def test_int4_hides_the_zero_point_in_the_scale_and_reads_back_through_the_rotation():
    # D = 2, signs [1, -1]: [1, 2] -> d1 * x = [1, -2] -> H2 = [1 - 2, 1 + 2] = [-1, 3]
    # scale = 4 / 15; zp = round(1 / (4 / 15)) = round(3.75) = 4; codes: -3.75 + 4 = 0.25 -> 0, 11.25 + 4 -> 15
    packed, stored = quantize_int4(torch.tensor([[1.0, 2.0]]))
    assert packed.tolist() == [[0xF0]]  # element 0 low nibble, element 1 high
    bits = stored.view(torch.int32)
    assert (bits & 0xF).tolist() == [4]
    scale = torch.tensor([4.0 / 15.0])
    assert torch.equal(bits & -16, scale.view(torch.int32) & -16)
    # read back: (0 - 4, 15 - 4) * s = (-4s, 11s); H2 -> (7s, -15s); * d1 -> (7s, 15s); / 2 -> (3.5s, 7.5s)
    s = (bits & -16).view(torch.float32)
    assert torch.equal(dequantize_int4(packed, stored), torch.stack([3.5 * s, 7.5 * s], dim=-1))


def test_bytes_per_token_and_head():
    assert [bytes_per_token_head(k, 128) for k in ("int8", "fp8", "int4")] == [132, 132, 68]
    with pytest.raises(UsageError, match="odd"):
        bytes_per_token_head("int4", 65)
    with pytest.raises(UsageError, match="unknown per-token-head kind"):
        bytes_per_token_head("int2", 128)
