"""Fuzz the input paths that came with the registry cache, publishing, pins, SBOMs and the bases lock: build.py
--cache-from/--cache-to, `python -m builder.publish manifest|join`, `python -m builder.pins` over a matrix's
[stack]/[flavour]/[facts], `python -m builder.sbom` and the .sqsh name its sidecars are named after, locks/bases.toml,
and [flavour.NAME] sdists/files/cmd/remove with hostile strings. Whatever the input: accepted, or exit 2 with one
`error:` line (what, where, how to fix), no traceback, no secret printed, nothing half-written, and nothing asked of a
registry or an index before the input is known good. Fuzzed in-process (the commands' main() with their registry,
engine and pip calls replaced by recorders); a handful of examples run the real commands."""
from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from packaging.requirements import Requirement

from builder import bases, cli, enroot, pins, publish, reference, referrers, registry, sbom, sbomgen
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.matrix.grammar import PACKAGE
from builder.paths import ROOT
from common import atomic
from test_fuzz_inputs import toml_str
from test_fuzz_matrix import mutate, paths  # the matrix fuzzer's document mutations

EXAMPLES = int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "60"))   # the whole file: about 40 s on 2 busy cores
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW = settings(SETTINGS, max_examples=max(10, EXAMPLES // 2))   # examples that write (and fsync) real files
TAG = "smoke-x86_64"
SECRET = "s3cretZ"
NOWHERE = {"DOCKER_HOST": "unix:///nonexistent/trainbox-fuzz.sock"}
MATRIX = load_matrix()
CELL_NAMES = sorted({c.name for c in MATRIX.cells} | {c.tag for c in MATRIX.cells})


def call(main, *argv: str) -> tuple[int, str, str]:
    """MAIN(argv) in this process: (exit code, stdout, stderr); argparse's own exit counts as its code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def one_error(stderr: str, start: str = "error: ") -> str:
    """The one line a refused input prints (what, where, how to fix), no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), stderr
    return lines[0]


def run(*argv: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, **NOWHERE, **(env or {})}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, datetime.date):
        return v.isoformat()
    if isinstance(v, str):
        return toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{ " + ", ".join(f"{toml_str(k)} = {toml_value(x)}" for k, x in v.items()) + " }"


def toml_doc(doc: dict, sections: tuple = ()) -> str:
    """DOC as TOML: each top-level key on one line (tables inline), except SECTIONS, written as [SECTION] tables
    whose keys are one-line inline tables (how matrix.toml writes [facts], which builder.pins rewrites in place)."""
    lines = [f"{toml_str(k)} = {toml_value(v)}" for k, v in doc.items()
             if not (k in sections and isinstance(v, dict))]
    for k in sections:
        if isinstance(doc.get(k), dict):
            lines += ["", f"[{toml_str(k)}]"] + [f"{toml_str(n)} = {toml_value(v)}" for n, v in doc[k].items()]
    return "\n".join(lines) + "\n"


HOSTILE = ["../../etc", "/etc/passwd", "images/../../etc", "a\nb", "a\rb", "x\u2028y", "$(id)", "`id`", "a;rm -rf /",
           "a b", "'", '"', "\\", "-rf", "--index-url=http://127.0.0.1:9/x", "", " ", "é", "ñame", "日本", "~/x",
           "*",
           "a|b", "a&&b", "${HOME}", "%s", "{name}", "\x00", "\t", "images/notebooks/unsloth/", "/", ".", "..",
           f"https://u:{SECRET}@127.0.0.1:9/x", "a" * 300]
hostile = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=16),
                    st.builds(lambda a, b: a + b, st.sampled_from(HOSTILE), st.sampled_from(HOSTILE)))
