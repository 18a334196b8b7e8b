"""The grammar of where each matrix value goes (a tag, a package name, a platform, an ENV line, a URL), and the check
of every value a cell renders into its Dockerfile, tags and labels against it."""
from __future__ import annotations

import re

from builder import reference
from builder.errors import UserError, shorten
from builder.matrix.model import Cell

TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", re.ASCII)
PACKAGE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", re.ASCII)  # PEP 508 names
PYTHON = re.compile(r"3\.[0-9]{1,2}", re.ASCII)
PLATFORM = re.compile(r"linux/(amd64|arm64|ppc64le|s390x|riscv64)(/v[0-9])?", re.ASCII)
WORD = re.compile(r"[A-Za-z0-9_.+:/@=,;-]+", re.ASCII)  # a URL, a platform tag, an arch list: one shell word
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
ENV_VALUE = re.compile(r"[A-Za-z0-9_.,:/+=-]*", re.ASCII)
DEB_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+", re.ASCII)  # Debian Policy 5.6.1
PREFIX = re.compile(r"/[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*", re.ASCII)
REL_PATH = re.compile(r"[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*", re.ASCII)


def grammar(where: str, field: str, value: str, pattern: re.Pattern, what: str) -> None:
    if not pattern.fullmatch(value):
        raise UserError(f"{field} = {shorten(value, 80)!r} is not {what}", where=where)


def check_cell_values(where: str, c: Cell) -> None:
    """The values a cell renders into its Dockerfile, its tags and its labels, each against its grammar."""
    w = f"{where}: cell {shorten(c.name, 60)}"
    grammar(w, "name", c.name, TAG, "usable in an image tag (letters, digits, '_', '.', '-'; 128 at most)")
    grammar(w, "tag", c.tag, TAG, "a valid image tag")
    for t in c.version_tags:
        grammar(w, "naming.version_tags", t, TAG, "a valid image tag")
    grammar(w, "naming.version", c.version, TAG, "usable in an image tag (e.g. 0.4.0)")
    if not reference.is_name(c.repository):
        raise UserError(f"naming.repository = {shorten(c.repository, 80)!r} is not an image repository name",
                        where=w, fix="lower case letters, digits and separators, e.g. trainbox or ghcr.io/org/trainbox")
    grammar(w, "naming.source", c.source, WORD, "a URL")
    for field in ("base_image", "build_image"):
        image = getattr(c, field)
        if image is not None and not (reference.REFERENCE.fullmatch(image) and len(image) <= reference.NAME_MAX):
            raise UserError(f"{field} = {shorten(image, 80)!r} is not an image reference", where=w,
                            fix="NAME[:TAG][@DIGEST], e.g. nvidia/cuda:12.9.1-base-ubuntu24.04")
    grammar(w, "python", c.python, PYTHON, "a Python version like 3.12")
    grammar(w, "arch.platform", c.platform, PLATFORM, "a platform like linux/amd64 or linux/arm64")
    grammar(w, "arch.uv_platform", c.uv_platform, WORD, "a platform tag like x86_64-manylinux_2_28")
    for field in ("cuda_arch_list", "torch_arch_list"):
        if getattr(c, field):
            grammar(w, field, getattr(c, field), re.compile(r"[0-9A-Za-z.+; ]*"),
                    "a list like 9.0a;10.0+PTX")
    for name in c.pins:
        grammar(w, "package name", name, PACKAGE, "a package name (PEP 508)")
    a = c.attention
    for key in ("package",):
        if a.get(key):
            grammar(w, f"attention.{key}", a[key], PACKAGE, "a package name (PEP 508)")
    for key in ("version", "source", "source_subdir"):
        if a.get(key):
            grammar(w, f"attention.{key}", a[key], WORD, "one word (no spaces or quotes)")
    for k, v in (a.get("build_env") or {}).items():
        grammar(w, "attention.build_env name", k, ENV_NAME, "an environment variable name")
        grammar(w, f"attention.build_env.{k}", str(v), ENV_VALUE, "a plain value")
    for name in c.fabric_packages:
        grammar(w, "fabric.packages", name, DEB_PACKAGE, "a Debian package name")
    for k, v in c.fabric_env:
        grammar(w, "fabric.env name", k, ENV_NAME, "an environment variable name")
        grammar(w, f"fabric.env.{k}", v, ENV_VALUE, "a plain value")
    for name, url in c.index_templates.items():
        grammar(w, f"index.{name}", url, re.compile(r"[^\s'\"\\`$]*"), "a URL (no spaces, quotes, backslashes or $)")

