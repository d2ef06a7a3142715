"""Fault injection on copies of results/quickstart: runs cut short, copied over, stale gate files, config mistakes,
other models' runs, closed pipes, extreme plan arguments and out-of-range lengths.

Every case ends the way kveval promises (:mod:`kveval.errors`): a verdict only on the data it names, else one line
naming the fix and exit 2, and results already written kept. No model runs: the runs are the committed ones,
damaged here in ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kveval.commands import main as cli

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "results" / "quickstart"
RUNS = QUICKSTART / "runs" / "smollm2-135m"
GATE_CPU = REPO / "configs" / "gate-cpu.yaml"
BASE, QUANT, RANDOM = "none", "quant_bits-8_group-16", "random_ratio-0.5"


def copy_runs(tmp_path: Path, *names: str, folder: str = "runs/smollm2-135m") -> dict[str, Path]:
    """Copies of the quickstart's run folders ``names`` under ``tmp_path/folder``."""
    out = {}
    for name in names:
        out[name] = tmp_path / folder / name
        shutil.copytree(RUNS / name, out[name])
    return out


def cut_items(run_dir: Path, keep: int) -> None:
    """Keep the first ``keep`` lines of ``items.jsonl``: a run cut short at a line boundary."""
    path = run_dir / "items.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:keep]))


def edit_run_json(run_dir: Path, edit) -> None:
    path = run_dir / "run.json"
    info = json.loads(path.read_text())
    edit(info)
    path.write_text(json.dumps(info, indent=2, sort_keys=True))


def kveval(capsys, *argv) -> tuple[int, str, str]:
    """Run the CLI in this process: (exit code, stdout, stderr)."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if "error" in line]
    assert lines and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


# ----------------------------------------------------------------------------- 1. runs that did not finish


@pytest.fixture
def truncated(tmp_path):
    """Baseline and quant copies, both cut to 100 of their 120 items at a line boundary (run.json records 120)."""
    runs = copy_runs(tmp_path, BASE, QUANT)
    for run_dir in runs.values():
        cut_items(run_dir, 100)
    return runs


def test_gate_refuses_runs_cut_at_a_line_boundary(truncated, capsys):
    code, out, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", truncated[BASE],
                            "--candidate", truncated[QUANT])
    assert code == 2 and "PASS" not in out
    one_line_error(err, str(truncated[BASE]), "holds 100 of 120 items")


def test_gate_refuses_a_truncated_candidate_of_a_whole_baseline(tmp_path, capsys):
    runs = copy_runs(tmp_path, BASE, QUANT)
    cut_items(runs[QUANT], 100)
    code, out, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs[BASE], "--candidate", runs[QUANT])
    assert code == 2 and "PASS" not in out
    one_line_error(err, str(runs[QUANT]), "holds 100 of 120 items")


def test_compare_and_report_refuse_truncated_runs(truncated, tmp_path, capsys):
    code, out, err = kveval(capsys, "compare", truncated[BASE], truncated[QUANT])
    assert code == 2
    one_line_error(err, "holds 100 of 120 items")
    code, out, err = kveval(capsys, "report", tmp_path, "--out", tmp_path / "o")
    assert code == 2 and not (tmp_path / "o" / "leaderboard.md").exists()
    one_line_error(err, "holds 100 of 120 items")


def killed_sweep_run(run_dir: Path, keep: int, expected: int | None) -> None:
    """A run as a SIGKILLed sweep leaves it: ``keep`` items written, run.json as opened (no finished count)."""
    cut_items(run_dir, keep)

    def opened(info):
        for key in ("items", "peak_kv_bytes", "ttft_s_mean", "decode_tokens_per_s_mean", "expected_items"):
            info["extra"].pop(key, None)
        info["bytes_per_token"] = info["nominal_bytes_per_token"] = None
        if expected is not None:
            info["extra"]["expected_items"] = expected
    edit_run_json(run_dir, opened)


@pytest.mark.parametrize("expected", [2, None], ids=["opened-with-its-count", "opened-before-counts-were-recorded"])
def test_a_killed_sweep_copied_aside_gets_no_verdict(tmp_path, capsys, expected):
    runs = copy_runs(tmp_path, BASE, QUANT, folder="aside/runs/smollm2-135m")
    for run_dir in runs.values():
        killed_sweep_run(run_dir, 1, expected)
    code, out, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs[BASE], "--candidate", runs[QUANT])
    assert code == 2 and "INCONCLUSIVE" not in out
    one_line_error(err, str(runs[BASE]), "holds 1 of 2 items" if expected else "did not finish")
    code, out, err = kveval(capsys, "report", tmp_path / "aside", "--out", tmp_path / "o")
    assert code == 2
    one_line_error(err, "holds 1 of 2 items" if expected else "did not finish")


def test_a_whole_run_still_gates(tmp_path, capsys):
    """Already passing: the committed runs, untouched, PASS as the quickstart's gate says."""
    runs = copy_runs(tmp_path, BASE, QUANT)
    code, out, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs[BASE], "--candidate", runs[QUANT])
    assert code == 0 and "gate: PASS" in out, err


