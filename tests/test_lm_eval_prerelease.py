"""``kveval lm-eval`` under the newest lm-eval the package index serves, pre-releases included.

The suite itself runs on the pinned release (``pyproject.toml``); this test installs the newest lm-eval (``pip
install --pre``) into a throwaway virtual environment that sees this one's packages, so that a release kveval's pin
allows is exercised before users meet it. It runs the documented command on the embedded SmolLM2 with ``--limit 2``
and checks what the results file records. Where the index cannot be reached it skips, saying so.
"""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kveval.modeling.sources import resolve_device_dtype

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def newest_lm_eval(tmp_path_factory) -> tuple[Path, str]:
    """A virtual environment with the newest lm-eval on the index over this one's packages: its python, lm-eval's
    version there."""
    where = tmp_path_factory.mktemp("lm-eval-newest")
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(where)
    python = where / "bin" / "python"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--pre", "--no-deps",
                              "--disable-pip-version-check", "-q", "--timeout", "30", "--retries", "1", "lm-eval"],
                             capture_output=True, text=True)
    if install.returncode != 0:
        pytest.skip(f"the package index could not give the newest lm-eval: {install.stderr.strip()[-300:]}")
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return python, version


def test_kveval_lm_eval_runs_under_the_newest_lm_eval(newest_lm_eval, tmp_path):
    python, version = newest_lm_eval
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    done = subprocess.run(
        [str(python), "-m", "kveval", "lm-eval", "--model", "kveval",
         "--model_args", "pretrained=smollm2-135m,policy=snapkv(ratio=0.5),question_marker=\\n\\n",
         "--tasks", "kveval_niah_multikey_mc", "--limit", "2", "--output_path", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    recorded = json.loads(results.read_text())
    config = recorded["config"]
    assert recorded["lm_eval_version"] == version == config["lm_eval_version"]
    assert config["kveval_policy"] == "snapkv(ratio=0.5)"
    assert config["kveval_measured_requests"] == 8  # 2 documents x 4 choices, every one through kveval's cache
    assert 0.45 < config["kveval_measured_ratio"] < 0.55  # half the context removed, as the policy asks
    assert "kveval_niah_multikey_mc" in recorded["results"]
    assert config["device"] == resolve_device_dtype()[0]  # the device that ran, not lm-eval's default cuda:0
