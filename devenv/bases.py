"""Debian bookworm base images for tests, made locally with debootstrap and published as one multi-arch image.

Production cells start `FROM nvidia/cuda:...`, which nobody can pull here; the tests substitute this base through
`--base OLD=NEW`. Each arch's root filesystem is debootstrapped once and cached as a gzipped layer under
$TRAINBOX_CACHE/bases (keyed by suite, arch and package list); publishing writes an OCI layout with one image per arch
(config says the real architecture — `docker import` would always say amd64) joined by an image index, and copies it
into the local registry with skopeo.

`python -m devenv.bases [--registry 127.0.0.1:PORT] [--arch amd64 --arch arm64]` prints the published reference.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from builder.errors import UserError, reports_user_errors
from common import atomic
from devenv import engine
from devenv.common import cache_dir, logger, which

SUITE = "bookworm"
# python3 + venv + certificates + tini (PID 1) up front: saves the Dockerfile's apt step, which is slow under QEMU.
INCLUDE = ["ca-certificates", "python3", "python3-venv", "python3-pip", "tini"]
REPOSITORY = "trainbox/base"
ARCHES = ("amd64", "arm64")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Paths that must not end up in a layer (runtime mounts, apt caches).
EXCLUDES = ["./dev/*", "./proc/*", "./sys/*", "./run/*", "./tmp/*", "./var/cache/apt/archives/*.deb",
            "./var/lib/apt/lists/*", "./debootstrap"]


_log = logger("bases")


def bases_dir() -> Path:
    d = cache_dir() / "bases"
    d.mkdir(parents=True, exist_ok=True)
    return d


def debian_mirror() -> str:
    """$TRAINBOX_DEBIAN_MIRROR, else the host's own apt source (so the proxy/mirror set-up of the machine applies)."""
    if os.environ.get("TRAINBOX_DEBIAN_MIRROR"):
        return os.environ["TRAINBOX_DEBIAN_MIRROR"]
    for src in [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]:
        try:
            text = src.read_text()
        except OSError:
            continue
        for m in re.finditer(r"(?:^URIs:\s*|^deb\s+(?:\[[^]]*\]\s+)?)(\S+/debian)\s", text, re.M):
            return m.group(1)
    return ""  # debootstrap's own default


def cache_key(arch: str) -> str:
    h = hashlib.sha256(json.dumps([SUITE, arch, INCLUDE, EXCLUDES]).encode()).hexdigest()[:12]
    return f"{SUITE}-{arch}-{h}"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rootfs_layer(arch: str) -> dict:
    """The cached layer for ARCH: {"path": .tar.gz, "digest": sha256 of it, "diff_id": sha256 of the tar, "size"}."""
    if arch not in ARCHES:
        raise UserError(f"unknown base arch {arch!r}: use one of {', '.join(ARCHES)}")
    key = cache_key(arch)
    meta_path = bases_dir() / f"{key}.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if Path(meta["path"]).exists():
            return meta
    if not which("debootstrap"):
        raise UserError("debootstrap is missing: run `make engine` (installs it) or apt-get install debootstrap")
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"rootfs-{arch}-", dir=bases_dir()))
    rootfs = work / "rootfs"
    try:
        argv = ["debootstrap", "--variant=minbase", f"--arch={arch}", f"--include={','.join(INCLUDE)}", SUITE,
                str(rootfs)]
        mirror = debian_mirror()
        if mirror:
            argv.append(mirror)
        _log(f"debootstrap {arch} ({' '.join(argv[1:])})")
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            log = rootfs / "debootstrap" / "debootstrap.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else r.stderr[-1500:]
            raise UserError(f"debootstrap of the {SUITE} {arch} base failed (exit {r.returncode}): "
                            f"{tail.strip().splitlines()[-1] if tail.strip() else r.stdout[-300:]}; for arm64 check "
                            "`update-binfmts --display qemu-aarch64` (run `make engine`)")
        tar_path = work / "layer.tar"
        subprocess.run(["tar", "--numeric-owner", "--xattrs", "--sort=name", "-C", str(rootfs),
                        *[f"--exclude={e}" for e in EXCLUDES], "-cf", str(tar_path), "."], check=True)
        diff_id = _sha256_file(tar_path)
        gz_path = bases_dir() / f"{key}.tar.gz"
        with open(tar_path, "rb") as src, atomic.replacing(gz_path) as gz_tmp, open(gz_tmp, "wb") as raw:
            # mtime=0: the same rootfs gives the same blob digest
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
                shutil.copyfileobj(src, gz, 1 << 20)
        meta = {"path": str(gz_path), "digest": _sha256_file(gz_path), "diff_id": diff_id,
                "size": gz_path.stat().st_size, "arch": arch, "suite": SUITE,
                "seconds": round(time.monotonic() - t0, 1)}
        atomic.write_text(meta_path, json.dumps(meta, indent=2))
        _log(f"{arch} base layer cached ({meta['size'] / 1e6:.1f} MB, {meta['seconds']}s)")
        return meta
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def write_oci_layout(layout: Path, layers: dict[str, dict], ref: str) -> str:
    """An OCI layout at LAYOUT whose REF is an image index over one image per arch; returns the index digest."""
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    entries = []
    for arch, meta in sorted(layers.items()):
        blob = layout / "blobs" / "sha256" / meta["digest"].split(":")[-1]
        if not blob.exists():
            try:
                os.link(meta["path"], blob)
            except OSError:
                shutil.copyfile(meta["path"], blob)
        config = {
            "architecture": arch, "os": "linux",
            "config": {"Env": [PATH_ENV, "LANG=C.UTF-8"], "Cmd": ["/bin/bash"]},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{meta['diff_id']}"]},
            "history": [{"created_by": f"debootstrap --variant=minbase --arch={arch} "
                                      f"--include={','.join(INCLUDE)} {SUITE}"}],
        }
        if arch == "arm64":
            config["variant"] = "v8"
        cdigest, csize = _blob(layout, json.dumps(config, sort_keys=True).encode())
        manifest = {
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdigest, "size": csize},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": f"sha256:{meta['digest'].split(':')[-1]}", "size": meta["size"]}],
        }
        mdigest, msize = _blob(layout, json.dumps(manifest, sort_keys=True).encode())
        platform = {"architecture": arch, "os": "linux", **({"variant": "v8"} if arch == "arm64" else {})}
        entries.append({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest,
                        "size": msize, "platform": platform})
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": entries}
    idigest, isize = _blob(layout, json.dumps(index, sort_keys=True).encode())
    top = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.index.v1+json",
                                               "digest": idigest, "size": isize,
                                               "annotations": {"org.opencontainers.image.ref.name": ref}}]}
    (layout / "index.json").write_text(json.dumps(top))
    return idigest


