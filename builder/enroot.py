"""Docker image -> enroot `.sqsh`, the same file `enroot import dockerd://IMAGE` writes.

Our own path (no enroot needed, the usual build host) repeats enroot's `docker::daemon::import`
(NVIDIA/enroot src/docker.sh, commit 8ea147d): `docker create` + `docker export` piped into the same tar command,
`common::fixperms`, then `docker::configure` writes /etc/fstab, /etc/environment, /etc/rc and /etc/rc.local, then
`mksquashfs rootfs FILE -all-root -processors N $ENROOT_SQUASH_OPTIONS` (enroot's default `-comp lzo -noD
-exit-on-error`, enroot.in line 88). With `use_enroot=True` the real `enroot import` does the work instead.

Our default compression is zstd (level 3), not enroot's lzo: on the smoke image it is several times faster to write
and under half the size (benchmarks/sqsh_export.py); every squashfs reader of the last years has it (kernel
CONFIG_SQUASHFS_ZSTD since 4.14, squashfs-tools/unsquashfs since 4.4, squashfuse built with zstd;
docs/journeys/slurm.md says how to check a cluster). `--compression lzo` writes exactly what enroot writes.

Beside every X.sqsh go X.sqsh.sha256 (`sha256sum -c` format) and X.sqsh.cdx.json (the image's SBOM, builder.sbomgen):
all three are staged under temporary names and renamed together, signals held, the .sqsh last, so a failed or
interrupted export leaves none of them (only a SIGKILL between the three renames could split them; the checksum
then shows it).

Differences from enroot, on purpose: SOURCE_DATE_EPOCH adds `-mkfs-time/-all-time` (enroot does that only for
`docker://`, not `dockerd://`) so rebuilds are byte-identical; the file is written through `common.atomic`
(a temporary sibling named with host and pid, fsync, rename), so an interrupted export never leaves a `.sqsh` and
exports from several nodes into one shared folder never delete each other's temporaries; symlinked
/etc/{rc,fstab,...} are replaced, never followed out of the rootfs.

CLI: `python -m builder.enroot IMAGE DEST.sqsh [--compression zstd|lzo|...] [--block-size 1M] [--enroot]`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from builder import options, reference, sbomgen
from builder.docker import check_arch, docker_cli, inspect_image
from builder.errors import UserError, reports_user_errors
from common import atomic

# mksquashfs compressor options. "lzo" is enroot's default (ENROOT_SQUASH_OPTIONS, enroot.in:88): data blocks are
# left uncompressed (-noD). "zstd" is ours: faster to write and smaller (see the module docstring).
DEFAULT_COMPRESSION = "zstd"
COMPRESSION_OPTIONS: dict[str, list[str]] = {
    "lzo": ["-comp", "lzo", "-noD", "-exit-on-error"],
    "zstd": ["-comp", "zstd", "-Xcompression-level", "3", "-exit-on-error"],
    "zstd-max": ["-comp", "zstd", "-Xcompression-level", "19", "-exit-on-error"],
    "gzip": ["-comp", "gzip", "-exit-on-error"],
    "lz4": ["-comp", "lz4", "-exit-on-error"],
    "xz": ["-comp", "xz", "-exit-on-error"],
}
_BLOCK_SIZE_RE = re.compile(r"^(\d+)([KM]?)$")
# enroot accepts only these characters in a dockerd:// reference (src/docker.sh, docker::daemon::import).
_ENROOT_REF_RE = re.compile(r"^[A-Za-z0-9/._:-]+$")


def _log(msg: str) -> None:
    print(f"[enroot] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- bash ${var@Q}, as enroot's /etc/rc uses it

_ANSIC = {"\x1b": "E", "\a": "a", "\v": "v", "\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t",
          "\\": "\\", "'": "'"}


def _printable(ch: str) -> bool:
    # bash tests isprint()/iswprint() in the user's locale; this is a UTF-8 locale (C.UTF-8, en_US.UTF-8).
    return ch.isprintable() if ord(ch) > 0x7F else 0x20 <= ord(ch) < 0x7F


def bash_quote(s: str) -> str:
    """bash's `${x@Q}` (sh_quote_reusable in lib/sh/shquote.c): '' for empty, $'..' if anything is unprintable."""
    if s == "":
        return "''"
    if not all(_printable(c) for c in s):
        out = []
        for ch in s:
            if ch in _ANSIC:
                out.append("\\" + _ANSIC[ch])
            elif _printable(ch):
                out.append(ch)
            else:
                out.extend(f"\\{b:03o}" for b in ch.encode("utf-8"))
        return "$'" + "".join(out) + "'"
    if s == "'":
        return "\\'"
    return "'" + s.replace("'", "'\\''") + "'"


