"""DeepSeek's per-token records as vLLM 0.33 writes them (``fp8_ds_mla``, ``nvfp4_ds_mla``) and V4.1's storage recipe
on V4's parts (``deepseek_v41_storage``).

vLLM's writers are Triton kernels that do not run on a CPU, so the reference here is a line-by-line transcription of
them (``ref_*``, each naming its kernel in vLLM 0.33.0), with its own E2M1 rounding (nearest on the grid, ties to the
even code) and vLLM's byte order; kveval's codecs (:mod:`kveval.tensors.ds_records`) are built on
:mod:`kveval.tensors.microscaling` and order a token's bytes their own way. Both must give the same bytes, scales and
dequantized values, on random and edge-case rows (all-zero tiles, one outlier, values beyond E2M1's and E4M3's range).
On tiny DeepSeek V3.2 and V4 models with the real widths (a 512-value latent or entry, 64 RoPE dims, 128-value indexer
keys): planned == measured, batch 3 == batch 1, the stored records are the codec's; refused in one line before the
weights load where they cannot apply.
"""

import pytest
import torch

from kveval.errors import PolicySpecError, UnsupportedModelError, UsageError
from kveval.planner.memory import plan
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate
from kveval.runner.runspec import RunSpec
from kveval.tensors import ds_records as dsr

from cache_runs import context_then_steps, random_ids
from tiny_models import Tok, tiny_model

FP8 = "vllm(kv_cache_dtype=fp8_ds_mla)"
NVFP4 = "vllm(kv_cache_dtype=nvfp4_ds_mla)"
V41 = "deepseek_v41_storage"
FP8_MXFP4 = "vllm(kv_cache_dtype=fp8_ds_mla,indexer_kv_dtype=mxfp4)"
#: The real widths on tiny models: V3.2's latent 512 + RoPE key 64, V4's 512-wide entries with 64 RoPE dims, and the
#: indexer's 128-wide keys (vLLM's records are written for these alone).
V32_WIDTHS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
V4_WIDTHS = dict(head_dim=512, qk_rope_head_dim=64, index_head_dim=128)
F32 = torch.float32


