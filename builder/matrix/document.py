"""matrix.toml read as a checked tree: readable, UTF-8, TOML, and every key and string one bounded line of text.

Every matrix string ends up in a rendered Dockerfile, a tag or a shell line: a newline would start an instruction
of the author's choosing, a trailing backslash would swallow the next one, a quote would end a RUN string. So the
whole tree is checked first (no control characters, bounded depth and length), then each value a cell carries
against the grammar of where it goes (builder/matrix/grammar.py)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from builder.errors import UserError, shorten

MAX_DEPTH = 8
MAX_STRING = 2000
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def read_document(path: str | Path) -> dict:
    """PATH's TOML as a checked tree (read, UTF-8, syntax, depth): one UserError naming the file, else the dict."""
    path = Path(path)
    where = str(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read the matrix: {e.strerror or e}", where=where,
                        fix="pass an existing file with --matrix") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"not UTF-8 text at byte {e.start}", where=where, fix="save the file as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"TOML syntax error: {e}", where=where, fix="fix the syntax at that line") from None
    except RecursionError:
        raise UserError(f"nested more than Python can parse (over {MAX_DEPTH} levels is never meant)", where=where,
                        fix="a matrix is a few tables deep; see matrix.toml") from None
    _check_tree(where, data)
    return data


def _check_tree(where: str, node: Any, path: str = "", depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise UserError(f"nested deeper than {MAX_DEPTH} levels at {shorten(path, 80)}", where=where,
                        fix="a matrix is a few tables deep; see matrix.toml")
    if isinstance(node, dict):
        for key, value in node.items():
            _check_string(where, f"{path}.{key}" if path else str(key), key, "key")
            _check_tree(where, value, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_tree(where, value, f"{path}[{i}]", depth + 1)
    elif isinstance(node, str):
        _check_string(where, path, node, "value")


def _check_string(where: str, path: str, text: str, what: str) -> None:
    m = _CONTROL.search(text)
    if m:
        raise UserError(f"the {what} at {shorten(path, 80)} holds a control character ({m.group(0)!r})",
                        where=where, fix="matrix strings are one line of text: remove it")
    if len(text) > MAX_STRING:
        raise UserError(f"the {what} at {shorten(path, 80)} is {len(text)} characters long", where=where,
                        fix=f"keep it under {MAX_STRING}")

