"""Failed builds: one clear error naming the cell and the failing step; no final tag moved to a half image; bad
build inputs refused before anything runs. Throwaway Dockerfiles FROM the test base keep these fast."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from builder import engine as eng
from builder.errors import UserError
from devenv import engine as devengine
from enginefix import BUILD_TIMEOUT, ROOT, ThrowawayCell, docker

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


# These builds stop before the deps stage: an index named for smoke's CPU torch passes the check that its wheel is
# somewhere (pipeline: engine.check_cpu_torch) without fetching it.
NO_WHEEL = ["--build-arg", "TORCH_INDEX_URL=http://127.0.0.1:9/never-asked"]


def test_cli_bad_base_exits_2_with_one_line(engine):  # noqa: F811
    # through the real CLI: a cell whose base cannot be resolved -> exit 2, one error line naming cell and step
    missing = f"{engine['registry']}/trainbox/no-such-base:nope"
    r = subprocess.run([sys.executable, "build.py", "--cell", "smoke", "--arch", "x86_64", "--quiet",
                        "--base", f"debian:bookworm={missing}", *NO_WHEEL], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "smoke-x86_64" in err[0] and f"FROM {missing}" in err[0]
    # the next step is named: substitute the base, or make local test bases
    assert f"the base {missing} cannot be pulled from here" in err[0] and "--base OLD=NEW" in err[0]
    assert "`make bases`" in err[0]


def test_legacy_builder_is_refused_with_one_line(engine):  # noqa: F811
    # the rendered Dockerfiles install the venv under a BuildKit cache mount: the legacy builder can't run them, so
    # --builder legacy stops before any build step with one line and the way out (no image, no tag)
    before = _image_id("trainbox:smoke-x86_64")
    r = subprocess.run([sys.executable, "build.py", "--cell", "smoke", "--arch", "x86_64", "--quiet", "--builder",
                        "legacy", *NO_WHEEL], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "smoke-x86_64" in err[0] and "RUN --mount=type=cache" in err[0], err
    assert "--builder auto" in err[0] and "Traceback" not in r.stderr
    assert _image_id("trainbox:smoke-x86_64") == before


def test_registry_cache_without_buildx_is_refused_with_one_line(engine):  # noqa: F811
    # --cache-from/--cache-to are buildx's (the workflow's builder); the engine's built-in BuildKit here has none:
    # one line before any lock or build work, nothing built
    before = _image_id("trainbox:smoke-x86_64")
    r = subprocess.run([sys.executable, "build.py", "--cell", "smoke", "--arch", "x86_64", "--quiet", "--cache-from",
                        "type=registry,ref=127.0.0.1:5555/trainbox-cache:smoke-x86_64"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "--cache-from/--cache-to need buildx" in err[0] and "Traceback" not in r.stderr, err
    assert _image_id("trainbox:smoke-x86_64") == before


def test_a_step_with_long_output_is_named_by_its_instruction(tmp_path, test_base):  # noqa: F811
    """600 lines of output push BuildKit's `#N [k/n] RUN ...` header out of any tail: the error still names the
    instruction and its Dockerfile line, never a bare `#N`."""
    ctx = _ctx(tmp_path, """\
        RUN echo ok
        RUN i=0; while [ $i -lt 600 ]; do echo "line $i"; i=$((i+1)); done; exit 3
        """)
    with pytest.raises(UserError) as e:
        _build(ctx, "fail-long", test_base, no_cache=True)
    msg = str(e.value)
    assert 'failed at `RUN i=0; while [ $i -lt 600 ]; do echo "line $i"; i=$((i+1)); done; exit 3 (Dockerfile:4, ' \
        in msg, msg
    assert "exit code: 3" in msg and " #" not in msg.split("failed at")[1].split(":")[0]


@pytest.fixture
def https_index(tmp_path):
    """A PEP 503 index over HTTPS with a self-signed certificate (what a TLS-intercepting proxy looks like to pip)."""
    import http.server
    import ssl
    import threading
    from functools import partial

    key, crt = tmp_path / "key.pem", tmp_path / "crt.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-days", "1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    root = tmp_path / "index"
    (root / "simple" / "trainbox-probe").mkdir(parents=True)
    (root / "simple" / "trainbox-probe" / "index.html").write_text("<html><body></body></html>\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(http.server.SimpleHTTPRequestHandler,
                                                                        directory=str(root)))
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(crt, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}/simple/"
    server.shutdown()


def test_tls_failure_names_the_certificate_and_the_fix(tmp_path, test_base, https_index):  # noqa: F811
    """pip hides CERTIFICATE_VERIFY_FAILED behind "No matching distribution found"; the error says the cause and
    where the CA goes."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    _ctx(ctx, f"""\
        RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install --retries 0 --timeout 10 --index-url {https_index} trainbox-probe==0.1
        """)
    with pytest.raises(UserError) as e:
        _build(ctx, "fail-tls", test_base, no_cache=True)
    msg = str(e.value)
    assert "cell fail-tls" in msg and "RUN python3 -m venv" in msg, msg
    assert "TLS certificate verification failed (CERTIFICATE_VERIFY_FAILED)" in msg, msg
    assert "No matching distribution found for trainbox-probe==0.1" in msg, msg
    assert "images/certs/NAME.crt" in msg
