"""Issue 29's hostile/new-user cases on the matrix surfaces: flavour files outside the build context (#12), two cells
with one name (#13), two spellings of one package (#14), an sdist the flavour doesn't install (#15), one unpublished
pin blamed for all (#18), `builder.pins --write` through a symbolic link (#19). Each: one line naming where, exit 2
through the CLIs, nothing written."""
from __future__ import annotations

import copy
import os
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from builder import dockerignore, lock, pins
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT
from test_fuzz_cli import toml_doc
from test_pins import MATRIX as PINS_MATRIX, index, pip_env  # noqa: F401  (pytest fixtures: a local PEP 503 index)

DOC = tomllib.loads((ROOT / "matrix.toml").read_text())


def load(tmp_path: Path, doc: dict):
    path = tmp_path / "matrix.toml"
    path.write_text(toml_doc(doc))
    return load_matrix(path)


def refused(tmp_path: Path, doc: dict, *needles: str) -> str:
    with pytest.raises(UserError) as e:
        load(tmp_path, doc)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "matrix.toml") in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def with_flavour(**table) -> dict:
    doc = copy.deepcopy(DOC)
    doc["flavour"]["x"] = {"cells": ["smoke-x86_64"], "packages": {"pyyaml": "6.0.3"}, **table}
    return doc


# ------------------------------------------------------------------------------------- #12 files and the context
@pytest.mark.parametrize("src, why", [
    ("builder/templates", "left out of the build context by .dockerignore"),
    ("tests", "left out of the build context by .dockerignore"),
    (".git", "git's own data"),
    ("images/notebooks/unsloth/x", "not in the repository"),
    ("images/smoke-x86_64/Dockerfile", "not a folder"),
])
def test_flavour_files_must_reach_the_build_context(tmp_path, src, why):
    refused(tmp_path, with_flavour(files={src: "/x"}), "flavour.x.files", repr(src), why)


def test_flavour_files_refuse_symbolic_links(tmp_path, monkeypatch):
    """A link (the folder itself, one on its way, or one inside it) reaches BuildKit as a link, not what it names."""
    repo = tmp_path / "repo"
    for folder in ("images/real", "images/notebooks/unsloth"):   # the latter: the real flavours' files
        (repo / folder).mkdir(parents=True)
        (repo / folder / "a.ipynb").write_text("{}")
    shutil.copy(ROOT / ".dockerignore", repo / ".dockerignore")
    (repo / "images" / "link").symlink_to("real")
    monkeypatch.setattr(dockerignore, "ROOT", repo)
    assert dockerignore.why_not_in_context("images/real") is None
    refused(tmp_path, with_flavour(files={"images/link": "/x"}), "symbolic link (images/link)")
    refused(tmp_path, with_flavour(files={"images/link/a.ipynb": "/x"}), "symbolic link (images/link)")
    (repo / "images" / "real" / "b").symlink_to("/etc/passwd")
    refused(tmp_path, with_flavour(files={"images/real": "/x"}), "symbolic link (images/real/b)")


def test_the_context_rules_are_read_as_the_engine_reads_them():
    rules = dockerignore.read_rules()
    assert not dockerignore.excluded("images/notebooks/unsloth/a.ipynb", rules)
    assert not dockerignore.excluded("locks/smoke-x86_64.txt", rules)
    assert dockerignore.excluded("locks/bases.toml", rules)   # only locks/*.txt
    assert dockerignore.excluded("trainbox/__pycache__/x.pyc", rules)
    assert dockerignore.excluded("builder/templates/Flavour.j2", rules)
    # the repository's own flavour folder passes
    assert load_matrix().select(["smoke-x86_64-unsloth-stack"])[0].files == (
        ("images/notebooks/unsloth", "/workspace/notebooks"),)


# ------------------------------------------------------------------------------------------- #13 one name, one cell
def test_an_explicit_cell_and_a_flavour_cell_with_one_name_are_refused(tmp_path):
    doc = with_flavour()
    doc["flavour"]["a"] = doc["flavour"].pop("x") | {"cells": ["smoke"]}
    doc["cell"].append(dict(doc["cell"][0], name="smoke-a"))
    refused(tmp_path, doc, "two cells are named 'smoke-a'", "cell[1]", "[flavour.a] on cell smoke")


