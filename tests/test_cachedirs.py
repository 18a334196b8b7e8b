"""trainbox.run.cachedirs: caches move off an unwritable $HOME, only when they must, and the user's variables win.

An unwritable home without mocks, even as root: a HOME below a regular file (mkdir fails with ENOTDIR), or on a
read-only bind mount (EROFS, what enroot's read-only root gives) when we may mount.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainbox.run import cachedirs

ROOT = Path(__file__).resolve().parents[1]
ALL = (*cachedirs.CACHE_VARS, *cachedirs.RUNTIME_VARS)


def _env(home: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ALL}
    env.update(HOME=home, **extra)
    return env


def _blocked_home(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("")
    return str(tmp_path / "file" / "home")


def test_writable_home_changes_nothing(tmp_path):
    env = _env(str(tmp_path / "home"))
    out = io.StringIO()
    assert cachedirs.apply(env, out) == {} and out.getvalue() == ""
    assert not set(ALL) & set(env)


def test_unwritable_home_moves_every_cache_to_a_temp_dir_and_says_so(tmp_path):
    env = _env(_blocked_home(tmp_path))
    out = io.StringIO()
    added = cachedirs.apply(env, out)
    base = cachedirs._temp_base()
    assert set(added) == set(ALL)
    assert env["HF_HOME"] == f"{base}/cache/huggingface" and env["XDG_CACHE_HOME"] == f"{base}/cache"
    assert env["JUPYTER_RUNTIME_DIR"] == f"{base}/jupyter-runtime"
    assert all(cachedirs.writable_dir(env[v]) for v in ALL)
    line = out.getvalue()
    assert line.count("\n") == 1 and "is not writable" in line and f"{base}/cache" in line and "HF_HOME" in line


def test_user_variables_win(tmp_path):
    mine = str(tmp_path / "mine")
    env = _env(_blocked_home(tmp_path), HF_HOME="/nowhere/hf", XDG_CACHE_HOME=mine)
    added = cachedirs.apply(env, io.StringIO())
    assert env["HF_HOME"] == "/nowhere/hf" and "HF_HOME" not in added  # kept even though it can't be written
    assert env["XDG_CACHE_HOME"] == mine and env["TRITON_CACHE_DIR"] == f"{mine}/triton"  # their base is ours
    env = _env(_blocked_home(tmp_path), **{v: "/set" for v in ALL})
    out = io.StringIO()
    assert cachedirs.apply(env, out) == {} and out.getvalue() == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")
def test_dispatcher_under_a_read_only_home(tmp_path):
    """What enroot does to $HOME: it exists, on a read-only mount. The dispatcher sets the folders before the child."""
    home = tmp_path / "home"
    home.mkdir()
    script = (f"mount --bind {home} {home} && mount -o remount,bind,ro {home} && "
              f"exec {sys.executable} -m trainbox doctor --help")
    env = _env(str(home), PYTHONPATH=str(ROOT))
    r = subprocess.run(["unshare", "--mount", "sh", "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"$HOME ({home}) is not writable" in r.stderr and "HF_HOME" in r.stderr
    r = subprocess.run([sys.executable, "-m", "trainbox", "doctor", "--help"], env=env, capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0 and "not writable" not in r.stderr  # same command, writable home: silent
