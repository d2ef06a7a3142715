"""DeepSeek-V4.1 in the planner, memory against concurrency, and DeepSeek deployments planned as the engines serve them.

Published figures pinned here, each with the storage it depends on:

* DeepSeek-V4.1-Flash: about 890 bytes per token of global KV, about 1/4 of V4-Flash. Reproduced with only the
  ``kv_source_layer_ids`` [2, 8, 14, 20] storing compressed entries (3 at one entry per 2 tokens, 1 at one per token)
  and the indexer keys beside them, the entries in FP4 after RoPE with an E4M3 scale per 16 (288 B of 512 values),
  the indexer keys in FP4 with a UE8M0 scale per 32 (68 B of 128): 3 x (288 + 68) / 2 + (288 + 68) = 890 B. Against
  V4-Flash as served (FP8 entries with BF16 RoPE, FP4 indexer keys): 0.254. With V4's FP8 entries instead, V4.1 is
  0.46 of V4-Flash: the 1/4 needs the FP4 entries.

The engines' rules are their own source's (vLLM 0.33.0, SGLang 0.5.23; :mod:`kveval.planner.parallel`):

* vLLM ``ModelConfig.get_num_kv_heads`` (``vllm/config/model.py``): ``max(1, kv_heads // tp)`` KV heads a rank, 1 for
  MLA; MLA and V4 KV specs carry ``max_tp_shards=1`` (``MLAAttention.get_kv_cache_spec``,
  ``vllm/models/deepseek_v4/attention.py``), so every TP rank past the first holds a replica
  (``_layer_tp_replicas``, ``vllm/v1/core/kv_cache_planning.py``); ``verify_with_parallel_config`` requires the
  attention heads to divide by the TP size; ``FusedMoEParallelConfig.make`` shards experts across TP x DP.
* SGLang ``_compute_cell_size`` (``sglang/srt/model_executor/pool_configurator.py``) does not divide the MLA cell by
  the attention-TP size; ``derive_attn_tp_size`` (``sglang/srt/runtime_context.py``) is ``tp // dp`` under DP attention.
"""

from __future__ import annotations

import json

import pytest

from kveval.commands import main as cli
from kveval.errors import UsageError
from kveval.planner.engines import sglang_plan, vllm_plan
from kveval.planner.memory import compare, concurrency, plan
from kveval.planner.model_specs import MXFP4_BYTES, load_model_spec, spec_from_config
from kveval.planner.parallel import Deployment
from kveval.planner.presets import PRESETS
from kveval.policies.spec import parse_policy

M = 2**20
GiB = 2**30
V3_REST, V3_EXPERTS = 17_117_648_384, 58 * 256 * 3 * 7168 * 2048  # FP8: 1 byte each


# --- V4.1 in the planner ------------------------------------------------------------------------------------------

