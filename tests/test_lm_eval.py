"""The ``kveval`` lm-eval model type and the ``kveval lm-eval`` CLI wrapper."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kveval.cache.attention import register_attention
from kveval.errors import UsageError

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from kveval.lm_eval.model import KVEvalLM, parse_model_args, policy_from_arg  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer():
    from kveval.modeling.sources import load_tokenizer

    return load_tokenizer("smollm2-135m")


def tiny_model(tokenizer, attn="kveval"):
    """A 2-layer random Llama with the SmolLM2 vocabulary (head_dim 32 so KIVI's group of 32 fits)."""
    register_attention()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         attn_implementation=attn, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def smollm():
    from kveval.runner.models import load_model

    try:
        return load_model("smollm2-135m", device="cpu", dtype="float32")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"embedded model unavailable: {exc}")


def ll_requests(pairs):
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " Lyon"),
    ("The capital of France is", " a city in Europe"),
    ("", "Hello world"),
    ("One two three four five six seven", " eight"),
    ("x", " y z"),
    ("A long list of words: apple banana cherry grape lemon mango. Which fruit is yellow? The answer is", " lemon"),
]


# --- model arguments -----------------------------------------------------------------------------

def test_model_args_keep_policy_commas():
    args = parse_model_args("pretrained=smollm2-135m,policy=snapkv(ratio=0.5,window=16)+kivi(bits=4),compress=query,seed=3")
    assert args == {"pretrained": "smollm2-135m", "policy": "snapkv(ratio=0.5,window=16)+kivi(bits=4)",
                    "compress": "query", "seed": 3}
    assert policy_from_arg("snapkv(ratio=0.5;window=16)+kivi(bits=4)").spec == policy_from_arg(args["policy"]).spec
    assert parse_model_args('policy="window(8)",pretrained=x') == {"policy": "window(8)", "pretrained": "x"}


def test_lm_eval_cli_parses_policy_model_args():
    """lm-eval 0.4.13's own --model_args parser: top-level commas, space-separated pairs and JSON all keep the spec."""
    from lm_eval._cli import HarnessCLI

    parser = HarnessCLI()
    spec = "snapkv(ratio=0.5,window=16)+kivi(bits=4)"
    forms = [["--model_args", f"pretrained=smollm2-135m,policy={spec},compress=context"],
             ["--model_args", "pretrained=smollm2-135m", f"policy={spec}", "compress=context"],
             ["--model_args", json.dumps({"pretrained": "smollm2-135m", "policy": spec, "compress": "context"})]]
    for form in forms:
        saved = sys.argv
        sys.argv = ["lm-eval", "run", "--model", "kveval", *form, "--tasks", "x"]
        try:
            args = parser.parse_args()
        finally:
            sys.argv = saved
        assert args.model_args == {"pretrained": "smollm2-135m", "policy": spec, "compress": "context"}


def test_bad_policy_or_mode_fails_before_loading():
    with pytest.raises(ValueError, match="ratio"):
        KVEvalLM(pretrained="no-such-model-anywhere", policy="snapkv(ratio=2)")
    with pytest.raises(ValueError, match="unknown policy"):
        KVEvalLM(pretrained="no-such-model-anywhere", policy="zip(ratio=0.5)")
    with pytest.raises(ValueError, match="compress"):
        KVEvalLM(pretrained="no-such-model-anywhere", compress="both")


