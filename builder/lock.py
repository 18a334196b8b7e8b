"""Per-cell hash-locked requirements: locks/<tag>.txt from `uv pip compile --generate-hashes` for the cell's
target platform and python (so aarch64 locks are made on an x86 host).

Each lock starts with a header recording a hash of its inputs (pins, python, platform, indexes); `is_fresh()`
recomputes it from the matrix without any network, which is what the freshness test checks.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from builder import atomic
from builder.errors import UserError
from builder.matrix import ROOT, Cell

HEADER = "# trainbox lock for cell {tag} ({platform}, python {python}); regenerate: python build.py --lock {tag}\n"
INPUTS = "# inputs-sha256: {digest}\n"


class Skip(Exception):
    """This cell can't be locked from here; the message names what is missing."""


def requirements_in(cell: Cell) -> str:
    return "".join(f"{r}\n" for r in cell.requirements())


def indexes(cell: Cell) -> list[str]:
    """Env var names of the extra wheel indexes the cell's pins need (the default index is implied)."""
    need = []
    if cell.torch_variant and cell.torch_variant != "cpu" and "torch" in cell.pins:
        need.append("TORCH_INDEX_URL")
    if cell.cuda and "vllm" in cell.pins:
        need.append("VLLM_INDEX_URL")
    return need


def inputs_digest(cell: Cell) -> str:
    """What the lock depends on; index URLs are named by variable and variant, never by value (may hold secrets)."""
    parts = [requirements_in(cell), cell.python, cell.uv_platform, cell.torch_variant or "",
             ",".join(indexes(cell)), "v1"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def find_links() -> list[str]:
    """Local wheel directories offered to the resolver: the repo's wheelhouse and pip's configured find-links
    (where the CPU torch wheel lives on development and CI machines)."""
    out = [str(ROOT / "wheelhouse")]
    for entry in os.environ.get("PIP_FIND_LINKS", "").split():
        out.append(entry)
    if Path("/opt/wheels").is_dir() and "/opt/wheels" not in out:
        out.append("/opt/wheels")
    return [d for d in out if Path(d).is_dir()]


def uv_binary() -> str:
    for cand in (Path(sys.executable).parent / "uv", shutil.which("uv")):
        if cand and Path(cand).exists():
            return str(cand)
    raise UserError("uv is not installed", fix="pip install uv (it is in the dev extra: pip install -e '.[dev]')")


def compile_lock(cell: Cell) -> str:
    """The lock file text for a cell. Raises Skip when an index it needs is not configured."""
    cmd = [uv_binary(), "pip", "compile", "-", "--quiet", "--generate-hashes", "--no-header",
           "--python-version", cell.python, "--python-platform", cell.uv_platform, "--no-build"]
    for d in find_links():
        cmd += ["--find-links", d]
    missing = [v for v in indexes(cell) if not os.environ.get(v)]
    if missing:
        raise Skip(f"needs {' and '.join(missing)} (torch {cell.pins.get('torch')}+{cell.torch_variant}"
                   f"{' and the matching vLLM build' if 'VLLM_INDEX_URL' in missing else ''} are not on the default "
                   f"index); set {' and '.join(missing)} to lock it")
    for var in indexes(cell):
        url = os.environ[var].rstrip("/")
        cmd += ["--extra-index-url", f"{url}/{cell.torch_variant}" if var == "TORCH_INDEX_URL" else url]
    if indexes(cell):
        # The variant indexes also carry common packages (numpy...); take each package's best version anywhere.
        cmd += ["--index-strategy", "unsafe-best-match"]
    env = dict(os.environ)
    env.setdefault("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")
    env.setdefault("UV_NATIVE_TLS", "1")
    proc = subprocess.run(cmd, input=requirements_in(cell), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        msg = " ".join(proc.stderr.strip().splitlines()[-3:]) or f"exit {proc.returncode}"
        raise UserError(f"uv pip compile failed for cell {cell.tag}: {msg}", fix="check the pins in matrix.toml")
    body = proc.stdout
    # Local wheel paths depend on the machine; the lock records names and hashes only.
    return (HEADER.format(tag=cell.tag, platform=cell.uv_platform, python=cell.python)
            + INPUTS.format(digest=inputs_digest(cell)) + body)


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


def is_fresh(cell: Cell, root: Path | str = ROOT) -> bool:
    return recorded_digest(Path(root) / cell.lock) == inputs_digest(cell)


def lock_cells(cells: list[Cell], root: Path | str = ROOT, quiet: bool = False) -> int:
    """Lock every selected cell that can be locked from here; name each skipped one and why.
    Exit 0 when at least one cell was locked (or none was selected), 1 when every one was skipped."""
    root = Path(root)
    locked, skipped = 0, 0
    for cell in cells:
        try:
            text = compile_lock(cell)
        except Skip as e:
            skipped += 1
            print(f"skipped {cell.tag}: {e}", file=sys.stderr)
            continue
        atomic.write_text(root / cell.lock, text)
        locked += 1
        if not quiet:
            print(f"locked {cell.tag} -> {cell.lock} ({text.count('--hash=')} hashes)")
    if skipped and not quiet:
        print(f"{locked} locked, {skipped} skipped (see above)", file=sys.stderr)
    return 1 if skipped and not locked else 0
