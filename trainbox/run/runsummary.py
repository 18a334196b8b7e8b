"""The end of a run: every rank leaves the process group, then the main process writes the run record, prints the
one-line summary (steps, wall time, steady-state rates, peak GPU memory, outputs, the checkpoint if preempted) and
copies the outputs to the artifact folder.
"""

from __future__ import annotations

import sys
import time

from trainbox.run import exitdeadline, outputs, preemption, resume


def _peak_gpu_gib() -> float | None:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.max_memory_allocated() / 2**30
    except ImportError:  # pragma: no cover
        pass
    return None


def _steady(trainer) -> str | None:
    from trainbox.run.throughput import Throughput  # defines a TrainerCallback: transformers, only at a run's end

    cb = preemption.find_callback(trainer, Throughput)
    return cb.summary() if cb else None


def summary(trainer, output_dir: str, started: float, name: str) -> str:
    """The one-line final summary (also used by tests)."""
    state = trainer.state
    wall = max(time.time() - started, 1e-9)
    cb = preemption.find_callback(trainer)
    step0 = cb.step_at_start if cb and cb.step_at_start is not None else 0
    tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0)
    tokens_run = tokens - ((cb.tokens_at_start or 0) if cb else 0)
    train_wall = wall
    if cb and cb.started_at:
        train_wall = max(time.time() - cb.started_at, 1e-9)
    parts = [
        f"[trainbox] {name} {'preempted (checkpoint saved)' if preemption.was_preempted() else 'done'}:",
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
    if preemption.was_preempted():
        ck = preemption.saved_checkpoint() or resume.resume_checkpoint(output_dir)
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
        if not outputs.is_main_process():  # nothing left but the teardown and the exit: bounded (exitdeadline.py)
            exitdeadline.arm(preemption.exit_code())
        dist.destroy_process_group()
        # Let gloo's worker threads drop the works they just finished before anything frees the group: DDP's Reducer
        # still holds it, and its dealloc (when train() returns) joins those threads holding the GIL, while a worker
        # destroying a finished all-gather needs the GIL to release its tensors. Seen once in a CI rehearsal
        # (py-spy: main in ~ProcessGroupGloo -> thread::join, a worker in ~AsyncAllgatherWork -> gil_scoped_acquire):
        # the rank hung for good, and the exit deadline could not fire without the GIL. Sleeping frees the GIL.
        time.sleep(0.2)


def finish(trainer, output_dir: str, started: float, name: str) -> None:
    """Every rank leaves the process group; then the main process prints the summary line and copies the outputs to
    $ARTIFACT_DIR / $SAKURA_ARTIFACT_DIR if set."""
    leave_process_group(trainer)
    if not outputs.is_main_process():
        return
    resume.write_run_record(trainer, output_dir, name, finished=not preemption.was_preempted())
    line = summary(trainer, output_dir, started, name)
    dest = outputs.artifact_dir()
    if dest and preemption.was_preempted():
        # Slurm's grace period is for the checkpoint, not for copying; the requeued run copies at its end.
        line += " artifacts not copied (preempted; the resumed run copies them)"
    elif dest:
        copied = outputs.copy_artifacts(output_dir, dest, name)
        line += f" artifacts {copied}"
    print(line, flush=True)
    sys.stdout.flush()