# --- the reference: vLLM 0.33.0's kernels, transcribed ---------------------------------------------------------------
def _e4m3(x):
    """Triton's fp32 -> float8e4nv (round to nearest even, saturating), as bits."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1(x):
    """``cvt.rn.satfinite.e2m1x2.f32``: nearest grid magnitude (ties to the even code), saturating at 6, sign kept."""
    a = x.abs().clamp(max=6.0).unsqueeze(-1)
    distance = (a - _GRID).abs()
    best = distance.min(dim=-1, keepdim=True).values
    ties = distance == best
    codes = torch.arange(8)
    even_first = torch.where(ties & (codes % 2 == 0), codes, 99).min(dim=-1).values
    any_first = torch.where(ties, codes, 99).min(dim=-1).values
    magnitude = torch.where((ties.sum(-1) > 1), even_first, any_first).to(torch.uint8)
    return magnitude | (torch.signbit(x).to(torch.uint8) << 3)


def _pack(nibbles):
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def ref_v32_fp8(latent, rope):
    """``models/deepseek_v32/common/kernels.py`` ``_fused_norm_rope_kernel``, ``MLA_CACHE_DS_MLA``: 656 bytes."""
    tiles = latent.float().reshape(-1, 4, 128)
    tile_scale = torch.maximum(tiles.abs().amax(-1, keepdim=True) * torch.tensor(1.0 / 448.0), torch.tensor(1e-4))
    tile_scale = torch.exp2(torch.ceil(torch.log2(tile_scale)))
    codes = _e4m3(tiles / tile_scale).reshape(-1, 512)
    return torch.cat([codes, tile_scale.reshape(-1, 4).contiguous().view(torch.uint8),
                      rope.to(torch.bfloat16).contiguous().view(torch.uint8)], -1)


def ref_v32_nvfp4(latent, rope):
    """The same kernel, ``MLA_CACHE_NVFP4``: 352 bytes (codes, RoPE in e4m3, permuted scales)."""
    tiles = latent.float().reshape(-1, 32, 16)
    sf8 = _e4m3(torch.maximum(tiles.abs().amax(-1, keepdim=True) * torch.tensor(1.0 / 6.0), torch.tensor(0.001953125)))
    q = tiles * (1.0 / sf8.view(torch.float8_e4m3fn).float())
    scales = torch.empty(latent.shape[0], 32, dtype=torch.uint8)
    s = torch.arange(32)
    scales[:, 8 * (s % 4) + s // 4] = sf8.reshape(-1, 32)
    return torch.cat([_pack(_e2m1(q.reshape(-1, 512))), _e4m3(rope.float()), scales], -1)


def ref_v4_entry(x):
    """``models/deepseek_v4/common/ops/fused_compress_quant_cache.py``
    ``_fused_kv_compress_norm_rope_insert_sparse_attn``: 448 fp8 + 128 bf16 RoPE bytes, then 7 UE8M0 + a pad byte."""
    quant = x.to(torch.bfloat16).float()[:, :448].reshape(-1, 7, 64)
    absmax = torch.maximum(quant.abs().amax(-1), torch.tensor(1e-4))
    exponents = torch.ceil(torch.log2(absmax * torch.tensor(1.0 / 448.0)))
    fp8 = _e4m3((quant * torch.exp2(-exponents).unsqueeze(-1)).clamp(-448, 448)).reshape(-1, 448)
    scales = (exponents + 127).clamp(0, 255).to(torch.uint8)
    rope = x[:, 448:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([fp8, rope], -1), torch.cat([scales, torch.zeros(len(x), 1, dtype=torch.uint8)], -1)


def ref_v32_indexer(x):
    """``kernels.py`` ``_fp8_ue8m0_quantize``: one tile, ``div_rn``, a float32 power of two."""
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.maximum(amax, torch.tensor(1e-4)) / 448.0)))
    return torch.cat([_e4m3(x.float() / scale), scale.contiguous().view(torch.uint8)], -1)


def ref_v41_window(x):
    """``models/deepseek_v41/common/ops/fused_compress_quant_cache.py`` ``_rope_quant_insert_mxfp8_kernel``."""
    quant = x.to(torch.bfloat16).float().reshape(-1, 16, 32)
    amax = torch.maximum(quant.abs().amax(-1), torch.tensor(1e-4))
    exponent = torch.ceil(torch.log2(amax * torch.tensor(1.0 / 448.0)))
    fp8 = _e4m3((quant * torch.exp2(-exponent).unsqueeze(-1)).clamp(-448, 448)).reshape(-1, 512)
    return torch.cat([fp8, (exponent + 127).clamp(0, 255).to(torch.uint8)], -1)


def ref_v41_entry(x):
    """The same file, ``_rope_quant_insert_nvfp4_kernel``: 288 bytes."""
    tiles = x.to(torch.bfloat16).float().reshape(-1, 32, 16)
    scale = _e4m3((tiles.abs().amax(-1) * torch.tensor(1.0 / 6.0)).clamp(0.001953125, 448.0))
    scaled = tiles / scale.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    return torch.cat([_pack(_e2m1(scaled.reshape(-1, 512))), scale], -1)


def ref_v41_indexer(x):
    """``models/deepseek_v41/common/ops/indexer_k_store.py``, ``USE_FP4`` (and V4's
    ``_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn``): a bfloat16 round trip, 64 packed bytes, 4 UE8M0."""
    blocks = x.to(torch.bfloat16).float().reshape(-1, 4, 32)
    amax = torch.maximum(blocks.abs().amax(-1), torch.tensor(6.0 * 2.0**-126))
    log2_ratio = torch.ceil(torch.log2(amax * torch.tensor(1.0 / 6.0))).clamp(-127, 127)
    packed = _pack(_e2m1((blocks * torch.exp2(-log2_ratio).unsqueeze(-1)).reshape(-1, 128)))
    return torch.cat([packed, (log2_ratio + 127).to(torch.uint8)], -1)


# --- rows: random, and the edge cases --------------------------------------------------------------------------------
def _rows(width: int, seed: int = 0) -> torch.Tensor:
    """Random rows with a spread of magnitudes, then the edge cases in the first rows: an all-zero row, one outlier
    among small values, values beyond E2M1's and E4M3's range, tiny values, negative zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, width, generator=g) * torch.exp2(torch.randint(-6, 6, (40, 1), generator=g).float())
    x[0] = 0.0
    x[1] = torch.randn(width, generator=g) * 1e-2
    x[1, 5] = 300.0
    x[2] = torch.randn(width, generator=g) * 1e4  # past 448 x 6 = 2688: NVFP4's scales and values saturate
    x[3] = torch.randn(width, generator=g) * 1e-6  # below the 1e-4 floor
    x[4] = -0.0
    return x


