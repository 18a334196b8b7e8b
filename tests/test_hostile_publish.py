"""Issue 29's hostile cases on the release path's own commands (build.py modes, builder.enroot, builder.publish,
builder.sbom): one line, exit 2, nothing written, before any engine or registry work; messages that are right and
never print a secret. No engine needed: the engine and registry calls are replaced by recorders or fakes."""
from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest

from builder import cli, enroot, publish, referrers, sbom, sbomgen
from builder.errors import UserError
from test_fuzz_cli import call  # noqa: E402  (the one in-process CLI runner of the tests)

SECRET = "s3cretZ"


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


# ------------------------------------------------------------------ a registry that answers from memory
class FakeRegistry:
    """builder.registry.Registry's calls over dicts: {repo: {tag or digest: (bytes, media type)}}, blobs by digest."""
    store: dict = {}
    blobs: dict = {}
    writes: list = []

    def __init__(self, host, repo):
        self.host, self.repo = host, repo

    def manifest(self, ref):
        for tag, (body, media_type) in self.store.get(self.repo, {}).items():
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            if ref in (tag, digest):
                return body, media_type, digest
        return None

    def blob(self, digest):
        return self.blobs[digest]

    def put_blob(self, data):
        self.writes.append(("blob", len(data)))
        return {"digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}

    def put_manifest(self, ref, body, media_type):
        self.writes.append(("manifest", ref))

        class R:
            headers = {"OCI-Subject": "yes"}
        return R()


def image(arch: str, marker: str = "") -> tuple[bytes, str]:
    """A pushed image manifest whose config says ARCH; returns (manifest bytes, config digest)."""
    cfg = json.dumps({"os": "linux", "architecture": arch, "marker": marker}).encode()
    digest = "sha256:" + hashlib.sha256(cfg).hexdigest()
    FakeRegistry.blobs[digest] = cfg
    return json.dumps({"schemaVersion": 2, "config": {"digest": digest}, "layers": []}).encode(), digest


@pytest.fixture
def fake_registry(monkeypatch):
    FakeRegistry.store, FakeRegistry.blobs, FakeRegistry.writes = {}, {}, []
    monkeypatch.setattr(referrers, "Registry", FakeRegistry)
    return FakeRegistry


def sbom_of(arch: str, image_id: str) -> dict:
    return {"metadata": {"timestamp": "2026-01-01T00:00:00Z", "component": {"properties": [
        {"name": "trainbox:image-id", "value": image_id}, {"name": "trainbox:platform", "value": f"linux/{arch}"}]}}}


# ------------------------------------------------------------------ case 11: sbom --attach to another arch's image
def test_attach_refuses_an_image_of_another_arch(fake_registry):
    amd_body, amd_id = image("amd64")
    arm_body, _ = image("arm64")
    fake_registry.store["trainbox"] = {"smoke-x86_64": (amd_body, "application/vnd.oci.image.manifest.v1+json"),
                                       "smoke-aarch64": (arm_body, "application/vnd.oci.image.manifest.v1+json")}
    with pytest.raises(UserError, match="is a linux/arm64 image, the SBOM describes a linux/amd64 one"):
        referrers.attach(sbom_of("amd64", amd_id), "127.0.0.1:5555/trainbox:smoke-aarch64")
    assert fake_registry.writes == []   # nothing pushed
    assert referrers.attach(sbom_of("amd64", amd_id), "127.0.0.1:5555/trainbox:smoke-x86_64").startswith("sha256:")
    assert fake_registry.writes   # the right image gets its SBOM


def test_attach_refuses_another_image_of_the_same_arch(fake_registry):
    body, _ = image("amd64", marker="pushed last week")
    _, local_id = image("amd64", marker="rebuilt here since")
    fake_registry.store["trainbox"] = {"smoke-x86_64": (body, "application/vnd.oci.image.manifest.v1+json")}
    with pytest.raises(UserError, match="is another image"):
        referrers.attach(sbom_of("amd64", local_id), "127.0.0.1:5555/trainbox:smoke-x86_64")
    assert fake_registry.writes == []


# ------------------------------------------------------------------ case 20: messages right, no secret printed
def test_registry_with_user_info_is_named_as_such_and_masked():
    rc, out, err = call(publish.main, "manifest", "--registry", f"user:{SECRET}@host/x", "smoke")
    line = one_error(err)
    assert rc == 2 and SECRET not in out + err
    assert "'***@host/x'" in line and "user-info" in line and "names a digest" not in line, line


def test_attach_help_text_is_not_masked(monkeypatch):
    monkeypatch.setattr(sbomgen, "generate", lambda *a, **k: pytest.fail("no work before the input is checked"))
    for ref, why in (("foo", "names no registry host"), (f"u:{SECRET}@127.0.0.1:1/x:y", "user-info")):
        rc, out, err = call(sbom.main, "trainbox:smoke-x86_64", "--output", "/tmp/unused.json", "--attach", ref)
        line = one_error(err)
        assert rc == 2 and SECRET not in out + err and why in line, line
        assert "REGISTRY/REPO@sha256:DIGEST" in line, line


def test_a_digest_reference_is_echoed_as_given(fake_registry):
    ref = "127.0.0.1:5555/trainbox@sha256:" + "b" * 64
    with pytest.raises(UserError) as e:
        referrers.attach(sbom_of("amd64", "sha256:" + "c" * 64), ref)
    assert f"{ref} is not in the registry" in str(e.value), e.value


# ------------------------------------------------------------------ case 10: an unreachable registry says so
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]   # closed again when the block ends: nothing listens there


