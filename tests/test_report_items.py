"""The report's per-item before/after views, verdict sentences and full-spec plot labels, on fixture runs (no
browser: tests/test_report_browser.py opens the page)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kveval.gate.config import GateConfig
from kveval.gate.report import to_markdown
from kveval.gate.rules import evaluate_gate
from kveval.probes.item import Needle, ProbeItem
from kveval.report import plots
from kveval.report.items import Passage, Recalled, kind_of, passage, run_changes
from kveval.report.leaderboard import build_report
from kveval.report.rows import collect_rows
from kveval.report.verdicts import verdict
from kveval.runs.records import ItemRecord, ItemWriter, RunInfo, write_run_info
from kveval.runs.results import load_run, sample_documents

FILLER = "The grass is green. The sky is blue. " * 12


def probe(i: int) -> ProbeItem:
    """Item ``i``: pass key ``1000+i`` planted mid-context, and a distractor key whose value is ``9000+i``."""
    context = (FILLER + f"The pass key is {1000 + i}. Remember it. " + FILLER
               + f"The door code is {9000 + i}. " + FILLER)
    question = "What is the pass key?"
    return ProbeItem(id=f"passkey-{i}", hash=hashlib.sha256(f"prompt {i}".encode()).hexdigest(), family="passkey",
                     params={}, context=context, question=question, prompt_context=context, prompt_question=question,
                     gold=[str(1000 + i)], length=300, depth=0.5,
                     needles=[Needle("pass key", str(1000 + i), "target", (120, 128)),
                              Needle("door code", str(9000 + i), "distractor", (250, 258))])


def record(i: int, outcome: str, *, selection: bool = False) -> ItemRecord:
    """``outcome``: ``right``, ``no_value``, ``distractor`` or ``fabricated``."""
    p = probe(i)
    answer = {"right": f" {1000 + i}.", "no_value": " a magic word", "distractor": f" {9000 + i}",
              "fabricated": " 5555"}[outcome]
    recalled = {"distractor": f"distractor:{9000 + i}", "fabricated": "fabricated:5555"}.get(outcome)
    metrics = {"kept_tokens_mean": 150.0, "tokens_seen": 310} if selection else {}
    return ItemRecord(id=p.id, hash=p.hash, task="passkey", score=float(outcome == "right"), correct=outcome == "right",
                      category="correct" if outcome == "right" else outcome, answer=answer, gold=p.gold,
                      recalled=recalled, length=300, depth=0.5, metrics=metrics)


def write(folder: Path, policy: str, records: list[ItemRecord], bpt: float) -> Path:
    write_run_info(folder, RunInfo(name=f"tiny/{policy}", model="tiny", policy=policy,
                                   family="none" if policy == "none" else policy.split("(")[0],
                                   ratio=0.5 if "ratio" in policy else None, bytes_per_token=bpt,
                                   nominal_bytes_per_token=1000.0))
    with ItemWriter(folder) as w:
        for r in records:
            w.write(r)
    return folder


#: Baseline: items 0-47 right, 48-49 wrong (fabricated). Candidate: 0-29 no value, 30-34 a distractor, 35-47 right;
#: 48 right (improved), 49 a distractor (wrong in both, another category).
N = 50


def baseline_outcome(i: int) -> str:
    return "right" if i < 48 else "fabricated"


def candidate_outcome(i: int) -> str:
    if i < 30:
        return "no_value"
    if i < 35 or i == 49:
        return "distractor"
    return "right"


@pytest.fixture()
def sweep(tmp_path):
    root = tmp_path / "sweep" / "runs"
    base = write(root / "base", "none", [record(i, baseline_outcome(i)) for i in range(N)], 1000.0)
    cand = write(root / "snap", "snapkv(ratio=0.5)", [record(i, candidate_outcome(i), selection=True) for i in range(N)], 500.0)
    same = write(root / "quant", "quant(bits=8)", [record(i, baseline_outcome(i)) for i in range(N)], 600.0)
    return {"base": base, "snap": cand, "quant": same}


def test_changes_are_regressed_improved_and_changed_items_with_their_prompts(sweep):
    probes = {probe(i).hash: probe(i) for i in range(N)}
    changes = run_changes(load_run(sweep["base"]), load_run(sweep["snap"]), probes)
    assert [c.id for c in changes.of("regressed")] == [f"passkey-{i}" for i in range(35)]
    assert [c.id for c in changes.of("improved")] == ["passkey-48"]
    assert [c.id for c in changes.of("changed")] == ["passkey-49"]
    assert changes.note == ""
    c = changes.of("regressed")[31]
    assert (c.task, c.depth, c.length, c.gold) == ("passkey", 0.5, 300, ("1031",))
    assert c.question == "What is the pass key?" and c.needle == "pass key = 1031"
    assert c.passage.needle == "The pass key is 1031."
    assert c.passage.before.endswith("The sky is blue. ") and c.passage.after.startswith(" Remember it.")
    assert (c.baseline.text, c.baseline.category) == (" 1031.", "correct")
    assert (c.candidate.text, c.candidate.category) == (" 9031", "distractor")
    assert c.candidate.recalled == (Recalled("distractor", "9031", "door code"),)
    assert c.candidate.recalled[0].describe() == "9031: the value of 'door code' (a distractor)"
    assert c.kept == ("The cache held 150 of the 310 tokens seen, on average over layers and heads (tokens 120-128 of "
                      "the prompt). Whether the needle's own tokens were kept is not recorded by this run (it predates "
                      "needle_kept).")


def test_without_prompts_the_view_says_so_and_keeps_what_the_records_hold(sweep):
    changes = run_changes(load_run(sweep["base"]), load_run(sweep["snap"]))
    c = changes.of("regressed")[0]
    assert c.question is None and c.passage is None and c.baseline.text == " 1000." and c.candidate.text == " a magic word"
    assert changes.note.startswith("The prompts are not shown: the runs record no probe set")
    assert c.kept.startswith("The cache held 150 of the 310 tokens seen") and "the needle is at" not in c.kept
    assert run_changes(load_run(sweep["base"]), load_run(sweep["quant"])).items == ()


def test_kind_of_a_pair():
    assert kind_of(record(0, "right"), record(0, "no_value")) == "regressed"
    assert kind_of(record(0, "no_value"), record(0, "right")) == "improved"
    assert kind_of(record(0, "no_value"), record(0, "distractor")) == "changed"
    assert kind_of(record(0, "no_value"), record(0, "no_value")) is None
    assert kind_of(record(0, "right"), record(0, "right")) is None


def test_passage_cuts_a_window_at_word_boundaries():
    text = "alpha beta gamma. The key is 42. delta epsilon zeta"
    assert passage(text, "42", window=8) == Passage("gamma. ", "The key is 42.", " delta", True, True)
    assert passage(text, "42", window=100) == Passage("alpha beta gamma. ", "The key is 42.", " delta epsilon zeta",
                                                      False, False)
    assert passage(text, "77") is None


def test_verdict_sentences_say_the_gate_status_first_in_words(sweep):
    gate = evaluate_gate(None, sweep["base"], [sweep["snap"], sweep["quant"]])
    rows, _ = collect_rows([sweep["base"].parent], gate_result=gate, n_resamples=999)
    by_policy = {r.info.policy: verdict(r) for r in rows}
    assert by_policy["none"].status == "baseline"
    snap = by_policy["snapkv(ratio=0.5)"]
    assert snap.status == "FAIL"
    assert snap.sentence == ("FAIL: loses 68 points on passkey, where 35 of 48 right answers went wrong (30 no_value, "
                             "5 distractor) and 1 wrong answer became right.")
    assert snap.reasons and all(r.startswith("passkey: ") for r in snap.reasons)
    quant = by_policy["quant(bits=8)"]
    assert quant.status == "INCONCLUSIVE"
    assert quant.sentence == ("INCONCLUSIVE: holds its score on passkey, but too few items to tell (about 52 items per "
                              "task would decide).")
    wide = evaluate_gate(GateConfig.from_dict({"margin": 0.1}), sweep["base"], [sweep["quant"]])
    rows, _ = collect_rows([sweep["base"], sweep["quant"]], gate_result=wide, n_resamples=999)
    assert verdict(rows[1]).sentence == "PASS: within 10 points of the baseline on every task (holds its score on passkey)."
    ungated, _ = collect_rows([sweep["base"].parent], n_resamples=999)
    assert {verdict(r).sentence for r in ungated if r.info.policy == "quant(bits=8)"} == {
        "Not gated; holds its score on passkey."}


def test_the_page_holds_every_changed_item_and_links_to_it(sweep, tmp_path):
    gate = evaluate_gate(None, sweep["base"], [sweep["snap"], sweep["quant"]])
    probes = {probe(i).hash: probe(i) for i in range(N)}
    paths = build_report([sweep["base"].parent], tmp_path / "out", gate_result=gate, n_resamples=999, probes=probes)
    page = Path(paths["html"]).read_text()
    assert page.count('<article class="item regressed"') == 35 and page.count('<article class="item improved"') == 1
    assert page.count('<article class="item changed"') == 1
    assert '<section class="items" id="items-tiny_snapkv_ratio_0.5"' in page
    assert 'href="#items-tiny_snapkv_ratio_0.5--passkey"' in page and 'href="#items-tiny_snapkv_ratio_0.5"' in page
    assert "<mark>The pass key is 1031.</mark>" in page
    assert "<details><summary>statistical detail</summary>" in page
    assert "<svg" not in page and page.count('alt="score_vs_compression"') == 1  # one score-vs-compression plot
    assert "http" not in page.split("</style>")[1] and "<link" not in page and "src=\"http" not in page


def test_score_plot_legend_names_full_policy_specs(sweep, tmp_path, monkeypatch):
    rows, _ = collect_rows([sweep["base"].parent], n_resamples=999)
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    plots.plot_score_vs_compression(rows, tmp_path / "s.png")
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert legend == ["baseline (0.96)", "quant(bits=8)", "snapkv(ratio=0.5)"]


def test_gate_markdown_quotes_both_answers_of_regressed_items(sweep):
    md = to_markdown(evaluate_gate(None, sweep["base"], [sweep["snap"]]))
    assert "- `tiny/snapkv(ratio=0.5)` passkey: 35 item(s)" in md
    assert "  - `passkey-0` (no_value): `1000.` \u2192 `a magic word`" in md
    assert "  - `passkey-19` (no_value): `1019.` \u2192 `a magic word`" in md and "`passkey-20`" not in md
    assert "  - and 15 more" in md


# ----------------------------------------------------------------------------- lm-eval runs


def lm_eval_sample(doc_id: int, lls: list[float], *, target: int = 1) -> dict:
    prompt = f"Question {doc_id}: which colour is the sky?"
    ok = float(max(range(len(lls)), key=lambda k: lls[k]) == target)
    return {
        "doc_id": doc_id, "doc": {"question": prompt, "choices": ["green", "blue", "red"]}, "target": str(target),
        "arguments": {f"gen_args_{k}": {"arg_0": prompt, "arg_1": f" {c}"} for k, c in enumerate(["green", "blue", "red"])},
        "resps": [[[str(x), "False"]] for x in lls], "filtered_resps": [[str(x), "False"] for x in lls],
        "filter": "none", "metrics": ["acc"], "acc": ok,
        "doc_hash": "d", "prompt_hash": hashlib.sha256(prompt.encode()).hexdigest(), "target_hash": "t",
    }


def write_lm_eval(folder: Path, rows: list[dict], model_args: str) -> Path:
    model_dir = folder / "my__model"
    model_dir.mkdir(parents=True)
    date = "2025-01-02T03-04-05.678901"
    (model_dir / f"samples_arc_easy_{date}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (model_dir / f"results_{date}.json").write_text(json.dumps({"results": {}, "config": {"model": "hf", "model_args": model_args}}))
    return folder


@pytest.fixture()
def lm_eval_runs(tmp_path):
    base = write_lm_eval(tmp_path / "lm_base", [lm_eval_sample(d, [-3.0, -1.0, -2.5]) for d in range(6)],
                         "pretrained=smollm2-135m")
    cand = write_lm_eval(tmp_path / "lm_cand",
                         [lm_eval_sample(d, [-0.5, -1.5, -2.5] if d in (1, 3) else [-3.0, -1.0, -2.5]) for d in range(6)],
                         "pretrained=smollm2-135m,policy=snapkv(ratio=0.5)")
    return base, cand


def test_lm_eval_items_show_the_document_prompt_and_both_choices(lm_eval_runs, tmp_path):
    base, cand = (load_run(p) for p in lm_eval_runs)
    docs = sample_documents(base)
    assert sorted(docs) == [f"arc_easy/{d}" for d in range(6)]
    d1 = docs["arc_easy/1"]
    assert d1.prompt == "Question 1: which colour is the sky?" and d1.choices == [" green", " blue", " red"]
    assert d1.target == "1" and d1.doc["choices"] == ["green", "blue", "red"]
    changes = run_changes(base, cand, documents=docs)
    assert [c.id for c in changes.of("regressed")] == ["arc_easy/1", "arc_easy/3"]
    c = changes.of("regressed")[0]
    assert (c.baseline.text, c.candidate.text, c.document) == ("1", "0", d1)
    assert changes.note == ""
    page = Path(build_report(list(lm_eval_runs), tmp_path / "rep", n_resamples=999)["html"]).read_text()
    assert page.count('<article class="item regressed"') == 2
    assert "<code> blue</code> \u2190 baseline</li>" in page and "<code> green</code> \u2190 candidate</li>" in page
    assert '<pre class="doc prompt">Question 3: which colour is the sky?</pre>' in page


def test_lm_eval_samples_of_kveval_probe_tasks_carry_their_confusion_category(tmp_path):
    """kveval's generate_until tasks log one ``cat_<name>`` metric per category: the item view and the confusion
    column name a distractor's value as a distractor, as for kveval's own runs."""
    from kveval.runs.results import records_from_samples

    cats = ["cat_correct", "cat_distractor", "cat_stale", "cat_partial", "cat_over_inclusion", "cat_fabricated", "cat_empty"]

    def row(doc_id, category):
        return {"doc_id": doc_id, "prompt_hash": f"h{doc_id}", "target": "6983147", "filtered_resps": [" 7667818."],
                "metrics": ["score", "correct", *cats], "score": float(category == "correct"),
                "correct": float(category == "correct"), **{c: float(c == f"cat_{category}") for c in cats}}

    rows = [row(0, "distractor"), row(1, "correct"), {**row(2, "empty"), "cat_fabricated": 1.0},
            {k: v for k, v in row(3, "stale").items() if not k.startswith("cat_")}]
    records = records_from_samples(rows, "kveval_niah_multikey", None, tmp_path / "samples.jsonl")
    # two categories at once, or none logged: no category is claimed
    assert [r.category for r in records] == ["distractor", "correct", "", ""]


# ----------------------------------------------------------------------------- prompts generated again


def test_recorded_probe_items_come_from_a_sweeps_manifest_or_a_runs_probe_sets(tmp_path):
    from test_run_folders import CharTok

    from kveval.errors import ModelNotFoundError
    from kveval.probes.sets import ProbeSet
    from kveval.sweep.recorded import recorded_probe_items

    probes = {"families": ["passkey"], "lengths": [1200], "n": 2, "depths": [0.5], "seed": 0}
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "manifest.json").write_text(json.dumps({"name": "s", "config": {"name": "s", "probes": probes}}))
    expected = ProbeSet(tokenizer="tiny", **probes).items(CharTok())

    def run(folder: Path, extra: dict) -> Path:
        write_run_info(folder, RunInfo(name=folder.name, model="tiny", policy="none", extra=extra))
        return folder

    swept = run(sweep / "runs" / "tiny" / "none", {"sweep": "s"})
    evaluated = run(tmp_path / "eval", {"probe_sets": [ProbeSet(tokenizer="tiny", **{**probes, "seed": 1}).to_dict()]})
    plain = run(tmp_path / "plain", {})
    loaded = []
    recorded = recorded_probe_items([swept, evaluated, plain], lambda name: loaded.append(name) or CharTok())
    assert loaded == ["tiny", "tiny"] and recorded.notes == []
    assert len(recorded.items) == 4
    assert {h: i.id for h, i in recorded.items.items() if i.hash in {e.hash for e in expected}} == {
        i.hash: i.id for i in expected}

    def missing(name):
        raise ModelNotFoundError(f"model {name!r} is not installed")

    failed = recorded_probe_items([swept], missing)
    assert failed.items == {} and failed.notes == [f"{swept}: its prompts could not be generated again (model 'tiny' "
                                                   f"is not installed)"]
