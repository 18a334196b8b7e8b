"""Fuzz `python -m builder.publish manifest|join` and `python -m builder.sbom --attach` (issue 29 item 2) against a
registry that answers from memory, or not at all: whatever the registry, the cell names and the reference, the
command exits 0 or 2, a refusal is one `error:` line, never a traceback, and no secret given in an argument is
printed. In-process, with the engine calls replaced (choose_builder, the SBOM's generate)."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from builder import publish, reference, referrers, registry, sbom, sbomgen
from builder.errors import UserError
from builder.matrix import load_matrix
from test_fuzz_cli import call  # noqa: E402  (the one in-process CLI runner of the tests)

SECRET = "s3cretZ"
EXAMPLES = int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MATRIX = load_matrix()
CELL_NAMES = sorted({c.name for c in MATRIX.cells} | {c.tag for c in MATRIX.cells})
HOSTILE = ["", " ", "-x", "--help", "a\nb", "$(id)", "é", "x" * 300, f"u:{SECRET}@h/x", f"https://u:{SECRET}@h/x",
           "@", ":", "/", "x@sha256:" + "a" * 64, "X:Y", "a b"]
registries = st.one_of(
    st.from_regex(reference.NAME, fullmatch=True).filter(lambda s: len(s) < 80),
    st.sampled_from(["127.0.0.1:5555/trainbox", "localhost:5000/a/b", "reg.example/Team", "[::1]:5000/x",
                     f"u:{SECRET}@127.0.0.1:5555/x", f"{SECRET}@127.0.0.1:5555/x", "127.0.0.1:5555/x@sha256:" + "b" * 64,
                     "127.0.0.1:5555/x:tag"]),
    st.builds(lambda a, b: a + b, st.sampled_from(HOSTILE), st.sampled_from(["", "/x", "127.0.0.1:5555/x"])),
    st.text(alphabet="abzAZ09._-/:@[] ", max_size=24))
names = st.lists(st.one_of(st.sampled_from(CELL_NAMES), st.sampled_from(HOSTILE)), min_size=1, max_size=3)
# what the registry does: answer with every arch, with some, or not at all
behaviours = st.sampled_from(["all", "x86_64 only", "none", "unreachable", "401"])


def check(rc, out, err):
    assert "Traceback" not in err, err
    assert rc in (0, 2), (rc, err)
    assert SECRET not in out + err, out + err
    if rc == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err


class Answers:
    """The registry's side, per behaviour: manifests by tag, or a UserError as the client raises it."""

    def __init__(self):
        self.behaviour = "all"
        self.lists: list = []

    def manifest(self, ref: str):
        host = ref.split("/", 1)[0]
        if self.behaviour == "unreachable":
            raise UserError(f"registry {host} did not answer: it is unreachable ([Errno 111] Connection refused)")
        if self.behaviour == "401":
            raise UserError(f"registry {host} wants credentials for x", fix=f"docker login {host}")
        tag = ref.rsplit(":", 1)[-1]
        if self.behaviour == "none" or (self.behaviour == "x86_64 only" and not tag.endswith("x86_64")):
            return None
        return {}, "sha256:" + hashlib.sha256(tag.encode()).hexdigest()


@pytest.fixture
def answers(monkeypatch):
    a = Answers()
    monkeypatch.setattr(publish, "registry_manifest", a.manifest)
    monkeypatch.setattr(publish, "choose_builder", lambda *x: None)

    def make(ref, results, arches, builder):   # the real check of the arches, then no engine call
        by_arch = {r.platform.split("/")[1] for r in results}
        missing = [x for x in arches if x not in by_arch]
        if missing:
            raise UserError(f"manifest list {ref}: no pushed image for {', '.join(missing)}")
        a.lists.append((ref, sorted(arches)))
        return "sha256:" + "0" * 64

    monkeypatch.setattr(publish, "publish_manifest_list", make)
    return a


