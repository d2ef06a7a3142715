"""Pairing, comparison and the regression gate on fixture run folders."""

from __future__ import annotations

import hashlib
import json
import shutil
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests

from kveval.commands import main as cli
from kveval.errors import ConfigError
from kveval.gate.config import GateConfig, load_gate_config
from kveval.gate.rules import evaluate_gate
from kveval.gate.verdicts import FAIL, PASS
from kveval.runs.records import ItemRecord, ItemWriter, ResultFileError, RunInfo, write_run_info
from kveval.runs.results import load_run
from kveval.stats import paired
from kveval.stats.comparison import compare_runs

REPO = Path(__file__).resolve().parent.parent
GATE_YAML = REPO / "configs" / "gate.yaml"
WRONG = ["distractor", "fabricated", "empty"]


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    """Build the CLI with the analysis subcommands only (the others import torch and models)."""
    keep = {k: v for k, v in cli.COMMANDS.items() if k in ("compare", "gate", "report")}
    monkeypatch.setattr(cli, "COMMANDS", keep)


def baseline_items(n_niah: int = 80, n_passkey: int = 60) -> list[ItemRecord]:
    items = []
    for i in range(n_niah):
        ok = i % 10 not in (3, 7, 9)  # 70% right at baseline
        cat = "correct" if ok else WRONG[i % 3]
        items.append(
            ItemRecord(
                id=f"niah_multikey/{i}",
                hash=hashlib.sha256(f"niah prompt {i}".encode()).hexdigest()[:16],
                task="niah_multikey",
                score=1.0 if ok else 0.0,
                correct=ok,
                category=cat,
                answer="1234567" if ok else ("8412337" if cat == "distractor" else ""),
                gold=["1234567"],
                recalled="distractor:8412337" if cat == "distractor" else None,
                length=[500, 1010][i % 2] + (i % 4),
                depth=[0.0, 0.25, 0.5, 0.75, 1.0][(i // 2) % 5],
            )
        )
    for i in range(n_passkey):
        ok = i % 5 != 0
        items.append(
            ItemRecord(
                id=f"passkey/{i}",
                hash=hashlib.sha256(f"passkey prompt {i}".encode()).hexdigest()[:16],
                task="passkey",
                score=1.0 if ok else 0.0,
                correct=ok,
                category="correct" if ok else "fabricated",
                answer="42" if ok else "17",
                gold=["42"],
                length=700,
                depth=(i % 5) / 4,
            )
        )
    return items


def write_run(path: Path, items: list[ItemRecord], *, policy: str = "none", name: str | None = None, **info) -> Path:
    family = policy.split("(")[0] if policy != "none" else "none"
    write_run_info(
        path,
        RunInfo(
            name=name or f"smollm2-135m/{policy}",
            model=info.pop("model", "smollm2-135m"),
            policy=policy,
            family=family,
            **info,
        ),
    )
    with ItemWriter(path) as w:
        for it in items:
            w.write(it)
    return path


def plant_regression(items: list[ItemRecord], share: float = 0.3, task: str = "niah_multikey") -> list[ItemRecord]:
    """Flip `share` of the task's items from right to a distractor's value."""
    task_items = [it for it in items if it.task == task]
    n_flip = int(round(share * len(task_items)))
    targets = [it.id for it in task_items if it.correct][:n_flip]
    assert len(targets) == n_flip
    out = []
    for it in items:
        if it.id in targets:
            it = replace(it, score=0.0, correct=False, category="distractor", answer="8412337", recalled="distractor:8412337")
        out.append(it)
    return out


@pytest.fixture()
def runs(tmp_path):
    base_items = baseline_items()
    base = write_run(tmp_path / "base", base_items)
    same = write_run(tmp_path / "same", base_items, policy="snapkv(ratio=0.25)")
    bad = write_run(tmp_path / "bad", plant_regression(base_items), policy="snapkv(ratio=0.75)", ratio=0.75)
    return {"base": base, "same": same, "bad": bad, "items": base_items, "tmp": tmp_path}


# ----------------------------------------------------------------------------- compare


def test_compare_planted_regression(runs):
    rc = compare_runs(runs["base"], runs["bad"], n_resamples=2000)
    assert rc.n == 140 and rc.task_names == ["niah_multikey", "passkey"]
    niah = rc.task("niah_multikey")
    assert niah.n == 80 and niah.n_regressed == 24 and niah.n_improved == 0
    assert niah.delta == pytest.approx(-0.3)
    assert niah.ci_method == "tango" and niah.binary
    assert (niah.ci_low, niah.ci_high) == pytest.approx(paired.tango_interval(24, 0, 80), abs=1e-12)
    assert niah.ci_low < -0.3 < niah.ci_high < 0
    assert niah.negative_flip_rate == pytest.approx(0.3)
    assert niah.mcnemar_p == pytest.approx(mcnemar(np.array([[32, 24], [0, 24]]), exact=True).pvalue, abs=1e-12)
    assert niah.test == "mcnemar" and niah.pvalue == niah.mcnemar_p
    raw = [c.pvalue for c in rc.tasks]
    np.testing.assert_allclose([c.p_holm for c in rc.tasks], multipletests(raw, method="holm")[1], atol=1e-12)
    np.testing.assert_allclose([c.p_bh for c in rc.tasks], multipletests(raw, method="fdr_bh")[1], atol=1e-12)
    assert niah.confusion_delta["distractor"] == pytest.approx(0.3)
    assert niah.confusion_delta["correct"] == pytest.approx(-0.3)
    assert niah.agreement == pytest.approx(56 / 80)
    assert {r["category"] for r in niah.regressed} == {"distractor"}
    assert all(r["recalled"] == "distractor:8412337" for r in niah.regressed)
    passkey = rc.task("passkey")
    assert passkey.n_regressed == 0 and passkey.delta == 0 and passkey.pvalue == 1.0
    # zero discordance never gives a zero-width interval
    assert passkey.ci_low == pytest.approx(-(1.959964**2) / (60 + 1.959964**2), abs=1e-6) and passkey.ci_high > 0
    # heatmap cells: lengths 500, 502 and 1011, 1013 fall into two buckets; 5 depths
    niah_cells = [c for c in rc.cells if c.task == "niah_multikey"]
    assert {c.length for c in niah_cells} == {501, 1012} and len({c.depth for c in niah_cells}) == 5
    assert sum(c.n for c in niah_cells) == 80
    lengths, depths, delta, counts = rc.grid()
    assert counts.sum() == 140 and np.nanmin(delta) < 0


def test_compare_cli_table_and_json(runs, capsys, tmp_path):
    out = tmp_path / "cmp.json"
    rc = cli.main(["compare", str(runs["base"]), str(runs["bad"]), "--json", str(out), "--resamples", "999"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "niah_multikey" in text and "-0.30" in text and "distractor +30pt" in text and "Tango" in text
    data = json.loads(out.read_text())
    assert data["tasks"][0]["n_regressed"] == 24 and data["cells"] and data["overall"]["n"] == 140


@pytest.mark.parametrize("command, flags, needle", [
    ("compare", ["--resamples", "0"], "resamples=0 must be a whole number >= 100"),
    ("compare", ["--resamples", "-5"], "resamples=-5"),
    ("compare", ["--confidence", "1.5"], "confidence level 1.5 must be in (0, 1)"),
    ("report", ["--resamples", "0"], "resamples=0"),
])
def test_too_few_resamples_or_a_coverage_outside_0_1_are_refused(runs, capsys, tmp_path, command, flags, needle):
    """Zero or negative resamples were accepted (exit 0): the bootstrap of a mostly graded task then had no resampled
    mean to draw its bounds from."""
    graded = [replace(it, score=0.5 + 0.01 * (i % 7)) for i, it in enumerate(runs["items"])]  # the bootstrap's tasks
    base = write_run(tmp_path / "gb", graded)
    cand = write_run(tmp_path / "gc", [replace(it, score=it.score - 0.1) for it in graded], policy="kivi(bits=2)")
    argv = [command, str(base), str(cand)] if command == "compare" else [command, str(base), str(cand), "--out", str(tmp_path / "r")]
    assert cli.main(argv + flags) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "internal error" not in err


# ----------------------------------------------------------------------------- gate


def gate_argv(runs, *cands, out=None):
    argv = ["gate", "--config", str(GATE_YAML), "--baseline", str(runs["base"])]
    for c in cands:
        argv += ["--candidate", str(c)]
    return argv + ["--out", str(out or runs["tmp"] / "gate")]


def verdict_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("PASS ", "FAIL ", "INCONCLUSIVE ", "ERROR "))]


def test_gate_unchanged_candidate_passes_with_enough_items(runs, capsys):
    code = cli.main(gate_argv(runs, runs["same"]))
    captured = capsys.readouterr()
    assert code == 0, captured.out
    verdicts = verdict_lines(captured.out)
    assert len(verdicts) == 1 and verdicts[0].startswith("PASS ") and "regressed 0/80" in verdicts[0]
    assert captured.out.strip().endswith("gate: PASS (exit 0)")
    junit = ET.parse(runs["tmp"] / "gate" / "gate.xml").getroot()
    assert junit.get("failures") == "0" and len(junit.findall(".//testcase")) == 2


def test_gate_refuses_the_same_run_as_baseline_and_candidate(runs, capsys):
    # Issue 65: a run gated against itself PASSed with a warning; it shows nothing, so it is refused.
    assert cli.main(gate_argv(runs, runs["base"])) == 2
    err = capsys.readouterr().err
    assert "a baseline gated against itself" in err
    copy = runs["tmp"] / "copy_of_base"
    shutil.copytree(runs["base"], copy)
    assert cli.main(gate_argv(runs, copy)) == 2
    assert "is the baseline" in capsys.readouterr().err  # a copy of it, too


def test_gate_swapped_runs_warn(runs, capsys):
    argv = gate_argv(runs, runs["base"])
    argv[argv.index(str(runs["base"]))] = str(runs["same"])
    cli.main(argv)
    assert "look swapped" in capsys.readouterr().err


def test_gate_few_unchanged_items_are_inconclusive_not_pass(tmp_path, capsys):
    items = baseline_items(3, 0)
    base = write_run(tmp_path / "base", items)
    cand = write_run(tmp_path / "cand", items, policy="quant(bits=8)")
    code = cli.main(["gate", "--baseline", str(base), "--candidate", str(cand)])
    out = capsys.readouterr().out
    assert code == 3, out
    line = verdict_lines(out)[0]
    assert line.startswith("INCONCLUSIVE ") and "non-inferiority not shown" in line
    assert "about 52 items per task would decide" in line  # -z^2/(n+z^2) > -0.05 from n = 52
    # inconclusive_blocks: false turns exit 3 into 0 with a warning
    cfg = tmp_path / "lenient.yaml"
    cfg.write_text("inconclusive_blocks: false\n")
    assert cli.main(["gate", "--config", str(cfg), "--baseline", str(base), "--candidate", str(cand)]) == 0
    assert "does not block" in capsys.readouterr().err


def test_gate_planted_regression_fails(runs, capsys):
    code = cli.main(gate_argv(runs, runs["same"], runs["bad"]))
    out = capsys.readouterr().out
    assert code == 1, out
    fail = [line for line in verdict_lines(out) if line.startswith("FAIL")]
    assert len(fail) == 1 and "snapkv(ratio=0.75)" in fail[0]
    assert "niah_multikey regressed 24/80 items (24 distractor)" in fail[0]
    assert "accuracy -0.300" in fail[0] and "loss beyond the margin" in fail[0] and "Holm" in fail[0]
    assert "distractor: 24 of 80 items were right at baseline (30.0% of the task" in fail[0] and "net negative flips" in fail[0]
    assert any(line.startswith("PASS smollm2-135m/snapkv(ratio=0.25)") for line in out.splitlines())
    gate_dir = runs["tmp"] / "gate"
    junit = ET.parse(gate_dir / "gate.xml").getroot()
    failures = junit.findall(".//failure")
    assert len(failures) == 1 and "distractor" in failures[0].get("message")
    md = (gate_dir / "gate.md").read_text()
    assert "**FAIL**" in md and "distractor:8412337" in md
    data = json.loads((gate_dir / "gate.json").read_text())
    assert data["exit_code"] == 1 and [c["status"] for c in data["candidates"]] == ["PASS", "FAIL"]


def test_gate_margin_is_the_test_at_large_n(tmp_path):
    """2,000 items losing 0.02: significant against 0, but inside the 0.05 margin: PASS, not FAIL."""
    items = [ItemRecord(id=f"t/{i}", hash=str(i), task="t", score=1.0, correct=True) for i in range(2000)]
    cand_items = [replace(it, score=0.0, correct=False) if i < 40 else it for i, it in enumerate(items)]
    base = write_run(tmp_path / "b", items)
    cand = write_run(tmp_path / "c", cand_items, policy="random(ratio=0.5)")
    res = evaluate_gate(None, base, [cand])
    task = res.candidates[0].tasks[0]
    assert task.comparison.pvalue < 1e-6 and task.status == PASS and task.test.lower > -0.05


def test_gate_holm_family_and_config(runs):
    res = evaluate_gate(GateConfig.from_dict({"tasks": ["niah_multikey", "passkey"], "margin": {"niah_multikey": 0.5}}), runs["base"], [runs["bad"]])
    tasks = res.candidates[0].tasks
    raw = [t.test.p_inferior for t in tasks]
    np.testing.assert_allclose([t.p_inferior_holm for t in tasks], multipletests(raw, method="holm")[1], atol=1e-12)
    assert tasks[0].margin == 0.5 and tasks[1].margin == 0.05
    # a lenient margin: the loss of 0.3 is inside 0.5, only the rules can fail it
    lenient = {"tasks": ["niah_multikey"], "margin": 0.5, "max_negative_flip_rate": None, "max_confusion_increase": None}
    assert evaluate_gate(GateConfig.from_dict(lenient), runs["base"], [runs["bad"]]).status == PASS
    assert evaluate_gate(GateConfig.from_dict(dict(lenient, margin=0.1)), runs["base"], [runs["bad"]]).status == FAIL
    # YAML defaults load and equal the built-in defaults; the old key names its replacement
    assert load_gate_config(GATE_YAML) == GateConfig()
    with pytest.raises(ConfigError, match="inconclusive_blocks"):
        load_gate_config({"require_non_inferiority": True})


def test_gate_confusion_among_wrong_items_is_reported_never_failed(runs):
    shifted = [replace(it, category="fabricated", answer="999") if not it.correct else it for it in runs["items"]]
    cand = write_run(runs["tmp"] / "shift", shifted, policy="kivi(bits=4)")
    res = evaluate_gate(load_gate_config(GATE_YAML), runs["base"], [cand])
    niah = res.candidates[0].tasks[0]
    assert niah.status == PASS and any("wrong in both runs changed confusion category" in n for n in niah.notes)


def test_gate_sweep_family(runs):
    res = evaluate_gate(GateConfig.from_dict({"family": "sweep"}), runs["base"], [runs["same"], runs["bad"]])
    fam = [t for c in res.candidates for t in c.tasks]
    np.testing.assert_allclose(
        [t.p_inferior_holm for t in fam], multipletests([t.test.p_inferior for t in fam], method="holm")[1], atol=1e-12
    )
    assert res.exit_code == 1


def test_gate_plan_prints_items_per_task(capsys):
    argv = ["gate", "--plan", "--baseline-accuracy", "0.9", "--churn", "0", "--churn", "0.05", "--margin", "0.05", "--alpha", "0.05"]
    assert cli.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[-1] for r in rows] == ["52", "245"] and [r[3] for r in rows] == ["pass", "pass"]


def test_gate_deployment_decision(runs, capsys):
    argv = gate_argv(runs, runs["same"], runs["bad"]) + ["--gpu-memory", "1GiB", "--context", "8192", "--batch", "4"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "deploy smollm2-135m/snapkv(ratio=0.25)" in out and "fit:" in out
    data = json.loads((runs["tmp"] / "gate" / "gate.json").read_text())
    assert data["deployment"]["choice"] == "smollm2-135m/snapkv(ratio=0.25)"


def test_a_candidate_the_planner_cannot_size_never_hides_a_fail(runs, capsys):
    """A policy outside the planner's model (here an unknown one; kvquant was) ended the gate in exit 2 after the
    verdicts were printed and before gate.md was written: a FAIL (exit 1) read as an error, its outputs lost."""
    odd = write_run(runs["tmp"] / "odd", runs["items"], policy="nosuch(ratio=0.5)")
    argv = gate_argv(runs, odd, runs["bad"]) + ["--gpu-memory", "1GiB", "--context", "8192"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "not sized by the planner, so not picked: smollm2-135m/nosuch(ratio=0.5)" in out
    data = json.loads((runs["tmp"] / "gate" / "gate.json").read_text())
    assert data["exit_code"] == 1 and "nosuch(ratio=0.5)" in next(iter(data["deployment"]["unplanned"]))


def test_a_model_the_planner_cannot_weigh_keeps_its_verdict(runs, capsys):
    """A MoE model's weights have no parameter count to estimate from: the deployment question raised after the
    verdicts (in a sweep, before gate.md was written). Now that model's line says it is not decided, naming the fix
    (--weights), and the gate's exit code is its verdict; with --weights it is decided."""
    config = runs["tmp"] / "moe" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "hidden_size": 4096, "num_local_experts": 8}))
    model = str(config)
    base = write_run(runs["tmp"] / "moe-base", runs["items"], model=model)
    bad = write_run(runs["tmp"] / "moe-bad", plant_regression(runs["items"]), policy="snapkv(ratio=0.75)", model=model)
    argv = ["gate", "--config", str(GATE_YAML), "--baseline", str(base), "--candidate", str(bad),
            "--out", str(runs["tmp"] / "moe-gate"), "--gpu-memory", "80GiB", "--context", "8192"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "deployment not decided" in out and "--weights" in out and (runs["tmp"] / "moe-gate" / "gate.md").is_file()
    assert cli.main(argv + ["--weights", "40GB"]) == 1
    assert "not decided" not in capsys.readouterr().out
    data = json.loads((runs["tmp"] / "moe-gate" / "gate.json").read_text())
    assert data["deployment"]["budget_bytes"] > 0


@pytest.mark.parametrize("flags, needle", [(["--gpu-memory", "80 gigs", "--context", "8192"], "is not a size"),
                                           (["--gpu-memory", "80GiB", "--context", "8192", "--headroom", "2"], "headroom"),
                                           (["--gpu-memory", "80GiB", "--context", "8192", "--batch", "0"], "batch=0")])
def test_a_deployment_that_cannot_be_asked_is_refused_before_the_verdicts(runs, capsys, flags, needle):
    assert cli.main(gate_argv(runs, runs["bad"]) + flags) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and not verdict_lines(captured.out) and not (runs["tmp"] / "gate").exists()


def _one_error_line(capsys, *needles):
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err) == 1, captured.err
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def test_gate_truncated_candidate_is_error(runs, capsys):
    items = runs["bad"] / "items.jsonl"
    items.write_text(items.read_text() + '{"id": "niah_multikey/99", "hash": "ab')
    assert cli.main(gate_argv(runs, runs["bad"])) == 2
    _one_error_line(capsys, "truncated", "items.jsonl")