def test_a_line_cut_mid_write_is_refused(tmp_path, capsys):
    """Already passing: a half-written last line (a killed writer) is refused."""
    runs = copy_runs(tmp_path, BASE, QUANT)
    path = runs[QUANT] / "items.jsonl"
    path.write_bytes(path.read_bytes()[:-40])
    code, out, err = kveval(capsys, "compare", runs[BASE], runs[QUANT])
    assert code == 2
    one_line_error(err, "truncated")


# ----------------------------------------------------------------------------- 2. verdicts of other data


def test_report_refuses_a_committed_gate_that_records_no_digest(tmp_path, capsys):
    """The issue's case: random's items copied over the quant run; the committed gate must not lend that run its PASS.
    The gate without a digest (written before gates recorded what they judged) is refused as such; the committed
    quickstart's gate records one, and its sequential runs hold 30 random items against quant's 120, so the copy is
    refused as a run cut short of its recorded decision."""
    runs = copy_runs(tmp_path, BASE, QUANT, RANDOM)
    shutil.copy(runs[RANDOM] / "items.jsonl", runs[QUANT] / "items.jsonl")
    code, out, err = kveval(capsys, "report", tmp_path / "runs", "--gate", QUICKSTART / "gate", "--out", tmp_path / "o")
    assert code == 2 and "PASS" not in out
    one_line_error(err, str(runs[QUANT]))
    gate = json.loads((QUICKSTART / "gate" / "gate.json").read_text())
    for result in gate.get("results", [gate]):
        for candidate in result["candidates"]:
            candidate.pop("judged", None)
    (tmp_path / "old-gate").mkdir()
    (tmp_path / "old-gate" / "gate.json").write_text(json.dumps(gate))
    runs = copy_runs(tmp_path / "fresh", BASE, QUANT, RANDOM)
    code, out, err = kveval(capsys, "report", tmp_path / "fresh" / "runs", "--gate", tmp_path / "old-gate", "--out",
                            tmp_path / "o2")
    assert code == 2 and "PASS" not in out
    one_line_error(err, "gate.json", "kveval gate", "--out")


