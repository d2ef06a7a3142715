"""``kveval sweep CONFIG.yaml``: models x policies x probes, then comparison, leaderboard and gate verdict.

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
import hashlib
import json
import platform
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from typing import TYPE_CHECKING

from kveval.errors import ConfigError, RunFolderError, UsageError
from kveval.records import atomic_write_text
from kveval.values import is_real, is_whole

if TYPE_CHECKING:
    from kveval.executors import Cell, CellResult, Executor
    from kveval.runspec import RunSpec

CONFIG_KEYS = {"name", "models", "policies", "mode", "kv_dtype", "probes", "batch_size", "gate", "out", "seed", "lm_eval",
               "fidelity"}
PROBE_KEYS = {"families", "lengths", "depths", "n", "seed", "params"}
LM_EVAL_KEYS = {"tasks", "limit", "model_args", "metadata"}
#: Config keys that name where things go or how they are judged, not what is computed: outside the config hash.
RESULT_NEUTRAL_KEYS = {"gate", "out"}
#: Lock file of a sweep folder: held (flock) by the process running the sweep, naming it.
LOCK_FILE = ".kveval-sweep.lock"
#: What a sweep folder's config and code were (:func:`read_manifest`).
MANIFEST_FILE = "manifest.json"


@dataclass
class SweepConfig:
    """A sweep, as read from YAML. ``gate:`` is relative to the YAML file's folder (the file ships beside it);
    ``out:`` and ``--out`` to the working directory, where a run's outputs go."""

    name: str
    models: list[str]
    policies: list["RunSpec"]  # parsed once here; the baseline none is added per mode by run_sweep
    mode: str = "context"
    kv_dtype: str | None = None
    families: list[str] = field(default_factory=lambda: ["passkey"])
    lengths: list[int] = field(default_factory=lambda: [512])
    depths: list[float] | None = None
    n: int = 10
    seed: int = 0
    family_params: dict = field(default_factory=dict)
    batch_size: int = 1
    gate: str | None = None
    out: str | None = None
    lm_eval: dict = field(default_factory=dict)
    #: Teacher-force the baseline's answers through every compressed policy (:mod:`kveval.fidelity`), as ``kveval eval --fidelity``.
    fidelity: bool = False
    raw: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def hash(self) -> str:
        """Hash of what changes results: the config less :data:`RESULT_NEUTRAL_KEYS` (fixing a gate path resumes)."""
        kept = {k: v for k, v in self.raw.items() if k not in RESULT_NEUTRAL_KEYS}
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def load_config(path: str | Path) -> SweepConfig:
    """Read and validate a sweep YAML; every problem is one :class:`~kveval.errors.ConfigError` line."""
    from kveval.probes import FAMILIES
    from kveval.runspec import RunSpec, parse_kv_dtype

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such sweep config; see configs/quickstart.yaml for an example")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; a sweep config is a YAML file") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sweep config is a mapping of keys ({', '.join(sorted(CONFIG_KEYS))})")
    unknown = set(raw) - CONFIG_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(CONFIG_KEYS))}")
    probes = _mapping(path, "probes", raw.get("probes"))
    unknown = set(probes) - PROBE_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown probes key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(PROBE_KEYS))}")
    mode = raw.get("mode", "context")  # policies may override it with a suffix: snapkv(ratio=0.5)@query
    if mode not in ("context", "query"):
        raise ConfigError(f"{path}: mode={mode!r}; use context or query")
    try:
        kv_dtype = parse_kv_dtype(raw.get("kv_dtype"))
        parsed = [(str(entry), RunSpec.parse(str(entry), default_mode=mode, kv_dtype=kv_dtype))
                  for entry in _list(path, "policies", raw.get("policies"))]
    except ValueError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    policies, warnings, first_entry = [], [], {}
    for entry, spec in parsed:
        if spec.kv_dtype != kv_dtype:  # the one baseline runs at the sweep's dtype: this run could not be gated
            raise ConfigError(f"{path}: policy {entry!r} asks for kv_dtype {spec.kv_dtype} but the sweep's baseline "
                              f"runs at {kv_dtype or 'the model default'}, and runs of two cache dtypes are not paired; "
                              f"set the sweep's kv_dtype: {spec.kv_dtype}, or give that policy a sweep of its own")
    for entry, spec in parsed:  # same canonical spec and mode: one run, merged with a warning
        if spec.key in first_entry:
            warnings.append(f"{path}: policy {entry!r} is the same run as {first_entry[spec.key]!r}; merged into one")
            continue
        first_entry[spec.key] = entry
        policies.append(spec)
    if not policies:
        raise ConfigError(f"{path}: list at least one policy under 'policies' (the baseline 'none' is added for you)")
    families = [_string(path, f"probes.families[{i}]", family)
                for i, family in enumerate(_list(path, "probes.families", probes.get("families")))] or ["passkey"]
    for family in families:
        if family not in FAMILIES:
            raise ConfigError(f"{path}: unknown probe family {family!r}; known: {', '.join(FAMILIES)}")
    lm_eval = _mapping(path, "lm_eval", raw.get("lm_eval"))
    unknown = set(lm_eval) - LM_EVAL_KEYS
    if unknown or (lm_eval and not lm_eval.get("tasks")):
        raise ConfigError(f"{path}: lm_eval needs `tasks` and takes only {', '.join(sorted(LM_EVAL_KEYS))}")
    if lm_eval:
        tasks = [_string(path, f"lm_eval.tasks[{i}]", task) for i, task in enumerate(_list(path, "lm_eval.tasks", lm_eval["tasks"]))]
        limit = lm_eval.get("limit")  # lm-eval's: a number of documents, or a fraction of them below 1
        if limit is not None and not (limit >= 1 if is_whole(limit) else is_real(limit) and 0 < limit <= 1):
            raise ConfigError(f"{path}: lm_eval.limit={limit!r} must be a whole number >= 1 or a fraction in (0, 1]")
        for key in ("model_args", "metadata"):
            _mapping(path, f"lm_eval.{key}", lm_eval.get(key))
        lm_eval = {**lm_eval, "tasks": tasks}
    fidelity = raw.get("fidelity", False)
    if not isinstance(fidelity, bool):
        raise ConfigError(f"{path}: fidelity={fidelity!r}; use true (teacher-forced KL against the baseline) or false")
    gate = raw.get("gate")
    if gate is not None:
        gate = _string(path, "gate", gate)
        from kveval.gate_config import load_gate_config

        gate = str((path.parent / gate).resolve()) if not Path(gate).is_absolute() else gate
        load_gate_config(gate)  # a bad gate file is reported now, before any model loads
    depths = probes.get("depths")
    if depths is not None:
        depths = [_fraction(path, f"probes.depths[{i}]", d) for i, d in enumerate(_list(path, "probes.depths", depths))]
    seed_key, seed = ("probes.seed", probes["seed"]) if "seed" in probes else ("seed", raw.get("seed", 0))
    return SweepConfig(
        name=_string(path, "name", raw.get("name", path.stem)),
        models=[_string(path, f"models[{i}]", m) for i, m in enumerate(_list(path, "models", raw.get("models")))]
        or ["smollm2-135m"],
        policies=[p for p in policies if not p.policy.is_none], mode=mode, kv_dtype=kv_dtype,
        families=[str(family) for family in families],
        lengths=[_count(path, f"probes.lengths[{i}]", x) for i, x in enumerate(_list(path, "probes.lengths", probes.get("lengths")))]
        or [512],
        depths=depths, n=_count(path, "probes.n", probes.get("n", 10)), seed=_whole(path, seed_key, seed),
        family_params=_mapping(path, "probes.params", probes.get("params")),
        batch_size=_count(path, "batch_size", raw.get("batch_size", 1)), gate=gate,
        out=None if raw.get("out") is None else _string(path, "out", raw["out"]), lm_eval=lm_eval, fidelity=fidelity,
        raw=raw, warnings=warnings,
    )


