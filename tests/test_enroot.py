"""builder.enroot: the .sqsh must be what `enroot import dockerd://IMAGE` writes.

Expected texts are pinned from NVIDIA/enroot src/docker.sh at commit 8ea147d, function docker::configure
(lines 338-398): fstab line per VOLUME (l.354), Env verbatim (l.357), provenance + labels as comments + one empty
line (l.360-364), the rc body heredoc (l.377-389, `${arr[@]@Q}` quoting), rc.local (l.393-396); and from
docker::daemon::import (l.559-618): tar excludes `dev/*` and `.dockerenv`, `mksquashfs -all-root` with
ENROOT_SQUASH_OPTIONS, default `-comp lzo -noD -exit-on-error` (enroot.in l.88).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings, strategies as st

from builder import enroot
from builder.enroot import UserError, bash_quote, configure_files, export_image, squash_options

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


# ------------------------------------------------------------------ quoting: bash's own ${a[@]@Q} is the oracle

def _bash_q(args: list[str]) -> str:
    # The same expansion enroot's rc heredoc does: ${entrypoint[@]+${entrypoint[@]@Q}} (docker.sh l.386).
    script = 'a=("$@"); cat <<EOF\n${a[@]+${a[@]@Q}}\nEOF'
    r = subprocess.run(["bash", "-c", script, "_", *args], capture_output=True,
                       env={"LC_ALL": "C.UTF-8", "PATH": os.environ["PATH"]})
    assert r.returncode == 0, r.stderr
    return r.stdout.decode("utf-8")[:-1]


@pytest.mark.parametrize("s", ["", "'", "''", "a", "it's", "a b", "$HOME", 'x"y', "tab\there", "new\nline",
                               "\x1b[0m", "\x7f", "back\\slash", "é", "日本", "--flag=a b"])
def test_bash_quote_matches_bash(s):
    assert bash_quote(s) == _bash_q([s])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x7F)), min_size=1, max_size=4))
def test_bash_quote_matches_bash_on_any_ascii(args):
    assert " ".join(bash_quote(a) for a in args) == _bash_q(args)


# ------------------------------------------------------------------ docker::configure texts

SAMPLE = {  # docker inspect shape; enroot lower-cases only the top-level keys
    "Architecture": "amd64",
    "Config": {
        "Env": ["PATH=/opt/venv/bin:/usr/bin:/bin", "QUOTED=a b 'c' $HOME"],
        "Volumes": {"/workspace/outputs": {}, "/data": {}},
        "WorkingDir": "/workspace",
        "Entrypoint": ["/usr/local/bin/trainbox"],
        "Cmd": ["jupyter", "--ip=0.0.0.0 x"],
        "Labels": {"io.trainbox.cell": "smoke", "multi": "one\ntwo"},
    },
}

SAMPLE_RC = """\
# enroot-provenance: dockerd://trainbox:smoke
# io.trainbox.cell smoke
# multi one two

mkdir -p "/workspace" 2> /dev/null
cd "/workspace" && unset OLDPWD || exit 1

if [ -s /etc/rc.local ]; then
    . /etc/rc.local
fi

