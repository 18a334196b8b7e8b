"""What the build context holds: the repository root as `.dockerignore` lets it through to the engine.

A path a Dockerfile COPYs must be in the context, not merely in the repository: `.dockerignore` here is an allowlist
(`**`, then `!locks/*.txt`, `!images/**`...), so a folder of the repository outside it passes a "does it exist" check
and then fails in BuildKit ("not found"). The rules are read the way the engine reads them (moby's patternmatcher):
patterns relative to the context root, `*` and `?` within one path element, `**` across elements, `!` re-includes,
the last matching pattern wins, and a pattern that matches a parent folder matches everything under it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from builder.paths import ROOT


def _regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):   # `**/` : any number of leading folders, none included
                out += "(.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + r"\Z", re.S)


def read_rules(root: Path | str | None = None) -> list[tuple[bool, re.Pattern]]:
    """(re-include?, pattern) per line of ROOT/.dockerignore, in order; none when there is no file."""
    try:
        text = (Path(root or ROOT) / ".dockerignore").read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line[1:].strip() if negate else line).lstrip("/")
        out.append((negate, _regex(pattern)))
    return out


def excluded(relpath: str, rules) -> bool:
    """Whether the file or folder RELPATH (relative to the context root) is left out of the build context."""
    parts = PurePosixPath(relpath).parts
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    out = False
    for negate, rx in rules:
        if any(rx.match(c) for c in candidates):
            out = not negate
    return out


def why_not_in_context(src: str, root: Path | str | None = None) -> str | None:
    """None when the repository folder SRC reaches the build context as a folder with files; else why not (missing,
    not a folder, a symbolic link on the way, left out by .dockerignore, or only its ignored files inside)."""
    root = Path(root or ROOT)
    parts = PurePosixPath(src).parts
    if not parts or ".." in parts or src.startswith("/"):
        return "is not a path inside the repository"
    if parts[0] == ".git":
        return "is git's own data, never part of the build context"
    here = root
    for part in parts:
        here = here / part
        try:
            if here.is_symlink():
                return (f"is a symbolic link ({'/'.join(here.relative_to(root).parts)}); BuildKit copies the link, "
                        "not its target")
            if not here.exists():
                return "is not in the repository"
        except OSError:   # a name the file system can't hold (ENAMETOOLONG): not in the repository either
            return "is not in the repository"
    if not here.is_dir():
        return "is not a folder"
    links = [p for p in here.rglob("*") if p.is_symlink()]
    if links:
        return (f"holds a symbolic link ({'/'.join(links[0].relative_to(root).parts)}); BuildKit copies the link, "
                "not its target")
    rules = read_rules(root)
    if not any(not excluded("/".join(p.relative_to(root).parts), rules) for p in here.rglob("*") if p.is_file()):
        return "is left out of the build context by .dockerignore (no file of it reaches the build)"
    return None
