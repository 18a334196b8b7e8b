"""Index plumbing against a real PEP 503 simple index on 127.0.0.1 (http.server over wheels downloaded from the
default index): `--index default=URL` makes the lock step resolve from it alone, and when it goes away the lock
step stops with one line naming it, writing nothing. This is what a mirror or an air-gapped wheelhouse looks like."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import liveindex
import simpleindex
from builder import engine as eng
from builder.matrix import load_matrix
from builder.paths import ROOT
from devenv import engine as devengine

# the wheels come from the live default index (downloaded once, cached)
pytestmark = pytest.mark.network

CELL = "smoke-aarch64"   # the light stack: ~70 wheels, tens of MB, and an arch that is not the host's


@pytest.fixture(scope="module")
def wheels() -> Path:
    """The cell's locked wheels for aarch64/cp311, downloaded once (hash-checked) and cached."""
    dest = devengine.cache_dir() / "pep503" / CELL
    done = dest / ".complete"
    if done.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none",
           "-d", str(dest), "-r", str(ROOT / "locks" / f"{CELL}.txt")]
    for plat in ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64", "linux_aarch64"):
        cmd += ["--platform", plat]
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_CERT="/etc/ssl/certs/ca-certificates.crt")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0 and re.search(r"(?i)connection|network|resolve|timed out", p.stderr):
        liveindex.unreachable(p.stderr.strip()[-200:])
    assert p.returncode == 0, p.stderr[-2000:]
    done.touch()
    return dest


def _lock(out: Path, url: str) -> subprocess.CompletedProcess:
    # UV_NO_CACHE: every answer comes from the server now, not from uv's cache of an earlier run
    return subprocess.run([sys.executable, str(ROOT / "build.py"), "--lock", CELL, "--output-dir", str(out),
                           "--index", f"default={url}"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, UV_NO_CACHE="1"))


def test_lock_resolves_from_a_local_simple_index_and_fails_cleanly_without_it(wheels, tmp_path):
    root = tmp_path / "index"
    simpleindex.write_index(wheels, root)
    log = tmp_path / "server.log"
    with simpleindex.serve(root, log) as url:
        p = _lock(tmp_path / "out", url)
        assert p.returncode == 0, p.stderr
    served = log.read_text()
    assert "GET /simple/jupyterlab/ " in served and "GET /files/jupyterlab-4.6.6-" in served
    # The same pins and hashes as the committed lock (which came from the default index itself).
    cell = next(c for c in load_matrix(ROOT / "matrix.toml").cells if c.tag == CELL)
    new = (tmp_path / "out" / cell.lock).read_text()
    pins = lambda t: re.findall(r"^([a-z0-9_.\-]+==\S+)", t, re.M)   # noqa: E731
    assert pins(new) == pins((ROOT / cell.lock).read_text())
    # the index URL (its port) lands only in the "resolved from" comment, never in a pin or the inputs digest
    port = url.split(":")[-1].split("/")[0]
    assert [ln for ln in new.splitlines() if port in ln and not ln.startswith("# resolved from: ")] == []
    # The same override reaches the build as INDEX_URL (the Dockerfile's pip then uses it as its index).
    assert eng.cell_build_args(cell, index_overrides={"default": url})["INDEX_URL"] == url
    # The server is gone: one line naming the index, exit 2, nothing written.
    p = _lock(tmp_path / "out2", url)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"default = {url}" in p.stderr
    assert not (tmp_path / "out2").exists()
