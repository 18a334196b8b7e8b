"""Index plumbing against a real PEP 503 simple index on 127.0.0.1 (http.server over wheels downloaded from the
default index): `--index default=URL` makes the lock step resolve from it alone, and when it goes away the lock
step stops with one line naming it, writing nothing. This is what a mirror or an air-gapped wheelhouse looks like."""
from __future__ import annotations

import hashlib
import html
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import liveindex
from builder import engine as eng
from builder.matrix import ROOT, load_matrix
from devenv import engine as devengine

# the wheels come from the live default index (downloaded once, cached)
pytestmark = pytest.mark.network

CELL = "smoke-aarch64"   # the light stack: ~70 wheels, tens of MB, and an arch that is not the host's


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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


def _simple_index(wheels: Path, root: Path) -> None:
    """PEP 503: /simple/ lists projects, /simple/<normalized>/ lists files with #sha256= fragments."""
    projects: dict[str, list[Path]] = {}
    for w in sorted(wheels.glob("*.whl")):
        projects.setdefault(_norm(w.name.split("-")[0]), []).append(w)
    (root / "files").mkdir(parents=True)
    for name, files in projects.items():
        d = root / "simple" / name
        d.mkdir(parents=True)
        links = []
        for f in files:
            (root / "files" / f.name).symlink_to(f)
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            links.append(f'<a href="../../files/{html.escape(f.name)}#sha256={digest}">{html.escape(f.name)}</a><br>')
        (d / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    (root / "simple" / "index.html").write_text(
        "<!DOCTYPE html><html><body>\n" + "\n".join(f'<a href="{n}/">{n}</a><br>' for n in sorted(projects))
        + "\n</body></html>\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lock(out: Path, url: str) -> subprocess.CompletedProcess:
    # UV_NO_CACHE: every answer comes from the server now, not from uv's cache of an earlier run
    return subprocess.run([sys.executable, str(ROOT / "build.py"), "--lock", CELL, "--output-dir", str(out),
                           "--index", f"default={url}"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, UV_NO_CACHE="1"))


def test_lock_resolves_from_a_local_simple_index_and_fails_cleanly_without_it(wheels, tmp_path):
    root = tmp_path / "index"
    _simple_index(wheels, root)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/simple/"
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
                                   "--directory", str(root)], stderr=f, stdout=f)
    try:
        deadline = time.monotonic() + 60   # a loaded CI box can take seconds to start python
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        p = _lock(tmp_path / "out", url)
        assert p.returncode == 0, p.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)
    served = log.read_text()
    assert "GET /simple/jupyterlab/ " in served and "GET /files/jupyterlab-4.6.6-" in served
    # The same pins and hashes as the committed lock (which came from the default index itself).
    cell = next(c for c in load_matrix(ROOT / "matrix.toml").cells if c.tag == CELL)
    new = (tmp_path / "out" / cell.lock).read_text()
    pins = lambda t: re.findall(r"^([a-z0-9_.\-]+==\S+)", t, re.M)   # noqa: E731
    assert pins(new) == pins((ROOT / cell.lock).read_text())
    assert str(port) not in new   # the index URL never lands in a lock
    # The same override reaches the build as INDEX_URL (the Dockerfile's pip then uses it as its index).
    assert eng.cell_build_args(cell, index_overrides={"default": url})["INDEX_URL"] == url
    # The server is gone: one line naming the index, exit 2, nothing written.
    p = _lock(tmp_path / "out2", url)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"default = {url}" in p.stderr
    assert not (tmp_path / "out2").exists()
