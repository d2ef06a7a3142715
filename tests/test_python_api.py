"""The Python API: ``import kveval`` stays cheap and torch-free, every exported name is documented, and the example
in docs/python-api.md runs as it stands."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kveval
from kveval.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "python-api.md"


def _python(code: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_import_kveval_is_torch_free_and_the_gate_needs_none(tmp_path):
    done = _python("import json, sys, kveval\n"
                   "before = 'torch' in sys.modules\n"
                   "gate = kveval.gate\n"
                   "print(json.dumps({'before': before, 'after_gate': 'torch' in sys.modules, 'callable': callable(gate),"
                   " 'names': sorted(kveval.API), 'dir': all(n in dir(kveval) for n in kveval.API)}))", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == {"before": False, "after_gate": False, "callable": True, "dir": True,
                                       "names": ["evaluate", "gate", "generate", "load_model", "parse_policy", "plan"]}


@pytest.mark.parametrize("name", sorted(kveval.API))
def test_every_exported_name_is_documented(name):
    value = getattr(kveval, name)
    assert (value.__doc__ or "").strip()
    assert f"kveval.{name}(" in kveval.__doc__ and f"kveval.{name}(" in DOC.read_text()
    if name == "gate":  # the gate's package, callable: what it calls is documented, and calling it calls it
        assert value.gate.__doc__.strip()
        with pytest.raises(ConfigError, match="no gate config named 'nope'"):
            value("base", ["candidate"], config="nope")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'evaluate_all'"):
        kveval.evaluate_all  # noqa: B018


def test_parse_policy_and_plan_take_spec_strings():
    assert kveval.parse_policy("snapkv(ratio=0.5)+kivi(bits=4)").spec == "snapkv(ratio=0.5)+kivi(bits=4)"
    from kveval.planner.memory import plan

    assert kveval.plan("llama-3.1-8b", 4096, 2, "kivi(bits=2)") == plan("llama-3.1-8b", 4096, 2,
                                                                         kveval.parse_policy("kivi(bits=2)"))


@pytest.mark.slow
def test_the_documented_example_runs_end_to_end(tmp_path):
    (example,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    done = _python(example, tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "snapkv(ratio=0.5)+kivi(bits=4)"
    runs = sorted((tmp_path / "runs" / "api-example" / "runs" / "smollm2-135m").iterdir())
    assert [run.name for run in runs] == ["none", "quant_bits-8_group-16"]
    assert all(len((run / "items.jsonl").read_text().splitlines()) == 3 for run in runs)
    assert "INCONCLUSIVE 3" in lines  # as the example says: three items decide nothing
    assert re.fullmatch(r"[\d,]+ B/token, [\d.]+ GiB \(uncompressed [\d.]+ GiB\)", lines[-1])
