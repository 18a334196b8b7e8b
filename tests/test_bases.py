"""Bases pinned by digest (issue 20 item 4): locks/bases.toml, the lock step that writes it (skopeo against a real
registry: the engine's local one, since Docker Hub is not reachable here), the rendered FROM images and labels, and
--frozen refusing a base with no digest."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import urllib.request
import uuid

import pytest

from builder import bases, lock, render
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT
from enginefix import docker

CELLS = {c.tag: c for c in load_matrix(ROOT / "matrix.toml").cells}
GPU = sorted(t for t, c in CELLS.items() if c.cuda and not getattr(c, "flavour", None))   # a flavour: FROM our image
LIST_TYPES = ", ".join([*bases.LIST_TYPES, "application/vnd.oci.image.manifest.v1+json",
                        "application/vnd.docker.distribution.manifest.v2+json"])


def _registry_digest(ref: str) -> str:
    """The registry's own Docker-Content-Digest for REF (plain HTTP: the local registry)."""
    host, rest = ref.split("/", 1)
    repo, tag = rest.rsplit(":", 1)
    req = urllib.request.Request(f"http://{host}/v2/{repo}/manifests/{tag}", headers={"Accept": LIST_TYPES})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.headers["Docker-Content-Digest"]


def _copy(src: str, dst: str, *extra: str) -> None:
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false", *extra,
                    f"docker://{src}", f"docker://{dst}"], check=True, capture_output=True, timeout=300)


@pytest.mark.parametrize("tag", GPU)
def test_gpu_dockerfiles_name_their_bases_by_digest(tag):
    cell = CELLS[tag]
    text = render.render(cell)
    digest = bases.digest_for(cell.base_image, cell.platform)
    assert digest, f"{bases.PATH} has no digest for {cell.base_image}"
    assert f"\nARG BASE_IMAGE={cell.base_image}@{digest}\n" in text
    assert f'org.opencontainers.image.base.digest="{digest}"' in text
    if cell.has_compile_stage:
        assert f"\nARG BUILD_IMAGE={cell.build_image}@{bases.digest_for(cell.build_image, cell.platform)}\n" in text
    assert "Not pinned by digest" not in text
    # The tag stays the cell's base name: --base OLD=NEW and [bases] keys still match it.
    assert f'org.opencontainers.image.base.name="{cell.base_image}"' in text


def test_each_arch_pulls_its_own_platform_where_recorded():
    x86, arm = CELLS["cu130-ampere-x86_64"], CELLS["cu130-ampere-aarch64"]
    entry = bases.read()[x86.base_image]
    assert bases.digest_for(x86.base_image, x86.platform) == entry["platforms"]["linux/amd64"]
    assert bases.digest_for(arm.base_image, arm.platform) == entry["platforms"]["linux/arm64"]
    assert entry["platforms"]["linux/amd64"] != entry["platforms"]["linux/arm64"]


def test_cpu_cells_are_not_pinned_and_frozen_still_builds_them():
    smoke = CELLS["smoke-x86_64"]
    assert bases.images(smoke) == [] and "ARG BASE_IMAGE=debian:bookworm\n" in render.render(smoke)
    assert lock.ensure([smoke], root=ROOT, frozen=True) == []


def test_frozen_refuses_a_base_without_digest_unless_substituted(tmp_path):
    cell = CELLS["cu130-blackwell-x86_64"]
    lock.ensure([cell], frozen=True)                                   # committed venv lock + committed digest
    other = dataclasses.replace(cell, base_image="nvidia/cuda:13.0.1-base-ubuntu24.04")   # a tag nobody locked
    assert bases.ref(other.base_image, other) == other.base_image
    assert "# Not pinned by digest: locks/bases.toml has no entry for nvidia/cuda:13.0.1" in render.render(other)
    with pytest.raises(UserError, match=r"--frozen: locks/bases.toml has no digest for nvidia/cuda:13.0.1-base"):
        lock.ensure([other], frozen=True)
    assert lock.ensure([other], frozen=True, bases={other.base_image: "127.0.0.1:5/x:y"}) == []


def test_a_bad_bases_lock_is_one_clear_error(tmp_path):
    (tmp_path / "locks").mkdir()
    (tmp_path / bases.PATH).write_text('["nvidia/cuda:x"]\ndigest = "sha256:abc"\n')
    with pytest.raises(UserError, match="has no valid sha256 digest"):
        bases.read(tmp_path)