@SETTINGS
@given(cmd=st.sampled_from(["manifest", "join"]), reg=registries, cells=names, behaviour=behaviours)
@example(cmd="manifest", reg="127.0.0.1:5555/t", cells=["smoke-x86_64"], behaviour="all")
@example(cmd="join", reg=f"u:{SECRET}@127.0.0.1:5555/x", cells=["smoke"], behaviour="all")
def test_publish(answers, cmd, reg, cells, behaviour):
    answers.behaviour, answers.lists = behaviour, []
    cells = ["x" + c if c.startswith("-") else c for c in cells]
    reg = "x" + reg if reg.startswith("-") else reg
    rc, out, err = call(publish.main, cmd, "--registry", reg, *cells)
    check(rc, out, err)
    # a list always holds every arch its cell has in the matrix: never a one-arch list of a two-arch cell
    for ref, arches in answers.lists:
        name = ref.rsplit(":", 1)[1]
        assert len(arches) == len([c for c in MATRIX.cells if c.name == name]), (ref, arches)


attach_refs = st.one_of(
    st.sampled_from(["127.0.0.1:5555/trainbox:smoke-x86_64", "127.0.0.1:5555/trainbox:smoke-aarch64",
                     "127.0.0.1:5555/trainbox:other", "127.0.0.1:5555/trainbox@sha256:" + "b" * 64, "foo",
                     f"u:{SECRET}@127.0.0.1:5555/x:y", "127.0.0.1:5555/x@sha256:abc", "localhost/x"]),
    st.builds(lambda a, b: a + b, st.sampled_from(HOSTILE), st.sampled_from(["", ":t", "/x:t", "@sha256:" + "c" * 64])),
    st.text(alphabet="abzAZ09._-/:@[] ", max_size=24))


class MemoryRegistry:
    """Registry over a dict: two pushed images (amd64, arm64); `behaviour` can make it unreachable."""
    behaviour = "all"

    def __init__(self, host, repo):
        self.host, self.repo = host, repo
        self.base = f"http://{host}/v2/{repo}"
        self.images = {}
        for tag, arch in (("smoke-x86_64", "amd64"), ("smoke-aarch64", "arm64")):
            cfg = json.dumps({"os": "linux", "architecture": arch}).encode()
            MemoryRegistry.blobs["sha256:" + hashlib.sha256(cfg).hexdigest()] = cfg
            self.images[tag] = json.dumps({"config": {"digest": "sha256:" + hashlib.sha256(cfg).hexdigest()}}).encode()

    blobs: dict = {}

    def _gate(self):
        if self.behaviour == "unreachable":
            raise UserError(f"registry {self.host} did not answer: it is unreachable ([Errno 111] Connection refused)")

    def manifest(self, ref):
        self._gate()
        for tag, body in self.images.items():
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            if ref in (tag, digest):
                return body, registry.OCI_MANIFEST, digest
        return None

    def blob(self, digest):
        self._gate()
        return self.blobs[digest]

    def put_blob(self, data):
        self._gate()
        return {"digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}

    def put_manifest(self, ref, body, media_type):
        self._gate()
        return type("R", (), {"headers": {"OCI-Subject": "1"}})()


@SETTINGS
@given(ref=attach_refs, unreachable=st.booleans())
@example(ref="127.0.0.1:5555/trainbox:smoke-aarch64", unreachable=False)
@example(ref="127.0.0.1:5555/trainbox@sha256:" + "b" * 64, unreachable=False)
@example(ref="foo", unreachable=False)
def test_sbom_attach(monkeypatch, tmp_path_factory, ref, unreachable):
    amd64 = json.dumps({"os": "linux", "architecture": "amd64"}).encode()
    doc = {"metadata": {"component": {"properties": [
        {"name": "trainbox:image-id", "value": "sha256:" + hashlib.sha256(amd64).hexdigest()},
        {"name": "trainbox:platform", "value": "linux/amd64"}]}}}
    monkeypatch.setattr(sbomgen, "generate", lambda *a, **k: doc)
    monkeypatch.setattr(referrers, "Registry", MemoryRegistry)
    MemoryRegistry.behaviour = "unreachable" if unreachable else "all"
    out = tmp_path_factory.mktemp("attach") / "s.json"
    ref = "x" + ref if ref.startswith("-") else ref
    rc, stdout, err = call(sbom.main, "trainbox:smoke-x86_64", "--output", str(out), "--attach", ref)
    check(rc, stdout, err)
    assert out.exists() == (rc == 0)   # a refused attach writes nothing
    if rc == 0:   # only the amd64 image takes the amd64 SBOM
        assert ref.endswith(":smoke-x86_64") or ref.endswith(hashlib.sha256(
            MemoryRegistry("h", "r").images["smoke-x86_64"]).hexdigest()), ref
