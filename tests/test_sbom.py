"""builder.sbom (sbomgen, referrers) on the real smoke image: the SBOM lists exactly what `pip list` and `dpkg -l`
report inside it, every locked package carries the lock's hashes, it is attached in the local registry (OCI referrer,
tag-schema fallback) and read back equal; the session's .sqsh has its checksum and SBOM beside it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import pytest
from packaging.utils import canonicalize_name

from builder import referrers, registry as reg_client, sbomgen
from builder.errors import UserError
from enginefix import BUILD_TIMEOUT, ROOT, docker, image_id

# a cold first build (debootstrap + the smoke image) runs inside the first test's setup
pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]


@pytest.fixture(scope="module")
def smoke_sbom(smoke_image, smoke_build):
    # the tag must still name the session's build: a test that built another image under it (a copy of the checkout
    # has revision "unknown") made this SBOM describe that image instead
    assert image_id(smoke_image) == smoke_build.image_id, f"{smoke_image} was moved off the session's smoke build"
    return sbomgen.generate(smoke_image)


def _components(doc: dict, kind: str) -> dict[str, dict]:
    return {c["name"]: c for c in doc["components"] if c.get("purl", "").startswith(f"pkg:{kind}/")}


def test_lists_exactly_what_pip_and_dpkg_report(smoke_sbom, smoke_image):
    pip = json.loads(docker("run", "--rm", "--entrypoint", "/opt/venv/bin/pip", smoke_image, "list",
                            "--format", "json", "--disable-pip-version-check").stdout)
    want_py = {(canonicalize_name(p["name"]), p["version"]) for p in pip}
    got_py = {(canonicalize_name(c["name"]), c["version"]) for c in _components(smoke_sbom, "pypi").values()}
    assert got_py == want_py
    assert len(want_py) > 100 and ("torch", "2.13.0+cpu") in got_py

    dpkg = docker("run", "--rm", "--entrypoint", "dpkg", smoke_image, "-l").stdout
    # "ii  libc6:amd64  2.36-9+deb12u10  amd64  GNU C Library..."; only installed ones ("rc": config files left)
    want_deb = {(f[1].split(":")[0], f[2]) for f in (ln.split() for ln in dpkg.splitlines()) if f and f[0] == "ii"}
    got_deb = {(c["name"], c["version"]) for c in _components(smoke_sbom, "deb").values()}
    assert got_deb == want_deb
    assert len(want_deb) > 50 and any(n == "libc6" for n, _ in got_deb)
    for c in _components(smoke_sbom, "deb").values():
        assert re.fullmatch(r"pkg:deb/debian/[^@]+@[^?]+\?arch=(amd64|all)&distro=debian-12(&upstream=.+)?", c["purl"])


def _lock_entries(path) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, hashes), read here independently of builder.sbomgen: one block per `name==version \\`."""
    out = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", path.read_text()):
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+)", block)
        if m:
            out[canonicalize_name(m.group(1))] = (m.group(2), set(re.findall(r"sha256:([0-9a-f]{64})", block)))
    return out


def test_every_locked_package_carries_the_lock_hash(smoke_sbom, smoke_build):
    from enginefix import smoke_cells

    cell = smoke_cells()["x86_64"]
    locked = _lock_entries(ROOT / cell.lock)
    assert len(locked) > 100
    py = {canonicalize_name(c["name"]): c for c in _components(smoke_sbom, "pypi").values()}
    for name, (version, hashes) in locked.items():
        assert name in py, f"{name} is locked but not in the image"
        assert py[name]["version"] == version
        assert {h["content"] for h in py[name]["hashes"] if h["alg"] == "SHA-256"} == hashes, name
    # the unlocked ones (pip itself) carry no hash
    assert all("hashes" not in c for n, c in py.items() if n not in locked)
    assert {"name": "trainbox:lock", "value": str(cell.lock)} in smoke_sbom["metadata"]["component"]["properties"]


def test_document_shape_and_metadata(smoke_sbom, smoke_image):
    assert smoke_sbom["bomFormat"] == "CycloneDX" and smoke_sbom["specVersion"] == "1.6"
    assert re.fullmatch(r"urn:uuid:[0-9a-f-]{36}", smoke_sbom["serialNumber"])
    labels = json.loads(docker("image", "inspect", "-f", "{{json .Config.Labels}}", smoke_image).stdout)
    props = {p["name"]: p["value"] for p in smoke_sbom["metadata"]["component"]["properties"]}
    for key in ("org.opencontainers.image.version", "org.opencontainers.image.revision", "io.trainbox.tag"):
        assert props[key] == labels[key]
    assert props["trainbox:platform"] == "linux/amd64"
    base = next(c for c in smoke_sbom["components"] if c.get("bom-ref") == "base-image")
    assert base["name"] == labels["org.opencontainers.image.base.name"]
    if labels.get("org.opencontainers.image.base.digest"):
        assert base["version"] == labels["org.opencontainers.image.base.digest"]
    refs = [c["bom-ref"] for c in smoke_sbom["components"]]
    assert len(refs) == len(set(refs))  # CycloneDX: bom-refs are unique
    assert sbomgen.dumps(sbomgen.generate(smoke_image)) == sbomgen.dumps(smoke_sbom)  # the same image, the same bytes


