"""The gate's error rates on simulated candidates, in kveval's own result format, through the CLI (seeded, fast).

* No-change candidates (baseline accuracy 0.9; 5% of right items flip to wrong and
  as many wrong ones flip to right; 100 items x 3 tasks) exit 1 in at most 5% of
  draws (the false-alarm rates quoted in configs/gate.yaml).
* A planted 10-point loss on 300 items (each right item turns wrong with
  probability 1/9) FAILs in at least 95% of draws.
* Three identical items are not PASS.

A draw is one baseline and one candidate. Each CLI call gates one baseline
against several candidates (``family: candidate``: each candidate is judged on
its own, exactly as if gated alone), to keep the test fast.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from kveval.commands import main as cli
from kveval.runs.records import ITEMS_FILE, ItemRecord, RunInfo, write_run_info
from kveval.stats import paired

REPO = Path(__file__).resolve().parent.parent
GATE_YAML = REPO / "configs" / "gate.yaml"


@pytest.fixture(autouse=True)
def only_gate(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", {k: v for k, v in cli.COMMANDS.items() if k == "gate"})


def _write(path: Path, policy: str, correct: dict[str, np.ndarray], wrong_category: dict[str, np.ndarray] | None = None) -> Path:
    write_run_info(path, RunInfo(name=f"sim/{path.name}", model="sim-model", policy=policy, family=policy.split("(")[0]))
    lines = []  # one write, no per-item fsync (ItemWriter's durability is not what is tested here)
    # Every field an ItemRecord writes, once: asdict per item took most of this test's time.
    template = asdict(ItemRecord(id="", hash="", task="", score=0.0, correct=False, category=""))
    for task, ok in correct.items():
        for i, right in enumerate(ok):
            cat = "correct" if right else (wrong_category[task][i] if wrong_category else "fabricated")
            lines.append(json.dumps({**template, "id": f"{task}/{i}", "hash": f"{task}{i}", "task": task,
                                     "score": float(right), "correct": bool(right), "category": str(cat)}))
    (path / ITEMS_FILE).write_text("\n".join(lines) + "\n")
    return path


def _gate(base: Path, cands: list[Path]) -> list[str]:
    """Per-candidate verdicts from the CLI's verdict lines (one per candidate, in order)."""
    argv = ["gate", "--config", str(GATE_YAML), "--baseline", str(base)]
    for c in cands:
        argv += ["--candidate", str(c)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    statuses = [line.split()[0] for line in out.getvalue().splitlines() if line.startswith(("PASS ", "FAIL ", "INCONCLUSIVE "))]
    assert len(statuses) == len(cands)
    worst = {"FAIL": 1, "INCONCLUSIVE": 3, "PASS": 0}[max(statuses, key=["PASS", "INCONCLUSIVE", "FAIL"].index)]
    assert code == worst  # the exit code is the worst verdict's
    return statuses


def _churn(rng, ok: np.ndarray, rate: float) -> np.ndarray:
    """Flip each right item with probability ``rate`` and as many wrong items (in expectation) back."""
    new = ok.copy()
    right, wrong = np.flatnonzero(ok), np.flatnonzero(~ok)
    new[right[rng.random(right.size) < rate]] = False
    back = min(1.0, rate * right.size / max(wrong.size, 1))
    new[wrong[rng.random(wrong.size) < back]] = True
    return new


def test_no_change_candidates_rarely_fail(tmp_path):
    rng = np.random.default_rng(20261130)
    tasks, n, cats = ["a", "b", "c"], 100, np.array(["distractor", "fabricated", "empty", "stale"])
    statuses = []
    for b in range(20):
        base_ok = {t: rng.random(n) < 0.9 for t in tasks}
        base_cat = {t: rng.choice(cats, n) for t in tasks}
        base = _write(tmp_path / f"base{b}", "none", base_ok, base_cat)
        cands = [
            _write(tmp_path / f"c{b}_{k}", "quant(bits=8)", {t: _churn(rng, base_ok[t], 0.05) for t in tasks}, {t: rng.choice(cats, n) for t in tasks})
            for k in range(20)
        ]
        statuses += _gate(base, cands)
    rate = statuses.count("FAIL") / len(statuses)
    print(f"no-change candidates (400 draws): FAIL {rate:.3f}, INCONCLUSIVE {statuses.count('INCONCLUSIVE') / 400:.3f}, "
          f"PASS {statuses.count('PASS') / 400:.3f}")
    assert len(statuses) == 400 and rate <= 0.05


def test_planted_ten_point_loss_fails(tmp_path):
    rng = np.random.default_rng(7)
    n = 300
    statuses = []
    for b in range(20):
        base_ok = {"t": rng.random(n) < 0.9}
        base = _write(tmp_path / f"base{b}", "none", base_ok)
        cands = []
        for k in range(20):
            ok = base_ok["t"] & ~(rng.random(n) < 1 / 9)
            cands.append(_write(tmp_path / f"c{b}_{k}", "random(ratio=0.5)", {"t": ok}))
        statuses += _gate(base, cands)
    rate = statuses.count("FAIL") / len(statuses)
    print(f"planted 10-point loss (400 draws): FAIL {rate:.3f}; exact power {paired.power(300, 0.1, 0.0, 0.05, 0.05, 'fail'):.3f}")
    assert rate >= 0.95
    # the exact probability agrees: a sum over every (regressed, improved) count
    assert paired.power(300, 0.1, 0.0, 0.05, 0.05, "fail") >= 0.95


def test_three_identical_items_are_not_pass(tmp_path):
    ok = {"t": np.array([True, True, False])}
    base = _write(tmp_path / "base", "none", ok)
    cand = _write(tmp_path / "cand", "quant(bits=8)", ok)
    assert _gate(base, [cand]) == ["INCONCLUSIVE"]