def test_the_records_have_the_engines_sizes():
    assert dsr.V32_FP8_LATENT.row_bytes(512) + dsr.Bfloat16Values().row_bytes(64) == 656
    assert dsr.V32_NVFP4_LATENT.row_bytes(512) + dsr.E4m3Values().row_bytes(64) == 352
    assert dsr.V4_ENTRY.row_bytes(512) == 584
    assert dsr.V32_INDEXER.row_bytes(128) == dsr.V4_INDEXER.row_bytes(128) == 132
    v41 = (dsr.V41_WINDOW.row_bytes(512), dsr.V41_ENTRY.row_bytes(512), dsr.V41_INDEXER.row_bytes(128))
    assert v41 == (528, 288, 68)


def test_v32_fp8_ds_mla_is_the_kernels_record():
    latent, rope = _rows(512), _rows(64, 1)
    ours = torch.cat([dsr.V32_FP8_LATENT.encode(latent), dsr.Bfloat16Values().encode(rope)], -1)
    assert torch.equal(ours, ref_v32_fp8(latent, rope))  # the same bytes in the same order
    scales = dsr.V32_FP8_LATENT.scales(ours, 512)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)  # powers of two
    decoded = dsr.V32_FP8_LATENT.decode(ours, 512)
    assert torch.equal(decoded[0], torch.zeros(512))
    assert float(decoded[1, 5]) == 288.0  # the outlier: its tile's scale is 1, and e4m3 rounds 300 to 288
    relative = (decoded[5:] - latent[5:]).abs().max() / latent[5:].abs().max()
    assert 0 < relative <= 2**-4  # e4m3: 3 mantissa bits


def test_v32_nvfp4_ds_mla_is_the_kernels_record():
    latent, rope = _rows(512), _rows(64, 1) / 100
    coded = dsr.V32_NVFP4_LATENT.encode(latent)
    rope_codes = dsr.E4m3Values().encode(rope)
    reference = ref_v32_nvfp4(latent, rope)
    # vLLM: codes (256) | RoPE (64) | scales (32); kveval: the latent's codes and scales, the RoPE key apart
    assert torch.equal(torch.cat([coded[:, :256], rope_codes, coded[:, 256:]], -1), reference)
    decoded = dsr.V32_NVFP4_LATENT.decode(coded, 512)
    assert torch.equal(decoded[0], torch.zeros(512))
    assert float(decoded[2].abs().max()) == 6.0 * 448.0  # the saturated block: scale 448, value 6
    assert torch.signbit(decoded[4]).all()  # -0.0 keeps its sign bit (code 8)


def test_v4_fp8_ds_mla_is_the_kernels_record():
    x = _rows(512)
    x[6, 448:] = 1e5  # RoPE dims are bf16: never saturated
    ours = dsr.V4_ENTRY.encode(x)
    values, scales = ref_v4_entry(x)
    # kveval: 448 codes, 7 scales and the pad, then the 128 RoPE bytes; vLLM: values (448 + 128), scales apart
    assert torch.equal(torch.cat([ours[:, :448], ours[:, 456:]], -1), values)
    assert torch.equal(ours[:, 448:456], scales)
    decoded = dsr.V4_ENTRY.decode(ours, 512)
    assert torch.equal(decoded[:, 448:], x[:, 448:].to(torch.bfloat16).float())
    assert torch.equal(decoded[0], torch.zeros(512))


@pytest.mark.parametrize("codec, reference, width", [
    (dsr.V32_INDEXER, ref_v32_indexer, 128),
    (dsr.V41_WINDOW, ref_v41_window, 512),
    (dsr.V41_ENTRY, ref_v41_entry, 512),
    (dsr.V41_INDEXER, ref_v41_indexer, 128),
])
def test_indexer_and_v41_records_are_the_kernels(codec, reference, width):
    x = _rows(width, 3)
    coded = codec.encode(x)
    assert torch.equal(coded, reference(x))
    assert coded.shape[-1] == codec.row_bytes(width)
    decoded = codec.decode(coded, width)
    assert torch.equal(decoded[0], torch.zeros(width))
    assert (decoded[5:] - x[5:]).abs().max() < x[5:].abs().max()  # a coding, not noise


