"""qemu-user for the arm64 builds on an x86 host: a new enough one, and its binfmt handler pointing at it.

    python3 -m devenv.qemu ensure    (root; `make gh200-image` runs it: stdlib only)
    python3 -m devenv.qemu version

Debian bookworm's qemu-user-static is QEMU 7.2, under which torch 2.13.0's aarch64 `import torch` segfaults in
libtorch's native init (benchmarks/results/gh200_image-2026-12-02c.txt; QEMU_CPU=cortex-a72 does the same), so the
GH200 cell's help-cache step, `doctor` and `selftest` cannot pass under it. QEMU 10.0.2 (bookworm-backports) imports
it. `ensure` installs qemu-user-static from the release's backports suite when the installed one is older than
MIN_VERSION, adding that suite with the mirror the machine's own Debian sources already name, then re-registers the
qemu-aarch64 handler: the handler is registered with the F flag (the kernel holds the interpreter file it opened at
registration), so a newer binary on disk is not used until it is registered again. Newer qemu-user packages register
through systemd's binfmt.d (/usr/lib/binfmt.d/qemu-aarch64.conf) instead of binfmt-support's update-binfmts.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MIN_VERSION = (10, 0)
BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")
BINFMT_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")        # qemu-user-binfmt (QEMU 10 and later)
BINFMTS_ENTRY = Path("/usr/share/binfmts/qemu-aarch64")           # binfmt-support's (QEMU 7.2's package)
SOURCES = Path("/etc/apt/sources.list.d")
BACKPORTS = SOURCES / "trainbox-backports.sources"


def _log(msg: str) -> None:
    print(f"[qemu] {msg}", file=sys.stderr, flush=True)


def parse_version(text: str) -> tuple[int, ...] | None:
    """`qemu-aarch64 version 10.0.2 (Debian ...)` -> (10, 0, 2)."""
    m = re.search(r"version (\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def version() -> tuple[int, ...] | None:
    exe = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if not exe:
        return None
    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return parse_version(r.stdout)


def os_release(path: Path = Path("/etc/os-release")) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        k, _, v = line.partition("=")
        out[k] = v.strip().strip('"')
    return out


def debian_mirror(sources_dir: Path = SOURCES, sources_list: Path = Path("/etc/apt/sources.list")) -> str | None:
    """The mirror the machine's Debian sources already use for the main archive (not the security one)."""
    texts = [p.read_text() for p in sorted(sources_dir.glob("*.sources")) if p != BACKPORTS]
    for text in texts:
        for m in re.finditer(r"^URIs:\s*(\S+)", text, re.M):
            if "security" not in m.group(1):
                return m.group(1)
    lists = [sources_list, *sorted(sources_dir.glob("*.list"))]
    for p in lists:
        for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+", p.read_text() if p.exists() else "", re.M):
            if "security" not in m.group(1):
                return m.group(1)
    return None


def backports_source(mirror: str, codename: str) -> str:
    return (f"Types: deb\nURIs: {mirror}\nSuites: {codename}-backports\nComponents: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")


def registered() -> str | None:
    """The registered qemu-aarch64 handler's interpreter, or None when none is enabled."""
    try:
        lines = (BINFMT_DIR / "qemu-aarch64").read_text().splitlines()
    except OSError:
        return None
    if not lines or lines[0].strip() != "enabled":
        return None
    return next((ln.split(None, 1)[1] for ln in lines if ln.startswith("interpreter ")), "")


def register() -> bool:
    """(Re-)register the qemu-aarch64 handler from whichever description the installed package ships."""
    if BINFMT_CONF.exists():
        if (BINFMT_DIR / "qemu-aarch64").exists():
            (BINFMT_DIR / "qemu-aarch64").write_text("-1")
        (BINFMT_DIR / "register").write_text(BINFMT_CONF.read_text().strip())
    elif BINFMTS_ENTRY.exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--disable", "qemu-aarch64"], capture_output=True)
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True)
    return registered() is not None


def ensure() -> int:
    have = version()
    installed = False
    if have and have >= MIN_VERSION:
        _log(f"qemu-aarch64 {'.'.join(map(str, have))}")
    else:
        rel = os_release()
        codename = rel.get("VERSION_CODENAME", "")
        if os.geteuid() != 0 or rel.get("ID") != "debian" or not codename:
            _log(f"qemu-aarch64 {have} is older than {MIN_VERSION}: install qemu-user-static {MIN_VERSION[0]}+ "
                 "(Debian: from <release>-backports); torch's aarch64 import segfaults under QEMU 7.2")
            return 0   # a warning: the smoke cell's arm64 build works under 7.2
        if not BACKPORTS.exists() and not any(f"{codename}-backports" in p.read_text()
                                              for p in SOURCES.glob("*") if p.is_file()):
            mirror = debian_mirror()
            if not mirror:
                _log("no Debian mirror in the apt sources to add backports from")
                return 2
            BACKPORTS.write_text(backports_source(mirror, codename))
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "-t", f"{codename}-backports", "qemu-user-static"]):
            if subprocess.run(cmd, env=env).returncode != 0:
                _log(f"`{' '.join(cmd)}` failed: qemu-aarch64 {have} stays; torch's aarch64 import segfaults "
                     "under QEMU 7.2, so the GH200 image's help-cache step will fail")
                return 2
        have, installed = version(), True
        _log(f"installed qemu-aarch64 {'.'.join(map(str, have or ()))} from {codename}-backports")
    # Only after an install or where none is registered: a running build's next exec would miss the handler
    if (installed or registered() is None) and os.geteuid() == 0 and BINFMT_DIR.joinpath("register").exists():
        if not register():
            _log("could not register the qemu-aarch64 binfmt handler")
            return 2
        _log(f"qemu-aarch64 binfmt handler registered: {registered()}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["version"]:
        print(".".join(map(str, version() or ())) or "none")
        return 0
    if argv[:1] == ["ensure"]:
        return ensure()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
