"""JupyterLab on 0.0.0.0:$JUPYTER_PORT (8888) in /workspace, always behind a token or a hashed password.

Auth, first that is set: JUPYTER_TOKEN, JUPYTER_TOKEN_FILE (a file holding the token), JUPYTER_PASSWORD_HASH (a
jupyter_server hash: python -c "from jupyter_server.auth import passwd; print(passwd())"); with none, a random
token is generated and the URL with it is printed. It never starts unauthenticated: once the server answers, this
checks that /api/status refuses a request without credentials and stops the server if not (e.g. a config file that
empties the token). The secret goes to the server through its environment, never its command line (which other users
of a shared Slurm node can read with ps).

Root: refused unless --allow-root (or JUPYTER_ALLOW_ROOT=1): the image's user is `trainer`, and root with a
browser-reachable shell is rarely what anyone meant. Exception: uid 0 inside a user namespace (enroot --root, rootless
podman) is an unprivileged user outside, so it is allowed.

Healthcheck: `trainbox healthcheck` reads the state file this writes (port, pid) and asks /api (no token needed).

Quiet start: the auth probe asks /login without credentials (200 = the login form: auth is on; a redirect = the
server let an anonymous user in), which the server logs at debug level, unlike a refused /api/status (a `403` warning
at every start). The URL carrying a generated token is printed once, by this module (the server masks it).

Examples: the notebooks shipped in the image (/opt/trainbox/trainbox/image/examples) are copied to ROOT/examples at
start when that folder does not exist yet and the root is writable (a mounted work folder gets them once; a user's
own `examples` folder is never touched).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common.errors import UsageError

DEFAULT_PORT = 8888
DEFAULT_ROOT = "/workspace"
READY_TIMEOUT_S = 180  # a cold start on a network filesystem can be slow; the healthcheck's start_period covers it


@dataclass(frozen=True)
class Auth:
    token: str  # "" when only a password is used
    hashed_password: str
    source: str  # where it came from, for the banner


def resolve_auth(env: dict[str, str]) -> Auth:
    """The credentials from the environment (see the module doc); raises UsageError for unusable ones."""
    token_set, file_set = "JUPYTER_TOKEN" in env, bool(env.get("JUPYTER_TOKEN_FILE"))
    hashed = env.get("JUPYTER_PASSWORD_HASH", "").strip()
    if token_set and file_set:
        raise UsageError("both JUPYTER_TOKEN and JUPYTER_TOKEN_FILE are set; keep one")
    if token_set:
        token = env["JUPYTER_TOKEN"].strip()
        if not token:
            raise UsageError("JUPYTER_TOKEN is set but empty: this image never runs Jupyter without auth; "
                             "unset it (a token is generated) or give a token")
        source = "JUPYTER_TOKEN"
    elif file_set:
        path = Path(env["JUPYTER_TOKEN_FILE"])
        try:
            token = path.read_text(encoding="utf-8").strip()  # a trailing newline would become part of the token
        except OSError as e:
            raise UsageError(f"JUPYTER_TOKEN_FILE={path}: can't read it ({e.strerror}); "
                             "mount the file or fix the path") from None
        except UnicodeDecodeError:
            raise UsageError(f"JUPYTER_TOKEN_FILE={path} is not UTF-8 text; put the token in it as text") from None
        if not token:
            raise UsageError(f"JUPYTER_TOKEN_FILE={path} is empty; put the token in it")
        source = f"JUPYTER_TOKEN_FILE ({path})"
    else:
        token, source = "", ""
    if hashed:
        check_password_hash(hashed)
        if not token:
            source = "JUPYTER_PASSWORD_HASH"
    if not token and not hashed:
        token, source = secrets.token_hex(24), "generated"
    return Auth(token=token, hashed_password=hashed, source=source)


def check_password_hash(hashed: str) -> None:
    """jupyter_server's formats: 'argon2:$argon2id$...' or 'ALGO:SALT:HEXDIGEST' with a hashlib algorithm."""
    if re.fullmatch(r"argon2:\$argon2(id|i|d)\$\S+", hashed):
        return
    algo, _, rest = hashed.partition(":")
    salt, _, digest = rest.partition(":")
    if algo in hashlib.algorithms_available and salt and re.fullmatch(r"[0-9a-f]+", digest or "-"):
        return
    raise UsageError("JUPYTER_PASSWORD_HASH is not a jupyter_server password hash (expected 'argon2:$argon2id$...' "
                     "or 'sha1:SALT:HEX'); make one with: python -c \"from jupyter_server.auth import passwd; "
                     "print(passwd())\"")


