"""Hash-locked requirements: `uv pip compile --generate-hashes` for a cell's target platform and python (so aarch64
locks are made on an x86 host), through the indexes the cell needs (builder/indexes.py).

- locks/<venv>.txt: the shared venv (every cell of one CUDA, arch and stack uses the same file, hence the same layer).
- locks/<tag>.attention.txt: a prebuilt FlashAttention wheel, by version and hash, installed in its own small layer.

Each lock starts with a header recording a hash of its inputs (pins, python, platform, index names and which package
comes from which index - never URLs) and, as a comment outside that hash, the redacted URLs it was resolved from;
`is_fresh()` recomputes the hash without any network. `ensure()` is the build's lock step: it locks what is missing or
stale before anything is built (all resolves first, then the writes, each atomic), or with `frozen` refuses.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from builder import bases as base_lock, indexes
from builder.errors import UserError
from builder.matrix import Cell
from builder.matrix.locknames import lock_names
from builder.paths import ROOT
from common import atomic

HEADER = "# trainbox lock for {name} ({platform}, python {python}); regenerate: python build.py --lock {tag}\n"
INPUTS = "# inputs-sha256: {digest}\n"
# What the lock was resolved from (redacted URLs): a comment, outside the inputs digest (a mirror must not make it stale).
RESOLVED = "# resolved from: {sources}\n"
UV_TIMEOUT_S = "60"


def requirements_in(cell: Cell) -> str:
    return "".join(f"{r}\n" for r in cell.requirements())


def attention_requirement(cell: Cell) -> str:
    return f"{cell.attention['package']}=={cell.attention['version']}"


def inputs_digest(cell: Cell) -> str:
    """What the venv lock depends on; indexes are named, never given by URL (a mirror must not make it stale)."""
    parts = [requirements_in(cell), cell.python, cell.uv_platform, cell.torch_variant or "",
             ",".join(n for n in indexes.needed(cell) if n != "flash"), "v1"]   # flash: the attention lock's
    routes = indexes.routes(cell)
    if routes:  # which package comes from which index is an input (cells without variant indexes keep their digest)
        parts.append(json.dumps(routes, sort_keys=True))
    if cell.sdists:  # likewise: cells whose locks take wheels only keep their digest
        parts.append("sdists=" + ",".join(cell.sdists))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def attention_digest(cell: Cell) -> str:
    parts = [attention_requirement(cell), cell.uv_platform, cell.flash["flash_variant"], "v1"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def find_links(cell: Cell) -> list[str]:
    """Local wheel directories offered to the resolver, for CPU-torch cells only (the CPU torch wheel lives there on
    development and CI machines; a GPU cell must never resolve `torch==2.13.0` to a local +cpu build)."""
    if cell.torch_variant != "cpu":
        return []
    out = [str(ROOT / "wheelhouse")]
    out += os.environ.get("PIP_FIND_LINKS", "").split()
    if Path("/opt/wheels").is_dir() and "/opt/wheels" not in out:
        out.append("/opt/wheels")
    return [d for d in out if Path(d).is_dir()]


def uv_binary() -> str:
    for cand in (Path(sys.executable).parent / "uv", shutil.which("uv")):
        if cand and Path(cand).exists():
            return str(cand)
    raise UserError("uv is not installed", fix="pip install uv (it is in the dev extra: pip install -e '.[dev]')")


def wheels_only(cell: Cell) -> list[str]:
    """Wheels for everything but the flavour's `sdists` (packages published as source archives only): uv takes
    those from their source archive, by hash like any wheel, and the image's install step builds them."""
    if not cell.sdists:
        return ["--no-build"]
    return ["--only-binary", ":all:", *(a for p in cell.sdists for a in ("--no-binary", p))]


SOURCE_MARK = "# source: "   # an attention lock with this line and no requirement: no prebuilt wheel, build from source


def uv_error(stderr: str, limit: int = 500) -> str:
    """uv's error as one line: all of it, its tree glyphs dropped, the end kept where it is long (the causes come
    last). uv wraps its text to a width that varies with where it runs, so its last lines alone could miss the
    reason (a run under xdist lost "has no wheels with a matching platform tag" that way)."""
    text = " ".join(re.sub(r"[×╰─▶│├]+", " ", stderr).split())
    return text if len(text) <= limit else "... " + text[-limit:]


