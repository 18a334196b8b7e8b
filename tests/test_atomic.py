"""common.atomic: the one writer of locks, Dockerfiles, job scripts, .sqsh files, artifact copies, merged models.

Crashes are real SIGKILLs of real writer processes; "another host" is another UTS name (unshare --uts) in this pid
space, which is what a second node writing into one shared Lustre/NFS folder looks like from here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from common import atomic

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    p = subprocess.Popen([PY, "-c", "pass"])
    p.wait()
    assert not psutil.pid_exists(p.pid)
    return p.pid


def _temp(folder: Path, name: str, host: str, pid: int, tag: str = "0a1b2c3d") -> Path:
    t = folder / f".{name}.tmp.{host}.{pid}.{tag}"
    t.write_text("partial")
    return t


def test_write_text_replaces_syncs_and_leaves_nothing_else(tmp_path):
    dest = tmp_path / "sub" / "Dockerfile"
    atomic.write_text(dest, "one\n")
    atomic.write_text(dest, "two\n", mode=0o755)
    assert dest.read_text() == "two\n" and (dest.stat().st_mode & 0o777) == 0o755
    assert [p.name for p in dest.parent.iterdir()] == ["Dockerfile"]


def test_temp_names_carry_host_and_pid(tmp_path):
    t = atomic.temp_path(tmp_path / "x.sqsh")
    assert t.parent == tmp_path and t.name.startswith(f".x.sqsh.tmp.{atomic.host()}.{os.getpid()}.")
    assert atomic.temp_path(tmp_path / "x.sqsh") != t  # two writers in one process don't share a name


WRITER = """
import os, signal, sys
from common import atomic
dest, kind = sys.argv[1], sys.argv[2]
if kind == "file":
    with atomic.replacing(dest) as tmp:
        with open(tmp, "w") as f:
            f.write("half of the new")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
else:
    with atomic.replacing_dir(dest) as tmp:
        (tmp / "model.safetensors").write_text("half of the new")
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_crash_mid_write_keeps_the_old_and_the_next_writer_cleans_up(tmp_path, kind):
    dest = tmp_path / ("lock.txt" if kind == "file" else "merged")
    if kind == "file":
        dest.write_text("old")
    else:
        dest.mkdir()
        (dest / "model.safetensors").write_text("old")
    r = subprocess.run([PY, "-c", WRITER, str(dest), kind], cwd=ROOT)
    assert r.returncode == -signal.SIGKILL
    old = dest if kind == "file" else dest / "model.safetensors"
    assert old.read_text() == "old"  # the old content, whole
    (left,) = tmp_path.glob(f".{dest.name}.tmp.*")  # the dead writer's temporary, named for this host
    assert left.name.startswith(f".{dest.name}.tmp.{atomic.host()}.")
    assert atomic.clean_stale(dest) == [left]
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]


def test_clean_stale_judges_only_this_hosts_dead_writers(tmp_path):
    dest = tmp_path / "x.sqsh"
    dead = _dead_pid()
    mine_dead = _temp(tmp_path, "x.sqsh", atomic.host(), dead)
    mine_alive = _temp(tmp_path, "x.sqsh", atomic.host(), os.getpid())
    mine_dead_dir = tmp_path / f".x.sqsh.tmp.{atomic.host()}.{dead}.99aa_work"
    (mine_dead_dir / "rootfs" / "ro").mkdir(parents=True)
    os.chmod(mine_dead_dir / "rootfs", 0o500)  # an unpacked image keeps read-only modes
    # Another node (its own pid space): the same pid number, alive or not here, is none of our business.
    other = _temp(tmp_path, "x.sqsh", "node-b.cluster", dead)
    other_same_pid = _temp(tmp_path, "x.sqsh", "node-b.cluster", os.getpid())
    unrelated = _temp(tmp_path, "y.sqsh", atomic.host(), dead)
    removed = atomic.clean_stale(dest)
    assert sorted(removed) == sorted([mine_dead, mine_dead_dir])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (mine_alive, other, other_same_pid, unrelated))


