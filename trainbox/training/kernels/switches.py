"""The on/off environment switches of the fast paths (TRAINBOX_*=0 turns one off), read one way everywhere.
"""

from __future__ import annotations

import os


def switch(raw: str | None, default: bool) -> bool | None:
    """An on/off environment switch: 1/true/yes/on -> True, 0/false/no/off -> False (any case, spaces ignored),
    unset or empty -> `default`; None for anything else (the caller says what a value it can't read does)."""
    value = (raw or "").strip().lower()
    if not value:
        return default
    return True if value in ("1", "true", "yes", "on") else False if value in ("0", "false", "no", "off") else None


def setting(env: str) -> tuple[bool, str | None]:
    """(on?, a note on the variable) for a fast path that is on unless `env` is 0/false/no/off; a value that is
    neither leaves it on and says so (never an error: a typo must not stop a run)."""
    raw = os.environ.get(env)
    on = switch(raw, default=True)
    return (True, f"{env}={raw!r} is neither 0 nor 1: left on") if on is None else (on, None)
