"""The one atomic writer: readers (and a crash) see the old file or folder or the new one, never half of either.

Every write of a lock, Dockerfile, job script, `.sqsh`, artifact copy or merged model goes through here: a temporary
sibling in the same folder (so the rename stays on one file system), the data fsynced, a rename, the folder fsynced
(so the rename itself survives a power loss). Lives in `common/`, the package host and image share: the trainers
write through it in the image, builder/ and devenv/ on the host.

Temporary names are `.NAME.tmp.HOST.PID.RANDOM`: on a shared (Lustre/NFS) folder several nodes write at once and
their pids mean nothing to each other, so `clean_stale` removes only temporaries of THIS host whose process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import stat
from pathlib import Path

TMP_MARK = ".tmp."  # a temporary of NAME starts with ".NAME.tmp.": hidden, and never ends in NAME's suffix


def host() -> str:
    """This machine's name as temporaries carry it (the UTS name: a container or `unshare --uts` has its own)."""
    return socket.gethostname() or "localhost"


def temp_path(path: str | Path, kind: str = "") -> Path:
    """A fresh temporary sibling of PATH: .NAME.tmp.HOST.PID.RANDOM (kind, e.g. "work", is added to RANDOM)."""
    path = Path(path)
    tag = secrets.token_hex(4) + (f"_{kind}" if kind else "")
    return path.parent / f".{path.name}{TMP_MARK}{host()}.{os.getpid()}.{tag}"


NAME_MAX = 255   # bytes in one file name (Linux file systems)


def name_fits(path: str | Path, kind: str = "") -> bool:
    """Whether PATH's temporary sibling (written first, then renamed) has a name the file system can hold: checked
    before long work, since a name that fits may still be too long once .tmp.HOST.PID.RANDOM is added."""
    return len(os.fsencode(temp_path(path, kind).name)) <= NAME_MAX


def _temp_owner(path: Path, name: str) -> tuple[str, int] | None:
    m = re.fullmatch(re.escape(f".{name}{TMP_MARK}") + r"(?P<host>.+)\.(?P<pid>\d+)\.[0-9a-f]+(?:_\w+)?", path.name)
    return (m["host"], int(m["pid"])) if m else None


def _dead(pid: int, since: float) -> bool:
    import psutil

    try:
        # A pid reused by a process that started after the temporary was last written is not its writer.
        return psutil.Process(pid).create_time() > since + 1
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # exists, but we may not look at it: assume it writes
        return False


def clean_stale(path: str | Path) -> list[Path]:
    """Remove temporaries of PATH left by writers on this host that died (SIGKILL, power loss); returns them.

    Another host's temporaries are never touched: its pids are not ours to judge."""
    path = Path(path)
    removed = []
    for p in path.parent.glob(f".{glob_escape(path.name)}{TMP_MARK}*"):
        owner = _temp_owner(p, path.name)
        if owner is None or owner[0] != host():
            continue
        try:
            mtime = p.lstat().st_mtime
        except FileNotFoundError:
            continue
        if _dead(owner[1], mtime):
            remove(p)
            removed.append(p)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?[])", r"[\1]", name)


def remove(p: Path) -> None:
    """Delete a file or a folder, also one whose modes say read-only (an unpacked image keeps them)."""
    def fix(func, q, exc):  # noqa: ARG001
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(q), 0o700)
            func(q)

    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, onerror=fix)
    else:
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------- durability

def fsync_path(p: str | Path) -> None:
    """fsync a file or a folder by path (a read-only descriptor is enough on Linux)."""
    fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(p) else 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems can't sync a folder; the data itself was synced
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and folder under ROOT, ROOT last (symlinks are not followed)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                fsync_path(p)
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                fsync_path(p)
    fsync_path(root)


def _pseudo(p: Path) -> str | None:
    """Why an absolute path lies where no file of ours belongs (/proc, /sys, the device tree), or None."""
    # /dev/shm is a tmpfs (shared memory) that holds files like any folder: only the device tree itself is refused.
    if p.parts[1:2] in (("proc",), ("sys",)) or (p.parts[1:2] == ("dev",) and p.parts[2:3] != ("shm",)):
        return f"it is under /{p.parts[1]}, which holds no files"
    return None


