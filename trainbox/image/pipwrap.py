"""`pip` in the image (/opt/venv/bin/pip, pip3, pip3.X run this): the real pip, whose resolution conflict with a
package pinned by the image's constraints file becomes one line naming the package and how to override.

pip's own message is a dozen lines across stdout and stderr ("Cannot install ... The conflict is caused by: ... The
user requested (constraint) torch==2.13.0 ... To fix this you could try to ..."). Here an `install` runs pip with
both streams piped and passed through line by line until that block starts; the block is held back and, when it names
a constraint, replaced by one `error:` line (exit 2). Anything else pip prints, and every other pip command (run by
exec: prompts and progress bars untouched), is pip's own. `python -m pip` (and a notebook's `%pip`, which runs it)
does not come here: it keeps pip's own message, whose "(constraint)" line names the package (docs/images.md: Extend an
image).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading

_START = re.compile(r"^(ERROR: Cannot install |The conflict is caused by:)")
_PINNED = re.compile(r"The user requested \(constraint\) (?P<name>[^\s=<>!~;]+)==(?P<version>[^\s;,]+)")


def conflict_line(text: str, argv: list[str], constraint: str) -> str | None:
    """The one line for pip's held-back conflict block TEXT, or None when no pinned package is in it."""
    if "The conflict is caused by:" not in text:
        return None
    block = text.split("The conflict is caused by:", 1)[1].split("\n\n", 1)[0]
    causes = [ln.strip() for ln in block.splitlines() if ln.strip()]
    pinned = [m for m in map(_PINNED.match, causes) if m]
    if not pinned:
        return None
    names = ", ".join(f"{m['name']} is pinned to {m['version']}" for m in dict((m["name"], m) for m in pinned).values())
    wants = "; ".join(c.replace("The user requested ", "you asked for ") for c in causes if not _PINNED.match(c))
    return (f"error: {names} by this image ({constraint}) and this install needs another version ({wants}); "
            f"to change it anyway: PIP_CONSTRAINT= pip {shlex.join(argv)}")


def _command(argv: list[str]) -> str | None:
    """pip's subcommand: the first word that is not an option (pip's general options with a value are few)."""
    with_value = {"--python", "--log", "--proxy", "--retries", "--timeout", "--exists-action", "--trusted-host",
                  "--cert", "--client-cert", "--cache-dir", "--use-feature", "--use-deprecated"}
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in with_value:
            skip = True
        elif not a.startswith("-"):
            return a
    return None


def main(argv: list[str]) -> int:
    pip = [sys.executable, "-m", "pip", *argv]
    constraint = os.environ.get("PIP_CONSTRAINT", "")
    if _command(argv) != "install" or not constraint.strip():
        os.execv(sys.executable, pip)
    proc = subprocess.Popen(pip, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
    held = {"out": [], "err": []}

    def relay(src, dst, key):
        hold, blank = False, ""  # pip prints a blank line before its conflict block: it goes with the block
        for line in src:
            hold = hold or bool(_START.match(line))
            if hold:
                held[key].append(blank + line)
            elif not line.strip():
                blank += line
                continue
            else:
                dst.write(blank + line)
                dst.flush()
            blank = ""
        held[key].append(blank)

    threads = [threading.Thread(target=relay, args=(proc.stdout, sys.stdout, "out")),
               threading.Thread(target=relay, args=(proc.stderr, sys.stderr, "err"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rc = proc.wait()
    one = conflict_line("".join(held["out"] + held["err"]), argv, constraint) if rc else None
    if one:
        print(one, file=sys.stderr)
        return 2
    sys.stdout.write("".join(held["out"]))
    sys.stderr.write("".join(held["err"]))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
