"""Layers run one way: every import between kveval's packages points down :data:`LAYERS`, and no import cycle
exists among its modules. Imports inside functions count too: they hide a cycle from Python's import machinery,
but not from a reader."""

import ast
from pathlib import Path

import kveval

PACKAGE = Path(kveval.__file__).parent


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


#: kveval's packages (and foundation modules), lowest first: a module may import its own package and those below it.
LAYERS = (
    ("kveval", "kveval.errors", "kveval.values", "kveval.paths"),  # foundation: no kveval imports
    ("kveval.yaml_files", "kveval.dtypes"),  # readers of user input that raise kveval.errors' errors
    ("kveval.tensors",),
    ("kveval.modeling",),
    ("kveval.runs",),
    ("kveval.probes",),
    ("kveval.calibration",),
    ("kveval.stores",),
    ("kveval.policies",),
    ("kveval.cache",),
    ("kveval.planner",),
    ("kveval.runner",),
    ("kveval.stats",),
    ("kveval.gate",),
    ("kveval.report",),
    ("kveval.lm_eval",),
    ("kveval.sweep",),
    ("kveval.commands",),
    ("kveval.__main__",),
)


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


def test_every_module_belongs_to_a_layer():
    ranked = {unit for units in LAYERS for unit in units}
    assert {unit_of(m) for m in _imports()} <= ranked


def test_imports_between_packages_point_down():
    assert upward_imports(_imports()) == []


def test_an_upward_import_is_caught():
    graph = _imports()
    graph["kveval.tensors.ranking"] = graph["kveval.tensors.ranking"] | {"kveval.policies.base"}
    assert upward_imports(graph) == ["kveval.tensors.ranking -> kveval.policies.base"]


def test_the_foundation_imports_nothing_of_kveval():
    graph = _imports()
    assert {m: graph[m] for m in LAYERS[0] if graph[m]} == {}


def test_no_import_cycle_among_kveval_modules():
    cycle = _cycle(_imports())
    assert cycle is None, " -> ".join(cycle)


def test_the_scan_sees_imports_inside_functions():
    graph = _imports()
    assert "kveval.lm_eval.__main__" in graph["kveval.commands.main"]  # imported inside main(): the scan must see it
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