def test_gate_corrupt_candidate_is_error_others_still_judged(runs, capsys):
    items = runs["bad"] / "items.jsonl"
    lines = items.read_text().splitlines(keepends=True)
    lines[5] = "{not json}\n"
    items.write_text("".join(lines))
    assert cli.main(gate_argv(runs, runs["same"], runs["bad"])) == 2
    captured = capsys.readouterr()
    assert "PASS smollm2-135m/snapkv(ratio=0.25)" in captured.out
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err) == 1 and "corrupt item line" in err[0] and ":6:" in err[0]
    data = json.loads((runs["tmp"] / "gate" / "gate.json").read_text())
    assert data["exit_code"] == 2 and data["candidates"][1]["status"] == "ERROR"
    junit = ET.parse(runs["tmp"] / "gate" / "gate.xml").getroot()
    assert junit.get("errors") == "1" and junit.find(".//error") is not None


def test_gate_missing_items_is_error(runs, capsys):
    cand = write_run(runs["tmp"] / "short", runs["items"][:-3], policy="snapkv(ratio=0.5)")
    assert cli.main(gate_argv(runs, cand)) == 2
    _one_error_line(capsys, "unpaired", "3 item(s) only in the baseline", "passkey/57")


def test_gate_extra_and_renamed_ids_is_error(runs, capsys):
    items = list(runs["items"])
    items[0] = replace(items[0], id="niah_multikey/renamed")
    cand = write_run(runs["tmp"] / "renamed", items, policy="snapkv(ratio=0.5)")
    assert cli.main(gate_argv(runs, cand)) == 2
    _one_error_line(capsys, "1 item(s) only in the baseline (niah_multikey/0)", "1 item(s) only in the candidate")