def test_publish_says_the_registry_is_unreachable(monkeypatch):
    monkeypatch.setattr(publish, "choose_builder", lambda *a: None)
    rc, out, err = call(publish.main, "manifest", "--registry", f"127.0.0.1:{closed_port()}/x", "smoke")
    line = one_error(err)
    assert rc == 2 and "did not answer: it is unreachable" in line and "no pushed image" not in line, line


# ------------------------------------------------------------------ case 9: a tag of one arch keeps the whole list
@pytest.fixture
def pushed(monkeypatch):
    """publish with both smoke arches (or only those in `have`) in the registry; lists recorded, not made."""
    state = {"have": {"smoke-x86_64", "smoke-aarch64"}, "lists": []}

    def manifest(ref):
        tag = ref.rsplit(":", 1)[1]
        return ({}, "sha256:" + hashlib.sha256(tag.encode()).hexdigest()) if tag in state["have"] else None

    monkeypatch.setattr(publish, "registry_manifest", manifest)
    monkeypatch.setattr(publish, "choose_builder", lambda *a: None)
    return state


@pytest.mark.parametrize("cmd", ["manifest", "join"])
def test_a_tag_joins_every_arch_of_its_cell(pushed, monkeypatch, cmd):
    def make(ref, results, arches, builder):
        pushed["lists"].append((ref, sorted(arches), sorted(r.tag for r in results)))
        return "sha256:" + "0" * 64
    monkeypatch.setattr(publish, "publish_manifest_list", make)
    rc, out, err = call(publish.main, cmd, "--registry", "127.0.0.1:5555/t", "smoke-x86_64")
    assert rc == 0, err
    assert pushed["lists"] == [("127.0.0.1:5555/t:smoke", ["amd64", "arm64"], ["smoke-aarch64", "smoke-x86_64"])]


def test_a_tag_whose_other_arch_is_missing_publishes_nothing(pushed):
    pushed["have"] = {"smoke-x86_64"}
    rc, out, err = call(publish.main, "manifest", "--registry", "127.0.0.1:5555/t", "smoke-x86_64")
    assert rc == 2 and out == "" and "no pushed image for arm64" in one_error(err), err
