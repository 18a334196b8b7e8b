"""Issue 29's hostile cases on the release path's own commands (build.py modes, builder.enroot, builder.publish,
builder.sbom): one line, exit 2, nothing written, before any engine or registry work; messages that are right and
never print a secret. No engine needed: the engine and registry calls are replaced by recorders or fakes."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import socket
from pathlib import Path

import pytest

from builder import cli, enroot, publish, sbom
from builder.errors import UserError

SECRET = "s3cretZ"


def call(main, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def one_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ------------------------------------------------------------------ case 3: builder.enroot into /proc, /sys, /dev
@pytest.mark.parametrize("dest", ["/proc/x.sqsh", "/sys/x.sqsh", "/dev/x.sqsh", "/dev/sub/x.sqsh"])
def test_enroot_refuses_proc_sys_dev_before_any_work(monkeypatch, dest):
    asked = []
    monkeypatch.setattr(enroot, "_export_ours", lambda *a, **k: asked.append(a))
    monkeypatch.setattr(enroot, "inspect_image", lambda *a, **k: asked.append(a))
    rc, out, err = call(enroot.main, "trainbox:smoke-x86_64", dest, "--quiet")
    line = one_error(err)
    assert rc == 2 and out == "" and asked == [], err
    assert dest in line and "holds no files" in line, line
    assert not Path(dest).exists()


# ------------------------------------------------------------------ case 8: build.py modes that exclude each other
@pytest.mark.parametrize("modes, words", [
    (["--lock", "--dry-run"], "--dry-run and --lock exclude each other"),
    (["--lock", "--lock-bases"], "--lock and --lock-bases exclude each other"),
    (["--list", "--explain"], "--list and --explain exclude each other"),
    (["--dry-run", "--list"], "--list and --dry-run exclude each other"),
    (["--lock", "--frozen"], "--frozen with --lock"),
    (["--lock-bases", "--frozen"], "--frozen with --lock-bases"),
])
def test_conflicting_modes_are_refused_before_any_work(monkeypatch, modes, words):
    """`--lock --dry-run` used to ignore --dry-run and rewrite the committed lock."""
    from builder import bases, lock, render
    touched = []
    for mod, name in ((lock, "lock_cells"), (lock, "seed"), (render, "write_cells"), (bases, "lock_bases")):
        monkeypatch.setattr(mod, name, lambda *a, _n=name, **k: touched.append(_n) or 0)
    rc, out, err = call(cli.main, "--cell", "smoke", "--arch", "x86_64", *modes)
    assert rc == 2 and out == "" and touched == [], (touched, err)
    assert words in one_error(err)


def test_frozen_dry_run_is_still_a_plan():
    rc, out, err = call(cli.main, "--cell", "smoke", "--arch", "x86_64", "--frozen", "--dry-run")
    assert rc == 0 and "build plan: 1 image(s)" in out, err