scalars = st.one_of(hostile, st.integers(-3, 20), st.booleans(), st.floats(allow_nan=False, allow_infinity=False),
                    st.just(datetime.date(2026, 11, 21)),
                    st.sampled_from(["2.13.0", "0.31.0", ">=0.22.0,<=0.31.0", "banana", "1.0-1", ">=1,<2", "==1.0"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


# --------------------------------------------------------------------------------- build.py --cache-from/--cache-to
def buildkit_cache_spec(spec: str, writes: bool) -> bool:
    """The oracle: BuildKit's cache syntax as build.py documents it. A bare image reference (type=registry), or
    type=TYPE,KEY=VALUE,... with lower-case keys, each once; registry needs ref=IMAGE, local src= (read) or dest=
    (write); inline only writes; mode is min or max. Printable ASCII, no white space or quotes (buildx reads the
    value as CSV: a quote would change what it means)."""
    if not spec or re.search(r"[^\x21-\x7e]|[\"'\\]", spec):
        return False
    if "=" not in spec:
        return bool(reference.REFERENCE.fullmatch(spec))
    fields = [f.partition("=") for f in spec.split(",")]
    if any(not sep or not re.fullmatch(r"[a-z][a-z0-9_-]*", k) or not v for k, sep, v in fields):
        return False
    d = {k: v for k, _, v in fields}
    if len(d) != len(fields):
        return False
    kinds = {"registry", "local", "gha", "s3", "azblob"} | ({"inline"} if writes else set())
    return (d.get("type") in kinds
            and (d["type"] != "registry" or bool(reference.REFERENCE.fullmatch(d.get("ref", ""))))
            and (d["type"] != "local" or bool(d.get("dest" if writes else "src")))
            and d.get("mode", "min") in ("min", "max"))


refs = st.from_regex(reference.REFERENCE, fullmatch=True).filter(lambda s: len(s) < 90)
FIELDS = ["mode=max", "mode=min", "mode=huge", "image-manifest=true", "oci-mediatypes=true", "src=/tmp/c",
          "dest=/tmp/c", "ignore-error=true", "region=r", "bucket=b", "x", "=v", "k=", "Mode=max", "ref=a", "type=s3",
          f"secret_access_key={SECRET}", f"session_token={SECRET}", "access_key_id=AKIA"]
cache_specs = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.sampled_from(list("type=registryreflocalsrcdest,:/@._-0 \"'\\\n")), max_size=40),
    refs,
    st.builds(lambda kind, ref, extra: ",".join([f"type={kind}", *([f"ref={ref}"] if ref is not None else []),
                                                 *extra]),
              st.sampled_from(["registry", "local", "inline", "gha", "s3", "azblob", "", "Registry", "bogus"]),
              st.one_of(st.none(), refs, st.text(max_size=12), st.sampled_from([f"u:{SECRET}@127.0.0.1:5555/c",
                                                                                 "HTTP://127.0.0.1:5555/c"])),
              st.lists(st.sampled_from(FIELDS), max_size=3)),
    st.sampled_from(["type=registry,ref=127.0.0.1:5555/trainbox-cache:cu130-x86_64-gpu",
                     "type=registry,ref=127.0.0.1:5555/trainbox-cache:v,mode=max,image-manifest=true",
                     "127.0.0.1:5555/trainbox-cache:v", "type=gha", "type=local,src=/tmp/cache", "", ",", "type=",
                     "type=registry", "type=registry,ref=", "type=registry,,ref=x", f"https://u:{SECRET}@h/c"]))


@SETTINGS
@given(spec=cache_specs, flag=st.sampled_from(["--cache-from", "--cache-to"]))
@example(spec="type=registry,ref=127.0.0.1:5555/trainbox-cache:v,mode=max", flag="--cache-to")
@example(spec="type=registry,ref=a b", flag="--cache-from")
@example(spec="type=inline", flag="--cache-from")
def test_cache_spec_is_accepted_exactly_when_buildkit_syntax(spec, flag):
    want = buildkit_cache_spec(spec, flag == "--cache-to")
    if spec.startswith("-"):
        spec = "x" + spec   # argparse would read it as a flag, not the value
        want = buildkit_cache_spec(spec, flag == "--cache-to")
    rc, out, err = call(cli.main, TAG, "--list", flag, spec)
    if want:
        assert rc == 0 and out.startswith(f"{TAG} ") and err == "", (spec, err)
        return
    assert rc == 2 and out == "", (spec, rc, out, err)
    line = one_error(err, f"error: {flag} ")
    assert f"(e.g. {flag} type=registry,ref=" in line, line   # how to fix it
    assert SECRET not in line, line


@SETTINGS
@given(head=cache_specs, key=st.sampled_from(["secret_access_key", "session_token", "token", "Password", "api_key"]),
       tail=st.sampled_from(["", ",mode=huge", ",x", " y", ",mode=max"]), flag=st.sampled_from(["--cache-from",
                                                                                             "--cache-to"]))
def test_a_secret_in_a_cache_spec_is_never_printed(head, key, tail, flag):
    spec = f"x{head},{key}={SECRET}{tail}"
    rc, out, err = call(cli.main, TAG, "--list", flag, spec)
    assert rc in (0, 2) and "Traceback" not in err
    assert SECRET not in out + err, out + err
    if rc == 2:
        one_error(err, f"error: {flag} ")


def _has_buildx() -> bool:
    from builder import docker

    try:
        return docker.choose_builder("auto").kind == "buildx"
    except UserError:
        return False


@pytest.mark.parametrize("args, ok", [
    (["--cache-from", "type=registry,ref=127.0.0.1:5555/trainbox-cache:smoke",
      "--cache-to", f"type=s3,region=r,bucket=b,secret_access_key={SECRET},mode=max"], True),
    (["--cache-from", "type=registry,ref=127.0.0.1:5555/Trainbox-Cache:smoke"], False),
    (["--cache-to", f"type=s3,region=r,bucket=b,secret_access_key={SECRET},mode=sometimes"], False),
    (["--cache-from", f"type=registry,ref=https://u:{SECRET}@127.0.0.1:5555/c"], False),
])
def test_cache_spec_through_build_py(tmp_path, args, ok):
    """As a user runs it: an accepted spec renders and plans (the plan never shows it); a refused one stops with one
    line before anything is rendered, and neither prints the secret."""
    out = tmp_path / "out"
    r = run("build.py", TAG, "--dry-run", "--output-dir", str(out), *args)
    assert SECRET not in r.stdout + r.stderr and "Traceback" not in r.stderr
    if ok and _has_buildx():
        assert r.returncode == 0 and "build plan: 1 image(s)" in r.stdout, r.stderr
        return
    assert r.returncode == 2 and r.stdout == "", r.stderr
    if ok:  # a valid spec, and no buildx here: the dry run refuses it as the build would (options.check_buildable)
        assert "need buildx" in one_error(r.stderr, "error: --cache-from/--cache-to need buildx")
    else:
        assert "(e.g. --cache-" in one_error(r.stderr, "error: --cache-")
    assert not out.exists()


# --------------------------------------------------------------------------- python -m builder.publish manifest|join
registries = st.one_of(
    st.from_regex(reference.NAME, fullmatch=True).filter(lambda s: len(s) < 80),
    st.text(alphabet="abzAZ09._-/:@[] ", max_size=24),
    st.sampled_from(["127.0.0.1:5555/trainbox", "127.0.0.1:1/x", "localhost/a__b-c.d", "[::1]:5000/x", "reg/Team",
                     "http://127.0.0.1:5555/x", "127.0.0.1:5555", "127.0.0.1:5555/x:tag", "x@sha256:" + "a" * 64,
                     f"u:{SECRET}@127.0.0.1:5555/x", "", "a" * 300]))
cell_args = st.lists(st.one_of(st.sampled_from(CELL_NAMES), hostile), min_size=1, max_size=3)


@pytest.fixture
def no_registry(monkeypatch):
    """publish's engine and registry calls replaced by a recorder: what the command would have asked."""
    asked: list = []
    monkeypatch.setattr(publish, "choose_builder", lambda *a: asked.append(("builder", a)))
    monkeypatch.setattr(publish, "registry_manifest", lambda ref: asked.append(("registry", ref)))
    monkeypatch.setattr(publish, "publish_manifest_list",
                        lambda ref, *a: asked.append(("list", ref)) or "sha256:" + "0" * 64)
    return asked


@SETTINGS
@given(cmd=st.sampled_from(["manifest", "join"]), registry=registries, cells=cell_args)
@example(cmd="manifest", registry="127.0.0.1:5555/trainbox", cells=["smoke", "no-such-cell"])
def test_publish_asks_nothing_until_registry_and_cells_are_known_good(no_registry, cmd, registry, cells):
    registry = "x" + registry if registry.startswith("-") else registry
    cells = ["x" + c if c.startswith("-") else c for c in cells]
    no_registry.clear()
    rc, out, err = call(publish.main, cmd, "--registry", registry, *cells)
    good = reference.is_name(registry) and len(registry) <= reference.NAME_MAX and all(c in CELL_NAMES for c in cells)
    assert SECRET not in out + err
    if good:
        assert rc == 0 and err == "" and any(a[0] == "list" for a in no_registry), (registry, cells, err)
        return
    assert rc == 2 and out == "" and no_registry == [], (registry, cells, no_registry, err)
    line = one_error(err)
    assert ("--registry" in line and "e.g. --registry" in line) or ("no cell named" in line and "--list" in line), line


@pytest.fixture
def fake_skopeo(tmp_path):
    """A skopeo on PATH that logs each call and answers 'no such manifest' (as for a registry that is not running)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "skopeo.log"
    bin_dir.mkdir()
    (bin_dir / "skopeo").write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "connection refused" >&2\nexit 1\n')
    (bin_dir / "skopeo").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


@pytest.mark.parametrize("args, valid", [
    (["manifest", "--registry", "127.0.0.1:1/trainbox", "smoke"], True),
    (["join", "--registry", "Not A Registry", "smoke"], False),
    (["manifest", "--registry", "127.0.0.1:1/trainbox", "smoke", "no-such-cell"], False),
    (["manifest", "--registry", f"https://u:{SECRET}@127.0.0.1:1/trainbox", "smoke"], False),
])
def test_publish_cli(fake_skopeo, args, valid):
    """The real command: bad input is one line, exit 2, before any registry call (skopeo logs every call); a valid
    one with no registry behind it fails in one line too, never with a traceback."""
    env, log = fake_skopeo
    r = run("-m", "builder.publish", *args, env=env)
    assert SECRET not in r.stdout + r.stderr
    if valid:
        assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, r.stderr
        if r.returncode:
            one_error(r.stderr)
        return
    assert r.returncode == 2 and r.stdout == "", r.stderr
    one_error(r.stderr)
    assert not log.exists(), log.read_text()


# ------------------------------------------------------------------------------------------ python -m builder.pins
PINS_BASE = {
    "stack": {n: {"packages": dict(t["packages"])} for n, t in MATRIX.data["stack"].items()},
    "flavour": {n: {"packages": dict(t["packages"]), "cells": list(t["cells"])}
                for n, t in MATRIX.data["flavour"].items()},
    "facts": copy.deepcopy(MATRIX.data["facts"]),
    "extras": copy.deepcopy(MATRIX.data["extras"]),   # pins reads these beside [facts] (matrix.toml's one home)
    "rule": copy.deepcopy(MATRIX.data["rule"]),
}
PINS_PATHS = paths(PINS_BASE)
pins_mutations = st.lists(st.tuples(st.sampled_from(PINS_PATHS), st.sampled_from(["set", "delete", "add"]), values,
                                    st.one_of(hostile, st.sampled_from(["version", "torch", "vllm_torch", "unsloth"]))),
                          min_size=1, max_size=3)


@pytest.fixture
def fake_index(monkeypatch):
    """pins.query replaced: every requirement must be one PEP 508 requirement (nothing pip could read as an option);
    then it answers like an index that has each release asked for (newest: 99.0), or like one that is unreachable."""
    state = {"reachable": True, "asked": []}

    def query(requirements, python=sys.executable):
        for r in requirements:
            assert not r.startswith("-") and Requirement(r).name, r
        state["asked"] += requirements
        if not state["reachable"]:
            raise UserError(f"cannot reach the package index {' '.join(requirements)[:200]}: connection refused",
                            fix="check that pip reaches its index")
        out = {}
        for r in map(Requirement, requirements):
            exact = [s.version for s in r.specifier if s.operator == "=="]
            out[pins.canonicalize_name(r.name)] = pins.Dist(r.name, exact[0] if exact else "99.0")
        return out

    monkeypatch.setattr(pins, "query", query)
    return state


@SETTINGS
@given(mutations=pins_mutations, reachable=st.booleans(), write=st.booleans())
def test_pins_on_a_mutated_matrix(fake_index, tmp_path_factory, mutations, reachable, write):
    path = tmp_path_factory.mktemp("pins") / "matrix.toml"
    path.write_text(toml_doc(mutate(PINS_BASE, mutations), sections=("facts",)))
    before = path.read_bytes()
    fake_index.update(reachable=reachable, asked=[])
    rc, out, err = call(pins.main, "--matrix", str(path), *(["--write"] if write else []))
    assert rc in (0, 2) and "Traceback" not in err, err
    if rc == 2:
        line = one_error(err)
        assert path.read_bytes() == before   # a refusal writes nothing
        if not fake_index["asked"]:          # refused before any index call: the input itself, named with its file
            assert str(path) in line, line
    else:
        assert reachable and err == "" and out.startswith("package")
        tomllib.loads(path.read_text())      # what --write left is still TOML


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 30),
                                st.text(alphabet=st.sampled_from(list('[]{}="\',.\n#abc019_-\\ <>=~!')), max_size=10)),
                      min_size=1, max_size=3))
def test_pins_on_mutated_text(fake_index, tmp_path_factory, edits):
    text = toml_doc(PINS_BASE, sections=("facts",))
    for pos, length, insert in edits:
        pos %= len(text)
        text = text[:pos] + insert + text[pos + length:]
    path = tmp_path_factory.mktemp("pins") / "matrix.toml"
    path.write_text(text)
    fake_index.update(reachable=False, asked=[])
    rc, out, err = call(pins.main, "--matrix", str(path))
    assert rc == 2 and out == "", err
    line = one_error(err)
    assert str(path) in line or fake_index["asked"], line


# pip asks a port nobody listens on, and nothing else (no config file, find-links or extra index)
PIP_OFFLINE = {"PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "1"}


@pytest.mark.parametrize("edit, asks_pip", [
    (None, True),
    (lambda d: d["stack"]["train"]["packages"].update({"--index-url=http://127.0.0.1:9/x": "1.0"}), False),
    (lambda d: d["facts"].update(vllm_torch={"0.31.0": "2.13.0; rm -rf /"}), False),
    (lambda d: d["flavour"]["verl"]["packages"].update(verl="0.9.1\n[stack.evil]"), False),
    (lambda d: d.update(facts=3), False),
])
def test_pins_cli_with_an_unreachable_index(tmp_path, edit, asks_pip):
    """The real command with pip pointed at a port nobody listens on: one error line, exit 2, matrix untouched."""
    doc = copy.deepcopy(PINS_BASE)
    if edit:
        edit(doc)
    path = tmp_path / "matrix.toml"
    path.write_text(toml_doc(doc, sections=("facts",)))
    before = path.read_bytes()
    r = run("-m", "builder.pins", "--matrix", str(path), "--write", env=PIP_OFFLINE, timeout=300)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    line = one_error(r.stderr)
    assert ("cannot reach the package index" in line) == asks_pip, line
    assert asks_pip or str(path) in line
    assert path.read_bytes() == before


def test_pins_never_prints_the_index_password(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(toml_doc(PINS_BASE, sections=("facts",)))
    r = run("-m", "builder.pins", "--matrix", str(path),
            env={**PIP_OFFLINE, "PIP_INDEX_URL": f"http://u:{SECRET}@127.0.0.1:9/simple"}, timeout=300)
    assert r.returncode == 2 and "cannot reach the package index" in one_error(r.stderr)
    assert SECRET not in r.stdout + r.stderr


# --------------------------------------------------------------- python -m builder.sbom, the .sqsh and its sidecars
names = st.one_of(st.text(alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
                          max_size=16),
                  st.sampled_from(["", ".", "..", "s.json", "-x", "a b.json", "x\n.json", "é.json", "exists",
                                   "a" * 200, "é" * 120, "a" * 300]))
images = st.one_of(refs, st.sampled_from(["--help", "-v", "trainbox:smoke-x86_64", "sha256:" + "a" * 64, "a b",
                                          "Trainbox:x", "", "x:" + "t" * 200, f"https://u:{SECRET}@h/x"]),
                   st.text(max_size=12))
attach_refs = st.one_of(st.none(), refs, st.sampled_from(["127.0.0.1:5555/trainbox:smoke-x86_64", "no-registry",
                                                          "127.0.0.1:5555/x@sha256:" + "b" * 64, "localhost/x",
                                                          f"u:{SECRET}@127.0.0.1:5555/x:y"]))


@pytest.fixture
def no_engine(monkeypatch):
    """sbom's engine and registry calls replaced by recorders."""
    asked: list = []
    monkeypatch.setattr(sbomgen, "generate", lambda image, *a, **k: asked.append(("generate", image)) or {"x": 1})
    monkeypatch.setattr(referrers, "attach", lambda doc, ref: asked.append(("attach", ref)) or "sha256:" + "c" * 64)
    return asked


def split_ok(ref: str) -> bool:
    try:
        registry.split_ref(ref)
    except UserError:
        return False
    return True


@SLOW
@given(image=images, name=names, attach=attach_refs)
@example(image="--help", name="s.json", attach=None)
@example(image="trainbox:smoke-x86_64", name="exists", attach=None)
def test_sbom_cli_checks_every_argument_before_any_work(no_engine, tmp_path_factory, image, name, attach):
    tmp = tmp_path_factory.mktemp("sbom")
    (tmp / "exists").mkdir()
    output = f"{tmp}/{name}"
    no_engine.clear()
    rc, out, err = call(sbom.main, "--output", output, *(["--attach", attach] if attach else []), "--", image)
    assert SECRET not in out + err
    good = (bool(reference.REFERENCE.fullmatch(image)) and name not in ("", ".", "..", "exists")
            and atomic.name_fits(output) and (attach is None or split_ok(attach)))
    if good:
        assert rc == 0, err
        assert json.loads(Path(output).read_text()) == {"x": 1}
        return
    assert rc == 2 and no_engine == [], (image, name, attach, no_engine, err)
    one_error(err)
    assert sorted(p.name for p in tmp.iterdir()) == ["exists"]   # nothing written


def test_sbom_cli_refuses_an_option_as_image_in_one_line(tmp_path):
    """`docker image inspect --help` prints help and exits 0: an image named like an option must never get there."""
    r = run("-m", "builder.sbom", "--output", str(tmp_path / "s.json"), "--", "--help")
    assert r.returncode == 2 and "is not an image reference" in one_error(r.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["build.py", TAG, "--list", "--output-dir", "/tmp/" + "a" * 300 + "/x"],
    ["build.py", TAG, "--list", "--report", "TMP/" + "a" * 250 + ".json"],
    ["build.py", TAG, "--list", "--sqsh", "TMP/" + "a" * 300],
    ["-m", "builder.sbom", "--output", "TMP/" + "a" * 300 + ".json", "x:1"],
    ["-m", "builder.enroot", "x:1", "TMP/new/" + "a" * 240 + ".sqsh"],
])
def test_overlong_paths_are_one_error_before_any_work(no_engine, tmp_path, argv):
    """A name the file system can't hold (ENAMETOOLONG; or only its temporary sibling can't) is refused at the start
    in one line, not as a traceback, nor after the work, and no folder is made."""
    no_engine.clear()
    main = {"build.py": cli.main, "builder.sbom": sbom.main, "builder.enroot": enroot.main}[argv[0] if argv[0] != "-m"
                                                                                         else argv[1]]
    args = [a.replace("TMP", str(tmp_path)) for a in argv[1 if argv[0] != "-m" else 2:]]
    rc, out, err = call(main, *args)
    assert rc == 2 and out == "" and no_engine == [], err
    one_error(err)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def fake_export(monkeypatch):
    """export_image's engine work replaced: the 'squashfs' is a few bytes, the SBOM a small document."""
    def export(image_ref, tmp_file, *a, **k):
        Path(tmp_file).write_bytes(b"hsqs" + image_ref.encode())

    monkeypatch.setattr(enroot, "_export_ours", export)
    monkeypatch.setattr(sbomgen, "generate", lambda image, *a, **k: {"image": image})


