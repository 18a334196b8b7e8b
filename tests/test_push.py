"""Push through the real CLI: both arches of the smoke cell, a manifest list joining them (build.py, and
`python -m builder.publish manifest` for arches pushed by separate runs), digests that are the registry's own (sha256
of the bytes it serves); refusals (missing arch, failed push) publish no list; a trainbox-package-only change re-pushes
one layer."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.server
import json
import subprocess
import sys
import threading
import urllib.request
import uuid

import pytest

from builder import engine as eng, publish
from builder.errors import UserError
from builder.options import parse_bases
from enginefix import BUILD_TIMEOUT, ROOT, build_args, docker, secret_file, smoke_cells, torch_wheelhouse

# a cold first build (debootstrap + the session images, arm64 under QEMU) runs inside the first test's setup
pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]


def skopeo_raw(ref: str) -> dict | None:
    r = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"], capture_output=True,
                       text=True)
    return json.loads(r.stdout) if r.returncode == 0 else None


def skopeo_digest(ref: str) -> str:
    r = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}", f"docker://{ref}"],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


@pytest.fixture(scope="module")
def pushed(registry, smoke_build, smoke_arm64, test_base, tmp_path_factory):  # noqa: F811
    """`python build.py --cell smoke --push --registry REG/REPO ...` exactly as a user runs it (builds are cache
    hits after the session fixtures)."""
    repo = f"{registry}/trainbox-e2e-{uuid.uuid4().hex[:6]}"
    report = tmp_path_factory.mktemp("report") / "report.json"
    cell = smoke_cells()["x86_64"]
    cmd = [sys.executable, "build.py", "--cell", "smoke", "--push", "--registry", repo, "--report", str(report),
           "--base", f"{cell.base_image}={test_base}", "--wheelhouse", torch_wheelhouse(cell.requirement("torch")),
           "--secret", f"id=hf_token,src={secret_file()}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return {"repo": repo, "stdout": r.stdout, "report": json.loads(report.read_text())}


def test_cli_push_prints_digests_that_the_registry_serves(pushed):
    cells = {c["tag"]: c for c in pushed["report"]["cells"]}
    assert set(cells) == {"smoke-x86_64", "smoke-aarch64"}
    for tag, c in cells.items():
        assert c["digest"].startswith("sha256:") and c["digest"] in pushed["stdout"]
        assert skopeo_digest(f"{pushed['repo']}:{tag}") == c["digest"]
        for extra in smoke_cells()[c["arch"]].version_tags:  # the matrix's version tags name the same image
            assert skopeo_digest(f"{pushed['repo']}:{extra}") == c["digest"]
        assert c["layers"] > 0 and c["size"] > 0 and c["seconds"] >= 0
    assert "pushed MB" in pushed["stdout"]  # the table


def test_the_pushed_images_run_by_their_registry_name(pushed):
    """What getting-started.md tells a user after `make build`: with --registry the builds carry the registry's name
    only (REG/REPO:TAG), so that is the name to `docker run`; the bare REPO:TAG was never made."""
    ref = f"{pushed['repo']}:smoke-x86_64"
    for args in (["--help"], ["doctor"]):
        r = docker("run", "--rm", ref, *args, check=False)
        assert r.returncode == 0 and r.stdout.strip(), r.stdout + r.stderr
    bare = pushed["repo"].rsplit("/", 1)[1] + ":smoke-x86_64"
    assert docker("image", "inspect", bare, check=False).returncode != 0


def test_every_pushed_image_carries_its_sbom(pushed):
    """build.py --push attaches each image's SBOM (read from the image) as an OCI referrer of the pushed manifest."""
    from builder import referrers

    for c in pushed["report"]["cells"]:
        got = referrers.read_back(c["pushed_ref"])
        assert len(got) == 1, c["tag"]
        names = {comp["name"] for comp in got[0]["components"]}
        assert {"dpkg", "jupyterlab"} <= names   # an OS package and a locked Python package
        assert ("torch" in names) == (c["arch"] == "x86_64")   # the aarch64 smoke cell is the light stack
        assert f"SBOM attached: {pushed['repo']}@" in pushed["stdout"]


