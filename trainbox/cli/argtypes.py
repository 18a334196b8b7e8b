"""argparse pieces of the commands that are not trainers (nccl-check, ray): one-line errors, whole numbers."""

from __future__ import annotations

import argparse

from common.errors import UsageError


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (run_main), not argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


PORT_MAX = 65535  # TCP's port field is 16 bits: torch's store raised a traceback for 99999


def _whole(text: str, minimum: int, what: str, maximum: int | None = None) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < minimum or (maximum is not None and v > maximum):
        raise argparse.ArgumentTypeError(f"must be {what}, got {v}")
    return v


def positive(text: str) -> int:
    return _whole(text, 1, "at least 1")


def not_negative(text: str) -> int:
    return _whole(text, 0, "0 or more")


def port(text: str) -> int:
    return _whole(text, 1, f"a TCP port, 1 to {PORT_MAX}", PORT_MAX)