@SLOW
@given(name=names, suffix=st.sampled_from([".sqsh", ".sqsh", ".SQSH", ".sqsh.tmp", ""]), image=images,
       block=st.sampled_from([None, "1M", "3M", "abc"]))
@example(name="a\nb", suffix=".sqsh", image="x:1", block=None)
@example(name="ok", suffix=".sqsh", image="--help", block=None)
def test_sqsh_name_gives_sidecars_sha256sum_reads(fake_export, tmp_path_factory, name, suffix, image, block):
    """Whatever the .sqsh is called: refused before a folder is made, or written with X.sqsh.sha256 that
    `sha256sum -c` verifies and X.sqsh.cdx.json beside it."""
    tmp = tmp_path_factory.mktemp("sqsh")
    dest = tmp / "new" / f"{name}{suffix}"
    try:
        got = enroot.export_image(image, dest, block_size=block, progress=False, docker="/bin/true")
    except UserError as e:
        assert "\n" not in str(e)
        assert list(tmp.iterdir()) == [], (name, str(e))   # not even the destination folder
        return
    assert reference.REFERENCE.fullmatch(image) and block in (None, "1M")
    names_now = sorted(p.name for p in got.parent.iterdir())
    assert names_now == sorted([got.name, got.name + ".sha256", got.name + ".cdx.json"]), names_now
    assert json.loads(Path(f"{got}.cdx.json").read_text()) == {"image": image}
    want = hashlib.sha256(got.read_bytes()).hexdigest()
    assert Path(f"{got}.sha256").read_text() == f"{want}  {got.name}\n"
    r = subprocess.run(["sha256sum", "--status", "-c", got.name + ".sha256"], cwd=got.parent, capture_output=True)
    assert r.returncode == 0, (name, r.stderr)