# Typed reads of the YAML's values: a value of the wrong type is one line naming the key, never coerced (true as
# 1, 2.5 as 2) nor iterated (a string read as a list of characters).
def _whole(path: Path, key: str, value) -> int:
    if not is_whole(value):
        raise ConfigError(f"{path}: {key}={value!r} must be a whole number")
    return value


def _count(path: Path, key: str, value) -> int:
    if not is_whole(value) or value < 1:
        raise ConfigError(f"{path}: {key}={value!r} must be a whole number >= 1")
    return value


def _fraction(path: Path, key: str, value) -> "int | float":
    if not is_real(value) or not 0 <= value <= 1:
        raise ConfigError(f"{path}: {key}={value!r} must be a number in [0, 1]")
    return value  # as written (0 stays 0): the items' ids are made from the depths


def _string(path: Path, key: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{path}: {key} must be a string, got {value!r}")
    return value


def _list(path: Path, key: str, value) -> list:
    """A YAML list (``None``: empty); a scalar is refused, naming the list it should be."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{path}: {key} must be a list, e.g. [{value}], got {value!r}")
    return value


def _mapping(path: Path, key: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key} must be a mapping of keys, got {value!r}")
    return value


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
    return {"name": config.name, "config": config.raw, "config_hash": config.hash, "seed": config.seed, "device": device,
            **_environment()}


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
    from kveval.executors import Cell

    if policies_per_cell is not None and policies_per_cell < 1:
        raise UsageError(f"policies per cell = {policies_per_cell}; give 1 or more")
    cells = []
    for model_name in config.models:
        for mode, specs in _specs_by_mode(config).items():
            size = policies_per_cell or len(specs)
            cells += [Cell(model_name, mode, tuple(specs[i:i + size])) for i in range(0, len(specs), size)]
    return cells


def _specs_by_mode(config: SweepConfig) -> dict[str, list[RunSpec]]:
    from kveval.runspec import RunSpec

    by_mode: dict[str, list[RunSpec]] = {config.mode: [RunSpec.parse("none", config.mode, config.kv_dtype)]}
    for spec in config.policies:
        by_mode.setdefault(spec.mode, []).append(spec)
    return by_mode


class CellRunner:
    """``work(cell)`` for an executor: load the cell's model, evaluate its policies, run its lm-eval tasks.

    Picklable (for Ray): the loaded model is kept only between calls in one
    process (consecutive cells of one model reuse it) and is not pickled.
    ``load_options``: keyword arguments of :func:`kveval.models.load_model` (``device_map``, ``max_memory``,
    ``self_check``), the same for every model of the sweep.
    """

    def __init__(self, config: SweepConfig, out: Path, load_options: dict | None = None, quiet: bool = False):
        self.config, self.out, self.load_options, self.quiet = config, Path(out), dict(load_options or {}), quiet
        self._loaded: tuple | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_loaded": None}

    def _model(self, name: str):
        from kveval.models import load_model

        if self._loaded is None or self._loaded[0] != name:
            self._loaded = None  # free the previous model before the next one loads
            self._loaded = (name, *load_model(name, **self.load_options))
        return self._loaded[1], self._loaded[2]

    def _finished(self, cell: Cell, items: list) -> list[Path] | None:
        """The cell's run folders if every one is finished (:func:`unfinished`; finalized again), else None."""
        from kveval.evaluate import finalize_run, model_identity, run_dir_for

        identity = model_identity(cell.model)
        dirs = [run_dir_for(self.out, identity, spec.for_model(cell.model)) for spec in cell.specs]
        if any(unfinished(self.config, spec, run_dir, items) for spec, run_dir in zip(cell.specs, dirs)):
            return None
        for run_dir in dirs:
            finalize_run(run_dir)
        return dirs

    def _fidelity(self, model, tokenizer, cell: Cell, items: list, dirs: list[Path]) -> None:
        """``fidelity.jsonl`` for the cell's compressed policies, against the baseline in the cell's mode (resumable)."""
        from kveval.fidelity import record_fidelity
        from kveval.runspec import RunSpec

        candidates = [(spec, d) for spec, d in zip(cell.specs, dirs) if not spec.policy.is_none]
        if candidates:
            baseline = RunSpec.parse("none", cell.mode, self.config.kv_dtype)
            record_fidelity(model, tokenizer, items, baseline, candidates, batch_size=self.config.batch_size,
                            seed=self.config.seed)

    def __call__(self, cell: Cell) -> CellResult:
        import torch
        from tqdm import tqdm

        from kveval.evaluate import evaluate_policies
        from kveval.executors import CellResult
        from kveval.models import load_tokenizer

        config = self.config
        items = sweep_items(config, load_tokenizer(cell.model) if self._loaded is None else self._loaded[2])
        finished = self._finished(cell, items)
        if finished is not None:  # a resumed sweep loads no weights for the cells that are done
            return CellResult([str(d) for d in finished])
        model, tokenizer = self._model(cell.model)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with tqdm(total=len(items) * len(cell.specs), desc=f"{Path(cell.model).name}: {cell.specs[0].spec}"
                  + (f" +{len(cell.specs) - 1}" if len(cell.specs) > 1 else ""), unit="item", disable=self.quiet) as bar:
            dirs = evaluate_policies(model, tokenizer, items, list(cell.specs), self.out, cell.model, cell.mode,
                                     config.batch_size, config.seed, bar, extra={"sweep": config.name, "config_hash": config.hash})
        if config.fidelity:
            self._fidelity(model, tokenizer, cell, items, dirs)
        if config.lm_eval:
            run_lm_eval_tasks(model, tokenizer, list(cell.specs), dirs, config.lm_eval, config.batch_size, config.seed)
        return CellResult([str(d) for d in dirs], torch.cuda.max_memory_allocated() if cuda else None)


def sweep_items(config: SweepConfig, tokenizer) -> list:
    """The sweep's probe items for one model's tokenizer: every family at every length, in the config's order."""
    from kveval.probes.sets import ProbeSet

    return ProbeSet(tokenizer=str(getattr(tokenizer, "kveval_name", "") or ""), families=config.families,
                    lengths=config.lengths, n=config.n, depths=config.depths, seed=config.seed,
                    params=config.family_params).items(tokenizer)


def unfinished(config: SweepConfig, spec: "RunSpec", run_dir: Path, items: list) -> str | None:
    """Why ``run_dir`` (``spec``'s run of the sweep) is not finished, or ``None`` where it holds every item (on its
    prompt), every lm-eval task and, under ``fidelity``, every item's fidelity. Another prompt under an item's id
    is not finished either: :func:`~kveval.evaluate.evaluate_policies` then refuses the folder, naming it."""
    from kveval.errors import ResultFileError
    from kveval.fidelity import read_fidelity
    from kveval.records import iter_items

    try:
        records = list(iter_items(run_dir))
    except (ResultFileError, OSError) as exc:  # missing, or a killed writer's half line
        return f"not readable ({exc})" if isinstance(exc, ResultFileError) else "not run yet"
    written = {r.id: r.hash for r in records}
    done = sum(written.get(item.id) == item.hash for item in items)
    if done < len(items):
        return f"holds {done} of {len(items)} items"
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
    from kveval.evaluate import model_identity, run_dir_for

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

    ``executor``: where the cells (:func:`plan_cells`) run (:mod:`kveval.executors`;
    default this process, one cell after another). The caller holds the sweep
    lock (:func:`sweep_lock`); cells only append items to their own run folders.
    Results do not depend on the executor or on ``policies_per_cell``.
    """
    from kveval.executors import InProcessExecutor
    from kveval.models import resolve_device_dtype

    for model_name in config.models:  # every spec against every model's config.json, before any weights load
        for spec in config.policies:
            spec.for_model(model_name)
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
    answered from a :class:`~kveval.lm_eval.model.ResponseStore` (identical
    samples and measured bytes). A task's samples are written only once lm-eval
    has finished it for that policy, so a sweep killed between two policies
    reruns only the policies not written, and never records half a task.
    """
    import lm_eval

    from kveval.compare import records_from_samples
    from kveval.lm_eval import register, tasks_dir
    from kveval.lm_eval.model import ResponseStore
    from kveval.records import ItemWriter, iter_items

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
                                             torch_random_seed=seed)
            with ItemWriter(run_dirs[i]) as writer:
                for subtask, rows in sorted(output["samples"].items()):
                    for record in records_from_samples(rows, subtask, None, f"lm-eval samples of {subtask}"):
                        record.metrics["lm_eval_task"] = task
                        writer.write(record)


