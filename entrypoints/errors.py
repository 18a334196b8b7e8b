"""The one error type the in-image side raises for bad input: the dispatcher prints it on one line and exits 2."""


class UsageError(Exception):
    """Bad config/arguments/data: say what, where and how to fix. Raised before any model loads."""

    exit_code = 2
