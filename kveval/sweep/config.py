"""Sweep configs (``configs/*.yaml``), validated once at the edge into a :class:`SweepConfig`."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kveval.dtypes import dtype_name, parse_kv_dtype
from kveval.errors import ConfigError
from kveval.gate.config import GateConfig, SequentialSettings, load_gate_config
from kveval.probes import FAMILIES
from kveval.runner.runspec import RunSpec
from kveval.values import is_real, is_whole
from kveval.yaml_files import load_yaml

if TYPE_CHECKING:
    import torch


CONFIG_KEYS = {"name", "models", "policies", "mode", "kv_dtype", "probes", "batch_size", "gate", "out", "seed", "lm_eval",
               "fidelity", "noise_floor", "sequential", "rank"}
PROBE_KEYS = {"families", "lengths", "depths", "n", "seed", "params"}
LM_EVAL_KEYS = {"tasks", "limit", "model_args", "metadata"}
#: Config keys that name where things go or how they are judged, not what is computed: outside the config hash.
#: ``noise_floor`` adds a run beside the others and changes none of them: asking for it resumes a finished sweep.
#: ``sequential`` changes how many items a run holds, and an item's answer only as another batch arrangement does (a
#: near-tie rounded another way, within the noise floor): a fixed-n sweep resumed sequentially replays its looks on
#: the items it holds, a sequential one resumed fixed-n runs the rest of the items.
#: ``rank`` only adds the report's ranking of candidates against each other (:mod:`kveval.report.ranking`).
RESULT_NEUTRAL_KEYS = {"gate", "out", "noise_floor", "sequential", "rank"}

@dataclass
class SweepConfig:
    """A sweep, as read from YAML. ``gate:`` names a gate config kveval ships (``cpu``, ``default``: a copied config
    finds it wherever it lies) or is a path relative to the YAML file's folder; ``out:`` and ``--out`` are relative to
    the working directory, where a run's outputs go."""

    name: str
    models: list[str]
    policies: list["RunSpec"]  # parsed once here; the baseline none is added per mode by run_sweep
    mode: str = "context"
    kv_dtype: "torch.dtype | None" = None  # None: the model's deployment dtype
    families: list[str] = field(default_factory=lambda: ["passkey"])
    lengths: list[int] = field(default_factory=lambda: [512])
    depths: list[float] | None = None
    n: int = 10
    seed: int = 0
    family_params: dict = field(default_factory=dict)
    batch_size: int = 1
    gate: "GateConfig | None" = None  # parsed once, here; None: the built-in defaults
    out: str | None = None
    lm_eval: dict = field(default_factory=dict)
    #: Teacher-force the baseline's answers through every compressed policy (:mod:`kveval.runner.fidelity`), as ``kveval eval --fidelity``.
    fidelity: bool = False
    #: Run each model's baseline a second time in another batch arrangement (:mod:`kveval.sweep.run`), for the gate's
    #: noise floor: the flips no compression causes.
    noise_floor: bool = False
    #: Rank each model's candidates against each other in the report (``report/ranking.md``).
    rank: bool = False
    raw: dict = field(default_factory=dict)
    path: Path | None = None  # the file it was read from (the sweep's manifest records it)
    warnings: list[str] = field(default_factory=list)

    @property
    def sequential(self) -> SequentialSettings | None:
        """The group-sequential design the sweep runs its items by (its gate's, after the sweep's ``sequential:``
        key), or ``None``: every candidate runs every item."""
        return self.gate.sequential if self.gate is not None else None

    @property
    def hash(self) -> str:
        """Hash of what changes results: the config less :data:`RESULT_NEUTRAL_KEYS` (fixing a gate path resumes)."""
        kept = {k: v for k, v in self.raw.items() if k not in RESULT_NEUTRAL_KEYS}
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def load_config(path: str | Path) -> SweepConfig:
    """Read and validate a sweep YAML; every problem is one :class:`~kveval.errors.ConfigError` line."""

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such sweep config; see configs/quickstart.yaml for an example")
    raw = load_yaml(path, "sweep config") or {}
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
    entries = _list(path, "policies", raw.get("policies"))
    _refuse_split_specs(path, entries)
    try:
        kv_dtype = parse_kv_dtype(raw.get("kv_dtype"))
        parsed = [(str(entry), RunSpec.parse(str(entry), default_mode=mode, kv_dtype=kv_dtype)) for entry in entries]
    except ValueError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    policies, warnings, first_entry = [], [], {}
    for entry, spec in parsed:
        if spec.kv_dtype != kv_dtype:  # the one baseline runs at the sweep's dtype: this run could not be gated
            asked = spec.kv_dtype_name
            raise ConfigError(f"{path}: policy {entry!r} asks for kv_dtype {asked} but the sweep's baseline runs at "
                              f"{dtype_name(kv_dtype) if kv_dtype is not None else 'the model default'}, and runs of two "
                              f"cache dtypes are not paired; set the sweep's kv_dtype: {asked}, or give that policy a "
                              f"sweep of its own")
    for entry, spec in parsed:  # same canonical spec and mode: one run, merged with a warning
        if spec.key in first_entry:
            warnings.append(f"{path}: policy {entry!r} is the same run as {first_entry[spec.key]!r}; merged into one")
            continue
        first_entry[spec.key] = entry
        policies.append(spec)
    if not any(not spec.policy.is_none for spec in policies):
        raise ConfigError(f"{path}: list at least one policy to compare under 'policies' (the baseline 'none' is "
                          f"added for you, and compared with nothing it decides nothing)")
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
    noise_floor = raw.get("noise_floor", False)
    if not isinstance(noise_floor, bool):
        raise ConfigError(f"{path}: noise_floor={noise_floor!r}; use true (run each baseline again in another batch "
                          f"arrangement, for the gate's noise floor) or false")
    rank = raw.get("rank", False)
    if not isinstance(rank, bool):
        raise ConfigError(f"{path}: rank={rank!r}; use true (rank the candidates against each other in the report) "
                          f"or false")
    fidelity = raw.get("fidelity", False)
    if not isinstance(fidelity, bool):
        raise ConfigError(f"{path}: fidelity={fidelity!r}; use true (teacher-forced KL against the baseline) or false")
    gate = raw.get("gate")
    if gate is not None:
        gate = _string(path, "gate", gate)

        gate = load_gate_config(gate, relative_to=path.parent)  # a bad gate file is reported now, before any model loads
        if not lm_eval:  # the runs' tasks are the probe families: a misspelt per-task key is known now too
            gate.check_tasks(families)
    gate = _sequential(path, raw, gate)
    if gate is not None and gate.sequential is not None and (lm_eval or fidelity):
        raise ConfigError(f"{path}: a sequential sweep runs its probe items in blocks and stops candidates early; "
                          f"{'lm_eval tasks run whole' if lm_eval else 'fidelity is measured on every item'}: set "
                          f"sequential: false for this sweep")
    depths = probes.get("depths")
    if depths is not None:
        depths = [_fraction(path, f"probes.depths[{i}]", d) for i, d in enumerate(_list(path, "probes.depths", depths))]
    seed_key, seed = ("probes.seed", probes["seed"]) if "seed" in probes else ("seed", raw.get("seed", 0))
    if "models" in raw and not raw["models"]:
        raise ConfigError(f"{path}: models: [] names no model; list one (e.g. [smollm2-135m]) or drop the key for "
                          f"the default")
    return SweepConfig(
        name=_name(path, raw.get("name", path.stem)),
        models=[_string(path, f"models[{i}]", m) for i, m in enumerate(_list(path, "models", raw.get("models")))]
        or ["smollm2-135m"],
        policies=[p for p in policies if not p.policy.is_none], mode=mode, kv_dtype=kv_dtype,
        families=[str(family) for family in families],
        lengths=[_count(path, f"probes.lengths[{i}]", x) for i, x in enumerate(_list(path, "probes.lengths", probes.get("lengths")))]
        or [512],
        depths=depths, n=_count(path, "probes.n", probes.get("n", 10)), seed=_whole(path, seed_key, seed),
        family_params=_mapping(path, "probes.params", probes.get("params")),
        batch_size=_count(path, "batch_size", raw.get("batch_size", 1)), gate=gate,
        out=None if raw.get("out") is None else _string(path, "out", raw["out"]), lm_eval=lm_eval, fidelity=fidelity, noise_floor=noise_floor,
        rank=rank, raw=raw, warnings=warnings, path=path,
    )


