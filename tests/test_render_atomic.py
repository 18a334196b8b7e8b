"""Whole or nothing: a render writes every selected cell or none (Ctrl-C at any moment, an error on the second
cell), a killed writer's temporaries are git-ignored and removed by the next write, a failed foreign render leaves no
temporary folder, and every path the build writes at its end (--sqsh, --report, --output-dir) is checked first."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder import render
from builder.matrix import load_matrix
from builder.paths import ROOT
from common import atomic

PY = sys.executable


def matrix_with_version(tmp: Path, version: str) -> Path:
    text = (ROOT / "matrix.toml").read_text()
    assert 'version = "0.1.0"' in text
    path = tmp / f"matrix-{version}.toml"
    path.write_text(text.replace('version = "0.1.0"', f'version = "{version}"', 1))
    return path


def versions_in(out: Path) -> dict[str, set[str]]:
    """cell -> the naming versions its Dockerfile and image.json carry."""
    seen = {}
    for d in sorted((out / "images").iterdir()):
        if not (d / "Dockerfile").exists():
            continue
        record = json.loads((d / "image.json").read_text())
        docker = (d / "Dockerfile").read_text()
        seen[d.name] = {v for v in ("9.1.0", "9.2.0") if f"v{v}" in docker or f"{v}" in docker} | \
            {record.get("version", "")}
    return seen


def test_ctrl_c_at_any_moment_never_leaves_a_mix(tmp_path):
    a, b = matrix_with_version(tmp_path, "9.1.0"), matrix_with_version(tmp_path, "9.2.0")
    out = tmp_path / "out"
    subprocess.run([PY, "build.py", "--matrix", str(a), "--dry-run", "--quiet", "--output-dir", str(out)], cwd=ROOT,
                   check=True, timeout=120)
    rng = random.Random(6)
    current = "9.1.0"
    for i in range(24):
        target = "9.2.0" if current == "9.1.0" else "9.1.0"
        p = subprocess.Popen([PY, "build.py", "--matrix", str(b if target == "9.2.0" else a), "--dry-run", "--quiet",
                              "--output-dir", str(out)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(0.05, 0.6))
        p.send_signal(signal.SIGINT)
        p.wait(60)
        seen = versions_in(out)
        found = set().union(*seen.values())
        assert len(found) == 1, f"run {i}: cells from two renders: {seen}"
        current = found.pop()
        leftovers = [q for q in out.rglob(".*.tmp.*")]
        assert leftovers == [], f"run {i}: temporaries left: {leftovers}"


def test_an_error_on_the_second_cell_writes_nothing(tmp_path, monkeypatch):
    cells = load_matrix().select(names=["smoke-x86_64", "smoke-aarch64"])
    calls = []
    real = render.render

    def second_fails(cell):
        calls.append(cell.tag)
        if len(calls) == 2:
            raise RuntimeError("injected: the second cell fails")
        return real(cell)

    monkeypatch.setattr(render, "render", second_fails)
    with pytest.raises(RuntimeError):
        render.write_cells(cells, root=tmp_path)
    assert not (tmp_path / "images").exists() or not list((tmp_path / "images").rglob("*")), "a cell was written"


def test_a_killed_writers_temporary_is_ignored_by_git_and_removed_by_the_next_write(tmp_path):
    target = tmp_path / "images" / "x" / "Dockerfile"
    target.parent.mkdir(parents=True)
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    stale = target.parent / f".Dockerfile{atomic.TMP_MARK}{atomic.host()}.{dead.pid}.deadbeef"
    stale.write_text("half")
    os.utime(stale, (time.time() - 60, time.time() - 60))
    r = subprocess.run(["git", "check-ignore", "-q", "images/cu130-hopper-x86_64/" + stale.name], cwd=ROOT)
    assert r.returncode == 0, "temporaries must be git-ignored"
    atomic.write_all({target: "FROM scratch\n"})
    assert target.read_text() == "FROM scratch\n" and not stale.exists()


def cli(*args, user=None):
    cmd = [PY, "build.py", *args]
    if user:
        cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *cmd]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HOME="/tmp"))


def test_a_failed_foreign_run_leaves_no_temporary_folder(tmp_path):
    """A foreign matrix without --output-dir works in a new temporary folder; a failure there (a lock through an
    index that refuses connections) removes it."""
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("trainbox-render-*"))
    r = cli("--matrix", str(matrix_with_version(tmp_path, "9.1.0")), "--lock", "smoke-x86_64",
            "--index", "default=https://127.0.0.1:1/simple")
    after = set(Path(tempfile.gettempdir()).glob("trainbox-render-*"))
    assert r.returncode == 2 and "rendering into" in r.stderr, r.stderr
    assert after - before == set(), after - before


@pytest.mark.parametrize("args,needle", [
    (["--sqsh", "/proc/x"], "under /proc"),
    (["--sqsh", "{file}"], "is a file, not a folder"),
    (["--sqsh", "{tmp}/s", "--sqsh-block-size", "banana"], "block size 'banana'"),
    (["--sqsh-block-size", "1M"], "without --sqsh"),
    (["--report", "{file}/r.json"], "is a file, not a folder"),
    (["--report", "{tmp}"], "is a folder"),
    (["--index", "default=notaurl"], "is not an index URL"),
    (["--index", "torch=https://h/x y"], "is not an index URL"),
    (["--secret", "id=x,src=/nonexistent"], "does not exist or is not readable"),
    (["--secret", "junk=1,id=x"], "unknown field 'junk'"),
    (["--secret", "id=a,env=TRAINBOX_SURELY_UNSET"], "is not set"),
    (["--output-dir", "{file}"], "is a file, not a folder"),
    (["--output-dir", "/proc/o"], "under /proc"),
    (["--output-dir", str(ROOT / "images")], "inside the repository"),
])
def test_build_options_are_checked_before_any_work(tmp_path, args, needle):
    (tmp_path / "afile").write_text("x")
    argv = [a.format(file=tmp_path / "afile", tmp=tmp_path) for a in args]
    r = cli("--cell", "smoke-x86_64", *argv)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "build plan" not in r.stdout and not (tmp_path / "s").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become another user")
@pytest.mark.parametrize("flag", ["--sqsh", "--report", "--output-dir"])
def test_a_folder_this_user_cannot_write_is_refused_before_any_work(flag):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="trainbox-ro-", dir="/tmp"))  # pytest's own tmp is root's only (0700)
    base.chmod(0o755)
    ro = base / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    target = str(ro / "r.json") if flag == "--report" else str(ro / "sub")
    try:
        r = cli("--cell", "smoke-x86_64", flag, target, user="nobody")
    finally:
        shutil.rmtree(base)
    assert r.returncode == 2 and "not writable" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
