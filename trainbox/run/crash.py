"""A crash in training ends the run promptly: traceback printed, the run's child processes killed, then an exit that
skips Python's exit handlers (what hung). No emergency checkpoint (see ends_on_crash).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from common.errors import UsageError


class Crashed(SystemExit):
    """Raised by ends_on_crash once the crash is reported and the run's other processes are gone."""


@contextlib.contextmanager
def ends_on_crash():
    """Any exception out of training (an OOM included) ends the run, promptly: the traceback is printed, SIGTERM/SIGINT
    get their default (deadly) action back, this process's children (DataLoader workers, which ignore SIGTERM for
    preemption's sake and made multiprocessing's exit handler wait forever) are killed, and Crashed unwinds to the
    entrypoint's main, which leaves with exit_now() after the run log is copied. No emergency checkpoint: a state
    that just raised (a half-applied optimizer step, a CUDA error) is not safe to save. Other ranks: torchrun ends
    them when this one exits (SIGTERM, then SIGKILL after its grace period)."""
    try:
        yield
    except (UsageError, SystemExit):
        raise
    except BaseException:
        # SIGCHLD too: torch's loader handler would report the workers we kill below as a second error.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, signal.SIG_DFL)
        import traceback

        traceback.print_exc()
        print("[trainbox] the run crashed (above): stopping its processes; exit code 1", file=sys.stderr, flush=True)
        kill_children()
        raise Crashed(1) from None


def kill_children() -> None:
    """SIGKILL every process this one started (recursively): loader workers, compile workers, tokenizer pools."""
    import psutil

    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.kill()
    psutil.wait_procs(kids, timeout=5)


in_kernel = False  # notebook.run sets it: a crash there returns its code to the notebook, the kernel lives on


def exit_now(code: int) -> int:
    """Leave without Python's exit handlers (multiprocessing's joins, NCCL's teardown): they are what hung. In a
    notebook kernel (the children are dead already) the code is returned instead."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if in_kernel:
        return code
    os._exit(code)
