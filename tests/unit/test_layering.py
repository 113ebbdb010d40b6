"""The package layering of docs/architecture.md, read from the source: every import
(module-level or inside a function) is an arrow, and no arrow points up or closes a cycle.

    stepahead (protocol, shared infrastructure)  <-  model_zoo (built-in models)
        <-  gateway | scheduler_service | worker_service (one each; none imports another)
        <-  cli (the commands)  <-  testing (harnesses)  <-  tests, benchmarks

Inside the worker, the shared layers (`worker_service.layers`) sit below the model families
(`worker_service.models`): a model file composes layers, a layer never imports a model.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("gateway", "scheduler_service", "worker_service")
# package -> the packages of this repository it may import (besides itself)
ALLOWED = {
    "stepahead": set(),
    "model_zoo": {"stepahead"},
    **{d: {"stepahead", "model_zoo"} for d in DAEMONS},
    "cli": {"stepahead", "model_zoo", *DAEMONS},
    "testing": {"stepahead", "model_zoo", *DAEMONS, "cli"},
    "benchmarks": {"stepahead", "model_zoo", *DAEMONS, "cli", "testing"},
    "tests": {"stepahead", "model_zoo", *DAEMONS, "cli", "testing"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of this repository it imports (a name imported from a package
    counts as its submodule when there is one)."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {t for t in map(owner, targets) if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    top = lambda name: name.split(".")[0]  # noqa: E731
    return sorted(f"{m} imports {t}" for m, ts in graph.items() for t in ts
                  if top(t) != top(m) and top(t) not in ALLOWED[top(m)])


def test_no_import_points_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_scheduler_core_imports_nothing_of_its_daemon():
    daemon_side = sorted(f"{m} imports {t}" for m, ts in import_graph().items() if m.startswith("scheduler_service.core")
                         for t in ts if t.startswith("scheduler_service.") and not t.startswith("scheduler_service.core"))
    assert daemon_side == []


def models_imported_by_layers(graph: dict[str, set[str]]) -> list[str]:
    in_package = lambda name, package: name == package or name.startswith(f"{package}.")  # noqa: E731
    return sorted(f"{m} imports {t}" for m, ts in graph.items() if in_package(m, "worker_service.layers")
                  for t in ts if in_package(t, "worker_service.models"))


def test_the_shared_layers_import_no_model():
    assert models_imported_by_layers(import_graph()) == []


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_the_checks_see_an_upward_import_and_a_cycle():
    graph = import_graph()
    assert "stepahead.plan" in graph["worker_service.model_runner"], "the graph must hold real arrows"
    graph = dict(graph, **{"stepahead.plan": graph["stepahead.plan"] | {"worker_service.model_runner"}})
    assert any({"stepahead.plan", "worker_service.model_runner"} <= set(c) for c in cycles(graph))
    assert upward_imports(graph) == ["stepahead.plan imports worker_service.model_runner"]


def test_the_layers_check_sees_a_layer_importing_a_model():
    graph = import_graph()
    assert "worker_service.layers.rotary" in graph["worker_service.layers.attention"], "the graph must hold real arrows"
    assert "worker_service.layers.attention" in graph["worker_service.models.llama"]
    graph = dict(graph, **{"worker_service.layers.mlp": graph["worker_service.layers.mlp"] | {"worker_service.models"}})
    assert models_imported_by_layers(graph) == ["worker_service.layers.mlp imports worker_service.models"]
