"""The gate's rules, parsed once at the edge into a :class:`GateConfig`, and the gate configs kveval ships.

A gate config is a YAML file, given by path or by the name of one that ships as package data
(``kveval/gate/configs/<name>.yaml``, so a pip install has them; ``configs/gate.yaml`` and ``configs/gate-cpu.yaml``
in a checkout link to them): ``default`` (the default rules, margin 0.05, every rule commented) and ``cpu`` (the same
rules at a 10-point margin, what the CPU-sized sweeps can resolve). ``--gate cpu`` and a sweep's ``gate: cpu`` name
one; a value with a path separator or a ``.yaml``/``.yml`` suffix is a path.

Every problem is a :class:`~kveval.errors.ConfigError` naming the file and the
key, raised before anything is loaded or evaluated (``kveval sweep`` checks
the gate file before it loads a model).
"""

from __future__ import annotations

import os
import copy
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from kveval.errors import ConfigError, UsageError
from kveval.stats.boundaries import SpendingFunction, parse_spending
from kveval.stats.comparison import CATEGORIES, MIN_RESAMPLES, OVERALL
from kveval.stats.sequential import SequentialDesign
from kveval.values import is_real, is_whole
from kveval.yaml_files import load_yaml

#: Where the gate configs kveval ships live (package data): ``<name>.yaml``.
SHIPPED_DIR = Path(__file__).resolve().parent / "configs"
#: The shipped gate ``kveval gate`` applies when given none.
DEFAULT_GATE = "default"
DEFAULT_CONFIG_PATH = SHIPPED_DIR / f"{DEFAULT_GATE}.yaml"
_KEYS = {
    "tasks",
    "alpha",
    "family",
    "margin",
    "inconclusive_blocks",
    "max_negative_flip_rate",
    "max_confusion_increase",
    "max_mean_kl",
    "power",
    "confidence_level",
    "n_resamples",
    "seed",
    "sequential",
}
_RENAMED = {"require_non_inferiority": "inconclusive_blocks (a task that cannot show non-inferiority is INCONCLUSIVE, not FAIL)"}

#: The default looks: four equal blocks of each task's items (docs/statistics.md, "Group-sequential verdicts": the
#: last boundary 1.720 against the fixed-n 1.645 keeps a full run's verdicts and costs about 3% more items for the
#: same power, while a candidate that loses most of its answers stops after a quarter of them).
DEFAULT_LOOKS = (0.25, 0.5, 0.75, 1.0)
#: The default spending, both decisions: O'Brien-Fleming-type spends almost nothing early (a stop at the first look
#: needs |z| near 4), so an early verdict is only ever an obvious one and the last look is nearly the fixed-n test.
DEFAULT_SPENDING = "obrien-fleming"
_SEQUENTIAL_KEYS = {"looks", "max_items", "spending", "pass_spending", "fail_spending"}


