"""Processes we started in the background (engine, registry, Slurm daemons, exports): alive? stop them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def pid_alive(pid: int | None) -> bool:
    """True while `pid` runs. A zombie (exited, not yet reaped by us) counts as gone."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def stop_pid(pid: int | None, timeout: float = 30, log=None, what: str = "process") -> None:
    """SIGTERM, wait up to `timeout` seconds, then SIGKILL."""
    if not pid_alive(pid):
        return
    if log:
        log(f"stopping {what} (pid {pid})")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.2)
    if pid_alive(pid):
        if log:
            log(f"{what} (pid {pid}) ignored SIGTERM; SIGKILL")
        os.kill(pid, signal.SIGKILL)
