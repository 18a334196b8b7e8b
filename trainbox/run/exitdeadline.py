"""A rank whose training is over leaves within a deadline, whatever holds its exit.

torchrun's agents end a multi-node run with a barrier: each waits up to 300 s (its exit_barrier_timeout) for the
other nodes' ranks to exit. A rank that outlives that window (an exit handler or a library thread holding the
process after training returned) turns a finished job into a failed one: the agent that hosts the rendezvous store
gives up and leaves, and the other node's agent, still watching its rank, loses the store (RendezvousConnectionError,
the task exits 1). Seen once on CI: a resumed 2-node sft, rank 1's node failed 300 s after rank 0 was done.

`arm(code)` starts a daemon thread: if the process still runs `EXIT_GRACE_S` later, it prints every thread's stack
(what held it) and leaves with the run's own exit code. The thread runs while Python joins non-daemon threads and
calls exit handlers, the two places a finished process can wait on others. Armed where a rank's work is over: ranks
other than the main one once every rank has met at the end (runsummary.leave_process_group: the process group's
teardown is covered too); every rank once train() returned (runner.run_trainer).

The deadline thread needs the GIL, and a native destructor can hold it forever: seen once in a CI rehearsal, DDP's
Reducer freeing a gloo process group joined a worker thread while holding the GIL, and that worker waited for the
GIL (py-spy). So `arm` also sets faulthandler's watchdog, a C thread that needs no GIL: BACKSTOP_S after the
deadline it dumps every thread's Python stack and exits 1 (not the run's code: it cannot know it).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback

from trainbox.run import crash

# Inside the agents' 300 s window with two minutes to spare, and far beyond a normal exit (a few seconds): exit
# handlers that legitimately take a while (an experiment tracker's last upload on rank 0) get three minutes.
EXIT_GRACE_S = 180.0
BACKSTOP_S = 30.0  # after the deadline: the GIL-free watchdog's exit (module docstring)


_armed: threading.Thread | None = None


def arm(code: int, seconds: float | None = None) -> threading.Thread | None:
    """From now on this process has SECONDS (EXIT_GRACE_S) to exit; past that, every stack, then exit with CODE.
    Armed once: a second call keeps the first, earlier deadline."""
    global _armed
    if _armed is not None or crash.in_kernel:  # a notebook kernel lives on after a run: nothing to bound
        return _armed
    seconds = EXIT_GRACE_S if seconds is None else seconds

    def expire():
        time.sleep(seconds)
        print(f"[trainbox] rank {os.environ.get('RANK', '?')}: training ended {seconds:.0f}s ago and this process has"
              f" not exited; what holds it follows; leaving with exit code {code}", file=sys.stderr, flush=True)
        print(stacks(), file=sys.stderr, flush=True)
        crash.exit_now(code)

    _armed = threading.Thread(target=expire, name="trainbox-exit-deadline", daemon=True)
    _armed.start()
    faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)
    return _armed


def stacks() -> str:
    """Every other thread's Python stack, named (this thread's own is the deadline's sleep)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    return "\n".join(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)).rstrip()
                     for ident, frame in sys._current_frames().items() if ident != me)
