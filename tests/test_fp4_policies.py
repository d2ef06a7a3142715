"""``fp4(format=nvfp4|mxfp4)`` and ``mxfp8`` as KV-cache quantizers: bytes planned == measured on every architecture
family, batch 3 == batch 1, the K/V the attention reads bit for bit :mod:`kveval.tensors.microscaling`'s codes
(pinned to torchao 0.18 in tests/test_microscaling.py; against torchao itself on SmolLM2's real K/V where it is
installed), the direction of the loss, and the refusals, in one line, before the weights load."""

from __future__ import annotations

import pytest
import torch
from cache_runs import (
    assert_one_batch_equals_batch_size_one,
    assert_one_line_error,
    assert_shared_prefill_equals_own_runs,
    context_then_steps,
    logit_errors,
    prefill,
    random_ids,
    random_prompts,
)
from tiny_models import Tok, tiny_model

from kveval.errors import PolicySpecError, UsageError
from kveval.planner.memory import plan
from kveval.policies.spec import parse_policy
from kveval.runner.runspec import RunSpec
from kveval.stores.quantized import QuantizedSequence
from kveval.tensors.microscaling import FORMATS, decode_kv, encode_kv, nvfp4_global_scale
from kveval.tensors.quant_format import TensorQuant

SPECS = ["fp4(format=nvfp4)", "fp4(format=mxfp4,k_axis=channel,residual=5)", "mxfp8(axis=channel)",
         "fp4(format=nvfp4,axis=channel,v_axis=token,residual=3)"]
