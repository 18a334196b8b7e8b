"""Preemption: SIGTERM/SIGUSR1 -> the ranks agree -> the Trainer saves a checkpoint and stops -> a clean exit.

Preemption contract (Slurm sends SIGTERM on scancel/preemption, or SIGUSR1 with `--signal=USR1@SECONDS`):
every rank installs handlers that only set a flag; the ranks agree on it at step ends without a blocking global sync
(`FlagAgreement`: a signal that reaches any rank during step N is acted on by every rank at the end of step N + 1;
one process: at the end of step N; a job's `--grace` should cover two steps and a save) and the Trainer writes a
normal `checkpoint-M` and returns. The process then exits with `exit_code()`: 0 by default, so torchrun and Slurm
see a clean end, and rerunning the same command resumes from checkpoint-M.
A job script that wants to requeue itself can set `TRAINBOX_PREEMPTED_EXIT_CODE` (e.g. 99) and test for it.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import sys
import time

from trainbox.run import outputs, resume

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_preempt_requested = False  # set by the signal handler (any rank)
_preempted = False  # set once the Trainer was told to save and stop
_checkpoint_saved: str | None = None


def _handler(signum, frame):
    global _preempt_requested
    _preempt_requested = True
    # Only async-signal-safe work here; the Trainer saves at the next step end.
    try:
        os.write(2, f"[trainbox] got signal {signal.Signals(signum).name}: will checkpoint and stop after this step\n".encode())
    except OSError:
        pass


def claim_preempt_signals() -> None:
    """Our handlers on SIGTERM/SIGUSR1, then both unblocked: a signal the dispatcher held back while it exec'ed this
    trainer (hold_preempt_signals) arrives now, into the handler."""
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, _handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPT_SIGNALS)


def hold_preempt_signals() -> None:
    """SIGTERM/SIGUSR1 blocked (pending, not lost) from here across exec: the dispatcher calls it before it execs a
    trainer, whose first act is claim_preempt_signals. Without it the seconds the trainer spends importing torch
    were a window where `docker stop` or `scancel` killed it (exit 143, nothing printed)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPT_SIGNALS)


def stop_before_training(name: str) -> int:
    """A SIGTERM/SIGUSR1 came before training began: nothing to save yet; one line, the preempted exit code."""
    global _preempted
    _preempted = True
    if outputs.is_main_process():
        print(f"[trainbox] {name}: got a stop signal before training began: nothing to save yet (no checkpoint "
              "written); rerun the same command to start", file=sys.stderr, flush=True)
    return exit_code()


def install_signal_handlers() -> None:
    claim_preempt_signals()
    shield_dataloader_workers()
    # `kill -USR2 PID` prints every thread's Python stack to stderr: how to see where a stuck rank waits.
    try:
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    except (ValueError, OSError, AttributeError):  # stderr without a file descriptor (captured): no dumps
        pass


