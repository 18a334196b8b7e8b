"""The image's pip/uv constraints file (/etc/trainbox/constraints.txt): written from the venv's lock at build time,
read back by `pip` (pipwrap.py) and doctor.

`python -m trainbox.image.constraints LOCK [-o FILE]` turns a hash-locked requirements file into `name==version` lines:
no hashes (pip refuses them in a constraints file: it switches to --require-hashes mode and then wants every
requirement pinned), no extras (a constraint can't carry one). Stdlib only, so a flavour image can run it on its own
lock with any Python. The image sets PIP_CONSTRAINT and UV_CONSTRAINT to the file: every `pip install X` keeps the
pinned versions; `PIP_CONSTRAINT= pip install ...` (or `UV_CONSTRAINT= uv pip install ...`) lifts that on purpose.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from common.errors import UsageError

PATH = "/etc/trainbox/constraints.txt"
_PIN = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*===?\s*(?P<version>[^\s;]+)\s*(?P<marker>;.*)?")


def norm(name: str) -> str:
    """PEP 503 normalised name: `Typing_Extensions` and `typing-extensions` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(text: str, where: str):
    """(line number, requirement) per logical line: continuations joined, comments and pip options dropped."""
    logical, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*", "", raw).rstrip()
        if not logical:
            start = n
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical = (logical + line).strip()
        if logical:
            yield start, logical
        logical = ""
    if logical.strip():
        raise UsageError(f"{where}:{start}: the file ends inside a continued line (a trailing backslash)")


def from_lock(text: str, where: str = "lock") -> list[str]:
    """`name==version[ ; marker]` for every requirement of a hash-locked file, in its order."""
    out = []
    for n, req in _requirements(text, where):
        req = re.sub(r"\s--hash[=\s]\S+", "", " " + req).strip()
        if not req or req.startswith("-"):  # --index-url, --find-links ...: where from, not what
            continue
        m = _PIN.fullmatch(req)
        if not m:
            raise UsageError(f"{where}:{n}: {req!r} is not pinned with ==; a lock pins every package: regenerate it "
                             "(python build.py --lock)")
        marker = f" {m['marker']}" if m["marker"] else ""
        out.append(f"{m['name']}=={m['version']}{marker}")
    if not out:
        raise UsageError(f"{where}: no pinned requirement in it; give the venv's lock (locks/<venv>.txt)")
    return out


def render(lines: list[str], source: str) -> str:
    return "".join([
        f"# trainbox: the versions this image's venv was installed from ({source}).\n",
        "# pip and uv read this file (PIP_CONSTRAINT, UV_CONSTRAINT): an install keeps every package below at its\n",
        "# version and stops if it needs another. To change one anyway: PIP_CONSTRAINT= pip install NAME==VERSION\n",
        "# (uv: UV_CONSTRAINT= uv pip install ...); `trainbox doctor` then warns about the changed package.\n",
        *(f"{line}\n" for line in lines)])


def _applies(marker: str | None) -> bool:
    """A pin's environment marker holds here (a pin for another platform is not expected to be installed)."""
    if not marker:
        return True
    try:
        from packaging.markers import InvalidMarker, Marker
    except ImportError:  # pragma: no cover - every image has packaging; without it, expect the pin
        return True
    try:
        return Marker(marker.lstrip(";").strip()).evaluate()
    except InvalidMarker:
        return True


def pins(path: str | Path = PATH) -> dict[str, tuple[str, str]]:
    """normalised name -> (name, version) of a constraints file, the pins whose marker holds here; {} when there is
    none (not in an image)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    out = {}
    for _, req in _requirements(text, str(path)):
        m = _PIN.fullmatch(req)
        if m and _applies(m["marker"]):
            out[norm(m["name"])] = (m["name"], m["version"])
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainbox.image.constraints",
                                description="Write a pip/uv constraints file (name==version lines) from a hash-locked "
                                            "requirements file.")
    p.add_argument("lock", help="the venv's lock, e.g. locks/<venv>.txt")
    p.add_argument("-o", "--output", help=f"write here (atomically; the image's is {PATH}) instead of stdout")
    args = p.parse_args(argv)
    try:
        text = Path(args.lock).read_text()
    except OSError as e:
        raise UsageError(f"cannot read the lock {args.lock}: {e.strerror}; give the venv's lock file") from None
    out = render(from_lock(text, args.lock), args.lock)
    if args.output:
        from common import atomic

        atomic.write_text(args.output, out)
    else:
        sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    from trainbox.dispatch import run_main

    sys.exit(run_main(main, prog="python -m trainbox.image.constraints"))