# ---------------------------------------------------------------- docker::configure (src/docker.sh)

def _jq_lines(values) -> list[str]:
    """`jq -r '.x[]' | readarray -t arr`: every element printed on its own line, so embedded newlines split it."""
    lines: list[str] = []
    for v in values or []:
        lines.extend(str(v).split("\n"))
    return lines


def configure_files(config: dict, uri: str) -> dict[str, str]:
    """The texts enroot's docker::configure writes, from `docker inspect` output (one element, any key case).

    Keys are paths inside the rootfs: /etc/fstab, /etc/environment, /etc/rc, /etc/rc.local.
    """
    # enroot lower-cases the top-level keys only: `with_entries(.key|=ascii_downcase)`.
    top = {k.lower(): v for k, v in config.items()}
    cfg = top.get("config") or {}
    volumes = cfg.get("Volumes") or {}
    env = cfg.get("Env") or []
    labels = cfg.get("Labels") or {}

    # `(.config.Volumes)? // empty | keys[]` -- jq's keys are sorted by code point.
    fstab = "".join(f"${{ENROOT_ROOTFS}}{v} {v} none x-create=dir,bind,rw,nosuid,nodev\n" for v in sorted(volumes))
    # `(.config.Env[])? // empty`, raw lines.
    environ = "".join(f"{e}\n" for e in env)

    rc = f"# enroot-provenance: {uri}\n"
    # docker inspect prints Labels sorted (Go map order); enroot keeps that order (to_entries) and flattens newlines.
    for key, value in labels.items():
        rc += f"# {key} {str(value).replace(chr(10), ' ')}\n"
    rc += "\n"  # `[ -s "${initrc}" ] && echo >> "${initrc}"`: never empty, it holds the provenance line.

    # `jq -r ... | common::read -r workdir`: read strips leading/trailing IFS whitespace and stops at the first line.
    workdir_raw = cfg.get("WorkingDir")
    workdir = str(workdir_raw).split("\n")[0].strip(" \t") if workdir_raw is not None else ""
    workdir = workdir or "/"
    entrypoint = _jq_lines(cfg.get("Entrypoint"))
    cmd = _jq_lines(cfg.get("Cmd"))
    if not entrypoint and not cmd:
        cmd = ["/bin/sh"]
    ep_q = " ".join(bash_quote(a) for a in entrypoint)
    cmd_q = " ".join(bash_quote(a) for a in cmd)
    rc += (
        f'mkdir -p "{workdir}" 2> /dev/null\n'
        f'cd "{workdir}" && unset OLDPWD || exit 1\n'
        "\n"
        "if [ -s /etc/rc.local ]; then\n"
        "    . /etc/rc.local\n"
        "fi\n"
        "\n"
        "if [ $# -gt 0 ]; then\n"
        f'    exec {ep_q} "$@"\n'
        "else\n"
        f"    exec {ep_q} {cmd_q}\n"
        "fi\n"
    )
    rclocal = (
        "# This file is sourced by /etc/rc when the container starts.\n"
        "# It can be used to manipulate the entrypoint or the command of the container.\n"
    )
    return {"/etc/fstab": fstab, "/etc/environment": environ, "/etc/rc": rc, "/etc/rc.local": rclocal,
            "workdir": workdir}


