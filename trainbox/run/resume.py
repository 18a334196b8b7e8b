"""Resume: the checkpoint a run continues from, and the record that keeps a finished run from training again.

Resume never overshoots nor crosses trainers: each checkpoint records the entrypoint that wrote it (CKPT_FILE) and a
run that ends writes RUN_FILE in its output folder. `resume auto` then exits 0 with one line when the last checkpoint
already reached the run's max_steps (or the same run finished: a resubmitted job that is done trains nothing, where
the Trainer used to train one step past max_steps and overwrite the final model), and refuses, exit 2, a checkpoint
another entrypoint wrote (sft resuming GRPO's optimizer and scheduler): each trainer needs its own output folder.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from common import atomic
from common.errors import UsageError
from trainbox.run.outputs import is_main_process

RUN_FILE = "trainbox-run.json"  # in the output folder: how the last run there ended
CKPT_FILE = "trainbox.json"  # in each checkpoint: the entrypoint that wrote it
_run_name: str | None = None  # this run's entrypoint (sft, qlora, grpo), set by resolve_resume

_CKPT = re.compile(r"^checkpoint-(\d+)$")
_cpu_locations_registered = False  # allow_cpu_rank_locations ran


def _complete(path: str) -> bool:
    """trainer_state.json is written after the weights and optimizer; without it, or with one that does not parse
    (a kill during the Trainer's plain write), the checkpoint was cut short and resuming from it would crash every
    requeued job the same way."""
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


def write_run_record(trainer, output_dir: str, name: str, finished: bool) -> None:
    """RUN_FILE: which entrypoint ran here, whether it finished (not preempted), the step and target it reached."""
    state, args = trainer.state, getattr(trainer, "args", None)
    max_steps, epochs = _target(args)
    record = {"trainer": name, "finished": finished, "global_step": int(state.global_step),
              "max_steps": max_steps, "num_train_epochs": epochs}
    try:
        atomic.write_text(os.path.join(output_dir, RUN_FILE), json.dumps(record) + "\n")
    except OSError as e:  # the run itself is done; a later resume just lacks the shortcut
        print(f"[trainbox] could not write {RUN_FILE} in {output_dir} ({e.strerror})", file=sys.stderr, flush=True)


def mark_checkpoint(path: str) -> None:
    """CKPT_FILE in the checkpoint folder PATH: the entrypoint that wrote it (once resolve_resume named this run's)."""
    if _run_name:
        atomic.write_text(os.path.join(path, CKPT_FILE), json.dumps({"trainer": _run_name}))


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


ABANDONED = "abandoned-"  # OUTPUT_DIR/abandoned-<UTC time>/: what `--resume never` moved out of the way


def abandon_earlier_run(out: str, name: str) -> str | None:
    """`--resume never`: the checkpoints and run record of an earlier run in `out` moved into
    out/abandoned-<UTC time>/ (one rename each, same folder: instant, nothing deleted), so this run starts over and
    a later `--resume auto` resumes this run, never the one given up. Left beside the new run, the old
    checkpoint-6 was what the next `--resume auto` took (it outnumbered the new run's). Main process only; returns
    the folder, or None when there was nothing to move."""
    if not is_main_process() or not os.path.isdir(out):
        return None
    names = sorted((n for n in os.listdir(out) if _CKPT.match(n) and os.path.isdir(os.path.join(out, n))),
                   key=lambda n: int(n.split("-")[1]))
    record = [RUN_FILE] if os.path.isfile(os.path.join(out, RUN_FILE)) else []
    if not names and not record:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = os.path.join(out, ABANDONED + stamp), 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(out, f"{ABANDONED}{stamp}-{n}")
    os.mkdir(dest)
    for item in names + record:
        os.rename(os.path.join(out, item), os.path.join(dest, item))
    atomic.fsync_path(out)
    what = (f"{len(names)} checkpoint{'s' if len(names) != 1 else ''} ({names[0]}" +
            (f" .. {names[-1]})" if len(names) > 1 else ")") if names else "")
    what += (" and " if what and record else "") + ("its run record" if record else "")
    print(f"[trainbox] {name}: --resume never: the earlier run's {what} moved to {dest} (nothing deleted; remove "
          "that folder to free the space); starting over", flush=True)
    return dest


def resolve_resume(resume: str, out: str, args=None, name: str | None = None) -> str | None:
    """The checkpoint to resume from (None: start fresh). With this run's `args` and entrypoint `name`: raises
    Finished when there is nothing left to train, UsageError for another entrypoint's checkpoint; `never` moves an
    earlier run's checkpoints aside (abandon_earlier_run)."""
    global _run_name
    if name:
        _run_name = name
    if resume == "never":
        if name:
            abandon_earlier_run(out, name)
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
