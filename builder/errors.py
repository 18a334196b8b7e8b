"""The one error type the host side raises for bad input: the CLI prints it on one line and exits 2."""


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
