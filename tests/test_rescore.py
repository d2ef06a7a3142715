"""``kveval rescore``: stored answers scored again by this version's scorer, with no model run.

A sweep folder is rescored from its config (the items regenerated, each checked against the prompt hash its
answer was run on) and its report and gate rebuilt; ``kveval eval`` folders from the items file. Nothing is
written unless every record of every run matches an item.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kveval.commands import main as cli
from kveval.probes import generate_items, score_answer
from kveval.runs.records import ITEMS_FILE, ItemRecord, ItemWriter, RunInfo, read_items, replace_items, write_run_info

RESULTS = Path(__file__).resolve().parent.parent / "results"


@pytest.fixture(scope="module")
def multikey_items(tok):
    return generate_items("niah_multikey", tok, 384, 3, depths=[0.5], seed=0)


def _eval_folder(root: Path, items, answers: list[str], policy: str = "none") -> Path:
    """A run folder as ``kveval eval`` writes it, its answers scored by ``score_answer`` (tampered where a test says)."""
    run_dir = root / "runs" / "smollm2-135m" / policy
    write_run_info(run_dir, RunInfo(name=f"smollm2-135m/{policy}", model="smollm2-135m", policy=policy))
    with ItemWriter(run_dir) as writer:
        for item, answer in zip(items, answers):
            s = score_answer(item, answer)
            writer.write(ItemRecord(id=item.id, hash=item.hash, task=item.family, score=s.score, correct=s.correct,
                                    category=s.category, answer=answer, gold=list(item.gold), recalled=s.recalled,
                                    length=item.length, depth=item.depth, metrics={"kv_bytes": 1}))
    return run_dir


def _items_file(path: Path, items) -> Path:
    path.write_text("".join(json.dumps(item.to_dict()) + "\n" for item in items))
    return path


def _tamper(run_dir: Path, index: int, **fields) -> None:
    """Give record ``index`` other scores, as an older scorer would have written them."""
    records = read_items(run_dir)
    records[index] = replace(records[index], **fields)
    replace_items(run_dir, records)


def test_an_answer_scored_by_an_older_scorer_is_scored_again(tmp_path, multikey_items, capsys):
    """A near miss of another key's value was ``fabricated`` before this version; rescoring names the distractor,
    leaves every other field and record as it was, and says what moved."""
    distractor = next(n.value for n in multikey_items[0].needles if n.role == "distractor")
    answers = [f" {distractor[:-1]}", f" {multikey_items[1].gold[0]}", " 5550123"]
    run_dir = _eval_folder(tmp_path, multikey_items, answers)
    assert read_items(run_dir)[0].category == "distractor"
    _tamper(run_dir, 0, category="fabricated", recalled=f"fabricated:{distractor[:-1]}")
    before = (run_dir / ITEMS_FILE).read_text()
    items = _items_file(tmp_path / "items.jsonl", multikey_items)

    assert cli.main(["rescore", str(tmp_path), "--items", str(items), "--dry-run"]) == 0
    assert (run_dir / ITEMS_FILE).read_text() == before  # a dry run writes nothing
    assert "in all, 1 of 3 items would change (dry run: nothing written): fabricated -> distractor 1" in capsys.readouterr().out

    assert cli.main(["rescore", str(run_dir), "--items", str(items)]) == 0
    records = read_items(run_dir)
    assert records[0].category == "distractor" and records[0].recalled == f"distractor:{distractor[:-1]}"
    assert [asdict(r) for r in records[1:]] == [json.loads(line) for line in before.splitlines()[1:]]
    assert records[0].metrics == {"kv_bytes": 1} and records[0].answer == answers[0]
    assert cli.main(["rescore", str(run_dir), "--items", str(items)]) == 0  # once rescored, nothing moves
    assert "0 of 3 items change" in capsys.readouterr().out


def test_records_that_do_not_match_the_items_are_refused_and_nothing_is_written(tmp_path, multikey_items, capsys):
    run_dir = _eval_folder(tmp_path, multikey_items, [" 1", " 2", " 3"])
    second = _eval_folder(tmp_path, multikey_items, [" 1", " 2", " 3"], policy="kivi_bits-4")
    _tamper(second, 0, category="correct", score=1.0, correct=True)
    before = [(d / ITEMS_FILE).read_text() for d in (run_dir, second)]

    items = _items_file(tmp_path / "other.jsonl", [replace(item, hash="f" * 64) for item in multikey_items])
    assert cli.main(["rescore", str(tmp_path), "--items", str(items)]) == 2  # same ids, other prompts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was run on another prompt" in err[0] and "kveval probes" in err[0]
    assert [(d / ITEMS_FILE).read_text() for d in (run_dir, second)] == before

    items = _items_file(tmp_path / "two.jsonl", multikey_items[:2])
    assert cli.main(["rescore", str(tmp_path), "--items", str(items)]) == 2  # an item the file does not hold
    assert f"{multikey_items[2].id} is not among the items" in capsys.readouterr().err
    assert [(d / ITEMS_FILE).read_text() for d in (run_dir, second)] == before


def test_lm_eval_records_are_kept_as_they_are(tmp_path, multikey_items):
    run_dir = _eval_folder(tmp_path, multikey_items, [" 1", " 2", " 3"])
    with ItemWriter(run_dir) as writer:
        writer.write(ItemRecord(id="arc_easy-0", hash="h", task="arc_easy", score=1.0, correct=True,
                                metrics={"lm_eval_task": "arc_easy"}))
    _tamper(run_dir, 1, score=1.0, correct=True, category="correct")
    items = _items_file(tmp_path / "items.jsonl", multikey_items)
    assert cli.main(["rescore", str(run_dir), "--items", str(items)]) == 0
    records = read_items(run_dir)
    assert records[1].category == "no_value" and records[1].score == 0.0  # " 2": no value of a 7-digit shape
    assert records[-1].task == "arc_easy" and records[-1].score == 1.0


@pytest.mark.parametrize("args, message", [
    (["{dir}"], "--items"),  # run folders need the items they were run on
    (["{dir}/nowhere", "--items", "{dir}/items.jsonl"], "no such run folder"),
    (["{dir}", "--items", "{dir}/missing.jsonl"], "missing.jsonl"),
    (["{dir}", "--items", "{dir}/garbage.jsonl"], "not a probe item"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, multikey_items, capsys, args, message):
    _eval_folder(tmp_path, multikey_items, [" 1", " 2", " 3"])
    _items_file(tmp_path / "items.jsonl", multikey_items)
    (tmp_path / "garbage.jsonl").write_bytes(b"\xff\xfe not json\n")
    assert cli.main(["rescore", *[a.format(dir=tmp_path) for a in args]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_sweep_folder_is_rescored_from_its_config_and_its_report_rebuilt(tmp_path, capsys):
    """The committed quickstart, one record tampered: rescoring from its config restores that record, leaves the
    other 479 byte for byte, and rebuilds the same gate. Given as a folder, a sweep is pointed at its config."""
    out = tmp_path / "quickstart"
    shutil.copytree(RESULTS / "quickstart", out, ignore=shutil.ignore_patterns("*.png", "*.html"))
    run_dir = out / "runs" / "smollm2-135m" / "streaming_sink-4_window-60"
    original = {d: (d / ITEMS_FILE).read_text() for d in (out / "runs" / "smollm2-135m").iterdir()}
    record = read_items(run_dir)[0]
    _tamper(run_dir, 0, correct=not record.correct, score=1.0 - record.score, category="empty")
    gate_before = (RESULTS / "quickstart" / "gate" / "gate.json").read_text()

    assert cli.main(["rescore", str(out), "--items", "x.jsonl"]) == 2
    assert "a sweep folder: give its config" in capsys.readouterr().err

    config = tmp_path / "quickstart.yaml"  # sequential, as the committed results were run
    config.write_text((Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml").read_text())
    assert cli.main(["rescore", str(out / "runs" / "smollm2-135m" / "none"), "--items", "x.jsonl"]) == 2
    assert "is a run of the sweep quickstart: rescore the sweep from its config" in capsys.readouterr().err
    assert cli.main(["rescore", str(config), "--out", str(out), "--gpu-memory", "1GiB", "--context", "4096"]) == 0
    output = capsys.readouterr().out
    assert "1 of 300 items change" in output and "gate verdict" in output
    assert "## Deployment" in (out / "gate" / "gate.md").read_text()  # the sweep's question, asked again
    assert "<mark>The pass key is " in (out / "report" / "leaderboard.html").read_text()  # items shown with prompts
    assert cli.main(["rescore", str(config), "--out", str(out)]) == 0
    assert {d: (d / ITEMS_FILE).read_text() for d in original} == original
    gate_after = json.loads((out / "gate" / "gate.json").read_text().replace(str(out), "results/quickstart"))
    assert gate_after.pop("verdicts_sha256")  # of the rebuilt file's own content, its paths included
    judged = [c.pop("judged") for r in gate_after["results"] for c in r["candidates"]]
    assert {j["candidate"]["items_sha256"] for j in judged} == {  # what the rebuilt gate judged: these runs' items
        hashlib.sha256(text.encode()).hexdigest() for d, text in original.items() if d.name != "none"}
    before = json.loads(gate_before)  # a committed gate from before gates recorded what they judged, or after
    before.pop("verdicts_sha256", None)
    for r in before["results"]:
        for c in r["candidates"]:
            c.pop("judged", None)
    assert gate_after == before
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rescored_under"]["kveval"] and "git_commit" in manifest["rescored_under"]
    capsys.readouterr()
    assert cli.main(["sweep", str(config), "--out", str(out)]) == 0  # finished: resumed, no model runs
    assert json.loads((out / "manifest.json").read_text())["rescored_under"] == manifest["rescored_under"]
    output = capsys.readouterr()
    # A finished sweep says so (it said "done"), and the verdict is printed once (it was three times: the
    # leaderboard's, gate.md's and the last line's): the leaderboard, then one line naming gate.md.
    assert "kveval sweep: already complete smollm2-135m: none, " in output.err and "kveval sweep: done" not in output.err
    assert f"kveval sweep: {out} is already complete (4 runs): nothing was run" in output.err
    assert output.out.count("gate verdict:") == 1 and "# kveval gate" not in output.out
    assert output.out.count("- FAIL smollm2-135m/random(ratio=0.5)") <= 1  # gate.md listed it again
    assert output.out.strip().splitlines()[-1].startswith(f"gate verdict: FAIL  |  gate: {out / 'gate' / 'gate.md'}")


def test_a_sweep_of_another_config_or_unfinished_is_refused(tmp_path, capsys):
    out = tmp_path / "quickstart"
    shutil.copytree(RESULTS / "quickstart", out, ignore=shutil.ignore_patterns("*.png", "*.html"))
    configs = Path(__file__).resolve().parent.parent / "configs"
    text = (configs / "quickstart.yaml").read_text()  # gate: cpu, a shipped gate: the copy finds it
    config = tmp_path / "other.yaml"
    config.write_text(text.replace("n: 60", "n: 59"))
    assert cli.main(["rescore", str(config), "--out", str(out)]) == 2
    assert "another config" in capsys.readouterr().err
    config.write_text(text)
    run_dir = out / "runs" / "smollm2-135m" / "none"
    lines = (run_dir / ITEMS_FILE).read_text().splitlines(keepends=True)
    (run_dir / ITEMS_FILE).write_text("".join(lines[:-1]))
    assert cli.main(["rescore", str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "119 of 120 items" in err and "kveval sweep" in err


def test_damaged_run_files_are_one_line_and_nothing_is_written(tmp_path, multikey_items, capsys):
    run_dir = _eval_folder(tmp_path, multikey_items, [" 1", " 2", " 3"])
    second = _eval_folder(tmp_path, multikey_items, [" 1", " 2", " 3"], policy="kivi_bits-4")
    _tamper(second, 0, category="correct", score=1.0, correct=True)
    before = (second / ITEMS_FILE).read_text()
    items = _items_file(tmp_path / "items.jsonl", multikey_items)
    lines = (run_dir / ITEMS_FILE).read_text().splitlines(keepends=True)
    damaged = [lines[0].replace(f'"hash": "{multikey_items[0].hash}"', '"hash": null'),
               lines[0].replace('"metrics": {"kv_bytes": 1}', '"metrics": 5')]
    for text in damaged:
        assert text != lines[0]
        (run_dir / ITEMS_FILE).write_text(text + "".join(lines[1:]))
        assert cli.main(["rescore", str(tmp_path), "--items", str(items)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "of the wrong type" in err[0], err
    (run_dir / ITEMS_FILE).write_bytes(b"\xff\xfe\n")
    assert cli.main(["rescore", str(tmp_path), "--items", str(items)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not UTF-8 text" in err[0], err
    assert (second / ITEMS_FILE).read_text() == before


def test_a_mistyped_config_or_a_folder_of_no_sweep_is_named(tmp_path, capsys):
    assert cli.main(["rescore", str(tmp_path / "typo.yaml")]) == 2
    assert "typo.yaml: no such sweep config" in capsys.readouterr().err
    config = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
    assert cli.main(["rescore", str(config), "--out", str(tmp_path)]) == 2
    assert "no sweep of quickstart here" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # not even a lock file


def test_kveval_eval_records_its_probe_sets_and_rescore_needs_no_items_file(tmp_path, capsys):
    """kveval eval writes the arguments its items came from into each run.json (extra.probe_sets, one entry per
    set that joined the run), so its folders are rescored without an items file; before, --items was required."""
    out = tmp_path / "eval"
    base = ["eval", "--policy", "none", "--length", "128", "--n", "1", "--out", str(out)]
    assert cli.main(base + ["--family", "passkey"]) == 0
    assert cli.main(base + ["--family", "niah_single"]) == 0  # resumed with another set
    run_dir = out / "runs" / "smollm2-135m" / "none"
    sets = json.loads((run_dir / "run.json").read_text())["extra"]["probe_sets"]
    assert [s["families"] for s in sets] == [["passkey"], ["niah_single"]]
    assert sets[0] == {"tokenizer": "smollm2-135m", "families": ["passkey"], "lengths": [128], "n": 1, "depths": None,
                       "seed": 0, "params": {}}
    record = read_items(run_dir)[1]
    _tamper(run_dir, 1, score=1.0 - record.score, correct=not record.correct, category="stale")
    capsys.readouterr()
    assert cli.main(["rescore", str(out)]) == 0
    assert "in all, 1 of 2 items change: stale -> " in capsys.readouterr().out
    assert read_items(run_dir)[1] == record