# ------------------------------------------------------------------------------------------------ locks/bases.toml
BASES_TEXT = (ROOT / bases.PATH).read_text()
BASES = tomllib.loads(BASES_TEXT)
BASES_PATHS = paths(BASES)
DIGEST = "sha256:" + "d" * 64
base_values = st.one_of(values, st.sampled_from([DIGEST, "sha256:abc", "SHA256:" + "D" * 64, "",
                                                 {"linux/amd64": DIGEST}, {"linux/arm64": 5}, {}, "2026-11-25"]))


def read_bases(tmp: Path, raw: bytes):
    (tmp / "locks").mkdir(exist_ok=True)
    (tmp / bases.PATH).write_bytes(raw)
    try:
        return bases.read(tmp)
    except UserError as e:
        assert "\n" not in str(e) and str(tmp / bases.PATH) in str(e), str(e)
        return None


def check_loaded(tmp: Path, data: dict) -> None:
    """What read() accepted: every lookup is a digest or nothing, and --lock-bases writes it back as it read it."""
    for tag, entry in data.items():
        for platform in ("linux/amd64", "linux/arm64", *entry.get("platforms", {})):
            got = bases.digest_for(tag, platform, tmp)
            assert got is None or bases.DIGEST.fullmatch(got), (tag, platform, got)
    text = bases.render_lock(data)   # lock_bases writes every entry it read back with the new ones
    (tmp / bases.PATH).write_text(text)
    again = bases.read(tmp)

    def meaning(d):
        return {t: {k: v for k, v in e.items() if v} for t, e in d.items()}
    assert meaning(again) == meaning(data)