def _uv(cell: Cell, what: str, requirements: str, args: list[str], urls: dict[str, str],
        unsatisfiable_ok: bool = False, project: str | None = None) -> str | None:
    """uv's lock text; None where `unsatisfiable_ok` and the index answered but has no matching wheel (uv exits 1
    with "No solution found"; an unreachable index exits 2 and stays an error). PROJECT: a pyproject.toml text to
    resolve instead of the REQUIREMENTS (the per-package index routing lives there)."""
    env = dict(os.environ)
    env.setdefault("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")
    env.setdefault("UV_NATIVE_TLS", "1")
    env.setdefault("UV_HTTP_TIMEOUT", UV_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="trainbox-lock-") as tmp:
        source = "-"
        if project is not None:
            (Path(tmp) / "pyproject.toml").write_text(project, encoding="utf-8")
            source = "pyproject.toml"   # relative: uv's "# via" comments then name no temporary path
        cmd = [uv_binary(), "pip", "compile", source, "--quiet", "--generate-hashes", "--no-header",
               "--python-version", cell.python, "--python-platform", cell.uv_platform, *wheels_only(cell), *args]
        proc = subprocess.run(cmd, input=requirements if project is None else None, capture_output=True, text=True,
                              env=env, cwd=tmp)
    if unsatisfiable_ok and proc.returncode == 1 and "No solution found" in proc.stderr:
        return None
    if proc.returncode != 0:
        msg = uv_error(indexes.redact(proc.stderr)) or f"exit {proc.returncode}"  # redacted whole, then cut
        named = ", ".join(f"{n} = {indexes.redact(u)}" for n, u in urls.items()) or "the default index only"
        fix = ("if an index is not reachable from here, point it at a mirror (--index NAME=URL or "
               "TRAINBOX_INDEX_<NAME>, see [index] in matrix.toml) or commit a lock made where it is reachable "
               f"(python build.py --lock {cell.tag})")
        raise UserError(f"cannot lock {what} for cell {cell.tag} through {named}: {msg}",
                        fix=fix)
    return proc.stdout


def project_text(cell: Cell, urls: dict[str, str]) -> str:
    """A pyproject.toml whose explicit indexes serve only the packages routed to them (indexes.routes): the torch
    family from the torch index, vLLM from the vLLM index, everything else from the default index alone. Never
    best-match across indexes: a higher `numpy` on the torch index must not win (the torchtriton shape of attack)."""
    routes = indexes.routes(cell)
    lines = ["[project]", 'name = "trainbox-lock-input"', 'version = "0"',
             "dependencies = [" + ", ".join(json.dumps(r) for r in cell.requirements()) + "]", ""]
    for name in sorted(set(routes.values())):
        lines += ["[[tool.uv.index]]", f"name = {json.dumps(name)}", f"url = {json.dumps(urls[name])}",
                  "explicit = true", ""]
    lines.append("[tool.uv.sources]")
    lines += [f"{pkg} = {{ index = {json.dumps(name)} }}" for pkg, name in sorted(routes.items())]
    return "\n".join(lines) + "\n"


def resolved_from(cell: Cell, urls: dict[str, str], default: str, links: list[str]) -> str:
    """The header's record of where a lock's packages came from (credentials redacted, local paths as given)."""
    routes = indexes.routes(cell)
    out = [f"default = {indexes.redact(default) if default else '(the installer default index)'}"]
    for name, u in urls.items():
        pkgs = sorted(p for p, n in routes.items() if n == name)
        out.append(f"{name} = {indexes.redact(u)}" + (f" (only {', '.join(pkgs)})" if pkgs else ""))
    out += [f"find-links = {_shown(d)}" for d in links]
    return RESOLVED.format(sources="; ".join(out))


def _shown(path: str) -> str:
    """A find-links folder as the header names it: repository-relative, else no machine path in a committed lock."""
    try:
        return str(Path(path).resolve().relative_to(ROOT.resolve()))
    except ValueError:
        return "a local wheel folder outside the repository (PIP_FIND_LINKS)"


