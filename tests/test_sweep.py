"""The sweep on the embedded model: kill it halfway, rerun, and get what an uninterrupted run gets."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kveval.errors import ConfigError
from kveval.runs.records import read_items
from kveval.sweep.config import load_config

pytestmark = pytest.mark.slow

CONFIG = """
name: resume-test
models: [smollm2-135m]
batch_size: 2
policies: [window(32)]
probes: {families: [passkey], lengths: [256], depths: [0.5], n: 3}
"""


def _sweep(config: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kveval", "sweep", str(config), "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _items(out: Path) -> dict:
    found = {}
    for run in sorted((out / "runs").glob("*/*")):
        for r in read_items(run):
            key = (run.name, r.id)
            assert key not in found, f"duplicated item {key}"
            found[key] = (r.answer, r.score, r.category, r.metrics["kv_bytes"])
    return found


def test_killed_sweep_resumes_to_the_uninterrupted_result(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text(CONFIG)
    whole = _sweep(config, tmp_path / "whole")
    assert whole.wait(timeout=600) == 0, whole.stdout.read()
    output = whole.stdout.read()
    assert "gate verdict:" in output and "| model | policy |" in output

    killed = _sweep(config, tmp_path / "killed")
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once some, not all, items are written
        written = sum(len(p.read_text().splitlines()) for p in (tmp_path / "killed").glob("runs/*/*/items.jsonl"))
        if written >= 3:
            break
        time.sleep(0.2)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    partial = sum(len(p.read_text().splitlines()) for p in (tmp_path / "killed").glob("runs/*/*/items.jsonl"))
    assert 3 <= partial < 6
    # A half-written line, as a kill in the middle of a write would leave.
    next((tmp_path / "killed").glob("runs/*/none/items.jsonl")).open("a").write('{"id": "passkey-256')

    resumed = _sweep(config, tmp_path / "killed")
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()
    assert _items(tmp_path / "killed") == _items(tmp_path / "whole")
    manifest = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert manifest["config_hash"] == load_config(config).hash and manifest["versions"]["torch"]
    for name in ("leaderboard.md", "leaderboard.csv", "leaderboard.html"):
        assert (tmp_path / "killed" / "report" / name).is_file()
    assert (tmp_path / "killed" / "gate" / "gate.xml").is_file()


def test_same_folder_with_another_config_is_refused(tmp_path):
    config = tmp_path / "a.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"config_hash": "something-else"}))
    from kveval.commands.main import main

    assert main(["sweep", str(config), "--out", str(out)]) == 2


@pytest.mark.parametrize("text, message", [
    ("policies: [bogus(1)]", "unknown policy"),
    ("policies: [kivi(bits=4)]\nprobes: {families: [nope]}", "unknown probe family"),
    ("policies: []", "at least one policy"),
    ("policies: [kivi(bits=4)]\ncolour: red", "unknown key"),
])
def test_bad_sweep_configs_are_one_line_errors(tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(config)


# Values of the wrong type: each was read without a word (a string iterated by character, true as 1, 2.5 as 2)
# or failed deep in a run (a TypeError: exit 2 as an internal error, "this is a bug in kveval").
@pytest.mark.parametrize("line, message", [
    ("batch_size: '8'", "batch_size='8' must be a whole number >= 1"),
    ("batch_size: true", "batch_size=True must be a whole number >= 1"),
    ("batch_size: 0", "batch_size=0 must be a whole number >= 1"),
    ("models: smollm2-135m", "models must be a list"),
    ("policies: kivi(bits=4)", "policies must be a list"),
    ("probes: {n: 2.5}", "probes.n=2.5 must be a whole number >= 1"),
    ("probes: {n: null}", "probes.n=None must be a whole number >= 1"),
    ("probes: {lengths: '384'}", "probes.lengths must be a list"),
    ("probes: {lengths: [384.0]}", r"probes.lengths\[0\]=384.0 must be a whole number >= 1"),
    ("probes: {depths: [1.5]}", r"probes.depths\[0\]=1.5 must be a number in \[0, 1\]"),
    ("probes: {depths: ['0.5']}", r"probes.depths\[0\]='0.5' must be a number in \[0, 1\]"),
    ("probes: {families: passkey}", "probes.families must be a list"),
    ("probes: {seed: 1.5}", "probes.seed=1.5 must be a whole number"),
    ("seed: yes", "seed=True must be a whole number"),
    ("probes: [passkey]", "probes must be a mapping"),
    ("probes: {params: 3}", "probes.params must be a mapping"),
    ("name: [a, b]", "name must be a string"),
    ("out: 3", "out must be a string"),
    ("gate: 5", "gate must be a string"),
    ("probes: {families: [[passkey]]}", r"probes.families\[0\] must be a string"),
    ("lm_eval: {tasks: hellaswag}", "lm_eval.tasks must be a list"),
    ("lm_eval: {tasks: [3]}", r"lm_eval.tasks\[0\] must be a string"),
    ("lm_eval: {tasks: [a], limit: true}", r"lm_eval.limit=True must be a whole number >= 1 or a fraction in \(0, 1\]"),
    ("lm_eval: {tasks: [a], limit: 1.5}", r"lm_eval.limit=1.5 must be a whole number >= 1 or a fraction in \(0, 1\]"),
    ("lm_eval: {tasks: [a], model_args: x}", "lm_eval.model_args must be a mapping"),
    ("lm_eval: {tasks: [a], metadata: [1]}", "lm_eval.metadata must be a mapping"),
])
def test_sweep_config_values_of_the_wrong_type_are_one_line_errors(tmp_path, line, message):
    config = tmp_path / "bad.yaml"
    base = {"policies": "policies: [kivi(bits=4)]"}
    key = line.split(":")[0]
    config.write_text("\n".join([line] + [v for k, v in base.items() if k != key]) + "\n")
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(config)
    assert "\n" not in str(refused.value)
    from kveval.commands.main import main

    assert main(["sweep", str(config), "--out", str(tmp_path / "out"), "--quiet"]) == 2


def test_lm_eval_tasks_listed_in_a_sweep_join_each_run(tmp_path):
    config = tmp_path / "lm.yaml"
    config.write_text("""
