"""The one error type the host side raises for bad input: the CLI prints it on one line and exits 2."""

import functools
import sys

from common import pipes as _pipes, redact as _redact


class UserError(Exception):
    """Bad matrix/arguments: the message says what, where (file, key) and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None):
        text = shorten(message, 1500)
        if where:
            text = f"{shorten(where, 300)}: {text}"
        if fix:
            text = f"{text} ({shorten(fix, 500)})"
        # One line whatever the input held (a key with a newline in it must not split the message), no credentials.
        super().__init__(one_line(_redact.text(text)))


def one_line(text: str) -> str:
    """Every character a terminal or splitlines() would break on (newline, CR, U+2028, NUL...) shown escaped."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


def shorten(text: str, limit: int = 200) -> str:
    """A value as an error may echo it: at most `limit` characters (a 100 MB value must not become a 100 MB line)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def reports_user_errors(main):
    """For a CLI's main(): a UserError becomes one `error: ...` line on stderr and exit code 2, not a traceback;
    stdout's reader gone (`--list | head`) a quiet exit 141 (common/pipes.py)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
            sys.stdout.flush()  # here, while a closed reader can still be told apart (not at the interpreter's exit)
            return result
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        except BrokenPipeError:
            if not _pipes.stdout_closed():
                raise
            return _pipes.reader_gone()

    return wrapper