def test_a_reused_pid_is_not_the_writer(tmp_path):
    """Our pid, but this process started after the temporary was last written: its writer died long ago."""
    t = _temp(tmp_path, "x.sqsh", atomic.host(), os.getpid())
    past = psutil.Process().create_time() - 3600
    os.utime(t, (past, past))
    assert atomic.clean_stale(tmp_path / "x.sqsh") == [t]


def test_replacing_dir_swaps_a_folder_whole(tmp_path):
    src = tmp_path / "out"
    (src / "logs").mkdir(parents=True)
    (src / "adapter_model.safetensors").write_text("new")
    (src / "logs" / "sft.log").write_text("log")
    (src / "link").symlink_to("adapter_model.safetensors")
    dest = tmp_path / "artifacts" / "out"
    dest.mkdir(parents=True)
    (dest / "stale-file").write_text("from the last run")
    atomic.copy_tree(src, dest)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == [
        "adapter_model.safetensors", "link", "logs", "logs/sft.log"]
    assert os.readlink(dest / "link") == "adapter_model.safetensors"
    assert [p.name for p in dest.parent.iterdir()] == ["out"]


def test_replacing_dir_without_exchange_renames_aside(tmp_path, monkeypatch):
    """File systems without renameat2(RENAME_EXCHANGE) (e.g. some network ones): old aside, new in, old gone."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    dest = tmp_path / "merged"
    dest.mkdir()
    (dest / "a").write_text("old")
    with atomic.replacing_dir(dest) as tmp:
        (tmp / "b").write_text("new")
    assert [p.name for p in dest.iterdir()] == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


def test_failed_write_leaves_nothing(tmp_path):
    dest = tmp_path / "job.sh"
    with pytest.raises(RuntimeError):
        with atomic.replacing(dest) as tmp:
            tmp.write_text("#!/bin/sh\n")
            raise RuntimeError("renderer failed")
    assert list(tmp_path.iterdir()) == []


HOLDER = """
import sys, time
from common import atomic
with atomic.replacing(sys.argv[1]) as tmp:
    tmp.write_text("in flight on " + atomic.host())
    print(tmp, flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for unshare --uts")
def test_another_hosts_write_in_flight_survives_our_cleaner(tmp_path):
    """Node B writes into the shared folder (another UTS name, this pid space); a writer on this host whose
    process died leaves a temporary too. Our cleaner removes ours only; B's write then lands."""
    dest = tmp_path / "x.sqsh"
    b = subprocess.Popen(["unshare", "--uts", "sh", "-c", 'hostname node-b && exec "$@"', "_",
                          PY, "-c", HOLDER, str(dest), "3"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    b_temp = Path(b.stdout.readline().strip())
    assert b_temp.name.startswith(f".x.sqsh.tmp.node-b.{b.pid}.")
    ours = _temp(tmp_path, "x.sqsh", atomic.host(), _dead_pid())
    # What B's pid looks like from a real other host: unknown here. Same number, dead here, other host: kept.
    fake_b_elsewhere = _temp(tmp_path, "x.sqsh", "node-b", _dead_pid())
    assert atomic.clean_stale(dest) == [ours]
    assert b_temp.exists() and fake_b_elsewhere.exists()
    assert b.wait(timeout=30) == 0
    assert dest.read_text() == "in flight on node-b"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dest.name, fake_b_elsewhere.name])


def test_pseudo_filesystems_are_refused_but_dev_shm_is_a_folder(tmp_path):
    from common.atomic import why_not_a_folder

    for bad in ("/proc/trainbox", "/sys/x", "/dev/trainbox-out", "/dev/null/x"):
        assert "holds no files" in why_not_a_folder(bad)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        assert why_not_a_folder("/dev/shm/trainbox-out") is None  # a tmpfs: 8B outputs go there on a small disk
