"""lm-eval's data-parallel mode with ``--model kveval``: two CPU processes (``accelerate launch``, gloo) equal one.

A tiny random Llama with the SmolLM2 vocabulary is saved to a folder and
evaluated on two packaged tasks (``generate_until`` and multiple choice) with a
compressing policy, once in one process and once sharded over two. Five
documents per task split 3 + 2, so lm-eval pads the second rank: the padding
must neither change an answer nor be measured. ``accelerate launch --cpu``
starts a single process (several need MPI); ``--multi_gpu`` is accelerate's
torchrun launcher, which on this GPU-less machine starts CPU processes.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kveval.lm_eval.data_parallel import real_requests

REPO = Path(__file__).resolve().parent.parent
TASKS = "kveval_passkey,kveval_niah_multikey_mc"
POLICY = "snapkv(ratio=0.5,window=4)+kivi(bits=4)"


class Req:
    def __init__(self, repeats=1):
        self.repeats = repeats


def test_real_requests_drops_only_lm_evals_padding():
    a, b, c = Req(), Req(), Req(repeats=2)
    assert real_requests([a, b]) == 2
    assert real_requests([a, b, b, b]) == 2  # two padding slots: more copies of the last request object
    assert real_requests([a, c, c]) == 3  # c's own two repeats are real
    assert real_requests([a, c, c, c, c]) == 3  # one padding slot of c is its two repeats again
    assert real_requests([a, Req(), Req()]) == 3  # equal requests that are distinct objects are all real
    assert real_requests([]) == 0


def test_a_data_parallel_process_loads_the_whole_model_on_its_own_device():
    from types import SimpleNamespace

    from kveval.errors import UsageError
    from kveval.lm_eval.data_parallel import Launch

    launch = Launch(SimpleNamespace(device=torch.device("cpu")), rank=1, world_size=2)
    assert launch.placement({"revision": "main"}) == "cpu"
    for placement in ({"device_map": "auto"}, {"max_memory": {0: "20GiB"}}):
        with pytest.raises(UsageError, match="launch a single process for a model larger than one device"):
            launch.placement(placement)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from kveval.modeling.sources import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=False, dtype="bfloat16")
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _evaluate(folder: Path, out: Path, launcher: list[str]) -> dict:
    """Run the two tasks through ``launcher -m kveval.lm_eval``; the results JSON and samples by (task, doc_id)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = ["-m", "kveval.lm_eval", "--model", "kveval",
            "--model_args", f"pretrained={folder},policy={POLICY},dtype=float32",
            "--tasks", TASKS, "--metadata", json.dumps({"length": 256, "n": 5, "tokenizer": str(folder)}),
            "--limit", "5", "--batch_size", "2", "--device", "cpu", "--log_samples", "--output_path", str(out)]
    done = subprocess.run([*launcher, *args], capture_output=True, text=True, env=env, cwd=out.parent, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    computed = {}  # (rank, request method) -> requests that rank computed
    for rank, count, method in re.findall(r"rank (\d+) of \d+ computed (\d+) (\w+) requests", done.stderr):
        computed[int(rank), method] = computed.get((int(rank), method), 0) + int(count)
    (results_file,) = sorted(out.rglob("results_*.json"))
    samples = {}
    for path in sorted(out.rglob("samples_*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            samples[(path.name.split("_20")[0], row["doc_id"], row["filter"])] = row
    return {"results": json.loads(results_file.read_text()), "samples": samples, "computed": computed}


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's launcher is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU processes: the launcher would claim the GPUs")
def test_two_processes_equal_one(tiny_folder, tmp_path):
    one = _evaluate(tiny_folder, tmp_path / "one", [sys.executable])
    two = _evaluate(tiny_folder, tmp_path / "two",
                    ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                     "--mixed_precision", "no", "--dynamo_backend", "no"])
    assert len(one["samples"]) == 2 * 5
    # Each process computed a shard: 3 + 2 documents per task (lm-eval's padding of rank 1 is answered, not computed).
    assert one["computed"] == {}  # a single process is not a rank of a data-parallel run
    assert two["computed"][0, "generate_until"] == 3 and two["computed"][1, "generate_until"] == 2
    choices = sum(len(row["resps"]) for (task, _, _), row in one["samples"].items() if task.endswith("_mc"))
    assert two["computed"][0, "loglikelihood"] + two["computed"][1, "loglikelihood"] == choices
    assert set(two["samples"]) == set(one["samples"])  # every document once: no padding copy, none lost
    for key, row in one["samples"].items():
        other = two["samples"][key]
        assert other["prompt_hash"] == row["prompt_hash"]
        assert other["filtered_resps"] == row["filtered_resps"], key
        # lm-eval appends its padding copies' answers to the padded request's own resps (as for --model hf):
        # every request here has repeats 1, so the first answer is the request's, the rest must repeat it.
        assert [r[:1] for r in other["resps"]] == row["resps"], key
        assert all(answer == r[0] for r in other["resps"] for answer in r), key
    assert two["results"]["results"] == one["results"]["results"]
    measured = {k: v for k, v in one["results"]["config"].items() if k.startswith("kveval_measured")}
    assert measured["kveval_measured_requests"] == 5 + choices and 0 < measured["kveval_measured_bytes_per_token"]
    assert {k: two["results"]["config"][k] for k in measured} == measured