def test_the_v4_indexer_rounds_its_input_to_bfloat16_and_v32s_does_not():
    # Scale 2**-8; x / s sits just below e4m3's midpoint 304 (between 288 and 320): read directly it rounds to 288,
    # rounded to bfloat16 first it is the midpoint, which goes to the even code, 320.
    x = torch.full((1, 128), 1.1875 - 2.0**-12)
    assert float(dsr.V4_INDEXER.decode(dsr.V4_INDEXER.encode(x), 128)[0, 0]) == 1.25
    assert float(dsr.V32_INDEXER.decode(dsr.V32_INDEXER.encode(x), 128)[0, 0]) == 1.125
    assert not torch.equal(dsr.V4_INDEXER.decode(dsr.V4_INDEXER.encode(x), 128),
                           dsr.V32_INDEXER.decode(dsr.V32_INDEXER.encode(x), 128))


def test_a_scale_at_a_power_of_two_is_that_power():
    """``ceil(log2(t))`` exactly: an amax of exactly 448 x 2**k gives scale 2**k (the largest value codes 448)."""
    x = torch.zeros(1, 128)
    x[0, 0] = 448.0 * 4
    coded = dsr.V32_INDEXER.encode(x)
    assert float(dsr.V32_INDEXER.scales(coded, 128)) == 4.0
    assert float(dsr.V32_INDEXER.decode(coded, 128)[0, 0]) == 448.0 * 4
    assert torch.equal(dsr.ceil_log2(torch.tensor([1.0, 1.0 + 2**-23, 0.75, 2.0**-140])),
                       torch.tensor([0.0, 1.0, 0.0, -140.0]))


def test_a_width_that_is_not_whole_blocks_is_refused():
    with pytest.raises(UsageError, match="a row of 100 is not a whole number"):
        dsr.V41_ENTRY.encode(torch.ones(1, 100))
    with pytest.raises(UsageError, match="a row of 120 is not a whole number"):
        dsr.V32_FP8_LATENT.encode(torch.ones(1, 120))


# --- on tiny models: planned == measured, batch 3 == batch 1, the stored records ------------------------------------
CASES = [("deepseek_v32", V32_WIDTHS, FP8), ("deepseek_v32", V32_WIDTHS, NVFP4), ("deepseek_v4", V4_WIDTHS, FP8),
         ("deepseek_v4", V4_WIDTHS, V41), ("deepseek_v4", V4_WIDTHS, FP8_MXFP4), ("glm_moe_dsa", V32_WIDTHS, FP8)]


@pytest.mark.parametrize("name, widths, spec", CASES)
def test_planned_is_measured_on_tiny_models_with_the_real_widths(name, widths, spec):
    model = tiny_model(name, **widths)
    for context, steps in ((37, 5), (50, 13)):
        planned = plan(model.config, context, new_tokens=steps, dtype_bytes=4, policy=parse_policy(spec))
        _, cache = context_then_steps(model, spec, random_ids(context, 1), random_ids(steps, 2), kv_dtype=F32)
        stats = cache.stats()
        parts = {p.name: p.bytes for p in planned.parts if p.name != "state"}
        assert parts == stats.parts, (context, steps)
        assert planned.sequence_bytes == stats.kv_bytes + sum(p.bytes for p in planned.parts if p.name == "state")
    tokens = 63
    expected = {FP8: {"latent": 656, "indexer": 132}, NVFP4: {"latent": 352, "indexer": 132}}
    if name == "glm_moe_dsa":  # its second layer reuses the first's top-k and keeps no indexer keys
        assert stats.parts == {"latent": 3 * tokens * 656, "indexer": 2 * tokens * 132}
    elif name == "deepseek_v32":  # both layers hold every token: the record per token and layer
        assert stats.parts == {k: 2 * tokens * v for k, v in expected[spec].items()}
    else:  # V4: 584 (or 528 / 288 / 68) bytes an entry
        entry, window, indexer = {FP8: (584, 584, 132), FP8_MXFP4: (584, 584, 68), V41: (288, 528, 68)}[spec]
        assert stats.parts == {"window": 3 * 7 * window, "csa": tokens // 4 * entry, "indexer": tokens // 4 * indexer,
                               "hca": tokens // 16 * entry}


@pytest.mark.parametrize("name, widths, spec", CASES)
def test_batch_of_three_gives_each_rows_answers_alone(name, widths, spec):
    model = tiny_model(name, **widths)
    prompts = [Prompt(random_ids(n, 10 + n)[0].tolist(), list(range(5, 5 + q))) for n, q in ((40, 3), (27, 1), (33, 4))]
    alone = [generate(model, Tok(), [p], parse_policy(spec), max_new_tokens=5)[0] for p in prompts]
    together = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=5, batch_size=3)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert (a.stats.kv_bytes, a.stats.parts) == (b.stats.kv_bytes, b.stats.parts)