def test_an_unreachable_registry_is_one_line_and_writes_nothing(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "build.py"), "--lock-bases", "--cuda", "13.0", "--output-dir",
                        str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    if p.returncode == 0:
        pytest.skip("this machine reaches Docker Hub: the lock was made")   # not here: nothing can be pulled
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "cannot lock base nvidia/cuda:" in p.stderr and "--lock-bases" in p.stderr
    assert not any(tmp_path.rglob("*"))


@pytest.mark.engine
def test_lock_bases_against_a_real_registry(registry, test_base, tmp_path):  # noqa: F811
    """A multi-arch image under a name of its own in the engine's registry: locked by the registry's digest with
    each platform's; the engine pulls the pinned ref; moving the tag changes the lock."""
    ref = f"{registry}/trainbox-baselock-{uuid.uuid4().hex[:8]}:v1"
    _copy(test_base, ref, "--all")
    cell = dataclasses.replace(CELLS["cu130-blackwell-x86_64"], base_image=ref)
    assert bases.lock_bases([cell], root=tmp_path, quiet=True) == 0
    entry = bases.read(tmp_path)[ref]
    assert entry["digest"] == _registry_digest(ref)
    assert set(entry["platforms"]) >= {"linux/amd64", "linux/arm64"}
    pinned = bases.ref(ref, cell, tmp_path)
    assert pinned == f"{ref}@{entry['platforms']['linux/amd64']}"
    docker("pull", "--platform", "linux/amd64", pinned)
    arch = docker("image", "inspect", "--format", "{{.Architecture}}", pinned).stdout.strip()
    assert arch == "amd64"
    bases.check_frozen([cell], tmp_path)
    before = (tmp_path / bases.PATH).read_text()

    # The tag moves (now one platform only): the re-lock is a visible change, the old digest is gone.
    _copy(test_base, ref, "--override-arch", "amd64", "--override-os", "linux")
    bases.lock_bases([cell], root=tmp_path, quiet=True)
    moved = bases.read(tmp_path)[ref]
    assert moved["digest"] == _registry_digest(ref) != entry["digest"]
    assert "platforms" not in moved and bases.ref(ref, cell, tmp_path) == f"{ref}@{moved['digest']}"
    assert (tmp_path / bases.PATH).read_text() != before
    manifest = json.loads(subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"],
                                         capture_output=True, check=True).stdout)
    assert "manifests" not in manifest


@pytest.mark.engine
def test_a_substituted_base_gives_the_venv_stage_its_host_platform_only_where_it_serves_it(registry, test_base):  # noqa: F811
    """bases.platforms asks the registry; an emulated build's venv stage goes on host-base (the substitute at this
    host's platform) only where the substitute serves that platform: a one-arch base of the target's arch keeps the
    venv stage on `base` (under QEMU: slower, but FROM an image that exists), as a name the registry does not know."""
    from builder import engine

    target = "arm64" if engine.host_arch() == "x86_64" else "amd64"
    multi = f"{registry}/trainbox-hostbase-{uuid.uuid4().hex[:8]}:multi"
    one = multi.replace(":multi", f":{target}")
    _copy(test_base, multi, "--all")
    _copy(test_base, one, "--override-arch", target, "--override-os", "linux")
    assert {"linux/amd64", "linux/arm64"} <= bases.platforms(multi)
    assert f"linux/{target}" in bases.platforms(one) and len({n.split("/")[1] for n in bases.platforms(one)}) == 1
    assert bases.platforms(multi.replace(":multi", ":absent")) is None
    cell = next(c for c in CELLS.values() if c.arch != engine.host_arch() and not getattr(c, "flavour", None))
    args = {ref: engine.cell_build_args(cell, bases={cell.base_image: ref})
            for ref in (multi, one, multi.replace(":multi", ":absent"))}
    assert args[multi]["VENV_BASE"] == "host-base" and args[multi]["HOST_BASE_IMAGE"] == multi
    for ref in (one, multi.replace(":multi", ":absent")):
        assert args[ref]["BASE_IMAGE"] == ref and "VENV_BASE" not in args[ref], ref
