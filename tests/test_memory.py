"""The KV-cache memory planner against hand arithmetic (no model is loaded)."""

from __future__ import annotations

import json

import pytest

from kveval.commands import main as cli
from kveval.planner import model_specs
from kveval.planner.memory import max_fit, parse_headroom, parse_size, plan
from kveval.planner.model_specs import load_model_spec
from kveval.policies.spec import parse_policy

KiB, MiB, GiB = 2**10, 2**20, 2**30


def llama(layers=32, heads=32, kv=None, hidden=4096, **extra):
    config = {"model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": heads,
              "hidden_size": hidden, "intermediate_size": 11008, "vocab_size": 32000}
    if kv is not None:
        config["num_key_value_heads"] = kv
    return config | extra


# --- dense layouts ---------------------------------------------------------------------------------

def test_llama2_7b_hand_arithmetic():
    p = plan("llama-2-7b", 8 * 1024, batch=8)
    # 32 layers x 32 KV heads x 128 x 2 bytes = 256 KiB for K, the same for V
    assert p.key_bytes_per_token == p.value_bytes_per_token == 256 * KiB
    assert p.bytes_per_token == p.baseline_bytes_per_token == 512 * KiB
    assert p.sequence_bytes == 4 * GiB
    assert p.total_bytes == 32 * GiB
    assert [layer.bytes for layer in p.layers] == [128 * MiB] * 32
    assert p.compression == 1


def test_28_layers_8_kv_heads_4096_tokens_is_448_mib():
    config = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 8, "head_dim": 128}
    assert plan(config, 4096).sequence_bytes == 448 * MiB


def test_gqa_mqa_and_head_dim_fallback():
    assert plan("llama-3.1-8b", 1).bytes_per_token == 32 * 8 * 128 * 2 * 2 == 128 * KiB
    assert plan("qwen2.5-7b", 1).bytes_per_token == 28 * 4 * 128 * 2 * 2
    assert plan("smollm2-135m", 1).bytes_per_token == 30 * 3 * 64 * 2 * 2
    # head_dim from hidden_size / heads; no num_key_value_heads means MHA; MQA via kv heads 1 or multi_query
    assert plan(llama(), 1).bytes_per_token == 512 * KiB
    assert plan(llama(kv=1), 1).bytes_per_token == 32 * 128 * 2 * 2
    assert plan({**llama(), "multi_query": True}, 1).bytes_per_token == 32 * 128 * 2 * 2
    assert plan(llama(), 100, dtype_bytes=4).sequence_bytes == 2 * 512 * KiB * 100


def test_qwen2_sliding_window_switched_off():
    p = plan("qwen2.5-7b", 200_000)
    assert all(layer.window is None for layer in p.layers)
    assert p.sequence_bytes == 28 * 4 * 128 * 4 * 200_000
    assert any("use_sliding_window is false" in n for n in p.notes)


# --- sliding windows and MLA ---------------------------------------------------------------------

def test_gemma3_hybrid_below_and_above_the_window():
    spec = load_model_spec("gemma3-270m")  # 18 layers, 5 sliding (512) : 1 full, 1 KV head, head_dim 256
    assert [i for i, w in enumerate(spec.windows) if w is None] == [5, 11, 17]
    per_layer_token = 1 * 256 * 2 * 2
    assert plan("gemma3-270m", 300).sequence_bytes == 18 * 300 * per_layer_token
    # a sliding layer holds window - 1 tokens, as transformers' own and kveval's cache do (it planned 512)
    assert plan("gemma3-270m", 2000).sequence_bytes == (15 * 511 + 3 * 2000) * per_layer_token
    # selection acts on the full-attention layers only (as the cache does)
    halved = plan("gemma3-270m", 2000, policy=parse_policy("snapkv(ratio=0.5)"))
    assert halved.sequence_bytes == (15 * 511 + 3 * 1000) * per_layer_token
    # the same model written with layer_types, and with the Gemma 3 default pattern
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    base = {k: v for k, v in model_specs.PRESETS["gemma3-270m"].items() if k != "sliding_window_pattern"}
    assert plan(base | {"layer_types": kinds}, 2000).sequence_bytes == (15 * 511 + 3 * 2000) * per_layer_token
    assert plan(base, 2000).sequence_bytes == (15 * 511 + 3 * 2000) * per_layer_token
    # Gemma 3 27B: 62 layers, 52 sliding (1024) + 10 full, 16 KV heads x 128
    p = plan("gemma-3-27b", 32768)
    assert p.sequence_bytes == (52 * 1023 + 10 * 32768) * 16 * 128 * 4


