"""Run lifecycle shared by the training entrypoints: output dir, preemption -> checkpoint, resume, summary, artifacts.

Preemption contract (Slurm sends SIGTERM on scancel/preemption, or SIGUSR1 with `--signal=USR1@SECONDS`):
every rank installs handlers that only set a flag; the ranks agree on it at step ends without a blocking global sync
(`FlagAgreement`: a signal that reaches any rank during step N is acted on by every rank at the end of step N + 1;
one process: at the end of step N; a job's `--grace` should cover two steps and a save) and the Trainer writes a
normal `checkpoint-M` and returns. The process then exits with `exit_code()`: 0 by default, so torchrun and Slurm
see a clean end, and rerunning the same command resumes from checkpoint-M.
A job script that wants to requeue itself can set `TRAINBOX_PREEMPTED_EXIT_CODE` (e.g. 99) and test for it.

Resume never overshoots nor crosses trainers: each checkpoint records the entrypoint that wrote it (CKPT_FILE) and a
run that ends writes RUN_FILE in its output folder. `resume auto` then exits 0 with one line when the last checkpoint
already reached the run's max_steps (or the same run finished: a resubmitted job that is done trains nothing, where
the Trainer used to train one step past max_steps and overwrite the final model), and refuses, exit 2, a checkpoint
another entrypoint wrote (sft resuming GRPO's optimizer and scheduler): each trainer needs its own output folder.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from common import atomic
from common.errors import UsageError

DEFAULT_OUTPUT_DIR = "/workspace/outputs"
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_preempt_requested = False  # set by the signal handler (any rank)
_preempted = False  # set once the Trainer was told to save and stop
_checkpoint_saved: str | None = None


def output_dir(configured: str | None) -> str:
    """Explicit option if the user set it, else $OUTPUT_DIR, else /workspace/outputs; checked (see check_writable_dir)
    before anything loads, created later by whoever writes first."""
    if configured:
        return check_writable_dir(str(configured), "--output_dir")
    if os.environ.get("OUTPUT_DIR"):
        return check_writable_dir(os.environ["OUTPUT_DIR"], "OUTPUT_DIR")
    return check_writable_dir(DEFAULT_OUTPUT_DIR, "the default output folder (--output_dir / OUTPUT_DIR)")


def check_writable_dir(path: str, option: str) -> str:
    """`path` if it is a writable folder or can be made one; else one UsageError (a file there, read-only, /proc)."""
    why = atomic.why_not_a_folder(path)
    if why:
        raise UsageError(f"{option} {path}: {why}; pass a writable folder (and check the container's mounts)")
    return path


def _handler(signum, frame):
    global _preempt_requested
    _preempt_requested = True
    # Only async-signal-safe work here; the Trainer saves at the next step end.
    try:
        os.write(2, f"[trainbox] got signal {signal.Signals(signum).name}: will checkpoint and stop after this step\n".encode())
    except OSError:
        pass


def claim_preempt_signals() -> None:
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, _handler)


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


def preempt_requested() -> bool:
    return _preempt_requested


def was_preempted() -> bool:
    """True when this run stopped early because of SIGTERM/SIGUSR1 (and the Trainer saved a checkpoint)."""
    return _preempted


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
            if _run_name and state.is_world_process_zero and os.path.isdir(_checkpoint_saved):
                atomic.write_text(os.path.join(_checkpoint_saved, CKPT_FILE), json.dumps({"trainer": _run_name}))
            return control

    PreemptionCallback.__module__, PreemptionCallback.__qualname__ = __name__, "PreemptionCallback"
    return PreemptionCallback


def __getattr__(name: str):  # lifecycle.PreemptionCallback, built on first access (PEP 562)
    if name == "PreemptionCallback":
        return _preemption_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_CKPT = re.compile(r"^checkpoint-(\d+)$")


def _complete(path: str) -> bool:
    """trainer_state.json is written after the weights and optimizer; without it, or with one that does not parse
    (a kill during the Trainer's plain write), the checkpoint was cut short and resuming from it would crash every
    requeued job the same way."""
    import json

    state = os.path.join(path, "trainer_state.json")
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
        return True
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:
        print(f"[trainbox] skipping {path} for resume: its trainer_state.json does not parse ({type(e).__name__})",
              file=sys.stderr, flush=True)
        return False


def resume_checkpoint(output_dir: str) -> str | None:
    """Last complete `checkpoint-N` under output_dir, or None. Skips a newest one that was cut short."""
    if not os.path.isdir(output_dir):
        return None
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(output_dir)  # the newest with a trainer_state.json (parsed or not)
    if last is None:
        return None
    if _complete(last):
        return last
    numbered = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(output_dir)
        if (m := _CKPT.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    for _, name in reversed(numbered):
        if _complete(os.path.join(output_dir, name)):
            return os.path.join(output_dir, name)
    return None


def is_main_process() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0")) == 0


def artifact_dir() -> str | None:
    return os.environ.get("ARTIFACT_DIR") or os.environ.get("SAKURA_ARTIFACT_DIR") or None


# Checkpoints (weights + optimizer state: ~100 GB for an 8B full fine-tune) stay in OUTPUT_DIR unless asked for.
CHECKPOINTS_ENV = "TRAINBOX_ARTIFACT_CHECKPOINTS"


def copy_artifacts(src: str, dest_root: str, name: str) -> str:
    """Copy src to DEST_ROOT/<basename of src> through the one atomic writer (never half-written, swapped whole):
    the final model or adapter, a merged model, the logs; `checkpoint-*` only with TRAINBOX_ARTIFACT_CHECKPOINTS=1."""
    import shutil

    final = Path(dest_root) / (Path(src).name or name)
    if final.resolve() == Path(src).resolve():
        return str(final)
    atomic.clean_stale(final)  # what an earlier copy on this host left when it was killed
    keep = os.environ.get(CHECKPOINTS_ENV, "").lower() in ("1", "true", "yes")
    return str(atomic.copy_tree(src, final, ignore=None if keep else shutil.ignore_patterns("checkpoint-*")))


def find_callback(trainer, cls=None):
    """The trainer's callback of type `cls` (default: PreemptionCallback), or None."""
    cls = cls or _preemption_callback_class()
    for cb in getattr(getattr(trainer, "callback_handler", None), "callbacks", []):
        if isinstance(cb, cls):
            return cb
    return None


def _peak_gpu_gib() -> float | None:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.max_memory_allocated() / 2**30
    except ImportError:  # pragma: no cover
        pass
    return None


def _steady(trainer) -> str | None:
    from .throughput import Throughput

    cb = find_callback(trainer, Throughput)
    return cb.summary() if cb else None


def summary(trainer, output_dir: str, started: float, name: str) -> str:
    """The one-line final summary (also used by tests)."""
    state = trainer.state
    wall = max(time.time() - started, 1e-9)
    cb = find_callback(trainer)
    step0 = cb.step_at_start if cb and cb.step_at_start is not None else 0
    tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0)
    tokens_run = tokens - ((cb.tokens_at_start or 0) if cb else 0)
    train_wall = wall
    if cb and cb.started_at:
        train_wall = max(time.time() - cb.started_at, 1e-9)
    parts = [
        f"[trainbox] {name} {'preempted (checkpoint saved)' if _preempted else 'done'}:",
        f"steps {state.global_step}/{state.max_steps} (this run {state.global_step - step0})",
        f"wall {wall:.1f}s",
    ]
    steady = _steady(trainer)
    steps_run = state.global_step - step0
    if steady:
        parts.append(steady)
    else:  # fewer than two steps (or no Throughput callback): the whole run's rates, start-up included
        if steps_run > 0:
            parts.append(f"train {train_wall:.1f}s ({steps_run / train_wall:.3f} steps/s, incl. start-up)")
        if tokens_run > 0:
            parts.append(f"tokens {tokens_run} ({tokens_run / train_wall:.1f} tokens/s, incl. start-up)")
    peak = _peak_gpu_gib()
    if peak is not None:
        parts.append(f"peak GPU memory {peak:.2f} GiB (rank 0)")
    parts.append(f"outputs {output_dir}")
    if _preempted:
        ck = _checkpoint_saved or resume_checkpoint(output_dir)
        parts.append(f"checkpoint {ck}; rerun the same command to resume")
    return " ".join(parts)