def compile_lock(cell: Cell, overrides: dict[str, str] | None = None) -> str:
    """The venv lock's text (no file is written)."""
    args: list[str] = []
    links = find_links(cell)
    for d in links:
        args += ["--find-links", d]
    urls = {n: indexes.url(cell, n, overrides) for n in indexes.needed(cell) if n != "flash"}
    default = indexes.url(cell, "default", overrides)
    if default:
        args += ["--default-index", default]
    body = _uv(cell, f"locks/{cell.venv}.txt", requirements_in(cell), args,
               {**({"default": default} if default else {}), **urls},
               project=project_text(cell, urls) if urls else None)
    absent = [p for p in cell.sdists if p not in lock_names(body)]
    if absent:   # `sdists` lets exactly these packages come as source archives: one the lock lacks is a mistake
        raise UserError(f"cannot lock locks/{cell.venv}.txt for cell {cell.tag}: sdists names {absent[0]!r}, which "
                        "the resolved lock does not contain", where=f"matrix.toml: flavour.{cell.flavour}.sdists",
                        fix="name a package of the flavour's lock that is published as a source archive only, or "
                            "drop it")
    return (HEADER.format(name=cell.venv, platform=cell.uv_platform, python=cell.python, tag=cell.tag)
            + INPUTS.format(digest=inputs_digest(cell)) + resolved_from(cell, urls, default, links) + body)


def compile_attention_lock(cell: Cell, overrides: dict[str, str] | None = None) -> str:
    """The prebuilt FlashAttention wheel by version and hash, from the flash index alone (no dependencies: it
    builds against the venv's torch). For a probed arch an index without a matching wheel gives a lock that says so:
    the cell then compiles the backend from its source (native builders only)."""
    url = indexes.url(cell, "flash", overrides)
    probe = bool(cell.flash.get("probe"))
    body = _uv(cell, str(cell.attention_lock), attention_requirement(cell) + "\n",
               ["--no-deps", "--index-url", url], {"flash": url}, unsatisfiable_ok=probe)
    if body is None:
        body = (f"{SOURCE_MARK}index flash has no {attention_requirement(cell)} wheel for {cell.uv_platform}, python "
                f"{cell.python}: compiled from matrix.toml's source (native builder only)\n")
    return (HEADER.format(name=f"{cell.tag}.attention", platform=cell.uv_platform, python=cell.python, tag=cell.tag)
            + INPUTS.format(digest=attention_digest(cell)) + RESOLVED.format(sources=f"flash = {indexes.redact(url)}")
            + body)


def attention_how(cell: Cell, root: Path | str = ROOT) -> str | None:
    """Where the cell's attention wheel comes from: "index" or "source" ("none" where the matrix gives neither);
    None for a probed arch whose fresh attention lock does not exist yet (the lock step decides)."""
    if not cell.flash:
        return None
    if cell.flash["how"] != "index" or not cell.flash.get("probe"):
        return cell.flash["how"]
    path = Path(root) / cell.attention_lock
    if recorded_digest(path) != attention_digest(cell):
        return None
    text = path.read_text(encoding="utf-8")
    return "source" if any(ln.startswith(SOURCE_MARK) for ln in text.splitlines()) else "index"


