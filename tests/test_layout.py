"""builder/ is the product: every module in it is reached from what a user runs, and none imports the test machine's
set-up (devenv/) or the tests. Imports are read with ast (nothing is executed), so a lazy import inside a function
counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "builder"


def user_entry_modules() -> set[str]:
    """What a user runs: build.py, and each `python -m builder.X` that the README or the Makefile shows."""
    text = (ROOT / "README.md").read_text() + (ROOT / "Makefile").read_text()
    return {"build"} | {f"{PACKAGE}.{m}" for m in re.findall(rf"-m {PACKAGE}\.(\w+)", text)}


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def imports_of(path: Path) -> set[str]:
    """Absolute names imported by the file (`from builder import x` yields builder and builder.x)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def reachable(roots: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or module_file(name) is None:
            continue
        seen.add(name)
        todo += [n for n in imports_of(module_file(name)) if n.split(".")[0] == PACKAGE]
    return seen


def module_name(path: Path) -> str:
    """builder/matrix/model.py -> builder.matrix.model; a package's __init__.py is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def builder_modules() -> set[str]:
    """Every module of the package, its subpackages' (builder.matrix.*) included."""
    return {module_name(p) for p in (ROOT / PACKAGE).rglob("*.py")}


def test_the_entry_points_are_found():
    roots = user_entry_modules()
    assert {"build", "builder.enroot", "builder.slurm"} <= roots, roots
    assert "builder.cli" in reachable({"build"})


def test_every_builder_module_is_reached_from_what_a_user_runs():
    orphans = builder_modules() - reachable(user_entry_modules()) - {PACKAGE}
    assert not orphans, (f"{sorted(orphans)} in builder/ are not imported by build.py or a documented `python -m "
                         "builder.X`: test-only or test-machine code belongs in tests/ or devenv/")


def test_builder_never_imports_devenv_or_tests():
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        bad = {n for n in imports_of(path) if n.split(".")[0] in ("devenv", "tests", "enginefix", "conftest")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_check_catches_an_orphan(tmp_path, monkeypatch):
    """The walk is real: a module nobody imports is reported."""
    fake = tmp_path / PACKAGE
    fake.mkdir()
    (tmp_path / "build.py").write_text("from builder.cli import main\n")
    (fake / "__init__.py").write_text("")
    (fake / "cli.py").write_text("from builder import used\nimport builder.errors\n")
    for name in ("used", "errors", "only_tests"):
        (fake / f"{name}.py").write_text("")
    (tmp_path / "README.md").write_text("")
    (tmp_path / "Makefile").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert builder_modules() - reachable(user_entry_modules()) - {PACKAGE} == {"builder.only_tests"}


# ------------------------------------------------------------------------------------ one-way imports (issue 30)
# builder/ may import these in-image modules only: the utilities host and image share (atomic writes, redaction) and
# the launcher's Slurm step variables the job renderer passes on. Issue 30 item 3 moves them to a shared package;
# then this set shrinks to nothing.
SHARED_WITH_ENTRYPOINTS = {"entrypoints.atomic", "entrypoints.redact", "entrypoints.launch",
                           # the command table (Slurm renderer: which commands get a job script); pure data, no
                           # import of torch/TRL (tests/test_command_table.py keeps it so)
                           "entrypoints.commands"}
# Import circles known and being removed elsewhere, each as the set of its modules.
KNOWN_CYCLES: list[set[str]] = []  # none; a cycle found here is a bug, not an exception to list


def module_imports(path: Path) -> set[str]:
    """imports_of PATH plus its relative imports, resolved against the package PATH is in."""
    names = imports_of(path)
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
            mod = f"{base}.{node.module}" if node.module else base
            names |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """{builder module: the builder modules it imports}, imports inside functions included."""
    graph = {}
    for name in builder_modules() - {PACKAGE}:
        graph[name] = {n for n in module_imports(module_file(name))
                       if n.split(".")[0] == PACKAGE and n != PACKAGE and n != name and module_file(n) is not None}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan): each is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_builder_has_no_import_cycle():
    """Data flows one way: a module never imports, even inside a function, one that imports it back."""
    found = [sorted(c) for c in cycles(import_graph()) if c not in KNOWN_CYCLES]
    assert not found, f"import circles in builder/ (imports inside functions count): {found}"


def test_builder_imports_only_the_shared_entrypoints_modules():
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        names = module_imports(path)
        bad = {n for n in names if n.split(".")[0] == "entrypoints" and n != "entrypoints"
               and ".".join(n.split(".")[:2]) not in SHARED_WITH_ENTRYPOINTS}
        bad |= {"entrypoints"} if "import entrypoints" in path.read_text() else set()
        assert not bad, (f"{path.relative_to(ROOT)} imports {sorted(bad)} from the in-image package; builder/ may use "
                         f"only {sorted(SHARED_WITH_ENTRYPOINTS)}")


def test_the_checks_catch_a_planted_cycle_and_an_entrypoints_import(tmp_path, monkeypatch):
    """The cycle check is real: a circle closed by an import inside a function is reported, and so is a builder
    module importing an in-image command."""
    fake = tmp_path / PACKAGE
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "a.py").write_text("from builder import b\n")
    (fake / "b.py").write_text("import builder.c\n")
    (fake / "c.py").write_text("def f():\n    from builder.a import x\n    return x\n")
    (fake / "d.py").write_text("from . import a\nfrom entrypoints import atomic, doctor\n")
    (fake / "sub").mkdir()   # a subpackage's modules are in the graph, their relative imports resolved
    (fake / "sub" / "__init__.py").write_text("")
    (fake / "sub" / "e.py").write_text("from . import f\nfrom .. import a\nfrom .f import g\n")
    (fake / "sub" / "f.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert cycles(import_graph()) == [{"builder.a", "builder.b", "builder.c"}]
    assert import_graph()["builder.d"] == {"builder.a"}
    assert import_graph()["builder.sub.e"] == {"builder.sub", "builder.sub.f", "builder.a"}
    with pytest.raises(AssertionError, match=r"imports \['entrypoints.doctor'\]"):
        test_builder_imports_only_the_shared_entrypoints_modules()
    with pytest.raises(AssertionError, match="import circles"):
        test_builder_has_no_import_cycle()
