"""Start (or reuse) a Docker engine, a local registry on 127.0.0.1 and QEMU binfmt for arm64; stop what we started.

`python -m builder.setup_engine up|down|status` (`make engine` / `make engine-stop`). Idempotent: whatever already
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
import time
import urllib.error
import urllib.request
from pathlib import Path

from builder import atomic
from builder.errors import UserError, reports_user_errors
from builder.procs import pid_alive, stop_pid

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


def cache_dir() -> Path:
    return Path(os.environ.get("TRAINBOX_CACHE") or Path.home() / ".cache" / "trainbox")


def state_dir() -> Path:
    d = cache_dir() / "engine"
    d.mkdir(parents=True, exist_ok=True)
    return d


def registry_port() -> int:
    raw = os.environ.get("TRAINBOX_REGISTRY_PORT", str(DEFAULT_PORT))
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise UserError(f"TRAINBOX_REGISTRY_PORT={raw!r} is not a TCP port; set it to a number between 1 and 65535")
    return int(raw)


def registry_address() -> str:
    return f"127.0.0.1:{registry_port()}"


def _state_path() -> Path:
    return state_dir() / "state.json"


def load_state() -> dict:
    try:
        return json.loads(_state_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _save_state(state: dict) -> None:
    path = _state_path()
    atomic.write_text(path, json.dumps(state, indent=2) + "\n")


def _log(msg: str) -> None:
    print(f"[engine] {msg}", file=sys.stderr, flush=True)


def docker_cli() -> str:
    """The CLI to talk to the engine: $TRAINBOX_DOCKER, else the first `docker` on PATH."""
    cli = os.environ.get("TRAINBOX_DOCKER") or shutil.which("docker") or "/usr/bin/docker"
    return cli


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


def _apt_install(packages: list[str]) -> None:
    if not packages:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise UserError(
            f"missing tools: install the Debian/Ubuntu packages {' '.join(packages)} (as root: apt-get install -y "
            f"{' '.join(packages)}), then run `make engine` again")
    _log(f"apt-get install {' '.join(packages)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lists = Path("/var/lib/apt/lists")
    if not any(lists.glob("*Packages*")):
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], env=env)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
        r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], env=env)
    if r.returncode != 0:
        raise UserError(f"apt-get install {' '.join(packages)} failed (exit {r.returncode}); see the output above")


def _have(cmd: str) -> bool:
    return shutil.which(cmd) is not None or Path("/usr/sbin", cmd).exists() or Path("/usr/bin", cmd).exists()


def _spawn(argv: list[str], log_name: str) -> int:
    log = open(state_dir() / log_name, "ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # survives the pytest/make process that started it
    return proc.pid


def _wait(predicate, what: str, timeout: float, pid: int | None = None, log_name: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if pid is not None and not pid_alive(pid):
            break
        time.sleep(0.5)
    tail = ""
    if log_name:
        try:
            tail = " | ".join((state_dir() / log_name).read_text(errors="replace").strip().splitlines()[-3:])
        except OSError:
            pass
    raise UserError(f"{what} did not come up within {timeout:.0f}s (log {state_dir() / (log_name or '')}: {tail})")


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
    _save_state(state)
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
    tmp = cfg.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(cfg)
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
    _save_state(state)
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
    _save_state(state)
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
        raise UserError(f"could not enable the qemu-aarch64 binfmt handler: {r.stderr.strip() or 'not enabled'}; "
                        "install qemu-user-static and binfmt-support, then run `update-binfmts --enable qemu-aarch64`")
    state["binfmt_enabled"] = True
    _save_state(state)


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
    _save_state(state)
    return {"registry": registry_address(), "docker": docker_cli(), "state": str(_state_path())}


def down() -> None:
    state = load_state()
    if "registry_pid" in state:
        stop_pid(state.pop("registry_pid"), log=_log, what="registry")
    if "registry_container" in state:
        subprocess.run([docker_cli(), "rm", "-f", state.pop("registry_container")], capture_output=True)
    if "dockerd_pid" in state:
        stop_pid(state.pop("dockerd_pid"), timeout=60, log=_log, what="dockerd")
    if state.pop("binfmt_enabled", False):
        subprocess.run(["update-binfmts", "--disable", "qemu-aarch64"], capture_output=True)
    if state.pop("binfmt_mounted", False):
        subprocess.run(["umount", str(BINFMT_DIR)], capture_output=True)
    _save_state(state)
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
    parser = argparse.ArgumentParser(prog="python -m builder.setup_engine", description=__doc__.splitlines()[0])
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
