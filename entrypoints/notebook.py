"""Run an entrypoint from a notebook: the same code as `trainbox NAME ARGS`, with the run's log kept as a file.

`run("qlora", [...], output_dir=D)` calls `entrypoints.<name>.main(args + ["--output_dir", D])` in this kernel
(no copy of the training logic). What it prints shows in the notebook and goes to D/logs/<name>.log as well. The
entrypoint itself copies D to $ARTIFACT_DIR (or the GPU cloud's variable) at the end, as it does for `trainbox NAME`;
then this puts the finished log there too (D/logs/ in the copy), so the platform gets adapter, merged model and log.
A failed run raises RuntimeError, so `jupyter nbconvert --execute` and papermill stop there. The kernel's own signal
handlers for SIGTERM and SIGUSR1 come back after the run.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
from pathlib import Path

from . import lifecycle

NAMES = ("grpo", "qlora", "sft")
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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


def run(name: str, args: list[str], *, output_dir: str) -> int:
    """`trainbox NAME ARGS --output_dir OUTPUT_DIR` in this kernel; returns 0 or raises RuntimeError."""
    if name not in NAMES:
        raise ValueError(f"unknown entrypoint {name!r}; one of {', '.join(NAMES)}")
    module = importlib.import_module(f"entrypoints.{name}")
    log_path = Path(output_dir) / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [*map(str, args), "--output_dir", str(output_dir)]
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ trainbox {name} {' '.join(argv)}\n")
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            code = module.main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = out, err
            for s, h in handlers.items():
                if h is not None:
                    signal.signal(s, h)
    dest = lifecycle.artifact_dir()
    if dest:  # the entrypoint copied the outputs at its end; the log was still being written then
        logs = Path(dest) / Path(output_dir).name / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log_path, logs / log_path.name)
    if code != 0:
        raise RuntimeError(f"trainbox {name} exited with {code}; the log is in {log_path}")
    return code


def files(folder: str) -> list[str]:
    """The files under FOLDER (relative paths, sorted): what a run left there."""
    root = Path(folder)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
