"""The Python lint gate: `make lint` (ruff with pyproject.toml's [tool.ruff]) runs before the suite in `make test` and
`make test-fast`, and the configuration catches what the suite once missed (an undefined name, a name imported twice).
Import order (isort, I) is in the gate; the imports whose order matters (Unsloth before transformers/TRL) keep it."""

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str:
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(exe).exists():
        pytest.fail("ruff is not installed: `make setup` (pyproject.toml's dev extra pins it)")
    return exe


def _prerequisites(target: str) -> list[str]:
    m = re.search(rf"^{target}:([^#\n]*)", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"no {target} rule in the Makefile"
    return m.group(1).split()


def test_make_test_and_test_fast_lint_first():
    assert "lint" in _prerequisites("test") and "lint" in _prerequisites("test-fast")
    assert "ruff check" in (ROOT / "Makefile").read_text()


def test_ruff_pin_is_the_dev_extra():
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    pin = next(r for r in dev if r.startswith("ruff=="))
    version = subprocess.run([_ruff(), "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
    assert pin == f"ruff=={version}"


@pytest.mark.parametrize("code, rule", [
    ("def f():\n    raise UsageError('x')\n", "F821"),                    # sftlib.py before issue 64
    ("from os import path, sep\nfrom os import path\n\nprint(path, sep)\n", "F811"),  # qlora.py's twice-imported names
    ("import os\n", "F401"),
    ("def f(x=[]):\n    return x\n", "B006"),
    ("import sys\nimport os\n\nprint(os, sys)\n", "I001"),
    # what the benchmarks' `# isort: split` lines are for: unsorted, Unsloth would go after torch
    ("def f():\n    from unsloth import FastLanguageModel\n\n    import torch\n\n    return FastLanguageModel, torch\n",
     "I001"),
])
def test_the_config_catches(tmp_path, code, rule):
    """The repository's own [tool.ruff] (not ruff's defaults) flags each planted mistake."""
    bad = tmp_path / "bad.py"
    bad.write_text(code)
    r = subprocess.run([_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and rule in r.stdout, r.stdout + r.stderr


def test_the_repository_is_clean():
    r = subprocess.run([_ruff(), "check", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_order_is_in_the_gate():
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "I" in lint["select"]
    assert {"builder", "common", "devenv", "trainbox"} <= set(lint["isort"]["known-first-party"])


def _imported(stmt) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [a.name for a in stmt.names]
    return [stmt.module or ""] if isinstance(stmt, ast.ImportFrom) else []


def test_unsloth_is_imported_before_what_it_patches():
    """Unsloth patches transformers and TRL when it is imported, so wherever a function or module imports it, it is
    that scope's first import (sorted, it would follow torch, transformers, trl and datasets)."""
    scopes = {}
    for path in sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "trainbox").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
                mods = [m for s in node.body for m in _imported(s)]
                if any(m.split(".")[0] == "unsloth" for m in mods):
                    scopes[f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}"] = mods
    assert {"benchmarks/unsloth_grpo.py:grpo", "benchmarks/unsloth_sides.py:sft",
            "benchmarks/unsloth_sides.py:grpo"} <= set(scopes), scopes
    for where, mods in scopes.items():
        assert mods[0] == "unsloth", f"{where}: Unsloth must come first, not after {mods[:mods.index('unsloth')]}"
