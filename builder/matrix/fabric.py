"""[fabric]: the RDMA userspace packages and ENV lines every GPU image gets, and [fabric.plugins.NAME], the NCCL net
plugins a cell may opt into (compiled from pinned sources), each value checked against the grammar of its RUN line."""
from __future__ import annotations

import re
from typing import Any

from builder.errors import UserError, shorten
from builder.matrix.grammar import DEB_PACKAGE, ENV_NAME, ENV_VALUE, PREFIX, REL_PATH, grammar
from builder.matrix.schema import FABRIC_KEYS, PLUGIN_BUILD_KEYS, PLUGIN_KEYS, check_table, str_list, str_table

PLUGIN_PREFIX = "/opt/nccl-net"   # a plugin's install prefix when its table names none
_GIT_SOURCE = re.compile(r"git\+(https://[A-Za-z0-9._~/:@%+-]+)@([0-9a-f]{40})", re.ASCII)
_URL_SOURCE = re.compile(r"https://[A-Za-z0-9._~/:%+-]+\.(tar\.gz|tgz|tar\.bz2|tar\.xz)", re.ASCII)
_CONFIGURE_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*(=[A-Za-z0-9_./,:+-]*)?", re.ASCII)


def check_fabric(f: str, fabric: dict) -> None:
    """[fabric]: Debian packages and ENV lines every GPU image gets (their grammar: check_cell_values)."""
    w = f"{f}: fabric"
    check_table(w, fabric, FABRIC_KEYS)
    if "packages" in fabric:
        str_list(f"{w}.packages", fabric["packages"])
    str_table(f"{w}.env", fabric.get("env", {}))
    if "plugins" in fabric:
        check_table(f"{w}.plugins", fabric["plugins"], {k: dict for k in fabric["plugins"]})
    for name, p in fabric.get("plugins", {}).items():
        _check_plugin(f"{w}.plugins.{name}", name, p)


def _check_plugin(w: str, name: str, p: Any) -> None:
    """One NCCL net plugin: every value is rendered into a RUN line, so each is checked against its grammar here."""
    grammar(w, "plugin name", name, re.compile(r"[a-z0-9][a-z0-9-]{0,31}", re.ASCII), "a short lower-case name")
    check_table(w, p, PLUGIN_KEYS, ("builds", "library"))
    if not p["builds"]:
        raise UserError("builds must not be empty", where=f"{w}.builds")
    seen = set()
    for i, b in enumerate(p["builds"]):
        bw = f"{w}.builds[{i}]"
        check_table(bw, b, PLUGIN_BUILD_KEYS, ("name", "source"))
        grammar(bw, "name", b["name"], re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII), "a short lower-case name")
        if b["name"] in seen:
            raise UserError(f"two builds are named {b['name']!r}", where=f"{bw}.name")
        seen.add(b["name"])
        src = b["source"]
        if src.startswith("git+"):
            if not _GIT_SOURCE.fullmatch(src):
                raise UserError(f"source {shorten(src, 80)!r} is not pinned to a commit", where=f"{bw}.source",
                                fix="write git+https://HOST/PATH@<40-hex commit> (git ls-remote URL TAG prints a "
                                    "tag's commit)")
            if "sha256" in b:
                raise UserError("sha256 is for a tarball source; a git source is pinned by its commit",
                                where=f"{bw}.sha256")
        elif _URL_SOURCE.fullmatch(src):
            if not re.fullmatch(r"[0-9a-f]{64}", b.get("sha256", ""), re.ASCII):
                raise UserError(f"a tarball source needs sha256 = <64 lower-case hex> (got {b.get('sha256')!r})",
                                where=f"{bw}.sha256", fix="sha256sum the release tarball you checked")
        else:
            raise UserError(f"source {shorten(src, 80)!r} is neither git+https://...@<commit> nor an https:// "
                            ".tar.gz/.tgz/.tar.bz2/.tar.xz URL", where=f"{bw}.source")
        for flag in str_list(f"{bw}.configure", b["configure"]) if "configure" in b else []:
            grammar(bw, "configure", flag, _CONFIGURE_FLAG, "a configure flag like --with-cuda=/usr/local/cuda")
            if flag.startswith("--prefix"):
                raise UserError("--prefix comes from the plugin's prefix", where=f"{bw}.configure")
    for key in ("build_packages", "packages"):
        for pkg in str_list(f"{w}.{key}", p[key]) if key in p else []:
            grammar(w, key, pkg, DEB_PACKAGE, "a Debian package name")
    for k, v in str_table(f"{w}.env", p.get("env", {})).items():
        grammar(w, "env name", k, ENV_NAME, "an environment variable name")
        grammar(w, f"env.{k}", v, ENV_VALUE, "a plain value")
    grammar(w, "prefix", p.get("prefix", PLUGIN_PREFIX), PREFIX, "an absolute path like /opt/nccl-net")
    grammar(w, "library", p["library"], REL_PATH, "a path inside the prefix like lib/libnccl-net.so")
    if "max_jobs" in p and p["max_jobs"] < 1:
        raise UserError("max_jobs must be >= 1", where=f"{w}.max_jobs")