def test_multimodal_config_reads_text_config():
    outer = {"model_type": "gemma3", "text_config": dict(model_specs.PRESETS["gemma3-270m"])}
    assert plan(outer, 2000).sequence_bytes == plan("gemma3-270m", 2000).sequence_bytes


def test_mistral_every_layer_slides():
    per_token = 32 * 8 * 128 * 2 * 2
    assert plan("mistral-7b", 1000).sequence_bytes == 1000 * per_token
    p = plan("mistral-7b", 16384)
    assert p.sequence_bytes == 4095 * per_token  # window - 1, as the cache holds it
    assert any("sliding window of 4096" in n and "v0.1" in n for n in p.notes)
    # A selection policy keeps its share of the window's 4,095 tokens, as kveval's cache does (it planned 3,000
    # tokens at 6,000 while the cache kept 4,095, then refused selection on such models; tests/test_sliding_selection.py).
    for context in (6000, 16384):
        assert plan("mistral-7b", context, policy=parse_policy("snapkv(ratio=0.5)")).sequence_bytes == 2048 * per_token


def test_deepseek_v3_mla():
    p = plan("deepseek-v3", 1000)
    assert p.bytes_per_token == (512 + 64) * 61 * 2 == 70272
    # as the cache holds MLA: the latent in K's place, the shared RoPE key in V's
    assert (p.key_bytes_per_token, p.value_bytes_per_token) == (512 * 61 * 2, 64 * 61 * 2)
    assert p.sequence_bytes == 70272 * 1000
    assert all(layer.kind == "mla" for layer in p.layers)
    assert any("MLA" in n for n in p.notes)
    # a DeepSeek-V2-Lite-like config: kv_lora_rank 512 + rope 64 in 27 layers
    v2 = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16, "hidden_size": 2048,
          "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_key_value_heads": 16}
    assert plan(v2, 10).sequence_bytes == 576 * 27 * 2 * 10
    # the latent quantizes with the key settings: 576 values, group 64 -> 9 groups per token
    q = plan("deepseek-v3", 1000, policy=parse_policy("quant(bits=8,group=64)"))
    assert q.sequence_bytes == 61 * 1000 * (576 + 9 * 4)
    # K's settings for the latent, V's for the RoPE key (it quantized all 576 with K's: 10,980 B/token, not 13,908)
    mixed = plan("deepseek-v3", 1000, policy=parse_policy("quant(k_bits=2,v_bits=8,group=64)"))
    assert mixed.bytes_per_token == 61 * (512 // 4 + 8 * 4 + 64 + 4) == 13908


# --- quantization --------------------------------------------------------------------------------

def test_int4_group32_per_token_exact_bytes():
    # per head and token: 128 codes x 4 bits = 64 bytes + 4 groups x (fp16 scale + fp16 zero) = 16 bytes
    p = plan("llama-2-7b", 1000, policy=parse_policy("quant(bits=4,group=32)"))
    assert p.key_bytes_per_token == 32 * 32 * (64 + 16)
    assert p.bytes_per_token == 32 * 32 * 2 * 80 == 163840
    assert p.sequence_bytes == 1000 * 163840
    assert p.compression == pytest.approx(512 * KiB / 163840)
    # symmetric: no zero point
    assert plan("llama-2-7b", 1000, policy=parse_policy("quant(bits=4,group=32,symmetric=true)")).sequence_bytes == 1000 * 32 * 32 * 2 * 72
    # fp8: 1 byte per value + one fp16 scale per 64 channels
    assert plan("llama-2-7b", 10, policy=parse_policy("fp8(group=64)")).sequence_bytes == 10 * 32 * 32 * 2 * (128 + 2 * 2)
    # residual tokens stay in fp16
    r = plan("llama-2-7b", 1000, policy=parse_policy("quant(bits=4,group=32,residual=100)"))
    assert r.sequence_bytes == 900 * 163840 + 100 * 512 * KiB


def test_per_channel_groups_amortize_over_tokens():
    p = plan("llama-2-7b", 100, policy=parse_policy("quant(bits=4,k_axis=channel,v_axis=channel,group=32)"))
    # 96 tokens quantized in 3 groups of 32 per channel, 4 tokens left in fp16
    per_head = 96 * 128 // 2 + 3 * 128 * 4 + 4 * 128 * 2
    assert p.sequence_bytes == 32 * 32 * 2 * per_head
    assert p.key_bytes_per_token == 32 * 32 * (64 + 128 * 4 / 32)


def test_kivi2_with_residual():
    # smollm2: 30 layers, 3 KV heads, head_dim 64; KIVI-2: K per channel, V per token, group 32, residual 128
    p = plan("smollm2-135m", 1000, policy=parse_policy("kivi(bits=2)"))
    k_aged = (1000 - 128) // 32 * 32  # 864 tokens in 27 whole groups, 136 in fp16
    k = k_aged * 64 // 4 + (k_aged // 32) * 64 * 4 + (1000 - k_aged) * 64 * 2
    v_aged = 1000 - 128  # per-token groups: everything past the residual
    v = v_aged * 64 // 4 + v_aged * (64 // 32) * 4 + 128 * 64 * 2
    assert (k, v) == (38144, 37312)
    assert p.sequence_bytes == 30 * 3 * (k + v)
    # shorter than the residual: nothing is quantized
    assert plan("smollm2-135m", 100, policy=parse_policy("kivi(bits=2)")).sequence_bytes == plan("smollm2-135m", 100).sequence_bytes


@pytest.mark.parametrize("policy", ["kivi(bits=2)", "kivi(bits=4,group=16,residual=32)", "quant(bits=4,group=32)",
                                    "quant(bits=2,k_axis=channel,group=64,residual=10,symmetric=true)",
                                    "fp8(axis=channel,group=16,residual=5)"])
def test_matches_the_real_store(policy):
    """The planner's bytes equal what kveval.stores.quantized.QuantizedStore really holds."""
    torch = pytest.importorskip("torch")
    from kveval.stores.quantized import QuantizedStore

    quant = parse_policy(policy).quantization
    heads, tokens, dim = 3, 301, 64
    store = QuantizedStore(quant.key_quant, quant.value_quant, quant.residual_tokens, torch.float16)
    store.append(torch.randn(heads, tokens, dim, dtype=torch.float16), torch.randn(heads, tokens, dim, dtype=torch.float16))
    store.seal()
    config = {"num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": dim}
    assert plan(config, tokens, policy=parse_policy(policy)).sequence_bytes == store.nbytes


# --- selection and structure ---------------------------------------------------------------------

def test_selection_policies():
    full = plan("llama-2-7b", 4096).sequence_bytes
    assert plan("llama-2-7b", 4096, policy=parse_policy("snapkv(ratio=0.5)")).sequence_bytes == full // 2
    assert plan("llama-2-7b", 4096, policy=parse_policy("h2o(budget=1024)")).sequence_bytes == full // 4
    assert plan("llama-2-7b", 4096, policy=parse_policy("window(size=512)")).sequence_bytes == full // 8
    assert plan("llama-2-7b", 4096, policy=parse_policy("streaming(sink=4,window=252)")).sequence_bytes == 256 * 512 * KiB
    # PyramidKV: budgets shrink with depth; the planner sums the layers

    pyramid = plan("llama-2-7b", 4096, policy=parse_policy("pyramidkv(ratio=0.5)"))
    selection = parse_policy("pyramidkv(ratio=0.5)").selection
    kept = [selection.keep_count(4096, i, 32) for i in range(32)]
    assert [layer.tokens for layer in pyramid.layers] == kept
    assert kept[0] > kept[-1]
    assert pyramid.sequence_bytes == sum(kept) * 16 * KiB
    # generation: a decode budget caps the cache; otherwise generated tokens add up
    assert plan("llama-2-7b", 4096, policy=parse_policy("h2o(ratio=0.5,decode_budget=3000)"), new_tokens=2000).layers[0].tokens == 3000
    assert plan("llama-2-7b", 4096, policy=parse_policy("snapkv(ratio=0.5)"), new_tokens=100).layers[0].tokens == 2148
    # selection stacked with quantization
    both = plan("llama-2-7b", 4096, policy=parse_policy("snapkv(ratio=0.5)+quant(bits=4,group=32)"))
    assert both.sequence_bytes == 2048 * 163840


def test_lowrank_ranks():
    assert plan("llama-2-7b", 10, policy=parse_policy("lowrank(rank=16)")).bytes_per_token == 32 * 32 * (16 + 16) * 2
    p = plan("llama-2-7b", 10, policy=parse_policy("lowrank(k_rank=32,v_rank=16)"))
    assert (p.key_bytes_per_token, p.value_bytes_per_token) == (32 * 32 * 32 * 2, 32 * 32 * 16 * 2)
    # coefficients quantized: 32 values per head at 4 bits = 16 bytes + one group of 32 (scale + zero)
    q = plan("llama-2-7b", 10, policy=parse_policy("lowrank(rank=32)+quant(bits=4,group=32)"))
    assert q.bytes_per_token == 32 * 32 * 2 * (16 + 4)
    # energy= needs a calibration: planned at head_dim (upper bound) with a note
    e = plan("llama-2-7b", 10, policy=parse_policy("lowrank(energy=0.9)"))
    assert e.bytes_per_token == 512 * KiB
    assert any("upper bound" in n for n in e.notes)


# --- what fits -----------------------------------------------------------------------------------

def test_max_fit_hand_computation():
    usable = 80 * GiB * 9 // 10 - 16 * 10**9  # 61,309,411,328 bytes for the cache
    fit = max_fit("llama-2-7b", "80GiB", "16GB", batch=1)
    assert fit.cache_budget_bytes == usable
    assert fit.value == usable // (512 * KiB) == 116938
    assert fit.value == max_fit("llama-2-7b", 80 * GiB, 16 * 10**9).value  # batch 1 by default; bytes as numbers
    assert max_fit("llama-2-7b", "80GiB", "16GB", batch=8).value == usable // (8 * 512 * KiB) == 14617
    batch = max_fit("llama-2-7b", "80GiB", "16GB", context=8192)
    assert batch.solve == "batch" and batch.value == usable // (4 * GiB) == 14
    assert max_fit("llama-2-7b", "80GiB", "16GB", context=8192, headroom="10%").value == 14
    # weights estimated from parameters x dtype bytes
    est = max_fit("llama-3.1-8b", "80GiB", context=8192)
    assert est.weights_estimated and est.weights_bytes == 8_030_261_248 * 2
    assert est.value == (80 * GiB * 9 // 10 - 8_030_261_248 * 2) // (8192 * 128 * KiB)


def test_max_fit_edges():
    # bounded cache (a window policy): any context fits
    assert max_fit("llama-2-7b", "80GiB", "16GB", policy=parse_policy("window(size=4096)")).value is None
    # weights larger than the GPU: nothing fits
    assert max_fit("deepseek-v3", "80GiB", "700GB").value == 0
    moe = llama(kv=8) | {"num_local_experts": 8}
    with pytest.raises(ValueError, match="--weights"):
        max_fit(moe, "80GiB")  # mixture of experts: no estimate from the config
    # quantization with per-channel groups: every shorter context fits too, the next one does not
    fit = max_fit("smollm2-135m", "1GiB", "300MB", policy=parse_policy("kivi(bits=2)"))
    limit = fit.cache_budget_bytes
    sizes = [plan("smollm2-135m", n, policy=parse_policy("kivi(bits=2)")).sequence_bytes for n in range(fit.value - 300, fit.value + 2)]
    assert max(sizes[:-1]) <= limit < sizes[-1]


def test_parse_sizes_and_headroom():
    assert parse_size("80GiB") == 80 * GiB
    assert parse_size("16GB") == 16 * 10**9
    assert parse_size("1.5 TiB") == 3 * 2**39
    assert parse_size(123) == 123
    assert parse_headroom("10%") == parse_headroom(0.1) == 0.1
    for bad in ("1.5", "-0.1", "100%", "lots"):
        with pytest.raises(ValueError, match="headroom"):
            parse_headroom(bad)
    with pytest.raises(ValueError, match="80GiB"):
        parse_size("80 gigs")


# --- configs from files and the Hub --------------------------------------------------------------

def test_local_config_file_and_folder(tmp_path):
    config = llama(kv=8) | {"_name_or_path": "my/llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan(str(tmp_path / "config.json"), 1).bytes_per_token == 32 * 8 * 128 * 4
    assert plan(str(tmp_path), 1).model == "my/llama"
    # the parameter estimate for a dense Llama equals Llama-2-7B's count
    preset = {k: v for k, v in model_specs.PRESETS["llama-2-7b"].items() if k != "num_parameters"}
    assert load_model_spec(preset).num_parameters == 6_738_415_616
    smol = {k: v for k, v in model_specs.PRESETS["smollm2-135m"].items() if k != "num_parameters"}
    assert load_model_spec(smol).num_parameters == 134_515_008


def test_transformers_config_object():
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(num_hidden_layers=12, num_key_value_heads=1, head_dim=256, sliding_window=512)
    p = plan(config, 2000)
    assert p.sequence_bytes == (10 * 511 + 2 * 2000) * 1024


def test_hub_id_not_cached_names_the_fix(monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(ValueError, match="download") as err:
        plan("someone/some-model", 10)
    assert "\n" not in str(err.value)


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: plan("llama-9000", 10), "unknown model 'llama-9000'"),
    (lambda: plan("llama-2-7b", -5), "context=-5"),
    (lambda: plan("llama-2-7b", 0), "context=0"),
    (lambda: plan("llama-2-7b", 10, batch=0), "batch=0"),
    (lambda: plan("llama-2-7b", 10, dtype_bytes=3), "dtype_bytes"),
    (lambda: plan("llama-2-7b", 10, policy=parse_policy("quant(bits=4,group=48)")), "group=48 does not divide head_dim=128"),
    (lambda: plan("llama-2-7b", 10, policy=parse_policy("lowrank(rank=256)")), "exceeds head_dim"),
    (lambda: plan("deepseek-v3", 10, policy=parse_policy("lowrank(rank=128)")), "rank 128 exceeds the MLA RoPE key width 64"),
    (lambda: plan("deepseek-v3", 10, policy=parse_policy("kvquant(bits=4)")), "MLA"),
    (lambda: plan("llama-2-7b", 10, policy=parse_policy("nosuch")), "unknown policy"),
    (lambda: max_fit("llama-2-7b", "80GiB", "16GB", headroom=1.5), "headroom"),
    (lambda: max_fit("llama-2-7b", "80GiB", "16GB", context=10, batch=2), "not both"),
])
def test_bad_input_is_one_clear_line(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


# --- the command ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["memory", "llama-9000", "--context", "10"],
    ["memory", "llama-2-7b", "--context", "-5"],
    ["memory", "llama-2-7b", "--context", "8k", "--gpu-memory", "80GiB", "--weights", "16GB", "--headroom", "1.5"],
    ["memory", "llama-2-7b"],
    ["memory", "llama-2-7b", "--context", "8k", "--gpu-memory", "80 gigs", "--weights", "16GB"],
    # An infinite number of bytes per parameter was an OverflowError inside (an internal error, "a bug").
    ["memory", "llama-2-7b", "--context", "8k", "--gpu-memory", "80GiB", "--weight-bytes-per-param", "inf"],
])
def test_cli_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kveval memory: error:") and "\n" not in err


