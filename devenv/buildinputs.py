"""What a smoke build on this machine takes from the host: its extra CA certificates, and the smoke cell's CPU torch.

- The host's extra CA certificates (/usr/local/share/ca-certificates/*.crt) are copied into images/certs/ (git-ignored),
  which the Dockerfile trusts: this machine's package traffic goes through a TLS-intercepting proxy.
- The smoke cell's torch wheel (cp311, manylinux x86_64), fetched with pip's own configuration (find-links on the
  dev/CI machines, else $TORCH_INDEX_URL/cpu), into a wheelhouse folder that `build.py --wheelhouse` offers first.

`python -m devenv.buildinputs [--wheelhouse DIR]` does both (quick when done), copies the wheel into DIR if given, and
prints the wheelhouse folder (`make build` passes .cache/wheels to build.py --wheelhouse).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from builder.errors import UserError, reports_user_errors
from builder.matrix import load_matrix
from builder.paths import ROOT
from common import atomic
from devenv.common import cache_dir, logger

HOST_CERTS = Path("/usr/local/share/ca-certificates")
_log = logger("buildinputs")


def install_certs(dest: Path = ROOT / "images" / "certs") -> list[Path]:
    """Copy the host's extra CA certificates into DEST (only those that differ); returns DEST's certificates."""
    dest.mkdir(parents=True, exist_ok=True)
    for crt in sorted(HOST_CERTS.glob("*.crt")):
        target = dest / crt.name
        if not target.exists() or target.read_bytes() != crt.read_bytes():
            atomic.copy_file(crt, target)
            _log(f"trusting {crt} in the images (images/certs/{crt.name})")
    return sorted(dest.glob("*.crt"))


def smoke_torch() -> str:
    """The smoke cell's torch requirement (x86_64, the full profile), from matrix.toml."""
    cell = next(c for c in load_matrix(ROOT / "matrix.toml").cells if c.name == "smoke" and c.arch == "x86_64")
    return cell.requirement("torch")


def torch_wheelhouse(requirement: str | None = None) -> Path:
    requirement = requirement or smoke_torch()
    dest = cache_dir() / "wheelhouse" / requirement.replace("==", "-")
    if dest.is_dir() and any(dest.glob("torch-*.whl")):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", str(dest), requirement]
    if os.environ.get("TORCH_INDEX_URL"):
        cmd += ["--extra-index-url", os.environ["TORCH_INDEX_URL"].rstrip("/") + "/cpu"]
    _log(f"fetching {requirement} into {dest}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not any(dest.glob("torch-*.whl")):
        shutil.rmtree(dest, ignore_errors=True)
        last = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise UserError(f"could not fetch {requirement} (cp311, manylinux x86_64): {last}",
                        fix="give pip a find-links folder holding it, or set TORCH_INDEX_URL to PyTorch's index")
    return dest


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devenv.buildinputs", description=__doc__.splitlines()[0])
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", help="also copy the wheel into DIR")
    a = p.parse_args(argv)
    install_certs()
    wheels = torch_wheelhouse()
    if a.wheelhouse:
        for whl in wheels.glob("*.whl"):
            if not (a.wheelhouse / whl.name).exists():
                atomic.copy_file(whl, a.wheelhouse / whl.name)
        wheels = a.wheelhouse
    print(wheels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
