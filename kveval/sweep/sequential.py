"""A sequential sweep's cells: items run in stratified blocks (:class:`~kveval.gate.sequential.LookPlan`), the gate
judges each candidate after each block, and a decided candidate leaves (docs/statistics.md, "The sequential sweep").

:class:`~kveval.sweep.run.CellRunner` hands a cell here when the sweep is sequential; what this asks of it is
:class:`CellRunning`. Resumable: a killed sweep finishes the block it was in, replays the looks on the items written
and goes on, so it decides as an uninterrupted sweep does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kveval.errors import ResultFileError
from kveval.gate.rules import evaluate_gate
from kveval.gate.sequential import DECISION_KEY, ORDER_KEY, LookPlan, family_size, probe_order
from kveval.gate.verdicts import ERROR
from kveval.policies.base import PolicyStack
from kveval.runner.runspec import RunSpec, model_identity, run_dir_for
from kveval.runs.records import read_run_info, write_run_info, written_hashes
from kveval.stats.sequential import CONTINUE
from kveval.sweep.config import SweepConfig
from kveval.sweep.layout import noise_floor_run
from kveval.values import is_whole

if TYPE_CHECKING:
    from kveval.sweep.executors import Cell, CellResult


class CellRunning(Protocol):
    """What a sequential cell asks of the sweep's runner (:class:`kveval.sweep.run.CellRunner`)."""

    config: SweepConfig
    out: Path

    def model(self, name: str) -> tuple:
        """The model ``name`` and its tokenizer, loaded once and kept between calls."""

    def noise_floor_of(self, model_name: str, spec: RunSpec, base_dir: Path, items: list) -> bool:
        """Run the noise floor of the baseline run ``base_dir`` on ``items`` where it lacks any; whether it ran."""


def look_plan(config: SweepConfig, items: list) -> "LookPlan":
    """The looks of a sequential sweep over ``items`` (every task, in :func:`~kveval.gate.sequential.probe_order`)."""
    gate = config.gate
    return LookPlan.build(config.sequential, probe_order(items), gate.alpha, gate.alpha, f"sweep {config.name}")


def sequential_items(config: SweepConfig, run_dir: Path, items: list) -> list | None:
    """The items a sequential sweep's run needed: those up to the look its recorded decision names (``None``: it
    records none, so it is not decided yet)."""
    try:
        record = read_run_info(run_dir).extra.get(DECISION_KEY)
    except (ResultFileError, OSError):
        return None
    if not isinstance(record, dict) or not is_whole(record.get("look")):
        return None
    plan = look_plan(config, items)
    by_id = {item.id: item for item in items}
    return [by_id[i] for i in plan.ids_through(min(record["look"], plan.looks) - 1)]


def started_look(run_dir: Path, plan: "LookPlan") -> int | None:
    """The look whose blocks ``run_dir`` was last asked for (its ``run.json``'s ``expected_items``), or ``None``
    where it was never opened or asks for no whole number of blocks."""
    try:
        expected = read_run_info(run_dir).extra.get("expected_items")
    except (ResultFileError, OSError):
        return None
    return next((k for k in range(plan.looks) if len(plan.ids_through(k)) == expected), None)


