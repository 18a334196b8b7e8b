"""The dispatcher: `trainbox NAME [ARGS]` / `python -m trainbox NAME [ARGS]` runs the entrypoint `trainbox.cli.NAME`.

Listing reads each module's docstring with `ast` (no import: `--help` stays instant and a module that isn't written
yet, or needs torch, can't break it). Running: it execs the entrypoint in place, so signals and exit codes are the
entrypoint's own. In `docker run` PID 1 is Debian's `tini -g` (the image's ENTRYPOINT): it forwards signals to the
process group, reaps orphans and exits with the entrypoint's code (128+N if killed by signal N); pyxis/enroot,
a shell or Slurm run `trainbox` directly. Before an entrypoint starts, cache folders move off an unwritable $HOME
(trainbox/run/cachedirs.py).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import signal
import sys
from pathlib import Path

from common import commands, pipes
from common.errors import UsageError, line
from trainbox.run import cachedirs

PACKAGE_DIR = Path(__file__).resolve().parent

PROG = "trainbox"


def module_file(name: str) -> Path:
    return PACKAGE_DIR.parent / commands.path(name)


def summary(name: str) -> str | None:
    """First line of trainbox/cli/NAME.py's docstring, read without importing it; None if the module is absent."""
    try:
        tree = ast.parse(module_file(name).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    doc = ast.get_docstring(tree) or ""
    return doc.strip().splitlines()[0] if doc.strip() else "(no description)"


def missing(name: str) -> list[str]:
    """The packages command NAME needs that this Python lacks (looked up, not imported: listing stays instant)."""
    return [m for m in commands.BY_NAME[name].needs if importlib.util.find_spec(m) is None]


def usage() -> str:
    lines = [f"usage: {PROG} NAME [ARGS...]   ({PROG} NAME --help for an entrypoint's options)", "", "commands:"]
    for name in commands.names(public=True):
        line, lacks = summary(name), missing(name)
        if lacks:
            line = f"(not in this image: needs {', '.join(lacks)})"
        lines.append(f"  {name:<10} {line if line is not None else '(not installed in this image)'}")
    lines += ["", "Same command inside Docker (`docker run IMAGE NAME ...`) and under Slurm/pyxis "
              f"(`srun --container-image=X.sqsh {PROG} NAME ...`).",
              "Any other program on PATH runs as given (`docker run -it IMAGE bash`, "
              "`enroot start IMAGE python x.py`)."]
    return "\n".join(lines)


def child_command(name: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", commands.qualified(name), *args]


def child_env() -> dict[str, str]:
    """Make sure the child imports this same package (not another installed `trainbox`) whatever its cwd."""
    env = dict(os.environ)
    home = str(PACKAGE_DIR.parent)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if home not in parts:
        env["PYTHONPATH"] = os.pathsep.join([home, *parts])
    return env


def run_main(main, argv: list[str] | None = None, prog: str | None = None) -> int:
    """For an entrypoint's `if __name__ == "__main__":` — a UsageError becomes one line on stderr and exit 2."""
    try:
        code = main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()
        return code
    except UsageError as e:
        print(f"{prog or PROG}: error: {line(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `trainbox doctor | head`: the reader left
        if not pipes.stdout_closed():
            raise
        return pipes.reader_gone()


def main(argv: list[str]) -> int:
    return run_main(_main, argv)


def _main(argv: list[str]) -> int:
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    if name in ("-h", "--help", "help"):
        print(usage())
        return 0
    if name not in commands.BY_NAME:
        # The image's ENTRYPOINT is this dispatcher, and enroot's /etc/rc passes its arguments to it: a program
        # on PATH (bash, python) runs as given, like in any other image.
        program = shutil.which(name) if not name.startswith("-") else None
        if program is None:
            print(f"{PROG}: unknown entrypoint {name!r} (and no program of that name on PATH)\n\n{usage()}",
                  file=sys.stderr)
            return 2
        return run_child([program, *args], dict(os.environ))
    if not module_file(name).is_file():
        print(f"{PROG}: entrypoint {name!r} is not installed in this image ({module_file(name)} is missing); "
              f"`{PROG} --help` lists what is", file=sys.stderr)
        return 2
    lacks = missing(name)
    if lacks:
        print(f"{PROG}: error: {name} needs {', '.join(lacks)}, which this image lacks (an image of the light stack: "
              f"doctor and jupyter only); run {name} in an image of the train or gpu stack", file=sys.stderr)
        return 2
    if commands.BY_NAME[name].trainer:
        from trainbox.run import preemption

        preemption.hold_preempt_signals()  # a stop signal from here on reaches the trainer's handler (exit 0)
    public = commands.BY_NAME[name].public
    if public:
        # First of all: without a usable temp folder (`docker run --read-only`) tempfile raises in whatever asks.
        try:
            cachedirs.apply_temp()
        except UsageError as e:
            print(f"{PROG}: error: {line(e)}", file=sys.stderr)
            return 2
    # Here, not at the top: the commands import run_main from this module, and only the dispatcher needs the help
    # cache (importlib.metadata).
    from trainbox import helpcache

    if public and helpcache.asked(args) and "--config" not in args:
        text = helpcache.load(name)  # the trainers' --help without importing TRL (helpcache.py)
        if text is not None:
            print(text, end="")
            return 0
    if public:
        # Before the entrypoint imports HF/torch: under enroot/pyxis defaults $HOME is read-only (cachedirs.py).
        cachedirs.apply()
    return run_child(child_command(name, args), child_env())


def run_child(cmd: list[str], env: dict[str, str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(cmd[0], cmd, env)
    except OSError as e:
        print(f"{PROG}: can't run {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 126
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
