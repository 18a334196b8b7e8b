"""The Docker engine as the builder sees it: which CLI talks to it, which builder builds with it, whether it answers,
what an image in it is (inspect) and the platform/arch names (Docker's amd64/arm64 against the matrix's x86_64/aarch64).

Builder choice (`--builder auto`): buildx when the CLI has it (through python-on-whales); otherwise the engine's own
BuildKit through a classic CLI that still accepts DOCKER_BUILDKIT=1 (Docker < 23, e.g. Debian's /usr/bin/docker).
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from python_on_whales import DockerClient

from builder import reference
from builder.errors import UserError


# ------------------------------------------------------------------------------------------------------------ CLIs
def candidate_clis() -> list[str]:
    """Every docker CLI here, $TRAINBOX_DOCKER first, each binary once."""
    seen, out = set(), []
    for c in [os.environ.get("TRAINBOX_DOCKER"), shutil.which("docker"), "/usr/bin/docker", "/usr/local/bin/docker"]:
        if c and Path(c).exists() and os.path.realpath(c) not in seen:
            seen.add(os.path.realpath(c))
            out.append(c)
    return out


def docker_cli() -> str:
    """The CLI that talks to the engine: $TRAINBOX_DOCKER, else the first `docker` on PATH."""
    return os.environ.get("TRAINBOX_DOCKER") or shutil.which("docker") or "/usr/bin/docker"


@dataclass(frozen=True)
class Builder:
    kind: str  # buildx | buildkit | legacy
    cli: str

    def client(self) -> DockerClient:
        return DockerClient(client_call=[self.cli])


def _cli_version(cli: str) -> tuple[int, ...] | None:
    try:
        r = subprocess.run([cli, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"(\d+)\.(\d+)", r.stdout.strip())
    return tuple(int(x) for x in m.groups()) if m else None


def _has_buildx(cli: str) -> bool:
    try:
        return subprocess.run([cli, "buildx", "version"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def choose_builder(requested: str = "auto") -> Builder:
    clis = candidate_clis()
    if not clis:
        raise UserError("no docker CLI found: run `make engine` (installs Debian's docker.io) or install Docker")
    if requested in ("auto", "buildx"):
        for cli in clis:
            if _has_buildx(cli):
                return Builder("buildx", cli)
        if requested == "buildx":
            raise UserError("--builder buildx: no docker CLI here has the buildx plugin; install docker-buildx or "
                            "use --builder auto")
    if requested in ("auto", "buildkit"):
        for cli in clis:
            v = _cli_version(cli)
            # Docker 23+ CLIs hand DOCKER_BUILDKIT=1 to buildx and refuse without it.
            if v and v < (23,):
                return Builder("buildkit", cli)
        if requested == "buildkit":
            raise UserError("--builder buildkit needs a classic docker CLI older than 23 (e.g. Debian's "
                            "/usr/bin/docker from docker.io) or buildx; set TRAINBOX_DOCKER to its path")
    if requested == "legacy":
        return Builder("legacy", clis[0])
    # Never fall back to the legacy builder: the Dockerfiles use a BuildKit cache mount and BuildKit secrets.
    raise UserError(f"no BuildKit builder here (no buildx plugin, no classic docker CLI older than 23 among "
                    f"{', '.join(clis)})", fix="run `make engine` (Debian's docker.io CLI has BuildKit) or install "
                    "docker-buildx")


def check_engine(builder: Builder) -> str:
    """The engine's version; a UserError naming the next step when no engine answers (before any lock or build)."""
    try:
        r = subprocess.run([builder.cli, "version", "--format", "{{.Server.Version}}"], capture_output=True,
                           text=True, timeout=30)
    except subprocess.TimeoutExpired:
        r = subprocess.CompletedProcess([], 1, "", "no answer in 30 s")
    if r.returncode == 0 and r.stdout.strip():
        return r.stdout.strip()
    where = os.environ.get("DOCKER_HOST") or "the default socket (unix:///var/run/docker.sock)"
    said = next((ln.strip() for ln in r.stderr.splitlines() if ln.strip()), "no answer")
    raise UserError(f"no Docker engine answers at {where} ({said[:200]})",
                    fix="start one with `make engine` (engine + local registry for this repository), or install and "
                        "start Docker; set DOCKER_HOST if yours listens elsewhere")


# ---------------------------------------------------------------------------------------------------------- images
def inspect_image(image_ref: str, docker: str | None = None) -> dict:
    """`docker image inspect` of a local image (one element); a UserError if the engine has none."""
    reference.check_image(image_ref, "image")   # '--help' would be an option of `docker image inspect`
    docker = docker or docker_cli()
    r = subprocess.run([docker, "image", "inspect", image_ref], capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"image {image_ref!r} is not in the local engine ({r.stderr.strip()}); build it first "
                        f"(python build.py ...) or `docker pull`/`docker load` it")
    return json.loads(r.stdout)[0]


def check_arch(image_ref: str, config: dict, arch: str | None) -> None:
    """ARCH (amd64, arm64), if given, must be what the image's config (inspect output) says."""
    have = config.get("Architecture") or config.get("architecture")
    if arch and have != arch:
        raise UserError(f"image {image_ref!r} is {have}, not {arch}; build it with --platform linux/{arch} "
                        "or export the matching tag")


# ------------------------------------------------------------------------------------------------------- platforms
def platform_arch(platform_: str) -> str:
    """linux/amd64 -> amd64 (Docker's name)."""
    return platform_.split("/")[1]


MATRIX_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}  # Docker's arch names -> the matrix's


def host_arch() -> str:
    """This machine's arch in the matrix's words (x86_64, aarch64)."""
    return MATRIX_ARCH.get(platform.machine().lower(), platform.machine().lower())


def host_platform() -> str:
    """This machine's platform in Docker's words (linux/amd64, linux/arm64)."""
    arch = host_arch()
    return "linux/" + next((d for d, m in MATRIX_ARCH.items() if m == arch), arch)
