"""Running a sweep (models x policies x probes): its lock, manifest, cells, resume, and the summary that ends in a leaderboard and gate verdict.

One run folder holds everything::

    <out>/manifest.json           versions, git commit, config and its hash, seeds, device
    <out>/runs/<model>/<policy>/  run.json + items.jsonl per policy (baseline ``none`` computed once),
                                  fidelity.jsonl per compressed policy with ``fidelity: true``
    <out>/report/                 leaderboard.md/.csv/.html and plots
    <out>/gate/                   gate.md, gate.xml (JUnit), gate.json

Items are appended and flushed one by one; a killed sweep rerun with the same
config continues where it stopped and ends with the same results as an
uninterrupted run. The same folder with a different config is refused.
"""

from __future__ import annotations

import functools
import json
import platform
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kveval.deployment import deployment_decision
from kveval.errors import ResultFileError, RunFolderError, UsageError
from kveval.gate.config import GateConfig
from kveval.gate.report import write_gate_outputs
from kveval.gate.rules import evaluate_sweep
from kveval.gate.verdicts import exit_code, overall_status
from kveval.lm_eval import register, tasks_dir
from kveval.lm_eval.responses import ResponseStore
from kveval.modeling.sources import load_tokenizer, resolve_device_dtype
from kveval.probes.sets import ProbeSet
from kveval.report.leaderboard import build_report
from kveval.runs.fidelity import read_fidelity
from kveval.runs.ownership import MANIFEST_FILE
from kveval.runs.records import ItemWriter, atomic_write_text, holds, iter_items, written_hashes
from kveval.policies.base import PolicyStack
from kveval.runner.runspec import RunSpec, check_lengths, model_identity, run_dir_for
from kveval.runs.results import records_from_samples
from kveval.sweep.config import SweepConfig
from kveval.sweep.layout import NOISE_FLOOR_DIR, noise_floor_batch_size, noise_floor_run
from kveval.sweep.sequential import run_sequential_cell, sequential_items

if TYPE_CHECKING:
    from kveval.sweep.executors import Cell, CellResult, Executor

#: Lock file of a sweep folder: held (flock) by the process running the sweep, naming it.
LOCK_FILE = ".kveval-sweep.lock"