def test_batch_size_in_model_args_is_read_and_checked(tokenizer, monkeypatch):
    """`--model_args ...,batch_size=0` was an internal TypeError (lm-eval passes its own batch_size too), and a
    batch size of 0 or "abc" ran as 1 without a word."""
    for bad in ("0", "abc", 0, -2):
        with pytest.raises(UsageError, match="batch_size"):
            KVEvalLM(pretrained="no-such-model-anywhere", batch_size=bad)
    with pytest.raises(UsageError, match="batch_size=0"):
        KVEvalLM.create_from_arg_string("pretrained=no-such-model-anywhere,batch_size=0", {"batch_size": 1})
    import kveval.runner.models

    monkeypatch.setattr(kveval.runner.models, "load_model", lambda *args, **kwargs: (tiny_model(tokenizer), tokenizer))
    lm = KVEvalLM.create_from_arg_string("pretrained=tiny,policy=window(2),batch_size=3", {"batch_size": 1, "device": "cpu"})
    assert lm.batch_size == 3  # the model args' own value


def test_spec_is_checked_against_the_config_before_the_weights_load(monkeypatch):
    import kveval.runner.models

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the spec was checked")

    monkeypatch.setattr(kveval.runner.models, "load_model", no_loading)
    with pytest.raises(ValueError, match="exceeds head_dim=64"):
        KVEvalLM(pretrained="smollm2-135m", policy="lowrank(rank=128)")
    with pytest.raises(ValueError, match="group=48 does not divide"):
        KVEvalLM(pretrained="smollm2-135m", policy="quant(bits=8,group=48)")
    with pytest.raises(ValueError, match="kv_dtype"):
        KVEvalLM(pretrained="smollm2-135m", kv_dtype="int3")


def test_results_schema_round_trip_reads_a_query_aware_run_back(tokenizer, tmp_path):
    """What the model type writes into results["config"] reads back as the same run: mode, ratio and bytes."""
    import hashlib

    from kveval.runs import lm_eval_schema as schema
    from kveval.runs.results import load_lm_eval_run

    lm = KVEvalLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, policy="snapkv(ratio=0.5,window=2)@query",
                  question_marker="?", kv_dtype="float16")
    lm.loglikelihood(ll_requests([(PAIRS[-1][0].replace(" The answer is", "? The answer is"), PAIRS[-1][1])]))
    config = lm.get_model_info()
    assert set(config) >= set(schema.KEYS)
    folder = tmp_path / "run" / "tiny"
    folder.mkdir(parents=True)
    date = "2026-01-02T03-04-05.678901"
    (folder / f"results_{date}.json").write_text(json.dumps({"results": {}, "config": config}))
    prompt = "q?"
    row = {"doc_id": 0, "doc": {}, "target": "0", "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": " a"}},
           "resps": [[["-1.0", "True"]]], "filtered_resps": [["-1.0", "True"]], "filter": "none", "metrics": ["acc"],
           "acc": 1.0, "doc_hash": "d", "prompt_hash": hashlib.sha256(prompt.encode()).hexdigest(), "target_hash": "t"}
    (folder / f"samples_task_{date}.jsonl").write_text(json.dumps(row) + "\n")
    info = load_lm_eval_run(folder).info
    assert (info.policy, info.mode, info.ratio, info.kv_dtype) == ("snapkv(ratio=0.5,window=2)", "query", 0.5, "float16")
    assert info.bytes_per_token == config[schema.MEASURED_BYTES] and 0 < info.bytes_per_token < info.nominal_bytes_per_token
    assert info.nominal_bytes_per_token == 2 * 2 * 2 * 32 * 2  # K+V, 2 layers, 2 KV heads, head_dim 32, float16


# --- loglikelihood -------------------------------------------------------------------------------

def test_policy_none_matches_stock_hflm(tokenizer):
    reference = HFLM(pretrained=tiny_model(tokenizer, "sdpa"), tokenizer=tokenizer, batch_size=2).loglikelihood(ll_requests(PAIRS))
    for compress in ("context", "query"):
        for batch_size in (1, 3):
            # kv_dtype=float32: the cache the stock (fp32) model keeps; the default is the 16-bit deployment cache
            lm = KVEvalLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, policy="none", compress=compress,
                          batch_size=batch_size, kv_dtype="float32")
            ours = lm.loglikelihood(ll_requests(PAIRS))
            for (a, greedy_a), (b, greedy_b) in zip(ours, reference):
                assert a == pytest.approx(b, abs=1e-5)
                assert greedy_a == greedy_b
    info = lm.get_model_info()
    assert info["kveval_policy"] == "none" and info["kveval_measured_ratio"] == pytest.approx(1.0)


