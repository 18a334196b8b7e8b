"""The release path fails closed per cell (issue 29, item 1): build.yml plans only the cells whose `--frozen` build
finds every lock it installs from (venv, flavour, attention, base digests; a flavour's base cell's too), and names
each missing lock with the workflow that makes it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from builder import cli, lock, workflow  # noqa: E402
from builder.errors import UserError  # noqa: E402
from builder.matrix import load_matrix  # noqa: E402


def test_every_planned_cell_passes_build_pys_frozen_check(tmp_path):
    """The real plan over the real matrix; each planned job's cells through build.py itself (--frozen --dry-run, as
    the build job runs them) and through the lock step a real --frozen build runs (cli.with_bases, then
    lock.ensure), not through the plan's own code."""
    m = load_matrix()
    include = workflow.plan()
    assert include, "the plan builds something"
    by_tag = {c.tag: c for c in m.cells}
    for job in include:
        tags = job["cells"].split()
        r = subprocess.run([sys.executable, "build.py", *tags, "--arch", job["arch"], "--frozen", "--dry-run",
                            "--output-dir", str(tmp_path / job["venv"])], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "refuses" not in r.stdout, r.stdout
        assert r.stdout.count("(fresh, used as is)") == r.stdout.count("   lock: "), r.stdout
        for tag in tags:
            cells, bases = cli.with_bases([by_tag[tag]], m, {}, None)
            lock.ensure(cells, root=ROOT, frozen=True, bases=bases)   # raises what --frozen refuses
    # and the cells left out are exactly those the real lock step refuses
    planned = {t for job in include for t in job["cells"].split()}
    for c in m.cells:
        if c.tag in planned:
            continue
        cells, bases = cli.with_bases([c], m, {}, None)
        with pytest.raises(UserError, match="--frozen"):
            lock.ensure(cells, root=ROOT, frozen=True, bases=bases)


def test_the_notice_names_each_cell_whose_lock_is_missing():
    """Whatever the matrix and locks/ hold today: every cell left out of the plan is named in a notice beside each
    lock it waits for (missing or stale), with the workflow that makes it and the command, and every cell whose
    committed locks are all there is planned. FA3's prebuilt wheels live on PyTorch's per-CUDA index, which this
    project's machines can't reach (DESIGN.md): lock.yml makes those attention locks."""
    blocked, notices = workflow.blocked(), workflow.notices()
    planned = {t for job in workflow.plan() for t in job["cells"].split()}
    assert set(blocked).isdisjoint(planned)
    for tag, waits in blocked.items():
        assert waits, tag
        for w in waits:
            assert not (ROOT / w.lock.split(" [")[0]).is_file() or w.state == "stale" or w.kind == "base", w
            line = next((n for n in notices if w.lock in n and tag in n.split("(", 1)[0]), None)
            assert line is not None, (tag, w.lock, notices)
            assert "lock.yml" in line and "`python build.py --lock " in line  # (one command per shared lock)
    left_out = {c.tag for c in load_matrix().cells} - planned
    assert left_out == set(blocked)


def _tree(tmp_path: Path) -> Path:
    """A copy of the matrix and its locks, with an attention lock (right inputs digest) for every cell that reads
    one: the state after lock.yml's pull request."""
    shutil.copy(ROOT / "matrix.toml", tmp_path / "matrix.toml")
    shutil.copytree(ROOT / "locks", tmp_path / "locks")
    for c in load_matrix(tmp_path / "matrix.toml").cells:
        if c.attention_lock:
            (tmp_path / c.attention_lock).write_text(
                lock.HEADER.format(name=f"{c.tag}.attention", platform=c.uv_platform, python=c.python, tag=c.tag)
                + lock.INPUTS.format(digest=lock.attention_digest(c)) + "flash-attn-3==3.0.0\n")
    return tmp_path / "matrix.toml"


def test_a_missing_attention_lock_leaves_the_rest_planned_and_that_cell_out(tmp_path):
    matrix = _tree(tmp_path)
    every = {t for job in workflow.plan(matrix_path=matrix) for t in job["cells"].split()}
    assert {"cu130-hopper-x86_64", "cu130-hopper-aarch64-unsloth"} <= every
    (tmp_path / "locks/cu130-hopper-aarch64.attention.txt").unlink()
    include = workflow.plan(matrix_path=matrix)
    planned = {t for job in include for t in job["cells"].split()}
    gone = {"cu130-hopper-aarch64", "cu130-hopper-aarch64-unsloth", "cu130-hopper-aarch64-verl"}
    assert planned == every - gone
    # the venv jobs stay, without that cell; the Hopper manifest lists wait (a list with one arch would be refused)
    assert {job["venv"] for job in include} >= {"cu130-gpu-aarch64", "cu130-gpu-aarch64-unsloth"}
    published = {r["cell"] for r in workflow.publish_rows(include, matrix)}
    assert "cu130-hopper" not in published and "cu130-ampere" in published
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "plan", "--matrix", str(matrix)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "cu130-" in ln]
    assert len(lines) == 1 and lines[0].startswith("::notice::not built: cu130-hopper-aarch64, ")
    assert "locks/cu130-hopper-aarch64.attention.txt is missing" in lines[0] and "lock.yml" in lines[0]
    # a stale lock is refused like a missing one
    (tmp_path / "locks/cu130-hopper-aarch64.attention.txt").write_text("# inputs-sha256: 0\n")
    assert workflow.blocked(matrix)["cu130-hopper-aarch64"][0].state == "stale"


