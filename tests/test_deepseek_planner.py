"""The planner on DeepSeek's caches: the chronicle's published figures, and planned == measured on tiny V3.2/V4.

Published figures pinned here, each with the storage it depends on:

* DeepSeek-V2's report: MLA cuts the KV cache by 93.3% against DeepSeek 67B. Reproduced with 67B's cache in BF16
  and V2's at the 6 bits per value on average its report deploys (``storage all=6bit``): 1 - 25,920 / 389,120 =
  93.34%. In BF16 both, the cut is 82.2%: the 93.3% depends on the 6 bits.
* DeepSeek-V4's report: at 1M tokens, V4-Pro's KV cache is about 10% of V3.2's (V4-Flash's about 7%). Reproduced
  with each stored as served: V3.2's latent in FP8 with a float32 scale per 128 values and its RoPE key in BF16
  (FlashMLA's 656 bytes), its indexer keys in FP8 with a float32 scale per 128; V4's entries in FP8 with BF16 RoPE
  values and a 1-byte scale per 64, its indexer keys in FP4 with a 1-byte scale per 32 (assumed). 10.46% and 7.31%.
  The report gives a rounded figure read off a chart: the tolerance is one percentage point.
* vLLM's DeepSeek-V4 post: in BF16 at 1M tokens, V4-Pro's cache is 8.7x smaller than V3.2's (9.62 GiB against
  83.88 GiB). Reproduced with every part in BF16: 8.714x, 9.625 GiB and 83.875 GiB (V4-Pro's layer pattern, 30 CSA
  and 31 HCA layers, is the assumption this figure confirms).

The tiny models run their own forward with transformers' own cache (``DynamicCache``: ``DynamicIndexedLayer`` for
V3.2, ``DynamicSlidingWindowLayer``/``DeepseekV4CSACache``/``DeepseekV4HCACache`` for V4); the measured bytes are
every floating tensor those cache layers hold (K, V, indexer keys, compressed entries, buffers, overlap state),
counted once where K and V share storage.
"""

from __future__ import annotations

import pytest

from kveval.commands import main as cli
from kveval.planner.memory import compare, plan
from kveval.policies.spec import parse_policy

from tiny_models import tiny_model

GiB = 2**30
M = 2**20


# --- the chronicle's published figures -----------------------------------------------------------------------------

def test_v2_cuts_67b_cache_by_93_3_percent_at_6_bits():
    dense = plan("deepseek-67b", 4096)
    assert dense.bytes_per_token == 95 * 8 * 128 * 2 * 2 == 389_120
    mla = plan("deepseek-v2", 4096, storage="all=6bit")
    assert mla.sequence_bytes == 4096 * 60 * 576 * 6 // 8
    assert 1 - mla.sequence_bytes / dense.sequence_bytes == pytest.approx(0.933, abs=0.0005)
    # the same in BF16: the 93.3% needs V2's 6-bit deployment
    assert 1 - plan("deepseek-v2", 4096).sequence_bytes / dense.sequence_bytes == pytest.approx(0.822, abs=0.001)


def test_v4_pro_is_about_10_percent_of_v3_2_at_1m_as_served():
    v32, pro, flash = (plan(m, M) for m in ("deepseek-v3.2", "deepseek-v4-pro", "deepseek-v4-flash"))
    assert v32.sequence_bytes == M * 61 * (512 + 4 * 4 + 64 * 2 + 128 + 4)  # FlashMLA's 656 B + indexer 132 B
    assert pro.sequence_bytes / v32.sequence_bytes == pytest.approx(0.10, abs=0.01)
    assert flash.sequence_bytes / v32.sequence_bytes == pytest.approx(0.07, abs=0.01)


