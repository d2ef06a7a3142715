"""Sweep folder integrity without loading a model: lock, duplicate policies, early gate check, config hash, folders."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kveval.commands import main as cli
from kveval.errors import ConfigError, RunFolderError
from kveval.runs.records import ItemRecord, ItemWriter, RunInfo, atomic_write_text, write_run_info
from kveval.runs.results import expand_run_dirs
from kveval.sweep.config import load_config
from kveval.sweep.run import LOCK_FILE, sweep_lock

CONFIG = """
name: integrity
models: [smollm2-135m]
policies: [kivi(bits=4)]
probes: {families: [passkey], lengths: [256], depths: [0.5], n: 1}
"""


def test_second_sweep_into_a_locked_folder_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "out"
    with sweep_lock(out):
        assert f"pid {os.getpid()}" in (out / LOCK_FILE).read_text()
        with pytest.raises(RunFolderError, match=f"in use by another sweep \\(pid {os.getpid()} on "):
            with sweep_lock(out):
                pass
        config = tmp_path / "s.yaml"
        config.write_text(CONFIG)
        assert cli.main(["sweep", str(config), "--out", str(out), "--quiet"]) == 2  # refused before any model loads
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and "in use by another sweep" in err[0]
    with sweep_lock(out):  # released on exit: the next sweep gets it
        pass


def test_duplicate_policies_are_merged_with_a_warning(tmp_path):
    config = tmp_path / "d.yaml"
    config.write_text(CONFIG.replace("[kivi(bits=4)]", "[snapkv(ratio=0.5), snapkv(0.5), snapkv(0.5)@query, kivi(bits=4)]"))
    cfg = load_config(config)
    keys = [p.key for p in cfg.policies]
    assert len(keys) == len(set(keys)) == 3  # snapkv@context, snapkv@query, kivi
    assert len(cfg.warnings) == 1 and "'snapkv(0.5)' is the same run as 'snapkv(ratio=0.5)'" in cfg.warnings[0]


def test_gate_config_is_checked_when_the_sweep_config_loads(tmp_path):
    (tmp_path / "gate.yaml").write_text("alpha: 0.05\ncolour: red\n")
    config = tmp_path / "g.yaml"
    config.write_text(CONFIG + "gate: gate.yaml\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(config)
    config.write_text(CONFIG + "gate: missing.yaml\n")
    with pytest.raises(ConfigError, match="no such gate config"):
        load_config(config)


def test_config_hash_ignores_paths_that_do_not_change_results(tmp_path):
    (tmp_path / "gate.yaml").write_text("alpha: 0.05\n")
    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    a.write_text(CONFIG)
    b.write_text(CONFIG + "gate: gate.yaml\nout: somewhere/else\n")
    c.write_text(CONFIG.replace("n: 1", "n: 2"))
    assert load_config(a).hash == load_config(b).hash != load_config(c).hash


def _run(folder: Path, policy: str) -> Path:
    write_run_info(folder, RunInfo(name=f"m/{policy}", model="m", policy=policy))
    with ItemWriter(folder) as w:
        w.write(ItemRecord(id="t/0", hash="h", task="t", score=1.0, correct=True))
    return folder


def test_report_folders_sweep_runs_and_run(tmp_path):
    sweep = tmp_path / "sweep"
    base = _run(sweep / "runs" / "m" / "none", "none")
    cand = _run(sweep / "runs" / "m" / "kivi", "kivi(bits=4)")
    assert sorted(expand_run_dirs([sweep])) == sorted([base, cand])
    assert sorted(expand_run_dirs([sweep / "runs"])) == sorted([base, cand])
    assert expand_run_dirs([cand]) == [cand]


def test_full_disk_leaves_no_temporary_file_and_exits_2(tmp_path, monkeypatch, capsys):
    target = tmp_path / "gate.json"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        atomic_write_text(target, "{}")
    assert list(tmp_path.iterdir()) == []
    assert cli.run_command("gate", lambda: atomic_write_text(target, "{}")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "No space left on device" in err[0] and list(tmp_path.iterdir()) == []


def test_summarize_names_the_policy_to_deploy(tmp_path, capsys):
    from kveval.sweep.run import summarize

    sweep = tmp_path / "sweep"
    items = [ItemRecord(id=f"t/{i}", hash=str(i), task="t", score=1.0, correct=True) for i in range(80)]
    runs = []
    for policy, wrong in (("none", 0), ("quant(bits=8)", 0), ("kivi(bits=4)", 0), ("random(ratio=0.5)", 40)):
        folder = sweep / "runs" / "smollm2-135m" / policy.replace("(", "_").replace(")", "")
        write_run_info(folder, RunInfo(name=f"smollm2-135m/{policy}", model="smollm2-135m", policy=policy))
        with ItemWriter(folder) as w:
            for i, it in enumerate(items):
                w.write(ItemRecord(**{**it.__dict__, "score": float(i >= wrong), "correct": i >= wrong}))
        runs.append(folder)
    code = summarize(sweep, runs, None, {"gpu_memory": "2GiB", "context": 16384, "batch": 8})
    out = capsys.readouterr().out
    assert code == 1 and "gate verdict: FAIL" in out
    # kivi(bits=4) is the most compressed PASSing policy whose cache fits (the baseline's 2.8 GiB does not)
    assert "deploy smollm2-135m/kivi(bits=4)" in out
    assert "deployment: deploy smollm2-135m/kivi(bits=4)" in (sweep / "report" / "leaderboard.md").read_text()


def test_a_sweeps_second_model_builds_its_items_with_its_own_tokenizer(tmp_path, monkeypatch):
    """The cell of a sweep's second model built its probe items with the tokenizer of the model loaded before it
    (the first model's): prompts sized in the wrong tokens, ids and hashes no rescore could reproduce. Found when
    Gemma's half of every two-model sweep failed to rescore."""
    import kveval.sweep.run as run
    from kveval.sweep.executors import Cell

    path = tmp_path / "two.yaml"
    path.write_text("name: two\nmodels: [smollm2-135m, gemma3-270m]\npolicies: [quant(bits=8)]\n")
    config = load_config(path)
    runner = run.CellRunner(config, tmp_path / "out", quiet=True)
    runner._loaded = ("smollm2-135m", object(), "smollm2's tokenizer")  # the previous cell's model, still loaded
    monkeypatch.setattr(run, "load_tokenizer", lambda name: f"{name}'s own tokenizer")
    seen = []

    class Stop(Exception):
        pass

    def items(cfg, tokenizer):
        seen.append(tokenizer)
        raise Stop

    monkeypatch.setattr(run, "sweep_items", items)
    with pytest.raises(Stop):
        runner(Cell("gemma3-270m", "context", tuple(config.policies)))
    with pytest.raises(Stop):
        runner(Cell("smollm2-135m", "context", tuple(config.policies)))
    assert seen == ["gemma3-270m's own tokenizer", "smollm2's tokenizer"]