def test_compressed_loglikelihood_does_not_depend_on_batch_size(tokenizer):
    combined = "snapkv(ratio=0.5,window=2)+kivi(bits=4,residual=1)"
    for policy, compress in (("window(2)", "context"), (combined, "context"), (combined, "query")):
        results = []
        for batch_size in (1, 4):
            lm = KVEvalLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, policy=policy, compress=compress,
                          batch_size=batch_size)
            results.append(lm.loglikelihood(ll_requests(PAIRS)))
        for (a, greedy_a), (b, greedy_b) in zip(*results):
            assert a == pytest.approx(b, abs=1e-4)
            assert greedy_a == greedy_b


def test_choices_share_one_compressed_prefill(tokenizer, monkeypatch):
    import kveval.lm_eval.model as module

    calls = []
    real = module.forward_rows

    def counting(model, cache, rows, seen, pad_id, logits_to_keep=1):
        calls.append(("prefill" if not any(seen) else "tail", len(rows)))
        return real(model, cache, rows, seen, pad_id, logits_to_keep)

    monkeypatch.setattr(module, "forward_rows", counting)
    lm = KVEvalLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, policy="window(2)", batch_size=1)
    lm.loglikelihood(ll_requests(PAIRS[:3]))  # three choices, one context
    assert [c for c in calls if c[0] == "prefill"] == [("prefill", 1)]
    assert lm.get_model_info()["kveval_measured_requests"] == 3


def test_question_marker_splits_context_and_question(tokenizer):
    lm = KVEvalLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, policy="window(2)", question_marker="\\n\\n")
    assert lm.question_marker == "\n\n"
    context = "Some haystack text. The key is 7.\n\nWhat is the key? The key is"
    ctx, cont = lm._encode_pair(context, " 7")
    prefill, protect, tail, continuation = lm._plan(((context, " 7"), ctx, cont))
    assert tokenizer.decode(list(prefill)) == "Some haystack text. The key is 7."
    assert protect == 0 and tail == ctx[len(prefill):] + cont[:-1] and continuation == cont
    lm.compress = "query"
    prefill, protect, tail, _ = lm._plan(((context, " 7"), ctx, cont))
    assert list(prefill) == ctx and protect == len(ctx) - len(tokenizer("Some haystack text. The key is 7.")["input_ids"])
    assert tail == cont[:-1]


def test_rolling_is_stock_hflm_and_use_cache_works(tokenizer, tmp_path):
    from lm_eval.api.model import CachingLM

    text = [Instance("loglikelihood_rolling", {}, ("A short document about the sea and the sky, nothing more.",), 0)]
    reference = HFLM(pretrained=tiny_model(tokenizer, "sdpa"), tokenizer=tokenizer).loglikelihood_rolling(text)
    lm = KVEvalLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, policy="window(2)+kivi(bits=2)")
    assert lm.loglikelihood_rolling(text)[0] == pytest.approx(reference[0], abs=1e-5)

    cached = CachingLM(lm, str(tmp_path / "cache.db"))
    first = cached.loglikelihood(ll_requests(PAIRS[:2]))
    measured = lm.get_model_info()["kveval_measured_requests"]
    assert cached.loglikelihood(ll_requests(PAIRS[:2])) == first
    assert lm.get_model_info()["kveval_measured_requests"] == measured  # answered from the cache
    assert cached.get_model_info()["kveval_policy"].startswith("window(size=2)")