def test_lock_yml_writes_the_attention_locks_too(tmp_path, monkeypatch):
    """lock.yml's `python build.py --lock` (no selection) writes every lock a --frozen build reads, the attention
    locks included (the resolver is replaced: nothing here reaches the indexes)."""
    run = "\n".join(s.get("run", "") for s in workflow.lock_dict()["jobs"]["lock"]["steps"])
    assert "python build.py --lock --quiet\n" in run and "locks/" in workflow.lock_dict()["jobs"]["lock"]["steps"][
        -1]["with"]["add-paths"]
    monkeypatch.setattr(lock, "compile_lock", lambda c, o=None: lock.INPUTS.format(digest=lock.inputs_digest(c)))
    monkeypatch.setattr(lock, "compile_attention_lock",
                        lambda c, o=None: lock.INPUTS.format(digest=lock.attention_digest(c)))
    assert cli.main(["--lock", "--quiet", "--output-dir", str(tmp_path)]) == 0
    cells = load_matrix().cells
    assert {c.attention_lock for c in cells if c.attention_lock} and all(
        lock.is_fresh(c, tmp_path) for c in cells)
    assert not [p for p in lock.frozen_problems(list(cells), tmp_path) if p.kind != "base"]


@pytest.mark.parametrize("missing", [(), ("locks/cu130-hopper-x86_64.attention.txt", "locks/cu130-gpu-aarch64.txt")])
def test_plan_names_every_cell_it_leaves_out_and_the_command_that_locks_it(tmp_path, missing):
    """Issue 64 case 5, as a property: `python -m builder.workflow plan`'s notices name each cell the plan leaves out,
    every one in a line that names the lock it waits for and the `python build.py --lock` command that makes it (on
    the real matrix, and on a copy with a venv lock and an attention lock removed, so some cells are always out)."""
    matrix = ROOT / "matrix.toml"
    if missing:
        matrix = _tree(tmp_path)
        for path in missing:
            (tmp_path / path).unlink()
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "plan", "--matrix", str(matrix)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = dict(line.split("=", 1) for line in r.stdout.splitlines())
    planned = {t for job in json.loads(out["matrix"])["include"] for t in job["cells"].split()}
    left_out = {c.tag for c in load_matrix(matrix).cells} - planned
    if missing:
        assert {"cu130-hopper-x86_64", "cu130-ampere-aarch64", "cu130-hopper-x86_64-verl"} <= left_out
    named = set()
    for line in r.stderr.splitlines():
        assert line.startswith("::notice::not built: "), line
        tags = line.removeprefix("::notice::not built: ").split(" (", 1)[0].split(", ")
        assert "locks/" in line and "`python build.py --lock " in line, line
        named |= set(tags)
    assert named == left_out, (sorted(left_out - named), sorted(named - left_out))