def test_gate_hash_mismatch_is_error(runs, capsys):
    items = [replace(it, hash="0" * 16) if i in (2, 4) else it for i, it in enumerate(runs["items"])]
    cand = write_run(runs["tmp"] / "rehashed", items, policy="snapkv(ratio=0.5)")
    assert cli.main(gate_argv(runs, cand)) == 2
    _one_error_line(capsys, "2 item(s) have different prompt hashes", "niah_multikey/2, niah_multikey/4")


def test_gate_other_model_is_error(runs, capsys):
    cand = write_run(runs["tmp"] / "gemma", runs["items"], policy="snapkv(ratio=0.5)", model="gemma3-270m")
    assert cli.main(gate_argv(runs, cand)) == 2
    _one_error_line(capsys, "different models")


def test_runs_with_different_cache_dtypes_are_not_paired(runs, capsys):
    """A float32 baseline beside a bfloat16 candidate passed the gate, and the leaderboard put its bytes per token
    next to the candidate's under a compression ratio that was neither's."""
    base = write_run(runs["tmp"] / "base-fp32", runs["items"], kv_dtype="float32")
    cand = write_run(runs["tmp"] / "cand-bf16", runs["items"], policy="snapkv(ratio=0.25)", kv_dtype="bfloat16")
    argv = gate_argv(runs, cand)
    argv[argv.index(str(runs["base"]))] = str(base)
    assert cli.main(argv) == 2
    _one_error_line(capsys, "different cache dtypes", "float32", "bfloat16", "--kv-dtype")
    same = write_run(runs["tmp"] / "cand-fp32", runs["items"], policy="snapkv(ratio=0.25)", kv_dtype="float32")
    argv[argv.index(str(cand))] = str(same)
    assert cli.main(argv) == 0


