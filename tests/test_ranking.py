"""The report's ranking of candidates against each other (kveval/report/ranking.py): pairs on common items, Holm
over a model's pairs, tiers that separate only what the items show."""

from __future__ import annotations

import hashlib
import json

import pytest

from kveval.commands import main as cli
from kveval.report.ranking import RANKING_ALPHA, rank_rows, ranking_markdown
from kveval.report.rows import collect_rows
from kveval.runs.records import ItemRecord, ResultFileError, read_run_info, write_run_info
from kveval.runs.results import SEQUENTIAL_DECISION
from tests.test_report import NOMINAL, write


def records(wrong: set[int], n: int = 200, prompt: str = "p") -> list[ItemRecord]:
    out = []
    for i in range(n):
        ok = i not in wrong
        out.append(ItemRecord(id=f"passkey/{i}", hash=hashlib.md5(f"{prompt}{i}".encode()).hexdigest(), task="passkey",
                              score=float(ok), correct=ok, category="correct" if ok else "fabricated",
                              answer="7" if ok else "9", length=512, depth=[0.1, 0.5, 0.9][i % 3]))
    return out


@pytest.fixture()
def runs(tmp_path):
    base = write(tmp_path / "base", "none", records(set()), bpt=NOMINAL)
    good = write(tmp_path / "good", "quant(bits=8)", records({1}), bpt=NOMINAL / 2)
    close = write(tmp_path / "close", "quant(bits=6)", records({1, 2}), bpt=NOMINAL / 2)
    bad = write(tmp_path / "bad", "quant(bits=2)", records(set(range(0, 200, 3))), bpt=NOMINAL / 8)
    return [base, good, close, bad]


def test_a_large_loss_is_told_apart_and_a_one_item_difference_is_not(runs):
    rows, _ = collect_rows(runs, n_resamples=1000)
    (m,) = rank_rows(rows, n_resamples=1000)
    assert [r.label for r in m.runs] == ["quant(bits=8)", "quant(bits=6)", "quant(bits=2)"]
    assert [r.tier for r in m.runs] == [1, 1, 3]
    assert m.runs[2].worse_than == ("quant(bits=8)", "quant(bits=6)")
    by_pair = {(p.a, p.b): p for p in m.pairs}
    small = by_pair[("quant(bits=8)", "quant(bits=6)")]
    assert (small.n, small.delta) == (200, -0.005) and not small.separated
    big = by_pair[("quant(bits=8)", "quant(bits=2)")]
    assert big.delta == pytest.approx(-(67 - 1) / 200) and big.ci_high < 0 and big.p_holm < RANKING_ALPHA
    # Holm over the three pairs: every adjusted p-value is at least its raw one
    assert all(p.p_holm >= p.pvalue for p in m.pairs)
    text = ranking_markdown([m])
    assert "Pairs told apart: 2 of 3." in text and "| 3 | quant(bits=2) |" in text


def test_runs_that_stopped_early_are_paired_on_the_items_both_ran(tmp_path):
    base = write(tmp_path / "base", "none", records(set()), bpt=NOMINAL)
    full = write(tmp_path / "full", "quant(bits=8)", records(set()), bpt=NOMINAL / 2)
    short = write(tmp_path / "short", "streaming(window=8)", records(set(range(40)), n=50), bpt=NOMINAL / 8)
    info = read_run_info(short)  # as a sequential sweep records a candidate it stopped at its first look
    info.extra[SEQUENTIAL_DECISION] = {"decision": "FAIL", "look": 0, "looks": [50, 100, 150, 200],
                                       "items": {"passkey": 50}, "items_total": 50}
    write_run_info(short, info)
    rows, _ = collect_rows([base, full, short], n_resamples=1000)
    (m,) = rank_rows(rows, n_resamples=1000)
    (pair,) = m.pairs
    assert pair.n == 50 and pair.delta == pytest.approx(-40 / 50) and pair.separated


def test_a_prompt_that_differs_between_candidates_is_refused(tmp_path):
    base = write(tmp_path / "base", "none", records(set()), bpt=NOMINAL)
    a = write(tmp_path / "a", "quant(bits=8)", records(set()), bpt=NOMINAL / 2)
    b = write(tmp_path / "b", "quant(bits=4)", records(set()), bpt=NOMINAL / 4)
    rows, _ = collect_rows([base, a, b], n_resamples=1000)
    rows[2].run.items[0] = ItemRecord(**{**rows[2].run.items[0].__dict__, "hash": "0" * 32})
    with pytest.raises(ResultFileError, match="has another prompt in each"):
        rank_rows(rows, n_resamples=1000)


def test_report_rank_writes_the_ranking(runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["report", *map(str, runs), "--out", str(out), "--rank", "--no-prompts", "--resamples", "1000"]) == 0
    assert "# kveval ranking" in capsys.readouterr().out
    data = json.loads((out / "ranking.json").read_text())
    assert [r["tier"] for r in data[0]["runs"]] == [1, 1, 3]
    assert (out / "ranking.md").is_file()
    assert cli.main(["report", *map(str, runs), "--out", str(tmp_path / "plain"), "--no-prompts",
                     "--resamples", "1000"]) == 0
    assert not (tmp_path / "plain" / "ranking.md").exists()


def test_a_sweep_config_asks_for_the_ranking_with_a_boolean(tmp_path):
    from kveval.errors import ConfigError
    from kveval.sweep.config import load_config

    good = tmp_path / "good.yaml"
    good.write_text("name: r\npolicies: [quant(bits=8)]\nrank: true\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text("name: r\npolicies: [quant(bits=8)]\n")
    assert load_config(good).rank and not load_config(plain).rank
    assert load_config(good).hash == load_config(plain).hash  # it changes the report, never a result
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: r\npolicies: [quant(bits=8)]\nrank: yes please\n")
    with pytest.raises(ConfigError, match="rank='yes please'; use true"):
        load_config(bad)
