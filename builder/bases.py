"""The bases lock (locks/bases.toml): every base and build image tag a GPU cell builds FROM -> the digest the tag
named when it was locked, so the OS side is pinned like the Python side. The Dockerfile then names its base as
`TAG@sha256:...` (ARG default and the OCI base labels); a tag whose digest moved is a change of this file in review,
not a silent rebuild. `python build.py --lock-bases [CELLS]` asks the registry (skopeo inspect --raw: the digest is
the sha256 of the manifest's own bytes); `--frozen` refuses a cell whose base has no entry.

An entry holds the tag's manifest (list) digest and, for a multi-arch tag, each platform's manifest digest; a cell
uses its platform's where recorded (what an arch's build pulls), else the tag's. CPU cells build FROM a local base in
the tests (--base) and are not locked.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from builder.errors import UserError
from builder.matrix import Cell
from builder.paths import ROOT
from common import atomic

PATH = Path("locks/bases.toml")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
LIST_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
SKOPEO_TIMEOUT_S = 120


def images(cell: Cell) -> list[str]:
    """The tags CELL builds FROM that the bases lock must pin (already digest-pinned names need no entry)."""
    if not getattr(cell, "cuda", None) or getattr(cell, "flavour", None):  # a flavour builds FROM our own image
        return []
    out = [cell.base_image] + ([cell.build_image] if cell.has_compile_stage and cell.build_image else [])
    return [i for i in out if "@" not in i]


def read(root: Path | str = ROOT) -> dict[str, dict]:
    path = Path(root) / PATH
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        raise UserError(f"cannot read the bases lock: {e}", where=str(path),
                        fix="restore it from git or run `python build.py --lock-bases`") from None
    for tag, entry in data.items():
        digests = ([entry.get("digest", "")] + list(entry.get("platforms", {}).values())
                   if isinstance(entry, dict) and isinstance(entry.get("platforms", {}), dict) else [])
        if not any(digests) or not all(isinstance(d, str) and DIGEST.fullmatch(d) for d in digests if d):
            raise UserError(f"bases lock entry {tag!r} has no valid sha256 digest", where=str(path),
                            fix="run `python build.py --lock-bases` where the registry is reachable")
        # what --lock-bases writes back (render_lock) must be what it read: known keys, strings only
        unknown = sorted(set(entry) - {"digest", "platforms", "locked", "source"})
        odd = [k for k in ("digest", "locked", "source") if not isinstance(entry.get(k, ""), str)]
        if unknown or odd:
            raise UserError(f"bases lock entry {tag!r}: " + (f"unknown key {unknown[0]!r}" if unknown else
                                                             f"{odd[0]} must be a string"), where=str(path),
                            fix="keys: digest, platforms, locked, source (strings); restore it from git or run "
                                "`python build.py --lock-bases`")
    return data


def digest_for(image: str, platform: str, root: Path | str = ROOT) -> str | None:
    """The digest IMAGE is pinned to for PLATFORM (linux/amd64...), None where the lock has no entry."""
    entry = read(root).get(image)
    if not entry:
        return None
    return entry.get("platforms", {}).get(platform) or entry.get("digest") or None


def ref(image: str, cell: Cell, root: Path | str = ROOT, platform: str | None = None) -> str:
    """IMAGE as the cell's Dockerfile names it: TAG@sha256:... where locked, else the tag; for PLATFORM (default the
    cell's: another one names the same base for the build machine, the host-base stage)."""
    if image not in images(cell):
        return image
    digest = digest_for(image, platform or cell.platform, root)
    return f"{image}@{digest}" if digest else image


def missing(cells: list[Cell], root: Path | str = ROOT, substituted=()) -> list[tuple[Cell, str]]:
    """(cell, tag) for every base a build would pull by tag alone (a --base substitution replaces it)."""
    return [(c, i) for c in cells for i in images(c) if i not in substituted and not digest_for(i, c.platform, root)]


def check_frozen(cells: list[Cell], root: Path | str = ROOT, substituted=()) -> None:
    bad = missing(cells, root, substituted)
    if bad:
        cell, image = bad[0]
        raise UserError(f"--frozen: {PATH} has no digest for {image} (cell {cell.tag}"
                        f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''})",
                        fix=f"run `python build.py --lock-bases {cell.tag}` where the registry is reachable and commit "
                            f"{PATH}, or build FROM another base (--base {image}=IMAGE)")


def _tls_flag(image: str) -> list[str]:
    """The engine pushes to 127.0.0.0/8 without TLS (DESIGN.md); skopeo must be told so."""
    host = image.split("/", 1)[0] if "/" in image else ""
    return ["--tls-verify=false"] if re.fullmatch(r"(127(\.\d+){3}|localhost|\[::1\])(:\d+)?", host) else []


