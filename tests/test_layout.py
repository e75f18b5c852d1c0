"""The package layout's contract: arrows point one way and no module imports itself back.

reports -> diagnostics / props -> tinylm; inside diagnostics, the import graph between
modules (every import, including those inside functions) has no cycle.
"""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tinylm", "diagnostics", "props", "reports")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every project module ``path`` imports, anywhere in its body, as dotted names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for mod, path in modules.items():
        graph[mod] = {m for m in _imports(path) if m in modules and m != mod}
    return graph


def test_arrows_point_one_way():
    allowed = {"tinylm": {"tinylm"}, "diagnostics": {"diagnostics", "tinylm"}, "props": {"props", "tinylm"},
               "reports": set(PACKAGES)}
    bad = [(mod, dep) for mod, deps in _graph().items() for dep in deps
           if dep.split(".")[0] not in allowed[mod.split(".")[0]]]
    assert not bad, bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_modules():
    # A package's __init__ re-exports its modules: edges into an __init__ from its own
    # sub-modules are how Python resolves `from . import x`, not a design circle.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    # negative control: the check above can fail
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("name, home", [("TrainOptions", "tinylm.train"), ("TrainError", "tinylm.train"),
                                        ("lr_schedule", "tinylm.train"), ("load_training", "tinylm.train")])
def test_moved_names_still_import_with_a_deprecation_warning(name, home):
    import diagnostics

    with pytest.warns(DeprecationWarning, match=home):
        obj = getattr(diagnostics, name)
    assert obj is getattr(importlib.import_module(home), name)


def test_moved_training_loop_still_runs_the_watch():
    import diagnostics

    with pytest.warns(DeprecationWarning, match="tinylm.train"):
        train = diagnostics.train
    from diagnostics.jobs.watch import train_watched

    assert train is train_watched


def test_public_names_import_without_warning():
    import diagnostics

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in diagnostics.__all__:
            getattr(diagnostics, name)
    with pytest.raises(AttributeError):
        diagnostics.no_such_name  # noqa: B018