def test_runs_computed_on_different_hardware_are_not_paired(runs, capsys):
    """Float kernels round differently on another CPU or GPU (12 of the quickstart's 480 answers moved between an
    AVX2 and an AVX512-BF16 CPU, the baseline's too): pairing such runs would count that as the policy's effect."""
    avx2, avx512 = "cpu AVX2 (some CPU), torch 2.13.0+cpu", "cpu AVX512 (AMD EPYC), torch 2.13.0+cpu"
    base = write_run(runs["tmp"] / "base-hw", runs["items"], extra={"hardware": avx2})
    elsewhere = write_run(runs["tmp"] / "elsewhere", runs["items"], policy="snapkv(ratio=0.25)", extra={"hardware": avx512})
    here = write_run(runs["tmp"] / "here", runs["items"], policy="snapkv(ratio=0.25)", extra={"hardware": avx2})
    mixed = write_run(runs["tmp"] / "mixed", runs["items"], policy="snapkv(ratio=0.25)",
                      extra={"hardware": f"mixed: {avx2} + {avx512}"})
    argv = ["gate", "--config", str(GATE_YAML), "--baseline", str(base), "--out", str(runs["tmp"] / "gate-hw")]
    assert cli.main(argv + ["--candidate", str(elsewhere)]) == 2
    _one_error_line(capsys, "different hardware", "AVX2", "AVX512")
    assert cli.main(argv + ["--candidate", str(mixed)]) == 2  # a run resumed on another machine pairs with nothing
    _one_error_line(capsys, "different hardware", "mixed")
    assert cli.main(argv + ["--candidate", str(here)]) == 0  # same machine, same items: PASS
    assert cli.main(argv + ["--candidate", str(runs["same"])]) == 0  # a run that predates the record pairs as before


