"""The one error type the host side raises for bad input: the CLI prints it on one line and exits 2."""

import functools
import sys


class UserError(Exception):
    """Bad matrix/arguments: the message says what, where (file, key) and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None):
        text = message
        if where:
            text = f"{where}: {text}"
        if fix:
            text = f"{text} ({fix})"
        # One line whatever the input held (a key with a newline in it must not split the message).
        super().__init__(text.replace("\r", "\\r").replace("\n", "\\n"))


def reports_user_errors(main):
    """For a CLI's main(): a UserError becomes one `error: ...` line on stderr and exit code 2, not a traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code

    return wrapper