def _worker_ignores_preemption(seed_worker):
    def worker_init(*args, **kwargs):
        # The rank saves and stops; its loader's workers end with it. A worker killed by the signal would crash the
        # rank instead ("DataLoader worker ... is killed by signal: Terminated").
        for sig in (*PREEMPT_SIGNALS, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        return seed_worker(*args, **kwargs)

    worker_init.trainbox_shield = True
    return worker_init


def shield_dataloader_workers() -> None:
    """DataLoader workers ignore SIGTERM/SIGUSR1/SIGINT. `scancel` and `docker stop` (tini -g) signal every process of
    the job, workers included, and a worker forked after Triton took SIGTERM (see PreemptionCallback.on_step_end) has
    the default disposition: it died and took the rank down with it, no checkpoint (2xH200, check_preempt
    --signal-all, 2 workers per rank). The Trainer builds its loaders with transformers.trainer.seed_worker as
    worker_init_fn: wrapped here, before any loader exists."""
    try:
        import transformers.trainer as hf_trainer
    except ImportError:  # pragma: no cover - the light stack has no trainer
        return
    if not getattr(hf_trainer.seed_worker, "trainbox_shield", False):
        hf_trainer.seed_worker = _worker_ignores_preemption(hf_trainer.seed_worker)


def preempt_requested() -> bool:
    return _preempt_requested


def was_preempted() -> bool:
    """True when this run stopped early because of SIGTERM/SIGUSR1 (and the Trainer saved a checkpoint)."""
    return _preempted


def saved_checkpoint() -> str | None:
    """The checkpoint the Trainer saved last in this run (None: none yet)."""
    return _checkpoint_saved


def exit_code() -> int:
    """0 normally. Preempted-and-saved: $TRAINBOX_PREEMPTED_EXIT_CODE if set, else 0 (clean end for torchrun/Slurm)."""
    if _preempted:
        try:
            return int(os.environ.get("TRAINBOX_PREEMPTED_EXIT_CODE", "0"))
        except ValueError:
            return 0
    return 0


def _distributed():
    """torch.distributed when a process group of more than one rank is up, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist


class FlagAgreement:
    """The ranks' preemption flags, agreed (max over ranks) without a blocking global sync at any step.

    `step(flag)` at every step end: waits for the MAX all-reduce that the previous step end started (it has had a
    whole step to finish, and the step's own gradient sync already brought every rank past that point, so the wait
    is about free), then starts the next one with this rank's flag (async, on a CPU tensor over a gloo group: no GPU
    sync) and returns. Every rank reads the same reduction at the same step end, so all stop at the same step.
    Bound: a flag set on any rank during step N (before its step end) is agreed at the end of step N + 1 on every
    rank, i.e. every rank checkpoints within K = 2 step ends of the signal (one step later than a blocking
    all-reduce). One process: the flag itself, at once. `close()` waits for the last one (every rank, at the end)."""

    def __init__(self, group=None):
        self.group = group
        self._pending = None  # the all-reduce started at the previous step end
        self._flag = None  # its tensor, reused (free again once the reduction is waited for)

    def step(self, flag: bool) -> bool:
        dist = _distributed()
        if dist is None:
            return flag
        import torch

        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            if self._flag.item():
                return True
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32)
        self._flag.fill_(1 if flag else 0)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


def flag_group():
    """The preemption flag's own gloo process group (None: one process), so its async all-reduce never queues
    behind or between the training's collectives, NCCL or gloo. Every rank must call this, in the same order."""
    dist = _distributed()
    return None if dist is None else dist.new_group(backend="gloo")


@functools.cache
def _preemption_callback_class():
    """Made on first use, not at import: subclassing transformers' TrainerCallback imports transformers (and peft,
    bitsandbytes: about 10 s of CPU), which the launcher process and the run log never need."""
    from transformers import TrainerCallback

    class PreemptionCallback(TrainerCallback):
        """Installs SIGTERM/SIGUSR1 handlers; at the next step end asks the Trainer to save a checkpoint and stop."""

        def __init__(self):
            super().__init__()
            install_signal_handlers()
            self.agreement = FlagAgreement()
            self.tokens_at_start: int | None = None
            self.step_at_start: int | None = None
            self.started_at: float | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            # Again here: model/distributed set-up may have replaced our handlers since __init__.
            install_signal_handlers()
            self.agreement = FlagAgreement(flag_group())
            self.tokens_at_start = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            self.step_at_start = int(state.global_step)
            self.started_at = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            global _preempted
            # And at every step: a native library loaded during the first steps can take SIGTERM/SIGUSR1 with its own
            # sigaction (seen on H200 with FSDP2: both then went to a C handler and training never stopped). Python
            # still reports our handler then, so re-installing (one syscall per signal) is the only sure way back.
            claim_preempt_signals()
            if self.agreement.step(_preempt_requested):
                _preempted = True
                control.should_save = True
                control.should_training_stop = True
            return control

        def on_train_end(self, args, state, control, **kwargs):
            self.agreement.close()  # the reduction the last step end started (every rank has one)
            return control

        def on_save(self, args, state, control, **kwargs):
            global _checkpoint_saved
            _checkpoint_saved = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if state.is_world_process_zero and os.path.isdir(_checkpoint_saved):
                resume.mark_checkpoint(_checkpoint_saved)
            return control

    PreemptionCallback.__module__, PreemptionCallback.__qualname__ = __name__, "PreemptionCallback"
    return PreemptionCallback


def __getattr__(name: str):  # preemption.PreemptionCallback, built on first access (PEP 562)
    if name == "PreemptionCallback":
        return _preemption_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def find_callback(trainer, cls=None):
    """The trainer's callback of type `cls` (default: PreemptionCallback), or None."""
    cls = cls or _preemption_callback_class()
    for cb in getattr(getattr(trainer, "callback_handler", None), "callbacks", []):
        if isinstance(cb, cls):
            return cb
    return None
