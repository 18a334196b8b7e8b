"""What every test-machine set-up module shares: log lines, its state file, apt installs, waiting, our processes.

One copy here instead of one per module (engine, Slurm, bases). Errors are builder's UserError, so each module's
`python -m devenv.X` prints one line and exits 2 on a machine that lacks something.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from builder.errors import UserError
from common import atomic


def logger(tag: str):
    """log(msg) printing `[tag] msg` on stderr (stdout stays for what a command prints for scripts)."""

    def log(msg: str) -> None:
        print(f"[{tag}] {msg}", file=sys.stderr, flush=True)

    return log


def cache_dir() -> Path:
    """$TRAINBOX_CACHE, else ~/.cache/trainbox: state, logs, registry storage, base layers, test wheelhouses."""
    return Path(os.environ.get("TRAINBOX_CACHE") or Path.home() / ".cache" / "trainbox")


class State:
    """A module's state file (`<cache>/<name>/state.json`): what `up` started, so `down` stops exactly that."""

    def __init__(self, name: str):
        self.name = name

    @property
    def dir(self) -> Path:
        d = cache_dir() / self.name
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def path(self) -> Path:
        return self.dir / "state.json"

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def save(self, state: dict) -> None:
        atomic.write_text(self.path, json.dumps(state, indent=2) + "\n")

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def which(cmd: str) -> str | None:
    """`cmd` on PATH, or in the sbin folders a non-root PATH lacks (dockerd, slurmctld, debootstrap live there)."""
    return shutil.which(cmd) or next((f"{d}/{cmd}" for d in ("/usr/sbin", "/sbin", "/usr/bin")
                                      if Path(d, cmd).exists()), None)


def apt_install(packages, log, then: str = "run the command again") -> None:
    """Install Debian/Ubuntu packages (root only); elsewhere one error naming the packages and the next step."""
    packages = sorted(set(packages))
    if not packages:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise UserError(f"missing tools: install the Debian/Ubuntu packages {' '.join(packages)} (as root: "
                        f"apt-get install -y {' '.join(packages)}), then {then}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    log(f"apt-get install {' '.join(packages)}")
    if not any(Path("/var/lib/apt/lists").glob("*Packages*")):
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
    r = subprocess.run(install, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # stale package lists: refresh once and retry
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        r = subprocess.run(install, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise UserError(f"apt-get install {' '.join(packages)} failed (exit {r.returncode}): {tail[0]}")


def log_tail(path: Path | None, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:]) if path else ""
    except OSError:
        return ""


def wait(predicate, what: str, timeout: float, pid: int | None = None, log_file: Path | None = None) -> None:
    """Poll `predicate` until true; give up early when `pid` (the process we wait for) is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if pid is not None and not pid_alive(pid):
            break
        time.sleep(0.3)
    tail = log_tail(log_file)
    raise UserError(f"{what} did not come up within {timeout:.0f}s" + (f" (log {log_file}: {tail})" if log_file else ""))


def spawn(argv: list[str], log_file: Path) -> int:
    """Start a daemon that outlives the make/pytest process which started it; returns its pid."""
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc.pid


def pid_alive(pid: int | None) -> bool:
    """True while `pid` runs; a zombie (exited, not reaped) counts as gone."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's process: it exists
        return True


def stop_pid(pid: int | None, log, what: str = "process", timeout: float = 30) -> None:
    """SIGTERM, wait up to `timeout` seconds, then SIGKILL; only the one process we started, by its pid."""
    if not pid_alive(pid):
        return
    log(f"stopping {what} (pid {pid})")
    try:
        proc = psutil.Process(pid)
        proc.terminate()
        _, alive = psutil.wait_procs([proc], timeout=timeout)
        if alive and pid_alive(pid):
            log(f"{what} (pid {pid}) ignored SIGTERM; SIGKILL")
            proc.kill()
            psutil.wait_procs([proc], timeout=10)
    except psutil.NoSuchProcess:
        pass
