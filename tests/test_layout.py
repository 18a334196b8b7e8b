"""builder/ is the product: every module in it is reached from what a user runs, and none imports the test machine's
set-up (devenv/) or the tests. Imports are read with ast (nothing is executed), so a lazy import inside a function
counts too."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "builder"


def user_entry_modules() -> set[str]:
    """What a user runs: build.py, and each `python -m builder.X` that the docs (README, docs/) or the Makefile show."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "Makefile"]
    text = "".join(p.read_text() for p in docs)
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
# What host and image share lives in one neutral package, common/: builder/ and devenv/ import it, never the in-image
# package (whose __init__ installs logging filters). common/ imports the standard library and itself; the only other
# names, each imported inside the one function that needs it (so importing common costs the standard library alone):
COMMON_LAZY_LIBRARIES = {
    "psutil",  # process lookups (atomic: a dead writer's temporary; launch: torchrun's ranks); host and images have it
    "torch",   # launch.torchrun_has_option asks torchrun's own parser, only when torchrun is about to run (in-image)
}
HOST_PACKAGES = ("builder", "devenv")
COMMON = "common"
IMAGE = "trainbox"  # the in-image package: dispatcher, commands (cli/), trainer library, a run's life, the image's own
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


def import_graph(package: str = PACKAGE) -> dict[str, set[str]]:
    """{module of PACKAGE: the modules of PACKAGE it imports}, imports inside functions included. The package's own
    __init__ is left out (every import of a submodule runs it; it is a node only where it imports something)."""
    graph = {}
    for name in {module_name(p) for p in (ROOT / package).rglob("*.py")} - {package}:
        graph[name] = {n for n in module_imports(module_file(name))
                       if n.split(".")[0] == package and n != package and n != name and module_file(n) is not None}
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


def test_the_in_image_package_has_no_import_cycle():
    """The same rule in trainbox/: commands (cli/) over the trainer library, a run's life and the image's facts;
    none of those imports a command, and no two modules import each other, even inside a function."""
    graph = import_graph(IMAGE)
    assert any(n.startswith(f"{IMAGE}.training.") for n in graph[f"{IMAGE}.cli.sft"])  # the graph sees real imports
    found = [sorted(c) for c in cycles(graph)]
    assert not found, f"import circles in {IMAGE}/ (imports inside functions count): {found}"


def package_imports(package: str) -> dict[Path, set[str]]:
    """{file of PACKAGE: the absolute names it imports (relative imports resolved), inside functions too}."""
    return {path: module_imports(path) for path in sorted((ROOT / package).rglob("*.py"))}


def test_the_host_never_imports_the_in_image_package():
    """builder/ and devenv/ (the host) and common/ (shared by both) never import trainbox, even inside a function."""
    for package in (*HOST_PACKAGES, COMMON):
        for path, names in package_imports(package).items():
            bad = {n for n in names if n.split(".")[0] == IMAGE}
            assert not bad, (f"{path.relative_to(ROOT)} imports {sorted(bad)}: the host may not import the in-image "
                             f"package; what both sides need belongs in {COMMON}/")


def test_pyproject_installs_every_package():
    """pyproject's packages list names every package folder: a subpackage left out (trainbox.cli...) is missing
    from an installed wheel while every test run from the checkout still passes."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p) for top in (PACKAGE, COMMON, "devenv", IMAGE) for p in (ROOT / top).rglob("__init__.py")}
    assert found == listed, f"not in pyproject: {sorted(found - listed)}; listed, absent: {sorted(listed - found)}"


def top_level_imports(path: Path) -> set[str]:
    """Top-level package names imported outside any function or class (what importing PATH runs)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(COMMON if node.level else node.module.split(".")[0])
    return names


def test_common_imports_only_the_standard_library_and_itself():
    assert (ROOT / COMMON / "__init__.py").is_file()
    for path, names in package_imports(COMMON).items():
        tops = {n.split(".")[0] for n in names}
        bad = tops - set(sys.stdlib_module_names) - {COMMON} - COMMON_LAZY_LIBRARIES
        bad |= top_level_imports(path) - set(sys.stdlib_module_names) - {COMMON}
        assert not bad, (f"{path.relative_to(ROOT)} imports {sorted(bad)}: {COMMON}/ (shared by host and image) may "
                         f"import only the standard library and itself (and {sorted(COMMON_LAZY_LIBRARIES)} inside a "
                         "function)")