def test_a_flavour_cell_name_without_the_flavour_is_refused(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["naming"]["flavour_cell_name"] = "{name}"
    refused(tmp_path, doc, "two cells are named 'cu130-ampere'", "[expand] cuda 13.0 gpu ampere",
            "[flavour.unsloth] on cell cu130-ampere")


def test_one_name_over_several_arches_is_one_cell():
    m = load_matrix()
    assert sorted(c.tag for c in m.cells if c.name == "smoke") == ["smoke-aarch64", "smoke-x86_64"]


# --------------------------------------------------------------------------------- #14 one package, one spelling
def test_two_spellings_of_one_package_in_a_flavour_are_refused(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["flavour"]["unsloth"]["packages"]["TRL"] = "1.16.0"
    refused(tmp_path, doc, "flavour.unsloth.packages", "'trl' and 'TRL' name one package (trl)")


def test_two_spellings_of_one_package_in_a_stack_are_refused(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["stack"]["gpu"]["packages"]["liger_kernel"] = "0.8.4"
    refused(tmp_path, doc, "stack.gpu.packages", "'liger-kernel' and 'liger_kernel' name one package (liger-kernel)")


def test_names_compare_as_pep_503_names(tmp_path):
    """A flavour's Liger_Kernel pin replaces the stack's liger-kernel (one pin, not two); `remove` and `sdists`
    spelled otherwise name the same package."""
    doc = copy.deepcopy(DOC)
    doc["flavour"]["verl"]["packages"]["Liger_Kernel"] = "0.8.4"
    doc["flavour"]["verl"]["sdists"] = ["ANTLR4_Python3.Runtime"]
    doc["flavour"]["unsloth"]["remove"] = ["Liger.Kernel"]
    m = load(tmp_path, doc)
    verl = m.select(["cu130-ampere-x86_64-verl"])[0]
    assert verl.pins["liger-kernel"] == "0.8.4" and not [p for p in verl.pins if "liger" in p and p != "liger-kernel"]
    assert verl.sdists == ("antlr4-python3-runtime",)
    assert "liger-kernel" not in m.select(["cu130-ampere-x86_64-unsloth"])[0].pins
    doc["flavour"]["verl"]["sdists"] = ["antlr4-python3-runtime", "antlr4_python3_runtime"]
    refused(tmp_path, doc, "flavour.verl.sdists", "listed already")


# ----------------------------------------------------------------------------- #15 an sdist the flavour installs
def test_an_sdist_the_flavour_does_not_install_is_refused(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["flavour"]["verl"]["sdists"] = ["antlr4-python3-runtime", "no-such-package-xyz"]
    refused(tmp_path, doc, "flavour.verl.sdists", "'no-such-package-xyz'", "not in locks/cu130-gpu-")
    r = subprocess.run([sys.executable, "build.py", "--matrix", str(tmp_path / "matrix.toml"), "--explain"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_lock_step_refuses_an_sdist_the_resolve_lacks(monkeypatch):
    """A new flavour has no lock yet: the lock step checks what uv resolved."""
    cell = load_matrix().select(["cu130-ampere-x86_64-verl"])[0]
    body = (ROOT / cell.lock).read_text()
    monkeypatch.setattr(lock, "_uv", lambda *a, **k: body)
    assert "antlr4-python3-runtime==" in lock.compile_lock(cell)
    import dataclasses
    odd = dataclasses.replace(cell, sdists=("antlr4-python3-runtime", "no-such-package-xyz"))
    with pytest.raises(UserError, match="sdists names 'no-such-package-xyz', which the resolved lock does not"):
        lock.compile_lock(odd)


# ----------------------------------------------------------------------------- #18 blame the one unpublished pin
def test_a_pin_the_index_lacks_is_blamed_alone(pip_env, tmp_path):  # noqa: F811
    path = tmp_path / "matrix.toml"
    path.write_text(PINS_MATRIX.replace('unsloth-zoo = "2026.10.9" }',
                                        'unsloth-zoo = "2026.10.9", no-such-package-xyz = "1.0" }'))
    before = path.read_bytes()
    r = subprocess.run([sys.executable, "-m", "builder.pins", "--matrix", str(path), "--write"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    line = r.stderr.strip()
    assert "the package index has no release for no-such-package-xyz" in line, line
    for other in ("torch", "transformers", "vllm", "accelerate", "pyyaml"):
        assert other not in line, line
    assert path.read_bytes() == before


def test_a_failed_batch_names_whole_requirements():
    reqs = [f"package-with-a-long-name-{i}==1.0.{i}" for i in range(22)]
    text = pins._names(reqs)
    assert text.endswith(" more") and all(part in reqs for part in text.rsplit(" and ", 1)[0].split())


# ------------------------------------------------------------------------------ #19 --write through a symlink
def test_write_goes_through_a_symlink_and_keeps_the_mode(pip_env, tmp_path):  # noqa: F811
    real = tmp_path / "real" / "matrix.toml"
    real.parent.mkdir()
    real.write_text(PINS_MATRIX)
    os.chmod(real, 0o640)
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    r = subprocess.run([sys.executable, "-m", "builder.pins", "--matrix", str(link), "--write"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert 'vllm_torch = { "0.31.0" = "2.13.0", "0.33.0" = "2.14.0" }' in real.read_text()
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert [p.name for p in real.parent.iterdir()] == ["matrix.toml"]   # no temporary left beside it


def test_a_new_flavours_unknown_sdist_is_one_line_naming_flavour_and_package(tmp_path, monkeypatch, capsys):
    """Issue 64 case 8: `sdists = ["no-such-package"]` in a flavour with no lock yet passes --list (no lock says what
    it installs), but `build.py --lock` and the build's own lock step, the first step that resolves it, refuse it in
    one line naming the flavour and the package, and write no lock."""
    from builder import cli

    doc = with_flavour(sdists=["no-such-package"])
    m = load(tmp_path, doc)
    cell = next(c for c in m.cells if c.flavour == "x")
    base_lock = (ROOT / "locks" / "smoke-x86_64.txt").read_text()
    monkeypatch.setattr(lock, "_uv", lambda *a, **k: base_lock)   # what uv resolves: no such package in it
    out = tmp_path / "out"
    rc = cli.main(["--matrix", str(tmp_path / "matrix.toml"), "--lock", cell.tag, "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert "flavour.x.sdists" in err and "'no-such-package'" in err, err
    assert not (out / cell.lock).exists()
