"""`trainbox jupyter` with the real JupyterLab: auth always (200 with the token, 403 without or wrong), the healthcheck,
a config that disables auth is caught, bad input exits 2, root policy."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TOKEN = "s3cret-token-for-tests-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Jupyter:
    def __init__(self, tmp: Path, env: dict[str, str] | None = None, args=(), prefix=(), port=None):
        self.port = port or free_port()
        self.tmp = tmp
        (tmp / "work").mkdir(exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
        self.env.update(PYTHONPATH=str(ROOT), HOME=str(tmp), TRAINBOX_STATE_DIR=str(tmp / "state"),
                        JUPYTER_CONFIG_DIR=str(tmp / "cfg"), JUPYTER_DATA_DIR=str(tmp / "data"),
                        JUPYTER_RUNTIME_DIR=str(tmp / "rt"))
        self.env.update(env or {})
        self.log = open(tmp / "jupyter.log", "w+")
        root = ["--allow-root"] if os.geteuid() == 0 and not prefix else []
        self.proc = subprocess.Popen(
            [*prefix, PY, "-m", "entrypoints", "jupyter", "--port", str(self.port), "--root-dir", str(tmp / "work"),
             *root, *args], env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)
        self.base = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return (self.tmp / "jupyter.log").read_text()

    def wait_ready(self, timeout=150):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter exited {self.proc.returncode}:\n{self.output()}")
            if "JupyterLab is up" in self.output():
                return self
            time.sleep(0.2)
        raise AssertionError(f"not up after {timeout}s:\n{self.output()}")

    def status(self, path, **kw) -> int:
        return requests.get(self.base + path, timeout=10, allow_redirects=False, **kw).status_code

    def healthcheck(self) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "entrypoints", "healthcheck"], env=self.env, capture_output=True, text=True,
                              timeout=60)

    def stop(self, pid=None) -> int:
        if self.proc.poll() is None:
            os.kill(pid or self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.log.close()


@pytest.fixture
def jupyter(tmp_path):
    started = []

    def start(**kw):
        j = Jupyter(tmp_path, **kw)
        started.append(j)
        return j

    yield start
    for j in started:
        if j.proc.poll() is None:
            j.proc.kill()
            j.proc.wait()


def test_token_from_env_200_with_it_403_without_or_wrong(jupyter):
    j = jupyter(env={"JUPYTER_TOKEN": TOKEN}).wait_ready()
    assert j.status("/api/status", headers={"Authorization": f"token {TOKEN}"}) == 200
    assert j.status(f"/api/status?token={TOKEN}") == 200
    assert j.status("/api/status") == 403
    assert j.status("/api/status", headers={"Authorization": "token wrong-token"}) == 403
    assert j.status("/api/status?token=wrong-token") == 403
    assert j.status("/api/contents") == 403
    assert j.status("/api") == 200  # the healthcheck's target needs no token
    assert TOKEN not in j.output()  # a token the user chose isn't echoed into logs
    cmdline = Path(f"/proc/{j.proc.pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline  # nor put where `ps` shows it
    hc = j.healthcheck()
    assert hc.returncode == 0 and "answers" in hc.stdout, hc.stdout
    state = json.loads((j.tmp / "state" / "jupyter.json").read_text())
    assert state["port"] == j.port
    code = j.stop()
    assert code == 0, j.output()   # one SIGTERM, forwarded once: a clean stop, not a death by signal
    assert not (j.tmp / "state" / "jupyter.json").exists()
    hc = j.healthcheck()
    assert hc.returncode == 0 and "no Jupyter" in hc.stdout


def test_no_credentials_generates_a_token_and_prints_the_url(jupyter):
    j = jupyter().wait_ready()
    m = re.search(rf"http://127\.0\.0\.1:{j.port}/lab\?token=([0-9a-f]+)", j.output())
    assert m, j.output()
    token = m.group(1)
    assert len(token) >= 32
    assert j.status(f"/api/status?token={token}") == 200
    assert j.status("/api/status") == 403
    assert j.status("/api/status?token=" + "0" * len(token)) == 403
    j.stop()


def test_token_file_is_stripped(jupyter, tmp_path):
    f = tmp_path / "tok"
    f.write_text(TOKEN + "\n")
    j = jupyter(env={"JUPYTER_TOKEN_FILE": str(f)}).wait_ready()
    assert j.status(f"/api/status?token={TOKEN}") == 200
    assert j.status("/api/status") == 403
    j.stop()


def test_hashed_password_login(jupyter):
    from jupyter_server.auth import passwd

    j = jupyter(env={"JUPYTER_PASSWORD_HASH": passwd("correct horse")}).wait_ready()
    assert j.status("/api/status") == 403
    s = requests.Session()
    s.get(j.base + "/login", timeout=10)
    xsrf = s.cookies.get("_xsrf")
    bad = s.post(j.base + "/login", data={"password": "wrong", "_xsrf": xsrf}, timeout=10, allow_redirects=False)
    assert bad.status_code == 401
    assert s.get(j.base + "/api/status", timeout=10).status_code == 403
    ok = s.post(j.base + "/login", data={"password": "correct horse", "_xsrf": xsrf}, timeout=10,
                allow_redirects=False)
    assert ok.status_code == 302
    assert s.get(j.base + "/api/status", timeout=10).status_code == 200
    j.stop()


def test_config_that_disables_auth_is_caught_and_stopped(jupyter, tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "jupyter_server_config.json").write_text(json.dumps({"IdentityProvider": {"token": ""}}))
    j = jupyter(env={"JUPYTER_TOKEN": TOKEN})
    assert j.proc.wait(150) == 1, j.output()
    assert "without credentials" in j.output()


def test_busy_port_fails_instead_of_moving(jupyter):
    """The published port is fixed: a busy one is an error (port_retries=0), never a silent move elsewhere."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        j = jupyter(env={"JUPYTER_TOKEN": TOKEN}, port=s.getsockname()[1])
        code = j.proc.wait(150)
    assert code != 0
    assert "already in use" in j.output() or "could not be started" in j.output(), j.output()
    assert not (j.tmp / "state" / "jupyter.json").exists()