def test_common_init_runs_nothing():
    """Importing common (every host command does) has no side effect: its __init__ is a docstring only."""
    body = ast.parse((ROOT / COMMON / "__init__.py").read_text()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value.value, str), body


def test_the_checks_catch_a_planted_cycle_and_an_in_image_import(tmp_path, monkeypatch):
    """The checks are real: a circle closed by an import inside a function is reported, and so are a builder module
    importing the in-image package (even inside a function) and a common module importing it or a library."""
    fake = tmp_path / PACKAGE
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "a.py").write_text("from builder import b\n")
    (fake / "b.py").write_text("import builder.c\n")
    (fake / "c.py").write_text("def f():\n    from builder.a import x\n    return x\n")
    (fake / "d.py").write_text("from . import a\nfrom common import atomic\n\n"
                               "def f():\n    import trainbox.cli.doctor\n")
    (tmp_path / COMMON).mkdir()
    (tmp_path / COMMON / "__init__.py").write_text('"""Shared."""\nfrom trainbox import quiet\n')
    (tmp_path / COMMON / "ok.py").write_text("import os\nfrom . import x\n\ndef f():\n    import psutil\n")
    (tmp_path / COMMON / "lazy.py").write_text("import psutil\n")  # a listed library, but at import time
    (tmp_path / COMMON / "lib.py").write_text("def f():\n    import jinja2\n")
    (fake / "sub").mkdir()   # a subpackage's modules are in the graph, their relative imports resolved
    (fake / "sub" / "__init__.py").write_text("")
    (fake / "sub" / "e.py").write_text("from . import f\nfrom .. import a\nfrom .f import g\n")
    (fake / "sub" / "f.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert cycles(import_graph()) == [{"builder.a", "builder.b", "builder.c"}]
    assert import_graph()["builder.d"] == {"builder.a"}
    assert import_graph()["builder.sub.e"] == {"builder.sub", "builder.sub.f", "builder.a"}
    (tmp_path / "trainbox" / "cli").mkdir(parents=True)  # the in-image package's graph: subpackages, lazy imports
    (tmp_path / "trainbox" / "training").mkdir()
    (tmp_path / "trainbox" / "cli" / "x.py").write_text("from trainbox.training import y\n")
    (tmp_path / "trainbox" / "training" / "y.py").write_text("def f():\n    from trainbox.cli import x\n")
    assert cycles(import_graph("trainbox")) == [{"trainbox.cli.x", "trainbox.training.y"}]
    with pytest.raises(AssertionError, match=r"builder/d.py imports \['trainbox.cli.doctor'\]: the host may not"):
        test_the_host_never_imports_the_in_image_package()
    with pytest.raises(AssertionError, match="import circles"):
        test_builder_has_no_import_cycle()
    with pytest.raises(AssertionError, match=r"common/__init__.py imports \['trainbox'\]"):
        test_common_imports_only_the_standard_library_and_itself()
    (tmp_path / COMMON / "__init__.py").write_text('"""Shared."""\n')
    with pytest.raises(AssertionError, match=r"common/lazy.py imports \['psutil'\]"):
        test_common_imports_only_the_standard_library_and_itself()
    (tmp_path / COMMON / "lazy.py").unlink()
    with pytest.raises(AssertionError, match=r"common/lib.py imports \['jinja2'\]"):
        test_common_imports_only_the_standard_library_and_itself()
    (tmp_path / COMMON / "lib.py").unlink()
    test_common_imports_only_the_standard_library_and_itself()  # what is left (ok.py) passes
    (tmp_path / COMMON / "__init__.py").write_text('"""Shared."""\nimport logging\nlogging.basicConfig()\n')
    with pytest.raises(AssertionError):
        test_common_init_runs_nothing()
