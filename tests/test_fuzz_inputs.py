"""Fuzz the inputs checked before any work: --registry against the Docker CLI's own reference parser (the oracle:
`docker pull` parses the reference before it contacts any engine), and matrix pins / [facts] ranges against packaging.
Valid values are accepted; any other gives exit 2 and one `error:` line, and nothing is rendered."""
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from builder import cli, reference
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT

SETTINGS = settings(max_examples=int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "150")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DOCKER = shutil.which("docker") or "/usr/bin/docker"
TAG = "smoke-x86_64"


def docker_accepts(name: str) -> bool:
    """Whether the Docker CLI parses NAME:TAG as a reference. The engine address points at nothing, so a reference
    it accepts fails later with "Cannot connect"; one it refuses says "invalid reference format"."""
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/trainbox-fuzz.sock"}
    r = subprocess.run([DOCKER, "pull", "-q", "--", f"{name}:{TAG}"], capture_output=True, text=True, env=env,
                       timeout=30)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    if re.search(r"invalid reference format|invalid repository name|must be lowercase|more than 255 char", out):
        return False
    assert "Cannot connect" in out or "connect:" in out or "error during connect" in out, out
    return True


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


names = st.one_of(
    st.from_regex(reference.NAME, fullmatch=True).filter(lambda s: len(s) < 80),
    st.text(alphabet="abzAZ09._-/:@[] ", max_size=24),
    st.builds(lambda a, b: a + b, st.from_regex(reference.NAME, fullmatch=True).filter(lambda s: len(s) < 40),
              st.sampled_from(["", ":5000", "/", "//x", "/Upper", "_", "__", "___", "-", ".", ":tag", "@x", " "])),
    st.sampled_from(["", "http://127.0.0.1:5555/x", "HTTPS://reg/x", "127.0.0.1:5555", "not a registry!!", "[::1]/x",
                     "[::1]:5000/x", "Reg.Example:443/team/x", "reg/Team", "localhost/a__b-c.d", "a" * 64, "a" * 300]))


@SETTINGS
@given(registry=names)
@example(registry="127.0.0.1:5555/trainbox")
@example(registry="not a registry!!")
def test_registry_is_accepted_exactly_when_docker_parses_it(registry):
    if registry.startswith("-"):
        registry = "x" + registry   # argparse would read it as a flag, not the value
    want = docker_accepts(registry)
    rc, stdout, stderr = run_cli(TAG, "--list", "--push", "--registry", registry)
    if want:
        assert rc == 0 and stdout.startswith(f"{TAG} "), stderr
    else:
        assert rc == 2, (registry, stdout, stderr)
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --registry "), stderr
        assert "Traceback" not in stderr and stdout == ""


@pytest.mark.parametrize("registry", ["127.0.0.1:5555/trainbox", "not a registry!!", "http://127.0.0.1:5555/x",
                                      "127.0.0.1:5555/Trainbox", "127.0.0.1:5555/trainbox:latest", "127.0.0.1:5555"])