if [ $# -gt 0 ]; then
    exec '/usr/local/bin/trainbox' "$@"
else
    exec '/usr/local/bin/trainbox' 'jupyter' '--ip=0.0.0.0 x'
fi
"""

RC_LOCAL = ("# This file is sourced by /etc/rc when the container starts.\n"
            "# It can be used to manipulate the entrypoint or the command of the container.\n")


def test_configure_texts_pinned_from_enroot_source():
    f = configure_files(SAMPLE, "dockerd://trainbox:smoke")
    assert f["/etc/rc"] == SAMPLE_RC
    # keys[] sorts; ${ENROOT_ROOTFS} stays literal (single-quoted jq program).
    assert f["/etc/fstab"] == ("${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev\n"
                               "${ENROOT_ROOTFS}/workspace/outputs /workspace/outputs none "
                               "x-create=dir,bind,rw,nosuid,nodev\n")
    assert f["/etc/environment"] == "PATH=/opt/venv/bin:/usr/bin:/bin\nQUOTED=a b 'c' $HOME\n"
    assert f["/etc/rc.local"] == RC_LOCAL
    assert f["workdir"] == "/workspace"


def test_configure_defaults_without_cmd_workdir_labels_volumes():
    f = configure_files({"config": {"Env": None, "Cmd": None, "Entrypoint": None, "WorkingDir": "",
                                    "Labels": None, "Volumes": None}}, "dockerd://x")
    # No labels: provenance + the empty line; no entrypoint: two spaces after exec; default cmd /bin/sh; cd /.
    assert f["/etc/rc"].startswith('# enroot-provenance: dockerd://x\n\nmkdir -p "/" 2> /dev/null\n'
                                   'cd "/" && unset OLDPWD || exit 1\n')
    assert "    exec  \"$@\"\n" in f["/etc/rc"]
    assert "    exec  '/bin/sh'\n" in f["/etc/rc"]
    assert f["/etc/fstab"] == "" and f["/etc/environment"] == ""


def test_configure_cmd_only_and_newline_splits_like_readarray():
    f = configure_files({"Config": {"Cmd": ["sh", "-c", "echo a\necho b"]}}, "dockerd://x")
    # jq -r prints the element over two lines; readarray -t makes them two words.
    assert "    exec  'sh' '-c' 'echo a' 'echo b'\n" in f["/etc/rc"]


def test_rc_runs_under_sh_with_args_and_default(tmp_path):
    """The generated /etc/rc is valid sh: run it with a fake entrypoint."""
    cfg = {"Config": {"Entrypoint": ["printf", "[%s]"], "Cmd": ["a b", "it's"], "WorkingDir": str(tmp_path)}}
    rc = tmp_path / "rc"
    rc.write_text(configure_files(cfg, "dockerd://x")["/etc/rc"])
    out = subprocess.run(["sh", str(rc)], capture_output=True, text=True, cwd="/")
    assert out.stdout == "[a b][it's]"
    out = subprocess.run(["sh", str(rc), "x y"], capture_output=True, text=True, cwd="/")
    assert out.stdout == "[x y]"


# ------------------------------------------------------------------ options and bad input

def test_squash_options():
    assert squash_options("lzo", None) == ["-comp", "lzo", "-noD", "-exit-on-error"]
    # build.py passes None when not asked: zstd, ours (lzo stays enroot's, on request)
    assert squash_options(None, None) == squash_options("zstd", None) == ["-comp", "zstd", "-Xcompression-level", "3",
                                                                          "-exit-on-error"]
    assert squash_options("zstd", "1M")[-2:] == ["-b", "1M"]
    for bad in ("3M", "100K", "abc", "0", "1000"):
        with pytest.raises(UserError, match="power of two"):
            squash_options("zstd", bad)
    with pytest.raises(UserError, match="unknown compression"):
        squash_options("brotli", None)


def test_bad_destination_and_epoch(tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"must end in \.sqsh"):
        export_image("x", tmp_path / "out.tar")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot create the destination directory"):
        export_image("x", tmp_path / "file" / "out.sqsh")
    (tmp_path / "file").unlink()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(UserError, match="SOURCE_DATE_EPOCH"):
        export_image("x", tmp_path / "out.sqsh")
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_input_exit_2(tmp_path):
    r = subprocess.run([PY, "-m", "builder.enroot", "img", str(tmp_path / "x.img")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "must end in .sqsh" in r.stderr


def test_use_enroot_without_enroot(tmp_path, monkeypatch):
    monkeypatch.setattr(enroot.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="enroot` is not on PATH"):
        export_image("x:1", tmp_path / "o.sqsh", use_enroot=True, docker="/bin/true")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ real images (engine)

def _docker() -> str:
    from builder.enroot import docker_cli

    return docker_cli()


@pytest.fixture(scope="session")
def docker_engine():
    from devenv import engine as devengine

    if not devengine.engine_answers():
        devengine.up(tools=False)
    return _docker()


def _mini_base(docker: str, tmp: Path) -> str:
    """A few host binaries (dash, rm, mkdir, cat) and their libraries as a base: seconds, no network."""
    root = tmp / "root"
    for d in ("bin", "etc", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for b in ("dash", "rm", "mkdir", "cat"):
        src = shutil.which(b)
        shutil.copy2(src, root / "bin" / b)
        ldd = subprocess.run(["ldd", src], capture_output=True, text=True).stdout
        for lib in [w for w in ldd.split() if w.startswith("/")]:
            dst = root / lib.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(lib), dst)
    (root / "bin" / "sh").symlink_to("dash")
    (root / "etc" / "environment").write_text("OLD=1\n")
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run([docker, "import", "-", "trainbox-test/minibase:1"], stdin=tar.stdout, check=True,
                   capture_output=True)
    tar.wait()
    return "trainbox-test/minibase:1"


TEST_DOCKERFILE = """\
FROM {base}
RUN mkdir -p /opt/gone /etc/keep && : > /opt/gone/file && : > /etc/keep/a
RUN rm -rf /opt/gone
COPY --chown=1000:1000 Dockerfile /home/trainer/Dockerfile
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility PYTORCH_VERSION=2.13.0
ENV QUOTED="a b 'c' \\$HOME"
LABEL io.trainbox.cell=test a.first=1
VOLUME ["/workspace/outputs", "/data"]
WORKDIR /workspace
ENTRYPOINT ["/bin/sh", "-c", "echo \\"it's\\" \\"$0\\" \\"$@\\"", "x"]
CMD ["jupyter", "--flag=a b"]
"""


@pytest.fixture(scope="session")
def test_image(docker_engine, tmp_path_factory):
    """An image with ENV/VOLUME/WORKDIR/ENTRYPOINT/CMD/labels (one with a newline) and a whiteout layer."""
    tmp = tmp_path_factory.mktemp("img")
    base = _mini_base(docker_engine, tmp)
    (tmp / "Dockerfile").write_text(TEST_DOCKERFILE.format(base=base))
    ref = "trainbox-test/enroot:1"
    subprocess.run([docker_engine, "build", "-q", "--label", "nl=line one\nline two", "-t", ref, str(tmp)], check=True,
                   capture_output=True, env=dict(os.environ, DOCKER_BUILDKIT="0"))
    return ref


def _unsquash(sqsh: Path, dest: Path) -> Path:
    subprocess.run(["unsquashfs", "-q", "-n", "-d", str(dest), str(sqsh)], check=True, capture_output=True)
    return dest


@pytest.mark.engine
def test_export_matches_enroot_layout(test_image, docker_engine, tmp_path):
    out = export_image(test_image, tmp_path / "t.sqsh", progress=False)
    listing = subprocess.run(["unsquashfs", "-lln", str(out)], capture_output=True, text=True, check=True).stdout
    # "MODE root/root SIZE DATE TIME PATH[ -> TARGET]"
    paths = {line.split(maxsplit=5)[5].split(" -> ")[0] for line in listing.splitlines() if line[:1] in "d-l"}
    assert {"squashfs-root/bin/sh", "squashfs-root/etc/rc", "squashfs-root/etc/keep/a",
            "squashfs-root/workspace"} <= paths
    assert "squashfs-root/opt/gone" not in paths  # the rm layer's whiteout is honoured
    assert "squashfs-root/.dockerenv" not in paths
    assert not [p for p in paths if p.startswith("squashfs-root/dev/")]  # empty /dev
    assert "squashfs-root/home/trainer/Dockerfile" in paths  # owned by 1000 in the image...
    assert all(line.split()[1] == "0/0" for line in listing.splitlines() if line[:1] in "d-l")  # ...-all-root
    root = _unsquash(out, tmp_path / "u")
    inspect = json.loads(subprocess.run([docker_engine, "image", "inspect", test_image], capture_output=True,
                                        check=True).stdout)[0]
    want = configure_files(inspect, f"dockerd://{test_image}")
    for rel in ("/etc/rc", "/etc/rc.local", "/etc/environment", "/etc/fstab"):
        assert (root / rel.lstrip("/")).read_text() == want[rel], rel
    rc = (root / "etc/rc").read_text()
    # Pinned, independent of configure_files: labels sorted, the newline flattened, Go's sort order.
    assert rc.startswith(f"# enroot-provenance: dockerd://{test_image}\n# a.first 1\n# io.trainbox.cell test\n"
                         "# nl line one line two\n\n")
    assert "    exec '/bin/sh' '-c' 'echo \"it'\\''s\" \"$0\" \"$@\"' 'x' 'jupyter' '--flag=a b'\n" in rc
    assert (root / "etc/environment").read_text().endswith("PYTORCH_VERSION=2.13.0\nQUOTED=a b 'c' $HOME\n")
    assert (root / "etc/fstab").read_text().splitlines()[0] == \
        "${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev"
    assert oct((root / "etc/rc").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


@pytest.mark.engine
def test_rc_runs_the_entrypoint_inside_the_rootfs(test_image, tmp_path):
    """What enroot start does last: sh /etc/rc [ARGS] inside the rootfs (chroot here)."""
    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    root = _unsquash(export_image(test_image, tmp_path / "t.sqsh", progress=False), tmp_path / "u")
    r = subprocess.run(["chroot", str(root), "/bin/sh", "/etc/rc"], capture_output=True, text=True)
    assert r.stdout == "it's x jupyter --flag=a b\n", r.stderr
    r = subprocess.run(["chroot", str(root), "/bin/sh", "/etc/rc", "sft", "--config", "c.yaml"],
                       capture_output=True, text=True)
    assert r.stdout == "it's x sft --config c.yaml\n", r.stderr


@pytest.mark.engine
def test_same_source_date_epoch_is_byte_identical(test_image, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a = export_image(test_image, tmp_path / "a.sqsh", compression="lzo", progress=False)
    time.sleep(1.1)  # a different wall-clock second would show up in any timestamp we failed to pin
    b = export_image(test_image, tmp_path / "b.sqsh", compression="lzo", progress=False)
    assert a.read_bytes() == b.read_bytes()
    z1 = export_image(test_image, tmp_path / "z1.sqsh", block_size="1M", progress=False)  # the default: zstd
    z2 = export_image(test_image, tmp_path / "z2.sqsh", compression="zstd", block_size="1M", progress=False)
    assert z1.read_bytes() == z2.read_bytes() != a.read_bytes()
    sb = subprocess.run(["unsquashfs", "-s", str(z1)], capture_output=True, text=True, check=True).stdout
    assert "zstd" in sb and "Block size 1048576" in sb
    assert "lzo" in subprocess.run(["unsquashfs", "-s", str(a)], capture_output=True, text=True, check=True).stdout
    listing = lambda p: subprocess.run(["unsquashfs", "-l", str(p)], capture_output=True, text=True,  # noqa: E731
                                       check=True).stdout
    assert listing(a) == listing(z1)  # same tree, only the compression differs
    # the sidecars are reproducible too: same SBOM bytes, a checksum line per file naming it
    assert (tmp_path / "a.sqsh.cdx.json").read_bytes() == (tmp_path / "z1.sqsh.cdx.json").read_bytes()
    assert (tmp_path / "z1.sqsh.sha256").read_text().split() == (tmp_path / "z2.sqsh.sha256").read_text().split()[:1] \
        + ["z1.sqsh"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{n}.sqsh{s}" for n in ("a", "b", "z1", "z2") for s in ("", ".sha256", ".cdx.json"))


@pytest.mark.engine
def test_export_replaces_existing_and_cli_works(test_image, tmp_path):
    dest = tmp_path / "t.sqsh"
    dest.write_text("old")
    r = subprocess.run([PY, "-m", "builder.enroot", test_image, str(dest), "--compression", "zstd", "--quiet"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes()[:4] == b"hsqs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.sqsh", "t.sqsh.cdx.json", "t.sqsh.sha256"]


@pytest.mark.engine
def test_missing_image_is_a_user_error(docker_engine, tmp_path):
    with pytest.raises(UserError, match="not in the local engine"):
        export_image("trainbox-test/does-not-exist:0", tmp_path / "x.sqsh", progress=False)
    assert list(tmp_path.iterdir()) == []


def _wait_for(pred, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="session")
def slow_image(test_image, docker_engine, tmp_path_factory):
    """The test image plus 128 MiB of random bytes: xz in 4K blocks takes seconds over it, so a signal sent after
    the temp file appears lands mid-write (the bare test image once finished first under CI load)."""
    tmp = tmp_path_factory.mktemp("slow")
    with open(tmp / "blob", "wb") as f:
        for _ in range(128):
            f.write(os.urandom(2**20))
    (tmp / "Dockerfile").write_text(f"FROM {test_image}\nCOPY blob /opt/blob\n")
    ref = "trainbox-test/enroot-slow:1"
    subprocess.run([docker_engine, "build", "-q", "-t", ref, str(tmp)], check=True, capture_output=True,
                   env=dict(os.environ, DOCKER_BUILDKIT="0"))
    shutil.rmtree(tmp, ignore_errors=True)  # the blob lives in the image now
    return ref


@pytest.mark.engine
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_killed_export_leaves_no_sqsh(slow_image, test_image, tmp_path, sig):
    dest = tmp_path / "k.sqsh"
    # SIGINT back to its default in the child: a harness that started us without job control may pass it down as
    # ignored, and a Python started that way rightly keeps ignoring it.
    p = subprocess.Popen([PY, "-m", "builder.enroot", slow_image, str(dest), "--compression", "xz",
                          "--block-size", "4K", "--quiet"], cwd=ROOT, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert _wait_for(lambda: _sqsh_temps(tmp_path, "k.sqsh", p.pid), timeout=120), "export never started writing"
    time.sleep(0.5)
    assert p.poll() is None, "the export ended before it could be interrupted"
    p.send_signal(sig)
    p.wait(timeout=120)
    assert p.returncode != 0, p.stderr.read().decode(errors="replace")
    assert not dest.exists()
    assert not list(tmp_path.glob("*.sqsh"))
    if sig != signal.SIGKILL:
        assert list(tmp_path.iterdir()) == [], "interrupted export left files behind"
    else:
        # SIGKILL can't be caught: the next export of the same DEST removes the dead process's leftovers.
        export_image(test_image, dest, progress=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["k.sqsh", "k.sqsh.cdx.json", "k.sqsh.sha256"]


@pytest.mark.engine
def test_failed_export_leaves_no_sidecar(test_image, tmp_path, monkeypatch):
    """mksquashfs fails after the SBOM was read and the rootfs unpacked: no .sqsh, no checksum, no SBOM, no temporary;
    an older complete set stays as it was."""
    old = export_image(test_image, tmp_path / "f.sqsh", progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["f.sqsh", "f.sqsh.cdx.json", "f.sqsh.sha256"]
    bin_dir = tmp_path.parent / f"{tmp_path.name}-bin"
    bin_dir.mkdir()
    (bin_dir / "mksquashfs").write_text("#!/bin/sh\necho 'FATAL ERROR: disk full' >&2\nexit 1\n")
    (bin_dir / "mksquashfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    with pytest.raises(UserError, match="mksquashfs failed.*disk full"):
        export_image(test_image, old, compression="lzo", progress=False)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    fresh = tmp_path / "fresh"
    with pytest.raises(UserError, match="mksquashfs failed"):
        export_image(test_image, fresh / "n.sqsh", progress=False)
    assert list(fresh.iterdir()) == []


def _sqsh_temps(folder: Path, name: str, pid: int, host: str | None = None) -> list[Path]:
    """The squashfs temporaries (not the unpack folders) that export PID on HOST writes next to NAME."""
    from common import atomic

    host = host or atomic.host()
    return [p for p in folder.glob(f".{name}.tmp.{host}.{pid}.*") if not p.name.endswith("_work")]


def _export_as_host(host: str, image: str, dest: Path, **kw) -> subprocess.Popen:
    """An export running under another host name (its own UTS namespace), in this pid space: how a second node
    writing into the same shared folder looks from here, except that its pids are ours to see."""
    cmd = [PY, "-m", "builder.enroot", image, str(dest), "--compression", "xz", "--block-size", "4K", "--quiet"]
    return subprocess.Popen(["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *cmd], cwd=ROOT,
                            stderr=subprocess.PIPE, **kw)


@pytest.mark.engine
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for unshare --uts")
def test_two_hosts_exporting_into_one_shared_folder(slow_image, test_image, tmp_path):
    """Node A's export dies mid-write (SIGKILL): its pid is gone here, which is how a LIVE export of another node
    looks from this one. This host's export of the same file must leave A's temporary alone (only A may judge its
    own pids); A's next export cleans it."""
    from common import atomic

    shared = tmp_path / "shared"
    shared.mkdir()
    dest = shared / "d.sqsh"
    a = _export_as_host("node-a.cluster", slow_image, dest)
    assert _wait_for(lambda: _sqsh_temps(shared, "d.sqsh", a.pid, "node-a.cluster"), timeout=120), \
        a.stderr.read().decode(errors="replace") if a.poll() is not None else "node A never started writing"
    a.kill()
    a.wait(timeout=60)
    left_by_a = sorted(shared.glob(".d.sqsh.tmp.node-a.cluster.*"))
    assert left_by_a and not psutil.pid_exists(a.pid)

    # This host (a different name, same pid space) exports the same file: A's temporaries survive.
    assert atomic.host() != "node-a.cluster"
    export_image(test_image, dest, progress=False)
    assert dest.read_bytes()[:4] == b"hsqs"
    assert sorted(shared.glob(".d.sqsh.tmp.node-a.cluster.*")) == left_by_a

    # While node B (another name) exports, node A exports too; both finish, neither touched the other's files.
    b = _export_as_host("node-b", test_image, shared / "d.sqsh")
    a2 = _export_as_host("node-a.cluster", test_image, dest)
    assert b.wait(timeout=300) == 0, b.stderr.read().decode(errors="replace")
    assert a2.wait(timeout=300) == 0, a2.stderr.read().decode(errors="replace")
    # A's second export removed A's dead leftovers (its own host, pid gone); nothing else is left.
    assert sorted(p.name for p in shared.iterdir()) == ["d.sqsh", "d.sqsh.cdx.json", "d.sqsh.sha256"]
    assert dest.read_bytes()[:4] == b"hsqs"


@pytest.mark.engine
def test_arm64_image(docker_engine, test_image, tmp_path):
    """An image whose config says arm64 exports the same way (nothing in it runs on the host)."""
    arm = _retag_arch(docker_engine, test_image, "arm64", tmp_path)
    out = export_image(arm, tmp_path / "arm.sqsh", progress=False, arch="arm64")
    assert (_unsquash(out, tmp_path / "u") / "etc/rc").read_text().startswith(f"# enroot-provenance: dockerd://{arm}")
    with pytest.raises(UserError, match="arm64.*not amd64|amd64"):
        export_image(arm, tmp_path / "wrong.sqsh", progress=False, arch="amd64")
    assert not (tmp_path / "wrong.sqsh").exists()


def _retag_arch(docker: str, ref: str, arch: str, tmp: Path) -> str:
    """docker save -> rewrite the config's architecture -> docker load (a `docker import` would say amd64)."""
    import hashlib
    import tarfile

    src, out_dir = tmp / "img.tar", tmp / "x"
    subprocess.run([docker, "save", "-o", str(src), ref], check=True)
    with tarfile.open(src) as t:
        t.extractall(out_dir, filter="tar")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    cfg_path = out_dir / manifest[0]["Config"]
    cfg = json.loads(cfg_path.read_text())
    cfg["architecture"] = arch
    data = json.dumps(cfg).encode()
    new_name = hashlib.sha256(data).hexdigest() + ".json"
    cfg_path.unlink()
    (out_dir / new_name).write_bytes(data)
    new_ref = f"trainbox-test/enroot-{arch}:1"
    manifest[0]["Config"] = new_name
    manifest[0]["RepoTags"] = [new_ref]
    (out_dir / "manifest.json").write_text(json.dumps(manifest))
    (out_dir / "repositories").unlink(missing_ok=True)
    dst = tmp / "arm.tar"
    with tarfile.open(dst, "w") as t:
        for p in sorted(out_dir.iterdir()):
            t.add(p, arcname=p.name)
    subprocess.run([docker, "load", "-i", str(dst)], check=True, capture_output=True)
    shutil.rmtree(out_dir)
    return new_ref


@pytest.mark.engine
@pytest.mark.skipif(not shutil.which("enroot"), reason="real enroot not installed (optional cross-check)")
def test_byte_identical_to_real_enroot(test_image, tmp_path):
    """With the real enroot on PATH: same mksquashfs times -> the very same bytes (lzo: enroot's own options)."""
    ours = _with_epoch(lambda: export_image(test_image, tmp_path / "ours.sqsh", compression="lzo", progress=False))
    env = dict(os.environ, TTY_OFF="y",
               ENROOT_SQUASH_OPTIONS="-comp lzo -noD -exit-on-error -mkfs-time 1700000000 -all-time 1700000000")
    env.pop("SOURCE_DATE_EPOCH", None)
    subprocess.run(["enroot", "import", "-o", str(tmp_path / "real.sqsh"), f"dockerd://{test_image}"], env=env,
                   check=True, capture_output=True)
    assert ours.read_bytes() == (tmp_path / "real.sqsh").read_bytes()
    # use_enroot=True goes through `enroot import` with our options: the same bytes again.
    via = _with_epoch(lambda: export_image(test_image, tmp_path / "via.sqsh", compression="lzo", progress=False,
                                           use_enroot=True))
    assert via.read_bytes() == ours.read_bytes()


def _with_epoch(fn):
    old = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = "1700000000"
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = old


# ------------------------------------------------------------------ the smoke image (built once per session by enginefix)


@pytest.fixture(scope="module")
def smoke_root(smoke_sqsh, tmp_path_factory):
    """The smoke .sqsh unpacked (2 GB): this module's tests read it; removed when they are done."""
    tmp = tmp_path_factory.mktemp("smoke-root")
    yield _unsquash(smoke_sqsh, tmp / "r")
    shutil.rmtree(tmp, ignore_errors=True)


def _environment(root: Path) -> dict:
    return dict(line.split("=", 1) for line in (root / "etc/environment").read_text().splitlines() if "=" in line)


@pytest.mark.engine
@pytest.mark.timeout(3600)  # the first one also builds the smoke image (shared, once per session) and exports it
def test_smoke_sqsh_rootfs_and_enroot_files(smoke_sqsh, smoke_root, smoke_build, engine):
    listing = subprocess.run(["unsquashfs", "-l", str(smoke_sqsh)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    for p in ("etc/rc", "etc/rc.local", "etc/fstab", "etc/environment", "opt/venv/bin/python",
              "usr/local/bin/trainbox", "etc/trainbox/image.json", "opt/trainbox/trainbox/__main__.py",
              "opt/trainbox/common/launch.py"):
        assert f"squashfs-root/{p}" in listing, p
    assert not [x for x in listing if x.startswith("squashfs-root/dev/") or x == "squashfs-root/.dockerenv"]
    # the session's .sqsh was exported from the build's image ID (enginefix.smoke_sqsh), its provenance line says so
    pinned = smoke_build.image_id
    inspect = json.loads(subprocess.run([engine["docker"], "image", "inspect", pinned], capture_output=True,
                                        check=True).stdout)[0]
    want = configure_files(inspect, f"dockerd://{pinned}")
    for rel in ("/etc/rc", "/etc/rc.local", "/etc/environment", "/etc/fstab"):
        assert (smoke_root / rel.lstrip("/")).read_text() == want[rel], rel
    assert "    exec '/usr/bin/tini' '-g' '--' '/usr/local/bin/trainbox' 'jupyter'\n" in want["/etc/rc"]


@pytest.mark.engine
@pytest.mark.timeout(3600)  # the first one also builds the smoke image (shared, once per session) and exports it
def test_smoke_image_fits_enroot_and_pyxis(smoke_root):
    """Issue #5 item 3, checked on the exported rootfs: what enroot/pyxis need from the image."""
    env = _environment(smoke_root)
    assert env["PATH"].split(":")[0] == "/opt/venv/bin"
    # a CPU image: no NVIDIA_* (enroot's NVIDIA hook would fail on a host without NVIDIA's container library; GPU
    # images set them: tests/test_render.py)
    assert not [k for k in env if k.startswith("NVIDIA_")], env
    assert env["PYTORCH_VERSION"]  # pyxis/enroot's PyTorch hook keys on it
    assert env["PYTHONPATH"] == "/opt/trainbox"
    assert _exists_in(smoke_root, "/bin/sh")  # pyxis runs `sh` (/bin may be a symlink: merged /usr)
    rc = (smoke_root / "etc/rc").read_text()
    workdir = rc.split('cd "', 1)[1].split('"', 1)[0]
    assert workdir == "/workspace" and (smoke_root / "workspace").is_dir()
    for line in (smoke_root / "etc/fstab").read_text().splitlines():  # VOLUME dirs exist in the image itself
        assert (smoke_root / line.split()[1].lstrip("/")).is_dir(), line
    assert os.access(smoke_root / "usr/local/bin/trainbox", os.X_OK)


def _exists_in(root: Path, path: str, depth: int = 0) -> bool:
    """Does PATH exist inside ROOT, following symlinks as the container would (absolute ones stay in ROOT)?"""
    cur = root
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        nxt = cur / part
        if nxt.is_symlink() and depth < 40:
            target = os.readlink(nxt)
            base = "/" + str(cur.relative_to(root)) if cur != root else "/"
            full = target if target.startswith("/") else os.path.normpath(os.path.join(base, target))
            return _exists_in(root, "/".join([full, *parts[i + 1:]]), depth + 1)
        if not nxt.exists():
            return False
        cur = nxt
    return True


def _login_shell(root: Path, *args: str) -> subprocess.CompletedProcess:
    """What enroot-switchroot does: chroot, env from /etc/environment, exec $SHELL as a login shell ("-sh")."""
    env = _environment(root)
    env.setdefault("HOME", "/root")

    def enter():
        os.chroot(root)
        os.chdir("/")

    return subprocess.run(["-sh", *args], executable="/bin/sh", env=env, preexec_fn=enter, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.engine
@pytest.mark.timeout(3600)  # the first one also builds the smoke image (shared, once per session) and exports it
def test_smoke_path_survives_the_login_shell(smoke_root):
    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    r = _login_shell(smoke_root, "-c", 'command -v python; command -v trainbox; echo "$PYTHONPATH"')
    assert r.stdout.splitlines() == ["/opt/venv/bin/python", "/usr/local/bin/trainbox", "/opt/trainbox"], r.stderr
    # enroot start IMAGE --help: /etc/rc execs the ENTRYPOINT with the arguments.
    r = _login_shell(smoke_root, "/etc/rc", "--help")
    assert r.returncode == 0 and "usage: trainbox" in r.stdout, r.stderr
    # (torch itself needs /dev, which enroot mounts at start: test_slurm_job's enroot-mode run covers that.)
    r = _login_shell(smoke_root, "-c", "python -c 'import trainbox; print(trainbox.__file__)'")
    assert r.stdout.strip() == "/opt/trainbox/trainbox/__init__.py", r.stderr


@pytest.mark.engine
@pytest.mark.timeout(3600)  # the first one also builds the smoke image (shared, once per session) and exports it
def test_smoke_exports_reproducible(smoke_build, smoke_sqsh, tmp_path, monkeypatch):
    """lzo (enroot's, on request) against zstd: test_same_source_date_epoch_is_byte_identical, on the small image;
    sizes on the smoke image: benchmarks/sqsh_export.py."""
    import filecmp

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    again = export_image(smoke_build.image_id, tmp_path / "again.sqsh", progress=False)   # the image smoke_sqsh is of
    assert filecmp.cmp(again, smoke_sqsh, shallow=False)  # the session's export: the default, zstd
    assert "Compression zstd" in subprocess.run(["unsquashfs", "-s", str(again)], capture_output=True, text=True,
                                                check=True).stdout