def port_from(value: str | None, where: str) -> int:
    if value is None or value == "":
        return DEFAULT_PORT
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise UsageError(f"{where}={value!r}: a port must be a number from 1 to 65535")
    return int(value)


def in_user_namespace() -> bool:
    """True when uid 0 here is someone else outside (enroot, rootless podman, docker userns-remap)."""
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return False
    return [ln.split() for ln in lines if ln.strip()] != [["0", "0", "4294967295"]]


def root_allowed(flag: bool, env: dict[str, str]) -> bool:
    """Whether to pass allow_root; raises UsageError for a real root that didn't opt in."""
    if os.geteuid() != 0:
        return False
    if in_user_namespace():
        return True
    if flag or env.get("JUPYTER_ALLOW_ROOT", "").lower() in ("1", "true", "yes"):
        print("jupyter: warning: running as root (you asked for it with --allow-root/JUPYTER_ALLOW_ROOT)",
              file=sys.stderr)
        return True
    raise UsageError("refusing to run Jupyter as root (uid 0): notebooks get a shell with root's powers. The image's "
                     "user is 'trainer' — drop `--user root`/`-u 0`; or pass --allow-root (JUPYTER_ALLOW_ROOT=1) if "
                     "you mean it")


def state_file(env: dict[str, str] | None = None) -> Path:
    """Where a running `trainbox jupyter` records its port (per user: /tmp is shared on a Slurm node)."""
    env = os.environ if env is None else env
    base = env.get("TRAINBOX_STATE_DIR") or os.path.join(tempfile.gettempdir(), f"trainbox-{os.getuid()}")
    return Path(base) / "jupyter.json"


def prepare_state_dir(path: Path) -> None:
    """Checked before the server starts, so a bad state dir is one clear error, not a silent healthcheck gap."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"can't create {path.parent} ({e.strerror}); set TRAINBOX_STATE_DIR to a writable "
                         "directory") from None
    if path.parent.stat().st_uid != os.getuid():  # someone else's dir in a shared /tmp: don't trust it
        raise UsageError(f"{path.parent} belongs to another user; set TRAINBOX_STATE_DIR to a directory of yours")


def write_state(path: Path, state: dict) -> None:
    from common import atomic

    atomic.write_text(path, json.dumps(state), mode=0o600)


def build_command(port: int, ip: str, root_dir: Path, auth: Auth, allow_root: bool, extra: list[str]) -> list[str]:
    # trainbox.image.labserver is jupyterlab's launcher plus a check of the resolved settings before anything listens.
    cmd = [sys.executable, "-m", "trainbox.image.labserver",
           f"--ServerApp.ip={ip}", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0",  # the published port is fixed: fail loudly rather than move silently
           "--ServerApp.allow_unauthenticated_access=False",  # a handler without an auth rule needs a login too
           f"--ServerApp.root_dir={root_dir}", "--ServerApp.open_browser=False"]
    if auth.hashed_password:
        cmd.append(f"--PasswordIdentityProvider.hashed_password={auth.hashed_password}")
    if allow_root:
        cmd.append("--ServerApp.allow_root=True")
    return cmd + extra


def child_env(auth: Auth, ip: str, port: int) -> dict[str, str]:
    from trainbox.image.labserver import BIND_ENV

    env = dict(os.environ)
    env[BIND_ENV] = json.dumps({"ip": ip, "port": port})
    env.pop("JUPYTER_TOKEN_FILE", None)  # resolved above (stripped); the server takes the value from JUPYTER_TOKEN
    if auth.token:
        env["JUPYTER_TOKEN"] = auth.token
    else:
        env.pop("JUPYTER_TOKEN", None)
    return env


def http_status(url: str, timeout: float = 5.0) -> int | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # report the 302 itself


def auth_probe(base: str, timeout: float = 5.0) -> int | None:
    """HTTP status of GET /login without credentials: 200 (the login form) when auth is on, 302 when it is off."""
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(base + "/login"), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


EXAMPLES = Path(__file__).resolve().parents[1] / "image" / "examples"


def seed_examples(root_dir: Path, source: Path = EXAMPLES) -> Path | None:
    """Copy the shipped notebooks to ROOT/examples if that doesn't exist and ROOT is writable; the copy or None."""
    dest = root_dir / "examples"
    if not source.is_dir() or dest.exists() or not os.access(root_dir, os.W_OK):
        return None
    import shutil

    from common import atomic

    try:
        with atomic.replacing_dir(dest, replace=False) as tmp:  # a user's own examples/ is never replaced
            shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)
    except OSError:
        return None
    return dest


