"""The packages a lock installs, read from its text (uv's `name==version` lines): the lock step and a flavour's
sdists check ask it."""
from __future__ import annotations

import re
from pathlib import Path

from packaging.utils import canonicalize_name


def lock_names(text: str) -> set[str]:
    """The canonical names of the packages a lock's text installs (uv's `name==version` lines)."""
    return {canonicalize_name(m.group(1)) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", text, re.M)}


def committed_lock_names(path: Path) -> set[str] | None:
    try:
        return lock_names(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return None