def test_cli_names_a_bad_batch_even_without_a_context(capsys):
    """--batch -3 alone was answered with "give --context N": the fix for another mistake."""
    assert cli.main(["memory", "llama-2-7b", "--batch", "-3"]) == 2
    assert "batch=-3 must be >= 1" in capsys.readouterr().err


def test_cli_table_and_json(capsys):
    assert cli.main(["memory", "llama-2-7b", "--context", "8k", "--batch", "8",
                     "--gpu-memory", "80GiB", "--weights", "16GB"]) == 0
    out = capsys.readouterr().out
    assert "512 KiB" in out and "32 GiB in total" in out
    assert "largest context at batch 8: 14,617 tokens" in out and "largest batch at 8,192 tokens: 14" in out
    assert cli.main(["memory", "deepseek-v3", "--context", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["bytes_per_token"] == 70272 and data["plan"]["total_bytes"] == 70272 * 4096
    assert len(data["plan"]["layers"]) == 61 and data["fit"] == []
    assert cli.main(["memory", "--list-presets"]) == 0
    assert "gemma3-270m" in capsys.readouterr().out


# --- the plan is what the cache measures -----------------------------------------------------------

MEASURED_ARCHS = ["llama", "gemma3", "cohere2", "llama4", "deepseek_v3", "qwen3_next", "bamba", "falcon_h1"]
MEASURED_POLICIES = ["none", "quant(bits=4,group=32,residual=8)", "kivi(bits=2,group=16,residual=8)",
                     "quant(bits=2,k_axis=channel,group=16,residual=5,symmetric=true)", "quant(k_bits=2,v_bits=8,group=16)",
                     "fp8(axis=channel,group=16,residual=3)", "snapkv(ratio=0.5)", "pyramidkv(ratio=0.5)",
                     "snapkv(ratio=0.5)+kivi(bits=4,group=16,residual=8)", "kvquant(bits=4,pre_rope=false)",
                     "kvquant(bits=2,pre_rope=false,sink=3,residual=5)", "lowrank(k_rank=16,v_rank=8)",
                     "latent(rank=16,rope_dims=4)+kivi(bits=4,group=8,residual=4)"]


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("name", MEASURED_ARCHS)
def test_the_plan_is_the_bytes_the_cache_measures(name):
    """100 tokens then 6 decode steps on a tiny model of each cache layout: sliding layers (window 16: they hold
    15), chunked attention, MLA's latent and RoPE key, Mamba and gated-delta layers (no K/V), Falcon-H1's hybrid
    layers. The planner priced sliding layers at their window, MLA's RoPE key with K's settings, every
    linear-attention or Mamba layer as a full attention layer (Qwen3-Next 4x, Bamba 3x), and refused kvquant, and
    lowrank and latent on MLA (which the cache runs on the latent and the RoPE key; kvquant codes them at their
    own widths, pre_rope=false)."""
    import sys

    import torch

    sys.path.insert(0, "tests")
    from cache_runs import context_then_steps, random_ids
    from tiny_models import tiny_model

    model = tiny_model(name)
    wrong = []
    for spec in MEASURED_POLICIES:
        _, cache = context_then_steps(model, spec, random_ids(100, 1), random_ids(6, 2), kv_dtype=torch.bfloat16)
        measured = cache.stats()
        planned = plan(model.config, 100, policy=parse_policy(spec), dtype_bytes=2, new_tokens=6)
        if (planned.sequence_bytes, planned.baseline_sequence_bytes) != (measured.kv_bytes, measured.nominal_bytes):
            wrong.append(f"{spec}: planned {planned.sequence_bytes} (baseline {planned.baseline_sequence_bytes}), "
                         f"measured {measured.kv_bytes} ({measured.nominal_bytes})")
    assert not wrong, "\n".join(wrong)


def test_hybrid_configs_plan_their_attention_layers_only():
    """Qwen3-Next-80B's shape: 12 of 48 layers hold K/V (it planned 48); Bamba's config.json names its attention
    layers in attn_layer_indices, Jamba's by period and offset; an unknown layer type is refused, not planned full."""
    qwen = {"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "hidden_size": 2048,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]}
    p = plan(qwen, 32768)
    assert p.sequence_bytes == 12 * 32768 * 2 * 2 * 256 * 2 and p.bytes_per_token == 12 * 2 * 2 * 256 * 2
    assert sum(layer.kind == "state" for layer in p.layers) == 36 and any("hold no K/V" in n for n in p.notes)
    bamba = {"model_type": "bamba", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "attn_layer_indices": [9, 18, 27]}
    assert plan(bamba, 1000).sequence_bytes == 3 * 1000 * 2 * 8 * 128 * 2
    jamba = {"model_type": "jamba", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "attn_layer_period": 8, "attn_layer_offset": 4}
    assert plan(jamba, 1000).sequence_bytes == 4 * 1000 * 2 * 8 * 128 * 2
    with pytest.raises(ValueError, match="'lightning_attention' is not one the planner knows"):
        plan({**qwen, "layer_types": ["lightning_attention"] * 48}, 10)
    # config.json files that name their attention layers another way, read as transformers reads them
    interval = {k: v for k, v in qwen.items() if k != "layer_types"} | {"full_attention_interval": 4}
    assert plan(interval, 32768).sequence_bytes == p.sequence_bytes
    lfm2 = {"model_type": "lfm2", "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 2048, "full_attn_idxs": [2, 5, 8, 10, 12, 14]}
    assert plan(lfm2, 1000).sequence_bytes == 6 * 1000 * 2 * 8 * 64 * 2
    with pytest.raises(ValueError, match="hybrid config .mamba_d_state. whose layers transformers cannot read"):
        plan({**bamba, "model_type": "not-a-model", "attn_layer_indices": None, "mamba_d_state": 16}, 10)
    with pytest.raises(ValueError, match="no layer holds K/V"):
        plan({**qwen, "layer_types": ["linear_attention"] * 48}, 10)


def test_kvquant_is_planned():
    """It was refused ("measure kvquant with kveval eval"), and gate --gpu-memory with a kvquant candidate ended in an
    error. Its bytes match the cache's on the tiny models above."""
    p = plan("llama-3.1-8b", 8192, policy=parse_policy("kvquant(bits=4)"))
    head = 128
    coded = 2 * (head * 4 // 8 + 2 * (2 + 1)) + 4  # codes, ceil(1% of 128) = 2 outliers (bf16 + uint8 index), lo/hi
    assert p.sequence_bytes == 32 * 8 * ((8192 - 1) * coded + 1 * 2 * head * 2)  # one sink token kept in bf16
    assert p.bytes_per_token == 32 * 8 * coded


@pytest.mark.parametrize("spec", ["kivi(bits=4,group=8,residual=4)", "quant(bits=4,k_axis=channel,v_axis=channel,group=4,residual=3)",
                                  "latent(rank=16,rope_dims=4)+kivi(bits=4,group=8,residual=4)"])
@pytest.mark.usefixtures("calibration_cache")
def test_a_sliding_window_cutting_per_channel_groups_is_planned_as_held(spec):
    """While decoding, a sliding layer's window drops its oldest token each step; a per-channel group it cuts keeps
    its dead slots until all are dead (storage.QuantizedSequence.keep_last). The plan counted only live tokens:
    Gemma 3's window-16 layer held 2,880 B after 6 steps of kivi(bits=4,group=8,residual=4), planned 2,624."""
    import sys

    import torch

    sys.path.insert(0, "tests")
    from cache_runs import context_then_steps, random_ids
    from tiny_models import tiny_model

    model = tiny_model("gemma3")
    for context, steps in ((100, 1), (100, 6), (100, 23), (10, 12), (14, 5), (40, 40)):
        _, cache = context_then_steps(model, spec, random_ids(context, 1), random_ids(steps, 2), kv_dtype=torch.bfloat16)
        planned = plan(model.config, context, policy=parse_policy(spec), dtype_bytes=2, new_tokens=steps).sequence_bytes
        assert planned == cache.stats().kv_bytes, (context, steps)
