"""Run folders: keyed by full model identity, refused on resume for another model or prompt; calibration recorded."""

import json

import pytest

from kveval.errors import RunFolderError
from kveval.probes.item import ProbeItem, prompt_hash
from kveval.runner.evaluate import evaluate_policies
from kveval.runner.runspec import model_folder, model_identity
from kveval.runs.records import read_items, read_run_info

from cache_runs import specs_of
from tiny_models import tiny_llama


class CharTok:
    """A character-level stand-in tokenizer whose ids fit the tiny model's vocabulary."""

    eos_token_id = None
    pad_token_id = 0
    chat_template = None
    bos_token = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + ord(c) % 120 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i % 26) for i in ids)


def _items(context="the pass key is 42. " * 3, n=2):
    items = []
    for i in range(n):
        question = f"What is the pass key? ({i})"
        items.append(ProbeItem(id=f"passkey-{i}", hash=prompt_hash(context, question), family="passkey", params={},
                               context=context, question=question, prompt_context=context, prompt_question=question,
                               gold=["42"], needles=[], length=len(context) + len(question), depth=0.5, max_new_tokens=2))
    return items


def test_models_with_the_same_folder_name_get_different_run_folders(tmp_path):
    (tmp_path / "org1" / "final").mkdir(parents=True)
    (tmp_path / "org2" / "final").mkdir(parents=True)
    ids = [model_identity(str(tmp_path / org / "final")) for org in ("org1", "org2")]
    assert ids[0]["hash"] != ids[1]["hash"]
    assert model_folder(ids[0]) != model_folder(ids[1])
    assert model_folder(model_identity("org1/M")) != model_folder(model_identity("org2/M"))
    assert model_identity("org/M", "v1")["hash"] != model_identity("org/M", "v2")["hash"]
    assert model_folder(model_identity("smollm2-135m")) == "smollm2-135m"  # embedded names are identities
    assert model_identity("org1/M")["hash"] == model_identity("org1/M", "main")["hash"]


def test_second_model_with_the_same_name_is_evaluated_not_resumed(tmp_path):
    model, tok = tiny_llama(), CharTok()
    first = evaluate_policies(model, tok, _items(), specs_of(["window(size=8)"]), tmp_path, "org1/M")
    second = evaluate_policies(tiny_llama(seed=1), tok, _items(), specs_of(["window(size=8)"]), tmp_path, "org2/M")
    assert first[0] != second[0]
    info = read_run_info(second[0])
    assert info.kv_dtype == "bfloat16"  # unset: the deployment dtype, recorded as resolved
    assert info.model_identity["source"] == "org2/M" and info.model_identity["revision"] == "main"
    assert json.loads((second[0] / "run.json").read_text())["model_identity"]["hash"] == model_identity("org2/M")["hash"]


def test_resuming_a_folder_of_another_model_or_prompt_is_refused(tmp_path):
    model, tok = tiny_llama(), CharTok()
    [run_dir] = evaluate_policies(model, tok, _items(), specs_of(["window(size=8)"]), tmp_path, "org1/M")
    # Same run folder, other model identity recorded (as an older kveval that keyed folders by name wrote it).
    info = json.loads((run_dir / "run.json").read_text())
    info["model_identity"]["hash"] = "00000000"
    (run_dir / "run.json").write_text(json.dumps(info))
    with pytest.raises(RunFolderError, match="holds runs of model"):
        evaluate_policies(model, tok, _items(), specs_of(["window(size=8)"]), tmp_path, "org1/M")
    info["model_identity"] = model_identity("org1/M")
    (run_dir / "run.json").write_text(json.dumps(info))
    # Same item ids, other prompts.
    with pytest.raises(RunFolderError, match="run on another prompt"):
        evaluate_policies(model, tok, _items(context="another haystack. " * 3), specs_of(["window(size=8)"]), tmp_path, "org1/M")
    # The same run resumes without complaint.
    evaluate_policies(model, tok, _items(), specs_of(["window(size=8)"]), tmp_path, "org1/M")


def test_the_hardware_is_recorded_and_a_resume_elsewhere_marks_the_run_mixed(tmp_path, monkeypatch):
    import kveval.runner.evaluate

    model, tok = tiny_llama(), CharTok()
    [run_dir] = evaluate_policies(model, tok, _items(n=1), specs_of(["window(size=8)"]), tmp_path, "org1/M")
    here = kveval.runner.evaluate.hardware_of(model)
    assert here.startswith("cpu ") and "torch " in here
    assert read_run_info(run_dir).extra["hardware"] == here
    evaluate_policies(model, tok, _items(n=2), specs_of(["window(size=8)"]), tmp_path, "org1/M")  # resumed here: unchanged
    assert read_run_info(run_dir).extra["hardware"] == here
    monkeypatch.setattr(kveval.runner.evaluate, "hardware_of", lambda model: "cuda NVIDIA H200, torch 2.13.0")
    evaluate_policies(model, tok, _items(n=2), specs_of(["window(size=8)"]), tmp_path, "org1/M")  # nothing left to compute
    assert read_run_info(run_dir).extra["hardware"] == here
    evaluate_policies(model, tok, _items(n=3), specs_of(["window(size=8)"]), tmp_path, "org1/M")  # item 3 computed elsewhere
    assert read_run_info(run_dir).extra["hardware"] == f"mixed: {here} + cuda NVIDIA H200, torch 2.13.0"


def test_low_rank_calibration_is_recorded_in_run_json(tmp_path):
    model, tok = tiny_llama(), CharTok()
    [run_dir] = evaluate_policies(model, tok, _items(n=1), specs_of(["lowrank(rank=8)"]), tmp_path, "org1/M")
    extra = read_run_info(run_dir).extra
    assert extra["calibration_id"].startswith("calibration.txt:sha256=") or "sha256=" in extra["calibration_id"]
    assert extra["calibration_tokens_used"] > 0


def test_kv_dtype_and_mode_name_the_run_folder(tmp_path):
    from kveval.runner.runspec import RunSpec

    model, tok = tiny_llama(), CharTok()
    specs = [RunSpec.parse("window(size=8)", mode="query", kv_dtype="float16")]
    [run_dir] = evaluate_policies(model, tok, _items(n=1), specs_of(specs), tmp_path, "org1/M")
    assert run_dir.name == "window_size-8@query@kv-float16"
    info = read_run_info(run_dir)
    assert (info.mode, info.kv_dtype) == ("query", "float16")


def test_a_killed_runs_half_written_line_is_cut_and_the_run_resumes(tmp_path):
    model, tok = tiny_llama(), CharTok()
    [run_dir] = evaluate_policies(model, tok, _items(n=1), specs_of(["window(size=8)"]), tmp_path, "org1/M")
    with open(run_dir / "items.jsonl", "a") as f:
        f.write('{"id": "passkey-1", "ha')
    evaluate_policies(model, tok, _items(n=2), specs_of(["window(size=8)"]), tmp_path, "org1/M")
    assert [r.id for r in read_items(run_dir)] == ["passkey-0", "passkey-1"]
