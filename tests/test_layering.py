"""Layers run one way (CLI -> runner -> cache/policies -> stores -> tensors): no import cycle among kveval's modules,
counting imports inside functions too, which hide a cycle from Python's import machinery but not from a reader."""

import ast
from pathlib import Path

import kveval

PACKAGE = Path(kveval.__file__).parent


def _imports() -> dict[str, set[str]]:
    """Each kveval module and the kveval modules it imports anywhere in its text (a submodule's own package aside:
    importing ``kveval.lm_eval.schema`` runs ``kveval.lm_eval`` first whatever one writes)."""
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


def test_no_import_cycle_among_kveval_modules():
    cycle = _cycle(_imports())
    assert cycle is None, " -> ".join(cycle)


def test_the_scan_sees_imports_inside_functions():
    graph = _imports()
    assert "kveval.lm_eval.__main__" in graph["kveval.cli"]  # imported inside main(): the scan must see it
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
