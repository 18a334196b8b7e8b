"""builder/ is the product: every module in it is reached from what a user runs, and none imports the test machine's
set-up (devenv/) or the tests. Imports are read with ast (nothing is executed), so a lazy import inside a function
counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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


def builder_modules() -> set[str]:
    return {f"{PACKAGE}.{p.stem}" if p.stem != "__init__" else PACKAGE for p in (ROOT / PACKAGE).glob("*.py")}


def test_the_entry_points_are_found():
    roots = user_entry_modules()
    assert {"build", "builder.enroot", "builder.slurm"} <= roots, roots
    assert "builder.cli" in reachable({"build"})


def test_every_builder_module_is_reached_from_what_a_user_runs():
    orphans = builder_modules() - reachable(user_entry_modules()) - {PACKAGE}
    assert not orphans, (f"{sorted(orphans)} in builder/ are not imported by build.py or a documented `python -m "
                         "builder.X`: test-only or test-machine code belongs in tests/ or devenv/")


def test_builder_never_imports_devenv_or_tests():
    for path in sorted((ROOT / PACKAGE).glob("*.py")):
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