def leave_process_group(trainer=None) -> None:
    """Every rank, once training is over: wait for the others (rank 0 may still be merging a model), then destroy the
    default process group so its gloo/NCCL threads stop before the interpreter exits. Left running, a gloo rank can
    abort at exit ("terminate called without an active exception", exit -6), which torchrun and Slurm report as a
    failed run (seen once in a CI rehearsal, srun-style sft)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return
    if dist.is_available() and dist.is_initialized():
        if trainer is not None and getattr(trainer, "accelerator", None) is not None:
            trainer.accelerator.wait_for_everyone()
        else:
            dist.barrier()
        dist.destroy_process_group()


def finish(trainer, output_dir: str, started: float, name: str) -> None:
    """Every rank leaves the process group; then the main process prints the summary line and copies the outputs to
    $ARTIFACT_DIR / $SAKURA_ARTIFACT_DIR if set."""
    leave_process_group(trainer)
    if not is_main_process():
        return
    write_run_record(trainer, output_dir, name)
    line = summary(trainer, output_dir, started, name)
    dest = artifact_dir()
    if dest and was_preempted():
        # Slurm's grace period is for the checkpoint, not for copying; the requeued run copies at its end.
        line += " artifacts not copied (preempted; the resumed run copies them)"
    elif dest:
        copied = copy_artifacts(output_dir, dest, name)
        line += f" artifacts {copied}"
    print(line, flush=True)
    sys.stdout.flush()


def allow_cpu_rank_locations() -> None:
    """transformers resumes a multi-process CPU run with torch.load(map_location=args.device), i.e. "cpu:N", and
    torch has no deserializer for that tag ("don't know how to restore data location ... cpu:0"): load it as CPU."""
    global _cpu_locations_registered
    if _cpu_locations_registered:
        return
    import torch.serialization

    torch.serialization.register_package(
        11, lambda obj: None, lambda obj, location: obj if str(location).startswith("cpu:") else None)
    _cpu_locations_registered = True


_cpu_locations_registered = False


RUN_FILE = "trainbox-run.json"  # in the output folder: how the last run there ended
CKPT_FILE = "trainbox.json"  # in each checkpoint: the entrypoint that wrote it
_run_name: str | None = None  # this run's entrypoint (sft, qlora, grpo), set by resolve_resume


class Finished(SystemExit):
    """Nothing to train: the run in the output folder is done (exit 0)."""


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _target(args) -> tuple:
    """What the user asked this run to reach: (max_steps, num_train_epochs)."""
    return int(getattr(args, "max_steps", -1) or -1), float(getattr(args, "num_train_epochs", 0) or 0)


def write_run_record(trainer, output_dir: str, name: str) -> None:
    """RUN_FILE: which entrypoint ran here, whether it finished (not preempted), the step and target it reached."""
    state, args = trainer.state, getattr(trainer, "args", None)
    max_steps, epochs = _target(args)
    record = {"trainer": name, "finished": not _preempted, "global_step": int(state.global_step),
              "max_steps": max_steps, "num_train_epochs": epochs}
    try:
        atomic.write_text(os.path.join(output_dir, RUN_FILE), json.dumps(record) + "\n")
    except OSError as e:  # the run itself is done; a later resume just lacks the shortcut
        print(f"[trainbox] could not write {RUN_FILE} in {output_dir} ({e.strerror})", file=sys.stderr, flush=True)


def _writer(ckpt: str | None, out: str) -> str | None:
    """The entrypoint that wrote `ckpt` (its CKPT_FILE), else the one that last ran in `out`."""
    return (_read_json(os.path.join(ckpt, CKPT_FILE)).get("trainer") if ckpt else None) or \
        _read_json(os.path.join(out, RUN_FILE)).get("trainer")


def check_same_trainer(ckpt: str, out: str, name: str) -> None:
    other = _writer(ckpt, out)
    if other and other != name:
        raise UsageError(f"{out} holds a {other} run ({os.path.basename(ckpt)}); {name} would resume from its "
                         f"weights, optimizer and scheduler: give {name} its own output folder (--output_dir DIR or "
                         f"OUTPUT_DIR), or move that run away")


def check_not_done(ckpt: str | None, out: str, args, name: str) -> None:
    """Finished (exit 0, one line) when the last checkpoint reached what this run asks for, or when the same run
    (same entrypoint, same max_steps / epochs) finished here."""
    want_steps, want_epochs = _target(args)
    reached = None
    if ckpt:
        state = _read_json(os.path.join(ckpt, "trainer_state.json"))
        step = int(state.get("global_step") or 0)
        if want_steps > 0:
            target = want_steps
        elif state.get("max_steps") and float(state.get("num_train_epochs") or 0) == want_epochs:
            target = int(state["max_steps"])  # the epochs' steps, as that run counted them
        else:
            target = None
        if target is not None and step >= target:
            reached = f"{os.path.basename(ckpt)} reached step {step} of {target}"
    record = _read_json(os.path.join(out, RUN_FILE))
    if reached is None and record.get("finished") and record.get("trainer") == name and \
            (record.get("max_steps"), record.get("num_train_epochs")) == (want_steps, want_epochs):
        reached = f"the same {name} run finished there at step {record.get('global_step')}"
    if reached is None:
        return
    if is_main_process():
        print(f"[trainbox] {name}: nothing to train: {out} holds a finished run ({reached}); to train further "
              "raise --max_steps (it resumes), or start over with --resume never or a new --output_dir", flush=True)
    raise Finished(0)


def resolve_resume(resume: str, out: str, args=None, name: str | None = None) -> str | None:
    """The checkpoint to resume from (None: start fresh). With this run's `args` and entrypoint `name`: raises
    Finished when there is nothing left to train, UsageError for another entrypoint's checkpoint."""
    global _run_name
    if name:
        _run_name = name
    if resume == "never":
        return None
    if resume == "auto":
        found = resume_checkpoint(out)
        if name and found:
            check_same_trainer(found, out, name)
        if name and args is not None:
            check_not_done(found, out, args, name)
        if found:
            allow_cpu_rank_locations()
        return found
    if not (Path(resume) / "trainer_state.json").is_file():
        raise UsageError(f"--resume {resume}: not a complete checkpoint (no trainer_state.json); use auto, never or a checkpoint-N dir")
    other = _read_json(os.path.join(resume, CKPT_FILE)).get("trainer")
    if name and other and other != name:
        raise UsageError(f"--resume {resume}: a {other} checkpoint; {name} can't resume from it (start fresh with "
                         "--resume never, or resume it with the entrypoint that wrote it)")
    allow_cpu_rank_locations()
    return resume
