"""One prefill for every policy of a sweep's lm-eval tasks, and the sweep's ``fidelity`` key (issue 16).

Tiny random Llama with the SmolLM2 vocabulary (:func:`test_lm_eval.tiny_model`), the packaged tasks under
``tasks/`` (``kveval_niah_single``: generate_until; ``kveval_niah_multikey_mc``: loglikelihood).
"""

import dataclasses
import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from test_lm_eval import tiny_model  # noqa: E402

from kveval.cache.compressed import CompressedCache  # noqa: E402
from kveval.lm_eval import tasks_dir  # noqa: E402
from kveval.lm_eval.model import KVEvalLM  # noqa: E402
from kveval.lm_eval.responses import ResponseStore  # noqa: E402
from kveval.runner.runspec import RunSpec  # noqa: E402
from kveval.runs.records import iter_items  # noqa: E402

from cache_runs import specs_of

TASKS = ["kveval_niah_single", "kveval_niah_multikey_mc"]
#: Baseline, selection + quantization stacked, eviction by accumulated attention, the random control.
POLICIES = ["none", "snapkv(ratio=0.5,window=2)+kivi(bits=4,residual=2)", "h2o(ratio=0.5)", "random(ratio=0.5)"]
METADATA = {"length": 256, "n": 2, "seed": 0}
SAMPLE_KEYS = ("doc_id", "prompt_hash", "resps", "filtered_resps", "metrics", "filter", "target")


@pytest.fixture(scope="module")
def tokenizer():
    from kveval.modeling.sources import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer)


@pytest.fixture(scope="module")
def manager():
    from kveval.sweep.run import _task_manager

    return _task_manager(str(tasks_dir()), json.dumps(METADATA, sort_keys=True))  # the one the sweep's runs reuse


def _evaluate(lm, task, manager):
    return lm_eval.simple_evaluate(model=lm, tasks=[task], limit=2, log_samples=True, task_manager=manager,
                                   gen_kwargs="max_gen_toks=12", random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def _samples(output):
    return {task: [{k: row[k] for k in SAMPLE_KEYS} for row in rows] for task, rows in sorted(output["samples"].items())}


def _measured(lm):
    return {k: v for k, v in lm.get_model_info().items() if k.startswith("kveval_measured")}


@pytest.mark.parametrize("mode", ["context", "query"])
def test_shared_prefill_samples_equal_separate_runs(model, tokenizer, manager, mode, monkeypatch):
    specs = [RunSpec.parse(p, mode=mode) for p in POLICIES]
    separate = {}
    for spec in specs:
        lm = KVEvalLM(pretrained=model, tokenizer=tokenizer, policy=spec, batch_size=2, question_marker="\\n\\n")
        separate[spec.key] = ([_samples(_evaluate(lm, task, manager)) for task in TASKS], _measured(lm))

    derived = []
    monkeypatch.setattr(CompressedCache, "derive", lambda self, p, _d=CompressedCache.derive: derived.append(1) or _d(self, p))
    prefills = []
    original_prefill = KVEvalLM._prefill
    monkeypatch.setattr(KVEvalLM, "_prefill", lambda self, *a: prefills.append(1) or original_prefill(self, *a))
    store = ResponseStore()
    lms = [KVEvalLM(pretrained=model, tokenizer=tokenizer, policy=spec, batch_size=2, question_marker="\\n\\n") for spec in specs]
    shared = {spec.key: [] for spec in specs}
    for task in TASKS:
        for n, (spec, lm) in enumerate(zip(specs, lms)):
            lm.share_prefill(specs[n + 1:], store)
            shared[spec.key].append(_samples(_evaluate(lm, task, manager)))
        assert len(store) == 0  # every answer left for a later policy was served
    for spec, lm in zip(specs, lms):
        assert shared[spec.key] == separate[spec.key][0], spec.key  # resps, filtered_resps, metrics: token for token
        assert _measured(lm) == separate[spec.key][1], spec.key  # measured bytes, byte for byte
    # One batch (2 docs) per task: ONE loglikelihood prefill served all 4 policies (separately: 4), and every
    # policy's cache was derived from a shared prefill, once per task.
    assert len(prefills) == 1 and len(derived) == len(TASKS) * len(specs)


def test_compression_changes_scores_so_equality_is_not_trivial(model, tokenizer, manager):
    """The exactness test compares different answers per policy: the policies do change log-likelihoods."""
    outputs = {}
    for policy in ("none", "window(8)"):
        lm = KVEvalLM(pretrained=model, tokenizer=tokenizer, policy=policy, batch_size=2, question_marker="\\n\\n")
        outputs[policy] = _samples(_evaluate(lm, "kveval_niah_multikey_mc", manager))
    resps = {p: [r["resps"] for rows in o.values() for r in rows] for p, o in outputs.items()}
    assert resps["none"] != resps["window(8)"]


def _sweep_records(run_dir):
    return sorted((dataclasses.asdict(r) for r in iter_items(run_dir)), key=lambda r: json.dumps(r, sort_keys=True))


def test_sweep_lm_eval_resumes_between_policies_without_recomputing_or_duplicating(model, tokenizer, tmp_path, monkeypatch):
    from kveval.sweep.run import run_lm_eval_tasks

    tasks = ["kveval_niah_multikey_mc", "kveval_kv_retrieval_mc"]  # loglikelihood: quick; generate_until is tested above
    settings = {"tasks": tasks, "limit": 2, "metadata": METADATA, "model_args": {"question_marker": "\\n\\n"}}
    specs = [RunSpec.parse(p) for p in POLICIES[:3]]

    def folders(root):
        dirs = [root / s.spec for s in specs]
        for d in dirs:  # as the sweep leaves them: probe items written (none here), lm-eval tasks next
            d.mkdir(parents=True)
            (d / "items.jsonl").touch()
        return dirs

    alone = folders(tmp_path / "alone")
    for spec, d in zip(specs, alone):
        run_lm_eval_tasks(model, tokenizer, [spec], [d], settings, 2, 0)

    calls = []
    real = lm_eval.simple_evaluate

    def dies_on_the_second_policy(**kwargs):
        calls.append(kwargs["model"].runspec.key)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between two policies of one prefill")
        return real(**kwargs)

    killed = folders(tmp_path / "killed")
    monkeypatch.setattr(lm_eval, "simple_evaluate", dies_on_the_second_policy)
    with pytest.raises(KeyboardInterrupt):
        run_lm_eval_tasks(model, tokenizer, specs, killed, settings, 2, 0)
    assert [len(list(iter_items(d))) for d in killed] == [2, 0, 0]
    calls.clear()
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kwargs: calls.append(kwargs["model"].runspec.key) or real(**kwargs))
    run_lm_eval_tasks(model, tokenizer, specs, killed, settings, 2, 0)
    # The finished (policy, task) is not recomputed; the others run once each.
    assert len(calls) == len(specs) * len(tasks) - 1
    for a, b in zip(alone, killed):
        assert _sweep_records(b) == _sweep_records(a), b.name  # no item lost or duplicated, each equal to a separate run