@dataclass(frozen=True)
class SequentialSettings:
    """A gate config's ``sequential:`` section, parsed once: the looks and spending of a group-sequential gate.

    Attributes
    ----------
    looks : tuple of float, or tuple of int
        ``fractions`` true: information fractions of each task's maximum items (increasing, in (0, 1], the last
        1); else item counts per task, the last the maximum (every task must hold exactly that many).
    fractions : bool
        Whether ``looks`` are fractions (the default, four equal ones) or item counts.
    pass_spending, fail_spending : SpendingFunction
        How the PASS error rate (``alpha``) and the FAIL error rate (``alpha`` split over the Holm family,
        Bonferroni: one test per task at each look) are spent over the looks; default O'Brien-Fleming-type.
    """

    looks: tuple = DEFAULT_LOOKS
    fractions: bool = True
    pass_spending: SpendingFunction = field(default_factory=lambda: parse_spending(DEFAULT_SPENDING))
    fail_spending: SpendingFunction = field(default_factory=lambda: parse_spending(DEFAULT_SPENDING))

    @classmethod
    def from_mapping(cls, data: Any, source: str = "gate config") -> "SequentialSettings":
        """Parse ``sequential:`` (``true``: the defaults; a mapping of ``looks``, ``max_items``, ``spending`` or
        ``pass_spending``/``fail_spending``); every problem is one :class:`ConfigError` line naming ``source``."""
        where = f"{source}: sequential"
        if data is True:
            return cls()
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: give true (four equal looks, O'Brien-Fleming spending) or a mapping of "
                              f"{', '.join(sorted(_SEQUENTIAL_KEYS))}, got {data!r}")
        unknown = sorted(str(k) for k in set(data) - _SEQUENTIAL_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_SEQUENTIAL_KEYS))})")
        looks = data.get("looks", DEFAULT_LOOKS)
        max_items = data.get("max_items")
        if isinstance(looks, (list, tuple)) and looks and all(is_real(x) and not isinstance(x, bool) for x in looks):
            if any(not 0 < x <= 1 for x in looks) and not all(is_whole(x) for x in looks):
                raise ConfigError(f"{where}.looks: fractions must lie in (0, 1] (or give whole item counts), got "
                                  f"{list(looks)!r}")
        # as fractions, unless every look is a whole count and a count (above 1, or max_items) says so
        fractions = not (isinstance(looks, (list, tuple)) and looks and all(is_whole(x) for x in looks)
                         and (max_items is not None or any(x > 1 for x in looks)))
        if max_items is not None and fractions:
            raise ConfigError(f"{where}: max_items goes with looks given as item counts; with fractions the maximum "
                              f"is each task's items")
        if max_items is not None and (not is_whole(max_items) or max_items < 1):
            raise ConfigError(f"{where}.max_items must be a whole number of items >= 1, got {max_items!r}")
        try:
            probe = {"looks": list(looks) if isinstance(looks, (list, tuple)) else looks,
                     **{k: data[k] for k in ("spending", "pass_spending", "fail_spending") if k in data}}
            probe["max_items"] = 10_000 if fractions else max_items
            if probe["max_items"] is None:
                probe.pop("max_items")
            design = SequentialDesign.from_mapping(probe, where)
        except UsageError as exc:  # a ConfigError too: already names where
            raise ConfigError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from None
        return cls(tuple(float(x) for x in looks) if fractions else design.looks, fractions, design.pass_spending,
                   design.fail_spending)

    def design_of(self, looks: tuple[int, ...], alpha_pass: float, alpha_fail: float) -> SequentialDesign:
        """The design testing one task at ``looks`` (item counts, strictly increasing), at these error rates."""
        return SequentialDesign(looks, alpha_pass=alpha_pass, alpha_fail=alpha_fail, pass_spending=self.pass_spending,
                                fail_spending=self.fail_spending)

    def to_dict(self) -> dict[str, Any]:
        """The section as written (what :meth:`from_mapping` reads back)."""
        return {"looks": list(self.looks), "pass_spending": self.pass_spending.name,
                "fail_spending": self.fail_spending.name}