def _platforms_in_registry(ref: str) -> set[str] | None:
    r = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"], capture_output=True,
                       text=True)
    if r.returncode != 0:
        return None
    try:
        raw = json.loads(r.stdout)
    except json.JSONDecodeError:
        return None
    return {m.get("platform", {}).get("architecture") for m in raw.get("manifests", [])}


def publish(registry: str | None = None, arches: tuple[str, ...] = ARCHES, force: bool = False) -> str:
    """Make sure REGISTRY holds the multi-arch base; returns its reference (REGISTRY/trainbox/base:bookworm-KEY)."""
    registry = registry or engine.registry_address()
    layers = {arch: rootfs_layer(arch) for arch in arches}
    key = hashlib.sha256(json.dumps(sorted((a, m["digest"]) for a, m in layers.items())).encode()).hexdigest()[:12]
    ref = f"{registry}/{REPOSITORY}:{SUITE}-{key}"
    if not force and _platforms_in_registry(ref) == set(arches):
        return ref
    with tempfile.TemporaryDirectory(prefix="oci-base-", dir=bases_dir()) as tmp:
        layout = Path(tmp) / "layout"
        write_oci_layout(layout, layers, "base")
        r = subprocess.run(["skopeo", "copy", "--all", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:base",
                            f"docker://{ref}"], capture_output=True, text=True)
        if r.returncode != 0:
            raise UserError(f"pushing the base image {ref} with skopeo failed: {r.stderr.strip()[-500:]}; is the "
                            "registry up (`make engine`)?")
    got = _platforms_in_registry(ref)
    if got != set(arches):
        raise UserError(f"the base {ref} in the registry lists platforms {sorted(got or [])}, expected {arches}")
    _log(f"published {ref} ({', '.join(arches)})")
    return ref


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devenv.bases", description=__doc__.splitlines()[0])
    p.add_argument("--registry", help="HOST:PORT of the local registry (default: the one `make engine` starts)")
    p.add_argument("--arch", action="append", choices=ARCHES, help="repeatable; default both")
    p.add_argument("--force", action="store_true", help="publish again even if the registry has it")
    p.add_argument("--write-config", metavar="FILE",
                   help="also write a build.py --config file mapping debian:bookworm (the smoke cell's base) to it")
    a = p.parse_args(argv)
    ref = publish(a.registry, tuple(a.arch or ARCHES), a.force)
    if a.write_config:
        atomic.write_text(a.write_config,
                          f'# written by python -m devenv.bases (make bases)\n[bases]\n"debian:{SUITE}" = "{ref}"\n')
    print(ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