def test_report_refuses_a_gate_judged_on_other_items(tmp_path, capsys):
    runs = copy_runs(tmp_path, BASE, QUANT, RANDOM)
    code, _, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs[BASE], "--candidate", runs[QUANT],
                          "--candidate", runs[RANDOM], "--out", tmp_path / "gate")
    assert code == 1, err  # random(ratio=0.5) FAILs
    judged = json.loads((tmp_path / "gate" / "gate.json").read_text())["candidates"][0]["judged"]
    assert judged["candidate"]["items"] == 120 and len(judged["candidate"]["items_sha256"]) == 64
    code, out, err = kveval(capsys, "report", tmp_path / "runs", "--gate", tmp_path / "gate", "--out", tmp_path / "o")
    assert code == 0 and "| PASS |" in out, err  # the gate's own runs: verdicts attached
    shutil.copy(runs[BASE] / "items.jsonl", runs[QUANT] / "items.jsonl")  # 120 items, other answers
    code, out, err = kveval(capsys, "report", tmp_path / "runs", "--gate", tmp_path / "gate", "--out", tmp_path / "o2")
    assert code == 2 and not (tmp_path / "o2" / "leaderboard.md").exists()
    one_line_error(err, str(runs[QUANT]), "other data", "kveval gate")


def test_report_refuses_a_gate_whose_baseline_changed(tmp_path, capsys):
    runs = copy_runs(tmp_path, BASE, QUANT)
    assert kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs[BASE], "--candidate", runs[QUANT],
                  "--out", tmp_path / "gate")[0] == 0
    path = runs[BASE] / "items.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[0])
    record.update(score=0.0, correct=False, category="fabricated", answer=" 12345")
    path.write_text(json.dumps(record, sort_keys=True) + "\n" + "".join(lines[1:]))
    code, out, err = kveval(capsys, "report", tmp_path / "runs", "--gate", tmp_path / "gate", "--out", tmp_path / "o")
    assert code == 2
    one_line_error(err, "baseline", "other data")


# ----------------------------------------------------------------------------- 3. gate and sweep config mistakes


def gate_with(tmp_path: Path, capsys, config_text: str, candidate: str = QUANT) -> tuple[int, str, str]:
    runs = copy_runs(tmp_path, BASE, candidate)
    config = tmp_path / "gate.yaml"
    config.write_text(config_text)
    return kveval(capsys, "gate", "--config", config, "--baseline", runs[BASE], "--candidate", runs[candidate])


@pytest.mark.parametrize("text, key", [
    ("margin: {default: 0.9, pasky: 0.01}\n", "margin.pasky"),
    ("margin: 0.9\nmax_mean_kl: {pasky: 0.01}\n", "max_mean_kl.pasky"),
])
def test_a_misspelt_task_in_a_per_task_map_is_refused(tmp_path, capsys, text, key):
    code, out, err = gate_with(tmp_path, capsys, text, RANDOM)  # pasky: 0.01 would have failed random on passkey
    assert code == 2 and "PASS" not in out
    one_line_error(err, key, "passkey", "niah_single")


def test_a_per_task_map_naming_the_runs_tasks_is_taken(tmp_path, capsys):
    """Already passing: a correct per-task margin applies to its task."""
    # random stopped at the first look of the sequential quickstart: a sequential gate judges its first block
    code, out, err = gate_with(tmp_path, capsys, "margin: {default: 0.9, passkey: 0.001}\nsequential: true\n", RANDOM)
    assert code == 1 and "FAIL" in out, err


@pytest.mark.parametrize("text", ["margin: 0.05\nmargin: 0.5\n", "margin: {default: 0.5, default: 0.05}\n"])
def test_a_repeated_key_in_a_gate_config_is_refused(tmp_path, capsys, text):
    code, out, err = gate_with(tmp_path, capsys, text)
    assert code == 2 and "gate:" not in out
    one_line_error(err, "margin" if text.startswith("margin: 0") else "default", "twice", "line")


def test_a_task_listed_twice_is_refused(tmp_path, capsys):
    code, out, err = gate_with(tmp_path, capsys, "margin: 0.1\ntasks: [passkey, passkey]\n")
    assert code == 2 and "gate:" not in out
    one_line_error(err, "passkey", "twice")


def test_a_repeated_key_in_a_sweep_config_is_refused(tmp_path):
    from kveval.errors import ConfigError
    from kveval.sweep.config import load_config

    path = tmp_path / "sweep.yaml"
    path.write_text("name: s\npolicies: [quant]\nprobes:\n  n: 2\n  n: 200\n")
    with pytest.raises(ConfigError, match=r"sweep.yaml: .*'n'.*twice"):
        load_config(path)