def test_manifest_list_joins_both_arches(pushed):
    lists = pushed["report"]["manifest_lists"]
    assert [x["ref"] for x in lists] == [f"{pushed['repo']}:smoke"]
    raw = skopeo_raw(f"{pushed['repo']}:smoke")
    assert raw["mediaType"] in publish.MANIFEST_LIST_TYPES
    by_arch = {m["platform"]["architecture"]: m["digest"] for m in raw["manifests"]}
    cells = {c["arch"]: c["digest"] for c in pushed["report"]["cells"]}
    assert by_arch == {"amd64": cells["x86_64"], "arm64": cells["aarch64"]}
    assert skopeo_digest(f"{pushed['repo']}:smoke") == lists[0]["digest"]
    # the engine resolves the list per platform
    arm = docker("manifest", "inspect", "--insecure", f"{pushed['repo']}:smoke").stdout
    assert cells["aarch64"] in arm


def _registry_says(ref: str) -> tuple[bytes, str]:
    """The manifest's bytes and the registry's own Docker-Content-Digest header for REF (plain HTTP: local registry)."""
    host, rest = ref.split("/", 1)
    repo, tag = rest.rsplit(":", 1)
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{tag}", headers={"Accept": ", ".join(
        [*publish.MANIFEST_LIST_TYPES, "application/vnd.docker.distribution.manifest.v2+json",
         "application/vnd.oci.image.manifest.v1+json"])})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read(), r.headers["Docker-Content-Digest"]


def test_digests_are_the_registrys_own(pushed):
    """publish.registry_manifest's digest is the one the registry names (sha256 of the bytes it serves), for an
    image manifest and for the list."""
    for tag in ("smoke-x86_64", "smoke-aarch64", "smoke"):
        ref = f"{pushed['repo']}:{tag}"
        body, header = _registry_says(ref)
        man, digest = publish.registry_manifest(ref)
        assert digest == header == "sha256:" + hashlib.sha256(body).hexdigest(), tag
        assert man == json.loads(body)


