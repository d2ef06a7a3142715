"""The second fault-injection audit's cases (issue 65), on copies of results/quickstart: a command writing into a
folder another command made, verdicts edited in gate.json, items that contradict themselves, user input that
reached an internal error, a closed standard output, and configs that would run the wrong thing.

Each case ends as kveval promises: one line naming the fix and exit 2 (or the verdict's own code), nothing written
already lost or changed. No model runs: every refusal comes before one would load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kveval.commands import main as cli

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "results" / "quickstart"
GATE_CPU = REPO / "configs" / "gate-cpu.yaml"
BASE, QUANT, RANDOM = "none", "quant_bits-8_group-16", "random_ratio-0.5"


def kveval(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def refused(code: int, err: str, *needles: str) -> None:
    """Exit 2 with one ``error`` line and no traceback, naming each of ``needles``."""
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert len([line for line in err.splitlines() if ": error: " in line]) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def sweep(tmp_path) -> Path:
    """A copy of the committed quickstart sweep folder."""
    out = tmp_path / "quickstart"
    shutil.copytree(QUICKSTART, out)
    return out


def edit_items(run_dir: Path, edit) -> None:
    path = run_dir / "items.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    edit(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ----------------------------------------------------------------------------- 1. a folder belongs to its command


def test_eval_refuses_to_write_into_a_finished_sweep_and_changes_nothing(sweep, capsys):
    before = tree_digest(sweep)
    code, _, err = kveval(capsys, "eval", "--policy", "knorm(ratio=0.5)", "--n", "5", "--out", sweep)
    refused(code, err, str(sweep), "kveval sweep", "quickstart", "--out a new folder")
    runs = sweep / "runs" / "smollm2-135m"
    for argv in (["report", runs, "--out", sweep / "report"],
                 ["gate", "--config", GATE_CPU, "--baseline", runs / BASE, "--candidate", runs / RANDOM, "--out",
                  sweep / "gate"]):
        code, _, err = kveval(capsys, *argv)
        refused(code, err, "holds the sweep 'quickstart'", f"kveval {argv[0]} does not write into it",
                "kveval rescore")
    assert tree_digest(sweep) == before
    code, _, err = kveval(capsys, "report", runs, "--out", sweep / "my-own-report")  # a folder of one's own: fine
    assert code == 0, err


@pytest.mark.parametrize("edit, needle", [
    (lambda raw: raw.update(policies=["none"]), "at least one policy to compare"),
    (lambda raw: raw.update(models=[]), "models: [] names no model"),
    (lambda raw: raw.update(name="../../escape"), "name='../../escape'"),
])
def test_a_config_that_would_run_the_wrong_thing_is_refused_before_any_model(tmp_path, capsys, monkeypatch, edit,
                                                                             needle):
    import yaml

    raw = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    raw["gate"] = str(GATE_CPU)
    edit(raw)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    code, _, err = kveval(capsys, "sweep", config)
    refused(code, err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # nothing written, no runs/ folder
    assert not (tmp_path.parent / "escape").exists()


# ----------------------------------------------------------------------------- 2. verdicts are derived, never trusted


@pytest.mark.parametrize("status", ["PASS", "LGTM"])
def test_report_refuses_a_gate_whose_verdict_was_edited(sweep, capsys, status):
    path = sweep / "gate" / "gate.json"
    data = json.loads(path.read_text())
    candidate = next(c for c in data["results"][0]["candidates"] if c["status"] == "FAIL")
    candidate["status"] = status
    path.write_text(json.dumps(data, indent=2))
    code, _, err = kveval(capsys, "report", sweep, "--gate", sweep / "gate", "--out", sweep.parent / "report2")
    refused(code, err, "gate.json", candidate["name"], f"status '{status}' recorded, the runs give 'FAIL'")
    assert not (sweep.parent / "report2" / "leaderboard.md").exists()


def test_report_shows_a_gate_whose_verdicts_its_runs_give(sweep, capsys):
    code, out, err = kveval(capsys, "report", sweep, "--gate", sweep / "gate", "--out", sweep.parent / "report2")
    assert code == 0, err
    board = (sweep.parent / "report2" / "leaderboard.md").read_text()
    assert "| PASS |" in board and "| FAIL |" in board


def test_a_gate_written_now_carries_a_digest_of_its_verdicts_and_an_edit_is_named(sweep, capsys):
    runs = sweep / "runs" / "smollm2-135m"
    code, _, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs / BASE, "--candidate",
                          runs / RANDOM, "--out", sweep.parent / "gate2")
    assert code == 1, err
    path = sweep.parent / "gate2" / "gate.json"
    data = json.loads(path.read_text())
    assert re.fullmatch(r"[0-9a-f]{64}", data["verdicts_sha256"])
    data["candidates"][0]["tasks"][0]["lower_bound"] = 0.5  # no verdict changes: only the digest shows the edit
    path.write_text(json.dumps(data, indent=2))
    code, _, err = kveval(capsys, "report", runs / BASE, runs / RANDOM, "--gate", path, "--out", sweep.parent / "r")
    refused(code, err, "edited after kveval wrote it", "verdicts_sha256")


def test_memory_refuses_an_edited_gate_and_another_models_gate(sweep, capsys):
    path = sweep / "gate" / "gate.json"
    code, out, err = kveval(capsys, "memory", "smollm2-135m", "--engine", "vllm", "--gpu-memory", "24GiB",
                            "--max-model-len", "8k", "--gate", path)
    assert code == 0, err
    code, _, err = kveval(capsys, "memory", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory", "80GiB",
                          "--max-model-len", "8k", "--gate", path)
    refused(code, err, "judged smollm2-135m, not llama-3.1-8b")
    data = json.loads(path.read_text())
    data["results"][0]["candidates"][0]["status"] = "FAIL"
    path.write_text(json.dumps(data))
    code, _, err = kveval(capsys, "memory", "smollm2-135m", "--engine", "vllm", "--gpu-memory", "24GiB",
                          "--max-model-len", "8k", "--gate", path)
    refused(code, err, "status 'FAIL' recorded, the runs give 'PASS'")


# ----------------------------------------------------------------------------- 3-5. one validation of runs and items


@pytest.mark.parametrize("edit, needle", [
    (lambda rows: rows[3]["metrics"].update(kv_bytes=-4608), "kv_bytes -4608 is not a byte count"),
    (lambda rows: rows[0].update(correct=True, score=0.0), "correct true with score 0.0"),
    (lambda rows: rows[5].update(category="teleported"), "category 'teleported' is not one of the taxonomy's"),
])
def test_items_that_contradict_themselves_are_refused_naming_the_item(sweep, capsys, edit, needle):
    runs = sweep / "runs" / "smollm2-135m"
    edit_items(runs / RANDOM, edit)
    for argv in (["gate", "--config", GATE_CPU, "--baseline", runs / BASE, "--candidate", runs / RANDOM],
                 ["report", runs / BASE, runs / RANDOM, "--out", sweep.parent / "r"],
                 ["compare", runs / BASE, runs / RANDOM]):
        code, _, err = kveval(capsys, *argv)
        refused(code, err, needle, str(runs / RANDOM))


def test_a_baseline_is_never_gated_against_itself(sweep, capsys):
    runs = sweep / "runs" / "smollm2-135m"
    code, _, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs / BASE, "--candidate", runs / BASE)
    assert code == 2 and "a baseline gated against itself" in err, err


def test_a_run_without_a_model_identity_is_not_paired_with_one_that_names_another(sweep, capsys):
    runs = sweep / "runs" / "smollm2-135m"
    path = runs / BASE / "run.json"
    info = json.loads(path.read_text())
    del info["model_identity"]
    path.write_text(json.dumps(info))
    cand = runs / QUANT / "run.json"
    info = json.loads(cand.read_text())
    info["model_identity"]["hash"] = "0ther0ne"
    cand.write_text(json.dumps(info))
    code, _, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs / BASE, "--candidate", runs / QUANT)
    assert code == 2 and "records no model identity" in err, err


# ----------------------------------------------------------------------------- 3. user input never reaches a bug


def test_a_gguf_path_that_is_not_gguf_is_refused_in_one_line(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a gguf")
    code, _, err = kveval(capsys, "generate", "--model", fake, "--prompt", "hello")
    refused(code, err, str(fake), "not a GGUF file")


def test_lm_eval_refuses_a_seed_that_is_not_a_whole_number():
    from kveval.errors import UsageError
    from kveval.lm_eval.arguments import whole_seed

    assert whole_seed("7") == 7 and whole_seed(-3) == -3
    for bad in ("abc", 1.5, True, "1e3"):
        with pytest.raises(UsageError, match="is not a whole number"):
            whole_seed(bad)


# ----------------------------------------------------------------------------- 6. a closed standard output


@pytest.mark.parametrize("argv, expected", [
    (["gate", "--config", GATE_CPU, "--baseline", "{runs}/none", "--candidate", "{runs}/random_ratio-0.5",
      "--out", "{tmp}/g"], 1),
    (["memory", "smollm2-135m", "--context", "8k"], 0),
])
def test_a_closed_stdout_still_gives_the_commands_own_exit_code(tmp_path, argv, expected):
    runs = QUICKSTART / "runs" / "smollm2-135m"
    argv = [a.format(runs=runs, tmp=tmp_path) if isinstance(a, str) else str(a) for a in argv]
    done = subprocess.run([sys.executable, "-m", "kveval", *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: os.close(1))  # the child starts with fd 1 closed, as `>&-` does
    assert done.returncode == expected, done.stderr
    assert "Traceback" not in done.stderr
    if argv[0] == "gate":
        assert json.loads((tmp_path / "g" / "gate.json").read_text())["status"] == "FAIL"


# ----------------------------------------------------------------------------- 8. the planner accepts only what can be


def test_a_storage_part_named_twice_is_refused(capsys):
    code, _, err = kveval(capsys, "memory", "deepseek-v3.2", "--context", "32k", "--storage",
                          "indexer=fp8-128,indexer=bf16")
    refused(code, err, "storage names indexer twice")


def test_more_kv_heads_than_attention_heads_is_refused(tmp_path, capsys):
    config = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 16,
              "hidden_size": 512, "max_position_embeddings": 4096, "vocab_size": 1000, "intermediate_size": 1024}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = kveval(capsys, "memory", tmp_path, "--context", "8k")
    refused(code, err, "num_key_value_heads 16 exceeds num_attention_heads 8")


# ----------------------------------------------------------------------------- 9. a parameter acts or is refused


@pytest.mark.parametrize("spec, needle", [
    ("knorm(ratio=0.5,floor=0.5)", "floor=0.5 acts only with adaptive=true"),
    ("sglang(kv_scale=1e-45)", "kv_scale=1e-45 is below the smallest normal"),
    ("kvquant(bits=4,calib_tokens=100000000)", "calib_tokens=100000000 is more than the calibration text"),
    ("vllm(scales=dynamic,calib_tokens=100000000)", "calib_tokens=100000000 is more than the calibration text"),
])
def test_a_parameter_that_would_do_nothing_is_refused_when_parsed(spec, needle):
    from kveval.errors import PolicySpecError
    from kveval.policies.spec import parse_policy

    with pytest.raises(PolicySpecError, match=re.escape(needle)):
        parse_policy(spec)


def test_adaptive_with_its_floor_and_a_scale_in_range_still_parse():
    from kveval.policies.spec import parse_policy

    assert parse_policy("knorm(ratio=0.5,adaptive=true,floor=0.5)").spec == "knorm(ratio=0.5,adaptive=true,floor=0.5)"
    assert parse_policy("sglang(kv_scale=0.5)").quantization.kv_scale == 0.5


@pytest.mark.parametrize("argv", [
    ["memory", "llama-3.1-8b", "--context", "8k", "--policy", "quant(bits=4,indexer=fp8)"],
    ["generate", "--model", "smollm2-135m", "--policy", "kivi(bits=4,indexer=native)", "--prompt", "hi"],
])
def test_an_indexer_term_on_a_model_without_an_indexer_is_refused_before_the_weights_load(capsys, argv):
    code, _, err = kveval(capsys, *argv)
    refused(code, err, "codes the DSA indexer's keys", "drop indexer=")


def test_one_size_grammar_for_the_deployment_context(capsys):
    """Issue 65: `gate --context 8k` was refused while `memory --context 8k` was read as 8,192 tokens."""
    runs = QUICKSTART / "runs" / "smollm2-135m"
    code, out, err = kveval(capsys, "gate", "--config", GATE_CPU, "--baseline", runs / BASE, "--candidate",
                            runs / QUANT, "--gpu-memory", "24GiB", "--context", "8k")
    assert code == 0 and "for 1 x 8192 tokens" in out, err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["gate", "--config", str(GATE_CPU), "--baseline", str(runs / BASE), "--candidate", str(runs / QUANT),
                  "--gpu-memory", "24GiB", "--context", "8q"])
    assert exit_.value.code == 2 and "'8q' is not a token count" in capsys.readouterr().err


def test_a_report_that_fails_part_way_leaves_the_previous_report_whole(tmp_path, capsys, monkeypatch):
    """Issue 65: the plots and four text formats are staged, then written together; a failure while rendering the
    last format leaves every file of the previous report byte for byte, and no staging folder behind."""
    from kveval.report import leaderboard

    runs = QUICKSTART / "runs" / "smollm2-135m"
    out = tmp_path / "report"
    code, _, err = kveval(capsys, "report", runs, "--out", out)
    assert code == 0, err
    before = tree_digest(out)
    assert {"leaderboard.md", "leaderboard.html", "score_vs_compression.png"} <= set(before)

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(leaderboard, "to_html", broken)
    code, _, err = kveval(capsys, "report", runs / BASE, runs / RANDOM, "--out", out)
    assert code == 2 and "No space left on device" in err, err
    assert tree_digest(out) == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before)