def test_gate_missing_baseline_is_error(runs, capsys):
    argv = ["gate", "--config", str(GATE_YAML), "--baseline", str(runs["tmp"] / "nope"), "--candidate", str(runs["bad"])]
    assert cli.main(argv) == 2
    _one_error_line(capsys, "kveval gate: error:", "nope", "no such file")


def test_gate_baseline_without_items_is_error(runs, capsys):
    (runs["base"] / "items.jsonl").unlink()
    assert cli.main(gate_argv(runs, runs["bad"])) == 2
    _one_error_line(capsys, "no items file")


def test_gate_bad_config_is_error(runs, capsys, tmp_path):
    cfg = tmp_path / "gate.yaml"
    cfg.write_text("alpha: 0.05\nmargins: 0.1\n")
    argv = ["gate", "--config", str(cfg), "--baseline", str(runs["base"]), "--candidate", str(runs["bad"])]
    assert cli.main(argv) == 2
    _one_error_line(capsys, "unknown key(s) margins")
    cfg.write_text("tasks: [niah_multikey, nosuchtask]\n")
    assert cli.main(argv) == 2
    _one_error_line(capsys, "nosuchtask", "not in the baseline")


def test_load_run_refuses_unknown_folder(tmp_path):
    with pytest.raises(ResultFileError, match="neither a kveval run folder"):
        load_run(tmp_path)


