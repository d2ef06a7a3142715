"""Long-output probe families (kveval.probes.long_output): sequence scoring on hand-computed cases, the items they
make, and the decode columns of the report (peak decode bytes, output length against the baseline)."""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import pytest

from kveval.probes import FAMILIES, ProbeItem, generate_items, score_answer
from kveval.probes.item import Needle
from kveval.probes.scoring import edit_distance, score_sequence
from kveval.report.leaderboard import build_report
from kveval.runner.evaluate import _record
from kveval.runner.generation import GenerationResult
from kveval.runs.records import ItemRecord, ItemWriter, RunInfo, write_run_info


def _item(gold, kind="word", needles=()) -> ProbeItem:
    return ProbeItem(id="x", hash="h", family="recite_list", params={}, context="", question="Write out the list.",
                     prompt_context="", prompt_question="", gold=list(gold), needles=list(needles), length=10,
                     depth=0.5, value_kind=kind, scoring="sequence")


GOLD = ["acorn", "banjo", "cello", "daisy"]


def test_edit_distance_counts_insertions_deletions_substitutions():
    assert edit_distance([], ["a", "b"]) == 2
    assert edit_distance(["a", "b", "c"], ["a", "c"]) == 1
    assert edit_distance(["a", "c", "b"], ["a", "b", "c"]) == 2
    assert edit_distance(["x", "y"], ["a", "b"]) == 2


@pytest.mark.parametrize("answer, score, category, omitted, invented, reordered", [
    (" acorn, banjo, cello, daisy.", 1.0, "correct", 0, 0, 0),
    # The first paragraph alone: a base model's next question is not part of the answer.
    (" 1. acorn, 2. banjo, 3. cello, 4. daisy.\n\nQuestion: list eagle, falcon", 1.0, "correct", 0, 0, 0),
    # Two swapped: distance 2 of 4.
    (" acorn, cello, banjo, daisy", 0.5, "partial", 0, 0, 1),
    # One left out: distance 1 of 4.
    (" acorn, banjo, daisy", 0.75, "partial", 1, 0, 0),
    # Every element in order and one more (a vocabulary word): distance 1 of 5.
    (" acorn, banjo, cello, daisy, banjo", 0.8, "over_inclusion", 0, 1, 0),
    # Repeats while losing its place: 2 right, then 4 invented repeats; distance 2 + 2 = 4 of 6.
    (" acorn, banjo, banjo, banjo, banjo, banjo", 1 - 4 / 6, "partial", 2, 4, 0),
    (" I cannot remember the list.", 0.0, "no_value", 4, 0, 0),
    ("\n\n", 0.0, "empty", 4, 0, 0),
])
def test_sequence_scores_hand_computed(answer, score, category, omitted, invented, reordered):
    result = score_answer(_item(GOLD), answer)
    assert result.score == pytest.approx(score)
    assert result.category == category and result.correct == (category == "correct")
    assert (result.detail["omitted"], result.detail["invented"], result.detail["reordered"]) == (omitted, invented,
                                                                                                  reordered)


def test_another_counters_value_is_a_distractor():
    needles = [Needle("k", v, "target") for v in ("1234", "5678", "9012")] + [Needle("other", "4444", "distractor")]
    item = _item(["1234", "5678", "9012"], kind="number", needles=needles)
    result = score_sequence(item, " 1234, 4444, 9012")
    assert result.category == "distractor" and result.recalled == "distractor:4444"
    assert result.score == pytest.approx(1 - 1 / 3)
    # Repeated values count each time they are written.
    assert score_sequence(item, " 1234, 5678, 5678, 9012").score == pytest.approx(0.75)