def test_every_yaml_kveval_reads_goes_through_the_strict_loader():
    """One loader refuses repeated keys: no module of kveval calls PyYAML's own loaders."""
    package = REPO / "kveval"
    calls = [f"{path.relative_to(REPO)}" for path in package.rglob("*.py") if path.name != "yaml_files.py"
             and any(f"yaml.{name}(" in path.read_text() for name in ("safe_load", "load", "full_load", "unsafe_load"))]
    assert calls == []


def test_yaml_merge_keys_stay_allowed(tmp_path):
    """Already passing: a key given by a merge (<<) and set again is YAML's override, not a repeat."""
    from kveval.yaml_files import load_yaml

    path = tmp_path / "x.yaml"
    path.write_text("base: &b {alpha: 0.05, power: 0.8}\nrules:\n  <<: *b\n  alpha: 0.01\n")
    assert load_yaml(path, "config")["rules"] == {"alpha": 0.01, "power": 0.8}


def test_a_sweep_refuses_a_gate_map_naming_none_of_its_families_before_it_runs(tmp_path):
    from kveval.errors import ConfigError
    from kveval.sweep.config import load_config

    (tmp_path / "gate.yaml").write_text("margin: {default: 0.1, pasky: 0.01}\n")
    (tmp_path / "sweep.yaml").write_text("name: s\npolicies: [quant]\ngate: gate.yaml\nprobes: {families: [passkey]}\n")
    with pytest.raises(ConfigError, match=r"margin.pasky.*passkey"):
        load_config(tmp_path / "sweep.yaml")


# ----------------------------------------------------------------------------- 4. runs of other models


def other_model(info):
    info["model_identity"].update(source="HuggingFaceTB/SmolLM2-360M", revision="main", hash="0badf00d")


@pytest.mark.parametrize("edit", [
    other_model,
    lambda info: info["model_identity"].update(revision="v2"),  # the same name and hash, another revision
], ids=["other-source", "other-revision"])
def test_runs_of_another_model_identity_are_not_paired(tmp_path, capsys, edit):
    runs = copy_runs(tmp_path, BASE, QUANT)
    edit_run_json(runs[QUANT], edit)
    code, out, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs[BASE], "--candidate", runs[QUANT])
    assert code == 2 and "PASS" not in out
    one_line_error(err, "different models", str(runs[QUANT]))
    code, out, err = kveval(capsys, "compare", runs[BASE], runs[QUANT])
    assert code == 2
    one_line_error(err, "different models")


def test_runs_of_another_model_name_are_not_paired(tmp_path, capsys):
    """Already passing: another model name is refused."""
    runs = copy_runs(tmp_path, BASE, QUANT)
    edit_run_json(runs[QUANT], lambda info: info.update(model="smollm2-360m"))
    code, out, err = kveval(capsys, "compare", runs[BASE], runs[QUANT])
    assert code == 2
    one_line_error(err, "different models")


# ----------------------------------------------------------------------------- 5. a reader that goes away