# ----------------------------------------------------------------------------- lm-eval samples


def _sample(doc_id, *, prompt, target, resps, metric_values, flt="none", generation=False):
    if generation:
        arguments = {"gen_args_0": {"arg_0": prompt, "arg_1": "{'until': ['\\n']}"}}
        filtered = [resps[0]]
        raw = [[r] for r in resps]
    else:
        arguments = {f"gen_args_{i}": {"arg_0": prompt, "arg_1": f" choice{i}"} for i in range(len(resps))}
        raw = [[[str(ll), "False"]] for ll in resps]
        filtered = [[str(ll), "False"] for ll in resps]
    row = {
        "doc_id": doc_id,
        "doc": {"q": prompt},
        "target": str(target),
        "arguments": arguments,
        "resps": raw,
        "filtered_resps": filtered,
        "filter": flt,
        "metrics": list(metric_values),
        "doc_hash": hashlib.sha256(prompt.encode()).hexdigest(),
        "prompt_hash": hashlib.sha256(prompt.encode()).hexdigest(),
        "target_hash": hashlib.sha256(str(target).encode()).hexdigest(),
    }
    row.update(metric_values)
    return row


def write_lm_eval(folder: Path, rows_by_task: dict[str, list[dict]], *, date="2025-01-02T03-04-05.678901", config=None) -> Path:
    model_dir = folder / "my__model"
    model_dir.mkdir(parents=True)
    for task, rows in rows_by_task.items():
        (model_dir / f"samples_{task}_{date}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (model_dir / f"results_{date}.json").write_text(json.dumps({"results": {}, "config": config or {"model": "hf", "model_args": "pretrained=smollm2-135m"}}))
    return folder


def lm_eval_pair(tmp_path, *, cand_hash_break=False, drop_doc=False):
    # multiple choice: gold index 1 (base), baseline right on docs 0-4, candidate wrong on 1 and 3
    base_mc, cand_mc, base_gen, cand_gen = [], [], [], []
    for d in range(6):
        base_lls = [-3.0, -1.0 - 0.1 * d, -2.5]
        cand_lls = list(base_lls)
        if d in (1, 3):
            cand_lls = [-0.5, -1.5 - 0.1 * d, -2.5]  # gold drops below choice 0
        base_ok = float(np.argmax(base_lls) == 1)
        cand_ok = float(np.argmax(cand_lls) == 1)
        prompt = f"Question {d}?"
        base_mc.append(_sample(d, prompt=prompt, target=1, resps=base_lls, metric_values={"acc": base_ok, "acc_norm": base_ok}))
        cand_prompt = prompt + " (changed)" if (cand_hash_break and d == 2) else prompt
        cand_mc.append(_sample(d, prompt=cand_prompt, target=1, resps=cand_lls, metric_values={"acc": cand_ok, "acc_norm": cand_ok}))
    for d in range(4):
        for flt in ("strict-match", "flexible-extract"):
            prompt = f"Sum {d}+{d}="
            ans = str(2 * d)
            cand_ans = "wrong" if (d == 0 and flt == "strict-match") else ans
            base_gen.append(_sample(d, prompt=prompt, target=ans, resps=[ans], metric_values={"exact_match": 1.0}, flt=flt, generation=True))
            cand_gen.append(
                _sample(d, prompt=prompt, target=ans, resps=[cand_ans], metric_values={"exact_match": float(cand_ans == ans)}, flt=flt, generation=True)
            )
    if drop_doc:
        cand_mc = cand_mc[:-1]
    base = write_lm_eval(tmp_path / "lm_base", {"arc_easy": base_mc, "gsm8k_cot": base_gen})
    cand = write_lm_eval(
        tmp_path / "lm_cand",
        {"arc_easy": cand_mc, "gsm8k_cot": cand_gen},
        config={"model": "kveval", "model_args": "pretrained=smollm2-135m,policy=snapkv(ratio=0.5)"},
    )
    return base, cand


def test_lm_eval_samples_pairing(tmp_path):
    base, cand = lm_eval_pair(tmp_path)
    rc = compare_runs(base, cand, n_resamples=999)
    assert rc.source == "lm-eval" and rc.n == 6 + 8
    assert rc.candidate.policy == "snapkv(ratio=0.5)" and rc.candidate.model == "smollm2-135m"
    assert rc.baseline.is_baseline
    assert sorted(rc.task_names) == ["arc_easy", "gsm8k_cot[flexible-extract]", "gsm8k_cot[strict-match]"]
    arc = rc.task("arc_easy")
    assert arc.n == 6 and arc.n_regressed == 2 and arc.baseline_score == 1.0 and arc.candidate_score == pytest.approx(4 / 6)
    assert sorted(r["id"] for r in arc.regressed) == ["arc_easy/1", "arc_easy/3"]
    assert arc.agreement == pytest.approx(4 / 6)
    # gold log-probability: -1.0-0.1d -> -1.5-0.1d on docs 1 and 3
    assert arc.n_logprob == 6 and arc.logprob_delta == pytest.approx(-1.0 / 6)
    strict = rc.task("gsm8k_cot[strict-match]")
    assert strict.n == 4 and strict.n_regressed == 1 and strict.regressed[0]["id"] == "gsm8k_cot/0/strict-match"
    assert rc.task("gsm8k_cot[flexible-extract]").n_regressed == 0
    assert strict.logprob_delta is None and strict.confusion_delta == {}
    # score by another metric
    assert compare_runs(base, cand, metric="acc_norm", n_resamples=999).task("arc_easy").n_regressed == 2


def test_lm_eval_prompt_hash_mismatch(tmp_path, capsys):
    base, cand = lm_eval_pair(tmp_path, cand_hash_break=True)
    with pytest.raises(ResultFileError, match=r"1 item\(s\) have different prompt hashes \(arc_easy/2\)"):
        compare_runs(base, cand)
    assert cli.main(["compare", str(base), str(cand)]) == 2
    _one_error_line(capsys, "arc_easy/2")


def test_lm_eval_unpaired_and_truncated(tmp_path):
    base, cand = lm_eval_pair(tmp_path, drop_doc=True)
    with pytest.raises(ResultFileError, match=r"1 item\(s\) only in the baseline \(arc_easy/5\)"):
        compare_runs(base, cand)
    f = next((cand / "my__model").glob("samples_arc_easy_*.jsonl"))
    f.write_text(f.read_text() + '{"doc_id": 7, "prom')
    with pytest.raises(ResultFileError, match="truncated"):
        compare_runs(base, cand)
    with pytest.raises(ResultFileError, match="cannot pair a lm-eval result"):
        compare_runs(tmp_path / "lm_base", write_run(tmp_path / "kv", baseline_items(4, 0)))


# ----------------------------------------------------------------------------- bad data: one line, exit 2


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("score", 5.0, "score 5.0 is not a number in [0, 1]"),
        ("score", -0.5, "score -0.5 is not a number in [0, 1]"),
        ("correct", "false", "correct 'false' is not a boolean"),
        ("correct", "no", "correct 'no' is not a boolean"),
        ("id", 7, "id 7 is not a non-empty string"),
    ],
)
def test_bad_item_values_are_refused_naming_file_and_item(runs, capsys, field, value, needle):
    lines = (runs["same"] / "items.jsonl").read_text().splitlines()
    row = json.loads(lines[3])
    row[field] = value
    lines[3] = json.dumps(row)
    (runs["same"] / "items.jsonl").write_text("\n".join(lines) + "\n")
    assert cli.main(gate_argv(runs, runs["same"])) == 2
    err = _one_error_line(capsys, needle, "items.jsonl")
    assert "item 4" in err or "niah_multikey/3" in err