@contextmanager
def sweep_lock(out: Path):
    """Hold the sweep folder's lock file for the duration; a second sweep into it is refused, naming the holder.

    The lock is an ``flock`` on :data:`LOCK_FILE`: the kernel drops it when the
    holder exits, however it ends, so a killed sweep never leaves a stale lock.
    """
    import fcntl
    import os
    import socket
    import sys
    import time

    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    handle = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RunFolderError(f"{out} is in use by another sweep ({holder}); wait for it to end or pass --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                     f"{' '.join(sys.argv)}")
        handle.flush()
        yield
    finally:
        handle.close()


def _manifest(config: SweepConfig, device: str) -> dict:
    return {"command": "sweep", "config_path": str(config.path) if config.path else None, "name": config.name,
            "config": config.raw, "config_hash": config.hash, "seed": config.seed, "device": device, **_environment()}


def _environment() -> dict:
    """The code and platform running now: package versions, kveval's git commit, Python and the OS."""
    import importlib.metadata as md

    versions = {}
    for package in ("kveval", "torch", "transformers", "lm_eval", "scipy", "numpy"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent,
                                timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"python": platform.python_version(), "platform": platform.platform(), "versions": versions, "git_commit": commit}


#: The packages whose versions change what a run computes (answers, scores, bytes).
_CODE_PACKAGES = ("kveval", "torch", "transformers")


def _code_of(manifest: dict) -> dict:
    """The code a manifest was written under: kveval's commit and the versions that change results."""
    versions = manifest.get("versions") or {}
    return {"git_commit": manifest.get("git_commit"), **{p: versions.get(p) for p in _CODE_PACKAGES}}


def running_code() -> dict:
    """:func:`_code_of` the code running now."""
    return _code_of(_environment())


def _describe(code: dict) -> str:
    commit = (code.get("git_commit") or "no commit")[:10]
    return f"kveval {code.get('kveval')} ({commit}), torch {code.get('torch')}, transformers {code.get('transformers')}"


def plan_cells(config: SweepConfig, policies_per_cell: int | None = None) -> list[Cell]:
    """The sweep's cells, model by model and mode by mode (the baseline ``none`` runs in the config's mode).

    ``policies_per_cell``: how many of a mode's policies one cell evaluates
    (they share each batch's prefill); ``None``: all of them, one cell per model
    and mode. Smaller cells spread further over workers, each repeating the prefill.
    """
    from kveval.sweep.executors import Cell  # imports torch: kept off rescore's and report's path

    if policies_per_cell is not None and policies_per_cell < 1:
        raise UsageError(f"policies per cell = {policies_per_cell}; give 1 or more")
    cells = []
    for model_name in config.models:
        for mode, specs in _specs_by_mode(config).items():
            size = policies_per_cell or len(specs)
            cells += [Cell(model_name, mode, tuple(specs[i:i + size])) for i in range(0, len(specs), size)]
    return cells


def _specs_by_mode(config: SweepConfig) -> dict[str, list[RunSpec]]:
    by_mode: dict[str, list[RunSpec]] = {config.mode: [RunSpec(PolicyStack(), config.mode, config.kv_dtype)]}
    for spec in config.policies:
        by_mode.setdefault(spec.mode, []).append(spec)
    return by_mode


class CellRunner:
    """``work(cell)`` for an executor: load the cell's model, evaluate its policies, run its lm-eval tasks.

    Picklable (for Ray): the loaded model is kept only between calls in one
    process (consecutive cells of one model reuse it) and is not pickled.
    ``load_options``: keyword arguments of :func:`kveval.runner.models.load_model` (``device_map``, ``max_memory``,
    ``self_check``), the same for every model of the sweep.
    """

    def __init__(self, config: SweepConfig, out: Path, load_options: dict | None = None, quiet: bool = False):
        self.config, self.out, self.load_options, self.quiet = config, Path(out), dict(load_options or {}), quiet
        self._loaded: tuple | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_loaded": None}

    def model(self, name: str):
        """The model ``name`` and its tokenizer: loaded once, kept while consecutive cells are of that model."""
        from kveval.runner.models import load_model  # imports torch: kept off rescore's and report's path

        if self._loaded is None or self._loaded[0] != name:
            self._loaded = None  # free the previous model before the next one loads
            self._loaded = (name, *load_model(name, **self.load_options))
        return self._loaded[1], self._loaded[2]

    def _finished(self, cell: Cell, items: list) -> list[Path] | None:
        """The cell's run folders if every one is finished (:func:`unfinished`; finalized again), else None."""
        from kveval.runner.evaluate import finalize_run  # imports torch: off rescore's path

        identity = model_identity(cell.model)
        dirs = [run_dir_for(self.out, identity, spec.for_model(cell.model)) for spec in cell.specs]
        if any(unfinished(self.config, spec, run_dir, items) for spec, run_dir in zip(cell.specs, dirs)):
            return None
        for run_dir in dirs:
            finalize_run(run_dir)
        return dirs

    def _fidelity(self, model, tokenizer, cell: Cell, items: list, dirs: list[Path]) -> None:
        """``fidelity.jsonl`` for the cell's compressed policies, against the baseline in the cell's mode (resumable)."""
        from kveval.runner.fidelity import record_fidelity  # imports torch: kept off rescore's and report's path

        candidates = [(spec, d) for spec, d in zip(cell.specs, dirs) if not spec.policy.is_none]
        if candidates:
            baseline = RunSpec(PolicyStack(), cell.mode, self.config.kv_dtype)
            record_fidelity(model, tokenizer, items, baseline, candidates, batch_size=self.config.batch_size,
                            seed=self.config.seed)

    def _noise_floor(self, cell: Cell, items: list, dirs: list[Path]) -> bool:
        """Under ``noise_floor``: the cell's baseline again, items in reverse order at another batch size
        (:func:`noise_floor_batch_size`), into :func:`noise_floor_run` (resumable; no weights load once it is done).
        Whether anything was run."""
        baseline = [(spec, d) for spec, d in zip(cell.specs, dirs) if spec.policy.is_none]
        if not self.config.noise_floor or not baseline:
            return False
        (spec, base_dir), = baseline
        return self.noise_floor_of(cell.model, spec, base_dir, items)

    def noise_floor_of(self, model_name: str, spec: "RunSpec", base_dir: Path, items: list) -> bool:
        """The noise floor of the baseline run ``base_dir`` on ``items`` (see :meth:`_noise_floor`)."""
        from kveval.runner.evaluate import evaluate_policies  # imports torch: kept off rescore's and report's path

        written = written_hashes(noise_floor_run(self.out, base_dir))
        if all(written.get(item.id) == item.hash for item in items):
            return False
        model, tokenizer = self.model(model_name)
        size = noise_floor_batch_size(self.config.batch_size)
        evaluate_policies(model, tokenizer, list(reversed(items)), [spec], self.out / NOISE_FLOOR_DIR, model_name,
                          size, self.config.seed,
                          extra={"sweep": self.config.name, "config_hash": self.config.hash,
                                 "noise_floor": {"of": str(base_dir), "batch_size": size, "order": "reversed"}})
        return True

    def __call__(self, cell: Cell) -> CellResult:
        import torch
        from tqdm import tqdm

        from kveval.runner.evaluate import evaluate_policies  # imports torch: kept off rescore's and report's path
        from kveval.sweep.executors import CellResult

        config = self.config
        # the loaded model's tokenizer only where it is this cell's model: a sweep's next model builds its items with
        # its own (the previous model's would size its prompts in other tokens)
        loaded = self._loaded is not None and self._loaded[0] == cell.model
        items = sweep_items(config, self._loaded[2] if loaded else load_tokenizer(cell.model))
        if config.sequential is not None:
            return run_sequential_cell(self, cell, items)
        finished = self._finished(cell, items)
        if finished is not None:  # a resumed sweep loads no weights for the cells that are done
            ran = self._noise_floor(cell, items, finished)
            return CellResult([str(d) for d in finished], already_complete=not ran)
        model, tokenizer = self.model(cell.model)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with tqdm(total=len(items) * len(cell.specs), desc=progress_label(cell), unit="item", disable=self.quiet) as bar:
            dirs = evaluate_policies(model, tokenizer, items, list(cell.specs), self.out, cell.model,
                                     config.batch_size, config.seed, bar, extra={"sweep": config.name, "config_hash": config.hash})
        if config.fidelity:
            self._fidelity(model, tokenizer, cell, items, dirs)
        if config.lm_eval:
            run_lm_eval_tasks(model, tokenizer, list(cell.specs), dirs, config.lm_eval, config.batch_size, config.seed)
        self._noise_floor(cell, items, dirs)
        return CellResult([str(d) for d in dirs], torch.cuda.max_memory_allocated() if cuda else None)


def progress_label(cell: Cell) -> str:
    """A cell's progress bar label: its model and policies, the first by name and the others counted
    (``smollm2-135m: none and 3 other policies``), which the bar's items x policies count."""
    others = len(cell.specs) - 1
    counted = f" and {others} other {'policy' if others == 1 else 'policies'}" if others else ""
    return f"{Path(cell.model).name}: {cell.specs[0].spec}{counted}"


def sweep_items(config: SweepConfig, tokenizer) -> list:
    """The sweep's probe items for one model's tokenizer: every family at every length, in the config's order."""

    return ProbeSet(tokenizer=str(getattr(tokenizer, "kveval_name", "") or ""), families=config.families,
                    lengths=config.lengths, n=config.n, depths=config.depths, seed=config.seed,
                    params=config.family_params).items(tokenizer)


def unfinished(config: SweepConfig, spec: "RunSpec", run_dir: Path, items: list) -> str | None:
    """Why ``run_dir`` (``spec``'s run of the sweep) is not finished, or ``None`` where it holds every item (on its
    prompt), every lm-eval task and, under ``fidelity``, every item's fidelity. Another prompt under an item's id
    is not finished either: :func:`~kveval.runner.evaluate.evaluate_policies` then refuses the folder, naming it."""

    try:
        records = list(iter_items(run_dir))
    except (ResultFileError, OSError) as exc:  # missing, or a killed writer's half line
        return f"not readable ({exc})" if isinstance(exc, ResultFileError) else "not run yet"
    written = {r.id: r.hash for r in records}
    if config.sequential is not None:  # a sequential sweep's run is finished once decided on the items it needed
        needed = sequential_items(config, run_dir, items)
        if needed is not None:  # else undecided: finished only holding every item (a fixed-n run of the sweep)
            items = needed
    short = holds(sum(written.get(item.id) == item.hash for item in items), len(items))
    if short:
        return short
    tasks = {r.metrics.get("lm_eval_task") for r in records}
    missing = [task for task in config.lm_eval.get("tasks", []) if task not in tasks]
    if missing:
        return f"lacks the lm-eval task(s) {', '.join(missing)}"
    if config.fidelity and not spec.policy.is_none:
        measured = read_fidelity(run_dir)
        done = sum(item.id in measured and measured[item.id].hash == item.hash for item in items)
        if done < len(items):
            return f"holds the fidelity of {done} of {len(items)} items"
    return None


def sweep_runs(config: SweepConfig, out: Path) -> "list[tuple[str, RunSpec, Path]]":
    """The sweep's runs under ``out`` as ``(model, spec, run folder)``, in :func:`run_sweep`'s order (baseline first
    for each model)."""

    return [(model_name, spec, run_dir_for(out, model_identity(model_name), spec.for_model(model_name)))
            for model_name in config.models for specs in _specs_by_mode(config).values() for spec in specs]


def read_manifest(out: Path, config: SweepConfig, remedy: str | None = None) -> dict | None:
    """The manifest of the sweep folder ``out`` (``None``: it has none), refused where it is damaged or foreign, or
    belongs to another config; ``remedy`` ends the refusal (default: a sweep's, start a new folder)."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        return None
    remedy = remedy or f"pass --out to a new folder, or delete {out} to start over"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict):
        raise RunFolderError(f"{path} is not a sweep manifest (damaged or foreign); {remedy}")
    if manifest.get("config_hash") != config.hash:
        raise RunFolderError(f"{out} holds a sweep with another config (hash {manifest.get('config_hash')}); {remedy}")
    return manifest


def run_sweep(config: SweepConfig, out: Path, quiet: bool = False, executor: Executor | None = None,
              load_options: dict | None = None, policies_per_cell: int | None = None) -> list[Path]:
    """Run (or resume) a sweep; return its run folders (baseline first for each model).

    ``executor``: where the cells (:func:`plan_cells`) run (:mod:`kveval.sweep.executors`;
    default this process, one cell after another). The caller holds the sweep
    lock (:func:`sweep_lock`); cells only append items to their own run folders.
    Results do not depend on the executor or on ``policies_per_cell``.
    """
    from kveval.sweep.executors import InProcessExecutor

    for model_name in config.models:  # every spec and length against every model's config.json, before any weights load
        for spec in config.policies:
            spec.for_model(model_name)
        check_lengths(model_name, config.lengths, f"sweep {config.name}: probes.lengths")
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST_FILE
    previous = read_manifest(out, config)
    if previous is None and (out / "runs").is_dir() and any((out / "runs").iterdir()):
        # A sweep writes its manifest before any run: these runs come from elsewhere (kveval eval), under settings
        # this config does not know, and would be resumed into and gated with its own.
        raise RunFolderError(f"{out} holds runs but no sweep manifest (kveval eval's, or another tool's); pass --out "
                             f"to a new folder")
    device, _ = resolve_device_dtype()
    manifest = _manifest(config, device)
    if previous is not None:
        manifest["started_under"] = previous.get("started_under") or _code_of(previous)
        if previous.get("rescored_under"):  # kveval rescore's: what scored the items written before
            manifest["rescored_under"] = previous["rescored_under"]
        if manifest["started_under"] != _code_of(manifest):
            import sys

            print(f"kveval sweep: warning: {out} was started under {_describe(manifest['started_under'])} and resumes "
                  f"under {_describe(_code_of(manifest))}: items written before keep what that code computed; "
                  f"pass --out to a new folder for one version throughout", file=sys.stderr)
    if config.sequential is not None:
        # one cell per model and mode: the baseline runs the blocks its candidates need, beside them
        policies_per_cell = None
        if executor is not None and executor.concurrent and len(_specs_by_mode(config)) > 1:
            raise UsageError(f"sweep {config.name} is sequential and has policies in several modes, whose cells "
                             f"share one baseline run block by block: run it with --executor inprocess, or set "
                             f"sequential: false")
        manifest["sequential"] = config.sequential.to_dict()
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2, sort_keys=True))
    cells = plan_cells(config, policies_per_cell)
    absolute = out.resolve()  # cells may run in another working directory (Ray workers do)
    results = (executor or InProcessExecutor()).run(cells, CellRunner(config, absolute, load_options, quiet))
    by_spec, peaks = {}, {}
    for cell, result in zip(cells, results):
        for spec, run_dir in zip(cell.specs, result.run_dirs):
            by_spec[(cell.model, cell.mode, spec.key)] = out / Path(run_dir).relative_to(absolute)
        if result.cuda_peak_allocated_bytes is not None:
            peaks[cell.model] = max(peaks.get(cell.model, 0), result.cuda_peak_allocated_bytes)
    if peaks:
        manifest["cuda_peak_allocated_bytes"] = peaks
    if config.sequential is not None:  # each run's decision (look, items spent), as its run.json records it
        from kveval.gate.sequential import DECISION_KEY
        from kveval.runs.records import read_run_info

        manifest["sequential_decisions"] = {
            str(by_spec[(model_name, mode, spec.key)].relative_to(out)):
                read_run_info(by_spec[(model_name, mode, spec.key)]).extra.get(DECISION_KEY)
            for model_name in config.models for mode, specs in _specs_by_mode(config).items() for spec in specs
            if (by_spec[(model_name, mode, spec.key)] / "run.json").is_file()}
    if peaks or config.sequential is not None:
        atomic_write_text(manifest_path, json.dumps(manifest, indent=2, sort_keys=True))
    return [by_spec[(model_name, mode, spec.key)] for model_name in config.models
            for mode, specs in _specs_by_mode(config).items() for spec in specs]


@functools.lru_cache(maxsize=4)
def _task_manager(include: str | None, metadata: str):
    """lm-eval's ``TaskManager`` for our task folder and the sweep's metadata (JSON), built once per process.

    Building one indexes every task lm-eval ships (about half a minute on 2
    cores); cells of one sweep and the policies of one cell reuse it.
    """
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[include] if include else None, metadata=json.loads(metadata))


def run_lm_eval_tasks(model, tokenizer, specs: "list[RunSpec]", run_dirs: list[Path], settings: dict, batch_size: int,
                      seed: int) -> None:
    """Run the sweep's lm-eval tasks under each policy; their per-sample results join each run's ``items.jsonl``.

    ``specs`` share one mode and KV dtype (one cell). Each task runs through
    lm-eval once per policy still missing it, exactly as a separate run would
    (its own :class:`~kveval.lm_eval.model.KVEvalLM`), but the first of those
    runs prefills every request once for all of them and the others' runs are
    answered from a :class:`~kveval.lm_eval.responses.ResponseStore` (identical
    samples and measured bytes). A task's samples are written only once lm-eval
    has finished it for that policy, so a sweep killed between two policies
    reruns only the policies not written, and never records half a task.
    """
    import lm_eval


    done = [{r.metrics.get("lm_eval_task") for r in iter_items(d)} for d in run_dirs]
    if all(set(settings["tasks"]) <= finished for finished in done):
        return
    model_class = register()
    lms = [model_class(pretrained=model, tokenizer=tokenizer, policy=spec, seed=seed, batch_size=batch_size,
                       **(settings.get("model_args") or {})) for spec in specs]
    store = ResponseStore()
    folder = tasks_dir()
    manager = _task_manager(str(folder) if folder else None, json.dumps(settings.get("metadata") or None, sort_keys=True))
    for task in settings["tasks"]:  # one call per listed task: a group's subtasks are recorded under the listed name
        pending = [i for i, finished in enumerate(done) if task not in finished]
        for n, i in enumerate(pending):
            lms[i].share_prefill([specs[j] for j in pending[n + 1:]], store)  # later policies read what this one leaves
            output = lm_eval.simple_evaluate(model=lms[i], tasks=[task], limit=settings.get("limit"), log_samples=True,
                                             task_manager=manager, random_seed=seed, numpy_random_seed=seed,
                                             torch_random_seed=seed, device=str(lms[i].device))  # recorded only
            with ItemWriter(run_dirs[i]) as writer:
                for subtask, rows in sorted(output["samples"].items()):
                    for record in records_from_samples(rows, subtask, None, f"lm-eval samples of {subtask}"):
                        record.metrics["lm_eval_task"] = task
                        writer.write(record)


def summarize(out: Path, run_dirs: list[Path], gate_config: "GateConfig | None", deploy: dict | None = None,
              probes: dict | None = None, rank: bool = False) -> int:
    """Compare, gate and report a finished sweep; print leaderboard and verdict; return the gate's exit code.

    ``deploy``: ``gpu_memory``, ``context``, ``batch`` (and ``headroom``, ``weights``) for the deployment decision;
    ``probes``: the sweep's probe items by prompt hash, where the caller holds them, for the report's item views.
    """

    floors = {str(d): noise_floor_run(out, d) for d in run_dirs if noise_floor_run(out, d).is_dir()}
    results = evaluate_sweep(gate_config, run_dirs, noise_floors=floors)
    if deploy:
        deployment_decision(results, **deploy)
    write_gate_outputs(results, out / "gate")
    # The verdicts just computed, not gate.json read back: a file is judged again from its runs, which here would
    # only repeat the gate.
    build_report(run_dirs, out / "report", gate_result=results, probes=probes, rank=rank)
    print()
    # The leaderboard carries each candidate's verdict and its reasons; gate.md says the same at length, so it is
    # named, not printed, and the sweep's verdict is said once, last.
    print((out / "report" / "leaderboard.md").read_text())
    code = exit_code(results)
    print(f"gate verdict: {overall_status(results)}  |  gate: {out / 'gate' / 'gate.md'}  |  "
          f"leaderboard: {out / 'report' / 'leaderboard.html'}")
    return code


