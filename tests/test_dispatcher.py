"""The dispatcher: listing without imports, unknown names, pass-through, exec in place; under the image's PID 1
(Debian's tini, the ENTRYPOINT `tini -g -- trainbox`): signals, exit codes, reaping."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import commands

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# Every command the table lists: a new one is checked here without naming it.
NAMES = commands.names(public=True)

# A stand-in entrypoint for the signal tests: logs what it receives, exits 7 on SIGTERM.
MARKER_ENTRYPOINT = '''"""Test stand-in: logs signals, exits 7 on SIGTERM."""
import os, signal, sys, time


def zombies():
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            n += stat.rpartition(")")[2].split()[0] == "Z"
    return n


def main(argv):
    out = argv[0]

    def log(s):
        with open(out, "a") as f:
            f.write(s + "\\n")

    signal.signal(signal.SIGUSR1, lambda *a: log("USR1"))
    signal.signal(signal.SIGHUP, lambda *a: log("HUP"))

    def term(*a):
        log("TERM")
        sys.exit(7)

    signal.signal(signal.SIGTERM, term)
    # A trainer takes the stop signals the dispatcher held across its exec (preemption.claim_preempt_signals).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})
    log(f"pid {os.getpid()} ppid {os.getppid()}")
    if "--orphan" in argv:  # a grandchild outlives its parent: re-parented to the reaper, which must reap it
        if os.fork() == 0:
            if os.fork() == 0:
                time.sleep(0.2)
                os._exit(0)
            os._exit(0)
        os.wait()
        time.sleep(2.5)
        log(f"zombies {zombies()}")
    if "--die" in argv:
        os.kill(os.getpid(), signal.SIGKILL)
    log("ready")
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def run(args, env=None, cwd=ROOT, **kw):
    e = dict(os.environ, PYTHONPATH=str(ROOT))
    e.update(env or {})
    return subprocess.run([PY, "-m", "trainbox", *args], cwd=cwd, env=e, capture_output=True, text=True,
                          timeout=120, **kw)


@pytest.fixture
def pkg(tmp_path):
    """A copy of the packages whose `sft` entrypoint is the marker stand-in (the real dispatcher runs it)."""
    home = tmp_path / "pkg"
    for package in ("trainbox", "common"):
        shutil.copytree(ROOT / package, home / package, ignore=shutil.ignore_patterns("__pycache__"))
    (home / "trainbox" / "cli" / "sft.py").write_text(MARKER_ENTRYPOINT)
    return home


def wait_for(path: Path, text: str, proc=None, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return path.read_text()
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {text!r}: {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def test_help_lists_every_entrypoint_with_its_docstring_line():
    r = run(["--help"])
    assert r.returncode == 0, r.stderr
    listed = {line.split()[0]: line.split(None, 1)[1] for line in r.stdout.splitlines() if line.startswith("  ")}
    assert set(NAMES) <= set(listed)
    assert "healthcheck" not in listed  # hidden
    doctor_doc = ast.get_docstring(ast.parse((ROOT / "trainbox/cli/doctor.py").read_text())).splitlines()[0]
    assert listed["doctor"] == doctor_doc


def test_help_imports_nothing_heavy():
    code = ("import sys; from trainbox.dispatch import usage; t = usage(); "
            "heavy = {'torch', 'transformers', 'trl', 'jupyter_server'} & set(sys.modules); "
            "assert not heavy, heavy; assert 'jupyter' in t")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", commands.names())
def test_entrypoint_module_honours_the_contract(name):
    """Each module: one-line docstring, top-level `main(argv)`, and runnable with `python -m` (a __main__ guard)."""
    path = ROOT / commands.path(name)
    assert path.is_file(), f"{path} missing"
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and doc.splitlines()[0].strip(), f"{name}: no docstring"
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert mains and len(mains[0].args.args) == 1, f"{name}: no top-level main(argv)"
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guards, f"{name}: no `if __name__ == '__main__'` block"


def test_trainbox_command_like_the_image(tmp_path):
    """/usr/local/bin/trainbox in the image is `exec python -m trainbox "$@"`: same listing through it."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "trainbox"
    shim.write_text(f'#!/bin/sh\nexec {PY} -m trainbox "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    r = subprocess.run(["trainbox", "--help"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in NAMES:
        assert f"\n  {name} " in r.stdout
    r = subprocess.run(["trainbox", "nope"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "unknown entrypoint 'nope'" in r.stderr and "usage:" in r.stderr


def test_other_programs_on_path_run_as_given(tmp_path):
    """`docker run -it IMAGE bash` / `enroot start IMAGE python x.py`: not an entrypoint, but a program on PATH."""
    r = run(["sh", "-c", "echo hello $0; exit 5", "there"])
    assert r.returncode == 5 and r.stdout == "hello there\n"
    r = run(["--frobnicate"])
    assert r.returncode == 2 and "usage:" in r.stderr


def test_ours_wins_over_an_installed_trainbox(tmp_path):
    """Another `trainbox` installed in site-packages (an older wheel of this project) must not shadow the package."""
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "trainbox.py").write_text('"""An installed trainbox stand-in."""\n'
                                     'raise SystemExit("wrong trainbox")\n')
    r = subprocess.run([venv / "bin" / "python", "-m", "trainbox", "doctor", "--help"], cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert r.returncode == 0 and "--json" in r.stdout, r.stderr


def test_unknown_name_and_no_name_exit_2_with_usage():
    r = run(["frobnicate"])
    assert r.returncode == 2
    assert "unknown entrypoint 'frobnicate'" in r.stderr and "doctor" in r.stderr
    r = run([])
    assert r.returncode == 2 and "usage:" in r.stderr


def test_name_help_passes_through_to_the_entrypoint():
    r = run(["doctor", "--help"])
    assert r.returncode == 0, r.stderr
    assert "--json" in r.stdout and "exit codes" in r.stdout.lower()


def test_missing_or_broken_module_does_not_break_listing(pkg):
    (pkg / "trainbox" / "cli" / "grpo.py").unlink(missing_ok=True)
    (pkg / "trainbox" / "cli" / "qlora.py").write_text("def main(argv:\n")  # a syntax error mid-edit
    r = run(["--help"], env={"PYTHONPATH": str(pkg)}, cwd=pkg)
    assert r.returncode == 0, r.stderr
    assert "grpo       (not installed in this image)" in r.stdout
    assert "  qlora" in r.stdout and "  doctor" in r.stdout
    r = run(["grpo"], env={"PYTHONPATH": str(pkg)}, cwd=pkg)
    assert r.returncode == 2 and "not installed" in r.stderr


def start(pkg, args, env=None, prefix=()):
    e = dict(os.environ, PYTHONPATH=str(pkg))
    e.update(env or {})
    return subprocess.Popen([*prefix, PY, "-m", "trainbox", "sft", *args], cwd="/", env=e,
                            stderr=subprocess.PIPE, text=True)


def test_not_pid1_execs_in_place(pkg, tmp_path):
    log = tmp_path / "log"
    p = start(pkg, [str(log)])
    text = wait_for(log, "ready", p)
    assert f"pid {p.pid} " in text  # the dispatcher became the entrypoint: no extra process in between
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 7
    assert "TERM" in log.read_text()


# The image's ENTRYPOINT, read from the template the images are rendered from (so the test follows it).
TEMPLATE = ROOT / "builder" / "templates" / "Dockerfile.j2"


def image_entrypoint() -> list[str]:
    import json
    import re

    (line,) = re.findall(r"^ENTRYPOINT (\[.*\])$", TEMPLATE.read_text(), re.M)
    return json.loads(line)


def _can_unshare() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


def _host_pid_of_pid1(unshare_pid: int, timeout=30) -> int:
    """PID 1 of the new namespace as seen from here: unshare --fork's only child."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.02)
    raise AssertionError("unshare started no child")


def start_as_image(pkg, args):
    """`docker run IMAGE sft ARGS`: the image's ENTRYPOINT as PID 1 of a new PID namespace, the dispatcher under it
    (the image's /usr/local/bin/trainbox is `exec python -m trainbox "$@"`)."""
    tini, *flags = image_entrypoint()[:-1]
    assert Path(tini).name == "tini" and flags == ["-g", "--"]
    tini = shutil.which("tini") or tini  # the host's Debian tini (make system-deps installs it)
    e = dict(os.environ, PYTHONPATH=str(pkg))
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", tini, *flags, PY, "-m", "trainbox",
                             "sft", *args], cwd="/", env=e, stderr=subprocess.PIPE, text=True)


needs_pidns = pytest.mark.skipif(not _can_unshare(), reason="needs root: unshare --pid (a new PID namespace)")


def test_the_image_runs_tini_as_pid1_and_trainbox_under_it():
    ep = image_entrypoint()
    assert ep == ["/usr/bin/tini", "-g", "--", "/usr/local/bin/trainbox"]
    assert 'CMD ["jupyter"]' in TEMPLATE.read_text()


@needs_pidns
def test_under_tini_signals_reach_the_entrypoint_and_its_code_comes_back(pkg, tmp_path):
    """Like `docker run` + `docker kill -s USR1/HUP` + `docker stop`: the signals come from outside to PID 1."""
    log = tmp_path / "log"
    p = start_as_image(pkg, [str(log), "--orphan"])
    pid1 = _host_pid_of_pid1(p.pid)
    text = wait_for(log, "ready", p)
    assert "ppid 1\n" in text  # the entrypoint is tini's child: the dispatcher exec'd in place
    assert "zombies 0" in text  # tini reaped the orphan
    for sig, word in ((signal.SIGUSR1, "USR1"), (signal.SIGHUP, "HUP")):
        os.kill(pid1, sig)
        wait_for(log, word, p)
    os.kill(pid1, signal.SIGTERM)
    assert p.wait(30) == 7
    assert log.read_text().splitlines()[-1] == "TERM"


@needs_pidns
def test_under_tini_death_by_signal_is_128_plus_n(pkg, tmp_path):
    p = start_as_image(pkg, [str(tmp_path / "log"), "--die"])
    assert p.wait(30) == 128 + signal.SIGKILL