def test_lm_eval_runs_computed_on_different_hardware_are_refused(tmp_path):
    base, cand = lm_eval_pair(tmp_path)
    compare_runs(base, cand)  # neither records its hardware (written before kveval did): paired as before
    for run, hardware in ((base, "cpu AVX2 (some CPU), torch 2.13.0"), (cand, "cuda NVIDIA H200, torch 2.13.0")):
        results = next(run.rglob("results_*.json"))
        data = json.loads(results.read_text())
        data.setdefault("config", {})["kveval_hardware"] = hardware
        results.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match="different hardware"):
        compare_runs(base, cand)


def test_lm_eval_runs_of_different_models_are_refused(tmp_path):
    base, cand = lm_eval_pair(tmp_path)
    results = next((cand / "my__model").glob("results_*.json"))
    data = json.loads(results.read_text())
    data["config"]["model_args"] = "pretrained=gemma3-270m,policy=snapkv(ratio=0.5)"
    results.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match="different models"):
        compare_runs(base, cand)
    data["config"]["model_args"] = "pretrained=smollm2-135m,revision=abc123,policy=snapkv(ratio=0.5)"
    results.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match="revision"):
        compare_runs(base, cand)


def test_one_graded_score_tests_the_score_change_its_interval_shows(tmp_path):
    """A single 0.5 among right/wrong items switched McNemar (p 0.125) to Wilcoxon (p 0.046); then McNemar on the
    correct flags stood beside an interval on the scores. The p-value is now Tango's test at 0 on the same
    discordances as the interval: below 0.05 exactly when the 95% interval excludes 0."""
    base = [ItemRecord(id=f"t/{i}", hash=str(i), task="t", score=1.0, correct=True) for i in range(40)]
    cand = [replace(it, score=0.0, correct=False) if i < 4 else it for i, it in enumerate(base)]
    cand[10] = replace(cand[10], score=0.5, correct=False)  # partial credit: counted by its `correct` flag
    rc = compare_runs(write_run(tmp_path / "b", base), write_run(tmp_path / "c", cand, policy="kivi(bits=2)"))
    t = rc.task("t")
    assert not t.binary and t.n_graded == 1 and t.test == "tango" and t.ci_method == "tango"
    assert t.n_regressed == 5 and t.mcnemar_p == pytest.approx(0.0625, abs=1e-12)  # exact binomial on the flags, 5 vs 0
    assert t.pvalue == pytest.approx(paired.tango_pvalue(4.5, 0, 40)) and (t.pvalue < 0.05) == (t.ci_high < 0)
    # the interval is the mean score's: 4 items lost 1, the partial one 0.5
    assert (t.score_lost, t.score_gained, t.delta) == (4.5, 0.0, -4.5 / 40)
    assert (t.ci_low, t.ci_high) == pytest.approx(paired.tango_interval(4.5, 0, 40), abs=1e-12)
    # mostly graded scores (40 items: the bootstrap), unchanged: p = 1 and the interval still is not [0, 0]
    graded = [replace(it, score=0.5 + 0.01 * (i % 7), correct=False) for i, it in enumerate(base)]
    g = compare_runs(write_run(tmp_path / "gb", graded), write_run(tmp_path / "gc", graded, policy="kivi(bits=4)")).task("t")
    assert g.test == g.ci_method == "bootstrap" and g.pvalue == 1.0 and g.ci_low < 0 < g.ci_high


