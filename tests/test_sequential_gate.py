"""The sequential gate wired in: its config, its judgment at looks, its records and their replay, the sequential
sweep (stratified blocks, early stops, kill and resume) and its error rates through ``kveval gate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.sequential_gate import gate_rates, gate_yaml, paired_draw, write_sim_run
from kveval.errors import ConfigError, ResultFileError
from kveval.gate.config import GateConfig, SequentialSettings
from kveval.gate.report import write_gate_outputs
from kveval.gate.rules import evaluate_gate
from kveval.gate.sequential import LookPlan, stratified_order
from kveval.gate.verdicts import ERROR, FAIL, INCONCLUSIVE, PASS
from kveval.gate.verify import check_gate_file, read_gate_file
from kveval.stats import sequential as seqstats

MARGIN_ONLY = {"margin": 0.05, "max_negative_flip_rate": None, "max_confusion_increase": None}


def _cfg(section=True, **rules) -> GateConfig:
    return GateConfig.from_dict({**MARGIN_ONLY, **rules, "sequential": section}, "g.yaml")


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("section, message", [
    ({"looks": [0.5, 0.4, 1.0]}, "increase strictly"),
    ({"looks": [20, 10, 40]}, "looks must increase strictly: look 2"),
    ({"looks": [10, 20], "max_items": 5}, "max_items 5 is below the first look"),
    ({"looks": [0.5, 1.5]}, r"fractions must lie in \(0, 1\]"),
    ({"looks": [0.5, 0.9]}, "exactly 1"),
    ({"spending": "hsd(gamma=50)"}, r"gamma must be a number in \[-40, 40\]"),
    ({"spending": "linear"}, "unknown spending function 'linear'"),
    ({"pass_spending": "hsd(gamma=x)"}, "gamma must be a number"),
    ({"looks": [0.5, 1.0], "max_items": 40}, "max_items goes with looks given as item counts"),
    ({"lookz": [1]}, "unknown key"),
    ("yes", "give true"),
])
def test_bad_sequential_sections_are_refused_in_one_line(section, message):
    with pytest.raises(ConfigError, match=message) as info:
        GateConfig.from_dict({"sequential": section}, "g.yaml")
    assert str(info.value).startswith("g.yaml: sequential") and "\n" not in str(info.value)


def test_the_section_parses_once_and_round_trips():
    default = _cfg(True).sequential
    assert default == SequentialSettings() and default.looks == (0.25, 0.5, 0.75, 1.0) and default.fractions
    assert default.pass_spending.name == default.fail_spending.name == "obrien-fleming"
    mixed = _cfg({"looks": [0.5, 1.0], "pass_spending": "pocock", "fail_spending": "hsd(gamma=-2)"})
    again = GateConfig.from_dict(mixed.to_dict())
    assert again.sequential == mixed.sequential and again.sequential.fail_spending.name == "hsd(gamma=-2)"
    counts = _cfg({"looks": [10, 20, 40]}).sequential
    assert not counts.fractions and counts.looks == (10, 20, 40)
    # a fixed-n gate records exactly what it recorded before: no sequential key at all
    assert "sequential" not in GateConfig().to_dict()
    assert GateConfig.from_dict({"sequential": False}).sequential is None


# ----------------------------------------------------------------------------- the look order


def test_blocks_are_stratified_in_proportion_and_keep_contexts_whole():
    # two depths of 8 contexts and one of 4 (two items each at depth 1.0): every quarter holds each in its share
    entries = [(f"a{i}", "t", 0.1, f"a{i}") for i in range(8)] + [(f"b{i}", "t", 0.5, f"b{i}") for i in range(8)]
    entries += [(f"c{i}-{j}", "t", 1.0, f"c{i}") for i in range(4) for j in range(2)]
    [order] = stratified_order(entries).values()
    assert sorted(order) == sorted(e[0] for e in entries)
    for quarter in range(4):
        block = order[quarter * 6:(quarter + 1) * 6]
        assert sum(x.startswith("a") for x in block) == 2 and sum(x.startswith("b") for x in block) == 2
        assert sum(x.startswith("c") for x in block) == 2 and block.count(block[-1]) == 1
    for i in range(4):  # a context's items are adjacent
        assert abs(order.index(f"c{i}-0") - order.index(f"c{i}-1")) == 1
    plan = LookPlan.build(SequentialSettings(), {"t": order}, 0.05, 0.05)
    assert plan.counts(0) == {"t": 6} and plan.ids_through(1) == order[:12]
    tiny = LookPlan.build(SequentialSettings(), {"t": ["x", "y", "z"]}, 0.05, 0.05)
    assert tiny.counts_by_task["t"] == (1, 2, 3, 3) and tiny.designs["t"].looks == (1, 2, 3)


# ----------------------------------------------------------------------------- judging at looks


def _pair(tmp_path, n, p_regress, p_improve, seed=0, name="c"):
    base, cand, _ = paired_draw(np.random.default_rng(seed), n, p_regress, p_improve)
    return write_sim_run(tmp_path / f"b-{name}", "none", base), write_sim_run(tmp_path / name, "quant(bits=2)", cand)


def test_each_look_is_the_statistics_decision_on_the_first_blocks(tmp_path):
    base, cand = _pair(tmp_path, 300, 0.25, 0.0)
    cfg = _cfg()
    [v] = evaluate_gate(cfg, base, [cand]).candidates
    assert v.status == FAIL and v.sequential["decision"] == FAIL and v.sequential["look"] == 1
    assert v.sequential["items"] == {"passkey": 75} and v.sequential["items_total"] == 75
    [task] = v.tasks
    c = task.comparison
    assert c.n == 75
    design = seqstats.SequentialDesign.from_fractions((0.25, 0.5, 0.75, 1.0), 300, alpha_pass=0.05, alpha_fail=0.05)
    by_hand = seqstats.decide(design, 0, c.score_lost, c.score_gained, c.n, 0.05)
    assert task.look == by_hand and v.sequential["boundary"] == {"passkey": by_hand.lower}
    assert v.sequential["design"]["tasks"]["passkey"] == design.to_dict()
    assert "lower boundary at look 1 (75 items)" in task.reasons[0] and "[look 1 of 4, 75 items]" in v.line()
    # the interval reported is the look's repeated confidence interval: wider than the fixed-n one on those items
    assert v.sequential["interval_level"] > 0.999


def test_unchanged_candidates_pass_early_and_no_few_items_pass(tmp_path):
    base, cand = _pair(tmp_path, 400, 0.0, 0.0)
    [v] = evaluate_gate(_cfg(), base, [cand]).candidates
    assert v.status == PASS and v.sequential["look"] == 2 and v.sequential["items_total"] == 200
    few_base, few = _pair(tmp_path, 3, 0.0, 0.0, name="few")
    [v] = evaluate_gate(_cfg(), few_base, [few]).candidates
    assert v.status == INCONCLUSIVE and v.sequential["look"] == 4 and v.sequential["items_total"] == 3


def test_fail_alpha_is_split_over_the_family_and_pass_needs_every_task(tmp_path):
    from tests.test_compare_gate import baseline_items, plant_regression, write_run

    items = baseline_items(200, 200)
    base = write_run(tmp_path / "base", items)
    bad = write_run(tmp_path / "bad", plant_regression(items, 0.4), policy="snapkv(ratio=0.75)")
    result = evaluate_gate(_cfg(), base, [bad])
    [v] = result.candidates
    assert v.sequential["alpha_fail"] == 0.025 and v.status == FAIL
    assert {t.task: t.status for t in v.tasks}["passkey"] != FAIL
    sweep_family = evaluate_gate(_cfg(family="sweep"), base, [bad, bad]).candidates[0]
    assert sweep_family.sequential["alpha_fail"] == 0.0125


def test_a_candidate_may_hold_only_the_first_blocks_and_only_sequentially(tmp_path):
    base, cand = _pair(tmp_path, 200, 0.0, 0.0)
    from kveval.runs.records import ITEMS_FILE

    lines = (cand / ITEMS_FILE).read_text().splitlines()
    first = LookPlan.build(SequentialSettings(), {"passkey": [f"passkey/{i}" for i in range(200)]}, 0.05, 0.05)
    keep = set(first.ids_through(0))
    (cand / ITEMS_FILE).write_text("\n".join(x for x in lines if json.loads(x)["id"] in keep) + "\n")
    [v] = evaluate_gate(_cfg(), base, [cand]).candidates
    assert v.status == INCONCLUSIVE and v.sequential["decision"] == "CONTINUE" and v.sequential["items_total"] == 50
    assert "upper boundary at look 1" in v.tasks[0].reasons[0]
    [fixed] = evaluate_gate(GateConfig.from_dict(MARGIN_ONLY), base, [cand]).candidates
    assert fixed.status == ERROR and "only in the baseline" in fixed.error
    # items past a gap in the look order are not the first blocks
    (cand / ITEMS_FILE).write_text("\n".join(lines[100:]) + "\n")
    [gap] = evaluate_gate(_cfg(), base, [cand]).candidates
    assert gap.status == ERROR and "not" in gap.error and "first blocks" in gap.error


def test_without_a_section_the_gate_is_the_fixed_n_gate(tmp_path):
    base, cand = _pair(tmp_path, 300, 0.25, 0.0)
    fixed = evaluate_gate(GateConfig.from_dict(MARGIN_ONLY), base, [cand])
    assert fixed.candidates[0].sequential is None and fixed.candidates[0].tasks[0].comparison.n == 300
    data = fixed.to_dict()
    assert "sequential" not in data["config"] and "sequential" not in data["candidates"][0]
    assert "sequential" not in data["candidates"][0]["tasks"][0] and "look" not in fixed.candidates[0].line()


def test_gate_json_replays_the_looks_and_refuses_an_edited_one(tmp_path):
    base, cand = _pair(tmp_path, 300, 0.25, 0.0)
    result = evaluate_gate(_cfg(), base, [cand])
    write_gate_outputs(result, tmp_path / "gate")
    data, path = read_gate_file(tmp_path / "gate")
    check_gate_file(data, path)  # the runs give the same looks again
    assert data["candidates"][0]["sequential"]["look"] == 1
    assert "Sequential: looks at 0.25, 0.5, 0.75, 1" in (tmp_path / "gate" / "gate.md").read_text()
    data["candidates"][0]["sequential"]["look"] = 3
    with pytest.raises(ResultFileError, match="sequential"):
        check_gate_file(data, path)


# ----------------------------------------------------------------------------- error rates through kveval gate


def test_error_rates_through_the_gate_command(tmp_path):
    """The issue's guarantees, through ``kveval gate`` on synthetic run folders (the full tables, three designs and
    400 candidates per row: ``python3 benchmarks/sequential_gate.py``): A/A candidates FAIL at most 5%, a planted
    10-point loss FAILs in at least 95% (at the maximum 300 items: the design's power), 3 unchanged items never
    PASS, and the reported interval covers the true change of clustered items in at least 93%."""
    rng = np.random.default_rng(20261207)
    config = gate_yaml("sequential: true", 0.05)
    aa = gate_rates(tmp_path / "aa", config, 60, rng, 300, (0.045, 0.045))
    assert aa["FAIL"] <= 0.05 and aa["ERROR"] == 0 and aa["items"] < 300
    loss = gate_rates(tmp_path / "loss", config, 60, rng, 300, (0.1, 0.0))
    assert loss["FAIL"] >= 0.95 and loss["PASS"] == 0 and loss["items"] < 250
    few = gate_rates(tmp_path / "few", config, 20, rng, 3, (0.0, 0.0))
    assert few["PASS"] == 0 and few["INCONCLUSIVE"] == 1
    clustered = gate_rates(tmp_path / "clustered", config, 60, rng, 200, "clustered")
    assert clustered["coverage"] >= 0.93 and clustered["ERROR"] == 0


# ----------------------------------------------------------------------------- the sequential sweep


GATE = "margin: 0.5\nmax_negative_flip_rate: null\nmax_confusion_increase: null\n"


def _sweep_config(tmp_path: Path, sequential: str = "sequential: true") -> Path:
    from tests.test_models import tiny_llama_folder

    model = tiny_llama_folder(tmp_path / "tiny") if not (tmp_path / "tiny").is_dir() else str(tmp_path / "tiny")
    (tmp_path / "gate.yaml").write_text(GATE)
    path = tmp_path / f"sweep-{len(sequential)}.yaml"
    path.write_text(f"name: seq\nmodels: [{model}]\nbatch_size: 4\n"
                    f"policies: ['kivi(bits=4,group=8)', 'streaming(sink=1,window=4)']\n"
                    f"probes: {{families: [passkey, niah_single], lengths: [96], depths: [0.2, 0.8], n: 16}}\n"
                    f"gate: gate.yaml\n{sequential}\n")
    return path


def _written(out: Path) -> dict:
    from kveval.runs.records import read_items

    return {run.name: [(r.id, r.answer, r.score) for r in read_items(run)] for run in sorted(out.glob("runs/*/*"))}


def _decisions(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["sequential_decisions"]


def test_a_sequential_sweep_stops_decided_candidates_in_stratified_blocks(tmp_path):
    from kveval.commands.main import main

    out = tmp_path / "out"
    assert main(["sweep", str(_sweep_config(tmp_path, "sequential: true\nnoise_floor: true")), "--out", str(out),
                 "--quiet"]) == 0
    runs = _written(out)
    # the noise floor reran only the baseline items that were run
    from kveval.runs.records import read_items

    [floor] = out.glob("noise_floor/runs/*/none")
    assert sorted(r.id for r in read_items(floor)) == sorted(i for i, _, _ in runs["none"])
    decisions = _decisions(out)
    # margin 0.5, nothing flips on a random model: every candidate PASSes at look 2, on half of each task's items
    for name, record in decisions.items():
        assert record["look"] == 2 and record["items"] == {"passkey": 8, "niah_single": 8}, name
        assert record["decision"] == ("BASELINE" if name.endswith("/none") else PASS)
    assert all(len(items) == 16 for items in runs.values())
    # block 1 is every task's first quarter, both depths in it; the run order is block by block
    base = runs["none"]
    first = [item_id for item_id, _, _ in base[:8]]
    assert {i.split("-")[0] for i in first} == {"passkey", "niah_single"}
    for task in ("passkey", "niah_single"):
        assert {i.split("-")[2] for i in first if i.startswith(task)} == {"0.20", "0.80"}
    gate = json.loads((out / "gate" / "gate.json").read_text())
    cands = (gate["results"][0] if "results" in gate else gate)["candidates"]
    assert [c["sequential"]["items_total"] for c in cands] == [16, 16]
    from kveval.commands.main import main as cli

    assert cli(["report", str(out / "runs"), "--gate", str(out / "gate"), "--out", str(tmp_path / "rep")]) == 0


def test_a_killed_sequential_sweep_resumes_to_the_same_decisions_and_items(tmp_path, monkeypatch):
    from kveval.commands.main import main
    from kveval.runs import records

    config = _sweep_config(tmp_path)
    assert main(["sweep", str(config), "--out", str(tmp_path / "whole"), "--quiet"]) == 0
    real, count = records.ItemWriter.write, {"n": 0}

    def dying(self, record):
        count["n"] += 1
        if count["n"] > 30:  # in the middle of the second block (24 writes a block: 8 items, 3 runs)
            raise KeyboardInterrupt("killed")
        return real(self, record)

    monkeypatch.setattr(records.ItemWriter, "write", dying)
    assert main(["sweep", str(config), "--out", str(tmp_path / "killed"), "--quiet"]) != 0  # interrupted
    monkeypatch.setattr(records.ItemWriter, "write", real)
    assert 24 < sum(len(v) for v in _written(tmp_path / "killed").values()) < 48
    assert main(["sweep", str(config), "--out", str(tmp_path / "killed"), "--quiet"]) == 0
    assert _written(tmp_path / "killed") == _written(tmp_path / "whole")
    assert _decisions(tmp_path / "killed") == _decisions(tmp_path / "whole")
    # finished: a third run loads no weights and changes nothing
    from kveval.runner import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a decided sweep loaded weights"))
    assert main(["sweep", str(config), "--out", str(tmp_path / "killed"), "--quiet"]) == 0
    assert _written(tmp_path / "killed") == _written(tmp_path / "whole")


def test_sequential_false_runs_every_item_as_before(tmp_path):
    from kveval.commands.main import main
    from kveval.sweep.config import load_config

    config = _sweep_config(tmp_path, "sequential: false")
    assert load_config(config).sequential is None
    out = tmp_path / "out"
    assert main(["sweep", str(config), "--out", str(out), "--quiet"]) == 0
    assert all(len(items) == 32 for items in _written(out).values())
    assert "sequential_decisions" not in json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("extra, message", [
    ("sequential: {looks: [0.5, 0.4, 1.0]}", "increase strictly"),
    ("sequential: true\nfidelity: true", "fidelity is measured on every item"),
])
def test_sweep_sequential_keys_are_checked_at_the_edge(tmp_path, extra, message):
    from kveval.sweep.config import load_config

    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\npolicies: ['kivi(bits=4)']\n{extra}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_the_time_to_verdict_benchmark_runs_both_sweeps_side_by_side(tmp_path, capsys):
    from benchmarks.sequential_quickstart import main as benchmark

    config = _sweep_config(tmp_path, "")
    runs = benchmark(["--config", str(config), "--keep", str(tmp_path / "bench")])
    fixed, seq = runs["fixed-n"]["candidates"], runs["sequential"]["candidates"]
    assert fixed.keys() == seq.keys() and len(fixed) == 2
    assert all(items == 32 for _, items in fixed.values()) and all(items == 16 for _, items in seq.values())
    assert {s for s, _ in fixed.values()} == {s for s, _ in seq.values()} == {PASS}
    out = capsys.readouterr().out
    assert "| candidate | fixed-n verdict | items | sequential verdict | items | same verdict |" in out
    assert f"ratio {runs['ratio']:.2f}" in out
    assert "floor" not in runs and "floor: every candidate stopped before its last item" in out


def test_the_benchmark_times_the_floor_of_candidates_that_need_every_item(tmp_path, capsys):
    """A candidate that runs every item sequentially bounds the ratio from below: the benchmark runs the baseline and
    those candidates alone, fixed-n, and their items are the fixed-n run's."""
    from benchmarks.sequential_quickstart import main as benchmark

    config = _sweep_config(tmp_path, "")
    (tmp_path / "gate.yaml").write_text(GATE + "sequential: {looks: [1.0]}\n")  # one look: nobody stops early
    runs = benchmark(["--config", str(config), "--keep", str(tmp_path / "bench")])
    assert runs["floor"]["policies"] == ["kivi(bits=4,group=8)", "streaming(sink=1,window=4)"]
    bench = tmp_path / "bench"
    assert _written(bench / "floor") == _written(bench / "fixed-n") and len(_written(bench / "floor")) == 3
    assert 0 < runs["floor_ratio"] and f"ratio {runs['floor_ratio']:.2f}: no look schedule" in capsys.readouterr().out


def test_a_sequential_sweep_finished_fixed_n_keeps_its_verdicts(tmp_path, capsys):
    """benchmarks/sequential_verdicts.py finishes a copy of a sequential sweep fixed-n: the stopped candidates run the
    items they skipped, the verdicts are compared, and the sweep itself is not written."""
    from benchmarks.sequential_verdicts import main as finish
    from kveval.commands.main import main

    out = tmp_path / "seq"
    assert main(["sweep", str(_sweep_config(tmp_path)), "--out", str(out), "--quiet"]) == 0
    before = _written(out)
    runs = finish([str(_sweep_config(tmp_path)), "--sweep", str(out), "--keep", str(tmp_path / "finish")])
    assert _written(out) == before and all(len(v) == 16 for v in before.values())
    finished = _written(tmp_path / "finish" / "seq")
    assert all(len(v) == 32 for v in finished.values())
    assert all(set(before[k]) <= set(finished[k]) for k in before)  # the sequential items kept, not rerun
    assert [(r["sequential"], r["fixed_n"], r["look"], r["items"]) for r in runs["rows"]] == [(PASS, PASS, 2, 16)] * 2
    assert runs["same"] == 2 and runs["item_runs"] == {"sequential": 48, "fixed_n": 96}
    assert "2 of 2 verdicts the same" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--config", "no-such.yaml"], None])
def test_the_sequential_benchmarks_refuse_a_missing_config_in_one_line(argv, capsys):
    from benchmarks.sequential_quickstart import main as time_to_verdict
    from benchmarks.sequential_verdicts import main as finish

    with pytest.raises(SystemExit) as exit_:
        (time_to_verdict(argv) if argv else finish(["no-such.yaml"]))
    assert exit_.value.code == 2 and "no-such.yaml: no such sweep config" in capsys.readouterr().err


def test_the_caps_spend_the_fail_error_rate_over_the_looks():
    """A cap (flips, confusion, KL) is tested at each look at the FAIL spending function's increment: the increments
    sum to alpha (its error rate by the union bound), O'Brien-Fleming spends almost nothing at the first look, and a
    candidate sitting just over a cap is not FAILed early where the fixed-n test would FAIL it at the end."""
    from kveval.gate.config import GateConfig
    from kveval.gate.rules import _lower_binomial, cap_alpha

    cfg = GateConfig.from_dict({"margin": 0.1, "sequential": {"looks": [0.25, 0.5, 0.75, 1.0]}})
    design = cfg.sequential.design_of((15, 30, 45, 60), cfg.alpha, cfg.alpha)
    spent = [cap_alpha(cfg, design, k) for k in range(4)]
    assert sum(spent) == pytest.approx(cfg.alpha, abs=1e-12)
    assert spent[0] < 1e-3 < spent[3] and all(a > 0 for a in spent)
    # 5 of 15 right answers turned wrong: over a 10% cap at the fixed alpha, not at the first look's increment
    assert _lower_binomial(5, 15, cfg.alpha) > 0.1 > _lower_binomial(5, 15, spent[0])


def test_a_candidate_sitting_over_a_cap_is_not_failed_by_it_at_the_first_look(tmp_path):
    """The net flip cap at the first look is tested at the spending increment: 20% of answers regressing (10-point cap)
    shows at the fixed alpha on the first 75 items, not at the first look's; the candidate FAILs at a later look."""
    from kveval.gate import sequential as seq
    from kveval.gate.rules import _lower_binomial
    from kveval.runs.results import load_run

    base, cand = _pair(tmp_path, 300, 0.2, 0.0, seed=3)
    cfg = _cfg(margin=0.9, max_negative_flip_rate=0.1)  # the margin cannot FAIL it: only the cap can
    [v] = evaluate_gate(cfg, base, [cand]).candidates
    first = set(seq.run_order(load_run(base))["passkey"][:75])
    b, c = ({r.id: r.correct for r in load_run(run).items if r.id in first} for run in (base, cand))
    lost = sum(b[i] and not c[i] for i in first)
    assert _lower_binomial(lost, 75, cfg.alpha) > 0.1  # tested at the full alpha, look 1 would FAIL it
    assert v.status == FAIL and v.sequential["look"] > 1