name: lm
models: [smollm2-135m]
policies: [window(16)]
probes: {families: [passkey], lengths: [256], depths: [0.5], n: 1}
lm_eval: {tasks: [kveval_niah_multikey_mc], limit: 3, model_args: {question_marker: "\\n\\n"}, metadata: {length: 256, n: 3}}
""")
    from kveval.commands.main import main

    assert main(["sweep", str(config), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    runs = {p.name: read_items(p) for p in (tmp_path / "out" / "runs" / "smollm2-135m").iterdir()}
    for records in runs.values():
        mc = [r for r in records if r.task == "kveval_niah_multikey_mc"]
        assert len(mc) == 3 and all(r.logprob_gold is not None for r in mc)
    base = {r.id: r.hash for r in runs["none"]}
    assert all(base[r.id] == r.hash for r in runs["window_size-16"])  # paired on the same prompts


def test_a_deployment_question_that_cannot_be_asked_is_refused_before_the_sweep(tmp_path, monkeypatch, capsys):
    """A bad --gpu-memory was read after every model had run, and its error kept the gate's outputs from being
    written; it is refused before any model loads."""
    from kveval.commands import main as cli
    from kveval.errors import UsageError
    from kveval.runner import models

    loaded = []

    def fake_load_model(name, **kwargs):
        loaded.append(name)
        raise UsageError("stop here")

    monkeypatch.setattr(models, "load_model", fake_load_model)
    argv = ["sweep", "configs/quickstart.yaml", "--out", str(tmp_path / "run"), "--gpu-memory", "80 gigs", "--context", "8192"]
    assert cli.main(argv) == 2
    assert "is not a size" in capsys.readouterr().err and loaded == []


@pytest.mark.parametrize("damage", ["latin1-config", "latin1-gate", "manifest-json", "manifest-list", "eval-runs"])
def test_a_folder_or_file_that_is_not_what_it_claims_is_one_line(tmp_path, monkeypatch, capsys, damage):
    """A non-UTF-8 config or gate file and a damaged or foreign manifest.json were internal errors (a traceback);
    runs in a folder without a manifest (kveval eval's) were taken over and gated with the sweep's own items."""
    from kveval.commands import main as cli
    from kveval.errors import UsageError
    from kveval.runner import models

    def no_model(name, **kwargs):
        raise UsageError("stop here: no model is loaded in this test")

    monkeypatch.setattr(models, "load_model", no_model)
    config, out = tmp_path / "sweep.yaml", tmp_path / "out"
    config.write_text(CONFIG)
    if damage == "latin1-config":
        config.write_bytes(CONFIG.encode() + "# caf\xe9\n".encode("latin-1"))
    elif damage == "latin1-gate":
        gate = tmp_path / "gate.yaml"
        gate.write_bytes("margin: 0.1 # caf\xe9\n".encode("latin-1"))
        config.write_text(CONFIG + f"gate: {gate}\n")
    else:
        out.mkdir()
        if damage == "manifest-json":
            (out / "manifest.json").write_text("{not json")
        elif damage == "manifest-list":
            (out / "manifest.json").write_text("[1, 2]")
        else:
            (out / "runs" / "smollm2-135m" / "none").mkdir(parents=True)
    code = cli.main(["sweep", str(config), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "internal error" not in err and "Traceback" not in err
    if damage.startswith("latin1"):  # the gate file too is read before any model runs
        assert "not UTF-8 text" in err and "stop here" not in err
    else:
        assert "pass --out to a new folder" in err and "stop here" not in err


def test_a_sweep_resumed_under_other_code_says_so(tmp_path, monkeypatch, capsys):
    """The manifest was overwritten on every resume: a sweep stopped, then resumed after an upgrade (a scoring
    fix, a new torch) held items of two versions under a manifest naming only the last. It now keeps the code the
    sweep started under and warns when it resumes under other code."""
    from kveval.commands import main as cli
    from kveval.errors import UsageError
    from kveval.runner import models

    def no_model(name, **kwargs):
        raise UsageError("stop here: no model is loaded in this test")

    monkeypatch.setattr(models, "load_model", no_model)
    config, out = tmp_path / "sweep.yaml", tmp_path / "out"
    config.write_text(CONFIG)
    assert cli.main(["sweep", str(config), "--out", str(out)]) == 2
    assert "warning" not in capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert "started_under" not in manifest  # the first start: nothing to compare
    manifest["git_commit"], manifest["versions"]["torch"] = "0123456789abcdef", "1.0.0"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["sweep", str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "was started under kveval" in err and "(0123456789), torch 1.0.0" in err
    resumed = json.loads((out / "manifest.json").read_text())
    assert resumed["started_under"]["git_commit"] == "0123456789abcdef" and resumed["started_under"]["torch"] == "1.0.0"
    assert cli.main(["sweep", str(config), "--out", str(out)]) == 2  # still named as started, resumed again
    assert "was started under kveval" in capsys.readouterr().err