@pytest.fixture(scope="module")
def pushed_smoke(smoke_image, registry):
    ref = f"{registry}/trainbox-sbom-{uuid.uuid4().hex[:6]}:smoke-x86_64"
    docker("tag", smoke_image, ref)
    try:
        docker("push", ref, timeout=1800)
    finally:
        docker("rmi", ref)
    return ref


def _skopeo_raw(ref: str) -> tuple[dict, bytes]:
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"],
                         capture_output=True, check=True).stdout
    return json.loads(raw), raw


def test_attached_in_the_registry_and_read_back(smoke_sbom, pushed_smoke):
    import hashlib

    digest = referrers.attach(smoke_sbom, pushed_smoke)
    _, image_raw = _skopeo_raw(pushed_smoke)
    subject = "sha256:" + hashlib.sha256(image_raw).hexdigest()
    repo = pushed_smoke.rsplit(":", 1)[0]
    # read back by the subject's digest, and through the tag
    assert referrers.read_back(f"{repo}@{subject}") == [smoke_sbom]
    assert referrers.read_back(pushed_smoke) == [smoke_sbom]
    # what another client (skopeo) sees: the referrers tag schema index, then the artifact manifest
    index, _ = _skopeo_raw(f"{repo}:sha256-{subject.split(':')[1]}")
    assert [(m["digest"], m["artifactType"]) for m in index["manifests"]] == [(digest, sbomgen.MEDIA_TYPE)]
    art, _ = _skopeo_raw(f"{repo}@{digest}")
    assert art["artifactType"] == sbomgen.MEDIA_TYPE and art["subject"]["digest"] == subject
    # attaching the same SBOM again changes nothing
    assert referrers.attach(smoke_sbom, f"{repo}@{subject}") == digest
    assert len(_skopeo_raw(f"{repo}:sha256-{subject.split(':')[1]}")[0]["manifests"]) == 1


def test_attach_to_an_index_picks_the_platform_manifest(smoke_sbom, pushed_smoke):
    """An SBOM describes one platform: given a multi-arch index, the subject is that platform's manifest."""
    host, repo, tag = reg_client.split_ref(pushed_smoke)
    reg = reg_client.Registry(host, repo)
    body, media_type, digest = reg.manifest(tag)
    index = {"schemaVersion": 2, "mediaType": reg_client.OCI_INDEX, "manifests": [
        {"mediaType": media_type, "digest": digest, "size": len(body),
         "platform": {"os": "linux", "architecture": "amd64"}}]}
    reg.put_manifest("smoke-index", json.dumps(index).encode(), reg_client.OCI_INDEX)
    index_ref = f"{host}/{repo}:smoke-index"
    referrers.attach(smoke_sbom, index_ref)
    assert referrers.referrers(f"{host}/{repo}@{digest}") == referrers.referrers(index_ref, platform=("linux", "amd64"))
    with pytest.raises(UserError, match="no single"):
        referrers.attach({**smoke_sbom, "metadata": {"component": {"properties": [
            {"name": "trainbox:platform", "value": "linux/arm64"}]}}}, index_ref)


def test_cli_writes_and_attaches(smoke_image, smoke_sbom, pushed_smoke, tmp_path):
    out = tmp_path / "s.cdx.json"
    r = subprocess.run([sys.executable, "-m", "builder.sbom", smoke_image, "--output", str(out), "--attach",
                        pushed_smoke], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == sbomgen.dumps(smoke_sbom)
    assert r.stdout.startswith("attached sha256:")


@pytest.mark.parametrize("args, what", [
    (["trainbox-test/no-such-image:0"], "not in the local engine"),
    (["SMOKE", "--attach", "no-registry-here"], "not a registry image reference"),
    (["SMOKE", "--attach", "127.0.0.1:1/x:y"], "did not answer"),
    (["SMOKE", "--output", "/proc/x/s.json"], "cannot write there"),
])
def test_cli_bad_input_one_line_exit_2_nothing_written(smoke_image, tmp_path, args, what):
    args = [smoke_image if a == "SMOKE" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "builder.sbom", "--output", str(tmp_path / "s.json"), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and what in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_sqsh_has_its_checksum_and_sbom_beside_it(smoke_sqsh, smoke_build):
    """The session's .sqsh was exported from smoke_build.image_id (enginefix): its SBOM sidecar is that image's,
    compared with one generated here from the same ID (never from a tag, which names whatever was built last)."""
    sums = smoke_sqsh.with_name(smoke_sqsh.name + ".sha256")
    r = subprocess.run(["sha256sum", "-c", sums.name], cwd=smoke_sqsh.parent, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == f"{smoke_sqsh.name}: OK\n", r.stdout + r.stderr
    sidecar = smoke_sqsh.with_name(smoke_sqsh.name + ".cdx.json").read_text()
    props = {p["name"]: p["value"] for p in json.loads(sidecar)["metadata"]["component"]["properties"]}
    assert props["trainbox:image-id"] == smoke_build.image_id
    assert sidecar == sbomgen.dumps(sbomgen.generate(smoke_build.image_id))
