"""Leaderboard report: markdown, CSV, self-contained HTML and PNG plots from fixture runs."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from kveval.commands import main as cli
from kveval.gate.config import GateConfig
from kveval.gate.report import write_gate_outputs
from kveval.gate.rules import evaluate_gate
from kveval.report.leaderboard import build_report
from kveval.runs.records import ItemRecord, ItemWriter, ResultFileError, RunInfo, write_run_info

PNG = b"\x89PNG\r\n\x1a\n"
NOMINAL = 2 * 30 * 3 * 64 * 4  # fp32 SmolLM2 K+V bytes per token


@pytest.fixture(autouse=True)
def only_our_commands(monkeypatch):
    keep = {k: v for k, v in cli.COMMANDS.items() if k in ("compare", "gate", "report")}
    monkeypatch.setattr(cli, "COMMANDS", keep)


def items(n_wrong_extra: int = 0, category: str = "distractor") -> list[ItemRecord]:
    out = []
    for i in range(160):  # 100 niah_multikey + 60 passkey items: enough for the gate to PASS or FAIL
        ok = i % 5 != 4
        if ok and n_wrong_extra and i < 20 * n_wrong_extra:
            ok = i % 4 != 0  # every fourth of the first items flips
        cat = "correct" if ok else (category if i % 5 != 4 else "fabricated")
        task = "niah_multikey" if i < 100 else "passkey"
        out.append(
            ItemRecord(
                id=f"{task}/{i}",
                hash=hashlib.md5(f"p{i}".encode()).hexdigest(),
                task=task,
                score=float(ok),
                correct=ok,
                category=cat,
                answer="7" if ok else "9",
                recalled=f"{cat}:9" if cat == "distractor" else None,
                length=[256, 512, 1024][i % 3],
                depth=[0.0, 0.5, 1.0][(i // 3) % 3],
            )
        )
    return out


def write(folder: Path, policy: str, records: list[ItemRecord], ratio=None, bpt=None, model="smollm2-135m") -> Path:
    family = "none" if policy == "none" else policy.split("(")[0]
    write_run_info(
        folder,
        RunInfo(
            name=f"{model}/{policy}",
            model=model,
            policy=policy,
            family=family,
            ratio=ratio,
            bytes_per_token=bpt,
            nominal_bytes_per_token=NOMINAL,
        ),
    )
    with ItemWriter(folder) as w:
        for r in records:
            w.write(r)
    return folder


@pytest.fixture()
def sweep(tmp_path):
    root = tmp_path / "sweep"
    write(root / "runs" / "base", "none", items(), bpt=NOMINAL)
    write(root / "runs" / "snap50", "snapkv(ratio=0.5)", items(1), ratio=0.5, bpt=NOMINAL / 2)
    write(root / "runs" / "snap75", "snapkv(ratio=0.75)", items(4), ratio=0.75, bpt=NOMINAL / 4)
    write(root / "runs" / "kivi", "kivi(bits=4)", items(2, "stale"), bpt=NOMINAL / 7.5)
    return root


def test_build_report_writes_everything(sweep, tmp_path):
    gate = evaluate_gate(None, sweep / "runs" / "base", sorted((sweep / "runs").glob("snap*")))
    paths = build_report([sweep], tmp_path / "out", gate_result=gate, n_resamples=999)
    for key in ("markdown", "csv", "json", "html"):
        assert Path(paths[key]).is_file()
    names = sorted(p.name for p in paths["plots"])
    assert names == ["confusion_smollm2-135m.png", "heatmap_smollm2-135m.png", "score_vs_compression.png"]
    for p in paths["plots"]:
        assert p.read_bytes().startswith(PNG)

    md = Path(paths["markdown"]).read_text()
    assert "| model | policy |" in md and "snapkv(ratio=0.75)" in md and "kivi(bits=4)" in md
    assert "**7.50x**" in md  # highest measured compression marked
    assert "FAIL" in md and "## Gate" in md

    rows = list(csv.DictReader(Path(paths["csv"]).open()))
    assert [r["policy"] for r in rows] == ["none", "kivi(bits=4)", "snapkv(ratio=0.5)", "snapkv(ratio=0.75)"]
    by_policy = {r["policy"]: r for r in rows}
    assert float(by_policy["snapkv(ratio=0.5)"]["compression"]) == pytest.approx(2.0)
    assert float(by_policy["snapkv(ratio=0.75)"]["delta"]) < 0
    assert by_policy["snapkv(ratio=0.75)"]["verdict"] == "FAIL"
    assert by_policy["kivi(bits=4)"]["verdict"] == ""  # not gated
    assert by_policy["none"]["verdict"] == "baseline"
    assert float(by_policy["snapkv(ratio=0.75)"]["negative_flip_rate[niah_multikey]"]) > 0
    assert 0 <= float(by_policy["snapkv(ratio=0.75)"]["p_holm_sweep[niah_multikey]"]) <= 1

    page = Path(paths["html"]).read_text()
    assert '<table id="leaderboard">' in page and "<style>" in page
    assert page.count('src="data:image/png;base64,') == 3
    assert "\u2605" in page and "<link" not in page and "http" not in page.split("</style>")[1]
    data = json.loads(Path(paths["json"]).read_text())
    assert data["tasks"] == ["niah_multikey", "passkey"] and len(data["rows"]) == 4


def test_report_cli_with_gate_json_and_run_dirs(sweep, tmp_path, capsys):
    runs = sweep / "runs"
    gate_out = tmp_path / "gate"
    write_gate_outputs(evaluate_gate(None, runs / "base", [runs / "snap50"]), gate_out)
    out = tmp_path / "rep"
    argv = ["report", str(runs / "base"), str(runs / "snap50"), "--out", str(out), "--gate", str(gate_out), "--resamples", "999"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "snapkv(ratio=0.5)" in text and "wrote" in text
    assert (out / "leaderboard.html").is_file() and (out / "heatmap_smollm2-135m.png").is_file()


def test_report_refuses_corrupt_run(sweep, tmp_path, capsys):
    f = sweep / "runs" / "snap75" / "items.jsonl"
    f.write_text(f.read_text()[:-20])
    assert cli.main(["report", str(sweep), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated" in err[0]
    assert cli.main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "no such run or sweep folder" in capsys.readouterr().err


def test_sweep_gate_two_models_into_report(sweep, tmp_path):
    from kveval.gate.rules import evaluate_sweep, group_runs_by_baseline
    from kveval.gate.verdicts import exit_code

    write(sweep / "runs" / "g_base", "none", items(), bpt=NOMINAL, model="gemma3-270m")
    write(sweep / "runs" / "g_snap", "snapkv(ratio=0.5)", items(), ratio=0.5, bpt=NOMINAL / 2, model="gemma3-270m")
    results = evaluate_sweep(None, [sweep])
    by_model = {r.baseline.model: r for r in results}
    assert sorted(by_model) == ["gemma3-270m", "smollm2-135m"]
    assert [c.status for c in by_model["gemma3-270m"].candidates] == ["PASS"]
    assert exit_code(results) == 1  # snapkv(ratio=0.75) on smollm2 regressed
    paths = write_gate_outputs(results, tmp_path / "gate")
    data = json.loads(paths["json"].read_text())
    assert data["exit_code"] == 1 and len(data["results"]) == 2
    rep = build_report([sweep], tmp_path / "rep", gate_result=tmp_path / "gate", n_resamples=999)
    rows = {(r["model"], r["policy"]): r["verdict"] for r in csv.DictReader(Path(rep["csv"]).open())}
    assert rows[("gemma3-270m", "snapkv(ratio=0.5)")] == "PASS"
    assert rows[("smollm2-135m", "snapkv(ratio=0.75)")] == "FAIL"
    assert len([p for p in rep["plots"] if p.name.startswith("heatmap_")]) == 2

    # family "sweep": one Holm family over every model's candidates x tasks
    from statsmodels.stats.multitest import multipletests

    fam = [t.comparison for r in evaluate_sweep(GateConfig.from_dict({"family": "sweep"}), [sweep]) for c in r.candidates for t in c.tasks]
    assert len(fam) == 2 * 4  # (snap50, snap75, kivi, g_snap) x 2 tasks
    expected = multipletests([c.pvalue for c in fam], method="holm")[1]
    assert [c.p_holm for c in fam] == pytest.approx(list(expected), abs=1e-12)

    write(sweep / "runs" / "orphan", "snapkv(ratio=0.5)", items(), model="qwen")
    with pytest.raises(ResultFileError, match="no baseline run .* for model 'qwen'"):
        group_runs_by_baseline([sweep])


def test_an_output_path_through_a_file_is_one_line_not_a_bug(sweep, tmp_path, capsys):
    """--out under a file (or naming a file where a folder must be) is the user's to fix: one line, exit 2 (it
    printed a traceback and "internal error ... this is a bug in kveval")."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker / "report", blocker):
        assert cli.main(["report", str(sweep), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "internal error" not in err[0] and str(blocker) in err[0], err


def test_a_policy_run_in_both_modes_is_shown_side_by_side(tmp_path):
    """kvpress's leaderboard separates query-agnostic and query-aware compression: a sweep that runs a policy both
    ways gets one line per policy with both modes' scores and changes adjacent, and the gap between them."""
    base = write(tmp_path / "none", "none", items())
    agnostic = write(tmp_path / "snap", "snapkv(ratio=0.5)", items(n_wrong_extra=2), bpt=9000.0)
    aware = write(tmp_path / "snapq", "snapkv(ratio=0.5)", items(n_wrong_extra=1), bpt=9000.0)
    info = json.loads((aware / "run.json").read_text())
    info.update(mode="query", name="smollm2-135m/snapkv(ratio=0.5)@query")
    (aware / "run.json").write_text(json.dumps(info))
    alone = write(tmp_path / "knorm", "knorm(ratio=0.5)", items(n_wrong_extra=1), bpt=9000.0)  # one mode only
    paths = build_report([base, agnostic, aware, alone], tmp_path / "out", n_resamples=100)
    board = Path(paths["markdown"]).read_text()
    section = board.split("## Query-agnostic and query-aware", 1)[1]
    [line] = [ln for ln in section.splitlines() if ln.startswith("| smollm2-135m")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # 160 items, 80% right at baseline; agnostic loses every fourth of the first 40 right items (8), aware of 20 (4)
    assert cells[1:] == ["snapkv(ratio=0.5)", "9,000", "0.750", "-0.050", "0.775", "-0.025", "+0.025"]
    assert "knorm" not in section
    page = Path(paths["html"]).read_text()
    assert "<h2>Query-agnostic and query-aware</h2>" in page and "<td>+0.025</td>" in page
    only_one = build_report([base, agnostic, alone], tmp_path / "out2", n_resamples=100)
    assert "Query-agnostic and query-aware" not in Path(only_one["markdown"]).read_text()