def test_publish_cli_joins_arches_pushed_by_separate_runs(pushed):
    """What the generated workflow's manifest job runs after one build job per arch: the list is made from what the
    registry holds; the same members give the same list digest as build.py's; `join` is the same command."""
    want = next(x["digest"] for x in pushed["report"]["manifest_lists"])
    for word in ("manifest", "join"):
        r = subprocess.run([sys.executable, "-m", "builder.publish", word, "--registry", pushed["repo"], "smoke"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert r.stdout.split() == [f"{pushed['repo']}:smoke@{want}"], r.stdout
    assert skopeo_digest(f"{pushed['repo']}:smoke") == want


def test_publish_cli_refuses_a_missing_arch(pushed):
    """A registry that has no image of the cell: exit 2, one line naming the missing arches, no list written."""
    repo = f"{pushed['repo']}-empty"
    r = subprocess.run([sys.executable, "-m", "builder.publish", "manifest", "--registry", repo, "smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and "no pushed image for amd64, arm64" in err[0], r.stderr
    assert skopeo_raw(f"{repo}:smoke") is None


def test_list_refused_when_an_arch_is_missing(pushed):
    x86 = next(c for c in pushed["report"]["cells"] if c["arch"] == "x86_64")
    res = eng.BuildResult(**{k: v for k, v in x86.items() if k in {f.name for f in dataclasses.fields(eng.BuildResult)}})
    ref = f"{pushed['repo']}:smoke-partial"
    with pytest.raises(UserError, match="no pushed image for arm64"):
        publish.publish_manifest_list(ref, [res], ["amd64", "arm64"], eng.choose_builder())
    assert skopeo_raw(ref) is None


def test_failed_push_publishes_no_list(pushed, smoke_build, registry):  # noqa: F811
    # an arm64 "result" whose image never reached the registry (its push failed): the list must not be written
    digest = skopeo_digest(f"{pushed['repo']}:smoke-x86_64")
    x86 = dataclasses.replace(smoke_build, digest=digest, pushed_ref=f"{pushed['repo']}@{digest}")
    ghost = "sha256:" + "0" * 64
    arm = dataclasses.replace(smoke_build, platform="linux/arm64", digest=ghost, pushed_ref=f"{pushed['repo']}@{ghost}")
    ref = f"{pushed['repo']}:smoke-ghost"
    with pytest.raises(UserError, match="not in the registry; nothing was published"):
        publish.publish_manifest_list(ref, [x86, arm], ["amd64", "arm64"], eng.choose_builder())
    assert skopeo_raw(ref) is None
    # and a push to a registry that is not there: one error naming the cell
    dead = dataclasses.replace(smoke_build, refs=["127.0.0.1:1/trainbox-dead:smoke-x86_64"])
    docker("tag", smoke_build.image_id, dead.refs[0])
    try:
        with pytest.raises(UserError, match="push of cell smoke-x86_64 to 127.0.0.1:1/trainbox-dead"):
            publish.push_result(dead, eng.choose_builder(), quiet=True)
    finally:
        docker("rmi", dead.refs[0], check=False)


def test_package_change_rebuilds_and_repushes_only_the_last_layer(pushed, tmp_path, test_base):  # noqa: F811
    ctx = eng.snapshot_context(tmp_path / "ctx")
    with open(ctx / "trainbox" / "__init__.py", "a") as f:
        f.write(f"\n# cache test {uuid.uuid4().hex}\n")
    cell = smoke_cells()["x86_64"]
    args = build_args(cell)
    before = json.loads(docker("image", "inspect", f"{pushed['repo']}:smoke-x86_64").stdout)[0]["RootFS"]["Layers"]
    res = eng.build_cell(cell, builder=eng.choose_builder(), context=ctx, registry=pushed["repo"],
                         bases=parse_bases(args.base), wheelhouse=args.wheelhouse, quiet=True)
    after = json.loads(docker("image", "inspect", res.image_id).stdout)[0]["RootFS"]["Layers"]
    # COPY trainbox/ and the steps after it (the --help texts rendered from it, ...) ran; every layer below is
    # reused, the venv's included.
    lines = (ROOT / cell.dockerfile).read_text().splitlines()
    at = lines.index("COPY trainbox/ /opt/trainbox/trainbox/")
    tail = sum(1 for ln in lines[at:] if ln.split(" ", 1)[0] in ("RUN", "COPY", "ADD"))
    assert tail >= 2 and len(after) == len(before) and after[:-tail] == before[:-tail] and after[-tail] != before[-tail]
    assert res.steps - res.cached_steps == tail, (res.steps, res.cached_steps, tail)
    publish.push_result(res, eng.choose_builder(), quiet=True)
    assert res.pushed_layers == tail
    assert 0 < res.pushed_bytes < 1_000_000 < res.size
    assert skopeo_digest(f"{pushed['repo']}:smoke-x86_64") == res.digest


@contextlib.contextmanager
def refusing_registry():
    """A registry that answers the build's reachability check (GET /v2/: 200) and refuses every other request (403:
    denied, which docker does not retry): the push fails after the build, where the tags must be put back. (A closed
    port is refused before anything builds: test_cli_edges.)"""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            ok = self.command == "GET" and self.path.rstrip("/") == "/v2"
            self.send_response(200 if ok else 403)
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            self.send_header("Content-Type", "application/json")
            body = b"{}" if ok else b'{"errors":[{"code":"DENIED","message":"refused by the test"}]}'
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_failed_push_leaves_no_tag(smoke_build, test_base):  # noqa: F811
    """`--push` to a registry that refuses the push: exit 2, one line; every registry-prefixed tag the run made is
    gone and a tag that named another image before the run names it again."""
    with refusing_registry() as port:
        _failed_push_leaves_no_tag(f"127.0.0.1:{port}/trainbox-dead-{uuid.uuid4().hex[:6]}", test_base)


def _failed_push_leaves_no_tag(repo: str, test_base: str) -> None:
    cell = smoke_cells()["x86_64"]
    docker("pull", "-q", test_base)   # another image than the one the run builds
    old = docker("image", "inspect", "--format", "{{.Id}}", test_base).stdout.strip()
    kept = f"{repo}:{cell.version_tags[-1]}"
    docker("tag", old, kept)   # an earlier image under one of the refs this run moves
    try:
        cmd = [sys.executable, "build.py", "--cell", "smoke", "--arch", "x86_64", "--push", "--registry", repo,
               "--quiet", "--base", f"{cell.base_image}={test_base}",
               "--wheelhouse", torch_wheelhouse(cell.requirement("torch")), "--secret", f"id=hf_token,src={secret_file()}"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
        assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and f"push of cell smoke-x86_64 to {repo}:" in err[0] and "Traceback" not in r.stderr
        left = docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}", repo).stdout.split("\n")
        left = [ln for ln in left if ln.strip()]
        assert len(left) == 1 and left[0].startswith(f"{kept} ") and old.split(":")[-1].startswith(left[0].split()[1])
    finally:
        docker("rmi", kept, check=False)