@pytest.mark.slow
def test_eviction_changes_passkey_loglikelihood(smollm):
    model, tokenizer = smollm
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 3
    context = ("There is a pass key hidden in this text. The pass key is 48213. Remember it. 48213 is the pass key. "
               + filler + "What is the pass key? The pass key is")
    requests = ll_requests([(context, " 48213")])
    full = KVEvalLM(pretrained=model, tokenizer=tokenizer, policy="none").loglikelihood(requests)[0]
    evicted_lm = KVEvalLM(pretrained=model, tokenizer=tokenizer, policy="window(8)")
    evicted = evicted_lm.loglikelihood(requests)[0]
    assert full[1] is True and full[0] > -3  # the uncompressed model retrieves the key
    assert evicted[0] < full[0] - 10 and evicted[1] is False  # the key was evicted: measurably less likely
    info = evicted_lm.get_model_info()
    assert info["kveval_measured_ratio"] < 0.15  # 8 of ~100 prefill tokens kept


# --- generation ----------------------------------------------------------------------------------

def test_generate_until_same_answers_for_any_batch_size(tokenizer):
    prompts = ["Q: What is the capital of France?\nA:", "The pass key is 4921. Remember 4921. The pass key is",
               "Count: one, two, three,", "List three colours: red,", "Tell me a fact about the sea."]
    gen_kwargs = {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}
    requests = [Instance("generate_until", {}, (p, gen_kwargs), i) for i, p in enumerate(prompts)]
    policy = "snapkv(ratio=0.5,window=2)+kivi(bits=4,residual=2)"
    for compress in ("context", "query"):
        answers = []
        for batch_size in (1, 4):
            lm = KVEvalLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, policy=policy, compress=compress,
                          batch_size=batch_size)
            answers.append(lm.generate_until(requests))
        assert answers[0] == answers[1]
        assert all("\n" not in a for a in answers[0]) and any(answers[0])
    info = lm.get_model_info()
    assert info["kveval_measured_requests"] == len(prompts)
    assert 0 < info["kveval_measured_bytes_per_token"] < info["kveval_nominal_bytes_per_token"]
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([Instance("generate_until", {}, ("Hi", {"do_sample": True, "temperature": 1.0}), 0)])


# --- the CLI wrapper -----------------------------------------------------------------------------

UTILS = '''
import datasets

DOCS = [
    {"context": "Anna keeps a red box. Ben keeps a blue box. Carl keeps a green box.", "question": "Who keeps the blue box?",
     "choices": ["Anna", "Ben", "Carl"], "label": 1, "answer": "Ben"},
    {"context": "The door code is 4417. The safe code is 9023.", "question": "What is the door code?",
     "choices": ["4417", "9023", "1234"], "label": 0, "answer": "4417"},
    {"context": "Mia lives in Oslo. Tom lives in Rome.", "question": "Where does Tom live?",
     "choices": ["Oslo", "Rome", "Paris"], "label": 1, "answer": "Rome"},
    {"context": "The cat is called Felix. The dog is called Rex.", "question": "What is the dog called?",
     "choices": ["Felix", "Rex", "Max"], "label": 1, "answer": "Rex"},
    {"context": "Water boils at 100 degrees. Ice melts at 0 degrees.", "question": "At what temperature does water boil?",
     "choices": ["0", "50", "100"], "label": 2, "answer": "100"},
    {"context": "The meeting is on Monday. The party is on Friday.", "question": "When is the party?",
     "choices": ["Monday", "Friday", "Sunday"], "label": 1, "answer": "Friday"},
]


def load(**kwargs):
    return {"test": datasets.Dataset.from_list(DOCS)}
'''