def why_not_a_folder(path: str | Path) -> str | None:
    """Why PATH can't be (made) a folder this user writes into (a file on the way, /proc /sys /dev, no write
    permission, a read-only mount), or None. Checked before long work, by the builder and the trainers alike."""
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    why = _pseudo(p)
    if why:
        return why
    probe = p
    try:
        while not probe.exists() and probe != probe.parent:
            if probe.is_symlink():
                return f"{probe} is a broken symbolic link"
            probe = probe.parent
        if not probe.is_dir():
            return f"{probe} is a file, not a folder"
    except PermissionError:
        return "a folder on the way is not writable or readable by this user"
    except OSError as e:   # e.g. a name longer than the file system allows (ENAMETOOLONG)
        return f"{e.strerror or e}"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user (uid {os.getuid()})"
    return None


# ---------------------------------------------------------------- files

class UnwritableTarget(OSError):
    """PATH can't take a file written through `replacing` (its message says why, in words for a user)."""


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe (fifo)"), (stat.S_ISSOCK, "a socket"))


def file_target(path: str | Path) -> tuple[Path, int | None]:
    """Where a write of PATH lands, and the mode it keeps: (PATH, None) for a new or regular file; for a symbolic
    link to a regular file, (the link's target, the target's mode): the write goes through, the link stays a link.
    Raises UnwritableTarget for what a rename would destroy or can't land in: a folder, a device node, a fifo, a
    socket, a broken link, a path under /proc, /sys or /dev, a folder this user can't write, an overlong name.
    The one rule for every file writer; CLIs check it before any work (builder.options.check_file_target)."""
    p = Path(os.path.abspath(path))
    if "\0" in str(p):
        raise UnwritableTarget("the path holds a NUL character")
    why = _pseudo(p) or why_not_a_folder(p.parent)
    if why:
        raise UnwritableTarget(why)
    if not name_fits(p):
        raise UnwritableTarget(f"the file name is too long for the file system (under {NAME_MAX - 40} bytes)")
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:   # ENAMETOOLONG, EACCES...
        raise UnwritableTarget(e.strerror or str(e)) from None
    keep = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise UnwritableTarget(f"it is a broken symbolic link (to {os.readlink(p)})") from None
        except OSError as e:   # a link loop
            raise UnwritableTarget(f"it is a symbolic link that can't be followed: {e.strerror or e}") from None
        p = Path(os.path.realpath(p))
        why = _pseudo(p) or why_not_a_folder(p.parent)
        if why:
            raise UnwritableTarget(f"it is a symbolic link to {p}: {why}")
        keep = stat.S_IMODE(st.st_mode)
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise UnwritableTarget(f"it is {kind}, not a regular file" if kind != "a folder" else "it is a folder")
    if keep is not None and not name_fits(p):
        raise UnwritableTarget(f"its target {p} has a name too long for the file system's temporaries")
    return (p, keep) if keep is not None else (Path(path), None)


def why_not_a_file(path: str | Path) -> str | None:
    """Why PATH can't take a file written through `replacing` (file_target's reason), or None."""
    try:
        file_target(path)
    except UnwritableTarget as e:
        return str(e)
    return None


@contextlib.contextmanager
def replacing(path: str | Path, mode: int | None = None):
    """`with replacing(DEST) as tmp:` write the new file at `tmp` (any program may); on a clean exit it is fsynced,
    given MODE and renamed over DEST, then DEST's folder is fsynced. On any error (or signal turned exception)
    the temporary goes and DEST stays as it was. DEST must be a file_target (UnwritableTarget otherwise): a link to
    a regular file is written through, keeping its target's mode. MODE None: the mode `open()` would leave, i.e.
    an existing DEST's own, else 0666 less the umask (a shared folder's umask 002 gives the group its access)."""
    path, keep = file_target(path)
    if keep is not None:
        mode = keep
    elif mode is None:
        mode = existing_mode(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path)  # what an earlier writer of PATH on this host left when it was killed
    tmp = temp_path(path)
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone after a rename; only a failed write leaves it
    fsync_path(path.parent)


