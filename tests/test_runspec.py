"""RunSpec at every edge: sweep configs, generate/eval CLIs; specs checked against config.json before weights load."""

import pytest
import torch

from kveval.errors import PolicySpecError
from kveval.sweep.config import load_config
from kveval.sweep.run import run_sweep


def _config(tmp_path, text):
    path = tmp_path / "sweep.yaml"
    path.write_text("models: [smollm2-135m]\nprobes: {families: [passkey], lengths: [256], n: 1}\n" + text)
    return path


def test_sweep_config_entries_parse_once_into_run_specs(tmp_path):
    config = load_config(_config(tmp_path, "kv_dtype: fp16\npolicies: [snapkv(ratio=0.5)@query, kivi(bits=4), none]\n"))
    assert [(s.spec, s.mode, s.kv_dtype) for s in config.policies] == [
        ("snapkv(ratio=0.5)", "query", torch.float16), ("kivi(bits=4)", "context", torch.float16)]
    assert config.kv_dtype == torch.float16
    assert [s.key for s in config.policies] == ["snapkv(ratio=0.5)@query@kv_dtype=float16", "kivi(bits=4)@kv_dtype=float16"]


@pytest.mark.parametrize("text, message", [
    ("policies: [snapkv(ratio=0.5)@sideways]", "suffix after '@'"),
    ("policies: ['quant(bits=4,symmetric=maybe)']", "symmetric=maybe is not true or false"),
    ("kv_dtype: int3\npolicies: [kivi(bits=4)]", "kv_dtype='int3'"),
    # computed in full, then an ERROR at the gate: runs of two cache dtypes are not paired
    ("kv_dtype: bf16\npolicies: ['kivi(bits=4)@kv_dtype=fp32']", "asks for kv_dtype float32 but the sweep's baseline runs at bfloat16"),
])
def test_bad_sweep_entries_are_one_line_errors(tmp_path, text, message):
    with pytest.raises(ValueError, match=message) as info:
        load_config(_config(tmp_path, text))
    assert "sweep.yaml" in str(info.value) and "\n" not in str(info.value)


def test_sweep_checks_every_policy_against_every_model_before_loading(tmp_path, monkeypatch):
    import kveval.runner.models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before every spec was checked")

    monkeypatch.setattr(kveval.runner.models, "load_model", no_loading)
    path = tmp_path / "two.yaml"
    path.write_text("models: [gemma3-270m, smollm2-135m]\npolicies: [kivi(bits=4), lowrank(rank=128)]\n")
    config = load_config(path)
    with pytest.raises(PolicySpecError, match="rank 128 exceeds head_dim=64 of smollm2-135m"):
        run_sweep(config, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_generate_refuses_a_bad_spec_before_loading(monkeypatch, capsys):
    import kveval.runner.models
    from kveval.commands.main import main

    monkeypatch.setattr(kveval.runner.models, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(["generate", "--policy", "lowrank(rank=16)+quant(bits=8,group=64)", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "group=64 does not divide the k rank 16" in err and len(err.strip().splitlines()) == 1
    assert main(["eval", "--policy", "snapkv(budget=2.5)", "--out", "x"]) == 2
    assert "budget=2.5 is not an integer" in capsys.readouterr().err


def test_below_the_edge_nothing_parses_a_string():
    """Specs and dtypes are parsed once, at the edge: the cache, the generator and the runner take typed values and
    refuse a string as the caller's bug (a TypeError, not a user error) instead of parsing it again."""
    from kveval.cache.compressed import CompressedCache
    from kveval.runner.evaluate import evaluate_policies
    from kveval.runner.generation import generate, generate_each
    from kveval.dtypes import parse_kv_dtype

    from tiny_models import tiny_llama

    model = tiny_llama()
    with pytest.raises(TypeError, match="takes a PolicyStack"):
        CompressedCache(model, "snapkv(ratio=0.5)")
    with pytest.raises(TypeError, match="kv_dtype='float16'"):
        CompressedCache(model, kv_dtype="float16")
    with pytest.raises(TypeError, match="takes a PolicyStack"):
        generate(model, None, [], "none")
    with pytest.raises(TypeError, match="takes a PolicyStack"):
        next(generate_each(model, None, [], ["none", "h2o(ratio=0.5)"]))
    with pytest.raises(TypeError, match="takes RunSpecs"):
        evaluate_policies(model, None, [], ["none"], "out", "m")
    assert parse_kv_dtype("bf16") == torch.bfloat16 and parse_kv_dtype("auto") is None and parse_kv_dtype(None) is None
