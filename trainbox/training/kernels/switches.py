"""The on/off environment switches of the fast paths (TRAINBOX_*=0 turns one off), read one way everywhere.
"""

from __future__ import annotations


def switch(raw: str | None, default: bool) -> bool | None:
    """An on/off environment switch: 1/true/yes/on -> True, 0/false/no/off -> False (any case, spaces ignored),
    unset or empty -> `default`; None for anything else (the caller says what a value it can't read does)."""
    value = (raw or "").strip().lower()
    if not value:
        return default
    return True if value in ("1", "true", "yes", "on") else False if value in ("0", "false", "no", "off") else None