def run_sequential_cell(runner: CellRunning, cell: "Cell", items: list) -> "CellResult":
    """A sequential sweep's cell: block by block (:func:`look_plan`), the baseline and the candidates still
    undecided run the block (one shared prefill), then the gate judges each candidate on the items so far
    (:func:`kveval.gate.rules.evaluate_gate` under the sequential config); a decided candidate leaves. Every
    run's ``run.json`` records the look order and, at the end, its decision (``extra.sequential_decision``).
    Resumed, it replays the same looks on the items written and runs only what is missing (no weights load
    where nothing is), so it decides as an uninterrupted sweep did."""
    import torch

    from kveval.sweep.executors import CellResult

    config, gate = runner.config, runner.config.gate
    identity = model_identity(cell.model)
    base_spec = RunSpec(PolicyStack(), config.mode, config.kv_dtype)
    base_dir = run_dir_for(runner.out, identity, base_spec.for_model(cell.model))
    dirs = [run_dir_for(runner.out, identity, spec.for_model(cell.model)) for spec in cell.specs]
    plan = look_plan(config, items)
    by_id = {item.id: item for item in items}
    tasks = list(plan.order) if gate.tasks == "all" else [t for t in gate.tasks if t in plan.order]
    family = family_size(gate, len(tasks), len(config.policies))
    extra = {"sweep": config.name, "config_hash": config.hash,
             ORDER_KEY: {"order": {t: list(ids) for t, ids in plan.order.items()}}}
    open_ = [(spec, d) for spec, d in zip(cell.specs, dirs) if not spec.policy.is_none]
    decisions: dict[Path, dict] = {}
    ran, look = False, -1
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # A killed sweep left runs part-way through a block they were asked for: finish it first, as the
    # uninterrupted sweep did, so that every look below is judged on whole blocks.
    for spec, run_dir in [(base_spec, base_dir)] + open_:
        started = started_look(run_dir, plan)
        if started is not None:
            ran |= run_block(runner, cell, [by_id[i] for i in plan.ids_through(started)], [(spec, run_dir)], extra)
    started = started_look(noise_floor_run(runner.out, base_dir), plan) if config.noise_floor else None
    if started is not None:
        ran |= runner.noise_floor_of(cell.model, base_spec, base_dir, [by_id[i] for i in plan.ids_through(started)])
    while open_ and look + 1 < plan.looks:
        look += 1
        block = [by_id[i] for i in plan.ids_through(look)]
        ran |= run_block(runner, cell, block, [(base_spec, base_dir)] + open_, extra)
        floor = noise_floor_run(runner.out, base_dir) if config.noise_floor else None
        if floor is not None:
            ran |= runner.noise_floor_of(cell.model, base_spec, base_dir, block)
        result = evaluate_gate(gate, base_dir, [d for _, d in open_], known_tasks=config.families,
                               noise_floor=floor, family=family)
        still = []
        for (spec, run_dir), verdict in zip(open_, result.candidates):
            if verdict.status == ERROR:
                raise ResultFileError(f"sequential sweep {config.name}: {verdict.error}")
            # a run holding later blocks (a killed sweep's, finished above) is judged on them too: decided at a
            # later look, it is still open at this one
            later = verdict.sequential["look"] > look + 1
            if (verdict.sequential["decision"] == CONTINUE or later) and look + 1 < plan.looks:
                still.append((spec, run_dir))
            else:
                decisions[run_dir] = verdict.sequential
        open_ = still
    for run_dir, record in decisions.items():
        info = read_run_info(run_dir)
        kept = {k: record[k] for k in ("decision", "look", "looks", "items", "items_total")}
        if info.extra.get(DECISION_KEY) != kept:
            info.extra[DECISION_KEY] = kept
            write_run_info(run_dir, info)
    if (base_dir / "run.json").is_file() and look >= 0:  # the baseline ran every block its candidates needed
        info = read_run_info(base_dir)
        recorded = info.extra.get(DECISION_KEY) or {}
        needed = max(look + 1, recorded.get("look", 0) if is_whole(recorded.get("look", 0)) else 0)
        counts = plan.counts(needed - 1)
        kept = {"decision": "BASELINE", "look": needed, "looks": plan.looks, "items": counts,
                "items_total": sum(counts.values())}
        if recorded != kept:
            info.extra[DECISION_KEY] = kept
            write_run_info(base_dir, info)
    return CellResult([str(d) for d in dirs], torch.cuda.max_memory_allocated() if cuda and ran else None,
                      already_complete=not ran)

def run_block(runner: CellRunning, cell: "Cell", block: list, runs: list, extra: dict) -> bool:
    """Run ``block``'s items under every ``(spec, run folder)`` of ``runs`` lacking any (one shared prefill per
    mode; written items are skipped). Whether anything ran (the weights load only then)."""
    from kveval.runner.evaluate import evaluate_policies  # imports torch: kept off rescore's and report's path

    wanted = {item.id: item.hash for item in block}
    missing = []
    for spec, run_dir in runs:
        written = written_hashes(run_dir)
        if any(written.get(i) != h for i, h in wanted.items()):
            missing.append(spec)
    if not missing:
        return False
    model, tokenizer = runner.model(cell.model)
    for mode in dict.fromkeys(spec.mode for spec in missing):  # one call per mode: the baseline's may differ
        evaluate_policies(model, tokenizer, block, [s for s in missing if s.mode == mode], runner.out, cell.model,
                          runner.config.batch_size, runner.config.seed, extra=extra)
    return True
