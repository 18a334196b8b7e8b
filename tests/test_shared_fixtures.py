"""Session fixtures run once per session only if one place registers them (conftest.py). A test module that imports
one (`from enginefix import smoke_sqsh`) gets its own copy of the fixture, run again for that module: the smoke .sqsh
export (over a minute) and the test Slurm's start were once paid in every module that imported them."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_session_fixture(decorator: ast.expr) -> bool:
    return (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) in ("pytest.fixture", "fixture")
            and any(k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value == "session"
                    for k in decorator.keywords))


def session_fixtures(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and any(map(_is_session_fixture,
                                                                                    f.decorator_list))}


def test_no_test_module_imports_a_session_fixture():
    local = {p.stem: p for p in TESTS.glob("*.py")}
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        if path.name == "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in local:
                shared = session_fixtures(local[node.module]) & {a.name for a in node.names}
                bad += [f"{path.name}:{node.lineno} imports {name} from {node.module}" for name in sorted(shared)]
    assert not bad, ("session fixtures imported into a module run once per importing module; register them in "
                     "tests/conftest.py and use them by name:\n" + "\n".join(bad))


def test_the_check_sees_an_imported_session_fixture(tmp_path):
    """The check above is only worth something if it finds the case it exists for."""
    fix = tmp_path / "fix.py"
    fix.write_text('import pytest\n\n@pytest.fixture(scope="session")\ndef big():\n    return 1\n\n'
                   '@pytest.fixture\ndef small():\n    return 2\n')
    assert session_fixtures(fix) == {"big"}
    assert "smoke_sqsh" in session_fixtures(TESTS / "enginefix.py")