#: Architecture families, with tiny widths that are whole blocks of 32 (the defaults of V3.2 and V4's indexer are
#: not: they are the refusals' cases below).
FAMILIES = {
    "llama": {},  # per-head K/V, head_dim 32
    "deepseek_v3": {},  # MLA: latent 32 as K, RoPE key 32 as V
    "deepseek_v32": {"kv_lora_rank": 32, "qk_rope_head_dim": 32, "index_head_dim": 32},  # latent, RoPE key, indexer
    "deepseek_v4": {"index_head_dim": 32},  # window, CSA/HCA entries, indexer (head 32)
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_is_the_bytes_the_cache_measures(family):
    """50 tokens then 7 decode steps (bfloat16 cache), and on V4 part by part: codes, one-byte block scales, NVFP4's
    FP32 per-tensor scale per layer, K and V (per part on V3.2/V4), and the residual in the cache dtype."""
    model = tiny_model(family, **FAMILIES[family])
    for spec in SPECS:
        _, cache = context_then_steps(model, spec, random_ids(50, 1), random_ids(7, 2), kv_dtype=torch.bfloat16)
        measured = cache.stats()
        planned = plan(model.config, 50, policy=parse_policy(spec), dtype_bytes=2, new_tokens=7)
        state = sum(p.bytes for p in planned.parts if p.name == "state")
        assert planned.sequence_bytes - state == measured.kv_bytes, (family, spec)
        assert {p.name: p.bytes for p in planned.parts if p.name != "state"} == measured.parts, (family, spec)
        if family != "deepseek_v4" or "channel" not in spec:  # V4's parts hold fewer entries than a block of tokens
            assert measured.kv_bytes < measured.nominal_bytes, (family, spec)


def test_bytes_per_token_are_the_formats():
    """SmolLM2-135M (30 layers, 3 KV heads of 64): NVFP4 64/2 + 64/16 = 36 bytes a head row, MXFP4 34, MXFP8 66,
    and NVFP4's 4-byte global scale per layer, K and V (240 bytes a sequence, whatever its length)."""
    rows = 30 * 3 * 2  # layers x KV heads x (K, V)
    for spec, per_row, fixed in (("fp4(format=nvfp4)", 36, 30 * 2 * 4), ("fp4(format=mxfp4)", 34, 0),
                                 ("mxfp8", 66, 0)):
        for context in (100, 1000):
            assert plan("smollm2-135m", context, policy=parse_policy(spec)).sequence_bytes == \
                context * rows * per_row + fixed, spec


@pytest.mark.parametrize("spec", ["fp4(format=nvfp4)", "fp4(format=mxfp4,k_axis=channel,residual=4)",
                                  "mxfp8(residual=2)"])
def test_a_batch_gives_batch_size_ones_answers(spec):
    """NVFP4's per-sequence global scale decodes its rows one by one; MXFP4/MXFP8 through the batched decode."""
    assert_one_batch_equals_batch_size_one(tiny_model("llama"), Tok(), random_prompts([(30, 3), (17, 2), (41, 4)], seed=6),
                                           spec, max_new_tokens=4)


def test_a_batch_gives_batch_size_ones_answers_on_mla():
    assert_one_batch_equals_batch_size_one(tiny_model("deepseek_v3"), Tok(), random_prompts([(30, 3), (17, 2), (41, 4)], seed=7),
                                           "fp4(format=nvfp4,k_axis=channel)", max_new_tokens=3)


def test_a_sweeps_shared_prefill_gives_each_format_its_own_runs():
    """Derived from one uncompressed prefill, each format (NVFP4's global scale included) answers as alone."""
    assert_shared_prefill_equals_own_runs(tiny_model("llama"), Tok(), random_prompts([(30, 3), (17, 2)], seed=9),
                                          ["none", "fp4(format=nvfp4)", "fp4(format=mxfp4,k_axis=channel,residual=4)",
                                           "mxfp8"], max_new_tokens=3)


def _held(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.layers[layer].rows[0].store.keys_values()


def _reference(x: torch.Tensor, fmt: str, axis: str, residual: int) -> torch.Tensor:
    """``x`` (``[H, T, D]``, the cache dtype's values) as the store must hold it: the tokens past the residual window
    (whole blocks of tokens along channels) coded by microscaling's encode_kv/decode_kv against NVFP4's global scale
    of the whole prefill, the rest as they are."""
    found = FORMATS[fmt]
    aged = max(0, x.shape[1] - residual)
    if axis == "channel":
        aged = aged // found.block * found.block
    scale = nvfp4_global_scale(x.float().abs().amax()) if found.global_scale else None
    coded = decode_kv(encode_kv(x[:, :aged].float(), found, axis, scale), axis)
    return torch.cat([coded, x[:, aged:].float()], dim=1)


@pytest.mark.parametrize("spec,fmt,k_axis,v_axis,residual", [
    ("fp4(format=nvfp4)", "nvfp4", "token", "token", 0),
    ("fp4(format=mxfp4,k_axis=channel,residual=5)", "mxfp4", "channel", "token", 5),
    ("mxfp8(axis=channel,residual=3)", "mxfp8", "channel", "channel", 3),
    ("fp4(format=nvfp4,k_axis=channel,residual=7)", "nvfp4", "channel", "token", 7),
])
def test_attention_reads_the_codecs_values_bit_for_bit(spec, fmt, k_axis, v_axis, residual):
    model = tiny_model("llama")
    ids = random_ids(70, 3)
    dense = prefill(model, "none", ids, kv_dtype="bfloat16")
    coded = prefill(model, spec, ids, kv_dtype="bfloat16")
    for layer in range(model.config.num_hidden_layers):
        (k, v), (ck, cv) = _held(dense, layer), _held(coded, layer)
        assert torch.equal(ck, _reference(k, fmt, k_axis, residual).to(ck.dtype))
        assert torch.equal(cv, _reference(v, fmt, v_axis, residual).to(cv.dtype))


def test_nvfp4_keeps_the_prefills_global_scale_and_saturates_past_it():
    """The per-tensor scale is fixed from the tokens held at the first seal; a later token 10x larger saturates its
    block (E4M3 scale 448, E2M1 6): it reads back as the prefill's largest magnitude, not its own."""
    seq = QuantizedSequence(TensorQuant.microscaled("nvfp4", "token"), 0, torch.float32)
    first = torch.zeros(1, 2, 16)
    first[0, 0, 0] = 3.0
    seq.append(first)
    seq.seal()
    assert float(seq.global_scale) == float(nvfp4_global_scale(3.0))
    late = torch.zeros(1, 1, 16)
    late[0, 0, 0] = 30.0
    seq.append(late)
    seq.seal()
    assert float(seq.global_scale) == float(nvfp4_global_scale(3.0))
    assert float(seq.materialize()[0, 2, 0]) == 3.0
    assert seq.nbytes == 3 * (8 + 1) + 4  # codes and a block scale per token, one FP32 global scale


def test_an_all_zero_tensor_codes_zeros_and_stays_finite():
    """torchao's global scale of an all-zero tensor is 0 (0 / 0 in the block scales); the cache takes 1.0."""
    seq = QuantizedSequence(TensorQuant.microscaled("nvfp4", "token"), 0, torch.float32)
    seq.append(torch.zeros(2, 3, 32))
    seq.seal()
    assert float(seq.global_scale) == 1.0
    assert torch.equal(seq.materialize(), torch.zeros(2, 3, 32))
    seq.append(torch.full((2, 1, 32), 2.0))
    seq.seal()
    assert torch.isfinite(seq.materialize()).all()


def test_fp4_loses_more_than_mxfp8():
    model = tiny_model("llama")
    none, nvfp4, mxfp4, mxfp8 = logit_errors(model, ["none", "fp4(format=nvfp4)", "fp4(format=mxfp4)", "mxfp8"],
                                              random_ids(60, 4), random_ids(5, 5), kv_dtype="bfloat16")
    assert none == 0
    assert 0 < mxfp8 < min(nvfp4, mxfp4), (mxfp8, nvfp4, mxfp4)
    assert nvfp4 < mxfp4, (nvfp4, mxfp4)  # blocks of 16 with E4M3 scales fit a block closer than 32 with powers of two


@pytest.mark.parametrize("spec,message", [
    ("fp4(format=int4)", "format='int4' must be one of nvfp4, mxfp4"),
    ("fp4(axis=rows)", "axis='rows' must be one of token, channel"),
    ("mxfp8(residual=-1)", "residual=-1 must be a number of tokens"),
    ("fp4(axis=channel,k_axis=token,v_axis=token)", "axis= does nothing beside k_axis= and v_axis="),
    ("mxfp8(format=mxfp8)", "mxfp8 has no parameter 'format'"),
])
def test_bad_specs_are_one_line_errors(spec, message):
    assert_one_line_error(lambda: parse_policy(spec), PolicySpecError, message)


@pytest.mark.parametrize("family,config,spec,message", [
    ("llama", {"head_dim": 24}, "fp4(format=nvfp4)", "the k head_dim 24 is not a whole number of blocks"),
    ("llama", {"head_dim": 48}, "fp4(format=mxfp4,k_axis=channel)", "the v head_dim 48 is not a whole number"),
    ("deepseek_v3", {"qk_rope_head_dim": 8}, "fp4(format=nvfp4)", "the v RoPE key width 8 is not a whole number"),
    ("deepseek_v32", {}, "fp4(format=nvfp4)", "the v RoPE key width 8 is not a whole number"),
    ("deepseek_v32", {"qk_rope_head_dim": 16}, "mxfp8", "the k latent width 16 is not a whole number"),
    ("deepseek_v4", {}, "fp4(format=mxfp4)", "the k indexer width 16 is not a whole number"),
])
def test_a_width_that_is_not_whole_blocks_is_refused_before_the_weights_load(family, config, spec, message):
    """On the config alone (what the runner checks before loading weights) and by the planner, in one line."""
    model_config = tiny_model(family, **config).config
    assert_one_line_error(lambda: RunSpec(parse_policy(spec)).for_model(model_config), UsageError, message)
    assert_one_line_error(lambda: plan(model_config, 100, policy=parse_policy(spec)), UsageError, "whole number|divide")


def test_the_cli_refuses_it_in_one_line_before_the_weights_load(tmp_path, capsys, monkeypatch):
    from test_architectures import _save_with_tokenizer

    from kveval.commands.main import main
    from kveval.runner import models

    _save_with_tokenizer(tiny_model("llama", head_dim=24), tmp_path)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7", "--policy", "fp4(format=nvfp4)"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "head_dim 24 is not a whole number of blocks" in err[0], err


def test_blocks_along_tokens_take_any_head_width():
    """Along channels the blocks run over tokens: head_dim 24 is fine for both K and V."""
    model = tiny_model("llama", head_dim=24)
    spec = "fp4(format=nvfp4,axis=channel,residual=2)"
    RunSpec(parse_policy(spec)).for_model(model.config)
    _, cache = context_then_steps(model, spec, random_ids(40, 1), random_ids(3, 2), kv_dtype=torch.bfloat16)
    assert plan(model.config, 40, policy=parse_policy(spec), dtype_bytes=2, new_tokens=3).sequence_bytes == \
        cache.stats().kv_bytes


def test_an_indexer_term_takes_the_indexer_out_of_the_width_check():
    """V4's default tiny indexer (16 wide) refuses mxfp4 blocks of 32; with indexer=fp8 the indexer is DeepSeek's."""
    model = tiny_model("deepseek_v4")
    spec = "fp4(format=mxfp4,indexer=fp8)"
    _, cache = context_then_steps(model, spec, random_ids(37, 1), random_ids(5, 2), kv_dtype=torch.float32)
    planned = plan(model.config, 37, policy=parse_policy(spec), dtype_bytes=4, new_tokens=5)
    assert {p.name: p.bytes for p in planned.parts if p.name != "state"} == cache.stats().parts


def test_memory_command_plans_the_formats(capsys):
    from kveval.commands.main import main

    assert main(["memory", "smollm2-135m", "--context", "100", "--policy", "fp4(format=nvfp4)"]) == 0
    out = capsys.readouterr().out
    assert "633.05 KiB per sequence" in out  # 100 x 180 x 36 + 240 bytes
    assert main(["memory", "deepseek-v4-flash", "--context", "128k", "--policy", "fp4(format=mxfp4)"]) == 0
    assert "mxfp4/32" in capsys.readouterr().out


# --- SmolLM2's real K/V against torchao 0.18 itself ---------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    from kveval.runner.models import load_model

    return load_model("smollm2-135m")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_smollm2_kv_is_torchao_bit_for_bit(smollm2, fmt):
    """One short prompt's K/V in every layer, coded by the policy along tokens: what the cache holds is torchao's
    dequantized tensor (NVFP4 with ``per_tensor_amax_to_scale`` of the layer's K or V) in the compute dtype."""
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer("The capital of France is Paris, and the capital of Italy is")["input_ids"]])
    spec = "mxfp8" if fmt == "mxfp8" else f"fp4(format={fmt})"
    dense, coded = prefill(model, "none", ids, "bfloat16"), prefill(model, spec, ids, "bfloat16")

    def torchao(x: torch.Tensor) -> torch.Tensor:
        rows = x.float().reshape(-1, x.shape[-1]).contiguous()
        if fmt == "nvfp4":
            scale = per_tensor_amax_to_scale(rows.abs().amax())
            values = NVFP4Tensor.to_nvfp4(rows, per_tensor_scale=scale).dequantize(torch.float32)
        else:
            element = torch.float4_e2m1fn_x2 if fmt == "mxfp4" else torch.float8_e4m3fn
            scales, codes = to_mx(rows, element, 32)
            values = to_dtype(codes, scales, element, 32, torch.float32)
        return values.reshape(x.shape)

    for layer in range(model.config.num_hidden_layers):
        for held, expected in zip(_held(coded, layer), _held(dense, layer)):
            assert torch.equal(held, torchao(expected).to(held.dtype)), (fmt, layer)