def test_compare_warns_on_swapped_runs(runs, capsys):
    assert cli.main(["compare", str(runs["same"]), str(runs["base"]), "--resamples", "199"]) == 0
    assert "kveval compare: warning: baseline and candidate look swapped" in capsys.readouterr().err


def test_the_deployment_sizes_a_threshold_at_the_ratio_its_run_reached(runs, capsys):
    """A threshold's kept count depends on the scores: the deployment plans it at its run's mean achieved ratio
    (run.json's ``achieved_ratio``), the bytes a ratio policy at that ratio would hold; a run without one is named
    as not sized, and the verdicts stand."""
    reached = write_run(runs["tmp"] / "thr", runs["items"], policy="threshold(scorer=knorm,threshold=-3.0)",
                        extra={"achieved_ratio": {"mean": 0.75, "min": 0.7, "max": 0.8}})
    unknown = write_run(runs["tmp"] / "thr2", runs["items"], policy="threshold(scorer=knorm,threshold=-4.0)")
    argv = gate_argv(runs, reached, unknown, runs["bad"]) + ["--gpu-memory", "1GiB", "--context", "8192"]
    assert cli.main(argv) == 1
    fits = json.loads((runs["tmp"] / "gate" / "gate.json").read_text())["deployment"]
    assert fits["fits"]["smollm2-135m/threshold(scorer=knorm,threshold=-3.0)"][0] == fits["fits"]["smollm2-135m/snapkv(ratio=0.75)"][0]
    assert "threshold(scorer=knorm,threshold=-4.0)" in next(iter(fits["unplanned"]))
    assert "plan it at a run's achieved ratio" in next(iter(fits["unplanned"].values()))