def _skopeo_inspect(image: str, *flags: str) -> subprocess.CompletedProcess | None:
    """`skopeo inspect FLAGS docker://IMAGE` (None when it timed out); no skopeo is one error."""
    skopeo = shutil.which("skopeo")
    if not skopeo:
        raise UserError("skopeo is not installed (the bases lock asks the registry through it)",
                        fix="apt-get install skopeo")
    try:
        return subprocess.run([skopeo, "inspect", *flags, *_tls_flag(image), f"docker://{image}"],
                              capture_output=True, timeout=SKOPEO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def inspect(image: str) -> dict:
    """The registry's answer for IMAGE: {digest, platforms} from the manifest's raw bytes."""
    proc = _skopeo_inspect(image, "--raw")
    if proc is None or proc.returncode != 0:
        why = "timed out" if proc is None else " ".join(proc.stderr.decode(errors="replace").split())[-300:]
        raise UserError(f"cannot lock base {image}: the registry did not answer ({why})",
                        fix="run `python build.py --lock-bases` where the registry is reachable (from CI, the lock "
                            "workflow), or build FROM a local base with --base")
    raw = proc.stdout
    out: dict = {"digest": "sha256:" + hashlib.sha256(raw).hexdigest()}
    manifest = json.loads(raw)
    if manifest.get("mediaType") in LIST_TYPES or "manifests" in manifest:
        plats = {}
        for m in manifest.get("manifests", []):
            p = m.get("platform") or {}
            if p.get("os") in (None, "unknown"):   # attestation manifests of a buildx image
                continue
            for name in _platform_names(p):
                plats.setdefault(name, m["digest"])
        out["platforms"] = plats
    return out


@functools.cache
def platforms(image: str) -> frozenset[str] | None:
    """The platforms IMAGE's tag serves: a manifest list's entries, or a single manifest's own (its config's os and
    architecture); None where the registry gives no answer (no skopeo, an image only in the local engine, a registry
    out of reach). Asked once per run: every emulated cell built FROM one substitute shares the answer."""
    try:
        got = inspect(image)
        if "platforms" in got:
            return frozenset(got["platforms"])
        proc = _skopeo_inspect(image, "--config", "--raw")
        config = json.loads(proc.stdout) if proc is not None and proc.returncode == 0 else {}
    except (UserError, ValueError):
        return None
    if not config.get("os") or not config.get("architecture"):
        return None
    return frozenset(_platform_names(config))


def _platform_names(p: dict) -> list[str]:
    """A manifest's (or image config's) os/architecture[/variant], and linux/arm64 beside linux/arm64/v8: the matrix
    and host_platform name it so."""
    name = f"{p['os']}/{p['architecture']}" + (f"/{p['variant']}" if p.get("variant") else "")
    return [name, f"{p['os']}/arm64"] if p["architecture"] == "arm64" and p.get("variant") == "v8" else [name]


def _toml(s: str) -> str:
    """S as a TOML basic string: JSON's escapes are TOML's, but JSON leaves DEL raw, which TOML refuses."""
    return json.dumps(s).replace("\x7f", "\\u007f")


def render_lock(entries: dict[str, dict]) -> str:
    """The TOML text (keys sorted; every string escaped for TOML, so what read() accepted reads back the same)."""
    lines = ["# trainbox bases lock: image tag -> digest it named when locked (the tag's manifest or manifest list;",
             "# `platforms`: each platform's manifest). Written by `python build.py --lock-bases`; a moved tag is a",
             "# change of this file. `source`: where the digest came from.", ""]
    for tag in sorted(entries):
        e = entries[tag]
        lines.append(f"[{_toml(tag)}]")
        if e.get("digest"):
            lines.append(f"digest = {_toml(e['digest'])}")
        if e.get("platforms"):
            inner = ", ".join(f"{_toml(k)} = {_toml(v)}" for k, v in sorted(e["platforms"].items()))
            lines.append(f"platforms = {{ {inner} }}")
        lines += [f"{k} = {_toml(e[k])}" for k in ("locked", "source") if k in e] + [""]
    return "\n".join(lines)


def lock_bases(cells: list[Cell], root: Path | str = ROOT, quiet: bool = False) -> int:
    """`--lock-bases`: ask the registry for every base tag of CELLS, then write the lock once (other entries kept)."""
    root = Path(root)
    tags = sorted({i for c in cells for i in images(c)})
    if not tags:
        raise UserError("the selected cells build FROM no base the bases lock pins (CPU cells use --base)",
                        fix="select GPU cells, e.g. python build.py --lock-bases --cuda 13.0")
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    found = {t: {**inspect(t), "locked": today, "source": "skopeo inspect --raw (python build.py --lock-bases)"}
             for t in tags}
    entries = {**read(root), **found}
    atomic.write_text(root / PATH, render_lock(entries))
    if not quiet:
        for t in tags:
            print(f"locked base {t}@{found[t]['digest']}")
    return 0
