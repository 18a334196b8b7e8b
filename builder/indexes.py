"""Which wheel indexes a cell needs and their URLs: matrix.toml's [index] defaults, overridden (in this order) by the
environment (TRAINBOX_INDEX_<NAME>), a --config file's [index] table and --index NAME=URL.

Each index becomes one build arg (INDEX_URL, TORCH_INDEX_URL, VLLM_INDEX_URL, FLASH_INDEX_URL) with the same value in
the lock step, the Dockerfile's ARG default, the build and the generated workflow. URLs never enter a lock's inputs
digest (a mirror must not make a lock stale) and `--dry-run` prints them without credentials.
"""
from __future__ import annotations

import os
import re

from builder import templating
from builder.errors import UserError
from builder.matrix import Cell
from builder.matrix.schema import INDEX_NAMES
from common import redact as _redact

ARGS = {"default": "INDEX_URL", "torch": "TORCH_INDEX_URL", "vllm": "VLLM_INDEX_URL", "flash": "FLASH_INDEX_URL"}


def needed(cell: Cell) -> list[str]:
    """Index names the cell's lock and build must reach besides the default index."""
    out = []
    if cell.cuda and "torch" in cell.pins and not cell.default_index:
        out.append("torch")
    if cell.cuda and "vllm" in cell.pins and not cell.default_index:
        out.append("vllm")
    if cell.flash and cell.flash["how"] == "index":
        out.append("flash")
    return out


# The packages each variant index is the one home of (PyTorch's index serves these builds per CUDA variant; vLLM's
# serves vLLM's). Only those the cell pins are routed: a source needs a direct requirement.
FAMILIES = {"torch": ("torch", "torchvision", "torchaudio", "triton"), "vllm": ("vllm",)}


def routes(cell: Cell) -> dict[str, str]:
    """Package -> the one index it resolves from, for every pinned package a variant index serves; every other
    package resolves from the default index alone (never best-match across indexes: dependency confusion)."""
    return {pkg: name for name in needed(cell) if name in FAMILIES
            for pkg in FAMILIES[name] if pkg in cell.pins}


def parse_overrides(pairs: list[str] | None, config: dict | None = None, env=None) -> dict[str, str]:
    """NAME -> URL template from the environment, then a config's [index] table, then --index NAME=URL."""
    env = os.environ if env is None else env
    out: dict[str, str] = {}
    for name in INDEX_NAMES:
        v = env.get(f"TRAINBOX_INDEX_{name.upper()}")
        if v:  # empty = unset (a workflow passes unset repository variables as empty strings)
            out[name] = v
    for source, items in (("--config [index]", (config or {}).items()),
                          ("--index", (p.partition("=")[::2] for p in pairs or []))):
        for name, url in items:
            if name not in INDEX_NAMES:
                raise UserError(f"{source}: unknown index {name!r}", fix=f"use one of {', '.join(INDEX_NAMES)} "
                                "(e.g. --index torch=https://mirror.example/whl/{variant})")
            if not isinstance(url, str):
                raise UserError(f"{source}: index {name} must be a URL string")
            check_url(url, f"{source} {name}")
            out[name] = url
    return out


def check_url(url: str, where: str) -> str:
    """An index URL (template): http(s) or file, a host, nothing a shell or a Dockerfile line would split on."""
    if not re.fullmatch(r"(?i)(https?://[^/\s'\"\\`$]+|file://)[^\s'\"\\`$]*", url):
        raise UserError(f"{where}: {redact(url)[:200]!r} is not an index URL",
                        fix="give http(s)://HOST/PATH or file:///PATH, e.g. --index torch=https://mirror.example/whl/{variant}")
    return url


def url(cell: Cell, name: str, overrides: dict[str, str] | None = None) -> str:
    """The cell's URL for index NAME ('' = the installer's default index)."""
    template = (overrides or {}).get(name, cell.index_templates.get(name, ""))
    fields = {"variant": cell.torch_variant or "", "vllm": cell.pins.get("vllm", ""),
              "flash_variant": (cell.flash or {}).get("flash_variant", "")}
    # The template may hold a password: errors show it through UserError, which redacts.
    return templating.fill(template, f"index {name}", **fields)


def build_args(cell: Cell, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """ARG name -> URL for every index the cell needs, plus INDEX_URL when the default index is replaced."""
    out = {}
    for name in needed(cell):
        value = url(cell, name, overrides)
        if not value:
            raise UserError(f"cell {cell.tag} needs the {name} index but its URL is empty",
                            fix=f"set [index] {name} in matrix.toml, or --index {name}=URL")
        out[ARGS[name]] = value
    default = url(cell, "default", overrides)
    if default:
        out["INDEX_URL"] = default
    return out


def redact(text: str) -> str:
    """Credentials out of every URL in `text` (user-info, secret query values): common.redact, the one home."""
    return _redact.text(text)
