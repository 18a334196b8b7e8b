"""The Python lint gate: `make lint` (ruff with pyproject.toml's [tool.ruff]) runs before the suite in `make test` and
`make test-fast`, and the configuration catches what the suite once missed (an undefined name, a name imported twice)."""

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