def recorded_digest(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            for _ in range(5):
                line = f.readline()
                if line.startswith("# inputs-sha256: "):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def wanted(cell: Cell) -> list[tuple[Path, str]]:
    """(lock path, digest it must record) for every lock the cell's build reads."""
    out = [(cell.lock, inputs_digest(cell))]
    if cell.attention_lock:
        out.append((cell.attention_lock, attention_digest(cell)))
    return out


def state(cell: Cell, root: Path | str = ROOT) -> str:
    """'fresh', 'missing' or 'stale' over all of the cell's locks."""
    worst = "fresh"
    for path, digest in wanted(cell):
        got = recorded_digest(Path(root) / path)
        if got is None:
            return "missing"
        if got != digest:
            worst = "stale"
    return worst


class Unfrozen(NamedTuple):
    """One reason a --frozen build refuses CELL: LOCK (a lock file, or a base tag locks/bases.toml lacks) is STATE."""
    cell: Cell
    lock: str
    state: str    # "missing" or "stale"
    kind: str     # "venv", "attention", "flavour" or "base"
    fix: str      # the command that makes it (lock.yml runs both)


def frozen_problems(cells: list[Cell], root: Path | str = ROOT, substituted=()) -> list[Unfrozen]:
    """Everything a --frozen build of CELLS refuses, in the order ensure() reports it: each venv, flavour and
    attention lock under ROOT that is missing or stale, then each base tag the bases lock has no digest for (the
    repository's locks/bases.toml). A flavour cell is built FROM its base cell, which the build adds to the selection
    (cli.with_bases) unless SUBSTITUTED names its image: the base cell's locks count for it."""
    root = Path(root)
    locks: list[Unfrozen] = []
    missing_bases: list[Unfrozen] = []
    for cell in cells:
        built = [cell.base, cell] if cell.flavour and cell.base and cell.base_image not in substituted else [cell]
        for c in built:
            for path, digest in wanted(c):
                got = recorded_digest(root / path)
                if got != digest:
                    kind = "attention" if path == c.attention_lock else "flavour" if c.flavour else "venv"
                    locks.append(Unfrozen(cell, str(path), "missing" if got is None else "stale", kind,
                                          f"python build.py --lock {c.tag}"))
        missing_bases += [Unfrozen(cell, f"{base_lock.PATH} [{image}]", "missing", "base",
                                   f"python build.py --lock-bases {c.tag}")
                          for c, image in base_lock.missing(built, ROOT, substituted)]
    return locks + missing_bases


def is_fresh(cell: Cell, root: Path | str = ROOT) -> bool:
    return state(cell, root) == "fresh"


def _texts(cells: list[Cell], root: Path, overrides, only_outdated: bool) -> dict[Path, str]:
    """Resolve every lock the cells need (each shared file once); raises before anything is written."""
    out: dict[Path, str] = {}
    for cell in cells:
        for path, digest in wanted(cell):
            if path in out or (only_outdated and recorded_digest(root / path) == digest):
                continue
            out[path] = (compile_lock(cell, overrides) if path == cell.lock
                         else compile_attention_lock(cell, overrides))
    return out


def lock_cells(cells: list[Cell], root: Path | str = ROOT, quiet: bool = False,
               overrides: dict[str, str] | None = None) -> int:
    """`--lock`: re-resolve every lock of the selected cells; all or nothing."""
    root = Path(root)
    texts = _texts(cells, root, overrides, only_outdated=False)
    for path, text in texts.items():
        atomic.write_text(root / path, text)
        if not quiet:
            print(f"locked {path} ({text.count('--hash=')} hashes)")
    return 0


def ensure(cells: list[Cell], root: Path | str = ROOT, overrides: dict[str, str] | None = None,
           frozen: bool = False, quiet: bool = False, bases: dict[str, str] | None = None) -> list[Path]:
    """The build's lock step: lock what is missing or stale (returns the paths written); `frozen` refuses instead,
    also where a base image the build pulls (one BASES does not substitute) has no digest in locks/bases.toml (the
    repository's: a digest is not a matrix input, so any output folder's build uses it)."""
    root = Path(root)
    if frozen:
        bad = [p for p in frozen_problems(cells, root, substituted=set(bases or {})) if p.kind != "base"]
        if bad:
            first = bad[0]
            raise UserError(f"--frozen: {first.lock} is {first.state} (cell {first.cell.tag}"
                            f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''})",
                            fix=f"run `python build.py --lock {first.cell.tag}` and commit the lock, or build without "
                                "--frozen to lock automatically")
        base_lock.check_frozen(cells, ROOT, substituted=set(bases or {}))
        return []
    texts = _texts(cells, root, overrides, only_outdated=True)
    for path, text in texts.items():
        atomic.write_text(root / path, text)
        if not quiet:
            print(f"lock: wrote {path} ({text.count('--hash=')} hashes)", flush=True)
    return list(texts)


def seed(cells: list[Cell], root: Path | str) -> list[Path]:
    """Copy the repository's fresh locks of CELLS into ROOT (another output folder) where it has none: a lock is keyed
    by its inputs' digest, so it serves any matrix whose cell has the same inputs. Returns the paths copied."""
    root = Path(root)
    copied: list[Path] = []
    if root.resolve() == ROOT.resolve():
        return copied
    for cell in cells:
        for path, digest in wanted(cell):
            if recorded_digest(root / path) is None and recorded_digest(ROOT / path) == digest:
                atomic.write_text(root / path, (ROOT / path).read_text(encoding="utf-8"))
                copied.append(path)
    return copied