def with_gate(config: SweepConfig, gate: str) -> SweepConfig:
    """``config`` judged by the gate config ``gate`` instead of its own (``--gate``: a shipped name or a path relative
    to the working directory), checked as ``gate:`` is. The gate is outside the config hash: a finished sweep
    resumes and is judged again."""
    rules = _sequential(config.path or Path("sweep config"), config.raw, load_gate_config(gate))
    if not config.lm_eval:
        rules.check_tasks(config.families)
    return replace(config, gate=rules)


def _sequential(path: Path, raw: dict, gate: GateConfig | None) -> GateConfig | None:
    """The gate with the sweep's ``sequential:`` key applied: absent, the gate config's own design (or none);
    ``false``, fixed-n; ``true``, the gate config's design, or the default one (four equal looks, O'Brien-Fleming);
    a mapping, that design (:meth:`SequentialSettings.from_mapping`)."""
    if "sequential" not in raw or raw["sequential"] is None:
        return gate
    value = raw["sequential"]
    gate = gate if gate is not None else GateConfig()
    if value is False:
        return replace(gate, sequential=None)
    if value is True:
        return replace(gate, sequential=gate.sequential or SequentialSettings())
    return replace(gate, sequential=SequentialSettings.from_mapping(value, str(path)))


#: A sweep's name: it names its folder under ``runs/``, so one path component of plain characters.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _name(path: Path, value) -> str:
    """The sweep's ``name``, refused where it is not one plain folder name (``../escape`` would write outside
    ``runs/``)."""
    name = _string(path, "name", value)
    if not _NAME.match(name) or name in (".", ".."):
        raise ConfigError(f"{path}: name={name!r} names the sweep's folder under runs/: use letters, digits, '.', '_' "
                          f"and '-' (no '/' or leading '.'); give --out for a folder elsewhere")
    return name


def _refuse_split_specs(path: Path, entries: list) -> None:
    """A spec with parameters written unquoted in a flow list, ``[quant(bits=8,group=16)]``, reaches here as two
    entries, ``quant(bits=8`` and ``group=16)``: YAML splits a flow list at every comma. Name the spec and its
    quoted form, rather than the half the policy parser would refuse."""
    for i, entry in enumerate(entries):
        if isinstance(entry, str) and entry.count("(") > entry.count(")"):
            pieces = [entry]
            for later in entries[i + 1:]:
                pieces.append(str(later))
                if "".join(pieces).count("(") <= "".join(pieces).count(")"):
                    break
            spec = ",".join(piece.strip() for piece in pieces)
            raise ConfigError(f"{path}: policies: YAML split the spec {spec!r} at its comma(s) into "
                              f"{', '.join(repr(p) for p in pieces)}; quote it: policies: [\"{spec}\"] (or give it "
                              f"its own line: - {spec})")


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