@SETTINGS
@given(mutations=st.lists(st.tuples(st.sampled_from(BASES_PATHS), st.sampled_from(["set", "delete", "add"]),
                                    base_values,
                                    st.one_of(hostile, st.sampled_from(["digest", "platforms", "locked"]))),
                          min_size=1, max_size=3))
def test_bases_lock_mutated(tmp_path_factory, mutations):
    tmp = tmp_path_factory.mktemp("bases")
    data = read_bases(tmp, toml_doc(mutate(BASES, mutations)).encode())
    if data is not None:
        check_loaded(tmp, data)


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, len(BASES_TEXT) - 1), st.integers(0, 30),
                                st.binary(max_size=8)
                                | st.text(alphabet=st.sampled_from(list('[]{}="\'.\n#:af09\x7f\\ ')),
                                          max_size=8).map(str.encode)),
                      min_size=1, max_size=3))
def test_bases_lock_mutated_bytes(tmp_path_factory, edits):
    raw = BASES_TEXT.encode()
    for pos, length, insert in edits:
        raw = raw[:pos] + insert + raw[pos + length:]
    tmp = tmp_path_factory.mktemp("bases")
    data = read_bases(tmp, raw)
    if data is not None:
        check_loaded(tmp, data)


def test_the_real_bases_lock_survives_the_harness(tmp_path):
    data = read_bases(tmp_path, BASES_TEXT.encode())
    assert data
    check_loaded(tmp_path, data)