def _write_like_shell(path: Path, text: str) -> None:
    """`cat > path`: truncate an existing file (keeping its mode), else create it 0666 & ~umask."""
    if path.is_symlink():  # `>` would follow it, possibly out of the rootfs
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def configure_rootfs(rootfs: Path, config: dict, uri: str) -> None:
    files = configure_files(config, uri)
    workdir = files.pop("workdir")
    (rootfs / "etc").mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        _write_like_shell(rootfs / rel.lstrip("/"), text)
    # `mkdir -p "${rootfs}${workdir:-/}"`
    (rootfs / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------- export

def squash_options(compression: str | None, block_size: str | int | None) -> list[str]:
    compression = compression or DEFAULT_COMPRESSION
    if compression not in COMPRESSION_OPTIONS:
        raise UserError(f"unknown compression {compression!r}; choose one of {', '.join(COMPRESSION_OPTIONS)} "
                        "(zstd is the default; lzo is enroot's own, for readers without zstd)")
    opts = list(COMPRESSION_OPTIONS[compression])
    if block_size is not None:
        raw = str(block_size).upper()
        m = _BLOCK_SIZE_RE.match(raw)
        size = int(m.group(1)) * {"": 1, "K": 1024, "M": 1024 * 1024}[m.group(2)] if m else 0
        if not m or size < 4096 or size > 1024 * 1024 or size & (size - 1):
            raise UserError(f"block size {block_size!r} is not a power of two between 4K and 1M; "
                            "give e.g. 128K or 1M")
        opts += ["-b", raw]
    return opts


def _source_date_epoch() -> int | None:
    raw = os.environ.get("SOURCE_DATE_EPOCH")
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or int(raw) >= 2**32:
        raise UserError(f"SOURCE_DATE_EPOCH={raw!r} is not a Unix time in seconds (0..4294967295); "
                        "set it to e.g. $(git log -1 --format=%ct)")
    return int(raw)


def sidecars(dest: Path) -> tuple[Path, Path]:
    """The checksum and SBOM files that go beside DEST (X.sqsh -> X.sqsh.sha256, X.sqsh.cdx.json)."""
    return dest.with_name(dest.name + ".sha256"), dest.with_name(dest.name + ".cdx.json")


def _clean_stale_temps(dest: Path, *more_dirs) -> None:
    """Remove temporaries of DEST left by exports on THIS host that were SIGKILLed (pid gone); never another
    node's (a shared Lustre/NFS folder sees several hosts' exports, and their pids mean nothing here)."""
    for p in (dest, *sidecars(dest)):
        atomic.clean_stale(p)
    for d in more_dirs:
        if d is not None:
            atomic.clean_stale(Path(d) / dest.name)


class _Terminated(BaseException):
    pass


def _raise_terminated(signum, frame):  # noqa: ARG001
    raise _Terminated(signum)


def _run(argv: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(argv, **kw)
    except FileNotFoundError as e:
        raise UserError(f"{what}: {argv[0]} not found; install it (squashfs-tools for mksquashfs, docker.io for "
                        "docker) or put it on PATH") from e
    if r.returncode != 0:
        err = (r.stderr or b"").decode(errors="replace").strip() if isinstance(r.stderr, bytes) else (r.stderr or "")
        raise UserError(f"{what} failed (exit {r.returncode}): {err.strip()[-2000:]}")
    return r


def _export_ours(image_ref: str, tmp_file: Path, workdir: Path, opts: list[str], sde: int | None,
                 progress: bool, docker: str, arch: str | None) -> None:
    config = inspect_image(image_ref, docker)
    check_arch(image_ref, config, arch)
    cfg = config.get("Config") or {}
    if not cfg.get("Entrypoint") and not cfg.get("Cmd"):
        # `docker create` refuses it, and so does enroot.
        raise UserError(f"image {image_ref!r} has neither ENTRYPOINT nor CMD; enroot import cannot read it either. "
                        "Add a CMD (e.g. CMD [\"/bin/sh\"]) to its Dockerfile")
    rootfs = workdir / "rootfs"
    rootfs.mkdir()
    name = f"trainbox-enroot-{uuid.uuid4().hex[:12]}"
    if progress:
        _log(f"Fetching image {image_ref}")
    _run([docker, "create", "--name", name, image_ref], "docker create", capture_output=True)
    try:
        if progress:
            _log("Extracting image content...")
        # The exact tar flags of enroot's docker::daemon::import: empty /dev, no /.dockerenv.
        exp = subprocess.Popen([docker, "export", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        tar = subprocess.run(["tar", "-C", str(rootfs), "--warning=no-timestamp", "--anchored", "--exclude=dev/*",
                              "--exclude=.dockerenv", "-px"], stdin=exp.stdout, capture_output=True)
        exp.stdout.close()
        exp_err = exp.stderr.read().decode(errors="replace")
        if exp.wait() != 0:
            raise UserError(f"docker export {image_ref} failed: {exp_err.strip()}")
        if tar.returncode != 0:
            raise UserError(f"unpacking {image_ref} failed (is there space in {workdir}?): "
                            f"{tar.stderr.decode(errors='replace').strip()[-2000:]}")
    finally:
        subprocess.run([docker, "rm", "-f", "-v", name], capture_output=True)
    # common::fixperms (src/common.sh): make everything readable/traversable by the owner, directories writable.
    subprocess.run(["chmod", "-f", "-R", "u+rX", str(rootfs)], capture_output=True)
    subprocess.run(["find", str(rootfs), "-maxdepth", "15", "-type", "d", "!", "-perm", "-u=w", "-exec", "chmod",
                    "-f", "u+w", "{}", "+"], capture_output=True)
    configure_rootfs(rootfs, config, f"dockerd://{image_ref}")

    if progress:
        _log(f"Creating squashfs filesystem... ({' '.join(opts)})")
    argv = ["mksquashfs", str(rootfs), str(tmp_file), "-all-root", "-processors", str(os.cpu_count() or 1)]
    if not progress:
        argv.append("-no-progress")
    if sde is not None:
        argv += ["-mkfs-time", str(sde), "-all-time", str(sde)]
    argv += opts
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}  # we pass it as flags instead
    _run(argv, "mksquashfs", env=env, stdout=sys.stderr if progress else subprocess.DEVNULL,
         stderr=subprocess.PIPE)


def _export_enroot(image_ref: str, tmp_file: Path, workdir: Path, opts: list[str], sde: int | None,
                   progress: bool, docker: str, arch: str | None) -> None:
    if not shutil.which("enroot"):
        raise UserError("use_enroot/--enroot was asked but `enroot` is not on PATH; install enroot "
                        "(github.com/NVIDIA/enroot releases) or drop --enroot to use the built-in exporter")
    if not _ENROOT_REF_RE.match(image_ref):
        raise UserError(f"enroot accepts only [A-Za-z0-9/._:-] in a dockerd:// reference, not {image_ref!r}; "
                        "tag the image (docker tag ID name:tag) and export the tag")
    check_arch(image_ref, inspect_image(image_ref, docker), arch)
    if sde is not None:  # enroot's dockerd:// path ignores SOURCE_DATE_EPOCH; hand mksquashfs the times ourselves
        opts = [*opts, "-mkfs-time", str(sde), "-all-time", str(sde)]
    env = dict(os.environ, ENROOT_SQUASH_OPTIONS=" ".join(opts), ENROOT_TEMP_PATH=str(workdir))
    env.pop("SOURCE_DATE_EPOCH", None)
    if not progress:
        env["TTY_OFF"] = "y"
    _run(["enroot", "import", "-o", str(tmp_file), f"dockerd://{image_ref}"], "enroot import", env=env,
         stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=None if progress else subprocess.PIPE)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_staged(path: Path, text: str) -> None:
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, 0o644)
    atomic.fsync_path(path)


def export_image(image_ref: str, dest_path, *, compression: str | None = None, block_size=None, use_enroot: bool = False,
                 progress: bool = True, docker: str | None = None, tmp_dir=None, arch: str | None = None) -> Path:
    """Write IMAGE's enroot squashfs to DEST_PATH (must end in .sqsh; an existing file is replaced atomically;
    missing parent directories are created) with its sidecars DEST.sha256 and DEST.cdx.json (the image's SBOM).
    compression None means DEFAULT_COMPRESSION (zstd); "lzo" is enroot's own.

    arch: if given (amd64, arm64), the image's config must say that architecture.

    tmp_dir: where the rootfs is unpacked (as big as the image); default: next to DEST.
    """
    dest = Path(dest_path).absolute()
    if dest.suffix != ".sqsh":
        raise UserError(f"destination {str(dest)!r} must end in .sqsh (pyxis and enroot look for that suffix)")
    # /proc and /sys hold no files and /dev/x.sqsh would fill RAM (/dev/shm, a tmpfs, is a folder like any other)
    why = atomic.why_not_a_folder(dest.parent)
    if why and why.startswith("it is under"):
        raise UserError(f"destination {str(dest)!r}: {why}", fix="write the .sqsh to a folder on a real disk")
    if why:
        raise UserError(f"cannot create the destination directory {str(dest.parent)!r}: {why}")
    options.check_file_target(dest, "destination")   # the writers' one rule (atomic.file_target)
    if not dest.name.isprintable():   # the .sha256 sidecar names it on one line (`sha256sum -c` format)
        raise UserError(f"destination {str(dest)!r} has a control character in its name",
                        fix="name the .sqsh with printable characters, e.g. the image's tag")
    if not all(atomic.name_fits(p, "work") for p in (dest, *sidecars(dest))):   # staged under temporary names
        raise UserError(f"destination {str(dest)!r}: the file name is too long for the file system once its "
                        "sidecars' temporary names are made from it", fix="give the .sqsh a shorter name")
    reference.check_image(image_ref, "image")   # every input checked before a folder is made
    opts = squash_options(compression, block_size)
    sde = _source_date_epoch()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the destination directory {str(dest.parent)!r}: {e.strerror}") from e
    if not os.access(dest.parent, os.W_OK):
        raise UserError(f"destination directory {str(dest.parent)!r} is not writable")
    docker = docker or docker_cli()
    _clean_stale_temps(dest, tmp_dir)

    work = atomic.temp_path(Path(tmp_dir or dest.parent).absolute() / dest.name, "work")
    work.mkdir(parents=True)
    old_handlers = {}
    if threading_main():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, _raise_terminated)
    t0 = time.monotonic()
    sum_path, sbom_path = sidecars(dest)
    staged = [(atomic.temp_path(p), p) for p in (sum_path, sbom_path, dest)]   # renamed in this order, .sqsh last
    try:
        tmp_file = staged[2][0]
        if use_enroot:
            _export_enroot(image_ref, tmp_file, work, opts, sde, progress, docker, arch)
        else:
            _export_ours(image_ref, tmp_file, work, opts, sde, progress, docker, arch)
        if progress:
            _log(f"Reading the contents of {image_ref} for its SBOM")
        sbom_text = sbomgen.dumps(sbomgen.generate(image_ref, docker=docker))
        os.chmod(tmp_file, 0o644)
        atomic.fsync_path(tmp_file)
        _write_staged(staged[0][0], f"{_sha256(tmp_file)}  {dest.name}\n")
        _write_staged(staged[1][0], sbom_text)
        with atomic.signals_held():
            for tmp, final in staged:
                os.replace(tmp, final)
        atomic.fsync_path(dest.parent)
    except _Terminated as e:
        raise UserError(f"export of {image_ref} interrupted by signal {e.args[0]}; nothing written to {dest}") from e
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)   # gone after the renames; only a failed export leaves them
        atomic.remove(work)
    if progress:
        _log(f"{dest} ({dest.stat().st_size / 2**20:.1f} MiB, {time.monotonic() - t0:.1f} s)")
    return dest


