"""The CLIs' edges (issue 65 cases 15, 16): a registry that does not answer is one line before any build (no
engine needed to see it), `--dry-run` refuses what the build refuses (one check both call), a reader that goes
away (`--list | head`) ends quietly, and an image without torch (the light stack) lists the trainers as not there
and refuses them in one line instead of a ModuleNotFoundError."""

import contextlib
import io
import os
import socket
import subprocess
import sys

import pytest

from builder import cli, docker
from builder.paths import ROOT

TAG = "smoke-x86_64"


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- case 16: registry preflight, dry-run = build


def test_a_registry_that_does_not_answer_is_one_line_before_any_build(tmp_path):
    """Through build.py, no engine anywhere (DOCKER_HOST points at nothing): the closed port is named, exit 2, before
    the builder, the engine or the lock step is asked."""
    port = _closed_port()
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/trainbox.sock"}
    r = subprocess.run([sys.executable, str(ROOT / "build.py"), TAG, "--push", "--registry",
                        f"127.0.0.1:{port}/trainbox", "--output-dir", str(tmp_path / "out"), "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and f"registry 127.0.0.1:{port} did not answer: it is unreachable" in lines[0], lines
    assert "Connection refused" in lines[0] and "Traceback" not in r.stderr
    assert "no Docker engine answers" not in r.stderr  # the registry was asked first


@pytest.mark.parametrize("extra, words", [
    (["--builder", "legacy"], "--builder legacy for smoke-x86_64: the legacy builder cannot build these Dockerfiles"),
    (["--wheelhouse", "/nonexistent/wheels"], "--wheelhouse /nonexistent/wheels: not a directory"),
    (["--cache-from", "type=registry,ref=127.0.0.1:5555/cache:x"], "--cache-from/--cache-to need buildx"),
])
def test_the_dry_run_refuses_what_the_build_refuses(tmp_path, monkeypatch, extra, words):
    """One check (options.check_buildable) for both: the dry run used to print a plan for each of these."""
    # This host's docker CLI as one without buildx (the engine's own BuildKit): what --cache-from needs is absent.
    monkeypatch.setattr(docker, "choose_builder", lambda requested: docker.Builder("buildkit", "/usr/bin/docker"))
    empty = tmp_path / "empty-wheels"
    empty.mkdir()
    for mode in (["--dry-run"], []):
        out = tmp_path / f"out{len(mode)}"
        rc, stdout, stderr = run_cli(TAG, "--output-dir", str(out), *extra, *mode)
        assert rc == 2 and stdout == "", (mode, stdout, stderr)
        assert len(stderr.splitlines()) == 1 and words in stderr, (mode, stderr)
        assert not (out / "images").exists()  # refused before a file was rendered
    rc, _, stderr = run_cli(TAG, "--output-dir", str(tmp_path / "w"), "--wheelhouse", str(empty), "--dry-run")
    assert rc == 2 and "no .whl files in it" in stderr
    rc, stdout, _ = run_cli(TAG, "--output-dir", str(tmp_path / "ok"), "--dry-run")
    assert rc == 0 and "build plan: 1 image(s)" in stdout


# ---------------------------------------------------------------- case 15: a reader that goes away


@pytest.mark.parametrize("cmd", [[str(ROOT / "build.py"), "--list"], [str(ROOT / "build.py"), "--explain"],
                                 ["-m", "trainbox", "--help"], ["-m", "builder.slurm", "--help"]])
def test_a_closed_reader_ends_the_listing_quietly(cmd):
    """`build.py --list | head`: BrokenPipeError tracebacks (two: the print, then the interpreter's last flush)."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    try:
        p = subprocess.run([sys.executable, *cmd], stdout=w, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert p.returncode in (0, 141), (p.returncode, p.stderr)


def test_pipes_tells_a_closed_stdout_from_a_broken_socket():
    from common import pipes

    code = ("import os, sys, time\nfrom common import pipes\ntime.sleep(0.3)\n"
            "print(pipes.stdout_closed(), file=sys.stderr)")
    for close_reader, want in ((True, "True"), (False, "False")):
        r, w = os.pipe()
        if close_reader:
            os.close(r)
        p = subprocess.run([sys.executable, "-c", code], stdout=w, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        os.close(w)
        if not close_reader:
            os.close(r)
        assert p.stderr.strip() == want, p.stderr
    assert pipes.EXIT_CODE == 141


# ---------------------------------------------------------------- case 15: the light image


@pytest.fixture(scope="module")
def light_python(tmp_path_factory):
    """A Python without torch, transformers, TRL (the light stack of the aarch64 smoke image): a bare venv."""
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


def test_a_light_image_lists_what_it_cannot_run_and_refuses_it_in_one_line(light_python):
    from common import commands

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([light_python, "-m", "trainbox", "--help"], capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 0, r.stderr
    listed = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.startswith("  ")}
    needing = [c.name for c in commands.TABLE if c.public and c.needs]
    assert set(commands.names(trainer=True)) <= set(needing)
    for name in needing:
        assert "(not in this image: needs torch" in listed[name], listed[name]
    assert "not in this image" not in listed["doctor"]
    for name in needing:
        for args in ([], ["--help"]):
            p = subprocess.run([light_python, "-m", "trainbox", name, *args], capture_output=True, text=True, env=env,
                               cwd="/", timeout=60)
            assert p.returncode == 2 and "Traceback" not in p.stderr, (name, p.stderr)
            lines = p.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"trainbox: error: {name} needs torch"), lines
