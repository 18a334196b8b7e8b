"""A training run's log as a file, copied next to its outputs in $ARTIFACT_DIR (or the GPU cloud's variable).

`trainbox sft|qlora|grpo` and `notebook.run` both keep OUTPUT_DIR/logs/NAME.log (NAME.nodeN.log on node N > 0 of a
multi-node run) and, at the end, copy it to ARTIFACT_DIR/<basename of OUTPUT_DIR>/logs/ — after the entrypoint's
own copy of the outputs (runsummary.finish), which ran while the log was still being written.

Command runs tee at the file-descriptor level: torchrun's workers inherit the descriptors, so every rank's lines, and
what native libraries print, land in the one file. A notebook run tees Python's streams instead (the kernel's output
goes to the notebook, not to fd 1). The process that keeps the log is the top of the run on its node: the launcher
that starts torchrun, or the single training process; a torchrun worker or a second Slurm task-rank keeps none.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

from common import atomic, redact
from common.errors import UsageError
from trainbox.run import outputs

_active: Path | None = None  # the log being kept by this process (nested runs add nothing)


def log_path(output_dir: str | Path, name: str, node_rank: int = 0) -> Path:
    return Path(output_dir) / "logs" / (f"{name}.log" if not node_rank else f"{name}.node{node_rank}.log")


def copy_to_artifacts(log: Path, output_dir: str | Path) -> Path | None:
    """ARTIFACT_DIR/<basename of OUTPUT_DIR>/logs/<log's name>, written atomically; None without an artifact dir."""
    dest = outputs.artifact_dir()
    if not dest or not log.is_file():
        return None
    return atomic.copy_file(log, Path(dest) / Path(output_dir).name / "logs" / log.name)


class _Tee:
    """A text stream that writes to the notebook's stream and to a log file."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text):
        self._log.write(text)
        return self._stream.write(text)

    def flush(self):
        self._log.flush()
        self._stream.flush()

    def __getattr__(self, name):  # isatty, encoding, fileno... from the notebook's stream
        return getattr(self._stream, name)


@contextlib.contextmanager
def _tee_streams(log):
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = out, err


_log_lock = threading.Lock()  # stdout's and stderr's pumps write whole lines to the one log, one at a time


def _pump(read_fd: int, write_fd: int, log) -> None:
    """Copy everything from the pipe to the terminal/file it replaced (at once) and to the log (whole lines only:
    with PYTHONUNBUFFERED=1 print() writes the text and its newline separately, and the other stream's line could
    land between them), until the pipe closes. Never stops early: a full pipe would block the training process."""
    partial = b""

    def to_log(data: bytes) -> None:
        with _log_lock, contextlib.suppress(OSError, ValueError):
            log.write(data)

    while chunk := os.read(read_fd, 65536):
        with contextlib.suppress(OSError, ValueError):
            os.write(write_fd, chunk)
        partial += chunk
        cut = partial.rfind(b"\n") + 1
        if cut:
            to_log(partial[:cut])
            partial = partial[cut:]
        elif len(partial) > 1 << 20:  # a megabyte with no newline (a progress bar's \r): write it as it is
            to_log(partial)
            partial = b""
    if partial:
        to_log(partial)
    os.close(read_fd)


@contextlib.contextmanager
def _tee_fds(log):
    sys.stdout.flush()
    sys.stderr.flush()
    saved, pumps = {}, []
    for fd in (1, 2):
        try:
            orig = os.dup(fd)
        except OSError:  # started with this descriptor closed: nothing to tee
            continue
        r, w = os.pipe()
        saved[fd] = orig
        pumps.append(threading.Thread(target=_pump, args=(r, saved[fd], log), daemon=True))
        os.dup2(w, fd)
        os.close(w)
        pumps[-1].start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, orig in saved.items():
            os.dup2(orig, fd)  # closes our pipe's last write end (children that held it have exited)
        for t in pumps:
            t.join(timeout=10)
        for orig in saved.values():
            os.close(orig)
        log.flush()


@contextlib.contextmanager
def kept(name: str, output_dir: str | Path, *, node_rank: int = 0, streams: bool = False, argv=()):
    """Keep this run's log in OUTPUT_DIR/logs/ and copy it to the artifact dir at the end (also after a failure).

    streams=True tees sys.stdout/sys.stderr (a notebook kernel); else file descriptors 1 and 2."""
    global _active
    if _active is not None:  # a notebook run already keeps this log
        yield _active
        return
    path = log_path(output_dir, name, node_rank)
    created = []  # the folders this log creates: removed again after bad input (nothing half-written)
    for folder in (path.parent, *path.parent.parents):
        if folder.exists():
            break
        created.append(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    new_log = not path.exists()
    bad_input = False
    with open(path, "ab", buffering=0) as raw:
        raw.write(f"$ trainbox {name} {' '.join(redact.argv(argv))}\n".encode())  # no secret options
        _active = path
        try:
            if streams:
                import io

                text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", write_through=True)
                with _tee_streams(text):
                    yield path
                text.detach()
            else:
                with _tee_fds(raw):
                    yield path
        except UsageError:
            bad_input = True
            raise
        finally:
            _active = None
            if not bad_input:
                copy_to_artifacts(path, output_dir)
            elif new_log:  # the error line went to the terminal; no log or output folder is left behind
                path.unlink(missing_ok=True)
                for folder in created:
                    with contextlib.suppress(OSError):
                        folder.rmdir()


def keeps_log_here(plan) -> bool:
    """Is this process the top of the run on its node (the launcher, or the only process)?"""
    if plan.mode == "torchrun":
        return True
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return False  # a torchrun worker: the launcher above it keeps the log
    rank = plan.env.get("RANK") or os.environ.get("RANK") or "0"  # one Slurm task per rank: rank 0's task
    return int(rank) == 0


@contextlib.contextmanager
def for_command(name: str, configured_output_dir: str | None, plan, argv):
    """`with runlog.for_command("sft", ..., plan, argv):` around a command run's launch or training."""
    if not keeps_log_here(plan):
        yield None
        return
    with kept(name, outputs.output_dir(configured_output_dir), node_rank=plan.node_rank, argv=argv) as path:
        yield path
