"""Random corruptions of a committed run and its gate: every command refuses (exit 2) or gives exactly the answer of
the uncorrupted files, never an internal error (exit 70), and no committed file changes (issue 65).

Each case damages copies of results/quickstart's baseline, candidates and gate.json in one way a careless or hostile
user, a half-finished copy or a bad disk would: truncation, deleted fields, changed types, NaN, infinities and
negatives, a ``correct`` that contradicts its score, duplicated and foreign items, edited run headers and edited
verdicts. Harmless edits (reordered lines, a timing changed, JSON re-spaced) must give the clean answer exactly.
The cases are drawn with a fixed seed, so a failure names a case that reproduces.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import shutil
from pathlib import Path

import pytest

from kveval.commands import main as cli

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "results" / "quickstart"
GATE_CPU = REPO / "configs" / "gate-cpu.yaml"
RUNS = ("none", "quant_bits-8_group-16", "random_ratio-0.5")
CASES = 520
REPORT_EVERY = 26  # the report draws plots (about a second): it runs on every 26th case, 20 in all
SEED = 20261207


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _run(argv: list) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue() + err.getvalue()


def _answers(root: Path, work: Path, with_report: bool) -> dict[str, tuple]:
    """What each command answers on the run folders and gate under ``root``: its exit code and the verdicts or
    numbers it gives (paths and timings aside)."""
    runs = root / "runs" / "smollm2-135m"
    out = {}
    code, _ = _run(["gate", "--config", GATE_CPU, "--baseline", runs / RUNS[0], "--candidate", runs / RUNS[1],
                    "--candidate", runs / RUNS[2], "--out", work / "gate"])
    verdicts = None
    if code != 2 and (work / "gate" / "gate.json").is_file():
        data = json.loads((work / "gate" / "gate.json").read_text())
        verdicts = [(c["name"], c["status"], sorted((t["task"], t["status"]) for t in c.get("tasks", [])))
                    for c in data["candidates"]]
    out["gate"] = (code, verdicts)
    code, text = _run(["compare", runs / RUNS[0], runs / RUNS[2]])
    out["compare"] = (code, _order_free(text.replace(str(root), "<root>")) if code != 2 else None)
    code, text = _run(["memory", "smollm2-135m", "--engine", "vllm", "--gpu-memory", "24GiB", "--max-model-len", "8k",
                       "--gate", root / "gate", "--json"])
    out["memory"] = (code, [(p["preset"], p["verdict"]) for p in json.loads(text)["presets"]] if code == 0 else None)
    if with_report:
        code, _ = _run(["report", runs, "--gate", root / "gate", "--out", work / "report"])
        board = (work / "report" / "leaderboard.csv").read_text() if code == 0 else None
        out["report"] = (code, _without_timings(board))
    return out


def _order_free(text: str) -> list[str]:
    """Compare's output as its sorted lines, each list of example items cut to its count: the items' order in a file
    decides which examples it prints first, not any number."""
    return sorted(line.split(":")[0] if line.startswith(("regressed items", "improved items")) else line
                  for line in text.splitlines())


def _without_timings(csv_text: str | None) -> str | None:
    if csv_text is None:
        return None
    lines = csv_text.splitlines()
    header = lines[0].split(",")
    keep = [i for i, h in enumerate(header) if "ttft" not in h and "tokens_per_s" not in h and "path" not in h]
    return sorted(",".join(cells[i] for i in keep if i < len(cells)) for cells in (l.split(",") for l in lines))


# ----------------------------------------------------------------------------- the corruptions


def _items(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_items(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _edit_item(rng: random.Random, root: Path, edit) -> str:
    run = root / "runs" / "smollm2-135m" / rng.choice(RUNS) / "items.jsonl"
    rows = _items(run)
    i = rng.randrange(len(rows))
    what = edit(rng, rows, i)
    _write_items(run, rows)
    return f"{run.parent.name} item {i}: {what}"


def truncate(rng, root):
    run = root / "runs" / "smollm2-135m" / rng.choice(RUNS) / "items.jsonl"
    data = run.read_bytes()
    cut = rng.randrange(1, len(data) - 1)
    run.write_bytes(data[:cut])
    return f"{run.parent.name}: items.jsonl cut at byte {cut}"


def delete_field(rng, root):
    def edit(rng, rows, i):
        key = rng.choice(["id", "hash", "task", "score", "correct"])
        del rows[i][key]
        return f"deleted {key}"
    return _edit_item(rng, root, edit)


def change_type(rng, root):
    def edit(rng, rows, i):
        key, value = rng.choice([("score", "1"), ("score", None), ("score", [1]), ("correct", "true"), ("correct", 1),
                                 ("id", 5), ("id", ""), ("task", None), ("metrics", [1, 2]), ("hash", 7)])
        rows[i][key] = value
        return f"{key}={value!r}"
    return _edit_item(rng, root, edit)


def bad_number(rng, root):
    def edit(rng, rows, i):
        key = rng.choice(["score", "kv_bytes", "nominal_bytes", "bytes_per_token"])
        value = rng.choice([float("nan"), float("inf"), -1.0, -4608, 1.5 if key == "score" else -0.5])
        if key == "score":
            rows[i]["score"] = value
        else:
            rows[i]["metrics"][key] = value
        return f"{key}={value!r}"
    return _edit_item(rng, root, edit)


def contradiction(rng, root):
    def edit(rng, rows, i):
        rows[i]["correct"] = not rows[i]["correct"]
        return "correct flipped, score kept"
    return _edit_item(rng, root, edit)


def bad_category(rng, root):
    def edit(rng, rows, i):
        rows[i]["category"] = rng.choice(["teleported", "CORRECT", "confused", 3])
        return f"category={rows[i]['category']!r}"
    return _edit_item(rng, root, edit)


def duplicate(rng, root):
    def edit(rng, rows, i):
        rows.insert(rng.randrange(len(rows)), dict(rows[i]))
        return "duplicated"
    return _edit_item(rng, root, edit)


def foreign(rng, root):
    def edit(rng, rows, i):
        key = rng.choice(["id", "hash", "task"])
        rows[i][key] = rows[i][key] + "-foreign"
        return f"{key} made foreign"
    return _edit_item(rng, root, edit)


def edit_header(rng, root):
    run = root / "runs" / "smollm2-135m" / rng.choice(RUNS) / "run.json"
    info = json.loads(run.read_text())
    key, value = rng.choice([("model", "llama-3.1-8b"), ("kv_dtype", "float32"), ("bytes_per_token", -4608.0),
                             ("bytes_per_token", "many"), ("model_identity", None), ("policy", 7), ("name", None)])
    if key == "model_identity" and value is None:
        info.pop("model_identity", None)
    elif key == "model_identity":
        info["model_identity"] = value
    else:
        info[key] = value
    run.write_text(json.dumps(info))
    return f"{run.parent.name}/run.json: {key}={value!r}"


def edit_verdict(rng, root):
    path = root / "gate" / "gate.json"
    data = json.loads(path.read_text())
    result = data["results"][0]
    candidate = rng.choice(result["candidates"])
    choice = rng.randrange(5)
    if choice == 0:
        candidate["status"] = rng.choice(["PASS", "FAIL", "INCONCLUSIVE", "LGTM", ""])
        if candidate["status"] == json.loads((QUICKSTART / "gate" / "gate.json").read_text())["results"][0][
                "candidates"][result["candidates"].index(candidate)]["status"]:
            candidate["status"] = "LGTM"
        what = f"status={candidate['status']!r}"
    elif choice == 1:
        task = rng.choice(candidate["tasks"])
        task["status"] = "PASS" if task["status"] != "PASS" else "FAIL"
        what = f"task {task['task']} status={task['status']}"
    elif choice == 2:
        candidate["reasons"] = ["looks fine"]
        what = "reasons edited"
    elif choice == 3:
        result["status"] = "PASS" if result["status"] != "PASS" else "FAIL"
        what = f"result status={result['status']}"
    else:
        candidate.pop("judged", None)
        what = "judged deleted"
    path.write_text(json.dumps(data))
    return f"gate.json: {candidate['name']}: {what}"


def harmless(rng, root):
    choice = rng.randrange(3)
    run = root / "runs" / "smollm2-135m" / rng.choice(RUNS) / "items.jsonl"
    rows = _items(run)
    if choice == 0:
        rng.shuffle(rows)
        what = "lines reordered"
    elif choice == 1:
        rows[rng.randrange(len(rows))]["metrics"]["ttft_s"] = rng.random() * 100
        what = "a timing changed"
    else:
        run.write_text("".join(json.dumps(r, indent=None, separators=(", ", ": ")) + "\n" for r in rows))
        return f"{run.parent.name}: JSON re-spaced"
    _write_items(run, rows)
    return f"{run.parent.name}: {what}"


CORRUPTIONS = (truncate, delete_field, change_type, bad_number, contradiction, bad_category, duplicate, foreign,
               edit_header, edit_verdict)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A clean copy of the quickstart's runs and gate, and its answers."""
    root = tmp_path_factory.mktemp("clean") / "quickstart"
    root.mkdir()
    shutil.copytree(QUICKSTART / "runs", root / "runs")
    shutil.copytree(QUICKSTART / "gate", root / "gate")
    work = tmp_path_factory.mktemp("clean-work")
    return root, _answers(root, work, with_report=True)


