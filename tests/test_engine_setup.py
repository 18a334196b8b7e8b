"""devenv.engine: idempotent up, status, and down stopping only what up started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from builder.errors import UserError
from devenv import engine as devengine
from enginefix import BUILD_TIMEOUT, ROOT

# a cold first build (debootstrap + the session images, arm64 under QEMU) runs inside the first test's setup
pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "devenv.engine", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=300)


def test_up_is_idempotent_and_status_answers(engine):  # noqa: F811
    before = devengine.load_state()
    again = _cli("up")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["registry"] == engine["registry"]
    after = devengine.load_state()
    # nothing new was started: same pids as before the second `up`
    assert {k: v for k, v in after.items() if k.endswith("_pid")} == \
           {k: v for k, v in before.items() if k.endswith("_pid")}
    st = _cli("status")
    assert st.returncode == 0, st.stdout + st.stderr
    status = json.loads(st.stdout)
    assert status["engine"] and status["registry_answers"] and status["binfmt_aarch64"]


def test_down_stops_only_what_up_started(engine, tmp_path):  # noqa: F811
    # A second registry on another port with its own state: `up` reuses the running engine and binfmt, starts
    # only the registry; `down` must stop that registry and leave the engine answering.
    port = _free_port()
    env = dict(os.environ, TRAINBOX_CACHE=str(tmp_path / "cache"), TRAINBOX_REGISTRY_PORT=str(port))
    up = _cli("up", env=env)
    assert up.returncode == 0, up.stderr
    state = json.loads((tmp_path / "cache" / "engine" / "state.json").read_text())
    assert set(k for k in state if k.endswith("_pid")) == {"registry_pid"}
    assert devengine.registry_answers(f"127.0.0.1:{port}")
    down = _cli("down", env=env)
    assert down.returncode == 0, down.stderr
    assert not devengine.registry_answers(f"127.0.0.1:{port}")
    assert devengine.engine_answers()
    assert devengine.registry_answers(engine["registry"])
    assert devengine.binfmt_enabled()


def test_bad_port_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("TRAINBOX_REGISTRY_PORT", "fifty")
    with pytest.raises(UserError, match="TRAINBOX_REGISTRY_PORT"):
        devengine.registry_address()
    r = _cli("up", env=dict(os.environ, TRAINBOX_REGISTRY_PORT="99999"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "TRAINBOX_REGISTRY_PORT" in r.stderr