def kveval_into_closed_pipe(*argv, cwd: Path) -> subprocess.CompletedProcess:
    """``kveval ARGV | head -c 0``, deterministically: the pipe's only reader is gone before kveval prints."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("KVEVAL_DEBUG", None)
        return subprocess.run([sys.executable, "-m", "kveval", *map(str, argv)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=cwd, env=env, timeout=120)
    finally:
        os.close(write_end)


def test_a_closed_stdout_keeps_the_gates_files_and_exit_code(tmp_path):
    runs = copy_runs(tmp_path, BASE, QUANT, RANDOM)
    done = kveval_into_closed_pipe("gate", "--config", GATE_CPU, "--baseline", runs[BASE], "--candidate", runs[QUANT],
                                   "--candidate", runs[RANDOM], "--out", tmp_path / "g", cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # random FAILs: the verdict's code, not an error's
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["gate.json", "gate.md", "gate.xml"]
    assert json.loads((tmp_path / "g" / "gate.json").read_text())["status"] == "FAIL"


def test_a_closed_stdout_ends_a_listing_quietly(tmp_path):
    done = kveval_into_closed_pipe("policies", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_the_gate_writes_its_files_before_it_prints(tmp_path, capsys, monkeypatch):
    """Whatever stops the printing (a closed pipe, a full terminal), the files are already there."""
    import builtins

    runs = copy_runs(tmp_path, BASE, QUANT)
    seen = []
    real_print = builtins.print
    monkeypatch.setattr(builtins, "print", lambda *a, **k: (seen.append((tmp_path / "g" / "gate.json").exists()),
                                                            real_print(*a, **k)))
    code, out, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs[BASE], "--candidate", runs[QUANT],
                            "--out", tmp_path / "g")
    assert code == 0 and seen and all(seen), (seen, err)


# ----------------------------------------------------------------------------- 6. extreme plan arguments, typed configs


@pytest.mark.parametrize("flags, needle", [
    (["--alpha", "0"], "alpha"), (["--alpha", "1"], "alpha"), (["--alpha", "-0.5"], "alpha"),
    (["--alpha", "nan"], "alpha"), (["--power", "0"], "power"), (["--power", "1"], "power"),
    (["--margin", "1e-9"], "margin"), (["--margin", "0"], "margin"), (["--loss", "nan"], "loss"),
])
def test_extreme_plan_arguments_are_one_line(capsys, flags, needle):
    code, out, err = kveval(capsys, "gate", "--plan", "--config", GATE_CPU, *flags)
    assert code == 2 and out == ""
    one_line_error(err, needle)


def test_a_plan_within_bounds_still_plans(capsys):
    """Already passing: --plan at ordinary settings prints its table."""
    code, out, err = kveval(capsys, "gate", "--plan", "--config", GATE_CPU, "--margin", "0.05", "--alpha", "0.05",
                            "--power", "0.9")
    assert code == 0 and "items per task for 90% power" in out, err


@pytest.mark.parametrize("config, needle", [
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": "4096"},
     "hidden_size"),
    ({"num_hidden_layers": 32, "num_attention_heads": "32", "num_key_value_heads": 8, "hidden_size": 4096},
     "num_attention_heads"),
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
      "max_position_embeddings": "8192"}, "max_position_embeddings"),
    ({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
      "sliding_window": "4k"}, "sliding_window"),
])
def test_a_config_json_value_of_the_wrong_type_is_one_line(tmp_path, capsys, config, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = kveval(capsys, "memory", path, "--context", "8k")
    assert code == 2
    one_line_error(err, str(path), needle)


# ----------------------------------------------------------------------------- 7. lengths past the model's positions


@pytest.fixture
def nothing_generated(monkeypatch):
    """Fail the test where items are generated or weights load: a length must be refused before either."""
    import kveval.runner.models
    from kveval.probes.sets import ProbeSet

    def refuse(*args, **kwargs):
        raise AssertionError("generated items or loaded weights before checking the lengths")

    monkeypatch.setattr(ProbeSet, "items", refuse)
    monkeypatch.setattr(kveval.runner.models, "load_model", refuse)


def test_a_sweep_refuses_a_length_past_the_models_positions_before_generating(tmp_path, nothing_generated):
    from kveval.errors import UsageError
    from kveval.sweep.config import load_config
    from kveval.sweep.run import run_sweep

    path = tmp_path / "huge.yaml"
    path.write_text("name: huge\nmodels: [smollm2-135m]\npolicies: [quant]\nprobes: {lengths: [512, 10000000], n: 1}\n")
    with pytest.raises(UsageError, match=r"10000000.*smollm2-135m.*8192"):
        run_sweep(load_config(path), tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


def test_eval_refuses_a_length_past_the_models_positions_before_loading(tmp_path, capsys, nothing_generated):
    code, out, err = kveval(capsys, "eval", "--model", "smollm2-135m", "--policy", "quant", "--length", "10000000",
                            "--out", tmp_path / "out")
    assert code == 2
    one_line_error(err, "10000000", "8192")


def test_a_length_within_the_positions_passes_the_check():
    """Already passing in effect: lengths the model holds are not refused (the check reads no weights)."""
    from kveval.runner.runspec import check_lengths

    check_lengths("smollm2-135m", [384, 4096], "probes.lengths")


# ----------------------------------------------------------------------------- 8. unclear or silent


@pytest.mark.parametrize("policies", ["[quant(bits=8,group=16)]", "[none, snapkv(ratio=0.5, window=8), quant]"])
def test_a_spec_yaml_split_at_its_comma_is_named_with_the_quoted_form(tmp_path, policies):
    from kveval.errors import ConfigError
    from kveval.sweep.config import load_config

    path = tmp_path / "sweep.yaml"
    path.write_text(f"name: s\npolicies: {policies}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "YAML split" in message and "comma" in message, message
    spec = "quant(bits=8,group=16)" if "quant(" in policies else "snapkv(ratio=0.5,window=8)"
    assert f'"{spec}"' in message, message


def test_a_block_list_spec_keeps_its_comma(tmp_path):
    """Already passing: a spec on its own line of a block list is one YAML string, commas and all."""
    from kveval.sweep.config import load_config

    path = tmp_path / "sweep.yaml"
    path.write_text("name: s\npolicies:\n  - quant(bits=8,group=16)\n")
    assert [p.spec for p in load_config(path).policies] == ["quant(bits=8,group=16)"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_names_the_file_it_could_not_write(tmp_path, capsys):
    runs = copy_runs(tmp_path, BASE, QUANT)
    code, out, err = kveval(capsys, "compare", runs[BASE], runs[QUANT], "--json", "/dev/full")
    assert code == 2
    one_line_error(err, "/dev/full", "No space left")
    code, out, err = kveval(capsys, "memory", "smollm2-135m", "--context", "8k", "--json", "/dev/full")
    assert code == 2
    one_line_error(err, "/dev/full", "No space left")


def test_rescore_of_a_sweep_run_copied_aside_names_no_wrong_folder(tmp_path, capsys, monkeypatch):
    runs = copy_runs(tmp_path, BASE, folder="part")
    cut_items(runs[BASE], 100)
    monkeypatch.chdir(tmp_path)
    code, out, err = kveval(capsys, "rescore", "part/none")
    assert code == 2
    one_line_error(err, "quickstart", "kveval rescore CONFIG.yaml")
    assert "--out ." not in err and "manifest.json" in err


def test_rescore_of_a_run_inside_its_sweep_names_the_sweep_folder(tmp_path, capsys):
    """Already passing: a run inside its sweep folder names that folder."""
    sweep = tmp_path / "qs"
    copy_runs(sweep, BASE)
    shutil.copy(QUICKSTART / "manifest.json", sweep / "manifest.json")
    code, out, err = kveval(capsys, "rescore", sweep / "runs" / "smollm2-135m" / "none")
    assert code == 2
    one_line_error(err, f"--out {sweep}")


def test_the_planner_refuses_heads_that_do_not_divide_the_width(tmp_path, capsys):
    config = {"num_hidden_layers": 32, "num_attention_heads": 33, "num_key_value_heads": 11, "hidden_size": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = kveval(capsys, "memory", path, "--context", "8k")
    assert code == 2
    one_line_error(err, "33", "head_dim")
    path.write_text(json.dumps({**config, "head_dim": 128}))  # given explicitly: planned as given
    code, out, err = kveval(capsys, "memory", path, "--context", "8k")
    assert code == 0, err
