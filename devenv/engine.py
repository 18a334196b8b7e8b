"""Start (or reuse) a Docker engine, a local registry on 127.0.0.1 and QEMU binfmt for arm64; stop what we started.

`python -m devenv.engine up|down|status` (`make engine` / `make engine-stop`). Idempotent: whatever already
answers (an engine, a registry on the port, an enabled qemu-aarch64 handler) is used as is and never stopped by
`down`; what `up` starts is recorded in a state file so `down` stops exactly that, by pid.
On a machine that already has Docker it installs nothing for the engine; missing tools are installed with apt only
when we are root on Debian/Ubuntu, otherwise one clear error says what to install.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from builder.enroot import docker_cli  # the product's choice of CLI: the engine we start is the one it talks to
from builder.errors import UserError, reports_user_errors
from common import atomic
from devenv import qemu
from devenv.common import State, apt_install, cache_dir, logger, pid_alive, spawn, stop_pid, wait, which

DEFAULT_PORT = 5555
# Debian's engine here has no iptables rights; the default bridge still works without NAT rules.
DEFAULT_DOCKERD_ARGS = "--iptables=false --ip-masq=false"
APT_PACKAGES = {  # command -> Debian package providing it
    "dockerd": "docker.io",
    "docker-registry": "docker-registry",
    "skopeo": "skopeo",
    "debootstrap": "debootstrap",
    "update-binfmts": "binfmt-support",
    "qemu-aarch64-static": "qemu-user-static",
}
BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")


STATE = State("engine")
_log = logger("engine")


def state_dir() -> Path:
    return STATE.dir


def load_state() -> dict:
    return STATE.load()


def registry_port() -> int:
    raw = os.environ.get("TRAINBOX_REGISTRY_PORT", str(DEFAULT_PORT))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise UserError(f"TRAINBOX_REGISTRY_PORT={raw!r} is not a TCP port; set it to a number between 1 and 65535")
    return int(raw)


def registry_address() -> str:
    return f"127.0.0.1:{registry_port()}"


def engine_answers(timeout: float = 10) -> bool:
    try:
        r = subprocess.run([docker_cli(), "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                           text=True, timeout=timeout)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and bool(r.stdout.strip())


def registry_answers(address: str, timeout: float = 3) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=timeout) as resp:
            return resp.status == 200
    except urllib.error.HTTPError as e:
        return e.code == 401  # a registry with auth still answers
    except (OSError, ValueError):
        return False


def binfmt_enabled() -> bool:
    entry = BINFMT_DIR / "qemu-aarch64"
    try:
        return entry.read_text().splitlines()[0].strip() == "enabled"
    except (OSError, IndexError):
        return False


def _apt_install(packages) -> None:
    apt_install(packages, _log, then="run `make engine` again")


def _have(cmd: str) -> bool:
    return which(cmd) is not None


def _spawn(argv: list[str], log_name: str) -> int:
    return spawn(argv, state_dir() / log_name)


def _wait(predicate, what: str, timeout: float, pid: int | None = None, log_name: str | None = None) -> None:
    wait(predicate, what, timeout, pid, state_dir() / log_name if log_name else None)


def _ensure_engine(state: dict) -> None:
    if engine_answers():
        _log(f"engine answers ({docker_cli()}); using it")
        return
    if not _have("dockerd"):
        _apt_install(["docker.io"])
    if engine_answers():  # the package's service may have started it
        return
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    args = os.environ.get("TRAINBOX_DOCKERD_ARGS", DEFAULT_DOCKERD_ARGS).split()
    _log(f"starting {dockerd} {' '.join(args)}")
    pid = _spawn([dockerd, *args], "dockerd.log")
    state["dockerd_pid"] = pid
    STATE.save(state)
    _wait(engine_answers, "the Docker engine (dockerd)", 90, pid, "dockerd.log")
    _log(f"engine up (pid {pid})")


def _registry_config(port: int) -> Path:
    storage = cache_dir() / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    cfg = state_dir() / "registry.yml"
    text = (
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    atomic.write_text(cfg, text)
    return cfg


def _ensure_registry(state: dict) -> None:
    address = registry_address()
    if registry_answers(address):
        _log(f"registry answers at {address}; using it")
        return
    if not _have("docker-registry") and _registry_container(state, address):
        return
    if not _have("docker-registry"):
        _apt_install(["docker-registry"])
    binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    cfg = _registry_config(registry_port())
    _log(f"starting registry at {address}")
    pid = _spawn([binary, "serve", str(cfg)], "registry.log")
    state["registry_pid"] = pid
    state["registry"] = address
    STATE.save(state)
    _wait(lambda: registry_answers(address), f"the registry at {address}", 30, pid, "registry.log")


REGISTRY_CONTAINER = "trainbox-registry"


def _registry_container(state: dict, address: str) -> bool:
    """A machine with Docker but without Debian's docker-registry: run the registry image instead (installs
    nothing on the host). False when the image cannot be had (offline machine) -> fall back to the package."""
    storage = cache_dir() / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    subprocess.run([docker_cli(), "rm", "-f", REGISTRY_CONTAINER], capture_output=True)
    r = subprocess.run([docker_cli(), "run", "-d", "--name", REGISTRY_CONTAINER, "-p", f"{address}:5000",
                        "-v", f"{storage}:/var/lib/registry", "registry:2"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        return False
    state["registry_container"] = REGISTRY_CONTAINER
    state["registry"] = address
    STATE.save(state)
    _wait(lambda: registry_answers(address), f"the registry container at {address}", 60)
    _log(f"registry container {REGISTRY_CONTAINER} at {address}")
    return True


def _ensure_binfmt(state: dict) -> None:
    if binfmt_enabled():
        _log("qemu-aarch64 binfmt handler enabled")
        return
    missing = [APT_PACKAGES[c] for c in ("update-binfmts", "qemu-aarch64-static") if not _have(c)]
    _apt_install(missing)
    if not (BINFMT_DIR / "register").exists():
        r = subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT_DIR)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise UserError(f"cannot mount binfmt_misc at {BINFMT_DIR}: {r.stderr.strip()}; run as root or mount it")
        state["binfmt_mounted"] = True
    r = subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True, text=True)
    if r.returncode != 0 or not binfmt_enabled():
        # QEMU 10's qemu-user-binfmt (bookworm-backports: devenv/qemu.py) describes it in systemd's binfmt.d
        qemu.register()
    if not binfmt_enabled():
        raise UserError(f"could not enable the qemu-aarch64 binfmt handler: {r.stderr.strip() or 'not enabled'}; "
                        "install qemu-user-static and binfmt-support, then run `update-binfmts --enable qemu-aarch64`")
    state["binfmt_enabled"] = True
    STATE.save(state)


def up(tools: bool = True) -> dict:
    """Bring everything up; returns {"registry": "127.0.0.1:PORT", "docker": CLI path, ...}."""
    registry_address()  # bad settings fail before anything is started
    state = load_state()
    # Forget pids of processes that are gone (a previous session's machine).
    for key in ("dockerd_pid", "registry_pid"):
        if key in state and not pid_alive(state[key]):
            del state[key]
    _ensure_engine(state)
    if tools:
        missing = sorted({APT_PACKAGES[c] for c in ("skopeo", "debootstrap") if not _have(c)})
        _apt_install(missing)
    _ensure_registry(state)
    _ensure_binfmt(state)
    state["registry"] = registry_address()
    STATE.save(state)
    return {"registry": registry_address(), "docker": docker_cli(), "state": str(STATE.path)}


def down() -> None:
    state = load_state()
    if "registry_pid" in state:
        stop_pid(state.pop("registry_pid"), _log, "registry")
    if "registry_container" in state:
        subprocess.run([docker_cli(), "rm", "-f", state.pop("registry_container")], capture_output=True)
    if "dockerd_pid" in state:
        stop_pid(state.pop("dockerd_pid"), _log, "dockerd", timeout=60)
    if state.pop("binfmt_enabled", False):
        subprocess.run(["update-binfmts", "--disable", "qemu-aarch64"], capture_output=True)
    if state.pop("binfmt_mounted", False):
        subprocess.run(["umount", str(BINFMT_DIR)], capture_output=True)
    STATE.save(state)
    _log("stopped what `up` started")


def status() -> dict:
    state = load_state()
    return {
        "engine": engine_answers(),
        "docker": docker_cli(),
        "registry": registry_address(),
        "registry_answers": registry_answers(registry_address()),
        "binfmt_aarch64": binfmt_enabled(),
        "started_by_us": {k: v for k, v in state.items() if k.endswith("_pid") or k.startswith("binfmt")},
    }


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devenv.engine", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "status"])
    args = parser.parse_args(argv)
    if args.action == "up":
        print(json.dumps(up()))
    elif args.action == "down":
        down()
    else:
        st = status()
        print(json.dumps(st, indent=2))
        return 0 if st["engine"] and st["registry_answers"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