# --------------------------------------------------------------------------- [flavour.NAME] with hostile strings
MATRIX_DOC = tomllib.loads((ROOT / "matrix.toml").read_text())
FLAVOURS = sorted(MATRIX_DOC["flavour"])
PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:=,+@-]+", re.ASCII)


def flavour_doc(fname: str, key: str, value: str, keep_valid: bool) -> dict:
    """The real matrix with flavour FNAME's KEY given the hostile VALUE (beside its valid entries if KEEP_VALID)."""
    doc = copy.deepcopy(MATRIX_DOC)
    t = doc["flavour"][fname]
    if key == "files.src":
        t["files"] = {**(t.get("files", {}) if keep_valid else {}), value: "/workspace/x"}
    elif key == "files.dest":
        t["files"] = {"images/notebooks": value}
    else:
        t[key] = [*(t.get(key, []) if keep_valid else []), value]
    return doc


@SETTINGS
@given(fname=st.sampled_from(FLAVOURS), key=st.sampled_from(["sdists", "files.src", "files.dest", "cmd", "remove"]),
       value=hostile, keep_valid=st.booleans())
@example(fname="unsloth", key="files.src", value="../../etc", keep_valid=False)
@example(fname="unsloth", key="files.src", value="a" * 300, keep_valid=False)   # ENAMETOOLONG from exists()
@example(fname="unsloth", key="files.dest", value="/workspace/a b", keep_valid=False)
@example(fname="verl", key="cmd", value="$(id)", keep_valid=True)
def test_flavour_hostile_strings(tmp_path_factory, fname, key, value, keep_valid):
    """One UserError naming flavour.FNAME.KEY, or a value that is safe where it goes: a plain word (CMD), a package
    name (sdists), a folder inside the repository and an absolute path (files), a pin of the base cell (remove)."""
    path = tmp_path_factory.mktemp("flavour") / "matrix.toml"
    path.write_text(toml_doc(flavour_doc(fname, key, value, keep_valid)))
    try:
        m = load_matrix(path)
    except UserError as e:
        msg = str(e)
        assert "\n" not in msg and str(path) in msg, msg
        assert f"flavour.{fname}.{key.split('.')[0]}" in msg, msg
        assert SECRET not in msg
        return
    cells = [c for c in m.cells if c.flavour == fname]
    assert cells
    for c in cells:
        if key == "cmd":
            assert all(PLAIN_WORD.fullmatch(w) for w in c.cmd), c.cmd
        elif key == "sdists":
            assert all(PACKAGE.fullmatch(p) for p in c.sdists), c.sdists
        elif key.startswith("files"):
            for src, dest in c.files:
                assert not src.startswith("/") and ".." not in src.split("/"), src
                assert (ROOT / src).resolve().is_relative_to(ROOT.resolve()) and (ROOT / src).exists(), src
                assert dest.startswith("/") and PLAIN_WORD.fullmatch(dest), dest
        else:   # remove: a pin of the base cell, gone from the flavour's pins unless the flavour pins it again
            name = pins.canonicalize_name(value)   # names compare as PEP 503 names
            assert name in c.base.pins, value
            own = {pins.canonicalize_name(p) for p in MATRIX_DOC["flavour"][fname]["packages"]}
            assert name not in c.pins or name in own, value


def test_the_real_matrix_survives_the_harness():
    assert load_matrix(ROOT / "matrix.toml").cells == MATRIX.cells
    m = tomllib.loads(toml_doc(MATRIX_DOC))
    assert m == MATRIX_DOC


@pytest.mark.parametrize("key, value", [("files.src", "../../etc"), ("cmd", "jupyter; curl x|sh"),
                                        ("sdists", "antlr4-python3-runtime\nRUN id")])
def test_hostile_flavour_through_build_py_writes_nothing(tmp_path, key, value):
    path, out = tmp_path / "matrix.toml", tmp_path / "out"
    path.write_text(toml_doc(flavour_doc("unsloth-stack", key, value, keep_valid=True)))
    r = run("build.py", "--matrix", str(path), "--output-dir", str(out), "--dry-run")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert f"flavour.unsloth-stack.{key.split('.')[0]}" in one_error(r.stderr)
    assert not out.exists()