def umask() -> int:
    """The process's umask, read without changing it (/proc: os.umask can only read it by setting it, which races
    with other threads creating files); where /proc can't tell, set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o077)
    os.umask(old)
    return old


def existing_mode(path: str | Path) -> int:
    """The mode `open(PATH, "w")` leaves: an existing regular file's own, else 0666 less the umask. What a write
    through a temporary and a rename gives the file (the temporary's mode is what lands)."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except OSError:
        pass
    return 0o666 & ~umask()


def write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> None:
    with replacing(path, mode) as tmp:
        with open(tmp, "xb") as f:
            f.write(data)


def write_text(path: str | Path, text: str, mode: int | None = None) -> None:
    write_bytes(path, text.encode("utf-8"), mode)


# ---------------------------------------------------------------- folders

_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE); False where the kernel or file system can't."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD = -100
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


@contextlib.contextmanager
def replacing_dir(path: str | Path, replace: bool = True):
    """`with replacing_dir(DEST) as tmp:` fill the new folder `tmp` (created empty); on a clean exit every file in it
    is fsynced and it takes DEST's place (swapped in one step where the file system can; else the old folder is
    renamed aside first), then the parent is fsynced. On error the temporary goes and DEST stays as it was.
    replace=False: a DEST that exists by then (someone else's) stays, and the rename raises OSError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if replace and path.is_dir() and not path.is_symlink():
            if not _exchange(tmp, path):
                aside = temp_path(path, "old")
                os.rename(path, aside)
                os.rename(tmp, path)
                tmp = aside
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists() or tmp.is_symlink():
            remove(tmp)  # a failed write, or the old folder after the swap
    fsync_path(path.parent)


@contextlib.contextmanager
def signals_held():
    """SIGINT/SIGTERM/SIGHUP wait until the block ends (a few renames that must all happen, or none)."""
    import signal

    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def write_all(files: dict[Path, str], mode: int | None = None) -> list[Path]:
    """Write several files as one change: every new content goes to a temporary first (an error or a signal then
    leaves every file as it was), then all are renamed into place with SIGINT/SIGTERM held. Returns those changed."""
    staged: list[tuple[Path, Path]] = []
    changed: list[Path] = []
    try:
        targets = [(Path(given), *file_target(given), text) for given, text in files.items()]   # all, before any
        for given, path, keep, text in targets:
            try:
                if path.read_text(encoding="utf-8") == text:
                    continue
            except (OSError, UnicodeDecodeError):
                pass
            path.parent.mkdir(parents=True, exist_ok=True)
            clean_stale(path)
            tmp = temp_path(path)
            staged.append((tmp, path))
            changed.append(given)
            with open(tmp, "xb") as f:
                f.write(text.encode("utf-8"))
            os.chmod(tmp, keep if keep is not None else mode if mode is not None else existing_mode(path))
            fsync_path(tmp)
        with signals_held():
            for tmp, path in staged:
                os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    for parent in {path.parent for _, path in staged}:
        fsync_path(parent)
    return changed


def copy_tree(src: str | Path, dest: str | Path, ignore=None) -> Path:
    """Copy folder SRC to DEST (symlinks kept as links; `ignore` as shutil.copytree's) through `replacing_dir`."""
    with replacing_dir(dest) as tmp:
        shutil.copytree(src, tmp, symlinks=True, dirs_exist_ok=True, ignore=ignore)
    return Path(dest)


def copy_file(src: str | Path, dest: str | Path) -> Path:
    """Copy file SRC to DEST (contents and mode) through `replacing`."""
    with replacing(dest, mode=stat.S_IMODE(os.stat(src).st_mode)) as tmp:
        shutil.copy2(src, tmp)
    return Path(dest)