def threading_main() -> bool:
    return threading.current_thread() is threading.main_thread()


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m builder.enroot",
                                description="Export an already-built image to an enroot .sqsh "
                                            "(same content as `enroot import dockerd://IMAGE`).")
    p.add_argument("image", help="local image reference, e.g. trainbox:smoke-cpu")
    p.add_argument("dest", help="output file, ending in .sqsh")
    p.add_argument("--compression", default=DEFAULT_COMPRESSION, choices=list(COMPRESSION_OPTIONS),
                   help="zstd (default): faster and smaller, needs a zstd-capable reader (docs/journeys/slurm.md: "
                        "how to check); lzo = enroot's own (-comp lzo -noD), for clusters without zstd")
    p.add_argument("--block-size", default=None, help="mksquashfs block size, e.g. 1M (default 128K)")
    p.add_argument("--enroot", action="store_true", help="run the real `enroot import` (must be installed)")
    p.add_argument("--arch", default=None, help="fail unless the image is this architecture (amd64, arm64)")
    p.add_argument("--tmp-dir", default=None, help="where to unpack the rootfs (default: next to DEST)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    a = p.parse_args(argv)
    try:
        export_image(a.image, a.dest, compression=a.compression, block_size=a.block_size, use_enroot=a.enroot,
                     progress=not a.quiet, tmp_dir=a.tmp_dir, arch=a.arch)
    except KeyboardInterrupt:
        print(f"error: export of {a.image} interrupted; nothing written to {a.dest}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
