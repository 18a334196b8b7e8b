"""The dispatcher: `trainbox NAME [ARGS]` / `python -m entrypoints NAME [ARGS]` runs the entrypoint `entrypoints.NAME`.

Listing reads each module's docstring with `ast` (no import: `--help` stays instant and a module that isn't written
yet, or needs torch, can't break it). Running: as PID 1 (`docker run`) it supervises the entrypoint as a child —
forwards signals, reaps orphans, exits with the child's code (128+N if killed by signal N); otherwise it execs the
entrypoint in place so signals and exit codes are native (pyxis/enroot, a shell, Slurm). Before an entrypoint
starts, cache folders move off an unwritable $HOME (entrypoints/cachedirs.py).
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROG = "trainbox"
# The public entrypoints in the order --help shows them; hidden ones run but aren't listed.
PUBLIC = ("jupyter", "grpo", "qlora", "sft", "doctor")
HIDDEN = ("healthcheck",)
# Signals a container runtime or a user sends that the entrypoint must see (SIGWINCH: terminal resizes).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
             signal.SIGWINCH)
# Testing/odd runtimes: force the supervisor even when not PID 1 (e.g. under a PID-1 shell that doesn't forward).
FORCE_SUPERVISE_ENV = "TRAINBOX_SUPERVISE"


def module_file(name: str) -> Path:
    return PACKAGE_DIR / f"{name}.py"


def summary(name: str) -> str | None:
    """First line of entrypoints/NAME.py's docstring, read without importing it; None if the module is absent."""
    try:
        tree = ast.parse(module_file(name).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    doc = ast.get_docstring(tree) or ""
    return doc.strip().splitlines()[0] if doc.strip() else "(no description)"


def usage() -> str:
    lines = [f"usage: {PROG} NAME [ARGS...]   ({PROG} NAME --help for an entrypoint's options)", "", "entrypoints:"]
    for name in PUBLIC:
        line = summary(name)
        lines.append(f"  {name:<9} {line if line is not None else '(not installed in this image)'}")
    lines += ["", "Same command inside Docker (`docker run IMAGE NAME ...`) and under Slurm/pyxis "
              f"(`srun --container-image=X.sqsh {PROG} NAME ...`).",
              "Any other program on PATH runs as given (`docker run -it IMAGE bash`, "
              "`enroot start IMAGE python x.py`)."]
    return "\n".join(lines)


def child_command(name: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", f"entrypoints.{name}", *args]


def child_env() -> dict[str, str]:
    """Make sure the child imports this same package (and not PyPI's old `entrypoints`) whatever its cwd."""
    env = dict(os.environ)
    home = str(PACKAGE_DIR.parent)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if home not in parts:
        env["PYTHONPATH"] = os.pathsep.join([home, *parts])
    return env


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _isolate_child(mask: set) -> None:  # runs in the child between fork and exec
    # Own process group that owns the terminal (if any): a tty's Ctrl-C reaches the entrypoint once, directly.
    os.setpgid(0, 0)
    try:
        os.tcsetpgrp(0, os.getpgrp())  # allowed: SIGTTOU is ignored here (inherited from the parent)
    except OSError:
        pass  # no terminal
    for s in (signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def supervise(cmd: list[str], env: dict[str, str] | None = None, on_start=None) -> int:
    """Run `cmd` as a child like an init: forward FORWARDED signals, reap every child, return the main child's code.

    Signals are blocked and collected with sigtimedwait (never lost between spawn and wait; and a blocked signal is
    delivered even to a PID 1, which drops signals whose disposition is the default). `on_start(pid)`, if given, runs
    in a daemon thread once the child exists (it inherits the blocked mask, so signals still come here).
    """
    wanted = set(FORWARDED) | {signal.SIGCHLD}
    _become_subreaper()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    old_tt = [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTTIN, signal.SIGTTOU)]
    try:
        try:
            child = subprocess.Popen(cmd, env=env, preexec_fn=lambda: _isolate_child(old_mask))
        except OSError as e:
            print(f"{PROG}: can't start {cmd[0]}: {e.strerror}", file=sys.stderr)
            return 127
        if on_start is not None:
            import threading

            threading.Thread(target=on_start, args=(child.pid,), daemon=True).start()
        code = None
        while code is None:
            info = signal.sigtimedwait(wanted, 1.0)  # the timeout also catches a coalesced SIGCHLD
            if info is not None and info.si_signo != signal.SIGCHLD:
                try:
                    os.kill(child.pid, info.si_signo)
                except ProcessLookupError:
                    pass
            code = _reap(child.pid)
        child.returncode = code  # reaped by us, not by Popen
        _reap(None)  # orphans that finished meanwhile
        return code
    finally:
        for s, h in zip((signal.SIGTTIN, signal.SIGTTOU), old_tt):
            signal.signal(s, h)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _become_subreaper() -> None:
    """Not PID 1 (forced supervisor): still adopt and reap orphaned grandchildren, like an init would."""
    if os.getpid() == 1 or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # best effort: only orphan reaping is lost


def _reap(main_pid: int | None) -> int | None:
    """Reap every exited child (orphans re-parented to PID 1 included); the main child's exit code if it was one."""
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return code
        if pid == 0:
            return code
        if pid == main_pid:
            code = _exit_code(status)


def run_main(main, argv: list[str] | None = None, prog: str | None = None) -> int:
    """For an entrypoint's `if __name__ == "__main__":` — a UsageError becomes one line on stderr and exit 2."""
    from entrypoints.errors import UsageError

    try:
        return main(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"{prog or PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def main(argv: list[str]) -> int:
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    if name in ("-h", "--help", "help"):
        print(usage())
        return 0
    if name not in PUBLIC + HIDDEN:
        # The image's ENTRYPOINT is this dispatcher, and enroot's /etc/rc passes its arguments to it: a program
        # on PATH (bash, python) runs as given, like in any other image.
        program = shutil.which(name) if not name.startswith("-") else None
        if program is None:
            print(f"{PROG}: unknown entrypoint {name!r} (and no program of that name on PATH)\n\n{usage()}",
                  file=sys.stderr)
            return 2
        return run_child([program, *args], dict(os.environ))
    if not module_file(name).is_file():
        print(f"{PROG}: entrypoint {name!r} is not installed in this image ({module_file(name)} is missing); "
              f"`{PROG} --help` lists what is", file=sys.stderr)
        return 2
    if name in PUBLIC:
        # Before the entrypoint imports HF/torch: under enroot/pyxis defaults $HOME is read-only (cachedirs.py).
        from entrypoints import cachedirs

        cachedirs.apply()
    return run_child(child_command(name, args), child_env())


def run_child(cmd: list[str], env: dict[str, str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    if os.getpid() == 1 or os.environ.get(FORCE_SUPERVISE_ENV) == "1":
        return supervise(cmd, env)
    try:
        os.execve(cmd[0], cmd, env)
    except OSError as e:
        print(f"{PROG}: can't run {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 126
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