def test_registry_checked_before_anything_is_written(tmp_path, registry):
    """Through build.py as a user runs it: a valid repository shows in the plan's tags; a bad one stops with one line
    naming the fix, before a file is rendered or an engine is asked (DOCKER_HOST points at nothing)."""
    out = tmp_path / "out"
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/trainbox.sock"}
    r = subprocess.run([sys.executable, str(ROOT / "build.py"), TAG, "--push", "--registry", registry,
                        "--output-dir", str(out), *(["--dry-run"] if docker_accepts(registry) else [])],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    if docker_accepts(registry):
        assert r.returncode == 0 and f"tags: {registry}:{TAG} " in r.stdout and "(pushed)" in r.stdout, r.stderr
        return
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --registry {registry!r} is not a repository reference: ")
    assert "e.g. --registry 127.0.0.1:5555/trainbox" in lines[0]
    assert not out.exists()


BASE_TEXT = (ROOT / "matrix.toml").read_text()
PIN = 'jupyterlab = "4.6.6"'
RANGE = '"1.16.0" = ">=0.22.0,<=0.31.0"'
assert PIN in BASE_TEXT and RANGE in BASE_TEXT

versions = st.one_of(
    st.from_regex(r"v?[0-9]{1,3}(\.[0-9]{1,3}){0,3}((a|b|rc|c|alpha|pre)[0-9]{0,2})?(\.post[0-9])?(\.dev[0-9]?)?"
                  r"(\+[a-z0-9]{1,4}(\.[a-z0-9]{1,3})?)?", fullmatch=True),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
    st.sampled_from(["banana", "", " 4.6.6", "4.6.6 ", "==4.6.6", "4.6.*", "4.6.6;", "1.0-1", "1!2.0", "4.6.6rc1"]))


def toml_str(value: str) -> str:
    """VALUE as a TOML basic string: quotes, backslashes and control characters escaped, everything else as is."""
    return '"' + "".join(f"\\u{ord(ch):04x}" if ch in '"\\' or ord(ch) < 0x20 or ord(ch) == 0x7F else ch
                         for ch in value) + '"'


def _load(tmp: Path, text: str):
    path = tmp / "matrix.toml"
    path.write_text(text)
    return path, load_matrix(path)


@SETTINGS
@given(pin=versions)
def test_a_pin_loads_exactly_when_packaging_reads_one_version(pin, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pin")
    try:
        ok = pin == pin.strip() and not any(ch in pin for ch in "=<>!~;,*") and bool(Version(pin))
    except InvalidVersion:
        ok = False
    text = BASE_TEXT.replace(PIN, f"jupyterlab = {toml_str(pin)}")
    try:
        path, m = _load(tmp, text)
    except UserError as e:
        assert not ok, (pin, str(e))
        msg = str(e)
        assert "\n" not in msg and "stack.light.packages.jupyterlab" in msg and str(tmp) in msg, msg
        return
    assert ok, pin
    assert {c.pins["jupyterlab"] for c in m.cells if "jupyterlab" in c.pins} == {pin}


specs = st.one_of(
    st.lists(st.tuples(st.sampled_from(["==", "!=", ">=", "<=", ">", "<", "~=", "===", "=", "=>", ""]),
                       st.from_regex(r"[0-9]{1,2}(\.[0-9]{1,2}){0,2}(rc1|\.dev0|\.\*)?", fullmatch=True)),
             min_size=1, max_size=3).map(lambda cs: ",".join(op + v for op, v in cs)),
    st.text(max_size=12))


@SETTINGS
@given(spec=specs)
def test_a_facts_range_loads_exactly_when_packaging_reads_it(spec, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    try:
        parsed = SpecifierSet(spec)
    except InvalidSpecifier:
        parsed = None
    text = BASE_TEXT.replace(RANGE, f'"1.16.0" = {toml_str(spec)}')
    try:
        _load(tmp, text)
    except UserError as e:
        msg = str(e)
        assert "\n" not in msg
        if "holds a control character" in msg:  # refused before any range is read (builder/matrix/document.py)
            assert "facts.trl_vllm_extra.1.16.0" in msg and any(not ch.isprintable() for ch in spec), msg
        elif parsed is None:
            assert "facts.trl_vllm_extra.1.16.0: cannot read the version range" in msg, msg
        else:   # readable, but the stack's vllm pin is outside it: the rule says so, naming its reason
            assert not parsed.contains("0.31.0") and "violates rule 'trl-vllm-extra'" in msg, msg
        return
    assert parsed is not None and parsed.contains("0.31.0"), spec


@pytest.mark.parametrize("value", ["banana", "4.6", "==4.6.6"])
def test_bad_pin_through_build_py(tmp_path, value):
    """The issue's case end to end: one line naming the file, the key and the fix; exit 2; nothing rendered."""
    bad = tmp_path / "m.toml"
    bad.write_text(BASE_TEXT.replace(PIN, f"jupyterlab = {toml_str(value)}"))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "build.py"), "--matrix", str(bad), "--dry-run", "-q",
                        "--output-dir", str(out)], capture_output=True, text=True, cwd=ROOT)
    if value == "4.6":   # a valid version: loads, and the image record carries it
        assert r.returncode == 0, r.stderr
        record = json.loads((out / "images/smoke-x86_64/image.json").read_text())
        assert record["versions"]["jupyterlab"] == "4.6"
        return
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and f"{bad}: stack.light.packages.jupyterlab:" in lines[0], r.stderr
    assert "PEP 440" in lines[0] or "exact version" in lines[0]
    assert not out.exists()
