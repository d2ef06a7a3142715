"""kveval's layers, stated as tiers, and the rules between them.

Two halves stand side by side on shared tiers:

- the **engine** runs models: tensors, model adapters, calibration, token stores, policies, the compressed cache, the
  memory planner and the runner;
- the **analysis** reads what runs left: run folders, paired statistics, the gate and the report.

The rule: the analysis half never imports the engine half, so ``kveval gate``, ``compare``, ``report`` and
``rescore --dry-run`` read results without loading torch (checked in a subprocess below). Units that join the halves
(the deployment decision, lm-eval, sweeps, the command line) stand above both.

Within that, every import between kveval's units points down :data:`LAYERS`, and no import cycle exists among its
modules. Imports inside functions count too: they hide a cycle from Python's import machinery, but not from a
reader.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kveval

PACKAGE = Path(kveval.__file__).parent
ROOT = PACKAGE.parent


def _imports() -> dict[str, set[str]]:
    """Each kveval module and the kveval modules it imports anywhere in its text (a submodule's own package aside:
    importing ``kveval.runs.lm_eval_schema`` runs ``kveval.lm_eval`` first whatever one writes)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a path back to its start), or ``None``."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


#: The tiers, lowest first, each with its units, lowest first too.
TIERS = (
    # imports nothing of kveval
    ("foundation", ("kveval", "kveval.errors", "kveval.values", "kveval.paths", "kveval.lazy")),
    # read what a user writes (YAML files, a cache dtype's name) and raise kveval.errors' errors; no torch on import
    ("readers", ("kveval.yaml_files", "kveval.dtypes")),
    # what both halves exchange, torch-free. probes: the items a run is built from and the scorer of its answers
    # (the runner runs them, the report and rescoring read them); they are handed a tokenizer, never load one.
    # runs: the run-folder format, the analysis half's base, ranked below the engine because the runner writes it.
    ("records", ("kveval.probes", "kveval.runs")),
    # the engine half. modeling: adapters onto Hugging Face model classes and where models come from (torch);
    # calibration: statistics a policy gathers by running the model (torch); planner: a policy's cache bytes for a
    # model, read off the engine's policy objects (and, today, the cache's checks), so it sits with what it plans.
    ("engine", ("kveval.tensors", "kveval.modeling", "kveval.calibration", "kveval.stores", "kveval.policies",
                "kveval.cache", "kveval.planner", "kveval.runner")),
    # the analysis half (with kveval.runs below): paired statistics, the gate's verdicts, the report
    ("analysis", ("kveval.stats", "kveval.gate", "kveval.report")),
    # what joins the halves: the deployment decision (the gate's verdicts and the planner's bytes), lm-eval's model
    # type, sweeps (run, then analyse), the Python API and the command line
    ("above both", ("kveval.deployment", "kveval.lm_eval", "kveval.sweep", "kveval.api", "kveval.commands",
                    "kveval.__main__")),
)
#: Every unit, lowest first: a module may import its own unit and those below it.
LAYERS = tuple((unit,) for _, units in TIERS for unit in units)
ENGINE = dict(TIERS)["engine"]
ANALYSIS = ("kveval.runs",) + dict(TIERS)["analysis"]


