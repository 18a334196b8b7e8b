"""Container healthcheck: 0 when no Jupyter runs here (e.g. the container trains) or Jupyter's /api answers 200.

Used by the image's HEALTHCHECK (`trainbox healthcheck`); hidden from `trainbox --help`. Reads the state file that
`trainbox jupyter` writes (port, pid). /api answers without a token, so no secret is needed here.
"""

from __future__ import annotations

import json
import sys

import psutil

from trainbox.cli.jupyter import http_status, state_file


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    path = state_file()
    try:
        state = json.loads(path.read_text())
        pid, port = int(state["pid"]), int(state["port"])
    except FileNotFoundError:
        print("healthy: no Jupyter in this container")
        return 0
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"unhealthy: unreadable state file {path} ({e})")
        return 1
    if not psutil.pid_exists(pid):
        print(f"healthy: no Jupyter running (stale state file {path}, pid {pid} is gone)")
        return 0
    # The address the server listens on (trainbox jupyter --ip); old state files have none: loopback.
    base = state.get("url", f"http://127.0.0.1:{port}/").rstrip("/")
    status = http_status(f"{base}/api", timeout=5)
    if status == 200:
        print(f"healthy: Jupyter answers on port {port}")
        return 0
    print(f"unhealthy: Jupyter (pid {pid}) doesn't answer on port {port} (" +
          (f"HTTP {status})" if status else "no connection)"))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
