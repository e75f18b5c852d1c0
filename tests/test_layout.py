"""The package layout's contract: arrows point one way and no module imports itself back.

reports -> diagnostics / props -> tinylm; inside diagnostics, the import graph between
modules (every import, including those inside functions) has no cycle.
"""

from __future__ import annotations

import ast
import re
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


# ----------------------------------------------------------------------------- naming reports, size, public names

_NAMES_REPORTS = re.compile(r"reports(\.\w+)*\.?")
_IMPORTERS = {"import_module", "__import__", "find_spec", "import_string"}


def _names_reports(source: str) -> list[str]:
    """Where ``source`` names the reports package as a string: a string constant (or an f-string's
    literal part) reading ``reports`` or ``reports.x.y``, or an importlib call on such a name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAMES_REPORTS.fullmatch(node.value):
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and _NAMES_REPORTS.fullmatch(head.value):
                found.append(f"line {node.lineno}: f-string {head.value!r}...")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            arg = node.args[0] if node.args else None
            if (name in _IMPORTERS and isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                    and arg.value.split(".")[0] == "reports"):
                found.append(f"line {node.lineno}: {name}({arg.value!r})")
    return found


def test_diagnostics_never_names_reports_even_as_a_string():
    bad = {str(p.relative_to(ROOT)): hits for p in sorted((ROOT / "diagnostics").rglob("*.py"))
           if (hits := _names_reports(p.read_text()))}
    assert not bad, bad


def test_the_reports_name_scan_finds_a_planted_name():
    # negative control: each way of naming reports is found, and an unrelated string is not
    assert _names_reports("RENDERER = 'reports.notebook'")
    assert _names_reports("import importlib\nimportlib.import_module('reports')")
    assert _names_reports("name = 'x'\nmod = f'reports.{name}'")
    assert _names_reports("__import__('reports.cli')")
    assert not _names_reports("'''The reports package draws; this module computes.'''\nx = 'reporting'")


MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    """Functions of ``path`` longer than MAX_FUNCTION_LINES, counted from the def line to the last line."""
    return [f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_every_diagnostics_file_is_at_most_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "diagnostics").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def test_every_diagnostics_function_is_at_most_80_lines():
    long = [f for p in sorted((ROOT / "diagnostics").rglob("*.py")) for f in _long_functions(p)]
    assert not long, long


def test_the_length_checks_find_a_long_function(tmp_path):
    # negative control: a function of 81 lines is found, one of 80 is not
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    (tmp_path / "m.py").write_text(f"def short():\n{body}\n\n\ndef long():\n{body}\n    return 0\n")
    assert _long_functions(tmp_path / "m.py", root=tmp_path) == ["m.py:83 long (81 lines)"]


def _private_diagnostics_imports(path: Path) -> list[str]:
    """What ``path`` imports from diagnostics that is not public: a name ``from diagnostics.x import
    name`` where ``name`` is neither in ``diagnostics.x.__all__`` nor a public sub-module of it, or a
    module path with a private part (``diagnostics.measure._numba``)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] == "diagnostics"
                    and any(part.startswith("_") for part in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "diagnostics":
            if any(part.startswith("_") for part in node.module.split(".")):
                bad.append(node.module)
                continue
            module = importlib.import_module(node.module)
            public = set(getattr(module, "__all__", ()))
            for alias in node.names:
                if alias.name in public:
                    continue
                try:  # a public sub-module is a public name of its package
                    importlib.import_module(f"{node.module}.{alias.name}")
                    is_module = not alias.name.startswith("_")
                except ImportError:
                    is_module = False
                if not is_module:
                    bad.append(f"{node.module}.{alias.name}")
    return bad


def test_reports_imports_only_public_diagnostics_names():
    bad = {str(p.relative_to(ROOT)): names for p in sorted((ROOT / "reports").rglob("*.py"))
           if (names := _private_diagnostics_imports(p))}
    assert not bad, bad


def test_the_public_name_check_finds_a_private_import(tmp_path):
    # negative control: a name outside __all__ and a private module are found; a public name is not
    path = tmp_path / "m.py"
    path.write_text("from diagnostics.measure import reduce\nfrom diagnostics.measure.reducer import _merge\n"
                    "import diagnostics.measure._numba\n")
    assert _private_diagnostics_imports(path) == ["diagnostics.measure.reducer._merge", "diagnostics.measure._numba"]