def summarize(out: Path, run_dirs: list[Path], gate_config: str | None, deploy: dict | None = None) -> int:
    """Compare, gate and report a finished sweep; print leaderboard and verdict; return the gate's exit code.

    ``deploy``: ``gpu_memory``, ``context``, ``batch`` (and ``headroom``, ``weights``) for the deployment decision.
    """
    from kveval.deployment import deployment_decision
    from kveval.gate import evaluate_sweep, exit_code, overall_status
    from kveval.gate_report import write_gate_outputs
    from kveval.report import build_report

    results = evaluate_sweep(gate_config, run_dirs)
    if deploy:
        deployment_decision(results, **deploy)
    write_gate_outputs(results, out / "gate")
    build_report(run_dirs, out / "report", gate_result=out / "gate" / "gate.json")
    print()
    print((out / "report" / "leaderboard.md").read_text())
    print((out / "gate" / "gate.md").read_text())
    code = exit_code(results)
    print(f"gate verdict: {overall_status(results)}  |  leaderboard: {out / 'report' / 'leaderboard.html'}")
    return code


def configure(parser) -> None:
    from kveval.deployment import add_deployment_arguments
    from kveval.models import add_placement_arguments

    parser.add_argument("config", help="sweep YAML, e.g. configs/quickstart.yaml")
    parser.add_argument("--out", help="run folder (default: the config's `out`, else runs/<name>)")
    parser.add_argument("--strict", action="store_true", help="exit with the gate's code: 1 FAIL, 3 INCONCLUSIVE (for CI)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_deployment_arguments(parser)
    parser.add_argument("--executor", choices=["inprocess", "ray"], default="inprocess",
                        help="where cells (model x policy group) run: this process (default) or Ray tasks, one GPU "
                             "(else one CPU) each; needs pip install 'kveval[ray]'")
    parser.add_argument("--address", help="Ray cluster to join (e.g. auto, ray://head:10001); default: start one locally")
    parser.add_argument("--workers", type=int, help="CPUs of the local Ray cluster (default: all); ignored with --address")
    parser.add_argument("--policies-per-cell", type=int,
                        help="policies one cell evaluates, sharing its prefill (default: all of a model's policies "
                             "in process, 1 with --executor ray)")
    parser.add_argument("--skip-self-check", action="store_true",
                        help="load models that kveval's load-time exactness check refuses (only if you know why)")
    add_placement_arguments(parser)


def run(args) -> int:
    import sys

    config = load_config(args.config)
    for warning in config.warnings:
        print(f"kveval sweep: warning: {warning}", file=sys.stderr)
    from kveval.deployment import deployment_of

    deploy = deployment_of(args)  # asked before the sweep runs, not refused after it
    from kveval.executors import make_executor
    from kveval.models import placement_from_args

    load_options = placement_from_args(args) | ({"self_check": False} if args.skip_self_check else {})
    executor = make_executor(args.executor, args.address, args.workers,
                             progress=None if args.quiet else lambda cell: print(f"kveval sweep: done {cell.label}", file=sys.stderr))
    out = Path(args.out or config.out or Path("runs") / config.name)
    with sweep_lock(out):
        run_dirs = run_sweep(config, out, quiet=args.quiet or args.executor != "inprocess", executor=executor,
                             load_options=load_options,
                             policies_per_cell=args.policies_per_cell or (1 if args.executor == "ray" else None))
        code = summarize(out, run_dirs, config.gate, deploy)
    return code if args.strict else (2 if code == 2 else 0)