TASKS = {
    "kvtest_mc.yaml": """
        task: kvtest_mc
        dataset_path: ""
        dataset_name: ""
        custom_dataset: !function utils.load
        output_type: multiple_choice
        test_split: test
        doc_to_text: "{{context}}\\n\\nQuestion: {{question}}\\nAnswer:"
        doc_to_choice: choices
        doc_to_target: label
        metric_list:
          - metric: acc
        metadata:
          version: 1.0
        """,
    "kvtest_gen.yaml": """
        task: kvtest_gen
        dataset_path: ""
        dataset_name: ""
        custom_dataset: !function utils.load
        output_type: generate_until
        test_split: test
        doc_to_text: "{{context}}\\n\\nQuestion: {{question}}\\nAnswer:"
        doc_to_target: answer
        generation_kwargs:
          until: ["\\n", "."]
          max_gen_toks: 6
          do_sample: false
        filter_list:
          - name: strip
            filter:
              - function: remove_whitespace
        metric_list:
          - metric: exact_match
        metadata:
          version: 1.0
        """,
}


def write_tasks(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "utils.py").write_text(UTILS)
    for name, text in TASKS.items():
        (folder / name).write_text(textwrap.dedent(text))
    return folder


@pytest.mark.slow
def test_cli_wrapper_runs_tasks_and_records_policy(smollm, tmp_path):
    from kveval.commands.main import main

    tasks = write_tasks(tmp_path / "tasks")
    out = tmp_path / "out"
    code = main(["lm-eval", "--model", "kveval",
                 "--model_args", "pretrained=smollm2-135m,policy=snapkv(ratio=0.5,window=4)+kivi(bits=4),question_marker=\\n\\n",
                 "--tasks", "kvtest_mc,kvtest_gen", "--include_path", str(tasks), "--device", "cpu",
                 "--batch_size", "5", "--limit", "5", "--log_samples", "--output_path", str(out)])
    assert code == 0
    results_files = sorted(out.rglob("results_*.json"))
    assert len(results_files) == 1
    results = json.loads(results_files[0].read_text())
    config = results["config"]
    assert config["model"] == "kveval"
    assert config["kveval_policy"].startswith("snapkv(ratio=0.5,window=4") and "kivi(bits=4" in config["kveval_policy"]
    assert config["kveval_compress"] == "context" and config["kveval_question_marker"] == "\n\n"
    assert config["kveval_kv_dtype"] == "bfloat16"  # the deployment cache, whatever the CPU computes in
    assert config["kveval_nominal_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert 0 < config["kveval_measured_bytes_per_token"] < config["kveval_nominal_bytes_per_token"]
    assert config["kveval_measured_requests"] == 5 * 3 + 5
    assert set(results["results"]) == {"kvtest_mc", "kvtest_gen"}
    for task in ("kvtest_mc", "kvtest_gen"):
        (samples,) = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        lines = [json.loads(line) for line in samples.read_text().splitlines()]
        assert len(lines) == 5 and all("prompt_hash" in line for line in lines)


def test_module_entry_point_and_bad_policy_exit_code(tmp_path):
    """``python -m kveval.lm_eval`` reaches lm-eval's parser; a bad spec is one error line and exit code 2."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tasks = write_tasks(tmp_path / "tasks")
    done = subprocess.run([sys.executable, "-m", "kveval.lm_eval", "--model", "kveval",
                           "--model_args", "pretrained=smollm2-135m,policy=snapkv(ratio=1.5)",
                           "--tasks", "kvtest_mc", "--include_path", str(tasks), "--limit", "1"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "kveval lm-eval: error:" in done.stderr and "ratio=1.5" in done.stderr


def test_include_paths_keep_ours_and_the_users(tmp_path):
    from kveval.lm_eval import tasks_dir
    from kveval.lm_eval.__main__ import _include_paths

    ours = tasks_dir()
    user = write_tasks(tmp_path / "a")
    paths = _include_paths(f"{user}{os.pathsep}{tmp_path / 'b'}")
    paths = paths if isinstance(paths, list) else [paths]
    assert paths[-2:] == [str(user), str(tmp_path / "b")]
    if ours is not None:
        assert paths[0] == str(ours)
        assert _include_paths(None) == str(ours)


def test_an_unexpected_exception_in_the_lm_eval_wrapper_is_an_internal_error_never_1(monkeypatch, capsys):
    """Exit 1 is the gate's FAIL: a crash inside lm-eval must not look like one (it prints its traceback, exits 70)."""
    import lm_eval._cli

    from kveval.commands.main import main

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash inside lm-eval")

    monkeypatch.setattr(lm_eval._cli.HarnessCLI, "execute", crash)
    code = main(["lm-eval", "run", "--model", "kveval", "--model_args", "pretrained=smollm2-135m", "--tasks", "kveval_passkey"])
    assert code == 70
    assert "internal error (RuntimeError)" in capsys.readouterr().err


def test_loglikelihood_batches_across_a_longrope_switch_are_refused_before_any_forward(tokenizer, monkeypatch):
    """A longrope model (a tiny Phi-3 switching at 64 positions) scoring contexts of about 30 and 90 tokens in
    one batch: transformers would turn the short row by the long row's factors. The refusal names batch_size=1
    and comes before any forward, not after the batches before it were scored; at batch size 1 the same
    requests run."""
    import transformers

    import kveval.lm_eval.model as module
    from kveval.errors import UnsupportedModelError

    register_attention()
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
                         "long_factor": [3.0] * 16, "original_max_position_embeddings": 64},
        attn_implementation="kveval", tie_word_embeddings=False, pad_token_id=0)
    model = transformers.Phi3ForCausalLM(config).eval()
    pairs = [("one two three " * 10, " four"), ("one two three " * 30, " four")]
    forwards = []
    real = module.forward_rows
    monkeypatch.setattr(module, "forward_rows", lambda *a, **k: forwards.append(1) or real(*a, **k))
    lm = KVEvalLM(pretrained=model, tokenizer=tokenizer, policy="none", batch_size=2)
    with pytest.raises(UnsupportedModelError, match="use batch_size=1"):
        lm.loglikelihood(ll_requests(pairs))
    assert forwards == []
    lm = KVEvalLM(pretrained=model, tokenizer=tokenizer, policy="none", batch_size=1)
    assert len(lm.loglikelihood(ll_requests(pairs))) == 2 and forwards


