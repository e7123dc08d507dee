"""The package's import graph: no module imports itself back through others (imports inside
functions count), and the model does not import the course machinery.

The graph is read from the source (ast), so it sees every import, run or not.
"""

import ast
from pathlib import Path

import qwen_mini

PACKAGE = Path(qwen_mini.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its source, by name in the package."""
    here = ["qwen_mini", *name.split(".")] if name else ["qwen_mini"]
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names]  # a module, or a name in one
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "qwen_mini":
                continue
            target = target.removeprefix("qwen_mini").lstrip(".")
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:  # the package itself: its public names
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w), component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions():
    graph = _graph()
    assert "ngram_embedding" in graph["architectures"]  # a top-level relative import
    assert "course.mine" in graph["course"]  # `from . import mine` inside a function
    assert "architectures" in graph["course.mine"]  # `from qwen_mini import architectures`


def test_no_import_circles():
    circles = _circles(_graph())
    assert circles == set(), f"modules that import each other, directly or not: {circles}"


def test_the_model_does_not_import_the_course():
    """The model installs without the course (pyproject.toml's `course` extra): no module outside
    qwen_mini/course imports one inside it, not even inside a function."""
    graph = _graph()
    found = {
        (a, b)
        for a, deps in graph.items()
        if not a.startswith("course")
        for b in deps
        if b.startswith("course")
    }
    assert found == set(), f"the model imports the course (module, what it imports): {found}"
    assert "cli" in graph["course.cli"]  # the course's command builds on the model's