@dataclass
class GateConfig:
    """Rules of the gate (the YAML file, validated).

    Attributes
    ----------
    tasks : "all" or list of str
        Tasks to gate.
    alpha : float
        One-sided error rate of every bound and test: a PASS claims
        non-inferiority at ``1 - alpha``; a FAIL claims a loss beyond the margin
        (Holm-adjusted over the family) or a rule broken at ``1 - alpha``.
    family : {"candidate", "sweep"}
        Holm family of the FAIL tests: one candidate's gated tasks, or all
        candidates' together.
    margin : dict
        Non-inferiority margin (largest acceptable loss of accuracy or mean
        score) per task, ``"default"`` for the rest.
    inconclusive_blocks : bool
        An INCONCLUSIVE verdict exits 3 (blocks a pipeline); false: exit 0
        with a warning.
    max_negative_flip_rate : float or None
        Cap on the net right->wrong rate ``(regressed - improved) / n``.
    max_confusion_increase : dict
        Cap per memory-confusion category (``"overall"``, ``"default"``) on the
        share of items that were right at baseline and fell into that category.
    max_mean_kl : dict
        Optional cap per task (``"default"`` for the rest) on the mean per-item
        KL divergence, in nats, of the candidate's next-token distributions from
        the baseline's along the baseline's own answer (``kveval eval
        --fidelity``, :mod:`kveval.runner.fidelity`). Empty (the default): rule off.
    power : float
        Power an INCONCLUSIVE task's "items needed" is computed for.
    confidence_level, n_resamples, seed
        Reported two-sided intervals; bootstrap settings (mostly graded tasks, log-prob changes, the KL rule).
    sequential : SequentialSettings or None
        A group-sequential gate (:mod:`kveval.gate.sequential`): each candidate judged at planned looks on the
        first blocks of every task's items, stopped at its first PASS or FAIL. ``None`` (the default): fixed-n.
    """

    tasks: str | list[str] = "all"
    alpha: float = 0.05
    family: str = "candidate"
    margin: dict[str, float] = field(default_factory=lambda: {"default": 0.05})
    inconclusive_blocks: bool = True
    max_negative_flip_rate: float | None = 0.10
    max_confusion_increase: dict[str, float] = field(default_factory=lambda: {OVERALL: 0.10, "default": 0.10})
    max_mean_kl: dict[str, float] = field(default_factory=dict)
    power: float = 0.8
    confidence_level: float = 0.95
    n_resamples: int = 9999
    seed: int = 0
    sequential: SequentialSettings | None = None
    #: Where the rules came from (the YAML file), for messages; not a rule.
    source: str = field(default="gate config", compare=False, repr=False)

    def margin_for(self, task: str) -> float:
        return float(self.margin.get(task, self.margin.get("default", 0.05)))

    def kl_limit(self, task: str) -> float | None:
        """The ``max_mean_kl`` cap of ``task`` (nats), or ``None`` when the rule is off for it."""
        return self.max_mean_kl.get(task, self.max_mean_kl.get("default"))

    def check_tasks(self, known: Sequence[str]) -> None:
        """Refuse a per-task setting (``margin``, ``max_mean_kl``) naming none of the ``known`` tasks (those of the
        runs gated): a misspelt task would fall back to ``default`` without a word."""
        for setting, per_task in (("margin", self.margin), ("max_mean_kl", self.max_mean_kl)):
            unknown = [task for task in per_task if task != "default" and task not in known]
            if unknown:
                raise ConfigError(f"{self.source}: {setting}.{unknown[0]}: no task {unknown[0]!r} in the runs gated; "
                                  f"their tasks are {', '.join(known)} (or default, for the rest)")

    def confusion_limit(self, category: str) -> float | None:
        if category in self.max_confusion_increase:
            return self.max_confusion_increase[category]
        if category == OVERALL:
            return None
        return self.max_confusion_increase.get("default")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "gate config") -> "GateConfig":
        data = dict(data or {})
        for old, new in _RENAMED.items():
            if old in data:
                raise ConfigError(f"{source}: {old} was replaced by {new}")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
        cfg = cls(source=source)
        if "tasks" in data:
            t = data["tasks"]
            if t == "all" or t is None:
                cfg.tasks = "all"
            elif isinstance(t, str):
                cfg.tasks = [t]
            elif isinstance(t, list) and t and all(isinstance(x, str) for x in t):
                twice = sorted({x for x in t if t.count(x) > 1})
                if twice:
                    raise ConfigError(f"{source}: tasks lists {', '.join(twice)} twice; list each task once")
                cfg.tasks = list(t)
            else:
                raise ConfigError(f"{source}: tasks must be 'all' or a non-empty list of task names, got {t!r}")
        if "alpha" in data:
            cfg.alpha = _prob(data["alpha"], "alpha", source, open_interval=True)
            if cfg.alpha >= 0.5:
                raise ConfigError(f"{source}: alpha is a one-sided error rate below 0.5, got {data['alpha']!r}")
        if "family" in data:
            if data["family"] not in ("candidate", "sweep"):
                raise ConfigError(f"{source}: family must be 'candidate' or 'sweep', got {data['family']!r}")
            cfg.family = data["family"]
        if "margin" in data:
            m = data["margin"]
            if isinstance(m, dict):
                cfg.margin = {str(k): _margin(v, f"margin.{k}", source) for k, v in m.items()}
                cfg.margin.setdefault("default", 0.05)
            else:
                cfg.margin = {"default": _margin(m, "margin", source)}
        if "inconclusive_blocks" in data:
            if not isinstance(data["inconclusive_blocks"], bool):
                raise ConfigError(f"{source}: inconclusive_blocks must be true or false")
            cfg.inconclusive_blocks = data["inconclusive_blocks"]
        if "max_negative_flip_rate" in data:
            v = data["max_negative_flip_rate"]
            cfg.max_negative_flip_rate = None if v is None else _prob(v, "max_negative_flip_rate", source)
        if "max_confusion_increase" in data:
            v = data["max_confusion_increase"]
            if v is None:
                cfg.max_confusion_increase = {}
            elif isinstance(v, dict):
                allowed = {*CATEGORIES, OVERALL, "default"} - {"correct"}
                bad = sorted(str(k) for k in v if k not in allowed)
                if bad:
                    raise ConfigError(
                        f"{source}: max_confusion_increase: unknown category {', '.join(bad)} (use {', '.join(sorted(allowed))})"
                    )
                cfg.max_confusion_increase = {str(k): _prob(x, f"max_confusion_increase.{k}", source) for k, x in v.items() if x is not None}
            else:
                x = _prob(v, "max_confusion_increase", source)
                cfg.max_confusion_increase = {OVERALL: x, "default": x}
        if "max_mean_kl" in data:
            v = data["max_mean_kl"]
            if v is None:
                cfg.max_mean_kl = {}
            elif isinstance(v, dict):
                cfg.max_mean_kl = {str(k): _positive(x, f"max_mean_kl.{k}", source) for k, x in v.items() if x is not None}
            else:
                cfg.max_mean_kl = {"default": _positive(v, "max_mean_kl", source)}
        if "power" in data:
            cfg.power = _prob(data["power"], "power", source, open_interval=True)
        if "confidence_level" in data:
            cfg.confidence_level = _prob(data["confidence_level"], "confidence_level", source, open_interval=True)
        if "n_resamples" in data:
            if not is_whole(data["n_resamples"]) or data["n_resamples"] < MIN_RESAMPLES:
                raise ConfigError(f"{source}: n_resamples must be an integer >= {MIN_RESAMPLES}")
            cfg.n_resamples = data["n_resamples"]
        if "seed" in data:
            if not is_whole(data["seed"]):
                raise ConfigError(f"{source}: seed must be an integer")
            cfg.seed = data["seed"]
        if data.get("sequential") not in (None, False):
            cfg.sequential = SequentialSettings.from_mapping(data["sequential"], source)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The rules as a mapping :meth:`from_dict` reads back (``sequential`` only where set: a fixed-n gate's
        record is unchanged)."""
        out = {k: getattr(self, k) for k in (f.name for f in fields(self)) if k not in ("source", "sequential")}
        out = copy.deepcopy(out)
        if self.sequential is not None:
            out["sequential"] = self.sequential.to_dict()
        return out


def _num(v: Any, name: str, source: str) -> float:
    if not is_real(v):
        raise ConfigError(f"{source}: {name} must be a number, got {v!r}")
    return float(v)


def _margin(v: Any, name: str, source: str) -> float:
    x = _num(v, name, source)
    if not 0 < x < 1:
        raise ConfigError(f"{source}: {name} must be in (0, 1) (a loss of accuracy or mean score), got {v!r}")
    return x


def _positive(v: Any, name: str, source: str) -> float:
    x = _num(v, name, source)
    if x <= 0:
        raise ConfigError(f"{source}: {name} must be a positive number of nats (mean per-token KL), got {v!r}")
    return x


def _prob(v: Any, name: str, source: str, open_interval: bool = False) -> float:
    x = _num(v, name, source)
    if open_interval and not 0 < x < 1 or not 0 <= x <= 1:
        raise ConfigError(f"{source}: {name} must be in {'(0, 1)' if open_interval else '[0, 1]'}, got {v!r}")
    return x


def shipped_gate_configs() -> dict[str, Path]:
    """The gate configs kveval ships, by name (``default``, ``cpu``): their files in the package."""
    return {path.stem: path for path in sorted(SHIPPED_DIR.glob("*.yaml"))}


def is_gate_name(value: str) -> bool:
    """Whether ``value`` names a shipped gate config rather than a file: no path separator, no YAML suffix."""
    return "/" not in value and os.sep not in value and Path(value).suffix.lower() not in (".yaml", ".yml")


def gate_config_path(value: str | os.PathLike, relative_to: str | os.PathLike | None = None) -> Path:
    """The file of the gate config ``value`` names: a shipped one by name (:func:`is_gate_name`), else a path,
    relative to ``relative_to`` (a sweep config's folder) where given, else to the working directory.

    An unknown name is one :class:`~kveval.errors.ConfigError` line listing the shipped names."""
    if isinstance(value, str) and is_gate_name(value):
        shipped = shipped_gate_configs()
        if value not in shipped:
            hint = f" (for the file {value!r} write ./{value})" if Path(value).is_file() else ""
            raise ConfigError(f"no gate config named {value!r}: kveval ships {', '.join(shipped)}; or give the path "
                              f"of a gate YAML{hint}")
        return shipped[value]
    path = Path(value)
    return path if relative_to is None or path.is_absolute() else Path(relative_to) / path


def load_gate_config(config: str | os.PathLike | dict | GateConfig | None = None,
                     relative_to: str | os.PathLike | None = None) -> GateConfig:
    """A :class:`GateConfig` from a shipped gate's name (``"default"``, ``"cpu"``), a YAML path (relative to
    ``relative_to`` where given), a dict, a config, or ``None`` (built-in defaults, the rules of ``default``)."""
    if config is None:
        return GateConfig()
    if isinstance(config, GateConfig):
        return config
    if isinstance(config, dict):
        return GateConfig.from_dict(config)
    path = gate_config_path(config, relative_to)
    if not path.is_file():
        raise ConfigError(f"{path}: no such gate config; give the path of a gate YAML, or the name of one kveval "
                          f"ships ({', '.join(shipped_gate_configs())})")
    data = load_yaml(path, "gate config")
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: a gate config is a mapping of settings")
    return GateConfig.from_dict(data, source=str(path))