def test_v41_flash_global_kv_is_890_bytes_a_token_as_its_report_stores_it():
    p = plan("deepseek-v4.1-flash", M)
    assert p.bytes_per_token == 3 * (288 + 68) / 2 + (288 + 68) == 890
    parts = {part.name: part for part in p.parts}
    assert set(parts) == {"window", "csa-entries", "csa-indexer"}
    assert (parts["csa-entries"].entry_bytes, parts["csa-indexer"].entry_bytes, parts["window"].entry_bytes) == (288, 68, 528)
    assert parts["csa-entries"].layers == parts["csa-indexer"].layers == 4 and parts["window"].layers == 40
    assert parts["csa-entries"].entries == 3 * M // 2 + M
    assert p.sequence_bytes == 890 * M + 40 * 128 * 528  # the windows: a ring of 128 FP8 entries in every layer
    # a layer that reuses a source holds its window and nothing more; the sources hold their entries and keys
    by_index = {layer.index: layer for layer in p.layers}
    assert by_index[3].bytes == by_index[0].bytes == by_index[39].bytes == 128 * 528
    assert by_index[2].bytes == 128 * 528 + (M // 2) * (288 + 68)
    assert by_index[20].bytes == 128 * 528 + M * (288 + 68)


def test_v41_flash_is_about_a_quarter_of_v4_flash_with_fp4_entries_only():
    v41, v4 = plan("deepseek-v4.1-flash", M), plan("deepseek-v4-flash", M)
    assert v41.bytes_per_token / v4.bytes_per_token == pytest.approx(0.25, abs=0.01)
    assert v41.sequence_bytes / v4.sequence_bytes == pytest.approx(0.25, abs=0.01)
    # with V4's FP8 entries (583 B), the cross-layer reuse alone gives 0.46: the 1/4 needs V4.1's FP4 entries
    fp8 = plan("deepseek-v4.1-flash", M, storage="csa-entries=fp8-mixed")
    assert fp8.bytes_per_token == 3 * (583 + 68) / 2 + (583 + 68)
    assert fp8.bytes_per_token / v4.bytes_per_token == pytest.approx(0.464, abs=0.005)
    # every part in BF16: the same layout, 2 bytes a value
    bf16 = plan("deepseek-v4.1-flash", M, storage="all=bf16")
    assert bf16.bytes_per_token == 3 * (1024 + 256) / 2 + (1024 + 256)


def test_v41_flash_preset_reads_its_config_and_refuses_a_broken_one():
    spec = load_model_spec("deepseek-v41")  # the alias
    assert spec.v4.kv_sources == (2, 8, 14, 20) and spec.v4.index_sources == (2, 8, 14, 20, 24, 28, 32, 36)
    assert spec.v4.layers[:3] == [("sliding", 0), ("sliding", 0), ("csa", 2)] and spec.v4.layers[20] == ("csa", 1)
    assert "only layers 2, 8, 14, 20 store compressed KV" in spec.describe
    config = dict(PRESETS["deepseek-v4.1-flash"])
    for change, message in (({"kv_source_layer_ids": [0, 8]}, "must be compressing layers"),
                            ({"kv_source_layer_ids": [8, 20]}, "the first of them layer 2"),
                            ({"kv_source_layer_ids": [2, 8, 14]}, r"layer 20 \(compress ratio 1\) would reuse layer 14"),
                            ({"kv_source_layer_ids": [2, 2]}, "distinct layer indices"),
                            ({"compress_ratios": [0, 0, 2]}, "for each of the 40 layers")):
        with pytest.raises(UsageError, match=message):
            spec_from_config(config | change, "v41")


def test_a_policy_on_v41_is_refused_in_one_line(capsys):
    assert cli.main(["memory", "deepseek-v4.1-flash", "--context", "8k", "--policy", "quant(bits=4)"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "transformers has no deepseek_v41" in err
    with pytest.raises(ValueError, match="has no cache part"):
        plan("deepseek-v4.1-flash", 10, storage="state=bf16")


def test_compare_gains_v41(capsys):
    models = ["deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4.1-flash"]
    result = compare(models, [M])
    assert result.rows[3].ratios[0] == pytest.approx(0.254, abs=0.002)
    assert cli.main(["memory", "--compare", ",".join(models), "--context", "128k,1m"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v4.1-flash " in out and "csa-entries fp4-16" in out and "window fp8-32" in out


# --- memory against concurrency ------------------------------------------------------------------------------------

def test_concurrency_increment_is_a_ratio_of_slopes(capsys):
    models = ["deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4.1-flash"]
    table = concurrency(models, [32768, 131072], [1, 2, 4, 8])
    rows = {(r.model, r.context): r for r in table.rows}
    for row in table.rows:
        assert row.totals == [row.slope * b for b in (1, 2, 4, 8)]  # no sharing across requests: linear in batch
    v3, v32, v41 = (rows[(m, 131072)] for m in ("deepseek-v3", "deepseek-v3.2", "deepseek-v4.1-flash"))
    assert v3.slope == 131072 * 61 * 576 * 2
    # "about 1/3 lower than V3's" is V3.2's increment (0.684), not V4.1's (0.013: about 99% lower)
    assert v32.slope_ratio == pytest.approx(2 / 3, abs=0.02)
    assert v41.slope_ratio == pytest.approx(0.013, abs=0.001)
    argv = ["memory", "--compare", ",".join(models), "--context", "32k,128k", "--concurrency", "1,2,4,8"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "batch 8" in out and "+1 request" in out and "0.6840" in out
    assert cli.main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batches"] == [1, 2, 4, 8]
    for bad in (argv[:-1] + ["1,x"], argv[:-1] + ["0,2"], argv + ["--batch", "2"],
                ["memory", "deepseek-v3", "--context", "8k", "--concurrency", "1,2"]):
        assert cli.main(bad) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


# --- deployments as served -----------------------------------------------------------------------------------------

H200 = 143_771 * 2**20


def test_vllm_tp8_replicates_the_v3_latent_and_counts_fp8_weights():
    p = vllm_plan("deepseek-v3", H200, max_model_len=131072, deployment=Deployment(8, 1))
    assert p.settings["block_size"] == 64 and p.settings["gpus"] == 8 and p.settings["kv_pools"] == 1
    assert p.weights_bytes == -(-V3_REST // 8) + -(-V3_EXPERTS // 8)  # FP8: 1 byte a parameter, over 8 ranks
    assert p.pool_bytes == -(-H200 * 9 // 10) - p.weights_bytes
    bf16, fp8 = p.presets
    assert bf16.bytes_per_token == 61 * 576 * 2  # the whole latent on every rank: not divided by 8
    assert bf16.sequence_bytes == 131072 * 61 * 576 * 2 and fp8.sequence_bytes == 131072 * 61 * 576
    assert bf16.blocks == p.pool_bytes // (64 * 61 * 576 * 2) and bf16.sequences == p.pool_bytes // bf16.sequence_bytes
    assert any("replicated on each of the 8 attention-TP ranks" in n for n in p.notes)
    one = vllm_plan("deepseek-v3", H200, max_model_len=131072)
    assert one.weights_bytes == V3_REST + V3_EXPERTS  # one GPU: the whole FP8 checkpoint
    assert one.presets[0].bytes_per_token == bf16.bytes_per_token


def test_per_head_caches_split_by_kv_heads_and_replicate_past_them():
    def per_gpu(tp):
        return vllm_plan("llama-3.1-8b", "80GiB", max_model_len=1024, weights="16GB",
                         deployment=Deployment(tp, 1)).presets[0].bytes_per_token
    assert per_gpu(1) == 32 * 8 * 128 * 2 * 2
    assert per_gpu(2) == per_gpu(1) / 2 and per_gpu(8) == per_gpu(1) / 8
    assert per_gpu(16) == per_gpu(8) == per_gpu(32)  # 8 KV heads: one a rank from 8 ranks on (replicated)
    p = sglang_plan("llama-3.1-8b", "80GiB", context_length=1024, weights="16GB", deployment=Deployment(8, 4, True))
    assert p.settings["attention_tp"] == 2 and p.presets[0].bytes_per_token == per_gpu(2)


def test_dp_attention_shards_requests_and_replicates_the_rest_of_the_weights():
    v = vllm_plan("deepseek-v3", H200, max_model_len=131072, deployment=Deployment(1, 8))
    s = sglang_plan("deepseek-v3", H200, context_length=131072, deployment=Deployment(8, 8, True))
    for p in (v, s):
        assert (p.settings["gpus"], p.settings["attention_tp"], p.settings["kv_pools"]) == (8, 1, 8)
        assert p.weights_bytes == V3_REST + V3_EXPERTS // 8  # attention and dense layers on every GPU
        per_pool = p.pool_bytes // (131072 * 61 * 576 * 2)
        block = p.settings["block_size"]  # vLLM's FlashMLA blocks of 64, SGLang's pages of 1
        assert p.presets[0].sequences == 8 * per_pool and p.presets[0].max_concurrency == (
            p.pool_bytes // (block * 61 * 1152) / (131072 // block))
    plain = sglang_plan("deepseek-v3", H200, context_length=131072, deployment=Deployment(8, 2))
    assert plain.settings["gpus"] == 16 and plain.settings["attention_tp"] == 8 and plain.settings["kv_pools"] == 2
    assert plain.settings["block_size"] == 1


def test_v4_weights_are_fp8_blocks_with_mxfp4_experts_and_pages_of_256():
    spec = load_model_spec("deepseek-v4-flash")
    experts = 43 * 256 * 3 * 4096 * 2048
    assert spec.weights.split(spec.num_parameters) == (284_000_000_000 - experts, -(-experts * 17 // 32))
    assert MXFP4_BYTES == 4.25 / 8
    for plan_of in (lambda d: vllm_plan("deepseek-v4-flash", H200, max_model_len="1M", deployment=d),
                    lambda d: sglang_plan("deepseek-v4-flash", H200, context_length="1M", deployment=d)):
        p = plan_of(Deployment(8, 1))
        assert p.settings["block_size"] == 256
        assert p.presets[0].sequence_bytes == plan("deepseek-v4-flash", M).sequence_bytes  # replicated, not split


@pytest.mark.parametrize("argv,message", [
    (["--engine", "vllm", "--tensor-parallel-size", "3"], "128 attention heads do not split across 3"),
    (["--engine", "sglang", "--tp", "8", "--dp", "16", "--enable-dp-attention"], "give a --dp that divides --tp"),
    (["--engine", "sglang", "--tp", "8", "--dp", "0"], "data_parallel_size=0 must be a whole number >= 1"),
    (["--engine", "vllm", "--tensor-parallel-size", "0"], "tensor_parallel_size=0"),
    (["--engine", "vllm", "--enable-dp-attention"], "vLLM has no --enable-dp-attention"),
    (["--engine", "vllm", "--block-size", "0"], "block_size=0"),
    (["--engine", "llamacpp", "--ctx-size", "8k", "--tp", "2"], "runs on one GPU here"),
])
def test_bad_deployments_are_refused_in_one_line(argv, message, capsys):
    base = ["memory", "deepseek-v3", "--gpu-memory", "141GB", "--max-model-len", "8k"]
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_command_answers_the_deployment_question(capsys):
    argv = ["memory", "deepseek-v3", "--engine", "vllm", "--gpu-memory", "143771MiB", "--tensor-parallel-size", "8",
            "--max-model-len", "128K"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "--tensor-parallel-size 8 --data-parallel-size 1 (block size 64)" in out and "GPUs       8: 1 KV pool" in out
    assert cli.main(["memory", "deepseek-v4-flash", "--engine", "sglang", "--gpu-memory", "143771MiB", "--tp", "8",
                     "--dp", "8", "--enable-dp-attention", "--context-length", "1M"]) == 0
    out = capsys.readouterr().out
    assert "--tp 8 --dp 8 --enable-dp-attention (page size 256)" in out and "8 KV pool(s)" in out
    assert parse_policy("none").is_none