def unit_of(module: str) -> str:
    """The package (or foundation module) ``module`` belongs to: ``kveval.cache.layers`` -> ``kveval.cache``."""
    parts = module.split(".")
    return ".".join(parts[:2])


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import in ``graph`` from a lower layer to a higher one, as ``importer -> imported`` lines."""
    rank = {unit: i for i, units in enumerate(layers) for unit in units}
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            if rank[unit_of(target)] > rank[unit_of(module)]:
                found.append(f"{module} -> {target}")
    return found


def crossing_imports(graph: dict[str, set[str]], source=ANALYSIS, forbidden=ENGINE) -> list[str]:
    """Every import in ``graph`` from a unit of ``source`` into one of ``forbidden``, as ``importer -> imported``."""
    return [f"{module} -> {target}" for module, imported in sorted(graph.items()) if unit_of(module) in source
            for target in sorted(imported) if unit_of(target) in forbidden]


def test_every_module_belongs_to_a_layer():
    ranked = {unit for units in LAYERS for unit in units}
    assert {unit_of(m) for m in _imports()} <= ranked
    assert len(ranked) == sum(len(units) for _, units in TIERS)  # no unit in two tiers


def test_imports_between_packages_point_down():
    assert upward_imports(_imports()) == []


def test_the_analysis_half_imports_nothing_of_the_engine():
    # Direct imports suffice: what the analysis half may import (its own units, records, readers, the foundation)
    # ranks below the engine, so by test_imports_between_packages_point_down it imports none of it either.
    assert crossing_imports(_imports()) == []
    assert "kveval.runs" in dict(TIERS)["records"]  # the one analysis unit not in the analysis tier ranks below the engine


def test_an_upward_import_is_caught():
    graph = _imports()
    graph["kveval.tensors.ranking"] = graph["kveval.tensors.ranking"] | {"kveval.policies.base"}
    assert upward_imports(graph) == ["kveval.tensors.ranking -> kveval.policies.base"]


def test_an_import_across_the_halves_is_caught():
    graph = _imports()
    graph["kveval.gate.rules"] = graph["kveval.gate.rules"] | {"kveval.planner.memory"}
    assert crossing_imports(graph) == ["kveval.gate.rules -> kveval.planner.memory"]
    # The ranks alone let it through (the analysis tier ranks above the engine's): the halves' rule is what refuses it.
    assert "kveval.gate.rules -> kveval.planner.memory" not in upward_imports(graph)


def test_the_foundation_imports_nothing_of_kveval():
    graph = _imports()
    assert {m: graph[m] for m in TIERS[0][1] if graph[m]} == {}


def test_no_import_cycle_among_kveval_modules():
    cycle = _cycle(_imports())
    assert cycle is None, " -> ".join(cycle)


def test_the_scan_sees_imports_inside_functions():
    graph = _imports()
    assert "kveval.lm_eval.__main__" in graph["kveval.commands.main"]  # imported inside main(): the scan must see it
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# --- the analysis commands load no torch ----------------------------------------------------------------------

_RUNS = "results/quickstart/runs/smollm2-135m"
_TORCH_FREE_COMMANDS = [
    pytest.param(["compare", f"{_RUNS}/none", f"{_RUNS}/random_ratio-0.5"], 0, id="compare"),
    pytest.param(["gate", "--config", "configs/gate-cpu.yaml", "--baseline", f"{_RUNS}/none", "--candidate",
                  f"{_RUNS}/quant_bits-8_group-16", "--candidate", f"{_RUNS}/random_ratio-0.5", "--out", "{tmp}/gate"],
                 1, id="gate"),
    pytest.param(["report", "results/quickstart", "--out", "{tmp}/report"], 0, id="report"),
    pytest.param(["rescore", "configs/quickstart.yaml", "--out", "results/quickstart", "--dry-run"], 0,
                 id="rescore-dry-run"),
    pytest.param(["memory", "llama-3.1-8b", "--context", "32768", "--batch", "8", "--policy",
                  "snapkv(ratio=0.5)+kivi(bits=4)"], 0, id="memory"),
    pytest.param(["memory", "deepseek-v4-flash", "--context", "128k", "--policy", "knorm(ratio=0.5)+fp8"], 0,
                 id="memory-deepseek"),
]
_PROBE = """import json, sys
from kveval.commands.main import main
code = main(json.loads(sys.argv[1]))
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


@pytest.mark.parametrize("argv,code", _TORCH_FREE_COMMANDS)
def test_the_analysis_commands_load_no_torch(tmp_path, argv, code):
    argv = [a.format(tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.stderr.strip(), done.stdout
    outcome = json.loads(done.stderr.strip().splitlines()[-1])
    assert outcome == {"code": code, "torch": False}, done.stderr[-2000:]