@pytest.mark.parametrize("name", ["bamba", "qwen3_next"])
def test_none_on_state_layer_models_matches_stock_hflm(tokenizer, name):
    """Mamba and gated-delta layers: continuations of different lengths in one batch are each scored with no
    padding in their states (kveval.runner.generation.forward_rows), as stock HFLM scores them (right-padded, one
    forward each); the padded continuations scored other log-likelihoods before, without a word."""
    from tiny_models import tiny_model as tiny_architecture

    def model(attn):
        built = tiny_architecture(name, attn=attn, vocab_size=len(tokenizer))
        built.generation_config.eos_token_id = tokenizer.eos_token_id
        return built

    reference = HFLM(pretrained=model("eager"), tokenizer=tokenizer, batch_size=1).loglikelihood(ll_requests(PAIRS))
    for compress in ("context", "query"):
        lm = KVEvalLM(pretrained=model("kveval"), tokenizer=tokenizer, policy="none", compress=compress, batch_size=4,
                      kv_dtype="float32")
        for (a, greedy_a), (b, greedy_b) in zip(lm.loglikelihood(ll_requests(PAIRS)), reference):
            assert a == pytest.approx(b, abs=1e-4), compress
            assert greedy_a == greedy_b


# --- from Python, and the device recorded --------------------------------------------------------