def test_unhealthy_when_jupyter_does_not_answer(tmp_path):
    """A state file whose process lives but whose port is dead -> unhealthy (1)."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "jupyter.json").write_text(json.dumps({"pid": os.getpid(), "port": free_port()}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRAINBOX_STATE_DIR=str(state))
    r = subprocess.run([PY, "-m", "entrypoints", "healthcheck"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "unhealthy" in r.stdout


@pytest.mark.skipif(subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                   capture_output=True).returncode != 0, reason="needs root for a PID namespace")
def test_docker_stop_as_pid1(jupyter):
    """Like `docker run IMAGE jupyter` then `docker stop`: SIGTERM to PID 1 from outside stops the server cleanly."""
    j = jupyter(env={"JUPYTER_TOKEN": TOKEN, "JUPYTER_ALLOW_ROOT": "1"},
                prefix=("unshare", "--pid", "--fork", "--mount-proc"))
    j.wait_ready()
    assert j.status(f"/api/status?token={TOKEN}") == 200
    kids = Path(f"/proc/{j.proc.pid}/task/{j.proc.pid}/children").read_text().split()
    code = j.stop(pid=int(kids[0]))
    assert code == 0, j.output()   # one SIGTERM, forwarded once: a clean stop, not a death by signal
    assert "stopping" in j.output()  # the server got the signal (its own log line), not a kill


def run_jupyter(args, env, tmp_path, uid_root_ok=True):
    e = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
    e.update(PYTHONPATH=str(ROOT), TRAINBOX_STATE_DIR=str(tmp_path / "state"), **env)
    return subprocess.run([PY, "-m", "entrypoints", "jupyter", "--root-dir", str(tmp_path), *args], env=e,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("env,args,needle", [
    ({"JUPYTER_TOKEN": ""}, [], "JUPYTER_TOKEN is set but empty"),
    ({"JUPYTER_TOKEN": "a", "JUPYTER_TOKEN_FILE": "/x"}, [], "keep one"),
    ({"JUPYTER_TOKEN_FILE": "/nonexistent/tok"}, [], "JUPYTER_TOKEN_FILE=/nonexistent/tok"),
    ({"JUPYTER_PASSWORD_HASH": "hunter2"}, [], "not a jupyter_server password hash"),
    ({"JUPYTER_PORT": "http"}, [], "JUPYTER_PORT='http'"),
    ({}, ["--port", "70000"], "--port='70000'"),
    ({}, ["--root-dir", "/nonexistent/ws"], "/nonexistent/ws is not a directory"),
])
def test_bad_input_exits_2_with_one_clear_line(env, args, needle, tmp_path):
    r = run_jupyter(["--allow-root", *args], env, tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "state" / "jupyter.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the root refusal needs root")
def test_real_root_is_refused_without_opt_in(tmp_path):
    r = run_jupyter([], {"JUPYTER_TOKEN": TOKEN}, tmp_path)
    if subprocess.run([PY, "-c", "import sys; from entrypoints.jupyter import in_user_namespace as u; "
                       "sys.exit(u())"], env=dict(os.environ, PYTHONPATH=str(ROOT))).returncode:
        pytest.skip("this test process already runs in a user namespace (root here isn't real root)")
    assert r.returncode == 2 and "refusing to run Jupyter as root" in r.stderr and "--allow-root" in r.stderr


def test_root_in_a_user_namespace_is_allowed():
    """enroot --root / rootless podman: uid 0 maps to an unprivileged user outside, so no opt-in is needed."""
    probe = ["unshare", "--user", "--map-root-user", "true"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("user namespaces unavailable here")
    code = ("import os; from entrypoints.jupyter import root_allowed, in_user_namespace; "
            "assert os.geteuid() == 0 and in_user_namespace(); print(root_allowed(False, {}))")
    r = subprocess.run(["unshare", "--user", "--map-root-user", PY, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
