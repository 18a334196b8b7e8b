"""A reader that went away: `build.py --list | head`, `trainbox --help | head -3`. The next print raised
BrokenPipeError and the CLI died with a traceback (then a second one from the interpreter's last flush). Here it is
a quiet end, as `ls | head` ends: nothing more printed, exit 141 (128 + SIGPIPE). Only for stdout: a broken socket
(a registry connection, a child's pipe) raises the same exception and stays an error (stdout_closed tells them
apart). Used by the host's CLIs (builder.errors.reports_user_errors) and the image's (the dispatcher, run_main,
the trainers' runner, and a last-resort hook for the rest)."""

from __future__ import annotations

import os
import select
import signal
import sys

EXIT_CODE = 128 + signal.SIGPIPE


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports POLLERR on its write end)."""
    try:
        p = select.poll()
        p.register(sys.stdout.fileno() if sys.stdout else 1, select.POLLOUT)
        return any(events & select.POLLERR for _, events in p.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout, or one without a descriptor (captured)
        return False


def reader_gone() -> int:
    """stdout pointed at /dev/null (the interpreter's final flush must not fail again); the exit code to return."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return EXIT_CODE


def install_hook() -> None:
    """The last resort for a command that does not catch it itself: an uncaught BrokenPipeError on a closed stdout
    ends without a traceback (exit 1, the interpreter's code for an uncaught exception; atexit handlers still run)."""
    previous = sys.excepthook
    if getattr(previous, "trainbox_pipes", False):
        return

    def hook(kind, value, tb):
        if issubclass(kind, BrokenPipeError) and stdout_closed():
            reader_gone()
            return
        previous(kind, value, tb)

    hook.trainbox_pipes = True
    sys.excepthook = hook