def test_every_command_refuses_a_corruption_or_gives_the_clean_answer(clean, tmp_path):
    root, expected = clean
    assert expected["gate"][0] == 1 and expected["memory"][0] == 0 and expected["report"][0] == 0
    before = _digest(QUICKSTART)
    rng = random.Random(SEED)
    case_root = tmp_path / "quickstart"
    refusals = 0
    for case in range(CASES):
        shutil.rmtree(case_root, ignore_errors=True)
        shutil.copytree(root, case_root)
        corrupt = rng.choice(CORRUPTIONS + (harmless,))
        what = corrupt(rng, case_root)
        work = tmp_path / f"work-{case}"
        answers = _answers(case_root, work, with_report=case % REPORT_EVERY == 0)
        for command, (code, answer) in answers.items():
            assert code != 70, f"case {case} ({what}): kveval {command} hit an internal error"
            if code == 2:
                refusals += 1
                # gate and compare read the runs alone; report and memory also hold them to the digest the gate
                # recorded, which a changed timing changes (a refusal there is the property's other branch)
                assert corrupt is not harmless or command in ("report", "memory"), \
                    f"case {case} ({what}): kveval {command} refused a harmless edit"
                continue
            assert (code, answer) == expected[command], f"case {case} ({what}): kveval {command} answered otherwise"
        shutil.rmtree(work, ignore_errors=True)
    assert refusals > CASES  # most corruptions are refused by more than one command
    assert _digest(QUICKSTART) == before