def test_long_output_items_ask_for_long_ordered_answers(tok):
    assert {"recite_list", "state_trace"} <= set(FAMILIES)
    (recite,) = generate_items("recite_list", tok, 400, 1, depths=[0.5], num_items=10)
    assert recite.scoring == "sequence" and len(recite.gold) == 10 and len(set(recite.gold)) == 10
    assert [n.value for n in recite.needles] == recite.gold and all(n.role == "target" for n in recite.needles)
    # One sentence, numbered as the answer writes it.
    assert f"in order: 1. {recite.gold[0]}, 2. {recite.gold[1]}, 3. " in recite.context
    assert recite.prompt_question.endswith("1.") and recite.max_new_tokens >= 60
    assert score_answer(recite, " " + ", ".join(f"{i + 1}. {w}" for i, w in enumerate(recite.gold)) + ".").correct

    (trace,) = generate_items("state_trace", tok, 500, 1, depths=[0.0], num_updates=6, num_distractors=1)
    targets = [n for n in trace.needles if n.role == "target"]
    assert [n.value for n in targets] == trace.gold and len(trace.gold) == 6  # in order through the context
    assert [n.span for n in targets] == sorted(n.span for n in targets)
    assert len([n for n in trace.needles if n.role == "distractor"]) == 3
    assert trace.max_new_tokens >= 2 * 6


def test_items_record_the_output_length_and_peak():
    item = _item(GOLD)
    result = GenerationResult("acorn", [5, 6, 7], [0.0] * 3, _stats(), 0.1, 10.0, 0.3, None, peak_kv_bytes=4096)
    record = _record(item, result, score_answer(item, "acorn"))
    assert record.metrics["new_tokens"] == 3 and record.metrics["peak_kv_bytes"] == 4096


def _stats():
    from kveval.cache.compressed import CacheStats

    return CacheStats(kv_bytes=2048, nominal_bytes=4096, index_bytes=0, tokens_seen=[10], kept_tokens=[[10]])


def _write(folder: Path, policy: str, lengths: list[int], peak: int) -> None:
    write_run_info(folder, RunInfo(name=f"m/{policy}", model="m", policy=policy,
                                   family="none" if policy == "none" else policy.split("(")[0],
                                   bytes_per_token=100.0, nominal_bytes_per_token=100.0))
    with ItemWriter(folder) as w:
        for i, n in enumerate(lengths):
            w.write(ItemRecord(id=f"recite_list/{i}", hash=hashlib.md5(str(i).encode()).hexdigest(), task="recite_list",
                               score=1.0 if i % 2 else 0.5, correct=bool(i % 2), category="correct" if i % 2 else "partial",
                               answer="a", metrics={"new_tokens": n, "peak_kv_bytes": peak + i * 2**20}))


def test_the_leaderboard_shows_peak_decode_bytes_and_output_length(tmp_path):
    """Baseline answers of 10 and 20 tokens, the candidate's 15 and 20: ratios 1.5 and 1.0 (mean 1.25), changes +5
    and 0 (mean +2.5). Peaks 1 and 2 MiB (mean 1.5) for the candidate."""
    _write(tmp_path / "runs" / "base", "none", [10, 20], 4 * 2**20)
    _write(tmp_path / "runs" / "rkv", "rkv(ratio=0,decode_budget=64)", [15, 20], 2**20)
    paths = build_report([tmp_path], tmp_path / "out", n_resamples=999)
    md = Path(paths["markdown"]).read_text()
    assert "peak decode MiB" in md and "output length" in md
    assert "| 1.50 | x1.25 (+2.5 tok) |" in md and "| 4.50 | 15.0 tok |" in md
    rows = {r["policy"]: r for r in csv.DictReader(Path(paths["csv"]).open())}
    assert float(rows["rkv(ratio=0,decode_budget=64)"]["output_length_ratio"]) == pytest.approx(1.25)
    assert float(rows["rkv(ratio=0,decode_budget=64)"]["output_length_delta"]) == pytest.approx(2.5)
    assert float(rows["rkv(ratio=0,decode_budget=64)"]["peak_decode_bytes_mean"]) == 1.5 * 2**20
    assert "peak decode MiB" in Path(paths["html"]).read_text()