def test_the_cache_holds_the_records_and_attention_reads_them_decoded():
    """V3.2's store holds a 528-byte latent row (codes and scales) and a 128-byte RoPE row a token, and reads back
    their decoding; V4's CSA part holds 288-byte records (V4.1's recipe) and reads back theirs."""
    model = tiny_model("deepseek_v32", **V32_WIDTHS)
    _, cache = context_then_steps(model, FP8, random_ids(20, 1), random_ids(2, 2), kv_dtype=F32)
    store = cache.layers[0].rows[0].store
    keys, values = store.keys_values()
    assert (store.k.shape[-1], store.v.shape[-1], store.length) == (528, 128, 22)
    assert torch.equal(keys, dsr.V32_FP8_LATENT.decode(store.k, 512))
    assert torch.equal(values, dsr.Bfloat16Values().decode(store.v, 64))
    model = tiny_model("deepseek_v4", **V4_WIDTHS)
    _, cache = context_then_steps(model, V41, random_ids(40, 1), random_ids(2, 2), kv_dtype=F32)
    part = cache.layers[1].parts["csa"][0]
    records = part.coded.store.k
    assert records.shape == (1, 42 // 4, 288)
    assert torch.equal(part.read(512, "cpu"), dsr.V41_ENTRY.decode(records, 512))
    window = cache.layers[0].rows[0].store
    assert window.k.shape[-1] == 528 and window.v.shape[-1] == 0


def test_nvfp4_loses_more_than_fp8_and_both_lose_something():
    """The first layer's latent and RoPE key (the same input under every policy) as each record holds them, against
    the uncompressed cache's: NVFP4 (E2M1, e4m3 RoPE) is further off than FP8 (e4m3, bfloat16 RoPE)."""
    model = tiny_model("deepseek_v32", **V32_WIDTHS)
    context, steps = random_ids(30, 1), random_ids(4, 2)

    def first_layer(spec):
        return context_then_steps(model, spec, context, steps, kv_dtype=F32)[1].layers[0].rows[0].store.keys_values()

    base = first_layer("none")
    error = {spec: [float((held - exact).abs().max() / exact.abs().max())
                    for held, exact in zip(first_layer(spec), base)] for spec in (FP8, NVFP4)}
    for latent_or_rope in (0, 1):
        assert 0 < error[FP8][latent_or_rope] < error[NVFP4][latent_or_rope]
    assert error[FP8][0] <= 2**-4 and error[FP8][1] <= 2**-8  # e4m3 tiles; bfloat16


# --- refused in one line, before the weights load --------------------------------------------------------------------
@pytest.mark.parametrize("model, spec, message", [
    (("llama", {}), FP8, "llama caches per-head K/V, which vLLM codes with per-tensor FP8"),
    (("deepseek_v3", {"kv_lora_rank": 512, "qk_rope_head_dim": 64}), FP8,
     "serves the packed DeepSeek records on its sparse MLA backends only"),
    (("deepseek_v2", {"kv_lora_rank": 512, "qk_rope_head_dim": 64}), NVFP4, "sparse MLA backends only"),
    (("deepseek_v4", V4_WIDTHS), NVFP4, "packs DeepSeek V4's cache in fp8_ds_mla only"),
    (("deepseek_v32", {}), FP8, "written for a latent 512, RoPE key 64, indexer key 128 per token; DeepSeek V3.2 "
                                "has latent 16, RoPE key 8, indexer key 16"),
    (("deepseek_v32", V32_WIDTHS), V41, "codes DeepSeek V4's parts"),
    (("deepseek_v4", {}), V41, "codes blocks of 32 values; DeepSeek V4's indexer key of 16"),
    (("deepseek_v4", V4_WIDTHS), "vllm(kv_cache_dtype=fp8)", "use vllm\\(kv_cache_dtype=fp8_ds_mla\\)"),
    (("deepseek_v32", V32_WIDTHS), FP8_MXFP4, "on DeepSeek V3.2 use indexer_kv_dtype=fp8"),
])
def test_refused_in_one_line_before_the_weights_load(model, spec, message):
    import transformers

    from tiny_models import ARCHITECTURES, NATIVE_ARCHITECTURES, _BASE

    name, over = model
    config_class, _, overrides = {**ARCHITECTURES, **NATIVE_ARCHITECTURES}[name]
    config = getattr(transformers, config_class)(**{**_BASE, **overrides, **over})
    with pytest.raises(UnsupportedModelError, match=message) as refused:
        RunSpec(parse_policy(spec)).for_model(config)
    assert "\n" not in str(refused.value)


def test_the_planner_refuses_in_one_line_and_the_cli_exits_2(capsys):
    from kveval.commands.main import main

    assert main(["memory", "deepseek-v3", "--context", "8k", "--policy", FP8]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sparse MLA backends only" in err
    assert main(["memory", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "80GiB", "--max-model-len", "32k",
                 "--kv-cache-dtype", "nvfp4_ds_mla"]) == 2


def test_scales_are_the_records_own():
    with pytest.raises(PolicySpecError, match="computes its scales per token and tile"):
        parse_policy("vllm(kv_cache_dtype=fp8_ds_mla,scales=dynamic)")
    with pytest.raises(PolicySpecError, match="fp8_ds_mla, nvfp4_ds_mla"):
        parse_policy("vllm(kv_cache_dtype=fp4_ds_mla)")
    with pytest.raises(PolicySpecError, match="beside kv_cache_dtype=fp8_ds_mla"):
        parse_policy("vllm(kv_cache_dtype=nvfp4_ds_mla,indexer_kv_dtype=mxfp4)")
    with pytest.raises(PolicySpecError, match="must be one of fp8, mxfp4"):
        parse_policy("vllm(kv_cache_dtype=fp8_ds_mla,indexer_kv_dtype=int4)")


# --- the planner's figures -------------------------------------------------------------------------------------
def test_bytes_per_token_at_128k():
    """V3.2: 61 layers x (656 or 352 + 132); V4-Flash: 21 CSA layers at 1/4 (a 584-byte entry and a 132-byte FP8
    indexer key), 20 HCA at 1/128; V4.1's recipe: 288-byte entries and 68-byte MXFP4 indexer keys."""
    context = 128 * 1024
    per_token = {spec: plan("deepseek-v3.2", context, policy=parse_policy(spec)).bytes_per_token
                 for spec in (FP8, NVFP4)}
    assert per_token == {FP8: 61 * (656 + 132), NVFP4: 61 * (352 + 132)}
    v4 = {spec: plan("deepseek-v4-flash", context, policy=parse_policy(spec)).bytes_per_token
          for spec in (FP8, FP8_MXFP4, V41)}
    assert v4[FP8] == pytest.approx(21 * (584 + 132) / 4 + 20 * 584 / 128)
    assert v4[FP8_MXFP4] == pytest.approx(21 * (584 + 68) / 4 + 20 * 584 / 128)
    assert v4[V41] == pytest.approx(21 * (288 + 68) / 4 + 20 * 288 / 128)


@pytest.mark.parametrize("dtype", ["nvfp4", "int4_per_token_head", "turboquant_4bit_nc"])
def test_vllm_dtypes_v4_refuses_are_refused_as_vllm_refuses_them(dtype):
    """V4's packed layout takes fp8 only (vllm/models/deepseek_v4/attention.py _resolve_dsv4_kv_cache_dtype raises);
    V3.2's sparse MLA serves every other quantized dtype as fp8_ds_mla: two different refusals, each as vLLM does."""
    from kveval.errors import UsageError
    from kveval.planner.memory import plan

    with pytest.raises(UsageError, match="refuses --kv-cache-dtype .*fp8_ds_mla layout only supports fp8"):
        plan("deepseek-v4-flash", 4096, policy=parse_policy(f"vllm(kv_cache_dtype={dtype})"))
    with pytest.raises(UsageError, match="serves --kv-cache-dtype .* as its fp8_ds_mla record"):
        plan("deepseek-v3.2", 4096, policy=parse_policy(f"vllm(kv_cache_dtype={dtype})"))
