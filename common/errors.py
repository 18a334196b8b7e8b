"""The one error type the in-image side raises for bad input: the dispatcher prints it on one line and exits 2.
Here, not in trainbox/, because the launch planner (launch.py) raises it too."""

from . import redact


class UsageError(Exception):
    """Bad config/arguments/data: say what, where and how to fix. Raised before any model loads."""

    exit_code = 2


def line(e: BaseException) -> str:
    """How a UsageError is printed: one line (every non-printable character escaped), no credentials, bounded."""
    text = redact.text(" ".join(str(e).split()))
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return text if len(text) <= 2000 else f"{text[:2000]}... ({len(text)} characters)"


def brief(e: BaseException) -> str:
    """An exception in a few words, for a line saying why a fast path was passed over: its type and the first line of
    its message, at most 160 characters of it."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