def test_simple_evaluate_takes_a_kvevallm_object(tokenizer, tmp_path):
    """docs/lm-eval.md's route from Python: ``lm_eval.simple_evaluate(model=KVEvalLM(...))`` runs the task through
    kveval's cache and records the policy and its measured bytes."""
    from lm_eval.tasks import TaskManager

    tasks = write_tasks(tmp_path / "tasks")
    lm = KVEvalLM(pretrained=tiny_model(tokenizer), tokenizer=tokenizer, policy="window(4)", question_marker="\\n\\n")
    results = lm_eval.simple_evaluate(model=lm, tasks=["kvtest_mc"], limit=3, log_samples=True,
                                      task_manager=TaskManager(include_path=[str(tasks)], include_defaults=False))
    config = results["config"]
    assert config["kveval_policy"] == "window(size=4)" and config["kveval_compress"] == "context"
    assert config["kveval_measured_requests"] == 3 * 3  # 3 documents x 3 choices, every one through kveval's cache
    assert 0 < config["kveval_measured_bytes_per_token"] < config["kveval_nominal_bytes_per_token"]
    assert set(results["results"]) == {"kvtest_mc"} and len(results["samples"]["kvtest_mc"]) == 3


def _settled(monkeypatch, available: str, device=None, model_args=None, config=None) -> str:
    """``args.device`` after :func:`kveval.lm_eval.__main__._settle_device`, on a machine whose ``auto`` device is
    ``available`` (``cpu``: no CUDA)."""
    import argparse

    import kveval.modeling.sources
    from kveval.lm_eval.__main__ import _settle_device

    monkeypatch.setattr(kveval.modeling.sources, "resolve_device_dtype", lambda: (available, None))
    args = argparse.Namespace(model="kveval", device=device, model_args=model_args or {}, config=config)
    _settle_device(args)
    return args.device


def test_the_wrapper_hands_lm_eval_the_device_that_runs(monkeypatch, tmp_path):
    """lm-eval records the device it is handed, and hands cuda:0 when given none: a CPU run recorded cuda:0."""
    assert _settled(monkeypatch, "cpu") == "cpu"  # no device given, no CUDA: the CPU, not lm-eval's cuda:0
    assert _settled(monkeypatch, "cuda") == "cuda"
    assert _settled(monkeypatch, "cuda", device="cpu") == "cpu"  # the user's choice is kept
    assert _settled(monkeypatch, "cuda", model_args={"pretrained": "x", "device": "cpu"}) == "cpu"  # what the model takes
    assert _settled(monkeypatch, "cpu", model_args={"device": "auto"}) == "cpu"
    yaml_config = tmp_path / "run.yaml"
    yaml_config.write_text("device: cpu\n")
    assert _settled(monkeypatch, "cuda", config=str(yaml_config)) == "cpu"
    with pytest.raises(UsageError, match="device cuda:0 was asked for, but CUDA is not available"):
        _settled(monkeypatch, "cpu", device="cuda:0")  # asked for explicitly: refused, not quietly run elsewhere
    with pytest.raises(UsageError, match="give the device once"):
        _settled(monkeypatch, "cuda", device="cuda:1", model_args={"device": "cpu"})


@pytest.mark.slow
def test_a_cpu_run_with_no_device_records_the_device_that_ran(tokenizer, monkeypatch, tmp_path, caplog):
    """``kveval lm-eval`` with no ``--device`` printed "device=cuda:0 requested but CUDA is not available" on a CPU
    and recorded ``"device": "cuda:0"``; it records the device that ran, and says nothing of CUDA."""
    import kveval.runner.models
    from kveval.commands.main import main
    from kveval.modeling.sources import resolve_device_dtype

    monkeypatch.setattr(kveval.runner.models, "load_model", lambda *args, **kwargs: (tiny_model(tokenizer), tokenizer))
    tasks = write_tasks(tmp_path / "tasks")
    code = main(["lm-eval", "--model", "kveval", "--model_args", "pretrained=tiny,policy=window(4)",
                 "--tasks", "kvtest_mc", "--include_path", str(tasks), "--limit", "2", "--output_path", str(tmp_path / "out")])
    assert code == 0
    (results,) = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(results.read_text())["config"]["device"] == resolve_device_dtype()[0]  # "cpu" without CUDA
    assert "CUDA is not available" not in caplog.text
