"""Sweep executors: cells planned once, the same results in process and on a local Ray cluster, item by item."""

import sys
from pathlib import Path

import pytest

from kveval.commands.main import main
from kveval.runs.records import read_items
from kveval.sweep.config import load_config
from kveval.sweep.executors import Cell, InProcessExecutor, make_executor
from kveval.sweep.run import plan_cells

from tests.test_models import tiny_llama_folder

POLICIES = '["snapkv(ratio=0.5)", "kivi(bits=4,group=8)", "window(16)"]'


def _config(tmp_path: Path, model: str = "smollm2-135m", policies: str = POLICIES) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"name: cells\nmodels: [{model}]\nbatch_size: 2\npolicies: {policies}\n"
                    f"probes: {{families: [passkey], lengths: [96], depths: [0.5], n: 2}}\n")
    return path


def _items(out: Path) -> dict:
    """(run folder, item id) -> what must not depend on the executor (timings excluded)."""
    found = {}
    for items_file in sorted(out.glob("runs/*/*/items.jsonl")):
        for r in read_items(items_file.parent):
            found[(items_file.parent.name, r.id)] = (r.answer, r.score, r.correct, r.category, r.metrics["kv_bytes"],
                                                     r.metrics["kept_tokens_mean"])
    return found


def test_cells_cover_every_policy_once_with_the_baseline_first(tmp_path):
    config = load_config(_config(tmp_path, policies="[kivi(bits=4), snapkv(ratio=0.5)@query, window(16)]"))
    whole = plan_cells(config)
    assert [(c.mode, [s.spec for s in c.specs]) for c in whole] == [
        ("context", ["none", "kivi(bits=4)", "window(size=16)"]), ("query", ["snapkv(ratio=0.5)"])]
    single = plan_cells(config, policies_per_cell=1)
    assert [len(c.specs) for c in single] == [1, 1, 1, 1] and single[0].specs[0].spec == "none"
    assert sorted(s.key for c in single for s in c.specs) == sorted(s.key for c in whole for s in c.specs)
    with pytest.raises(ValueError, match="give 1 or more"):
        plan_cells(config, policies_per_cell=0)


def test_in_process_executor_runs_cells_in_order():
    seen = []
    cells = [Cell("m", "context", ()), Cell("n", "query", ())]
    progress = lambda cell, result: seen.append((cell, result))  # noqa: E731
    assert InProcessExecutor(progress=progress).run(cells, lambda cell: cell.model) == ["m", "n"]
    assert seen == [(cells[0], "m"), (cells[1], "n")]  # each cell as it finishes, with its result
    with pytest.raises(ValueError, match="--address needs --executor ray"):
        make_executor("inprocess", address="auto")


def test_missing_ray_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert main(["sweep", str(_config(tmp_path)), "--out", str(tmp_path / "out"), "--executor", "ray", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'kveval[ray]'" in err
    assert not (tmp_path / "out" / "runs").exists()


def test_max_memory_without_device_map_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["sweep", str(_config(tmp_path)), "--out", str(out), "--max-memory", "cpu=1GiB", "--quiet"]) == 2
    assert "--max-memory needs --device-map" in capsys.readouterr().err and not out.exists()


def test_ray_sweep_on_two_workers_equals_the_serial_sweep_item_by_item(tmp_path, monkeypatch):
    import ray  # noqa: F401  (the test extras install it: a missing Ray fails here rather than skipping unseen)
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))
    config = _config(tmp_path, model=tiny_llama_folder(tmp_path / "tiny"))
    serial, on_ray = tmp_path / "serial", tmp_path / "ray"
    assert main(["sweep", str(config), "--out", str(serial), "--quiet"]) == 0
    assert main(["sweep", str(config), "--out", str(on_ray), "--quiet", "--executor", "ray", "--workers", "2"]) == 0
    expected = _items(serial)
    assert len(expected) == 4 * 2 and _items(on_ray) == expected  # 4 cells (none + 3 policies) x 2 items
    assert (on_ray / "gate" / "gate.json").is_file() and (on_ray / "report" / "leaderboard.md").is_file()

    # A cell lost mid-run: its folder keeps the items already written; the rerun computes only the rest.
    runs = sorted(on_ray.glob("runs/*/*/items.jsonl"))
    lost, kept = runs[0], runs[1:]
    lost.write_text(lost.read_text().splitlines(keepends=True)[0] + '{"id": "half-writ')
    before = {p: p.read_bytes() for p in kept}
    assert main(["sweep", str(config), "--out", str(on_ray), "--quiet", "--executor", "ray", "--workers", "2"]) == 0
    assert {p: p.read_bytes() for p in kept} == before and _items(on_ray) == expected