def banner(port: int, auth: Auth, ip: str = "0.0.0.0") -> str:
    wildcard = ip in ("0.0.0.0", "", "*", "::")
    hosts = [probe_base(ip, port).split("//")[1].rsplit(":", 1)[0]] + ([socket.gethostname()] if wildcard else [])
    if auth.source == "generated":
        urls = [f"http://{h}:{port}/lab?token={auth.token}" for h in hosts]
        how = "token generated for this run"
    else:
        urls = [f"http://{h}:{port}/lab" for h in hosts]
        how = f"log in with the {'password' if auth.source == 'JUPYTER_PASSWORD_HASH' else 'token'} from {auth.source}"
    return "\n".join(["", f"JupyterLab is up ({how}); open one of:", *[f"    {u}" for u in urls],
                      "(from another machine: the port you published/forwarded instead of " f"{port})", ""])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainbox jupyter", description=__doc__.split("\n\n")[0],
                                epilog="Anything after `--` goes to `jupyter lab` as is.")
    p.add_argument("--port", default=None, help=f"port (default: $JUPYTER_PORT or {DEFAULT_PORT})")
    p.add_argument("--ip", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    p.add_argument("--root-dir", default=os.environ.get("JUPYTER_ROOT_DIR", DEFAULT_ROOT),
                   help=f"notebook root (default: $JUPYTER_ROOT_DIR or {DEFAULT_ROOT})")
    p.add_argument("--allow-root", action="store_true", help="run even as real root (also JUPYTER_ALLOW_ROOT=1)")
    argv, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = p.parse_args(argv)

    env = dict(os.environ)
    port = port_from(args.port, "--port") if args.port is not None else port_from(env.get("JUPYTER_PORT"),
                                                                                   "JUPYTER_PORT")
    check_ip(args.ip)
    root_dir = Path(args.root_dir)
    if not root_dir.is_dir():
        raise UsageError(f"notebook root {root_dir} is not a directory; mount one there (-v DIR:{root_dir}) or "
                         "pass --root-dir / JUPYTER_ROOT_DIR")
    auth = resolve_auth(env)
    allow_root = root_allowed(args.allow_root, env)
    seeded = seed_examples(root_dir)
    if seeded:
        print(f"jupyter: example notebooks copied to {seeded}", file=sys.stderr, flush=True)
    cmd = build_command(port, args.ip, root_dir.resolve(), auth, allow_root, extra)
    state = state_file()
    prepare_state_dir(state)
    base = probe_base(args.ip, port)
    refused = []

    def watch(server: Server) -> None:
        """Once the server answers: auth must be on at the address it listens on, else stop it (exit 1)."""
        write_state(state, {"pid": server.proc.pid, "port": port, "url": base + "/"})
        deadline = time.monotonic() + READY_TIMEOUT_S
        while http_status(base + "/api", timeout=2) != 200:
            if not _alive(server.proc.pid):
                return  # it exited by itself; its own log (or labserver's refusal) says why
            if time.monotonic() > deadline:
                refused.append(None)
                print(f"jupyter: error: the server did not answer on {base} within {READY_TIMEOUT_S} s, so its "
                      "authentication could not be checked; stopping it (is --ip an address of this machine?)",
                      file=sys.stderr, flush=True)
                server.stop()
                return
            time.sleep(0.2)
        status = auth_probe(base)
        if status != 200:
            refused.append(status)
            print(f"jupyter: error: the server let a request without credentials in (/login answered HTTP {status} "
                  "instead of the login form): something (a jupyter_server_config file?) disabled authentication; "
                  "stopping it", file=sys.stderr, flush=True)
            server.stop()
            return
        print(banner(port, auth, args.ip), file=sys.stderr, flush=True)

    try:
        code = serve(cmd, child_env(auth, args.ip, port), watch)
    finally:
        try:
            state.unlink()
        except OSError:
            pass
    return 1 if refused and code == 0 else code


def probe_base(ip: str, port: int) -> str:
    """Where the server answers from this machine: a wildcard address on loopback, any other address as itself."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "*": "127.0.0.1", "::": "::1"}.get(ip, ip)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def check_ip(ip: str) -> str:
    """An IP address or a host name, else one line (the server would otherwise die with a traceback)."""
    import ipaddress

    try:
        ipaddress.ip_address(ip)
        return ip
    except ValueError:
        if ip in ("", "*") or re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?"
                                           r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*", ip):
            return ip
    raise UsageError(f"--ip {ip[:80]!r} is not an IP address or a host name; e.g. --ip 0.0.0.0 (every address) "
                     "or --ip 127.0.0.1")


# What a container runtime, Slurm or a user sends to stop or poke the server: it gets them from us, exactly once.
# The server runs in its own session, so a signal to our process group (tini -g under `docker stop`, Ctrl-C, Slurm)
# does not reach it a second time: the second SIGTERM could land after jupyter_server had put the default disposition
# back while shutting down, and the container then exited 143 instead of 0 (seen in a CI rehearsal, compose stop).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# A stop is over within this: past it the server and everything it started (kernels run in sessions of their own)
# are killed. jupyter_server's own shutdown waits for kernels and terminals; 15 s covers a clean one.
STOP_DEADLINE_S = 15.0


class Server:
    """The server process and the deadline of a stop that has begun."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.kill_at: float | None = None

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        if self.kill_at is None:
            self.kill_at = time.monotonic() + STOP_DEADLINE_S
        self.send(signum)

    def kill(self) -> None:
        import psutil

        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its session's group: it leads it (start_new_session)
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()


def serve(cmd: list[str], env: dict[str, str], watch) -> int:
    """Run the server as our child (we keep the state file and the auth probe), pass it our signals, wait for it,
    return its exit code (128+N if a signal N ended it). A stop that takes longer than STOP_DEADLINE_S is finished
    with SIGKILL. PID 1's duties (reaping, group signals) are tini's."""
    server = Server(cmd, env)

    def forward(signum, frame):  # noqa: ARG001
        server.stop(signum) if signum in STOPPING else server.send(signum)

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        threading.Thread(target=watch, args=(server,), daemon=True).start()
        while True:
            try:
                code = server.proc.wait(timeout=0.5)  # short waits: Python runs the handlers between them
                break
            except subprocess.TimeoutExpired:
                if server.kill_at is not None and time.monotonic() > server.kill_at:
                    print(f"jupyter: error: the server did not stop within {STOP_DEADLINE_S:.0f} s; killed it and "
                          "what it started", file=sys.stderr, flush=True)
                    server.kill()
                    server.kill_at = float("inf")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - code if code < 0 else code


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    from trainbox.dispatch import run_main

    sys.exit(run_main(main, prog="trainbox jupyter"))
