"""Failed builds: one clear error naming the cell and the failing step; no final tag moved to a half image; bad
build inputs refused before anything runs. Throwaway Dockerfiles FROM the test base keep these fast."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from enginefix import BUILD_TIMEOUT, ROOT, ThrowawayCell, docker, engine, test_base  # noqa: F401

from builder import engine as eng
from devenv import engine as devengine
from builder.errors import UserError

# a cold first build (debootstrap + the session images, arm64 under QEMU) runs inside the first test's setup
pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]


def _ctx(tmp_path, body: str):
    (tmp_path / "Dockerfile").write_text("ARG BASE_IMAGE=debian:bookworm\nFROM ${BASE_IMAGE}\n" + textwrap.dedent(body))
    return tmp_path


def _image_id(ref: str) -> str | None:
    r = docker("image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def _build(ctx, tag, base, **kw):
    cell = ThrowawayCell(name=tag, tag=tag, repository="trainbox-failtest")
    return eng.build_cell(cell, builder=eng.choose_builder("auto"), context=ctx,
                          bases={"debian:bookworm": base}, quiet=True, **kw)


def test_bad_base_names_cell_and_from_step(tmp_path, engine):  # noqa: F811
    ctx = _ctx(tmp_path, "RUN true\n")
    missing = f"{devengine.registry_address()}/trainbox/no-such-base:nope"
    with pytest.raises(UserError) as e:
        _build(ctx, "fail-base", missing)
    msg = str(e.value)
    assert "cell fail-base" in msg and f"FROM {missing}" in msg and "not found" in msg
    assert _image_id("trainbox-failtest:fail-base") is None


def test_missing_wheel_names_the_pip_step_and_keeps_the_old_tag(tmp_path, test_base):  # noqa: F811
    ref = "trainbox-failtest:fail-wheel"
    good = _build(_ctx(tmp_path, "RUN echo v1 > /v\n"), "fail-wheel", test_base)
    assert good.refs == [ref] and _image_id(ref) == good.image_id
    ctx = _ctx(tmp_path, """\
        RUN echo v2 > /v
        RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-index --find-links /nowhere trainbox-absent==1.0
        """)
    with pytest.raises(UserError) as e:
        _build(ctx, "fail-wheel", test_base)
    msg = str(e.value)
    assert "cell fail-wheel" in msg and "RUN python3 -m venv" in msg
    assert "No matching distribution found for trainbox-absent==1.0" in msg
    assert _image_id(ref) == good.image_id  # the tag still names the last good image, not a half one


def test_network_failure_names_the_step(tmp_path, test_base):  # noqa: F811
    # port 9 on loopback: nothing listens, so the RUN step's download fails like an unreachable index
    ctx = _ctx(tmp_path, """\
        RUN python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9/simple/torch/', timeout=5)"
        """)
    with pytest.raises(UserError) as e:
        _build(ctx, "fail-net", test_base, no_cache=True)
    msg = str(e.value)
    assert "cell fail-net" in msg and "urllib.request.urlopen" in msg and "refused" in msg.lower()


def test_wheelhouse_is_checked_and_cleaned_up(tmp_path, test_base):  # noqa: F811
    with pytest.raises(UserError, match="not a directory"):
        _build(_ctx(tmp_path, "RUN true\n"), "fail-wh", test_base, wheelhouse=str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no .whl files"):
        _build(_ctx(tmp_path, "RUN true\n"), "fail-wh", test_base, wheelhouse=str(empty))
    # a real wheelhouse: the wheel is offered in the context for the build and gone afterwards
    wh = tmp_path / "wh"
    wh.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wh),
                    str(_tiny_project(tmp_path))], check=True)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    _ctx(ctx, """\
        COPY wheelhouse/ /wh/
        RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --no-index --find-links /wh trainbox-probe==0.1
        """)
    (ctx / "wheelhouse").mkdir()
    (ctx / "wheelhouse" / ".gitkeep").write_text("")
    res = _build(ctx, "wheelhouse-ok", test_base, wheelhouse=str(wh), no_cache=True)
    out = docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", res.refs[0], "-c",
                 "import trainbox_probe; print(trainbox_probe.X)").stdout.strip()
    assert out == "42"
    assert sorted(p.name for p in (ctx / "wheelhouse").iterdir()) == [".gitkeep"]


def _tiny_project(tmp_path):
    proj = tmp_path / "probe"
    (proj / "trainbox_probe").mkdir(parents=True)
    (proj / "trainbox_probe" / "__init__.py").write_text("X = 42\n")
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "trainbox-probe"\nversion = "0.1"\n')
    return proj


def test_cli_bad_base_exits_2_with_one_line(engine):  # noqa: F811
    # through the real CLI: a cell whose base cannot be resolved -> exit 2, one error line naming cell and step
    missing = f"{engine['registry']}/trainbox/no-such-base:nope"
    r = subprocess.run([sys.executable, "build.py", "--cell", "smoke", "--arch", "x86_64", "--quiet",
                        "--base", f"debian:bookworm={missing}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "smoke-x86_64" in err[0] and f"FROM {missing}" in err[0]
