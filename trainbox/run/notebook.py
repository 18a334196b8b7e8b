"""Run an entrypoint from a notebook: the same code as `trainbox NAME ARGS`, with the run's log kept as a file.

`run("qlora", [...], output_dir=D)` calls `trainbox.cli.<name>.main(args + ["--output_dir", D])` in this kernel
(no copy of the training logic). What it prints shows in the notebook and goes to D/logs/<name>.log as well. The
entrypoint itself copies D to $ARTIFACT_DIR (or the GPU cloud's variable) at the end, as it does for `trainbox NAME`;
then this puts the finished log there too (D/logs/ in the copy), so the platform gets adapter, merged model and log.
A failed run raises RuntimeError, so `jupyter nbconvert --execute` and papermill stop there. The kernel's own signal
handlers for SIGTERM and SIGUSR1 come back after the run.
"""

from __future__ import annotations

import importlib
import signal
from pathlib import Path

from common import commands
from trainbox.run import crash, runlog

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def run(name: str, args: list[str], *, output_dir: str) -> int:
    """`trainbox NAME ARGS --output_dir OUTPUT_DIR` in this kernel; returns 0 or raises RuntimeError."""
    if name not in commands.names(trainer=True):
        raise ValueError(f"unknown entrypoint {name!r}; one of {', '.join(commands.names(trainer=True))}")
    module = importlib.import_module(commands.qualified(name))
    argv = [*map(str, args), "--output_dir", str(output_dir)]
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    # The same log file and artifact copy as a command run (runlog.py), teeing Python's streams: the kernel's
    # output goes to the notebook, not to file descriptor 1.
    with runlog.kept(name, output_dir, streams=True, argv=argv) as log_path:
        crash.in_kernel = True
        try:
            code = module.main(argv)
        finally:
            crash.in_kernel = False
            for s, h in handlers.items():
                if h is not None:
                    signal.signal(s, h)
    if code != 0:
        raise RuntimeError(f"trainbox {name} exited with {code}; the log is in {log_path}")
    return code


def files(folder: str) -> list[str]:
    """The files under FOLDER (relative paths, sorted): what a run left there."""
    root = Path(folder)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
