"""Reads the image's own record (/etc/trainbox/image.json; env TRAINBOX_IMAGE_INFO overrides the path).

`load()` returns the record as a dict, or None when running outside a trainbox image (no file at the default path).
A record that exists but is unreadable or malformed raises ImageInfoError (a UsageError: exit 2 with what/where/fix),
because guessing the image's facts would make doctor's verdict a lie.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common.errors import UsageError

DEFAULT_PATH = "/etc/trainbox/image.json"
ENV_VAR = "TRAINBOX_IMAGE_INFO"
# The keys render.py writes (CONTRIBUTING.md, "The image contract"); values may be null where the contract says so.
REQUIRED_KEYS = ("cell", "tag", "arch", "cuda", "gpu", "cuda_arch_list", "attention_backend", "min_driver", "python",
                 "versions")
ATTENTION_BACKENDS = ("fa3", "fa2", "sdpa")


class ImageInfoError(UsageError):
    """The image record exists but can't be used."""


def path() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_PATH)


def load() -> dict | None:
    """The image record, or None outside an image. Raises ImageInfoError for a broken record."""
    p = path()
    explicit = bool(os.environ.get(ENV_VAR))
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise ImageInfoError(f"{ENV_VAR}={p}: no such file; point it at an image record or unset it") from None
        return None
    except OSError as e:
        raise ImageInfoError(f"image record {p}: can't read it ({e.strerror}); check its permissions") from None
    except UnicodeDecodeError:
        raise ImageInfoError(f"image record {p}: not UTF-8 text (a binary file?); rebuild the image or fix the "
                             "file") from None
    try:
        info = json.loads(text)
    except json.JSONDecodeError as e:
        raise ImageInfoError(f"image record {p}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); "
                             "rebuild the image or fix the file") from None
    validate(info, p)
    return info


def validate(info: object, where: Path | str = "image record") -> None:
    if not isinstance(info, dict):
        raise ImageInfoError(f"{where}: expected a JSON object, got {type(info).__name__}; rebuild the image")
    missing = [k for k in REQUIRED_KEYS if k not in info]
    if missing:
        raise ImageInfoError(f"{where}: missing key(s) {', '.join(missing)}; the record must have "
                             f"{', '.join(REQUIRED_KEYS)} (CONTRIBUTING.md) — rebuild the image")
    if not isinstance(info["versions"], dict):
        raise ImageInfoError(f"{where}: 'versions' must be an object of package -> version; rebuild the image")
    if info["attention_backend"] not in ATTENTION_BACKENDS:
        raise ImageInfoError(f"{where}: attention_backend={info['attention_backend']!r}, expected one of "
                             f"{', '.join(ATTENTION_BACKENDS)}; rebuild the image")


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def version_of(info: dict | None, *names: str) -> str | None:
    """The recorded version of the first of `names` present (package names compared like pip does: - _ . equal)."""
    if not info:
        return None
    table = {_norm(k): v for k, v in info.get("versions", {}).items()}
    for n in names:
        if _norm(n) in table:
            return table[_norm(n)]
    return None


def capabilities(info: dict | None) -> list[tuple[int, int]]:
    """The image's cuda_arch_list ("8.0;9.0+PTX", "9.0a", or a list) as sorted (major, minor) pairs."""
    raw = (info or {}).get("cuda_arch_list") or []
    items = raw if isinstance(raw, list) else str(raw).replace(",", ";").replace(" ", ";").split(";")
    out = set()
    for item in items:
        s = str(item).strip().removesuffix("+PTX").rstrip("af")
        if not s:
            continue
        major, _, minor = s.partition(".")
        if major.isdigit() and (minor or "0").isdigit():
            out.add((int(major), int(minor or 0)))
    return sorted(out)


def has_ptx(info: dict | None) -> bool:
    raw = (info or {}).get("cuda_arch_list") or []
    return "+PTX" in (";".join(raw) if isinstance(raw, list) else str(raw))
