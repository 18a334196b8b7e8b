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
from functools import partial
from pathlib import Path

import pytest
import requests

import sidebyside

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TOKEN = "s3cret-token-for-tests-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Jupyter:
    def __init__(self, tmp: Path, env: dict[str, str] | None = None, args=(), prefix=(), port=None, ip=None,
                 extra=()):
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
            [*prefix, PY, "-m", "trainbox", "jupyter", "--port", str(self.port), "--root-dir", str(tmp / "work"),
             *root, *(["--ip", ip] if ip else []), *args, *(["--", *extra] if extra else [])],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)
        host = {None: "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(ip, ip)
        self.base = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

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
        return subprocess.run([PY, "-m", "trainbox", "healthcheck"], env=self.env, capture_output=True, text=True,
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


def hammer(j: Jupyter) -> list[int]:
    """Unauthenticated requests, as fast as they go, until the server process ends: the HTTP statuses answered."""
    answered = []
    deadline = time.monotonic() + 90
    while j.proc.poll() is None and time.monotonic() < deadline:
        for path in ("/api/contents", "/api/status"):
            try:
                answered.append(requests.get(j.base + path, timeout=2, allow_redirects=False).status_code)
            except requests.RequestException:
                pass
        time.sleep(0.01)
    return answered


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


IPS = ["127.0.0.1", "127.0.0.2", "0.0.0.0", *(["::1"] if ipv6_loopback() else [])]


@pytest.mark.parametrize("ip", IPS)
def test_passthrough_that_empties_the_token_is_refused_before_any_request(jupyter, ip):
    """Any address: the resolved settings are checked before the server listens, so not one request is served."""
    j = jupyter(env={"JUPYTER_TOKEN": TOKEN}, ip=ip, extra=["--IdentityProvider.token="])
    answered = hammer(j)
    assert j.proc.wait(60) == 2, j.output()
    assert answered == [], answered
    errors = [ln for ln in j.output().splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "authentication is off" in errors[0], j.output()
    assert not (j.tmp / "state" / "jupyter.json").exists()


@pytest.mark.parametrize("config", [
    ("jupyter_server_config.json", json.dumps({"IdentityProvider": {"token": ""}})),
    ("jupyter_server_config.py", 'c.IdentityProvider.token = ""\nc.ServerApp.token = ""\n'),
    ("jupyter_server_config.py", 'c.ServerApp.disable_check_xsrf = True\n'),
    ("jupyter_server_config.py", 'from jupyter_server.auth.identity import IdentityProvider\n'
                                 'class Anyone(IdentityProvider):\n    pass\n'
                                 'c.ServerApp.identity_provider_class = Anyone\n'),
])
def test_config_file_that_weakens_auth_is_refused_before_any_request(jupyter, tmp_path, config):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / config[0]).write_text(config[1])
    j = jupyter(env={"JUPYTER_TOKEN": TOKEN}, ip="127.0.0.2")
    answered = hammer(j)
    assert j.proc.wait(60) == 2, j.output()
    assert answered == [], answered
    assert "refusing to start" in j.output()


@pytest.mark.parametrize("extra,needle", [
    # Options trainbox jupyter sets itself: traitlets refuses a second value (exit 1), naming it.
    ("--ServerApp.ip=127.0.0.3", "ServerApp.ip"),
    ("--ServerApp.allow_unauthenticated_access=True", "allow_unauthenticated_access"),
    # One it doesn't set: labserver's check refuses it (exit 2).
    ("--ServerApp.disable_check_xsrf=True", "disable_check_xsrf is on"),
])
def test_passthrough_that_weakens_the_server_is_refused(jupyter, extra, needle):
    j = jupyter(env={"JUPYTER_TOKEN": TOKEN}, ip="127.0.0.2", extra=[extra])
    assert hammer(j) == []
    assert j.proc.wait(60) in (1, 2), j.output()
    assert needle in j.output()


def test_the_check_refuses_a_server_that_moved_or_listens_on_a_socket():
    """What a config file could do if the command line no longer won: the check itself, on a resolved ServerApp."""
    from jupyter_server.auth.identity import PasswordIdentityProvider

    from trainbox.image.labserver import insecure_settings

    class App:
        identity_provider = PasswordIdentityProvider(token=TOKEN)
        disable_check_xsrf = allow_unauthenticated_access = False
        ip, port, sock = "127.0.0.2", 8888, ""

    bind = {"ip": "127.0.0.2", "port": 8888}
    assert insecure_settings(App(), bind) == []
    moved = App()
    moved.ip = "0.0.0.0"
    assert "not the 127.0.0.2:8888" in " ".join(insecure_settings(moved, bind))
    sock = App()
    sock.sock = "/tmp/x.sock"
    assert "ServerApp.sock" in " ".join(insecure_settings(sock, bind))
    open_ = App()
    open_.identity_provider = PasswordIdentityProvider(token="")
    assert "authentication is off" in " ".join(insecure_settings(open_, bind))


@pytest.mark.parametrize("ip", [i for i in IPS if i != "127.0.0.1"])
def test_good_token_on_any_address_serves_only_authenticated_requests(jupyter, ip):
    j = jupyter(env={"JUPYTER_TOKEN": TOKEN}, ip=ip).wait_ready()
    assert j.status("/api/contents") == 403
    assert j.status("/api/status") == 403
    assert j.status("/api/contents", headers={"Authorization": f"token {TOKEN}"}) == 200
    s = requests.Session()
    s.get(j.base + "/lab", timeout=10)  # the _xsrf cookie an attacker's page could get
    xsrf = s.cookies.get("_xsrf", "")
    assert s.post(j.base + "/api/terminals", headers={"X-XSRFToken": xsrf}, timeout=10).status_code == 403
    hc = j.healthcheck()
    assert hc.returncode == 0 and "answers" in hc.stdout, hc.stdout  # the healthcheck asks the bound address
    assert j.stop() == 0, j.output()


@pytest.mark.parametrize("bad", ["not an address!", "1.2.3.4.5.6;rm", "-x"])
def test_bad_ip_is_one_line(tmp_path, bad):
    r = run_jupyter(["--allow-root", f"--ip={bad}"], {"JUPYTER_TOKEN": TOKEN}, tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--ip" in r.stderr, r.stderr


def test_stop_ends_within_the_deadline_even_if_the_server_ignores_it(tmp_path):
    """A server stuck in shutdown (seen: 3 of 9 stops hung) is killed with what it started once the deadline passes."""
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time, signal; signal.signal(15, signal.SIG_IGN); "
            "time.sleep(300)'], start_new_session=True); print('up', flush=True); time.sleep(300)")
    script = (f"import os, signal, sys, threading, time\n"
              f"from trainbox.cli import jupyter as J\n"
              f"J.STOP_DEADLINE_S = 2\n"
              f"threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()\n"
              f"sys.exit(J.serve([sys.executable, '-c', {code!r}], dict(os.environ), lambda s: None))\n")
    t0 = time.monotonic()
    r = subprocess.run([PY, "-c", script], env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 128 + signal.SIGKILL, r.stderr
    assert "did not stop within 2 s" in r.stderr
    assert took < 10, took
    stray = subprocess.run(["pgrep", "-f", "time.sleep\\(300\\)"], capture_output=True, text=True).stdout.split()
    assert stray == [], f"left running: {stray}"


def test_twenty_stops_at_random_moments_never_hang(jupyter, tmp_path):
    """SIGTERM at any moment of the start (before, during, after the auth probe) ends the wrapper within the
    stated deadline (STOP_DEADLINE_S), 20 times, and leaves no server behind. The runs go one per core (each has its
    own port and folder): in a row their random waits alone took ~42 s."""
    import random

    from trainbox.cli.jupyter import STOP_DEADLINE_S

    def once(i: int) -> None:
        run = tmp_path / f"run{i}"
        run.mkdir()
        j = Jupyter(run, env={"JUPYTER_TOKEN": TOKEN}, ip="127.0.0.2")
        time.sleep(random.Random(18 + i).uniform(0.2, 4.0))
        t0 = time.monotonic()
        os.kill(j.proc.pid, signal.SIGTERM)
        try:
            j.proc.wait(STOP_DEADLINE_S + 10)
        except subprocess.TimeoutExpired:
            j.proc.kill()
            raise AssertionError(f"run {i}: no exit {STOP_DEADLINE_S + 10:.0f} s after SIGTERM:\n{j.output()}")
        finally:
            j.log.close()
        assert time.monotonic() - t0 < STOP_DEADLINE_S + 2, (i, j.output())
        with pytest.raises(requests.ConnectionError):
            requests.get(j.base + "/api", timeout=2)

    sidebyside.in_parallel([partial(once, i) for i in range(20)])


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
    r = subprocess.run([PY, "-m", "trainbox", "healthcheck"], env=env, capture_output=True, text=True)
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
    return subprocess.run([PY, "-m", "trainbox", "jupyter", "--root-dir", str(tmp_path), *args], env=e,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("env,args,needle", [
    ({"JUPYTER_TOKEN": ""}, [], "JUPYTER_TOKEN is set but empty"),
    ({"JUPYTER_TOKEN": "a", "JUPYTER_TOKEN_FILE": "/x"}, [], "keep one"),
    ({"JUPYTER_TOKEN_FILE": "/nonexistent/tok"}, [], "JUPYTER_TOKEN_FILE=/nonexistent/tok"),
    ({"JUPYTER_TOKEN_FILE": "BINARY"}, [], "is not UTF-8 text"),
    ({"JUPYTER_PASSWORD_HASH": "hunter2"}, [], "not a jupyter_server password hash"),
    ({"JUPYTER_PORT": "http"}, [], "JUPYTER_PORT='http'"),
    ({}, ["--port", "70000"], "--port='70000'"),
    ({}, ["--root-dir", "/nonexistent/ws"], "/nonexistent/ws is not a directory"),
])
def test_bad_input_exits_2_with_one_clear_line(env, args, needle, tmp_path):
    if env.get("JUPYTER_TOKEN_FILE") == "BINARY":
        (tmp_path / "tok.bin").write_bytes(b"\xff\xfe\x00token\x80")
        env = {"JUPYTER_TOKEN_FILE": str(tmp_path / "tok.bin")}
    r = run_jupyter(["--allow-root", *args], env, tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "state" / "jupyter.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the root refusal needs root")
def test_real_root_is_refused_without_opt_in(tmp_path):
    r = run_jupyter([], {"JUPYTER_TOKEN": TOKEN}, tmp_path)
    if subprocess.run([PY, "-c", "import sys; from trainbox.cli.jupyter import in_user_namespace as u; "
                       "sys.exit(u())"], env=dict(os.environ, PYTHONPATH=str(ROOT))).returncode:
        pytest.skip("this test process already runs in a user namespace (root here isn't real root)")
    assert r.returncode == 2 and "refusing to run Jupyter as root" in r.stderr and "--allow-root" in r.stderr


def test_root_in_a_user_namespace_is_allowed():
    """enroot --root / rootless podman: uid 0 maps to an unprivileged user outside, so no opt-in is needed."""
    probe = ["unshare", "--user", "--map-root-user", "true"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("user namespaces unavailable here")
    code = ("import os; from trainbox.cli.jupyter import root_allowed, in_user_namespace; "
            "assert os.geteuid() == 0 and in_user_namespace(); print(root_allowed(False, {}))")
    r = subprocess.run(["unshare", "--user", "--map-root-user", PY, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