# --- fidelity: true in sweep configs -------------------------------------------------------------

FIDELITY_CONFIG = """
name: fid
models: [smollm2-135m]
policies: [window(16), kivi(bits=4)]
mode: {mode}
fidelity: true
probes: {{families: [passkey], lengths: [128], depths: [0.5], n: 2}}
"""


def test_fidelity_key_is_validated(tmp_path):
    from kveval.sweep.config import load_config

    path = tmp_path / "bad.yaml"
    path.write_text(FIDELITY_CONFIG.format(mode="context").replace("fidelity: true", "fidelity: 3"))
    with pytest.raises(ValueError, match="fidelity=3; use true"):
        load_config(path)
    path.write_text(FIDELITY_CONFIG.format(mode="context").replace("fidelity: true\n", ""))
    assert load_config(path).fidelity is False


@pytest.mark.parametrize("mode", ["context", "query"])
def test_sweep_fidelity_equals_kveval_eval_fidelity_and_resumes(model, tokenizer, tmp_path, mode):
    from kveval.runner.evaluate import evaluate_policies
    from kveval.runs.fidelity import FIDELITY_FILE
    from kveval.sweep.config import load_config
    from kveval.sweep.run import CellRunner, plan_cells, sweep_items

    path = tmp_path / "fid.yaml"
    path.write_text(FIDELITY_CONFIG.format(mode=mode))
    config = load_config(path)
    runner = CellRunner(config, tmp_path / "sweep", quiet=True)
    runner._loaded = ("smollm2-135m", model, tokenizer)  # the tiny model stands in for the embedded one
    (cell,) = plan_cells(config)
    dirs = runner(cell).run_dirs
    reference = evaluate_policies(model, tokenizer, sweep_items(config, tokenizer), specs_of(list(cell.specs)), tmp_path / "eval",
                                  "smollm2-135m", config.batch_size, config.seed, fidelity=True)
    for got, want in zip(dirs, reference):
        got_file, want_file = Path(got) / FIDELITY_FILE, want / FIDELITY_FILE
        if want.name == "none":
            assert not got_file.exists() and not want_file.exists()
            continue
        assert got_file.read_text() == want_file.read_text() and want_file.read_text().count("\n") == 2

    # A killed fidelity pass (one line missing) makes the cell unfinished; rerunning fills only that line.
    first = f"{dirs[1]}/{FIDELITY_FILE}"
    lines = open(first).read().splitlines(keepends=True)
    open(first, "w").write(lines[0])
    assert runner._finished(cell, sweep_items(config, tokenizer)) is None
    runner(cell)
    assert open(first).read() == "".join(lines)
    assert runner._finished(cell, sweep_items(config, tokenizer)) is not None