def test_v4_pro_is_8_7x_smaller_than_v3_2_in_bf16_at_1m():
    v32, pro = (plan(m, M, storage="all=bf16") for m in ("deepseek-v3.2", "deepseek-v4-pro"))
    assert v32.sequence_bytes == M * 61 * (576 + 128) * 2  # 83.875 GiB
    assert v32.sequence_bytes / pro.sequence_bytes == pytest.approx(8.7, abs=0.05)
    assert pro.sequence_bytes / GiB == pytest.approx(9.62, abs=0.01)
    parts = {part.name: part for part in pro.parts}
    assert parts["csa-entries"].entries == 30 * M // 4 and parts["hca-entries"].entries == 31 * M // 128
    assert parts["window"].entries == 61 * 127


def test_compare_chronicle_ratios_and_json(capsys):
    models = ["deepseek-67b", "deepseek-v2", "deepseek-v3", "deepseek-v3.2", "deepseek-v4-pro"]
    result = compare(models, [128 * 1024, M])
    assert [row.model for row in result.rows] == models
    assert result.rows[0].ratios == [None, None]
    assert result.rows[1].ratios[0] == pytest.approx(60 * 576 / (95 * 8 * 128 * 2))
    assert result.rows[4].ratios[1] == pytest.approx(0.1046, abs=0.0005)
    assert any("deepseek-67b" in n and "max_position_embeddings" in n for n in result.notes)
    argv = ["memory", "--compare", ",".join(models), "--context", "128k,1m"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "x prev" in out and "deepseek-v4-pro" in out and "fp4-32" in out
    assert cli.main(argv + ["--json"]) == 0
    import json
    data = json.loads(capsys.readouterr().out)
    assert [m["model"] for m in data["models"]] == models
    assert data["models"][4]["at"][1]["ratio_to_previous"] == pytest.approx(0.1046, abs=0.0005)
    # a part one model has applies to that model; a part none has is refused
    bf16_index = compare(models[3:], [M], storage="indexer=bf16")
    assert bf16_index.rows[0].storage["indexer"] == "bf16" and bf16_index.rows[1].storage["csa-indexer"] == "fp4-32"
    with pytest.raises(ValueError, match="no model compared has a cache part idx"):
        compare(models, [M], storage="idx=bf16")


def test_what_the_planner_cannot_size_on_the_new_layouts_is_refused_in_one_line(capsys):
    refusals = {
        # a selection over parts coded before it acts: its bytes depend on which entries it keeps
        ("deepseek-v4-flash", "knorm(ratio=0.5)+kivi(bits=2)"): "coded before knorm(ratio=0.5) acts, with a residual",
        ("deepseek-v3.2", "knorm(ratio=0.5)+quant(bits=4,k_axis=channel)"): "latent entries are coded before",
        # what the cache refuses, in its words
        ("deepseek-v4-flash", "snapkv(ratio=0.5)"): "scores with attention",
        ("deepseek-v4-flash", "kvquant(bits=4)"): "use kvquant(bits=4,pre_rope=false)",
        ("deepseek-v3.2", "indexer(ratio=0.5)"): "which a deepseek_v32 model does not have",
        ("deepseek-v3.2", "llamacpp(k=q8_0,v=q8_0)"): "with quant, kivi, fp8, fp4, mxfp8, kvquant only",
        ("llama-3.1-8b", "indexer(ratio=0.5)"): "which llama-3.1-8b does not have",
    }
    for (model, policy), message in refusals.items():
        assert cli.main(["memory", model, "--context", "8k", "--policy", policy]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (policy, err)
    with pytest.raises(ValueError, match="no cache part"):
        plan("deepseek-v4-pro", 10, storage="latent=bf16")
    for model in ("deepseek-v3", "deepseek-v4-flash"):
        with pytest.raises(ValueError, match="storage overrides size the native cache"):
            plan(model, 10, policy=parse_policy("kivi(bits=2)"), storage="all=bf16")


def test_a_policy_on_a_served_layout_is_compared_with_kvevals_uncompressed_cache():
    """Under a policy the planner sizes kveval's cache (the window once in every layer, each part coded by the
    policy from the cache dtype) against kveval's own uncompressed cache in the cache dtype, which is what a run
    measures; the preset's serving formats are the native plan's (policy none), named in a note."""
    served = plan("deepseek-v4-flash", 131072)
    coded = plan("deepseek-v4-flash", 131072, policy=parse_policy("quant(bits=4,indexer=fp8)"))
    bf16 = plan("deepseek-v4-flash", 131072, storage="all=bf16")
    sliding_only = 2 * 127 * 512 * 2  # two sliding-only layers: transformers holds their K=V window twice
    assert coded.baseline_sequence_bytes == bf16.sequence_bytes - sliding_only
    assert served.sequence_bytes < bf16.sequence_bytes and any("441.99 MiB" in n for n in coded.notes)
    assert [p.name for p in coded.parts] == ["window", "csa", "indexer", "hca", "state"]
    assert {p.name: p.storage for p in coded.parts} == {"window": "int4/64", "csa": "int4/64",
                                                        "indexer": "fp8-e4m3/128", "hca": "int4/64", "state": "dtype"}
    # The selection keeps half of every CSA/HCA layer's entries; the window and the state stay.
    half = plan("deepseek-v4-flash", 131072, policy=parse_policy("knorm(ratio=0.5)+quant(bits=4,indexer=fp8)"))
    for whole, halved in zip(coded.parts, half.parts):
        if whole.name in ("csa", "indexer", "hca"):
            assert halved.entries == whole.entries // 2 and halved.bytes == whole.bytes // 2
        else:
            assert halved.bytes == whole.bytes
    # The lightning indexer scores CSA's entries only: HCA keeps all of its own.
    indexer = {p.name: p.entries for p in plan("deepseek-v4-flash", 131072,
                                                policy=parse_policy("indexer(ratio=0.5)")).parts}
    assert indexer["csa"] == indexer["indexer"] == 21 * 32768 // 2 and indexer["hca"] == 20 * 1024


def test_storage_override_on_a_classic_model_matches_the_dtype_plan():
    for model in ("llama-3.1-8b", "gemma3-270m", "deepseek-v3"):
        assert plan(model, 3000, storage="all=bf16").sequence_bytes == plan(model, 3000).sequence_bytes
        assert sum(part.bytes for part in plan(model, 3000).parts) == plan(model, 3000).sequence_bytes


def test_max_fit_on_v4_fits_at_every_shorter_context():
    from kveval.planner.memory import max_fit

    fit = max_fit("deepseek-v4-flash", "1TiB", "160GB")
    sizes = [plan("deepseek-v4-flash", n).sequence_bytes for n in range(fit.value - 300, fit.value + 2)]
    assert max(sizes[:-1]) <= fit.cache_budget_bytes < sizes[-1]
    # closing an HCA window turns 127 buffered tokens into one entry: the cache dips
    assert plan("deepseek-v4-flash", 128 * 1000).sequence_bytes < plan("deepseek-v4-flash", 128 * 1000 - 1).sequence_bytes


# --- planned == measured on tiny models ----------------------------------------------------------------------------

V32 = dict(model_type="deepseek_v32", vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24,
           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=8,
           n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
           max_position_embeddings=128)
V4 = dict(model_type="deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
          num_attention_heads=2, num_key_value_heads=1, head_dim=32, q_lora_rank=16, sliding_window=8, o_groups=1,
          o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4, num_experts_per_tok=2,
          hc_mult=2, layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
          max_position_embeddings=128)


def _tensors(layer):
    """Every floating tensor a cache layer holds, by name (dicts of tensors: ``buffer_kv[indexer]``)."""
    import torch

    for name, value in vars(layer).items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for key, tensor in items:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                yield (name if key is None else f"{name}[{key}]"), tensor


def measured_bytes(cache) -> list[int]:
    """Bytes per cache layer, each storage counted once (V4's K and V are one tensor)."""
    out = []
    for layer in cache.layers:
        seen = {}
        for _, tensor in _tensors(layer):
            seen[tensor.data_ptr()] = max(seen.get(tensor.data_ptr(), 0), tensor.numel() * tensor.element_size())
        out.append(sum(seen.values()))
    return out


def run_tiny(config: dict, dtype, prefill: int, decode: int):
    import torch
    import transformers

    classes = {"deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
               "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM")}[config["model_type"]]
    settings = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = getattr(transformers, classes[0])(**settings)
    torch.manual_seed(0)
    model = getattr(transformers, classes[1])(hf_config).to(dtype).eval()
    cache = transformers.DynamicCache(config=hf_config)
    ids = torch.randint(0, config["vocab_size"], (1, prefill + decode), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for step in range(decode):
            model(ids[:, prefill + step:prefill + step + 1], cache=cache, use_cache=True)
    return hf_config, cache


@pytest.mark.parametrize("config", [V32, V4], ids=["deepseek_v32", "deepseek_v4"])
@pytest.mark.parametrize("dtype_name,prefill,decode", [("float32", 40, 0), ("bfloat16", 37, 5), ("float32", 3, 0)])
def test_planned_bytes_are_the_bytes_transformers_cache_holds(config, dtype_name, prefill, decode):
    import torch

    dtype = getattr(torch, dtype_name)
    hf_config, cache = run_tiny(config, dtype, prefill, decode)
    measured = measured_bytes(cache)
    size = torch.empty((), dtype=dtype).element_size()
    for source in (config, hf_config):  # the config dict, and transformers' own config object
        p = plan(source, prefill, new_tokens=decode, dtype_bytes=size)
        assert [layer.bytes for layer in p.layers] == measured
        assert p.sequence_bytes == sum(measured) == sum(part.bytes for part in p.parts)


# Planner part -> the parts kveval's own cache measures (kveval.cache.native_layers); the compressor's pending tokens
# and CSA's overlap are its constant-size state_bytes.
MEASURED_PART = {"latent": "latent", "rope": "latent", "indexer": "indexer", "window": "window",
                 "csa-entries": "csa", "csa-indexer": "indexer", "hca-entries": "hca"}


@pytest.mark.parametrize("config", [V32, V4], ids=["deepseek_v32", "deepseek_v4"])
@pytest.mark.parametrize("prefill,decode", [(40, 0), (37, 5)])
def test_planned_parts_are_the_parts_kvevals_cache_measures(config, prefill, decode):
    """The same tiny configs through kveval's cache under ``none`` (float32): each planned part is the bytes kveval
    measures for it, and the planned state is its ``state_bytes``."""
    import torch

    from kveval.cache.compressed import CompressedCache

    settings = {k: v for k, v in config.items() if k != "model_type"}
    name = config["model_type"]
    model = tiny_model(name, **settings)
    cache = CompressedCache(model, parse_policy("none"), kv_dtype=torch.float32)
    ids = torch.randint(0, config["vocab_size"], (1, prefill + decode), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for step in range(decode):
            model(ids[:, prefill + step:prefill + step + 1], cache=cache, use_cache=True,
                  position_ids=torch.tensor([[prefill + step]]))
    stats = cache.stats()
    planned: dict[str, int] = {}
    for part in plan(config, prefill, new_tokens=decode, dtype_bytes=4).parts:
        if part.name != "state":
            planned[MEASURED_PART[part.name]] = planned.get(MEASURED_PART[part.name], 0) + part.bytes
    state = sum(p.bytes for p in plan(config, prefill, new_tokens=decode, dtype_bytes=4).parts if p.name == "state")
    measured = {k: v for k, v in stats.parts.items() if v}
    if name == "deepseek_v4":
        # V4's window entry is one vector for K and V. kveval stores it once in every layer; transformers'
        # DynamicSlidingWindowLayer (the sliding-only layers) holds it twice, as keys and values, and the planner
        # sizes what transformers holds (the test above): one extra copy per sliding-only layer.
        held = min(prefill + decode, config["sliding_window"] - 1)
        entry = held * config["head_dim"] * 4
        assert measured.pop("window") == config["num_hidden_layers"] * entry
        sliding_only = config["layer_types"].count("sliding_attention")
        assert planned.pop("window") == (config["num_hidden_layers"] + sliding_only) * entry
    assert planned == measured
    assert state == stats.state_bytes


# Under a policy the planner sizes kveval's cache, part for part as kveval's layers hold them: one of each family
# these caches take, the indexer at its own width, KVQuant's calibrated codes, selections by ratio (V4) or on the
# latent (V3.2, GLM), with decode budgets and per-channel groups where the bytes do not depend on which tokens stay.
PLANNED_POLICIES = {
    "deepseek_v32": ["fp8(group=8)", "quant(bits=4,group=8,indexer=fp8)", "kivi(bits=2,group=8,residual=4)",
                     "kvquant(bits=4,pre_rope=false,calib_tokens=128)", "knorm(ratio=0.5)+quant(bits=4,group=8)",
                     "window(size=20)+kvquant(bits=2,pre_rope=false,sink=0,calib_tokens=128)",
                     "knorm(budget=12,decode_budget=16)+quant(bits=4,group=8,indexer=native)", "streaming(sink=4,window=16)"],
    "deepseek_v4": ["fp8(group=16)", "quant(bits=4,group=16,indexer=fp8)", "kivi(bits=4,residual=0,group=4)",
                    "kivi(bits=2,group=4,residual=4)", "kvquant(bits=4,pre_rope=false,calib_tokens=128)",
                    "knorm(ratio=0.5)+quant(bits=4,group=16)", "streaming(ratio=0.5,sink=4)", "indexer(ratio=0.5)",
                    "random(ratio=0.5)+kvquant(bits=2,pre_rope=false,sink=0,calib_tokens=128,indexer=fp8)"],
    "glm_moe_dsa": ["none", "quant(bits=4,group=8)", "window(size=20)+fp8(group=8)",
                    "kvquant(bits=4,pre_rope=false,calib_tokens=128)"],
}


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("name, spec", [(n, s) for n, specs in PLANNED_POLICIES.items() for s in specs])
def test_a_planned_policy_is_the_bytes_kvevals_cache_measures(name, spec):
    """Prefill, then decode steps (windows closed, entries emitted, groups sealed while decoding), float32: every
    part, the state and the uncompressed cache as kveval measures them (GLM: its second layer, reusing the first's
    top-k, keeps no indexer keys: under none the planner's parts are the model's own, latent and RoPE key apart)."""
    import torch

    from cache_runs import context_then_steps, random_ids

    model = tiny_model(name)
    for context, steps in ((37, 5), (50, 13)):
        planned = plan(model.config, context, new_tokens=steps, dtype_bytes=4, policy=parse_policy(spec))
        _, cache = context_then_steps(model, spec, random_ids(context, 1), random_ids(steps, 2), kv_dtype=torch.float32)
        stats = cache.stats()
        parts = {p.name: p.bytes for p in planned.parts if p.name != "state"}
        if spec == "none":
            parts = {"latent": parts.pop("latent") + parts.pop("rope"), **parts}
        state = sum(p.bytes for p in planned.parts if p.name == "state")
        assert parts == stats.parts and state == stats.state_bytes, (context, steps)
        assert planned.sequence_bytes == stats.kv_bytes + state
        assert planned.baseline_sequence_bytes == stats.nominal_bytes + state


def test_the_v4_gpu_configs_expected_memory_is_the_planners():
    """configs/gpu-deepseek-v4-flash.yaml states each policy's planned cache at 32K and 128K tokens in its header:
    every policy it runs has its row, and the row is what the planner says (a comment that cannot go stale)."""
    from pathlib import Path

    from kveval.planner.memory import human_bytes
    from kveval.sweep.config import load_config

    path = Path(__file__).resolve().parent.parent / "configs" / "gpu-deepseek-v4-flash.yaml"
    rows = {}
    for line in path.read_text().splitlines():
        words = line.lstrip("# ").split()
        if len(words) >= 5 and words[0] != "policy" and words[2] == "MiB" and words[4] == "MiB":
            rows[parse_policy(words[0]).spec] = (f"{words[1]} MiB", f"{words[3]} MiB")
    for run in load_config(path).policies:
        planned = tuple(human_bytes(plan("deepseek-v4-flash", n, policy=parse_policy(run.spec)).sequence_bytes)
                        for n in (32768, 131072))
        assert rows.get(run.spec) == planned, run.spec
